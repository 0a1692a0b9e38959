"""Other Slurm releases beside the 22.05 test bed (cluster/releases.sh): clusters whose daemons and
commands are that release, each run from a Debian root of the suite that ships it. A client reaches
one through ``release_env(release)``: that release's commands first on PATH, its SLURM_CONF.

- ``24.11``: Debian trixie's slurm-wlm, cluster ``r2411``, partition ``main`` on nodes t1, t2
- ``26.05``: Debian forky's slurm-wlm, cluster ``r2605``, partition ``main`` on nodes u1, u2

`make cluster-up` starts them (cluster/releases.sh up); a test of one fails under `make test`
(HPCDIST_REQUIRE_SLURM=1) when it does not answer, and is skipped elsewhere, saying how to start it."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

from tests.support.cli import missing
from tests.support.members import Member, member_in, require_members

RELEASES = ("24.11", "26.05")
CLUSTERS = {"24.11": "r2411", "26.05": "r2605"}
NODES = {"24.11": ("t1", "t2"), "26.05": ("u1", "u2")}
RELEASES_STATE = os.environ.get("HPCDIST_SLURM_RELEASES_STATE", "/var/tmp/hpcdist-releases")
RELEASES_ETC = "/etc/slurm-releases"
USER_PATH = "/usr/local/bin:/usr/bin:/bin"  # what tests/support/members.run_as gives a user


def release_env(release: str, path: str = USER_PATH) -> dict[str, str]:
    """The environment a client needs to reach release `release`: its wrappers first on `path`."""
    if release not in RELEASES:
        raise ValueError(f"no Slurm release {release!r} on the test bed; releases are {', '.join(RELEASES)}")
    return {"PATH": f"{RELEASES_STATE}/{release}/bin:{path}", "SLURM_CONF": f"{RELEASES_ETC}/{release}/slurm.conf"}


def require_release(release: str) -> None:
    """Fail under `make test` (HPCDIST_REQUIRE_SLURM=1: make cluster-up starts the releases), skip
    elsewhere, when release `release`'s controller does not answer or its commands are another
    release's."""
    start = f"bash cluster/releases.sh up {release} (make cluster-up starts it)"
    env = {**os.environ, **release_env(release)}
    scontrol = f"{RELEASES_STATE}/{release}/bin/scontrol"
    said = ""
    if not os.path.exists(scontrol):
        said = f"{scontrol} is missing"
    else:
        try:
            version = subprocess.run([scontrol, "--version"], env=env, capture_output=True, text=True, timeout=30,
                                     check=False).stdout.strip()
            ping = subprocess.run([scontrol, "ping"], env=env, capture_output=True, text=True, timeout=30, check=False)
            answer = ((ping.stdout + ping.stderr).strip().splitlines() or ["no answer"])[0]
            if f" {release}." not in version:
                said = f"its scontrol is {version!r}"
            elif "is UP" not in answer:
                said = f"its controller does not answer ({answer[:200]})"
        except subprocess.TimeoutExpired:
            said = "scontrol timed out after 30 s"
    if said:
        missing(f"Slurm {release}: {said}; start it with {start}")


def alice_on(release: str, name: str, files: dict[str, str], own_index: bool = False) -> Iterator[Member]:
    """alice in a folder of her own (`name` and the release in its name) holding `files`, reaching
    release `release` (``release_env``); the folder is removed after. For a test's fixture.
    `own_index`: her job index in that folder (``XDG_STATE_HOME``): another cluster's job of the
    same id would otherwise be in hers."""
    require_members()
    require_release(release)
    folder = Path(f"/home/alice/t-{name}{release.replace('.', '')}-{uuid.uuid4().hex[:8]}")
    try:
        own = {"XDG_STATE_HOME": str(folder / ".state")} if own_index else {}
        yield member_in(folder, files, **own, **release_env(release))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
