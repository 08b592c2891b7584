"""The GPU-only host code driven to the driver boundary on a machine without a GPU.

cuda-bindings converts every argument before it loads the driver library, so a call that stops only
at "driver not found" was type-correct: a TypeError, or an error of ours, fails here. Where a call
cannot get past the missing driver (cuTensorMapEncodeTiled's result), a fake that enforces the CUDA
Driver API reference's contract for it stands in, and what our code does with the result is run."""
import os
import subprocess
import sys

import pytest
import torch

import sampling

from autoflash.kernels.defaults import call_default, default_backward_config, default_config, default_decode_config
from autoflash.kernels.gpus import get_profile
from autoflash.kernels.launch import sm90_maps, tile_maps
from autoflash.kernels.tensor_map import DATA_TYPES, SWIZZLES, for_tensor

driver = pytest.importorskip("cuda.bindings.driver")
H100 = get_profile("h100")


def driver_missing(error: BaseException) -> bool:
    """Whether `error` says only that the CUDA driver is not there (the boundary of this machine)."""
    text = f"{type(error).__name__}: {error}"
    return ("DynamicLibNotFoundError" in text and "driver" in text) or "CUDA_ERROR_NO_DEVICE" in text \
        or "CUDA_ERROR_NOT_INITIALIZED" in text or "cudaErrorInsufficientDriver" in text  # CuPy, no libcuda


def reaches_the_driver(call):
    """Runs `call` and requires that it stops at the missing driver and nowhere before."""
    try:
        call()
    except Exception as e:  # the assertion below says which
        assert driver_missing(e), f"stopped before the driver: {type(e).__name__}: {e}"
    else:
        pytest.skip("a CUDA driver is present: the call went through")


def _sm90_maps():
    """Every tensor map the sm90 forward, backward and KV-cache defaults build (d 64, 128, 256; odd
    shapes), and with V's own head dim ((64, 256), (192, 128), (64, 512): V and O dv wide)."""
    maps = []
    for d, dv in ((64, 64), (128, 128), (256, 256), (64, 256), (192, 128), (64, 512)):
        fwd = call_default("fwd", d, "bf16", True, {}, H100, dv)
        q, k = (torch.empty(2, 3, 77, d, dtype=torch.bfloat16) for _ in range(2))
        v, o = (torch.empty(2, 3, 77, dv, dtype=torch.bfloat16) for _ in range(2))
        maps += sm90_maps(fwd, q, k, v, o)
        if dv <= 256:
            bwd = call_default("bwd", d, "bf16", True, {}, H100, dv)
            maps += tile_maps(bwd, (q, bwd.block_m), (k, bwd.block_n), (v, bwd.block_n), (o, bwd.block_m))
        # the KV-cache kernel's: query heads folded into rows, a dense cache and one of 256-row pages, each
        # (batch or page, seqlen, heads_kv, d) seen as (batch or page, heads_kv, seqlen, d)
        for page in (None, 256):
            dec = default_decode_config(d, "bf16", H100, page, False, False, dv)
            rows = 300 if page is None else page
            kc, vc = (torch.empty(5, rows, 2, w, dtype=torch.bfloat16).transpose(1, 2) for w in (d, dv))
            qf, of = (torch.empty(3, 2, 8, w, dtype=torch.bfloat16) for w in (d, dv))
            maps += tile_maps(dec, (qf, 64), (kc, dec.block_n), (vc, dec.block_n), (of, 64))
    return maps


def test_every_sm90_default_map_reaches_the_driver():
    # Before the fix every sm90 launch raised "TypeError: Cannot convert int to cuuint32_t" here.
    from autoflash.kernels import tensor_map

    tensor_map._encode.cache_clear()
    for m in _sm90_maps():
        reaches_the_driver(m.encoded)


class _Contract:
    """cuTensorMapEncodeTiled as the CUDA Driver API reference specifies its arguments (interleave
    none): the bindings' types, then every documented rule. Returns (CUDA_SUCCESS, CUtensorMap) with
    the opaque words filled from the arguments, so the caller's handling of the result runs."""

    def __init__(self):
        self.calls = []

    def __call__(self, data_type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob):
        d = driver
        assert isinstance(data_type, d.CUtensorMapDataType) and isinstance(interleave, d.CUtensorMapInterleave)
        assert isinstance(swizzle, d.CUtensorMapSwizzle) and isinstance(l2, d.CUtensorMapL2promotion)
        assert isinstance(oob, d.CUtensorMapFloatOOBfill) and isinstance(rank, int) and isinstance(address, int)
        for name, values, kind in (("globalDim", dims, d.cuuint64_t), ("globalStrides", strides, d.cuuint64_t),
                                   ("boxDim", box, d.cuuint32_t), ("elementStrides", element_strides, d.cuuint32_t)):
            assert isinstance(values, list) and all(type(v) is kind for v in values), (name, values)
        dims, strides, box, es = ([int(v) for v in x] for x in (dims, strides, box, element_strides))
        size = {0: 1, 3: 4, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}[int(data_type)]
        assert 1 <= rank <= 5 and len(dims) == rank and len(strides) == rank - 1 and len(box) == rank == len(es)
        assert address % 16 == 0  # 32 with interleave 32B; none here
        assert all(0 < n <= 2**32 for n in dims)
        assert all(s % 16 == 0 and s < 2**40 for s in strides)
        assert all(0 < b <= 256 for b in box) and all(0 < e <= 8 for e in es)
        inner = box[0] * size
        assert inner % 16 == 0
        span = {0: None, 1: 32, 2: 64, 3: 128}[int(swizzle)]
        assert span is None or inner <= span
        assert int(interleave) == 0 and int(l2) in range(4) and int(oob) in (0, 1)
        self.calls.append((int(data_type), dims, strides, box, es, int(swizzle)))
        tmap = d.CUtensorMap()
        words = [address, *dims, *strides, *box, *es]
        tmap.opaque = [d.cuuint64_t(v) for v in words + [0] * (16 - len(words))]
        return d.CUresult.CUDA_SUCCESS, tmap


@pytest.fixture
def contract(monkeypatch):
    """The contract fake in place of the driver's encoder, with an empty map cache before and after."""
    from autoflash.kernels import tensor_map

    fake = _Contract()
    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled", fake)
    tensor_map._encode.cache_clear()
    yield fake
    tensor_map._encode.cache_clear()


def test_encoded_maps_keep_the_contract(contract):
    fake = contract
    for m in _sm90_maps():
        raw = m.encoded()
        assert isinstance(raw, bytes) and len(raw) == 128
        words = list(memoryview(raw).cast("Q"))
        assert words[0] == m.address and words[1:1 + m.rank] == list(m.dims)
        assert (m.data_type, list(m.dims), list(m.strides), list(m.box), list(m.element_strides),
                SWIZZLES[m.swizzle]) in fake.calls


def test_a_map_is_encoded_once_per_distinct_map(contract):
    # Launches on the same tensors ask for the same maps: the driver encodes each once.
    q = torch.empty(1, 2, 128, 64, dtype=torch.bfloat16)
    first = [for_tensor(q, (1, 1, 64, 64), 128).encoded() for _ in range(5)]
    assert len(contract.calls) == 1 and len(set(first)) == 1
    for_tensor(q, (1, 1, 128, 64), 128).encoded()  # another box: another map
    for_tensor(q[:, :, 64:], (1, 1, 64, 64), 128).encoded()  # another address
    assert len(contract.calls) == 3


def test_the_contract_refuses_what_the_driver_refuses(contract):
    # The fake is not a spy: a map our checks would let through with a rule broken is caught by it.
    good = for_tensor(torch.empty(1, 1, 64, 64, dtype=torch.bfloat16), (1, 1, 64, 64), 128)
    object.__setattr__(good, "box", (72, 64, 1, 1))  # 144 inner bytes past the 128-byte swizzle span
    with pytest.raises(AssertionError):
        good.encoded()


def test_a_refusal_names_the_map(contract, monkeypatch):
    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled",
                        lambda *a: (driver.CUresult.CUDA_ERROR_INVALID_VALUE, None))
    m = for_tensor(torch.empty(1, 1, 64, 64, dtype=torch.float16), (1, 1, 64, 64), 128)
    with pytest.raises(ValueError, match=r"cuTensorMapEncodeTiled refused the map of \(64, 64, 1, 1\).*INVALID_VALUE"):
        m.encoded()


def test_data_types_are_the_drivers():
    for dtype, code in DATA_TYPES.items():
        assert int(driver.CUtensorMapDataType(code)) == code
    assert {int(driver.CUtensorMapSwizzle(v)) for v in SWIZZLES.values()} == {0, 1, 2, 3}
    assert driver.CUtensorMapDataType(DATA_TYPES[torch.bfloat16]).name == "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"
    assert driver.CUtensorMapDataType(DATA_TYPES[torch.float16]).name == "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"


# ---- NVRTC from its wheel, whatever else is imported ------------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
def test_nvrtc_builtins_load_from_nvrtcs_own_wheel():
    """NVRTC 13.0.88's libnvrtc.so.13 (the wheel CUDA torch 2.14.1 pins) has no RPATH: it finds
    libnvrtc-builtins.so.13.0 only if something loaded it first, and every compile in `tune` and
    `render` failed. The compiler loads the builtins of NVRTC's own folder before NVRTC itself."""
    script = ("from autoflash.kernels import compiler; compiler._nvrtc(); "
              "import pathlib; print('\\n'.join(l.split()[-1] for l in pathlib.Path('/proc/self/maps')"
              ".read_text().splitlines() if 'libnvrtc' in l))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    nvrtc = [p for p in out if "libnvrtc.so" in p or "libnvrtc.alt.so" in p]
    builtins = [p for p in out if "libnvrtc-builtins" in p]
    assert nvrtc, out
    assert builtins, f"NVRTC loaded without its builtins: {sorted(set(out))}"
    assert {os.path.dirname(p) for p in builtins} == {os.path.dirname(nvrtc[0])}


def test_nvrtc_builtins_are_found_beside_the_library(tmp_path):
    from autoflash.kernels.compiler import nvrtc_builtins

    for name in ("libnvrtc.so.13", "libnvrtc-builtins.so.13.0", "libnvrtc-builtins.alt.so.13.0", "libcudart.so.13"):
        (tmp_path / name).write_bytes(b"")
    assert nvrtc_builtins(str(tmp_path / "libnvrtc.so.13")) == [str(tmp_path / "libnvrtc-builtins.so.13.0")]


# ---- launch arguments against the cubin's own parameter table ---------------------------------------

def _every_default_kernel():
    """Every default config of both families and every kernel kind: forward, backward (atomics and
    the dQ pass), the KV-cache kernel split and paged with its combine (and with packed queries over
    gathered pages), the variant kernels, on the
    A100 (sm_80) and the H100 (sm_90: the sm90 family where it applies)."""

    a100 = get_profile("a100")
    configs = set()
    for d in (64, 128, 256):
        for prof in (a100, H100):
            for causal in (False, True):
                configs.add((default_config(d, "bf16", causal, prof), prof.arch))
                configs.add((default_backward_config(d, "fp16", causal, prof), prof.arch))
            configs.add((default_config(d, "bf16", True, prof, True).replace(
                causal=False, window=True, softcap=True, alibi=True, varlen=True, align="bottom_right"), prof.arch))
            configs.add((call_default("bwd", d, "bf16", False, {"key_bias": True}, prof), prof.arch))
            configs.add((default_decode_config(d, "bf16", prof, 256).replace(paged=True, split=True), prof.arch))
            configs.add((default_decode_config(d, "bf16", prof, None, False, True).replace(  # FA3's varlen, pages of 4
                causal=True, align="bottom_right", varlen=True, paged=True, gather=True, split=True), prof.arch))
    configs.add((default_backward_config(64, "bf16", True, a100).replace(dq="pass"), "sm_80"))
    configs.add((default_config(64, "fp32", False, a100), "sm_80"))
    configs = sorted(configs, key=lambda x: (x[0].name, x[1]))
    if os.environ.get("AUTOFLASH_NVRTC_STACK"):  # another release (.ci/nvrtc_stacks.sh): one of each kind
        kind = lambda job: (job[0].family, job[0].direction, job[0].kvcache)  # noqa: E731
        configs = sampling.sample(configs, kind, salt="launch " + os.environ["AUTOFLASH_NVRTC_STACK"])
    return configs


@pytest.mark.slow
@pytest.mark.parametrize("config, arch", _every_default_kernel(), ids=lambda x: getattr(x, "name", x))
def test_launch_arguments_match_the_cubins_parameter_table(config, arch):
    from autoflash.kernels.compiler import compile_config
    from autoflash.kernels.cubin import param_table
    from autoflash.kernels.launch import check_params, params_for

    cubin = compile_config(config, arch).cubin
    check_params(config, cubin)
    for symbol, params in params_for(config).items():
        table = param_table(cubin, symbol)
        assert [p.ordinal for p in table.params] == list(range(len(params.spans)))
        # the bank holds every parameter: the last one's end, past the first one's pad
        last = table.params[-1]
        assert table.bank_bytes == last.offset + last.size, (symbol, table)
        assert table.params[0].offset < 64  # at most the pad that aligns a first 64-byte TMA map


def test_a_parameter_the_launcher_does_not_pack_is_refused():
    # Stubs with the sm90 backward's two signatures, then one more scalar in the delta kernel than
    # launch.py packs: the check names both lists.
    from autoflash.kernels.compiler import compile_source
    from autoflash.kernels.launch import SM90_BWD_PARAMS, SM90_DELTA_PARAMS, check_params

    config = default_backward_config(64, "bf16", False, H100)
    main = _stub(config.name, SM90_BWD_PARAMS, "")
    ok = compile_source(main + _stub(f"{config.name}_delta", SM90_DELTA_PARAMS, ""), config.name, "sm_90a")
    check_params(config, ok.cubin)
    bad = compile_source(main + _stub(f"{config.name}_delta", SM90_DELTA_PARAMS, ", int one_more"), config.name,
                         "sm_90a")
    with pytest.raises(ValueError, match="_delta: the cubin's parameters"):
        check_params(config, bad.cubin)


def _stub(name: str, params, extra: str) -> str:
    """A kernel with the C parameters `params` packs (+ `extra`), that reads its first pointer."""
    ctype = {"P": "float*", "q": "long long", "i": "int", "f": "float"}
    codes = ["M"] * params.maps + list(params.struct.format[1 + 4 * params.maps:])
    args = ", ".join("const __grid_constant__ Map m%d" % i if c == "M" else f"{ctype[c]} a{i}"
                     for i, c in enumerate(codes))
    first = params.maps
    return ("struct alignas(64) Map { unsigned long long w[16]; };\n" if params.maps else "") + (
        f'extern "C" __global__ void {name}({args}{extra}) {{ if (a{first}) a{first}[threadIdx.x] = 1.f; }}\n')


def test_module_load_reaches_the_driver():
    # compile, the parameter-table check, then cupy's device and module load: the first thing that
    # needs the GPU is the driver itself.
    from autoflash.kernels.launch import load_functions

    config = default_config(64, "bf16", True, H100)
    load_functions.cache_clear()
    reaches_the_driver(lambda: load_functions(config, H100, 0))
    load_functions.cache_clear()


def test_shared_memory_past_the_opt_in_limit_is_refused_before_the_driver():
    from autoflash.kernels.launch import check_shared_memory

    config = default_config(128, "bf16", False, H100)
    room = H100.smem_per_block_optin - config.smem_bytes
    check_shared_memory(config, room, H100)  # exactly the limit: what cuFuncSetAttribute accepts
    with pytest.raises(ValueError, match=f"{config.smem_bytes} bytes of dynamic and {room + 16} of static"):
        check_shared_memory(config, room + 16, H100)


def test_the_stream_wraps_torchs_handle_without_a_driver():
    from autoflash.kernels.launch import _stream

    stream = _stream(0x1234, 0)
    assert stream.ptr == 0x1234 and _stream(0x1234, 0) is stream
