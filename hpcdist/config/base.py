"""What every config model is built on (both sides): the frozen base that refuses unknown keys,
and a path as users write it (``~`` and ``$VARS`` expanded, made absolute at load time)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict


def _expand_path(value: object) -> object:
    """`~` and `$VARS` are expanded and relative paths made absolute at load time."""
    if isinstance(value, str):
        return Path(os.path.expandvars(os.path.expanduser(value))).absolute()
    return value


# A path written by a user in a site config or job params (shared by storage roots and job params).
ExpandedPath = Annotated[Path, BeforeValidator(_expand_path)]


class Frozen(BaseModel):
    """Base of every config and job-params model: immutable, and unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)
