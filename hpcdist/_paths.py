"""Where data shipped with hpcdist lives: inside the installed package, or the source tree."""

from __future__ import annotations

import os
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """`templates` or `site_configs`: packaged copy when installed, the repo's folder otherwise."""
    packaged = _PKG / name
    if packaged.is_dir():
        return packaged
    return _PKG.parent / name


def cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/hpcdist/NAME`` (``~/.cache/hpcdist/NAME``): what hpcdist may throw away
    and make again, such as compiled templates (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "hpcdist" / name
