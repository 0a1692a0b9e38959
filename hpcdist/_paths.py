"""Where data shipped with hpcdist lives: inside the installed package, or the source tree."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """`templates` or `site_configs`: packaged copy when installed, the repo's folder otherwise."""
    packaged = _PKG / name
    if packaged.is_dir():
        return packaged
    return _PKG.parent / name
