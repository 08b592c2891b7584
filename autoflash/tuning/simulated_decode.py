"""The simulated backend's cost model for decode keys: a plausibility model of a memory-bound KV-cache
kernel, not a prediction (see simulated.py). A call reads the K + V bytes of its caches; how fast
depends on how many SMs have blocks (batch x K/V heads x query blocks x splits), how many bytes
each SM keeps in flight (Little's law: tiles in flight x stages, capped by the warps issuing the
loads), wave quantisation, the tensor-core work padded up to block_m rows, and, when split, the
fp32 partials written and merged by the combine kernel. Enough for the search to face the real
trade-offs (splits fill the SMs but cost a combine; wide tiles keep more bytes in flight but fit
fewer blocks), with +-3% deterministic jitter per (point, shape)."""
from __future__ import annotations

import math

from autoflash.kernels.gpus import GpuProfile
from autoflash.tuning.decode import DecodeWorkload

LAUNCH_US = 4.0  # fixed cost of one launch, microseconds (as simulated.LAUNCH_US)
MEMORY_LATENCY_US = 1.0  # HBM round trip a load waits: bytes in flight / latency = bandwidth (a round figure)
SM_SHARE_MAX = 2.5  # one SM draws at most this many times its even share of HBM bandwidth (a guess)
WARP_BYTES_IN_FLIGHT = 8 * 1024  # 32 threads x 16 B cp.async x 16 outstanding: what one warp can have pending
SUSTAINED = 0.9  # share of the datasheet bandwidth a streaming read reaches (copy kernels reach ~90%)


def decode_model_ms(config, num_splits: int, w: DecodeWorkload, profile: GpuProfile,
                    registers: int | None = None, jitter: float = 0.0) -> float:
    """Modelled milliseconds of flash_decode(num_splits=num_splits, config=config) on workload w
    (config: the unsplit KV-cache KernelConfig; num_splits 0 = choose_num_splits, as flash_decode)."""
    from autoflash.kernels.decode import MAX_SPLITS, choose_num_splits
    from autoflash.tuning.simulated import estimated_registers

    group = w.heads // w.heads_kv
    heads, rows = (w.heads_kv, w.seqlen_q * group) if group > 1 else (w.heads, w.seqlen_q)  # GQA rows folded
    m_blocks = math.ceil(rows / config.block_m)
    key_tiles = math.ceil(w.cache_len / config.block_n)
    splits = num_splits or choose_num_splits(w.batch * heads * m_blocks, profile.sm_count, key_tiles)
    splits = max(1, min(splits, MAX_SPLITS, key_tiles))
    blocks = w.batch * heads * m_blocks * splits

    regs = registers or estimated_registers(config)
    per_sm = max(1, min(profile.smem_per_sm // max(config.smem_bytes, 1), profile.regs_per_sm // (regs * config.threads),
                        profile.max_threads_per_sm // config.threads, 32))
    slots = profile.sm_count * per_sm
    waves = math.ceil(blocks / slots)
    resident = min(per_sm, math.ceil(blocks / profile.sm_count))  # blocks an SM holds in the first wave
    active = min(profile.sm_count, blocks)
    tile_bytes = 2 * config.block_n * config.head_dim * 2  # one K and one V tile, 16-bit
    in_flight = resident * min(config.num_stages * tile_bytes, config.num_stages * config.num_warps * WARP_BYTES_IN_FLIGHT)
    hbm = (profile.mem_bandwidth_gbs or 1000.0) * 1e9 * SUSTAINED  # bytes/s
    per_sm_bw = min(in_flight / (MEMORY_LATENCY_US * 1e-6), SM_SHARE_MAX * hbm / profile.sm_count)
    bandwidth = min(hbm, active * per_sm_bw) * (blocks / (waves * min(blocks, slots)))
    read = w.kv_bytes * key_tiles * config.block_n / w.cache_len  # the last tile's loads are whole rows too
    t_mem = read / bandwidth

    peak = (profile.peak_tflops_bf16 or 100.0) * 1e12 * 0.5  # mma.sync decode kernels: half the peak at best
    padded = 4.0 * w.batch * heads * m_blocks * config.block_m * w.cache_len * w.head_dim
    t_math = padded / peak
    seconds = max(t_mem, t_math) + LAUNCH_US * 1e-6
    if splits > 1:  # fp32 partial O and LSE written, then read back by the combine kernel
        partials = splits * w.batch * heads * rows * (w.head_dim + 1) * 4
        seconds += 2 * partials / hbm + LAUNCH_US * 1e-6
    return seconds * 1e3 * (1 + 0.03 * jitter)


def sdpa_decode_model_ms(default_config, w: DecodeWorkload, profile: GpuProfile) -> float:
    """A stand-in for SDPA on a decode call: the built-in kernel unsplit (SDPA's kernels do not split
    the keys of one query block), 10% slower (it reads the cache per query head group as it is)."""
    return 1.1 * decode_model_ms(default_config, 1, w, profile)
