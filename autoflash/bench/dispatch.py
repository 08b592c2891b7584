"""Dispatch overhead: the host time autoflash.attention adds to a call, beside torch SDPA's own.

    python -m autoflash.bench dispatch            # what this machine can measure
    python -m autoflash.bench dispatch --json out.json

Every row is the median over --rounds rounds of --calls back-to-back calls, in microseconds per call,
caches warm (first calls untimed). Inputs: (1, 1, 128, 64) bf16, causal: launch-bound, so the host
time per call is what is measured.

On any machine:
  sdpa (cpu)          torch SDPA on CPU tensors: its checks, dispatch and a tiny computation, for scale
  plan                autoflash's validation and path decision (planned as on a GPU): a repeated call,
                      served by the plan cache (keyed on shapes, strides, dtypes, devices, flags)
  plan (new call)     the same for a signature not seen before: the cache emptied before each call
  select_config       the config lookup the op does on a GPU (tuned table or heuristic), cached
  custom op (meta)    torch.ops.autoflash.attention_fwd on meta tensors: the op's dispatch and its fake
                      implementation's two allocations (no data, no kernel)
  sm90 maps (new)     the four TMA maps of an sm90 forward (Q, K, V, O of (2, 16, 4096, 128) bf16, the
                      H100 default's boxes) built and checked from the tensors: what every launch paid
                      before the cache, and what a call on tensors not seen before pays
  sm90 maps (cached)  the same four served by the cache keyed by what they encode (address, shape,
                      strides, dtype, box, swizzle), as a launch on CUDA tensors looks them up (the
                      driver's encoding of each is cached beside it: tensor_map.py)
On a CUDA GPU, also, synchronised once per round:
  sdpa (cuda)         torch SDPA, whichever backend it picks
  autoflash (cuda)    autoflash.attention, through to the kernel launch
The target (issue: dispatcher) is autoflash's per-call host overhead with warm caches <= 20 us; it is
judged on the GPU rows. Without a GPU the script reports plan + select_config (autoflash's own Python
before the op) and leaves the verdict to a GPU run. plan + select_config has a target of its own
(issue: FA2-class tiling, item 4), <= 5 us: reported on every machine, not reflected in the exit status
(a CPU's speed is not the code's).
"""
import argparse
import json
import statistics
import time
import warnings
from pathlib import Path


def _per_call_us(fn, calls: int, rounds: int, sync=None) -> float:
    for _ in range(max(10, calls // 10)):  # warm: caches, lazy imports, the op's first dispatch
        fn()
    if sync:
        sync()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync:
            sync()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def measure(gpu: str, calls: int, rounds: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from autoflash.dispatch import ops  # noqa: F401  (registers torch.ops.autoflash)
    from autoflash.dispatch import sdpa as dispatch
    from autoflash.kernels.gpus import get_profile
    from autoflash.dispatch.selection import select_config

    rows = []
    q, k, v = (torch.randn(1, 1, 128, 64, dtype=torch.bfloat16) for _ in range(3))
    rows.append({"what": "sdpa (cpu)", "us": _per_call_us(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), calls, rounds)})
    rows.append({"what": "plan", "us": _per_call_us(
        lambda: dispatch.plan(q, k, v, is_causal=True, device_check=False), calls, rounds)})
    clear = _per_call_us(dispatch.clear_plan_cache, calls, rounds)
    rows.append({"what": "plan (new call)", "us": _per_call_us(
        lambda: (dispatch.clear_plan_cache(), dispatch.plan(q, k, v, is_causal=True, device_check=False)),
        calls, rounds) - clear, "note": "validation and decision, uncached"})
    profile = get_profile(gpu)
    rows.append({"what": "select_config", "us": _per_call_us(
        lambda: select_config(profile, "fwd", "bf16", 64, True, 128), calls, rounds), "note": f"for {profile.name}"})
    qm, km, vm = (t.to("meta") for t in (q, k, v))
    rows.append({"what": "custom op (meta)", "us": _per_call_us(
        lambda: torch.ops.autoflash.attention_fwd(qm, km, vm, True, 0.125), calls, rounds)})
    meta_alloc = _per_call_us(lambda: torch.empty_like(qm), calls, rounds)
    rows[-1]["note"] = f"of which allocating on meta ~{2 * meta_alloc:.1f} us (2 x torch.empty_like)"
    rows += _map_rows(calls, rounds)

    if torch.cuda.is_available():
        sync = torch.cuda.synchronize
        q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        rows.append({"what": "sdpa (cuda)", "us": _per_call_us(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), calls, rounds, sync)})
        with warnings.catch_warnings():
            warnings.simplefilter("error", dispatch.FallbackWarning)  # time the kernels, not a fallback
            rows.append({"what": "autoflash (cuda)", "us": _per_call_us(
                lambda: dispatch.attention(q, k, v, is_causal=True), calls, rounds, sync)})
        rows[-1]["note"] = rows[-2]["note"] = f"{torch.cuda.get_device_name()}, (1, 1, 128, 64) bf16 causal"
    return rows


def _map_rows(calls: int, rounds: int) -> list[dict]:
    import torch

    from autoflash.kernels import tensor_map
    from autoflash.kernels.defaults import default_config
    from autoflash.kernels.gpus import get_profile

    config = default_config(128, "bf16", False, get_profile("h100"), family="sm90")
    span = config.swizzle_span
    tiles = [(torch.empty(2, 16, 4096, 128, dtype=torch.bfloat16), rows) for rows in (64, config.block_n, config.block_n, 64)]
    fields = [(t.dtype, t.data_ptr(), tuple(t.shape), t.stride(), (1, 1, rows, span // 2), span) for t, rows in tiles]
    new = _per_call_us(lambda: [tensor_map._map(*f, None) for f in fields], calls, rounds)
    # the key built from the tensors on every call, as for_tensor does for CUDA tensors
    cached = _per_call_us(lambda: [tensor_map.cached_map(t.dtype, t.data_ptr(), tuple(t.shape), t.stride(),
                                                         (1, 1, rows, span // 2), span) for t, rows in tiles],
                          calls, rounds)
    note = f"{config.name}: 4 maps"
    return [{"what": "sm90 maps (new)", "us": new, "note": note},
            {"what": "sm90 maps (cached)", "us": cached, "note": note + ", a repeated call's"}]


def overhead_us(rows: list[dict]) -> tuple[float, str, bool]:
    """(autoflash's per-call host overhead, what it covers, whether it is the full call). On a GPU:
    autoflash.attention through the launch. Without one: plan + select_config only."""
    us = {r["what"]: r["us"] for r in rows}
    if "autoflash (cuda)" in us:
        return us["autoflash (cuda)"], "autoflash.attention per call on the GPU, through the launch", True
    return us["plan"] + us["select_config"], "plan + select_config only: no GPU here for the launch", False


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autoflash.bench dispatch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="h100", help="profile the meta-tensor rows plan for (default h100)")
    p.add_argument("--calls", type=int, default=2000, help="calls per round (default 2000)")
    p.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported (default 7)")
    p.add_argument("--target-us", type=float, default=20.0, help="the overhead target (default 20 us)")
    p.add_argument("--plan-target-us", type=float, default=5.0,
                   help="the plan + select_config target, reported only (default 5 us)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows and settings here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error(f"--calls/--rounds: got {args.calls}/{args.rounds}, expected >= 1")
    try:
        rows = measure(args.gpu, args.calls, args.rounds)
    except ValueError as e:  # an unknown --gpu
        parser.error(str(e))
    for r in rows:
        print(f"{r['what']:<18} {r['us']:8.2f} us/call  {r.get('note', '')}")
    planning = sum(r["us"] for r in rows if r["what"] in ("plan", "select_config"))
    print(f"plan + select_config: {planning:.2f} us/call: {'meets' if planning <= args.plan_target_us else 'MISSES'} "
          f"the {args.plan_target_us:g} us target (host time on this machine)")
    total, how, full = overhead_us(rows)
    if full:
        verdict = "meets" if total <= args.target_us else "MISSES"
        print(f"autoflash overhead: {total:.2f} us/call ({how}): {verdict} the {args.target_us:g} us target")
    else:
        print(f"autoflash overhead before the op: {total:.2f} us/call ({how}); the {args.target_us:g} us target "
              "is judged on a GPU run")
    if args.json:
        import platform

        import torch

        args.json.write_text(json.dumps({"command": " ".join(["python", "-m", "autoflash.bench", "dispatch",
                                                              *(argv or [])]),
                                         "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
                                         "cpu": platform.processor() or platform.machine(), "rows": rows,
                                         "overhead_us": total, "overhead_is": how}, indent=1) + "\n")
    return 1 if full and total > args.target_us else 0
