"""Benchmarks: the kernels against torch SDPA's backends on a GPU (kernels.py), autoflash.attention's
per-call overhead (dispatch.py), a small model trained on both (train.py), the host emulator's speed
(emulator.py), decode steps over a KV cache against SDPA (decode.py), a static SASS side-by-side with FlashAttention-2 in torch's wheel (sass.py, no GPU),
FlashAttention-3's own test file run against autoflash on the emulator (peer_tests.py, no GPU);
CUDA-event timing shared with the tuner (timing.py) and the reports (report.py).

    python -m autoflash.bench [--help]            # the kernel benchmark (GPU)
    python -m autoflash.bench dispatch|train|emulator|sass|decode|peer-tests --help
"""
from __future__ import annotations

import sys

SUBCOMMANDS = {"dispatch": "autoflash.bench.dispatch", "train": "autoflash.bench.train",
               "emulator": "autoflash.bench.emulator", "sass": "autoflash.bench.sass", "decode": "autoflash.bench.decode",
               "peer-tests": "autoflash.bench.peer_tests"}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    name = SUBCOMMANDS.get(argv[0], "autoflash.bench.kernels") if argv else "autoflash.bench.kernels"
    rest = argv[1:] if argv and argv[0] in SUBCOMMANDS else argv
    return importlib.import_module(name).main(rest)
