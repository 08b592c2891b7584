"""First calls on a real Hopper GPU: each case runs autoflash against the fp32 reference under
FA3's rule and prints the kernel that ran. One case's failure does not stop the others (but an
illegal address poisons the process's context: every later case then fails the same way)."""
import math, sys, time, traceback
import torch
import autoflash
from autoflash.reference.forward import attention_ref, within_tolerance
from autoflash.reference.kvcache import attention_kvcache_ref

torch.manual_seed(0)
dev = "cuda"
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "emulated h100", "torch", torch.__version__)
from autoflash.kernels import compiler
print("nvrtc", compiler.nvrtc_version(), "templates", compiler.template_hash()[:12] if hasattr(compiler, "template_hash") else "?")
results = []
EMU = not torch.cuda.is_available()  # a check of this script itself on the emulator, at small sizes
if EMU:
    dev = "cpu"
    _EMULATION = autoflash.emulate("h100")
    _EMULATION.__enter__()
N = (lambda n: max(1, n // 14)) if EMU else (lambda n: n)


def names(plan):
    sels = [s for s in (plan.forward, plan.backward) if s is not None]
    return " + ".join(s.config.name for s in sels) or plan.reason


def case(name):
    def wrap(fn):
        t = time.time()
        try:
            ok, info = fn()
            status = "PASS" if ok else "FAIL"
        except Exception as e:  # noqa: BLE001 -- the smoke run reports every failure and goes on
            status, info = "ERROR", f"{type(e).__name__}: {str(e)[:600]}"
            traceback.print_exc()
        torch.cuda.synchronize() if not EMU else None
        print(f"{status:5} {name} ({time.time() - t:.1f} s): {info}", flush=True)
        results.append((name, status))
        return fn
    return wrap


def rnd(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=dev, dtype=dtype)


def dense(d, dtype, causal, lq=None, lk=None, hq=8, hkv=8, backward=True, dv=None, **variant):
    lq, lk = N(lq or 1000), N(lk or 1000)
    q = rnd(2, hq, lq, d, dtype=dtype).requires_grad_()
    k = rnd(2, hkv, lk, d, dtype=dtype).requires_grad_()
    v = rnd(2, hkv, lk, dv or d, dtype=dtype).requires_grad_()
    fa = lambda x: x.transpose(1, 2)
    kw = dict(causal=causal, **variant)
    plan = autoflash.explain(autoflash.flash_attn_func, fa(q), fa(k), fa(v), **kw)
    out = autoflash.flash_attn_func(fa(q), fa(k), fa(v), strict=True, **kw)
    out = fa(out)
    rkw = dict(causal=causal, align="bottom_right", window=variant.get("window_size", (-1, -1)),
               softcap=variant.get("softcap", 0.0))
    ref, _ = attention_ref(q, k, v, **rkw)
    pt, _ = attention_ref(q, k, v, upcast=False, **rkw)
    ok, e, bound = within_tolerance(out, ref, pt, softcap=rkw["softcap"])
    info = f"fwd err {e:.2e} <= {bound:.2e}"
    if ok and backward:
        g = torch.randn_like(out)
        ga = torch.autograd.grad(out, (q, k, v), g)
        gr = torch.autograd.grad(ref, (q, k, v), g.float())
        gt = torch.autograd.grad(pt, (q, k, v), g)
        for nm, x, r, t in zip("qkv", ga, gr, gt):
            okx, ex, bx = within_tolerance(x, r, t, softcap=rkw["softcap"], backward=True)
            info += f"; d{nm} {ex:.2e} <= {bx:.2e}"
            ok = ok and okx
    return ok, info + f" | {names(plan)}"


for d, dtype, causal in [(128, torch.bfloat16, False), (128, torch.bfloat16, True), (64, torch.float16, True),
                         (256, torch.bfloat16, False), (96, torch.float16, False)]:
    case(f"flash_attn_func d{d} {dtype} causal={causal} fwd+bwd")(lambda d=d, dtype=dtype, causal=causal: dense(d, dtype, causal))
case("gqa 16/2 d128 causal lq 300 lk 1000")(lambda: dense(128, torch.bfloat16, True, lq=300 if not EMU else 9, hq=16, hkv=2))
case("window (256, 0) softcap 30 d128")(lambda: dense(128, torch.bfloat16, False, window_size=(256, 0), softcap=30.0))
case("dv 256 at d 64 (fwd)")(lambda: dense(64, torch.bfloat16, False, dv=256, backward=False))


@case("varlen d128 causal fwd+bwd")
def _():
    lens = [N(300), 1, N(777), N(1024)]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
    T = sum(lens)
    q, k, v = (rnd(T, 8, 128).requires_grad_() for _ in range(3))
    out = autoflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, strict=True)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    ok, info = True, ""
    for i, L in enumerate(lens):
        s = slice(int(cu[i]), int(cu[i + 1]))
        qs, ks, vs = (x[s].detach().transpose(0, 1)[None].requires_grad_() for x in (q, k, v))
        ref, _ = attention_ref(qs, ks, vs, causal=True)
        pt, _ = attention_ref(qs, ks, vs, causal=True, upcast=False)
        o1, e, b = within_tolerance(out[s].transpose(0, 1)[None], ref, pt)
        gs = g[s].transpose(0, 1)[None]
        gr = torch.autograd.grad(ref, (qs, ks, vs), gs.float())
        gt = torch.autograd.grad(pt, (qs, ks, vs), gs)
        for nm, x, r, t in zip("qkv", (dq[s], dk[s], dv[s]), gr, gt):
            okx, ex, bx = within_tolerance(x.transpose(0, 1)[None], r, t, backward=True)
            o1 = o1 and okx
        ok = ok and o1
        info += f"seq{i} fwd {e:.1e}/{b:.1e} "
    return ok, info


def kvcache(page=None, splits=0, d=128, dv=None, qv=False, lq=1, hq=16, hkv=2):
    b, cap = 4, 4096 if not EMU else 256
    seqlens = torch.tensor([1, 700, 4000, 2500] if not EMU else [1, 70, 250, 130], device=dev, dtype=torch.int32)
    dvv = dv or d
    if page:
        npages = b * cap // page
        kc, vc = rnd(npages, page, hkv, d), rnd(npages, page, hkv, dvv)
        bt = torch.randperm(npages, device=dev, dtype=torch.int32).reshape(b, cap // page)
    else:
        kc, vc, bt = rnd(b, cap, hkv, d), rnd(b, cap, hkv, dvv), None
    q = rnd(b, lq, hq, d)
    qvt = rnd(b, lq, hq, dvv) if qv else None
    kw = dict(cache_seqlens=seqlens, block_table=bt, causal=True, num_splits=splits)
    if qv:
        kw["qv"] = qvt
    plan = autoflash.explain(autoflash.flash_attn_with_kvcache, q, kc, vc, **kw)
    out = autoflash.flash_attn_with_kvcache(q, kc, vc, strict=True, **kw)
    used = seqlens.tolist()
    rkw = dict(block_table=bt, causal=True, qv=qvt)
    ref = attention_kvcache_ref(q, kc, vc, used, **rkw)
    pt = attention_kvcache_ref(q, kc, vc, used, upcast=False, **rkw)
    ref, pt = (x[0] if isinstance(x, tuple) else x for x in (ref, pt))
    ok, e, bnd = within_tolerance(out, ref, pt)
    return ok, f"err {e:.2e} <= {bnd:.2e} | {names(plan)}"


case("kvcache dense decode gqa 16/2")(lambda: kvcache())
case("kvcache paged 256 split 4")(lambda: kvcache(page=256, splits=4))
case("kvcache paged 4 (gather)")(lambda: kvcache(page=4))
case("kvcache paged 16 lq 7")(lambda: kvcache(page=16, lq=7))
case("kvcache qv d64 dv512 (MLA)")(lambda: kvcache(d=64, dv=512, qv=True, hq=16, hkv=1))

bad = [n for n, s in results if s != "PASS"]
print(f"smoke: {len(results) - len(bad)} of {len(results)} passed" + (f"; not passed: {bad}" if bad else ""))
sys.exit(1 if bad else 0)
