"""Where torch and Triton keep what they compile for a rank: this user's own 0700 folders in the
site's scratch, never a folder another user could have made first.

torch's defaults are ``/tmp/torchinductor_$USER`` (generated code and FX-graph pickles that later
runs load), ``~/.triton/cache`` (kernels as shared objects), ``~/.cache/torch_extensions`` (C++
extensions) and ``~/.cache/torch/kernels`` (CUDA's JIT kernels). On a shared node another user
makes ``/tmp/torchinductor_alice`` before alice's first compile, and torch uses it without
looking at its owner; a shared ``$HOME`` is the same. So every rank (each job kind's, an
``hpcdist.Executor`` call's, ``hpcdist.init()``'s outside a job) sets each variable the user
did not set to its folder of ``JobPaths.cache`` (``<scratch>/<user>/<name>``), made 0700 and
checked to be this user's (``hpcdist.files.trust.private_folder``) before torch is imported.
A value the user set stands (the site's ``env:``, the job's, the shell's), except the one torch
writes back itself, its own default: that is no one's choice.

A rank hpcdist starts (not a script's own process under ``hpcdist.init()``) also gets a private
``TMPDIR`` unless one is set: a fresh 0700 folder of the node's temporary folder (``mkdtemp``,
an unpredictable name), removed when the rank ends. torch writes other things under
``tempfile.gettempdir()``: a memo of padded matmuls under ``/tmp/torchinductor_$USER/cache``
whatever ``TORCHINDUCTOR_CACHE_DIR`` says, debugging dumps, the vendored CuTe kernels' cache.
"""

from __future__ import annotations

import atexit
import getpass
import os
import re
import shutil
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcdist.config.paths import JobPaths

COMPILE_VAR = "TORCHINDUCTOR_CACHE_DIR"
# each variable, and the name of its folder in this user's scratch
CACHES = {
    COMPILE_VAR: "torchinductor",
    "TRITON_CACHE_DIR": "triton",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "PYTORCH_KERNEL_CACHE_PATH": "torch_kernels",
}
TMP_VAR = "TMPDIR"


def torch_default() -> str:
    """torch's own ``TORCHINDUCTOR_CACHE_DIR`` (``cache_dir_utils.default_cache_dir``), which torch
    writes into the environment once anything asks for it; computed without importing torch."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def use_private(paths: JobPaths, env: MutableMapping[str, str] | None = None) -> dict[str, Path]:
    """Each cache variable in `env` (``os.environ``) that the user did not set pointed at this
    user's own 0700 folder of `paths`; the folder each variable names now. UntrustedFileError
    when such a folder is not this user's."""
    from hpcdist.files.trust import private_folder

    env = os.environ if env is None else env
    used = {}
    for var, name in CACHES.items():
        value = env.get(var, "")
        if value and not (var == COMPILE_VAR and value == torch_default()):
            used[var] = Path(value)
            continue
        used[var] = private_folder(paths.cache(name))
        env[var] = str(used[var])
    return used


def private_tmp(env: MutableMapping[str, str] | None = None) -> Path | None:
    """A ``TMPDIR`` of this rank's own (module docstring) unless one is set; removed at exit.
    The folder made, or None."""
    env = os.environ if env is None else env
    if env.get(TMP_VAR):
        return None
    folder = Path(tempfile.mkdtemp(prefix=f"hpcdist-{os.geteuid()}-"))
    env[TMP_VAR] = str(folder)
    tempfile.tempdir = None  # gettempdir() asks the environment again
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def for_rank(paths: JobPaths, env: MutableMapping[str, str] | None = None) -> dict[str, Path]:
    """What a rank hpcdist starts sets before torch is imported: the caches, then its ``TMPDIR``."""
    used = use_private(paths, env)
    private_tmp(env)
    return used
