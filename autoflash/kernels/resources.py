"""Where the shipped data lives: templates/ and tuned/ sit inside the package in a wheel and at the
repository root in a checkout (editable install or plain PYTHONPATH)."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # autoflash/


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


def user_tuned_dir() -> Path:
    """The per-user table folder: $XDG_DATA_HOME/autoflash/tuned, else ~/.local/share/autoflash/tuned."""
    import os

    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "autoflash" / "tuned"


def checkout_tuned_dir() -> Path | None:
    """tuned/ of a source checkout (where tables are committed), or None for an installed wheel."""
    root = _PACKAGE.parent
    return root / "tuned" if (root / "pyproject.toml").is_file() and (root / "tuned").is_dir() else None


def default_tune_output() -> Path:
    """Where `python -m autoflash.tune` writes without --out: $AUTOFLASH_TUNED_DIR, else the checkout's
    tuned/, else the per-user folder (an installed package's own folder is not the user's to write)."""
    import os

    if os.environ.get("AUTOFLASH_TUNED_DIR"):
        return Path(os.environ["AUTOFLASH_TUNED_DIR"])
    return checkout_tuned_dir() or user_tuned_dir()
