"""What torch compiles for a member's job lives in her own 0700 scratch, not in ``/tmp`` (issue 54,
item 3): bob makes ``/tmp/torchinductor_<alice>`` first, 0777, before alice's ``python`` job, her
``hpcdist.Executor`` call and her script's ``hpcdist.init()`` run; none of them points torch at
it. Run as the test bed's ordinary users (cluster/users.sh): root ignores file modes."""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.members import as_user, require_members

# argv[1]: "job" (a python job's rank), "executor" (submits where() as a direct Executor call) or "init"
SCRIPT = """
import json, os, sys, tempfile

def where():
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir, triton_cache_dir
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "PYTORCH_KERNEL_CACHE_PATH")
    return {**{n: os.environ.get(n) for n in names}, "inductor": cache_dir(), "memo": default_cache_dir(),
            "triton": triton_cache_dir(0), "tmp": tempfile.gettempdir()}

if sys.argv[1] == "executor":
    import hpcdist
    got = hpcdist.Executor(site="local", time_min=5).submit(where).result()
elif sys.argv[1] == "init":
    import hpcdist
    hpcdist.init()
    got = where()
else:
    got = where()
print("WHERE " + json.dumps(got), flush=True)
"""


@pytest.fixture
def work() -> Iterator[tuple[Path, str]]:
    """alice's working folder (the local site's hpcdist-out/ goes there), and the name her jobs
    run under ($USER, which torch's default folder is named after): unique to this test, so bob's
    planted /tmp/torchinductor_<name> is this test's own, and removed after it."""
    require_members()
    tag = uuid.uuid4().hex[:8]
    top, name = Path(f"/tmp/hpcdist-t-{tag}"), f"alice{tag}"
    top.mkdir(mode=0o755)
    shutil.chown(top, "alice")
    (top / "where.py").write_text(SCRIPT)
    shutil.chown(top / "where.py", "alice")
    try:
        yield top, name
    finally:
        shutil.rmtree(top, ignore_errors=True)
        shutil.rmtree(f"/tmp/torchinductor_{name}", ignore_errors=True)


def _where(text: str) -> dict[str, Any]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("WHERE ")]
    return dict(json.loads(line[len("WHERE "):]))


def _is_alices_private(folder: str) -> None:
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == Path("/home/alice").stat().st_uid, folder
    assert stat.S_IMODE(st.st_mode) == 0o700, (folder, oct(st.st_mode))


def test_no_job_of_alices_compiles_into_the_folder_bob_made_for_her_in_tmp(work: tuple[Path, str]) -> None:
    top, name = work
    planted = Path(f"/tmp/torchinductor_{name}")
    plant = ("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777); "
             "open(os.path.join(sys.argv[1], 'bobs.py'), 'w').write('# generated code\\n')")
    assert as_user("bob", "-c", plant, str(planted)).code == 0
    env = {"USER": name, "LOGNAME": name}
    scratch = top / "hpcdist-out" / "scratch"

    job = as_user("alice", "-m", "hpcdist.cli", "submit", "--site", "local", "--wait", "--",
                  str(top / "where.py"), "job", cwd=top, env=env)
    assert job.code == 0 and "1/1 ranks succeeded" in job.out, job.text
    logs = "".join(p.read_text() for p in (top / "hpcdist-out" / "logs" / "where").glob("*/*_0_log.out"))
    called = as_user("alice", str(top / "where.py"), "executor", cwd=top, env=env)
    assert called.code == 0, called.text
    mine = str(top / "triton-of-mine")  # a value alice set stands
    script = as_user("alice", str(top / "where.py"), "init", cwd=top, env={**env, "TRITON_CACHE_DIR": mine})
    assert script.code == 0, script.text

    for what, got in (("job", _where(logs)), ("executor", _where(called.out)), ("init", _where(script.out))):
        assert got["TORCHINDUCTOR_CACHE_DIR"] == got["inductor"] == str(scratch / "torchinductor"), (what, got)
        assert got["TRITON_CACHE_DIR"] == got["triton"] == (mine if what == "init" else str(scratch / "triton"))
        assert got["TORCH_EXTENSIONS_DIR"] == str(scratch / "torch_extensions"), (what, got)
        assert got["PYTORCH_KERNEL_CACHE_PATH"] == str(scratch / "torch_kernels"), (what, got)
        if what != "init":  # a rank hpcdist starts: its own TMPDIR, so torch's memo is not in bob's folder either
            assert got["tmp"].startswith("/tmp/hpcdist-") and got["memo"].startswith(got["tmp"] + "/"), (what, got)
            assert not os.path.exists(got["tmp"]), got["tmp"]  # removed when the rank ended
    for folder in ("torchinductor", "triton", "torch_extensions", "torch_kernels"):
        _is_alices_private(str(scratch / folder))
    assert [p.name for p in planted.iterdir()] == ["bobs.py"]  # nothing of alice's went into bob's folder
