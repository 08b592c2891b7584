"""Per-call host work (issue "FA2-class tiling ... cut per-call host work", item 4): the plan cache
of autoflash.attention, the selection cache and its view of the tuned tables on disk, and the
launch-argument packing. Each cache must give what an uncached call gives: a hit the same decision,
any change in what the decision reads a fresh one, bad input its own error every time."""
import ctypes
import warnings

import numpy as np
import pytest
import torch

import autoflash
from autoflash.dispatch import sdpa as dispatch
from autoflash.dispatch import selection
from autoflash.dispatch.sdpa import FallbackWarning, UnsupportedCallError
from autoflash.dispatch.selection import HEURISTIC, select_config
from autoflash.kernels import launch, resources
from autoflash.kernels.codegen import template_hash
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.gpus import get_profile
from autoflash.tuning.problem import ProblemKey
from autoflash.tuning.table import Entry, Result, Table, merge_into, table_path

H100 = get_profile("h100")


@pytest.fixture(autouse=True)
def _fresh(fresh_fallback_policy):
    dispatch.clear_plan_cache()
    yield
    dispatch.clear_plan_cache()


def _count_calls(monkeypatch, module, name: str) -> list:
    """Replaces module.name by a wrapper that records each call's arguments; returns the record."""
    calls = []
    real = getattr(module, name)

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture
def decisions(monkeypatch):
    """Counts the uncached planning runs (_decide) behind plan()."""
    return _count_calls(monkeypatch, dispatch, "_decide")


def _qkv(shape=(1, 2, 16, 64), dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(3))


# ------------------------------------------------------------------ the plan cache
def test_a_repeated_call_reuses_its_plan(decisions):
    q, k, v = _qkv()
    first = dispatch.plan(q, k, v, is_causal=True, device_check=False)
    again = dispatch.plan(*_qkv(), is_causal=True, device_check=False)  # other tensors, same signature
    assert again is first and len(decisions) == 1
    assert first == dispatch._decide(q, k, v, None, 0.0, True, None, False, False)


def _transposed(q, k, v):  # the same shapes in a (batch, seqlen, heads, dim) layout
    return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))


# Each changes one thing the key covers; the call stays valid.
CHANGES = {
    "dtype": (lambda q, k, v: tuple(t.half() for t in (q, k, v)), {}),
    "stride": (_transposed, {}),
    "causal": (lambda q, k, v: (q, k, v), {"is_causal": False}),
    "scale": (lambda q, k, v: (q, k, v), {"scale": 0.5}),
    "gqa": (lambda q, k, v: (q, k, v), {"enable_gqa": True}),
    "dropout": (lambda q, k, v: (q, k, v), {"dropout_p": 0.1}),
    "key_length": (lambda q, k, v: (q, k[:, :, :8], v[:, :, :8]), {}),
    "mask": (lambda q, k, v: (q, k, v), {"attn_mask": torch.ones(16, 16, dtype=torch.bool), "is_causal": False}),
    "device": (lambda q, k, v: tuple(t.to("meta") for t in (q, k, v)), {}),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_key_component_gives_a_fresh_plan(decisions, change):
    q, k, v = _qkv()
    base = {"is_causal": True, "device_check": False}
    dispatch.plan(q, k, v, **base)
    mutate, kwargs = CHANGES[change]
    args, kw = mutate(q, k, v), {**base, **kwargs}
    got = dispatch.plan(*args, **kw)
    assert len(decisions) == 2, f"{change}: served from the cache"
    uncached = dispatch._decide(*args, kw.get("attn_mask"), kw.get("dropout_p", 0.0), kw["is_causal"],
                                kw.get("scale"), kw.get("enable_gqa", False), False)
    assert got == uncached


def test_the_emulated_gpu_is_part_of_the_key(decisions):
    q, k, v = _qkv()
    outside = dispatch.plan(q, k, v, is_causal=True)
    assert "cpu tensors" in outside.reason
    with autoflash.emulate("h100"):
        inside = dispatch.plan(q, k, v, is_causal=True)
        assert inside.reason is None
        assert dispatch.plan(q, k, v, is_causal=True) is inside  # a hit inside the same emulation
    with autoflash.emulate("a100"):
        assert dispatch.plan(q, k, v, is_causal=True).reason is None
    assert dispatch.plan(q, k, v, is_causal=True) is outside
    assert len(decisions) == 3  # outside, h100, a100


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(dispatch, "PLAN_CACHE_MAX", 4)
    for n in range(1, 11):
        q, k, v = _qkv((1, 1, n, 64))
        dispatch.plan(q, k, v, device_check=False)
        assert len(dispatch._plans) <= 4


def test_a_trace_is_planned_without_the_cache(monkeypatch, decisions):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v = _qkv()
    for _ in range(2):
        assert dispatch.plan(q, k, v, is_causal=True, device_check=False).reason is None
    assert len(decisions) == 2 and not dispatch._plans


def _error(fn):
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    return type(info.value), str(info.value)


# Arguments equal as dict keys to a valid call's (1 == True == 1.0, 0 == False) that validation refuses.
LOOKALIKES = {
    "is_causal=1": ({"is_causal": True}, {"is_causal": 1}, TypeError, "is_causal: got 1"),
    "enable_gqa=0": ({"enable_gqa": False}, {"enable_gqa": 0}, TypeError, "enable_gqa: got 0"),
    "dropout_p=False": ({"dropout_p": 0}, {"dropout_p": False}, TypeError, "dropout_p: got bool"),
    "scale=True": ({"scale": 1}, {"scale": True}, TypeError, "scale: got True"),
    "scale=nan": ({"scale": 0.5}, {"scale": float("nan")}, TypeError, "scale: got nan"),
}


@pytest.mark.parametrize("case", sorted(LOOKALIKES))
def test_bad_input_raises_its_own_error_on_every_call(case):
    good, bad, error, message = LOOKALIKES[case]
    q, k, v = _qkv()
    dispatch.plan(q, k, v, **good, device_check=False)  # cached: its key must not answer for `bad`
    first = _error(lambda: dispatch.plan(q, k, v, **bad, device_check=False))
    assert first[0] is error and message in first[1]
    assert _error(lambda: dispatch.plan(q, k, v, **bad, device_check=False)) == first
    assert _error(lambda: autoflash.attention(q, k, v, **bad)) == first


def test_shape_errors_repeat_with_the_same_message():
    q, k, v = _qkv()
    for bad in ((q, k[..., :32], v), (q, k, v[:, :, :3]), (q, [1.0], v)):
        assert _error(lambda: autoflash.attention(*bad)) == _error(lambda: autoflash.attention(*bad))


def test_a_signed_zero_scale_keeps_its_own_reason():
    q, k, v = _qkv()
    assert "scale 0.0:" in dispatch.plan(q, k, v, scale=0.0, device_check=False).reason
    assert "scale -0.0:" in dispatch.plan(q, k, v, scale=-0.0, device_check=False).reason


def test_fallback_warnings_come_as_before(decisions):
    q, k, v = _qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            autoflash.attention(q, k, v)
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1 and fallbacks[0].filename == __file__  # pointing at the caller, as before
    dispatch._warned.clear()  # a new process, as far as warnings go: the cached plan warns again
    with pytest.warns(FallbackWarning, match="cpu tensors"):
        autoflash.attention(q, k, v)
    with pytest.raises(UnsupportedCallError, match="cpu tensors"):  # strict still reads the cached reason
        autoflash.attention(q, k, v, strict=True)
    assert len(decisions) == 1


# ------------------------------------------------------------------ the selection cache
@pytest.fixture
def tables(tmp_path, monkeypatch):
    """An empty user folder and shipped folder; the tables on disk looked at on every call."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(selection.USER_DIR_ENV, str(user))
    monkeypatch.setattr(resources, "tuned_dir", lambda: shipped)
    monkeypatch.setattr(selection, "TABLE_RECHECK_S", 0.0)
    selection.clear_cache()
    yield user, shipped
    selection.clear_cache()


@pytest.fixture
def selections(monkeypatch):
    """Counts the uncached selections (_select)."""
    return _count_calls(monkeypatch, selection, "_select")


def _cfg(m, n, w, causal=True):
    return KernelConfig(head_dim=128, dtype="bf16", block_m=m, block_n=n, num_warps=w, num_stages=2, causal=causal)


def _tune(folder, winner, *, bucket="le4k", gpu="h100"):
    key = ProblemKey(gpu, "fwd", "bf16", 128, winner.causal, bucket)
    entry = Entry(key=key, winner=Result.of(winner, 1.0, 100.0), default=None, sdpa_flash_ms=None, runner_ups=(),
                  shapes=((4, 16, 4096, 128),), evaluated=1, failed=0, trials=1, date="2026-11-24T00:00:00+00:00")
    merge_into(table_path(folder, gpu), Table(gpu, template_hash(), {"backend": "cuda"}, {}).with_entries(entry))
    return table_path(folder, gpu)


def test_a_repeated_selection_is_a_hit(tables, selections):
    first = select_config(H100, "fwd", "bf16", 128, True, 3000)
    assert select_config(H100, "fwd", "bf16", 128, True, 2500) is first  # the same bucket
    assert len(selections) == 1 and first.origin == HEURISTIC


# Each changes one argument of select_config(h100, "fwd", "bf16", 128, True, 3000): gpu ... seqlen bucket.
SELECTION_CHANGES = [("a100", "fwd", "bf16", 128, True, 3000), ("h100", "bwd", "bf16", 128, True, 3000),
                     ("h100", "fwd", "fp16", 128, True, 3000), ("h100", "fwd", "bf16", 64, True, 3000),
                     ("h100", "fwd", "bf16", 128, False, 3000), ("h100", "fwd", "bf16", 128, True, 9000)]


@pytest.mark.parametrize("change", SELECTION_CHANGES)
def test_each_selection_argument_gives_a_fresh_selection(tables, selections, change):
    select_config(H100, "fwd", "bf16", 128, True, 3000)
    gpu, *rest = change
    got = select_config(get_profile(gpu), *rest)
    assert len(selections) == 2
    assert got.key == ProblemKey(gpu, *rest[:4], selection.seqlen_bucket(rest[4]))


def test_a_table_tuned_on_disk_is_picked_up_without_clear_cache(tables, selections):
    user, shipped = tables
    assert select_config(H100, "fwd", "bf16", 128, True, 3000).origin == HEURISTIC
    path = _tune(shipped, _cfg(128, 32, 8))
    assert select_config(H100, "fwd", "bf16", 128, True, 3000).config == _cfg(128, 32, 8)
    _tune(shipped, _cfg(64, 96, 4))  # re-tuned: the same file, a new winner
    sel = select_config(H100, "fwd", "bf16", 128, True, 3000)
    assert sel.config == _cfg(64, 96, 4) and sel.origin == f"tuned table {path}"
    user_path = _tune(user, _cfg(64, 64, 4))  # a user table comes before the shipped one
    assert select_config(H100, "fwd", "bf16", 128, True, 3000).origin == f"tuned table {user_path}"
    user_path.unlink()  # back to the files of the re-tuned selection: that one, remembered
    assert select_config(H100, "fwd", "bf16", 128, True, 3000).config == _cfg(64, 96, 4)
    assert len(selections) == 4


def test_tables_are_looked_at_once_per_interval(tables, monkeypatch):
    _, shipped = tables
    now = [1000.0]
    monkeypatch.setattr(selection, "_clock", lambda: now[0])
    monkeypatch.setattr(selection, "TABLE_RECHECK_S", 1.0)
    assert select_config(H100, "fwd", "bf16", 128, True, 3000).origin == HEURISTIC
    _tune(shipped, _cfg(128, 32, 8))
    now[0] += 0.5
    assert select_config(H100, "fwd", "bf16", 128, True, 3000).origin == HEURISTIC  # not looked at yet
    now[0] += 0.6
    assert select_config(H100, "fwd", "bf16", 128, True, 3000).config == _cfg(128, 32, 8)


def test_another_user_folder_gives_a_fresh_selection(tables, tmp_path, monkeypatch):
    other = tmp_path / "other"
    path = _tune(other, _cfg(64, 96, 4))
    assert select_config(H100, "fwd", "bf16", 128, True, 3000).origin == HEURISTIC
    monkeypatch.setenv(selection.USER_DIR_ENV, str(other))
    assert select_config(H100, "fwd", "bf16", 128, True, 3000).origin == f"tuned table {path}"


def test_a_bad_table_warns_once_while_it_is_unchanged(tables):
    user, _ = tables
    path = table_path(user, "h100")
    path.write_text("{broken")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seqlen in (100, 3000, 9000, 3000):  # looked at on every call (TABLE_RECHECK_S = 0)
            assert select_config(H100, "fwd", "bf16", 128, True, seqlen).origin == HEURISTIC
    assert len(caught) == 1 and str(path) in str(caught[0].message) and caught[0].filename == __file__


def test_a_bad_sequence_length_raises_every_time(tables):
    for _ in range(2):
        with pytest.raises(ValueError, match="seqlen_bucket: got 0, expected a positive int"):
            select_config(H100, "fwd", "bf16", 128, True, 0)


# ------------------------------------------------------------------ launch arguments
# What each parameter was passed as before the packing: numpy scalars of the kernel's C types.
NUMPY_TYPES = {"P": np.uint64, "q": np.int64, "i": np.int32, "f": np.float32}


def _launch_values(params, seed=0):
    tensors = tuple(torch.empty(4 + i, dtype=torch.float32) for i in range(params.pointers))
    rng = np.random.default_rng(seed)
    scalars = []
    for code in params.struct.format[1 + params.pointers:]:
        scalars.append(float(rng.uniform(-3, 3)) if code == "f" else int(rng.integers(-2**31, 2**31)))
    return tensors, tuple(scalars)


def _expected_bytes(params, tensors, scalars):
    values = [t.data_ptr() for t in tensors] + list(scalars)
    codes = params.struct.format[1:]
    return [NUMPY_TYPES[c](v).tobytes() for c, v in zip(codes, values)]


@pytest.mark.parametrize("name", ["FWD_PARAMS", "DELTA_PARAMS", "BWD_PARAMS", "COMBINE_PARAMS"])
def test_cupy_gets_the_bytes_numpy_scalars_gave(name):
    from cupy.cuda.function import CPointer

    params = getattr(launch, name)
    tensors, scalars = _launch_values(params)
    params.pack(tensors, scalars)
    args = params.cupy_args()
    assert all(isinstance(a, CPointer) for a in args) and len(args) == len(params.spans)
    got = [ctypes.string_at(a.ptr, size) for a, (_, size) in zip(args, params.spans)]
    assert got == _expected_bytes(params, tensors, scalars)
    _, other = _launch_values(params, seed=1)
    params.pack(tensors, other)  # the next launch: the same pointers, new values behind them
    assert params.cupy_args() is args
    assert [ctypes.string_at(a.ptr, s) for a, (_, s) in zip(args, params.spans)] == \
        _expected_bytes(params, tensors, other)


def _c_code(param: str) -> str:
    """The struct code of one C parameter declaration ("const elem_t* __restrict__ q" -> "P"; a TMA
    tensor map by value, "const __grid_constant__ TmaDesc q_map", -> its 128 bytes)."""
    if "*" in param:
        return "P"
    if "TmaDesc" in param:
        return "128s"
    return {"long long": "q", "int": "i", "float": "f"}[param.rsplit(" ", 1)[0]]


@pytest.mark.parametrize("direction", ["fwd", "bwd", "bwd-dqpass", "fwd-split", "fwd-sm90", "bwd-sm90"])
def test_the_packing_follows_the_templates_signatures(direction):
    """launch.py's parameter lists against the kernels' own, from the rendered source: a parameter
    added to a template and not to launch.py would shift every one after it."""
    import re

    from autoflash.kernels.codegen import render
    from autoflash.kernels.defaults import default_backward_config, default_config
    from autoflash.kernels.gpus import get_profile

    make = default_config if direction.startswith("fwd") else default_backward_config
    # The H100's defaults at d = 64 are the sm90 family's (its own templates); the A100's the sm80 ones.
    config = make(64, "bf16", True, H100 if direction.endswith("sm90") else get_profile("a100"))
    if direction == "bwd-dqpass":
        config = config.replace(dq="pass")
    if direction == "fwd-split":  # the KV-cache kernel and its combine kernel
        config = config.replace(align="bottom_right", kvcache=True, paged=True, split=True)
    source = render(config)
    expected = {config.name: launch.FWD_PARAMS} if direction.startswith("fwd") else \
        {config.name: launch.BWD_PARAMS, f"{config.name}_delta": launch.DELTA_PARAMS}
    if direction.endswith("sm90"):
        assert config.family == "sm90"
        expected = {config.name: launch.SM90_FWD_PARAMS} if direction == "fwd-sm90" else \
            {config.name: launch.SM90_BWD_PARAMS, f"{config.name}_delta": launch.SM90_DELTA_PARAMS}
    if direction == "fwd-split":
        expected[f"{config.name}_combine"] = launch.COMBINE_PARAMS
    if direction == "bwd-dqpass":
        expected[f"{config.name}_dq"] = launch.DQ_PARAMS
    assert set(expected) == set(config.symbols)
    for name, params in expected.items():
        # comments naming the switches a parameter serves (they may hold parentheses) go first
        declared = re.search(r"\n" + re.escape(name) + r"\(([^)]*)\)\s*\{", re.sub(r"//[^\n]*", "", source)).group(1)
        codes = "".join(_c_code(" ".join(p.split())) for p in declared.split(","))
        assert "@" + codes == params.struct.format, name


def test_parameters_sit_at_their_c_offsets():
    # templates/flash_fwd.cu.j2: 17 pointers, 17 long long, 9 int, 3 float; flash_bwd.cu.j2 likewise
    assert [o for o, _ in launch.FWD_PARAMS.spans] == [8 * i for i in range(34)] + [272 + 4 * i for i in range(12)]
    # flash_combine.cu.j2: 6 pointers, 5 long long, 4 int
    assert [o for o, _ in launch.COMBINE_PARAMS.spans] == [8 * i for i in range(11)] + [88 + 4 * i for i in range(4)]
    assert launch.DELTA_PARAMS.struct.size == 76
    # 15 pointers and 22 long long end at 296; 6 int, 4 float, n_block0
    assert [o for o, _ in launch.BWD_PARAMS.spans][-11:] == [296 + 4 * i for i in range(11)]


def test_the_emulator_gets_the_tensors_and_the_same_bytes():
    params = launch.FWD_PARAMS
    tensors, scalars = _launch_values(params)
    args = params.emulator_args(tensors, params.pack(tensors, scalars))
    n = params.pointers
    assert all(a is t for a, t in zip(args[:n], tensors)) and len(tensors) == n
    assert [np.asarray(a).tobytes() for a in args[n:]] == _expected_bytes(params, tensors, scalars)[n:]


def test_the_gpu_branch_launches_on_torchs_stream_with_cpointers(monkeypatch):
    from cupy.cuda.function import CPointer

    class FakeCupy:
        class cuda:
            entered = []

            class Device:
                def __init__(self, index):
                    self.index = index

                def __enter__(self):
                    FakeCupy.cuda.entered.append(self.index)

                def __exit__(self, *exc):
                    return False

            class Stream:  # CuPy 14's supported API only (ExternalStream is deprecated, gone in 15)
                @staticmethod
                def from_external(obj):
                    return ("stream", obj.__cuda_stream__(), FakeCupy.cuda.entered[-1])

    class FakeStream:
        cuda_stream = 0xABC

    monkeypatch.setattr(launch, "_cupy", lambda: (FakeCupy, CPointer))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: FakeStream)
    launch._stream.cache_clear()
    seen = []
    tensors, scalars = _launch_values(launch.DELTA_PARAMS)
    try:
        launch._call(lambda *a, **kw: seen.append((a, kw)), (3, 2, 1), 128, 0, torch.device("cuda", 1),
                     launch.DELTA_PARAMS, tensors, scalars)
    finally:
        launch._stream.cache_clear()
    (grid, block, args), kw = seen[0]
    # the stream protocol's (version 0, handle), wrapped with the launch's device current
    assert (grid, block, kw) == ((3, 2, 1), (128, 1, 1), {"shared_mem": 0, "stream": ("stream", (0, 0xABC), 1)})
    assert FakeCupy.cuda.entered == [1] and all(isinstance(a, CPointer) for a in args)
    assert [ctypes.string_at(a.ptr, s) for a, (_, s) in zip(args, launch.DELTA_PARAMS.spans)] == \
        _expected_bytes(launch.DELTA_PARAMS, tensors, scalars)


@pytest.mark.parametrize("scalars, message", [((8,) * 6 + (2**31,), "int"), ((8,) * 6 + ("7",), "int")])
def test_values_their_parameters_cannot_hold_are_refused(scalars, message):
    tensors = tuple(torch.empty(4) for _ in range(3))
    with pytest.raises(ValueError, match=rf"kernel scalars: got .*expected values their .*{message}"):
        launch.DELTA_PARAMS.pack(tensors, scalars)
    with pytest.raises(ValueError, match="kernel tensors: got 2, expected 3"):
        launch.DELTA_PARAMS.pack(tensors[:2], (8,) * 7)


def test_a_float_beyond_float32_packs_as_numpy_did():
    tensors, scalars = _launch_values(launch.FWD_PARAMS)
    params = launch.FWD_PARAMS
    buf = params.pack(tensors, (*scalars[:-1], 1e39))
    offset, size = params.spans[-1]
    with np.errstate(over="ignore"):
        assert ctypes.string_at(ctypes.addressof(buf) + offset, size) == np.float32(1e39).tobytes()  # inf
