"""Built-in default configs: FlashAttention-2's published tile choices, adjusted where our kernel
needs it (registers, shared memory), for a GPU profile. The tuner starts from these."""
from __future__ import annotations

import dataclasses
import functools

from autoflash.kernels.config import HEAD_DIM_MAX, O_SLICE_MAX, VARIANTS, KernelConfig
from autoflash.kernels.gpus import GpuProfile

# A100-class parts let one block use up to 163 KB of shared memory; sm_86/sm_89 parts only 99 KB.
_BIG_SMEM = 160 * 1024


@dataclasses.dataclass(frozen=True)
class StackSpill:
    """A built-in kernel that ptxas spills (or gives a stack frame) under the NVRTC of some of the CUDA
    stacks our users get (the compile tier runs under each: .ci/nvrtc_stacks.sh,
    bench/results/compile/). Under an NVRTC older than `clean_from` the default takes the next
    choice: the next tile, or for the sm90 family (`tile` None) the sm80 family's kernel."""

    archs: tuple[str, ...]
    family: str
    direction: str
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...]
    causal: tuple[bool, ...]
    tile: tuple[int, int, int] | None  # (block_m, block_n, num_warps); None: the family's built-in tile
    clean_from: tuple[int, int]  # the first NVRTC seen clean
    seen: str  # where it spilled
    # The variant switches (VARIANTS) of the kernels it is about: () the built-in tile whatever the switches
    # (those that take other tiles never meet it), else exactly these (a variant's own tiles).
    switches: tuple[str, ...] = ()

    def covers(self, arch: str, direction: str, dtype: str, head_dim: int, causal: bool,
               switches: tuple[str, ...] = ()) -> bool:
        """Whether this entry is about such a problem, under whichever NVRTC."""
        return (arch in self.archs and direction == self.direction and dtype in self.dtypes
                and head_dim in self.head_dims and causal in self.causal
                and self.switches in ((), tuple(switches)))

    def applies(self, arch: str, direction: str, dtype: str, head_dim: int, causal: bool,
                nvrtc: tuple[int, int], switches: tuple[str, ...] = ()) -> bool:
        """Whether this entry rules its kernel out for such a problem under `nvrtc`."""
        return nvrtc < self.clean_from and self.covers(arch, direction, dtype, head_dim, causal, switches)

    def note(self, nvrtc: tuple[int, int]) -> str:
        first = f"{self.tile[0]} x {self.tile[1]} with {self.tile[2]} warps" if self.tile else f"the {self.family} family"
        return (f"NVRTC {nvrtc[0]}.{nvrtc[1]} picked it: ptxas there spills the first choice, {first} ({self.seen}; "
                f"clean from NVRTC {self.clean_from[0]}.{self.clean_from[1]})")


_16BIT, _BOTH = ("fp16", "bf16"), (False, True)
STACK_SPILLS = (
    StackSpill(("sm_80",), "sm80", "fwd", _16BIT, (128,), _BOTH, (128, 64, 4), (13, 5),
               "72-80 bytes under 12.1, 12.9 and 13.0.88"),
    StackSpill(("sm_80",), "sm80", "fwd", _16BIT, (32, 64), _BOTH, (128, 128, 4), (12, 9),
               "a 672-800 byte stack frame under 12.1"),
    StackSpill(("sm_80", "sm_90"), "sm80", "fwd", ("fp32",), (40,), _BOTH, (64, 32, 4), (13, 5),
               "12-20 bytes under 12.1, 12.9 and 13.0.88"),
    StackSpill(("sm_90",), "sm90", "fwd", _16BIT, (208,), _BOTH, None, (13, 5), "16 bytes under 12.9 and 13.0.88"),
    # packed sequences alone at d = 128: the plain tile's 80 queries a step, then 64 (_sm90_variant_tiles)
    StackSpill(("sm_90",), "sm90", "bwd", _16BIT, (128,), _BOTH, (80, 128, 8), (12, 9),
               "12-16 bytes under 12.1 and 12.8, causal 4-8 under 12.8", switches=("varlen",)),
)


def stack_spill(arch: str, family: str, direction: str, dtype: str, head_dim: int, causal: bool,
                tile: tuple[int, int, int] | None = None, nvrtc: tuple[int, int] | None = None,
                switches: tuple[str, ...] = ()) -> StackSpill | None:
    """The StackSpill that rules a kernel out under `nvrtc` (default: the installed NVRTC; none
    installed: the newest, under which nothing is ruled out), or None. `switches`: the kernel's
    variant switches (VARIANTS names)."""
    if nvrtc is None:
        from autoflash.kernels.compiler import installed_nvrtc

        nvrtc = installed_nvrtc()
        if nvrtc is None:
            return None
    return next((s for s in STACK_SPILLS if (s.family, s.tile) == (family, tile)
                 and s.applies(arch, direction, dtype, head_dim, causal, nvrtc, switches)), None)


def stack_note(config: KernelConfig, profile: GpuProfile) -> str | None:
    """Where the installed NVRTC moved a built-in choice that `config` replaces (explain() prints it)."""
    from autoflash.kernels.compiler import installed_nvrtc

    nvrtc = installed_nvrtc()
    if nvrtc is None:
        return None
    tile = (config.block_m, config.block_n, config.num_warps)
    for s in STACK_SPILLS:
        replaced = s.family != config.family or (s.tile is not None and s.tile != tile)
        if replaced and s.applies(profile.arch, config.direction, config.dtype, config.head_dim, config.causal, nvrtc,
                                  config.variants):
            return s.note(nvrtc)
    return None


def _candidates(head_dim: int, dtype: str, causal: bool, big_smem: bool, arch: str, variant: bool = False):
    """Tile shapes in order of preference: (block_m, block_n, num_warps). `variant`: a kernel with
    variant switches (KernelConfig.variants or bottom-right alignment), whose band limits and logits
    need registers the plain kernel's first choices do not have: ptxas spills 128 x 128 at d <= 64
    and 128 x 64 with 4 warps at d = 128 there (sm_80, bench/results/compile/), so they take the
    next shape."""
    if dtype == "fp32":
        # SIMT path: 4 warps; as many threads per row as the head dim allows keeps O in registers.
        # O takes head_dim / tpr registers per thread: 8 threads per row above d = 128.
        for block_n in (32, 16):
            for tpr in ((4, 2, 1) if head_dim <= 128 else (8, 4, 2)):
                if (head_dim // 4) % tpr == 0:
                    yield 128 // tpr, block_n, 4
        return
    # FA2 csrc/flash_attn/src/flash_fwd_launch_template.h (sm80): d<=64 128x128 (4 warps),
    # d<=128 128x64 (4 warps, 32 query rows each), d<=256 128x64 (8 warps) or 64x64 (4 warps) with
    # less shared memory; sm86/sm89 at d=128: 128x32 non-causal, 64x64 causal. Ours compile to
    # these without spills on sm_80 and sm_90 (tests/test_compile.py) except where noted: d = 40, 48, 56
    # at 128x128 and d = 104, 112 at 128x64 with 4 warps spill, so they take the next shape.
    blackwell = arch in ("sm_100", "sm_120")  # ptxas for these spills 128 x 128 at d = 64
    if head_dim <= 64:
        if head_dim not in (40, 48, 56) and not blackwell and not variant:  # d = 40 (NVRTC 13.0, sm_80), 48 spill
            yield 128, 128, 4
        yield 128, 64, 4
    elif head_dim <= 128:
        if big_smem:
            if head_dim not in (104, 112) and not (blackwell and causal) and not variant:  # spills on sm_100
                yield 128, 64, 4
            yield 128, 64, 8
        elif causal:
            yield 64, 64, 4
        else:
            yield 128, 32, 4
        yield 64, 64, 4
    else:
        if big_smem:
            yield 128, 64, 8
        yield 64, 64, 4
        yield 64, 32, 4
    yield 64, 32, 4


def _sm90_tiles(head_dim: int, causal: bool) -> tuple[int, int, bool]:
    """(block_m, block_n, pingpong) of the sm90 forward, from FlashAttention-3's tile_size_fwd_sm90
    for 16-bit inputs (hopper/tile_size.h; ../shared/docs/hopper.md 4.1): d <= 128 as FA3 runs them
    (128 x 176 non-causal, 128 x 128 causal at d = 128, pingpong between the two consumer
    warpgroups), d = 192 128 x 112 and d = 256 128 x 80 without pingpong. Where FA3 takes 192-row
    tiles with P through shared memory (d <= 96), ours keep P in registers (RS) and so take 128 rows:
    three consumer warpgroups get 160 registers a thread, too few for S, P and O of 192 keys.
    Intra-warpgroup overlap is on throughout, as in FA3."""
    if head_dim <= 64:
        return 128, 128 if causal else 192, True
    if head_dim <= 96:
        return 128, 128, True
    if head_dim <= 128:
        return 128, 128 if causal else 176, True
    if head_dim <= 192:
        return 128, 112, False
    return 128, 80, False


def _sm90_biased_keys(head_dim: int, block_n: int) -> int:
    """block_n of the sm90 forward when a key bias is read beside softcap or ALiBi: ptxas holds a bias
    value per key column live through the softmax, and spills 8-84 bytes on the wide non-causal tiles
    (192 and 176 keys), at d = 192 (NVRTC 13.5) and at d = 256 (13.0.88): the causal tiles' 128 keys up
    to d = 128, 96 up to d = 192, 64 above."""
    return min(block_n, 128 if head_dim <= 128 else 96 if head_dim <= 192 else 64)


def _sm90_variant_tiles(head_dim: int, block_m: int, switches: dict) -> dict:
    """The sm90 backward's tiles with a variant switch (VARIANTS; the alignment alone keeps the plain
    ones, and packed sequences alone, as FlashAttention-3's varlen backward does: at d = 128 NVRTC 12.1
    and 12.8 spill 12-16 B on its 80 queries a step, where call_default takes 64 under them,
    STACK_SPILLS), as KernelConfig.replace arguments. Up to d = 128 a consumer thread holds S^T, dP^T
    and dK, dV of 64 keys, and a window's second limit, softcap's tanh or ALiBi's distances spilled
    4-232 bytes on the plain tiles (128, 96 and 80 queries a step; NVRTC 13.5). Up to d = 64, 96 queries (FlashAttention-3's causal softcap tile
    there); 64 with two score modifiers (softcap, ALiBi, key bias: 8-16 bytes at 96) or a window beside
    another switch (4 bytes). Above, 64 (FA3's tile for local or softcap attention at d = 128), 48 with
    two score modifiers (4-52 bytes at d = 128 under NVRTC 13.5, 13.0.88 or 12.9). At d = 128 a window
    beside any other switch spilled 4-28 bytes on those: there the two warpgroups share 64 keys
    (dkv_split), which every switch set compiles clean. Above d = 128 (dK and dV split already) the
    plain tiles take every switch."""
    on = [f for f in VARIANTS if switches.get(f)]
    if head_dim > 128 or not on or on == ["varlen"]:
        return {}
    twice = sum(f in on for f in ("softcap", "alibi", "key_bias")) > 1
    banded = "window" in on and len(on) > 1  # a window and more
    if head_dim <= 64:
        return {"block_m": min(block_m, 64 if twice or banded else 96)}
    if head_dim > 112 and banded:
        return {"block_m": 64, "block_n": 64}
    return {"block_m": min(block_m, 48 if twice else 64)}


def _chunked_keys(family: str, head_dim: int, block_n: int, switches: dict) -> int:
    """block_n of a forward with attention chunks: each masked tile computes its rows' chunk limits
    (an integer division by the run-time chunk). Beside a score modifier (a key bias, or softcap with
    ALiBi) ptxas (NVRTC 13.5) spilled 12-96 bytes on the sm80 family's 64-key tiles above d = 144 and
    16 bytes on the sm90 family's 80-key tile at d = 256; alone, 28 bytes at d = 232 under 12.9 and
    13.0.88 (where the window kernel without chunks spills 12 already). 32 keys there on sm80, 64 on
    sm90: clean under every NVRTC (bench/results/compile/). On sm90 the chunks beside ALiBi spilled
    4-44 bytes on the 96-key tiles of 256 O columns (V's head dim its own, NVRTC 13.5): every chunked
    kernel that wide takes the plain d = 256 tile's 80 keys."""
    if not switches.get("chunk"):
        return block_n
    modified = switches.get("key_bias") or (switches.get("softcap") and switches.get("alibi"))
    if family == "sm90":
        return min(block_n, 64 if modified else 80) if head_dim > 240 else block_n
    return min(block_n, 32) if head_dim > 224 or (modified and head_dim > 144) else block_n


def sm90_applies(head_dim: int, dtype: str, profile: GpuProfile) -> bool:
    """Whether the built-in forward on this GPU is the sm90 family: an sm_90 GPU (H100, H200), 16-bit
    inputs, a head dim wgmma's k steps cover (a multiple of 16)."""
    return profile.arch == "sm_90" and dtype in ("fp16", "bf16") and head_dim % 16 == 0


def sm90_backward_applies(head_dim: int, dtype: str, profile: GpuProfile) -> bool:
    """Whether the built-in backward on this GPU is the sm90 family: where the forward's is
    (sm90_applies: every head dim that is a multiple of 16; above 128 with dK and dV split between two
    warpgroups, KernelConfig.dkv_split)."""
    return sm90_applies(head_dim, dtype, profile)


def _sm90_backward_tiles(head_dim: int, causal: bool) -> tuple[int, int, int, tuple[int, ...]]:
    """(block_m, block_n, num_warps, stage counts) of the sm90 backward, two consumer warpgroups. Up to
    d = 128 each owns 64 keys, with FlashAttention-3's tiles where it has them (tile_size_bwd_sm90 for
    16-bit inputs, hopper/flash_bwd_launch_template.h; ../shared/docs/hopper.md 4.4): 128 x 128 at
    d = 64 and 80 x 128 at d = 128, which ours take causal too (FA3 there: 64 x 128); between them
    96 x 128 (FA3 at d = 96: 64 x 128; ours runs fewer instructions per unit of tensor-core work at 96
    queries a step, and 112 spill). Above, dK^T and dV^T are split between them (dkv_split) over 64
    keys and 64 queries: FA3 takes 64 x 96 at d = 192 and 64 x 80 at d = 256 with its dKV_swapAB,
    both warpgroups holding half of dK^T and of dV^T; ours needs block_n = 64 (S^T's rows, one wgmma
    M). d = 256 fits one Q/dO stage (209 KB of the H100's 227), d = 192 two. Each compiles without
    spills (tests/test_sm90_backward.py); the least SASS per unit of tensor-core work of the schedules
    that do (bench/results/static/)."""
    if head_dim <= 64:
        return 128, 128, 8, (2,)
    if head_dim <= 96:
        return 96, 128, 8, (2,)
    if head_dim <= 128:
        return 80, 128, 8, (2,)
    return 64, 64, 8, (2, 1)


def _family_wanted(family: str | None, applies: bool, direction: str, dtype: str, head_dim: int, causal: bool,
                   profile: GpuProfile, head_dim_v: int | None = None) -> bool:
    """Whether a default is the sm90 family's: asked for (`family`), or by default where it applies."""
    if family not in (None, "sm80", "sm90"):
        raise ValueError(f"family: got {family!r}, expected 'sm80', 'sm90' or None (the GPU's default)")
    if family == "sm90" and not applies:
        dv = f" with head_dim_v={head_dim_v}" if head_dim_v is not None else ""
        raise ValueError(f"family 'sm90': no {direction} default for head_dim={head_dim}{dv} on {profile.name} "
                         f"(the family runs 16-bit attention at head dims that are multiples of 16 on sm_90 GPUs, "
                         f"Q and K's up to {HEAD_DIM_MAX})")
    if family is not None:
        return family == "sm90"
    return applies and not stack_spill(profile.arch, "sm90", direction, dtype, head_dim, causal)


@functools.lru_cache(maxsize=None)
def default_config(head_dim: int, dtype: str, causal: bool, profile: GpuProfile, variant: bool = False,
                   family: str | None = None, head_dim_v: int | None = None) -> KernelConfig:
    """The built-in config for one problem on one GPU: the first preferred tile shape that fits the
    profile's shared memory, with two K/V pipeline stages when they fit, else one. `variant`: the
    tiles for a kernel that will carry variant switches (see _candidates); the switches themselves
    are the caller's to set. On sm_90 GPUs the forward (with or without `variant`) is the sm90
    family's where sm90_applies (_sm90_tiles) and the installed NVRTC compiles it clean
    (stack_spill), else the sm80 family's. `family` ("sm80", "sm90") asks for that family's default
    instead (ValueError where it has none for the problem). `head_dim_v`: V's head dim where it is
    not head_dim (_wide_v_config)."""
    if head_dim_v is not None and head_dim_v != head_dim:
        applies = sm90_applies(head_dim, dtype, profile) and head_dim <= HEAD_DIM_MAX and head_dim_v % 16 == 0
        if _family_wanted(family, applies, "fwd", dtype, head_dim, causal, profile, head_dim_v):
            return _sm90_wide_v_config(head_dim, head_dim_v, dtype, causal, profile)
        return _wide_v_config(head_dim, head_dim_v, dtype, causal, profile, variant)
    if _family_wanted(family, sm90_applies(head_dim, dtype, profile), "fwd", dtype, head_dim, causal, profile):
        m, n, pingpong = _sm90_tiles(head_dim, causal)
        return _first_fitting([dict(head_dim=head_dim, dtype=dtype, block_m=m, block_n=n, num_warps=m // 16,
                                    causal=causal, family="sm90", pingpong=pingpong, overlap=True, stages=(2,))],
                              profile, f"head_dim={head_dim} {dtype} (sm90 family)")
    big = profile.smem_per_block_optin >= _BIG_SMEM
    return _first_fitting(
        (dict(head_dim=head_dim, dtype=dtype, block_m=m, block_n=n, num_warps=w, causal=causal)
         for m, n, w in _candidates(head_dim, dtype, causal, big, profile.arch, variant)
         if not stack_spill(profile.arch, "sm80", "fwd", dtype, head_dim, causal, (m, n, w))),
        profile, f"head_dim={head_dim} {dtype}")


def _o_split(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """(head_split, the wider head dim a block holds) of a forward with V's head dim its own: the
    fewest blocks sharing O whose slices of whole 16-column steps hold at most O_SLICE_MAX columns."""
    dv_padded = -(-head_dim_v // 16) * 16
    split = next((h for h in (1, 2, 4) if dv_padded // h <= O_SLICE_MAX and dv_padded % (16 * h) == 0), 1)
    return split, max(head_dim, dv_padded // split)


def _sm90_wide_v_config(head_dim: int, head_dim_v: int, dtype: str, causal: bool, profile: GpuProfile) -> KernelConfig:
    """The sm90 forward for V's head dim differing from Q and K's: O shared as _wide_v_config shares it
    (V of 512 columns: two blocks of 256, each computing S in full; FlashAttention-3 runs one block of
    64 rows whose first warpgroup hands P to the second through shared memory instead), two consumer
    warpgroups of 64 rows (pingpong where both head dims are at most 128, as the plain tiles), and the
    most keys a tile, a multiple of 16 up to 176, whose S, P and O take at most 200 registers a consumer
    thread (O's columns / 2, S's keys / 2 and P's keys / 4: 196 on the plain d = 128 tile, 188 on
    d = 256's) and whose two K and V stages fit shared memory. FlashAttention-3's pairs: (64, 256)
    128 x 96 as FA3; (192, 128) 128 x 128 as FA3; (128, 256) 128 x 96; (64, 512) 128 x 96 a block.
    Each compiles clean under NVRTC 12.1 to 13.5 (bench/results/compile/)."""
    split, _ = _o_split(head_dim, head_dim_v)
    o_cols = head_dim_v // split
    m, row = 128, 2 * max(head_dim, o_cols)
    fits = [n for n in range(176, 15, -16)
            if o_cols // 2 + 3 * n // 4 <= 200
            and 1024 * 4 + m * row + 2 * n * 2 * (head_dim + o_cols) <= profile.smem_per_block_optin]
    return _first_fitting([dict(head_dim=head_dim, head_dim_v=head_dim_v, head_split=split, dtype=dtype, block_m=m,
                                block_n=n, num_warps=8, causal=causal, family="sm90",
                                pingpong=max(head_dim, o_cols) <= 128, overlap=True, stages=(2,)) for n in fits],
                          profile, f"head_dim={head_dim}, head_dim_v={head_dim_v} {dtype} (sm90 family)")


def _wide_v_config(head_dim: int, head_dim_v: int, dtype: str, causal: bool, profile: GpuProfile,
                   variant: bool = False) -> KernelConfig:
    """The forward for V's head dim differing from Q and K's (FlashAttention-3's headdim_v): O shared
    among the fewest blocks (head_split) that keep at most 256 of its columns each, and the tiles the
    variant kernels take at the wider of the two head dims a block holds (its Q and K columns, its
    O and V columns), whose registers those set."""
    split, width = _o_split(head_dim, head_dim_v)
    big = profile.smem_per_block_optin >= _BIG_SMEM
    # Q and K wider than 256 (qv's columns appended): 64 query rows, as many keys as shared memory holds;
    # 32 rows on GPUs of 99 KB a block (d = 576: 88 KB). With a variant switch half the keys: ptxas
    # 12.1-13.0.88 spilled 64-key tiles (sm_80, sm_90) and 32 x 32 (sm_89) under the heaviest sets.
    wide = ((64, 32, 4), (32, 16, 2)) if variant else ((64, 64, 4), (64, 32, 4), (32, 32, 2))
    tiles = wide if width > HEAD_DIM_MAX else _candidates(width, dtype, causal, big, profile.arch, True)
    return _first_fitting(
        (dict(head_dim=head_dim, head_dim_v=head_dim_v, head_split=split, dtype=dtype, block_m=m, block_n=n,
              num_warps=w, causal=causal) for m, n, w in tiles),
        profile, f"head_dim={head_dim}, head_dim_v={head_dim_v} {dtype}")


def _first_fitting(candidates, profile: GpuProfile, what: str) -> KernelConfig:
    """The first candidate (KernelConfig fields) that is valid and fits the profile's shared memory.
    Of its pipeline depths (2, then 1 stage) the deeper one is taken unless the shallower one lets
    more blocks share an SM (counting registers as if the kernel took all 255 it may):
    FlashAttention-2 runs d = 128 at 64 KB so that two blocks (8 warps) are resident on an A100; a
    second stage (96 KB) would leave one. A candidate may restrict its depths ("stages")."""
    tried = []
    for fields in candidates:
        fitting = []
        for stages in fields.pop("stages", (2, 1)):
            try:
                cfg = KernelConfig(**fields, num_stages=stages)
            except ValueError:  # e.g. a head_split that does not divide this head dim
                continue
            if cfg.smem_bytes <= profile.smem_per_block_optin:
                fitting.append(cfg)
            else:
                tried.append(cfg.name)
        if fitting:
            # Registers as ptxas may take them under __launch_bounds__(threads, 1): up to 255.
            return max(fitting, key=lambda c: (profile.blocks_per_sm(c.smem_bytes, c.threads, 255), c.num_stages))
    raise ValueError(
        f"no built-in config for {what} fits {profile.name}'s {profile.smem_per_block_optin} bytes of "
        f"shared memory per block; tried {tried}"
    )


def _backward_candidates(head_dim: int, dtype: str, arch: str, variant: bool = False):
    """(block_m, block_n, num_warps, head_split) for the backward, in order of preference.

    Tensor cores: FlashAttention-2's sm80 tiles (csrc/flash_attn/src/flash_bwd_launch_template.h:
    d <= 64 128 x 128 with 8 warps, d <= 128 64 x 128 or 128 x 64, larger d 64 x 64) in its 2D warp
    tiling (KernelConfig.backward_layout), never a head_split (no recomputed MMA). The first choice
    of each range compiles without spills on sm_80 and sm_90 (tests/test_compile.py) except where
    noted: d = 40, 48 take 64 x 128, d = 104, 112 take 64 x 64. Smaller tiles follow for GPUs with
    less shared memory.
    `variant`: a kernel with variant switches, whose band and logits need registers: the first
    choices up to d = 128 spill there (sm_80), so they take the next shape.
    Yields (block_m, block_n, num_warps, head_split[, allowed stage counts])."""
    if dtype == "fp32":  # SIMT: 4 threads share a key row up to d = 128, then 8 (registers)
        for warps in (4, 2):  # 2 warps: half the keys per block, for head dims like 152 on 99 KB GPUs
            for tpr in ((4, 2, 1) if head_dim <= 128 else (8, 4, 2)):
                if (head_dim // 4) % tpr == 0:
                    for block_m in (32, 16):
                        yield block_m, 32 * warps // tpr, warps, 1
        return
    if head_dim <= 64:
        if head_dim not in (40, 48) and not variant:
            yield 128, 128, 8, 1
        yield 64, 128, 8, 1
    elif head_dim <= 128:
        if head_dim == 128 and not variant:  # FA2's 64 x 128, two stages where they fit (A100: 161 of 163 KB)
            yield 64, 128, 8, 1
        if head_dim not in (104, 112) and not variant:
            yield 128, 64, 8, 1
        yield 64, 64, 8, 1
    yield 32, 64, 8, 1
    yield 64, 64, 4, 1
    yield 32, 64, 4, 1
    yield 32, 32, 4, 1
    yield 16, 32, 2, 1


@functools.lru_cache(maxsize=None)
def default_backward_config(head_dim: int, dtype: str, causal: bool, profile: GpuProfile,
                            variant: bool = False, family: str | None = None) -> KernelConfig:
    """The built-in backward config for the profile's arch: the first preferred tile that fits its
    shared memory, with the stage count _first_fitting picks among those the candidate allows.
    `variant` and `family` as for default_config. On sm_90 GPUs the backward (with or without
    `variant`) is the sm90 family's where sm90_backward_applies and the installed NVRTC compiles it
    clean."""
    if _family_wanted(family, sm90_backward_applies(head_dim, dtype, profile), "bwd", dtype, head_dim, causal,
                      profile):
        m, n, w, stages = _sm90_backward_tiles(head_dim, causal)
        return _first_fitting([dict(head_dim=head_dim, dtype=dtype, block_m=m, block_n=n, num_warps=w,
                                    causal=causal, direction="bwd", family="sm90", stages=stages)],
                              profile, f"the backward at head_dim={head_dim} {dtype} (sm90 family)")
    return _first_fitting(
        (dict(head_dim=head_dim, dtype=dtype, block_m=m, block_n=n, num_warps=w, causal=causal, direction="bwd",
              head_split=h, **({"stages": stages[0]} if stages else {}))
         for m, n, w, h, *stages in _backward_candidates(head_dim, dtype, profile.arch, variant)),
        profile, f"the backward at head_dim={head_dim} {dtype}")


def _decode_candidates(head_dim: int, page_size: int | None, variant: bool, gather: bool = False):
    """(block_m, block_n, num_warps, stage counts) of the KV-cache (decode) kernel, in order of
    preference: FlashAttention-2's split-KV tiles (csrc/flash_attn/src/flash_fwd_launch_template.h,
    run_mha_fwd_splitkv_dispatch: 64 query rows, 4 warps, 256 keys at d <= 64, 128 at d <= 128, 64
    above), then narrower key tiles. A paged cache takes only key tiles dividing its page size.
    `variant` (a window, softcap, ALiBi or key bias): 256 keys spill there (sm_80 d = 64, sm_90
    d = 40), so 128 come first, and above d = 192 32 (64 spill from d = 224 with a key bias on sm_80).
    `gather` (pages gathered row by row, the rows' places held through the copies): 256 keys spill
    from d = 40 and 64 at d = 232 (NVRTC 13.5), so 128 come first up to d = 128, 64 up to d = 192,
    then 32; with a variant 64 up to d = 128 (its 128-key tiles sit at 255 registers there), then 32.
    Head dims padded to 240 (232, 240: their 16-byte chunks leave 4- and 2-wide blocks) take half the
    keys: ptxas 12.1 to 13.0.88 spills the packed-query kernel there at 64 keys (sm_90, 44 B) and the
    heavy variant kernels at 32 (4-16 B)."""
    if variant:
        first = 128 if head_dim <= 128 else 64 if head_dim <= 192 else 32
    else:
        first = 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64
    if gather:
        first = min(first, (64 if head_dim <= 128 else 32) if variant else
                    128 if head_dim <= 128 else 64 if head_dim <= 192 else 32)
    if -(-head_dim // 16) * 16 == 240:
        first = min(first, 16 if variant else 32)
    for block_n in (256, 128, 64, 32, 16):
        if block_n <= first and (page_size is None or page_size % block_n == 0):
            yield 64, block_n, 4, (2, 1)


@functools.lru_cache(maxsize=None)
def default_decode_config(head_dim: int, dtype: str, profile: GpuProfile, page_size: int | None = None,
                          variant: bool = False, gather: bool = False, head_dim_v: int | None = None,
                          qv: bool = False) -> KernelConfig:
    """The built-in KV-cache kernel (kvcache on) for one head dim on one GPU: the first preferred
    tile that fits, stages as _first_fitting picks them. `variant`: the kernel will carry a window,
    softcap or ALiBi; `gather`: it will gather a paged cache's rows (page_size then None; see
    _decode_candidates). The variant, paging and split switches themselves are the caller's to set.
    `head_dim_v`: V's head dim where it differs: O shared among head_split blocks as _wide_v_config
    shares it, the tiles those of the wider of the head dims a block holds. `qv`: FlashAttention-3's, the
    sm90 family's switch (its tiles then hold qv's rows and all of V's columns)."""
    split, width = 1, head_dim
    if head_dim_v is not None and head_dim_v != head_dim:
        split, width = _o_split(head_dim, head_dim_v)
    if sm90_applies(head_dim, dtype, profile) and (head_dim_v or head_dim) % 16 == 0:
        return _sm90_decode_config(head_dim, head_dim_v, split, dtype, profile, page_size, variant, gather, qv)
    return _first_fitting(
        (dict(head_dim=head_dim, head_dim_v=head_dim_v, head_split=split, dtype=dtype, block_m=m, block_n=n,
              num_warps=w, kvcache=True, stages=stages)
         for m, n, w, stages in _decode_candidates(width, page_size, variant, gather)),
        profile, f"the KV-cache kernel at head_dim={head_dim}"
        + (f", head_dim_v={head_dim_v}" if head_dim_v not in (None, head_dim) else "") + f" {dtype}")


def _sm90_decode_config(head_dim: int, head_dim_v: int | None, split: int, dtype: str, profile: GpuProfile,
                        page_size: int | None, variant: bool, gather: bool = False, qv: bool = False) -> KernelConfig:
    """The sm90 family's KV-cache kernel: one consumer warpgroup of 64 rows (a decode step's rows are
    its queries times the query heads folded in, often fewer), the most keys a tile up to 176 (FA3's
    split kernel's at d = 128) whose S, P and O take at most 200 of its 256 registers a thread (O's
    columns / 2 + 3 keys / 4, as _sm90_wide_v_config counts them) and that divide a paged cache's
    pages, and the deepest pipeline of 2 to 4 K and V stages that fits: decoding reads the cache once,
    so stages are what keep its loads in flight. Intra-warpgroup overlap on, as in the forward. At
    d = 128: 64 x 176, two stages (paged: 64 x 128, pages of 128 or more). `variant` (a window, softcap,
    ALiBi or key bias): at most 128 keys (window, softcap and ALiBi together spill 160 and 176 at d = 96
    to 192, NVRTC 13.5), and 80 above d = 192 where `gather` copies the rows (every switch at once
    spilled 96 at d = 256; V of its own beside d = 64 or 128 did not). Gathered pages take any key count.
    `qv` beside a variant: at most 80 keys, 32 where two blocks share O (window, softcap and ALiBi
    together spilled 96 at (64, 256) and 48 at (64, 512), NVRTC 13.5 and 13.0.88)."""
    o_cols = (head_dim_v or head_dim) // split
    most = 80 if variant and gather and head_dim > 192 else 128 if variant else 176
    if qv and variant:
        most = min(most, 80 if split == 1 else 32)
    keys = [n for n in range(most, 15, -16)
            if o_cols // 2 + 3 * n // 4 <= 200 and (page_size is None or page_size % n == 0)]
    return _first_fitting([dict(head_dim=head_dim, head_dim_v=head_dim_v, head_split=split, dtype=dtype, block_m=64,
                                block_n=n, num_warps=4, family="sm90", overlap=True, kvcache=True, qv=qv,
                                stages=(4, 3, 2)) for n in keys],
                          profile, f"the KV-cache kernel at head_dim={head_dim}"
                          + (f", head_dim_v={head_dim_v}" if head_dim_v not in (None, head_dim) else "")
                          + f" {dtype} (sm90 family)")


def _valid(config: KernelConfig, **changes) -> KernelConfig | None:
    """config.replace(**changes), or None where the result is not a valid config."""
    try:
        return config.replace(**changes)
    except ValueError:
        return None


def call_default(direction: str, head_dim: int, dtype: str, causal: bool, switches: dict,
                 profile: GpuProfile, head_dim_v: int | None = None) -> KernelConfig:
    """The built-in kernel of a call: the direction's default for its problem with the call's variant
    switches (Variant.switches: align and VARIANTS) turned on. The sm90 family's plain default where it
    is the GPU's (a window takes the causal tiles, as FlashAttention-3's is_causal or is_local; in the
    forward a key bias beside softcap or ALiBi fewer keys a tile, _sm90_biased_keys; the backward with
    a variant fewer queries a step, _sm90_variant_tiles); else the sm80 family's, with the tiles for
    variant kernels where any switch is on. Forward attention chunks beside a score modifier take fewer
    keys a tile on either family (_chunked_keys). A forward whose V head dim differs (head_dim_v) takes
    _sm90_wide_v_config's kernel where the sm90 family runs it, else _wide_v_config's; its tiles' keys
    are cut for the wider of its head dims. Its backward takes the wider head dim's tiles: on the sm90
    family with both head dims (head_dim_v), else the sm80 family's kernel at the wider head dim, which
    the launcher runs on the narrower side zero-padded."""
    default = default_config if direction == "fwd" else default_backward_config
    banded = causal or bool(switches.get("window"))
    wide_v = {"head_dim_v": head_dim_v} if head_dim_v not in (None, head_dim) else {}
    if direction == "bwd" and wide_v:  # the wider head dim's tiles; the sm90 family's kernel takes both
        width = max(head_dim, head_dim_v)
        plain = default(width, dtype, banded, profile)
        if plain.family != "sm90":  # the caller zero-pads the narrower side (flash_backward)
            return call_default(direction, width, dtype, causal, switches, profile)
        plain = plain.replace(**_sm90_variant_tiles(width, plain.block_m, switches))
        # dQ^T's query columns split between the warpgroups where Q's head dim is one row of 64: whole k
        # steps each (80 queries a step at the width 128 take 64, 48 take 32)
        plain = next(c for c in (_valid(plain, head_dim=head_dim, head_dim_v=head_dim_v, block_m=m)
                                 for m in (plain.block_m, plain.block_m // 32 * 32)) if c is not None)
        deeper = plain.replace(num_stages=2)  # the narrower side's tiles may leave room for a second stage
        plain = deeper if deeper.smem_bytes <= profile.smem_per_block_optin else plain
        return plain.replace(causal=causal, **switches)
    plain = default(head_dim, dtype, banded, profile, **wide_v)
    if plain.family == "sm90":  # the plain tiles take the switches
        if direction == "fwd":  # the wider of the head dims a block holds sets its registers
            width = max(head_dim, plain.o_columns)
            if switches.get("key_bias") and (switches.get("softcap") or switches.get("alibi")):
                plain = plain.replace(block_n=_sm90_biased_keys(width, plain.block_n))
            plain = plain.replace(block_n=_chunked_keys("sm90", width, plain.block_n, switches))
        else:  # the backward's block_n is its consumer warpgroups' keys: fewer queries a step instead
            plain = plain.replace(**_sm90_variant_tiles(head_dim, plain.block_m, switches))
            on = tuple(f for f in VARIANTS if switches.get(f))
            if on and stack_spill(profile.arch, "sm90", "bwd", dtype, head_dim, causal,
                                  (plain.block_m, plain.block_n, plain.num_warps), switches=on):
                plain = plain.replace(block_m=64)  # the installed NVRTC spills these tiles
        return plain.replace(causal=causal, **switches)
    heavy = switches.get("align", "top_left") != "top_left" or any(switches.get(f) for f in VARIANTS)
    config = default(head_dim, dtype, banded, profile, heavy, **wide_v)
    if direction == "fwd":  # the wider of the head dims a block holds (O's columns: head_dim's padded to 16 alone)
        width = max(head_dim, config.o_columns)
        config = config.replace(block_n=_chunked_keys("sm80", width, config.block_n, switches))
    return config.replace(causal=causal, **switches)
