"""TMA on the host emulator (autoflash/emulation/cuda/runtime/tma.h) and the tensor maps it reads
(autoflash/kernels/tensor_map.py): tile loads of rank 2-5 land swizzled as the PTX ISA's table says,
fill zero outside the tensor and complete their bytes on an mbarrier; stores write only what is
inside; boxes loaded in each swizzle feed wgmma through the descriptors of that swizzle (whose layouts
the wgmma tests check against CuTe's); every constraint the driver documents is a ValueError when
encoding and a finding when a hand-made map reaches the emulator; each planted misuse is a finding of
its kind (tests/host/tma_probe.cu.j2)."""
import numpy as np
import pytest
import torch

import host_probes
from autoflash.emulation import build
from autoflash.emulation.module import EmulatedModule
from autoflash.kernels import tensor_map
from autoflash.kernels.tensor_map import TiledMap

ENTRIES = ("tma_roundtrip", "tma_wgmma")


def source(rank: int = 2, span: int = 128, case: str = "") -> str:
    return host_probes.render("tma_probe.cu.j2", rank=rank, span=span, case=case)


def probe(rank: int = 2, span: int = 128, case: str = "", sanitize: bool = False) -> EmulatedModule:
    module = host_probes.load(source(rank, span, case), "tma_probe", ENTRIES, sanitize)
    module.clear_findings()  # the library stays loaded: a test before this one may have left some
    return module


def swizzled(data: bytes, span: int) -> bytes:
    """Bytes as a load with that swizzle leaves them from a 1024-aligned address: the PTX ISA's table
    (5.5.7) read directly: in 128-byte line r, 16-byte chunk c lands in chunk c ^ (r % (span / 16))."""
    if not span:
        return data
    out = bytearray(len(data))
    for o in range(0, len(data), 16):
        line, chunk = divmod(o, 128)
        chunk //= 16
        to = line * 128 + (chunk ^ (line % (span // 16))) * 16
        out[to:to + 16] = data[o:o + 16]
    return bytes(out)


def box_of(t: torch.Tensor, box: tuple, at: tuple) -> torch.Tensor:
    """The box of t at coordinates `at` (the tensor's dim order), zero where it hangs outside."""
    out = torch.zeros(box, dtype=t.dtype)
    src = tuple(slice(max(a, 0), min(a + b, n)) for a, b, n in zip(at, box, t.shape))
    dst = tuple(slice(s.start - a, s.stop - a) for s, a in zip(src, at))
    if all(s.stop > s.start for s in src):
        out[dst] = t[src]
    return out


# (shape, box, load coordinates, store coordinates), in the tensor's own dim order; the inner dim is
# padded in memory so rows start 16-aligned. Boxes hang past the tensor on both sides.
GEOMETRY = {
    2: ((40, 100), (24, None), (-5, 60), (20, 40)),
    3: ((3, 20, 72), (2, 8, None), (2, 15, -16), (0, 4, 8)),
    4: ((2, 3, 9, 40), (1, 2, 8, None), (1, 2, 4, 8), (1, 0, 3, 0)),
    5: ((2, 2, 3, 5, 24), (2, 1, 2, 4, None), (-1, 1, 2, 3, 16), (0, 1, 1, 2, 0)),
}


def padded(shape: tuple, dtype: torch.dtype, fill=None) -> torch.Tensor:
    inner = -(-shape[-1] * torch.finfo(dtype).bits // 8 // 16) * 16 // (torch.finfo(dtype).bits // 8)
    base = torch.randn(*shape[:-1], inner + 8).to(dtype) if fill is None else torch.full((*shape[:-1], inner + 8), fill, dtype=dtype)
    return base[..., :shape[-1]]


def roundtrip(rank: int, span: int, dtype: torch.dtype, case: str = "", sanitize: bool = False, map_bytes=None,
              store_at=None):
    shape, box, at, to = GEOMETRY[rank]
    to = store_at or to
    esize = torch.finfo(dtype).bits // 8
    box = (*box[:-1], (span or 32) // esize)
    src, dst = padded(shape, dtype), padded(shape, dtype, fill=-7.0)
    before = dst.clone()
    load, store = tensor_map.for_tensor(src, box, span), tensor_map.for_tensor(dst, box, span)
    if map_bytes is not None:  # a hand-made load map
        load = map_bytes(load)
    nbytes = int(np.prod(box)) * esize
    dump = torch.zeros(nbytes, dtype=torch.uint8)
    module = probe(rank, case=case, sanitize=sanitize)
    module.get_function("tma_roundtrip")((1, 1, 1), (128, 1, 1),
                                         (load, store, torch.tensor([*reversed(at), *reversed(to)], dtype=torch.int32),
                                          dump, np.int32(nbytes)),
                                         shared_mem=1024 + nbytes, names=("load_map", "store_map", "coords", "dump", "bytes"))
    return module, src, dst, before, box, at, to, dump


def stored(before: torch.Tensor, box: torch.Tensor, shape: tuple, to: tuple) -> torch.Tensor:
    """`before` with a store of `box` (of `shape`) at `to`: only the elements inside the tensor."""
    expect = before.clone()
    region = tuple(slice(a, min(a + b, n)) for a, b, n in zip(to, shape, before.shape))
    expect[region] = box[tuple(slice(0, s.stop - s.start) for s in region)]
    return expect


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("span", [0, 32, 64, 128])
@pytest.mark.parametrize("rank", sorted(GEOMETRY))
def test_a_box_lands_swizzled_and_stores_back(rank, span, dtype):
    module, src, dst, before, box, at, to, dump = roundtrip(rank, span, DTYPES[dtype])
    want = box_of(src, box, at)
    assert dump.numpy().tobytes() == swizzled(want.contiguous().view(torch.uint8).numpy().tobytes(), span)
    assert torch.equal(dst, stored(before, want, box, to))  # inside the box written, the rest untouched
    assert module.findings() == []


@pytest.mark.parametrize("rank", [2, 5])
def test_the_roundtrip_is_clean_under_the_sanitizer(rank):
    module, src, dst, *_ = roundtrip(rank, 128, torch.bfloat16, sanitize=True)
    assert module.findings() == []


@pytest.mark.parametrize("sanitize", [False, True])
@pytest.mark.parametrize("span", [128, 64, 32])
def test_tma_boxes_feed_wgmma_in_each_swizzle(span, sanitize):
    """TMA writes what the wgmma descriptors of the same swizzle read: D = A B^T exactly (fp32 sums of
    bf16 products of small integers)."""
    if sanitize and span != 128:
        pytest.skip("one swizzle under the sanitizer")
    g = torch.Generator().manual_seed(span)
    a = torch.randint(-4, 5, (64, 64), generator=g).bfloat16()
    b = torch.randint(-4, 5, (64, 64), generator=g).bfloat16()
    out = torch.full((64, 64), float("nan"))
    module = probe(span=span, sanitize=sanitize)
    maps = [tensor_map.for_tensor(x, (64, span // 2), span) for x in (a, b)]
    module.get_function("tma_wgmma")((1, 1, 1), (128, 1, 1), (*maps, out), shared_mem=1024 + 2 * 8192,
                                     names=("a_map", "b_map", "out"))
    assert torch.equal(out, a.float() @ b.float().T)
    assert module.findings() == []


MISUSES = {
    "no wait": ("uninitialized", "before its TMA load landed"),
    "written in flight": ("async", "while a TMA load into it is in flight"),
    "bytes short": ("mbarrier", "bytes completed beyond the transaction bytes"),
    "generic write": ("async", "through the async proxy, which thread"),
    "source written": ("async", "an in-flight cp.async.bulk.tensor store reads was written"),
    "source written before read wait": ("async", "an in-flight cp.async.bulk.tensor store reads was written"),
    "no store wait": ("async", "exited with bulk stores or reductions in flight"),
    "no init": ("mbarrier", "before any mbarrier.init there"),
}


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_each_misuse_is_a_finding(case):
    module, *_ = roundtrip(2, 128, torch.bfloat16, case=case, sanitize=True)
    kind, text = MISUSES[case]
    found = [(f.kind, f.detail, f.thread) for f in module.findings()]
    assert any(k == kind and text in d and thread >= 0 for k, d, thread in found), found


def test_a_fenced_generic_write_is_no_finding():
    module, *_ = roundtrip(2, 128, torch.bfloat16, case="generic write fenced", sanitize=True)
    assert module.findings() == []


def test_a_read_wait_frees_the_source_and_the_store_still_lands():
    """cp.async.bulk.wait_group.read (CUTLASS's tma_store_wait): the source may be written once the
    store has read it; the store writes what it read (by the thread's exit at the latest)."""
    module, src, dst, before, box, at, to, _ = roundtrip(2, 128, torch.bfloat16, case="read wait", sanitize=True)
    assert torch.equal(dst, stored(before, box_of(src, box, at), box, to))
    assert module.findings() == []


def forge(word: int, value):
    """A load map whose word `word` (runtime/tma.h's format) is replaced: bytes that bypass the
    encoder's checks, as a map written by hand would."""
    def apply(m: TiledMap) -> np.ndarray:
        w = m.emulated().view(np.uint64).copy()
        w[word] = value(int(w[word])) if callable(value) else value
        return w.view(np.uint8)
    return apply


FORGED = {
    "stride not a multiple of 16": (8, lambda s: s + 8, "expected a multiple of 16 below 2^40"),
    "box dim over 256": (12, lambda b: (b & ~0xfff000) | (300 << 12), "box dim 1 of 300"),
    "inner box wider than the span": (2, lambda x: (x & ~(0xff << 24)) | (2 << 24), "wider than its 64-byte swizzle span"),
    "rank 6": (2, lambda x: (x & ~(0xff << 8)) | (6 << 8), "has rank 6"),
    "address not 16-aligned": (1, lambda a: a + 8, "expected 16-byte alignment"),
    "not encoded by autoflash": (0, 0, "did not encode"),
    "element stride 9": (13, lambda s: s | (9 << 4), "element stride 9 for dim 1"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_map_the_driver_would_refuse_is_a_finding(case):
    word, value, text = FORGED[case]
    module, *_ = roundtrip(2, 128, torch.bfloat16, sanitize=True, map_bytes=forge(word, value))
    found = [(f.kind, f.detail) for f in module.findings()]
    assert any(k == "tma" and text in d for k, d in found), found


def test_a_negative_store_coordinate_is_a_finding():
    module, *_ = roundtrip(2, 128, torch.bfloat16, sanitize=True, store_at=(-1, 0))
    found = [(f.kind, f.detail) for f in module.findings()]
    assert any(k == "tma" and "must not be negative" in d for k, d in found), found


REFUSED = {  # TiledMap fields -> the driver's rule the encoder names
    "rank": (dict(dims=(8,) * 6, strides=(16,) * 5, box=(8,) * 6), "rank: got 6"),
    "address": (dict(address=0x1008), "global address: got 0x1008"),
    "dim zero": (dict(dims=(64, 0)), "dim 1: got 0 elements"),
    "dim past 2^32": (dict(dims=(64, 2**32 + 1)), "expected 1..2^32"),
    "stride": (dict(strides=(136,)), "stride of dim 1: got 136 bytes"),
    "stride 2^40": (dict(strides=(2**40,)), "below 2^40"),
    "box zero": (dict(box=(64, 0)), "box dim 1: got 0"),
    "box 257": (dict(box=(64, 257)), "box dim 1: got 257"),
    "inner box bytes": (dict(box=(4, 8)), "inner box: got 4 elements = 8 bytes"),
    "element stride": (dict(element_strides=(1, 9)), "element stride of dim 1: got 9"),
    "swizzle span": (dict(swizzle=64), "at most the 64-byte swizzle span"),
    "swizzle mode": (dict(swizzle=16), "swizzle: got 16"),
    "data type": (dict(data_type=13), "data type: got 13"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_encoder_refuses_what_the_driver_refuses(case):
    fields = dict(data_type=9, address=0x1000, dims=(64, 64), strides=(128,), box=(64, 8), swizzle=128)
    change, text = REFUSED[case]
    with pytest.raises(ValueError, match=text.replace("^", r"\^").replace("(", r"\(").replace(")", r"\)")):
        TiledMap(**{**fields, **change})


def test_a_map_of_a_tensor():
    t = torch.zeros(3, 5, 40, dtype=torch.bfloat16)[:, :, :32]
    m = tensor_map.for_tensor(t, (1, 4, 32), 64)
    assert (m.dims, m.strides, m.box, m.data_type, m.box_bytes) == ((32, 5, 3), (80, 400), (32, 4, 1), 9, 256)
    with pytest.raises(ValueError, match="last dim contiguous"):
        tensor_map.for_tensor(torch.zeros(8, 8).T, (8, 8))
    with pytest.raises(TypeError, match="torch.float16"):
        tensor_map.for_tensor(torch.zeros(8, 8, dtype=torch.int16), (8, 8))


@pytest.mark.parametrize("old, new", [
    ("return B ? a ^ (((a >> 7) & ((1u << B) - 1)) << 4) : a;", "return a;"),  # no swizzle
    ("w.window[off] = addr ? *reinterpret_cast<const unsigned char*>(addr + b) : 0;",
     "w.window[off] = addr ? *reinterpret_cast<const unsigned char*>(addr + b) : 0x3c;"),  # no zero fill
])
def test_the_tma_checks_fail_when_the_emulator_is_broken(old, new, broken_runtime):
    broken_runtime("runtime/tma.h", old, new)
    with pytest.raises((AssertionError, build.EmulationError)):
        test_a_box_lands_swizzled_and_stores_back(2, 128, "bf16")


def test_a_broken_swizzle_breaks_the_wgmma_product(broken_runtime):
    broken_runtime("runtime/tma.h", "return B ? a ^ (((a >> 7) & ((1u << B) - 1)) << 4) : a;", "return a;")
    with pytest.raises(AssertionError):
        test_tma_boxes_feed_wgmma_in_each_swizzle(128, False)


@pytest.mark.parametrize("rank", [2, 5])
def test_the_probe_compiles_for_sm_90a_to_tma_instructions(rank):
    from autoflash.kernels.compiler import compile_source
    from autoflash.kernels.sass import disassemble

    compiled = compile_source(source(rank), "tma_roundtrip", "sm_90a")
    assert not compiled.resources.spills
    sass = disassemble(compiled.cubin_path, "tma_roundtrip")
    assert f"UTMALDG.{rank}D" in sass and f"UTMASTG.{rank}D" in sass, sass
