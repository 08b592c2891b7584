"""Where the shipped data lives: templates/ and tuned/ sit inside the package in a wheel and at the
repository root in a checkout (editable install or plain PYTHONPATH)."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"autoflash data folder {name!r} not found; looked in {_PACKAGE / name} and {_PACKAGE.parent / name}"
    )


def templates_dir() -> Path:
    return _find("templates")


def tuned_dir() -> Path:
    return _find("tuned")
