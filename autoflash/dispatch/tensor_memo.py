"""Answers remembered per tensor, by its identity and version counter: a model hands every layer of a
forward the same mask tensor, so what the layers ask of it (is it a key-padding mask, its padding as
kernel arguments) is worked out once per forward, and an in-place change of the tensor is seen."""
from __future__ import annotations

import weakref

import torch

MISSING = object()


class TensorMemo:
    """{tensor (and a hashable key): value}, entries dropped once their tensor is gone."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}  # id(tensor) -> (weakref to it, (version, key), value)

    @staticmethod
    def _version(t: torch.Tensor) -> int | None:
        try:
            return t._version
        except RuntimeError:  # an inference-mode tensor has no version counter: never remembered
            return None

    def get(self, t: torch.Tensor, key=()):
        """The value remembered for `t` as it is now (and `key`), else MISSING."""
        version = self._version(t)
        entry = self._entries.get(id(t))
        if version is None or entry is None or entry[0]() is not t or entry[1] != (version, key):
            return MISSING
        return entry[2]

    def put(self, t: torch.Tensor, value, key=()) -> None:
        version = self._version(t)
        if version is None:
            return
        for stale in [i for i, entry in self._entries.items() if entry[0]() is None]:
            del self._entries[stale]
        self._entries[id(t)] = (weakref.ref(t), (version, key), value)

    def clear(self) -> None:
        self._entries.clear()
