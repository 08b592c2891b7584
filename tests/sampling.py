"""How a test run samples a grid: all of it under AUTOFLASH_SWEEP=full, else one case per key plus
SHARE of the rest, drawn from a seed printed in pytest's header and summary (AUTOFLASH_SWEEP_SEED=N
replays a run). conftest.py samples the emulated sweeps with it, tests/test_compile.py its NVRTC grid."""
import os
import random
import time

SHARE = 0.04  # of a grid's cases beyond one per key (CI on 2 cores: 56 min at 0.06 with the sm90 backward)
SEED = int(os.environ.get("AUTOFLASH_SWEEP_SEED") or time.time_ns() % 2**31)
# pytest-xdist's workers inherit it (conftest imports this module before they start): every worker
# must collect the same sampled cases.
os.environ["AUTOFLASH_SWEEP_SEED"] = str(SEED)
FULL = os.environ.get("AUTOFLASH_SWEEP", "").lower() == "full"


def keep(items: list, key) -> list[bool]:
    """For each item (in order), whether this run keeps it; `key(item)` groups the items."""
    if FULL:
        return [True] * len(items)
    rng = random.Random(SEED)
    groups: dict = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    kept = [False] * len(items)
    for k in sorted(groups, key=str):
        members = groups[k]
        first = rng.randrange(len(members))
        for j, i in enumerate(members):
            kept[i] = j == first or rng.random() < SHARE
    return kept
