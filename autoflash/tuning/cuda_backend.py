"""The real backend, run inside a worker process on one GPU: check a candidate against the reference
on a small problem (a wrong result fails the trial, with its error size), then time it with CUDA
events on the key's representative shapes: warm-up, L2 flushed before every repetition, median of
the repetitions. Any CUDA error here kills at most this worker, never the study."""
from __future__ import annotations

import sys

from autoflash.kernels.config import KernelConfig
from autoflash.tuning.problem import ProblemKey, Shape

# The correctness problem: lengths that are no multiple of any tile, two heads sharing one K/V head.
CHECK_BATCH, CHECK_HEADS, CHECK_KV_HEADS, CHECK_SEQLEN = 1, 2, 1, 257


class CudaBackend:
    def __init__(self, gpu: str):
        import torch

        from autoflash.kernels.gpus import detect

        if not torch.cuda.is_available():
            raise RuntimeError(f"no CUDA device visible (torch {torch.__version__}, CUDA {torch.version.cuda}); "
                               f"measuring for {gpu!r} needs that GPU; --dry-run works without one")
        self.torch = torch
        self.profile = detect()
        if self.profile.name != gpu:
            raise RuntimeError(f"--gpu {gpu} but the visible device is {torch.cuda.get_device_name()} "
                               f"(profile {self.profile.name!r}); tune on the GPU you name, or name this one")
        self._inputs: dict[tuple, tuple] = {}
        self._flush = None

    def describe(self) -> dict:
        torch = self.torch

        def attempt(f):
            try:
                return str(f())
            except Exception as e:  # provenance says why a field is missing instead of failing the tune
                return f"unavailable ({type(e).__name__}: {e})"

        def driver():
            import cupy
            v = cupy.cuda.runtime.driverGetVersion()
            return f"{v // 1000}.{v % 1000 // 10}"

        cc = torch.cuda.get_device_capability()
        return {"device_name": torch.cuda.get_device_name(), "compute_capability": f"{cc[0]}.{cc[1]}",
                "profile": self.profile.name, "driver": attempt(driver), "cuda": torch.version.cuda,
                "torch": torch.__version__, "cupy": attempt(lambda: __import__("cupy").__version__),
                "python": sys.version.split()[0]}

    # ---------------------------------------------------------------- helpers
    def _tensors(self, key: ProblemKey, shape: tuple[int, int, int, int], kv_heads: int | None = None) -> tuple:
        """q, k, v, dout of a shape, created once per (dtype, shape) and reused across trials."""
        from autoflash.kernels.checks import TORCH_DTYPES

        cache_key = (key.dtype, shape, kv_heads)
        if cache_key not in self._inputs:
            b, h, s, d = shape
            dt = TORCH_DTYPES[key.dtype]
            gen = self.torch.Generator(device="cuda").manual_seed(0)
            mk = (lambda heads: self.torch.randn(b, heads, s, d, device="cuda", dtype=dt, generator=gen))
            self._inputs[cache_key] = (mk(h), mk(kv_heads or h), mk(kv_heads or h), mk(h))
        return self._inputs[cache_key]

    def _calls(self, key: ProblemKey, config: KernelConfig, tensors):
        """The timed callable of a config: the forward, or the backward on a saved forward."""
        from autoflash.kernels.launch import flash_backward, flash_forward

        q, k, v, dout = tensors
        c = key.causal
        if key.direction == "fwd":
            return lambda: flash_forward(q, k, v, causal=c, config=config)
        out, lse = flash_forward(q, k, v, causal=c)
        return lambda: flash_backward(dout, q, k, v, out, lse, causal=c, config=config)

    def _check(self, key: ProblemKey, config: KernelConfig) -> dict | None:
        """None when the config's result satisfies FlashAttention's rule, else a "wrong" result."""
        from autoflash.reference.forward import attention_ref, within_tolerance
        from autoflash.reference.backward import attention_backward_ref

        torch = self.torch
        shape = (CHECK_BATCH, CHECK_HEADS, CHECK_SEQLEN, key.head_dim)
        q, k, v, dout = self._tensors(key, shape, CHECK_KV_HEADS)
        hi = (lambda t: t.double()) if q.dtype == torch.float32 else (lambda t: t)
        got = self._calls(key, config, (q, k, v, dout))()
        if key.direction == "fwd":
            pairs = {"out": (got[0], attention_ref(hi(q), hi(k), hi(v), causal=key.causal)[0],
                             attention_ref(q, k, v, causal=key.causal, upcast=False)[0])}
            factor = 2.0
        else:
            ref = attention_backward_ref(hi(q), hi(k), hi(v), hi(dout), causal=key.causal)
            low = attention_backward_ref(q, k, v, dout, causal=key.causal, upcast=False)
            pairs = {n: (g, r, t) for n, g, r, t in zip(("dq", "dk", "dv"), got, ref, low)}
            factor = 3.0
        for name, (g, r, t) in pairs.items():
            ok, err, bound = within_tolerance(g, r, t, factor=factor)
            if not ok:
                return {"status": "wrong", "err": err, "bound": bound,
                        "reason": f"{name}: max error {err:.4g} > bound {bound:.4g} (FlashAttention's rule, "
                                  f"factor {factor:g}) at batch {shape[0]}, heads {shape[1]}/{CHECK_KV_HEADS}, "
                                  f"seqlen {shape[2]}"}
        return None

    # ---------------------------------------------------------------- protocol
    def measure(self, key: ProblemKey, config: KernelConfig, shapes: list[Shape], registers: int | None,
                trial: int | None = None, reps: int = 20, warmup: int = 3) -> dict:
        from autoflash.bench.timing import flush_buffer, time_cuda

        wrong = self._check(key, config)
        if wrong is not None:
            return wrong
        if self._flush is None:
            self._flush = flush_buffer(self.torch)
        ms = []
        with self.torch.no_grad():
            for s in shapes:
                fn = self._calls(key, config, self._tensors(key, (s.batch, s.heads, s.seqlen, s.head_dim)))
                ms.append(time_cuda(self.torch, fn, reps=reps, warmup=warmup, flush=self._flush)["ms_median"])
        return {"status": "ok", "ms": ms}

    def baseline(self, key: ProblemKey, shapes: list[Shape], reps: int = 20, warmup: int = 3) -> dict:
        """SDPA's FlashAttention backend on the same shapes (forward, or backward on a saved graph)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        from autoflash.bench.timing import flush_buffer, time_cuda

        torch = self.torch
        if self._flush is None:
            self._flush = flush_buffer(torch)
        ms = []
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                for s in shapes:
                    q, k, v, dout = self._tensors(key, (s.batch, s.heads, s.seqlen, s.head_dim))
                    if key.direction == "fwd":
                        def fn():
                            return sdpa(q, k, v, is_causal=key.causal)
                    else:
                        leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
                        with torch.enable_grad():
                            saved = sdpa(*leaves, is_causal=key.causal)

                        def fn():
                            return torch.autograd.grad(saved, leaves, dout, retain_graph=True)
                    ms.append(time_cuda(torch, fn, reps=reps, warmup=warmup, flush=self._flush)["ms_median"])
        except RuntimeError as e:  # "No available kernel": this torch's flash backend refuses the key
            return {"status": "unsupported", "reason": str(e).strip().splitlines()[0]}
        return {"status": "ok", "ms": ms}
