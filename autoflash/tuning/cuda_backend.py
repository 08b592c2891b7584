"""The real backend, run inside a worker process on one GPU: check a candidate against the reference
on a small problem (a wrong result fails the trial, with its error size), then time it with CUDA
events on the key's representative shapes: warm-up, L2 flushed before every repetition, median of
the repetitions. Each shape runs as the key's Workload (ProblemKey.workload): a window key with its
sliding window, bottom-right aligned; a packed key with cu_seqlens. Any CUDA error here kills at most
this worker, never the study. Decode keys are
measured by cuda_decode.py."""
from __future__ import annotations

import sys

from autoflash.kernels.config import KernelConfig
from autoflash.tuning.problem import SDPA_UNSUPPORTED, ProblemKey, Shape, Workload

# The correctness problem: lengths that are no multiple of any tile, two heads sharing one K/V head.
# A window key runs it with its window (left 64 at 257); a packed key packs CHECK_TOKENS tokens as
# sequences of random lengths up to CHECK_SEQLEN (a few sequences, most no multiple of a tile).
CHECK_BATCH, CHECK_HEADS, CHECK_KV_HEADS, CHECK_SEQLEN = 1, 2, 1, 257
CHECK_TOKENS = 3 * CHECK_SEQLEN


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
        self._cu_seqlens: dict[Workload, object] = {}
        self._decode: dict = {}  # (dtype, DecodeWorkload) -> its tensors (cuda_decode.decode_tensors)
        self.device = "cuda"  # where inputs are made ("cpu" under autoflash.emulate(), for tests)
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
    def _tensors(self, key: ProblemKey, workload: Workload, kv_heads: int | None = None) -> tuple:
        """q, k, v, dout of a workload, created once per (dtype, workload, kv heads) and reused across
        trials: dense (batch, heads, seqlen, d), or packed (total, heads, d) for packed sequences."""
        from autoflash.kernels.checks import TORCH_DTYPES

        cache_key = (key.dtype, workload, kv_heads)
        if cache_key not in self._inputs:
            h, d = workload.heads, workload.head_dim
            dt = TORCH_DTYPES[key.dtype]
            gen = self.torch.Generator(device=self.device).manual_seed(0)
            rows = (workload.tokens,) if workload.packed else (len(workload.lengths), workload.max_seqlen)

            def mk(heads):
                shape = (*rows, heads, d) if workload.packed else (rows[0], heads, rows[1], d)
                return self.torch.randn(*shape, device=self.device, dtype=dt, generator=gen)

            self._inputs[cache_key] = (mk(h), mk(kv_heads or h), mk(kv_heads or h), mk(h))
        return self._inputs[cache_key]

    def _variant_args(self, workload: Workload) -> dict:
        """The launcher's keywords for a workload: causal, align, window, and for packed sequences
        cu_seqlens (int32, made once per workload) with max_seqlen, queries and keys alike."""
        kw = workload.launch_options()
        if workload.packed:
            if workload not in self._cu_seqlens:
                starts = [0]
                for n in workload.lengths:
                    starts.append(starts[-1] + n)
                self._cu_seqlens[workload] = self.torch.tensor(starts, dtype=self.torch.int32,
                                                                 device=self.device)
            cu = self._cu_seqlens[workload]
            kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=workload.max_seqlen,
                      max_seqlen_k=workload.max_seqlen)
        return kw

    def _calls(self, key: ProblemKey, config: KernelConfig, tensors, variant_args: dict):
        """The timed callable of a config: the forward, or the backward on a saved forward, both with
        the workload's variant keywords (the launcher turns their switches on the config)."""
        from autoflash.kernels.launch import flash_backward, flash_forward

        q, k, v, dout = tensors
        if key.direction == "fwd":
            return lambda: flash_forward(q, k, v, config=config, **variant_args)
        out, lse = flash_forward(q, k, v, **variant_args)
        return lambda: flash_backward(dout, q, k, v, out, lse, config=config, **variant_args)

    def _references(self, key: ProblemKey, workload: Workload, tensors, variant_args: dict) -> tuple[list, list]:
        """(accurate, same-dtype) reference results, out or (dq, dk, dv): the dense references with
        the workload's causal / align / window, or for packed sequences attention_varlen_ref (its
        gradients by autograd, as attention_backward_ref takes them from attention_ref)."""
        from autoflash.reference.backward import attention_backward_ref
        from autoflash.reference.forward import attention_ref, attention_varlen_ref

        torch = self.torch
        q, k, v, dout = tensors
        opts = workload.launch_options()
        hi = (lambda t: t.double()) if q.dtype == torch.float32 else (lambda t: t)
        if workload.packed:
            cu = (variant_args["cu_seqlens_q"], variant_args["cu_seqlens_k"])
            if key.direction == "fwd":
                return [attention_varlen_ref(q, k, v, *cu, upcast=up, **opts)[0] for up in (True, False)]
            return [_varlen_grads(q, k, v, dout, cu, upcast=up, **opts) for up in (True, False)]
        if key.direction == "fwd":
            return [attention_ref(hi(q), hi(k), hi(v), **opts)[0], attention_ref(q, k, v, upcast=False, **opts)[0]]
        return [attention_backward_ref(hi(q), hi(k), hi(v), hi(dout), **opts),
                attention_backward_ref(q, k, v, dout, upcast=False, **opts)]

    def _check(self, key: ProblemKey, config: KernelConfig) -> dict | None:
        """None when the config's result satisfies FlashAttention-3's rule against the reference on the
        check problem (the key's variant included: its window, or packed sequences of random
        lengths up to CHECK_SEQLEN), else a "wrong" result."""
        from autoflash.reference.forward import within_tolerance

        shape = Shape(CHECK_BATCH, CHECK_HEADS, CHECK_SEQLEN, key.head_dim)
        workload = key.workload(shape, tokens=CHECK_TOKENS)
        tensors = self._tensors(key, workload, CHECK_KV_HEADS)
        args = self._variant_args(workload)
        got = self._calls(key, config, tensors, args)()
        ref, low = self._references(key, workload, tensors, args)
        if key.direction == "fwd":
            pairs = {"out": (got[0], ref, low)}
        else:
            pairs = {n: (g, r, t) for n, g, r, t in zip(("dq", "dk", "dv"), got, ref, low)}
        for name, (g, r, t) in pairs.items():
            ok, err, bound = within_tolerance(g, r, t, backward=name != "out")
            if not ok:
                where = (f"{len(workload.lengths)} packed sequences of {workload.tokens} tokens" if workload.packed
                         else f"batch {shape.batch}, seqlen {shape.seqlen}")
                return {"status": "wrong", "err": err, "bound": bound,
                        "reason": f"{name}: max error {err:.4g} > bound {bound:.4g} (FlashAttention-3's "
                                  f"rule) at {where}, heads {shape.heads}/{CHECK_KV_HEADS}"
                                  + (f", window {workload.window}" if workload.window != (-1, -1) else "")}
        return None

    # ---------------------------------------------------------------- protocol
    def measure(self, key: ProblemKey, config: KernelConfig, shapes: list[Shape], registers: int | None,
                trial: int | None = None, reps: int = 20, warmup: int = 3) -> dict:
        """Check, then time `config` (a decode key's: a space.DecodePoint) on the key's shapes."""
        from autoflash.bench.timing import flush_buffer, time_cuda

        if self._flush is None:
            self._flush = flush_buffer(self.torch)
        if key.is_decode:
            from autoflash.tuning.cuda_decode import measure_decode

            return measure_decode(self, key, config, shapes, reps, warmup)
        wrong = self._check(key, config)
        if wrong is not None:
            return wrong
        if self._flush is None:
            self._flush = flush_buffer(self.torch)
        ms = []
        with self.torch.no_grad():
            for s in shapes:
                w = key.workload(s)
                fn = self._calls(key, config, self._tensors(key, w), self._variant_args(w))
                ms.append(time_cuda(self.torch, fn, reps=reps, warmup=warmup, flush=self._flush)["ms_median"])
        return {"status": "ok", "ms": ms}

    def baseline(self, key: ProblemKey, shapes: list[Shape], reps: int = 20, warmup: int = 3) -> dict:
        """SDPA's FlashAttention backend on the same shapes (forward, or backward on a saved graph);
        "unsupported" for a variant key (SDPA_UNSUPPORTED says why); a decode key's: cuda_decode."""
        if key.is_decode:
            from autoflash.bench.timing import flush_buffer

            if self._flush is None:
                self._flush = flush_buffer(self.torch)
            from autoflash.tuning.cuda_decode import baseline_decode

            return baseline_decode(self, key, shapes, reps, warmup)
        if key.variant != "plain":
            return {"status": "unsupported", "reason": SDPA_UNSUPPORTED[key.variant]}
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
                    q, k, v, dout = self._tensors(key, key.workload(s))
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


def _varlen_grads(q, k, v, dout, cu_seqlens: tuple, *, upcast: bool, **options) -> tuple:
    """(dq, dk, dv) of attention_varlen_ref's out for `dout`, by autograd on leaves in the compute
    dtype (fp32 for 16-bit inputs when upcast, else the input dtype), as attention_backward_ref does."""
    import torch

    from autoflash.reference.forward import attention_varlen_ref

    dtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out, _ = attention_varlen_ref(*leaves, *cu_seqlens, upcast=upcast, **options)
        return torch.autograd.grad(out, leaves, grad_outputs=dout.detach().to(out.dtype))
