"""Timing on a GPU, shared by the benchmark and the tuner: CUDA events around the call only, after
warm-up, with the L2 cache flushed before every repetition (torch is passed in, imported lazily)."""
from __future__ import annotations

from autoflash.bench.report import summarize

FLUSH_BYTES = 256 << 20  # written before every timed call: larger than any L2 (x4 L2 if that is more)


def flush_buffer(torch, device: str = "cuda"):
    """A buffer whose zeroing evicts the inputs and outputs of the previous call from L2."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return torch.empty(max(FLUSH_BYTES, 4 * l2), dtype=torch.int8, device=device)


def time_cuda(torch, fn, *, reps: int, warmup: int, flush) -> dict:
    """{"ms_median", "ms_min", "ms_max"} of `reps` timed calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()  # evict q, k, v and the output from L2
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in events])
