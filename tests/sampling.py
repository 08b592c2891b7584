"""How a test run samples a grid: all of it under AUTOFLASH_SWEEP=full, else a budget of cases per grid
spread over its keys, drawn from a seed printed in pytest's summary (AUTOFLASH_SWEEP_SEED=N replays a
run). conftest.py samples the emulated sweeps with it (CASES per sweep), tests/test_compile.py its
NVRTC grid, tests/test_emulation.py the every-default sanitizer sweep.

A run's budget is what keeps the suite under 20 minutes on 2 cores with cold caches: each emulated
case builds its kernel for the host and runs a whole grid of fibers (~5-15 s), and the sweeps hold
~4,500 of them. The keys a run does not reach, later runs do (the seed changes per run)."""
import os
import random
import time

# Emulated cases per sweep and run: one per key for this many keys, drawn in a seeded order
# (AUTOFLASH_SWEEP_CASES=N changes it; at 8 the nine sweeps' tests took ~290 s, summed over both
# workers, of a 20-minute run).
CASES = int(os.environ.get("AUTOFLASH_SWEEP_CASES") or 4)
SEED = int(os.environ.get("AUTOFLASH_SWEEP_SEED") or time.time_ns() % 2**31)
# pytest-xdist's workers inherit it (conftest imports this module before they start): every worker
# must collect the same sampled cases.
os.environ["AUTOFLASH_SWEEP_SEED"] = str(SEED)
FULL = os.environ.get("AUTOFLASH_SWEEP", "").lower() == "full"


def keep(items: list, key, budget: int | None = None, salt: str = "") -> list[bool]:
    """For each item (in order), whether this run keeps it; `key(item)` groups the items. With a
    budget: one item of each of `budget` keys (all keys, one each, when there are fewer), keys and
    items drawn from the seed (salted by `salt`: each grid its own draw). Without one: one item of
    every key."""
    if FULL:
        return [True] * len(items)
    rng = random.Random(f"{SEED}:{salt}")
    groups: dict = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    keys = sorted(groups, key=str)
    rng.shuffle(keys)
    kept = [False] * len(items)
    for k in keys[:len(keys) if budget is None else budget]:
        kept[rng.choice(groups[k])] = True
    return kept


def sample(items, key, budget: int | None = None, salt: str = "") -> list:
    """The items this run keeps (keep's draw), in order."""
    items = list(items)
    return [item for item, kept in zip(items, keep(items, key, budget, salt)) if kept]
