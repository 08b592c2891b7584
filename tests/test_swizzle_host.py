"""The swizzled shared-memory layout (templates/common/smem_tile.cuh), checked on the host: g++
compiles the real header with the CUDA qualifiers defined away, then a small program proves for
every tile shape the kernels can use that the loaders cover each chunk exactly once, that the
ldmatrix addresses agree with the layout, and that no access phase has a bank conflict."""
import shutil
import subprocess
from pathlib import Path

import pytest

import sampling

from autoflash.kernels.resources import templates_dir

HERE = Path(__file__).resolve().parent
ROWS = (16, 48, 64, 80, 128, 256)
CHUNKS = tuple(range(4, 66, 2))  # d_pad / 8 for fp16/bf16 (4..32), d / 4 for fp32 (8..64)
THREADS = (64, 128, 256)
ALL_SHAPES = [(r, c, t) for r in ROWS for c in CHUNKS for t in THREADS]
# Each shape is a template instance of the checker (all 558 take g++ ~110 s): per run one shape per
# (rows, threads), its chunks drawn from the seed; all of them under AUTOFLASH_SWEEP=full.
SHAPES = sampling.sample(ALL_SHAPES, lambda s: (s[0], s[2]), salt="swizzle")

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    out = tmp_path_factory.mktemp("swizzle")
    (out / "shapes.inc").write_text("".join(f"SHAPE({r}, {c}, {t})\n" for r, c, t in SHAPES))
    exe = out / "swizzle_check"
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", str(templates_dir()), "-I", str(out),
                    str(HERE / "host" / "swizzle_check.cpp"), "-o", str(exe)], check=True)
    return exe


@pytest.mark.parametrize("rows, chunks, threads", SHAPES, ids=lambda x: str(x))
def test_tile_layout(checker, rows, chunks, threads):
    r = subprocess.run([str(checker), str(rows), str(chunks), str(threads)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout


def test_checker_catches_an_unswizzled_layout(tmp_path):
    """The same program against a header without the XOR swizzle must report bank conflicts."""
    (tmp_path / "common").mkdir()
    src = (templates_dir() / "common" / "smem_tile.cuh").read_text()
    broken = src.replace("return chunk_in_block ^ ((row / (8 / W)) & (W - 1));", "return chunk_in_block;")
    assert broken != src
    (tmp_path / "common" / "smem_tile.cuh").write_text(broken)
    (tmp_path / "common" / "types.cuh").write_text((templates_dir() / "common" / "types.cuh").read_text())
    (tmp_path / "shapes.inc").write_text("SHAPE(64, 12, 128)\n")
    exe = tmp_path / "broken"
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", str(tmp_path), str(HERE / "host" / "swizzle_check.cpp"),
                    "-o", str(exe)], check=True)
    r = subprocess.run([str(exe), "64", "12", "128"], capture_output=True, text=True)
    assert r.returncode == 1 and "bank conflict" in r.stdout, r.stdout
