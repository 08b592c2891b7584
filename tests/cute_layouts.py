"""CuTe's own definitions of the wgmma (sm_90 GMMA) layouts, read as text from the `nvidia-cutlass` wheel
(a test dependency: its headers are read, never compiled or copied) and evaluated here, as an
independent statement of what the emulator's wgmma must do:

- the accumulator and register-A fragments, `CLayout_64xN` and `ALayout_64x16` of
  cute/atom/mma_traits_sm90_gmma.hpp: (thread, value) -> m + 64 * (n or k);
- the shared-memory layout a descriptor describes, the canonical layouts in the comment above
  `make_gmma_desc` (per major and swizzle, in elements, LBO and SBO as strides), composed with
  `Swizzle<B,4,3>` on byte addresses as cute/swizzle.hpp defines `apply`.

A CuTe layout maps a coordinate to an offset: each mode's index is split colexicographically over its
shape (first sub-mode fastest) and dotted with its strides."""
from __future__ import annotations

import math
import re
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cute_dir() -> Path:
    import cutlass_library

    path = Path(cutlass_library.__file__).parent / "source" / "include" / "cute"
    if not path.is_dir():
        raise FileNotFoundError(f"CuTe headers: got no {path}; expected the nvidia-cutlass wheel's")
    return path


def _split(text: str) -> list[str]:
    """Top-level comma-separated items of `text`."""
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch in "(<":
            depth += 1
        elif ch in ")>":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return items + [cur]


def parse_tuple(text: str, env: dict):
    """'((T,8,m),(8,k))' with symbols from env -> nested tuples of ints ('8T' is 8 * T)."""
    text = text.strip()
    if text.startswith("("):
        return tuple(parse_tuple(item, env) for item in _split(text[1:-1]))
    m = re.fullmatch(r"(\d*)\s*([A-Za-z_]\w*)?", text)
    if not m or not (m.group(1) or m.group(2)):
        raise ValueError(f"CuTe layout term: got {text!r}")
    factor = int(m.group(1)) if m.group(1) else 1
    return factor * (env[m.group(2)] if m.group(2) else 1)


def parse_cpp_layout(text: str, env: dict):
    """'Layout<Shape<Shape<_4,_8,_4>,Shape<_2,_2,Int<N/8>>>, Stride<...>>' -> (shape, stride)."""
    def node(t: str):
        t = t.strip()
        m = re.fullmatch(r"(Shape|Stride)\s*<(.*)>", t, re.S)
        if m:
            return tuple(node(item) for item in _split(m.group(2)))
        m = re.fullmatch(r"_(\d+)", t)
        if m:
            return int(m.group(1))
        m = re.fullmatch(r"Int\s*<(.*)>", t, re.S)
        if m:
            return int(eval(m.group(1), {}, dict(env)))  # an arithmetic expression of the template's ints
        raise ValueError(f"CuTe layout node: got {t!r}")

    m = re.fullmatch(r"Layout\s*<(.*)>", text.strip(), re.S)
    shape, stride = _split(m.group(1))
    return node(shape), node(stride)


def _flat(t):
    return [x for item in t for x in _flat(item)] if isinstance(t, tuple) else [t]


def evaluate(shape, stride, index: int) -> int:
    """The offset of linear `index` in the layout (colexicographic over the flattened shape)."""
    offset = 0
    for size, step in zip(_flat(shape), _flat(stride)):
        offset += (index % size) * step
        index //= size
    return offset


def mode_size(shape) -> int:
    return math.prod(_flat(shape))


def swizzle(bits: int, base: int, shift: int, offset: int) -> int:
    """cute::Swizzle<B,M,S>::apply: offset ^ ((offset & yyy_msk) >> S), yyy_msk = (2^B - 1) << (M + S)."""
    yyy = ((1 << bits) - 1) << (base + shift)
    return offset ^ ((offset & yyy) >> shift)


# ------------------------------------------------------------------ fragments
def _template_layout(name: str) -> str:
    text = (cute_dir() / "atom" / "mma_traits_sm90_gmma.hpp").read_text()
    m = re.search(rf"using\s+{name}\s*=\s*(Layout\s*<.*?>)\s*;", text, re.S)
    if not m:
        raise ValueError(f"CuTe: no `using {name} = Layout<...>` in mma_traits_sm90_gmma.hpp")
    return m.group(1)


def accumulator_owner(n: int) -> dict[tuple[int, int], tuple[int, int]]:
    """{(thread, value): (m, n)} of CLayout_64xN (its template, with N = n)."""
    shape, stride = parse_cpp_layout(_template_layout("CLayout_64xN"), {"N": n})
    threads, values = mode_size(shape[0]), mode_size(shape[1])
    out = {}
    for t in range(threads):
        for v in range(values):
            off = evaluate(shape[0], stride[0], t) + evaluate(shape[1], stride[1], v)
            out[(t, v)] = (off % 64, off // 64)
    return out


def register_a_owner() -> dict[tuple[int, int], tuple[int, int]]:
    """{(thread, half): (m, k)} of ALayout_64x16 (16-bit A in registers, low half first)."""
    shape, stride = parse_cpp_layout(_template_layout("ALayout_64x16"), {})
    out = {}
    for t in range(mode_size(shape[0])):
        for v in range(mode_size(shape[1])):
            off = evaluate(shape[0], stride[0], t) + evaluate(shape[1], stride[1], v)
            out[(t, v)] = (off % 64, off // 64)
    return out


# ------------------------------------------------------------------ shared memory
SWIZZLE_NAMES = {"INTERLEAVE": 0, "B32": 1, "B64": 2, "B128": 3}  # bits B of Swizzle<B,4,3>


@lru_cache(maxsize=1)
def canonical_layouts() -> dict[tuple[str, str], tuple[int, str, str]]:
    """{(major, layout type): (swizzle bits B, shape text, stride text)} from the comment above
    make_gmma_desc (the element-unit forms, T = 16 bytes / element size)."""
    text = (cute_dir() / "atom" / "mma_traits_sm90_gmma.hpp").read_text()
    comment = text[text.index("// make_gmma_desc<Major::MN> //"):text.index("make_gmma_desc(Tensor<TEngine,TLayout>")]
    out, major = {}, None
    for line in comment.splitlines():
        if "make_gmma_desc<Major::MN>" in line:
            major = "MN"
        elif "make_gmma_desc<Major::K>" in line:
            major = "K"
        m = re.search(r"LayoutType::(\w+)\s*:\s*Swizzle<(\d),4,3>\s*o\s*smem_ptr\s*o\s*(\(.*\))\s*:\s*(\(.*\))\s*$", line)
        if m and major and (major, m.group(1)) not in out:
            out[(major, m.group(1))] = (int(m.group(2)), m.group(3), m.group(4))
    if len(out) != 8:
        raise ValueError(f"CuTe: expected 8 canonical GMMA layouts above make_gmma_desc, found {sorted(out)}")
    return out


def smem_byte(major: str, layout: str, rows: int, r: int, kk: int, lbo: int, sbo: int, elem: int = 2) -> int:
    """Byte offset (from a tile starting on its swizzle pattern's boundary) of element (r along M/N,
    kk along K) of a rows x 16 operand in the canonical layout, LBO and SBO in elements."""
    return smem_bytes(major, layout, rows, lbo, sbo, elem)[r][kk]


@lru_cache(maxsize=256)
def smem_bytes(major: str, layout: str, rows: int, lbo: int, sbo: int, elem: int = 2) -> tuple:
    """smem_byte of every element, as rows tuples of 16."""
    bits, shape_text, stride_text = canonical_layouts()[(major, layout)]
    t = 16 // elem
    env = {"T": t, "LBO": lbo, "SBO": sbo}
    if major == "MN":  # ((T,W/16,m),(8,k)): m and k from the tile
        env["m"] = rows // (t * (1 << bits))
        env["k"] = 16 // 8
    else:  # ((8,m),(T,2))
        env["m"] = rows // 8
    shape, stride = parse_tuple(shape_text, env), parse_tuple(stride_text, env)
    assert mode_size(shape[0]) == rows and mode_size(shape[1]) == 16, (shape, rows)
    return tuple(tuple(swizzle(bits, 4, 3, (evaluate(shape[0], stride[0], r) + evaluate(shape[1], stride[1], kk)) * elem)
                       for kk in range(16)) for r in range(rows))


def swizzle_bits(layout: str) -> int:
    return canonical_layouts()[("K", layout)][0]
