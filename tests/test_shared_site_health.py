"""The node-health record on a group's site, attacked by its own members (issue 41, item 7): bob
dates a mark in 2100, alice clears bob's mark in the admin's sticky folder, bob floods the folder
with 20,000 files, bob makes the folder before the admin does. Run as the test bed's ordinary
users (cluster/users.sh), each scratch root root:mlgroup 3770 as the admin makes one; root only
sets up and cleans up."""

from __future__ import annotations

import calendar
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import REPO, Run
from tests.support.members import GROUP_ROOT, as_user, require_members

MAX_READ = 256  # hpcdist.store.records.health.MAX_READ, the bound a read opens at most


def _admin_root(with_record: bool) -> Path:
    """A scratch root as the admin makes one (root:mlgroup, 3770), with the node-health folder or not."""
    root = GROUP_ROOT / "scratch" / f"t-health-{uuid.uuid4().hex[:8]}"
    for folder in [root, *([root / "node-health"] if with_record else [])]:
        folder.mkdir()
        shutil.chown(folder, "root", "mlgroup")
        folder.chmod(0o3770)
    return root


@pytest.fixture
def scratch() -> Iterator[Path]:
    """The admin's scratch root with the admin's node-health folder in it."""
    require_members()
    root = _admin_root(with_record=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def bare_scratch() -> Iterator[Path]:
    """The admin's scratch root, its node-health folder not made yet."""
    require_members()
    root = _admin_root(with_record=False)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def nodes(user: str, root: Path, *args: str, umask: str = "022") -> Run:
    return as_user(user, "-m", "hpcdist.cli", "nodes", "--site", "local-group",
                   "--set", f"site.storage.scratch={root}", *args, umask=umask)


def in_record(out: str) -> list[dict[str, Any]]:
    """The rows of `hpcdist nodes --json` that the health record gives (its marks), without the
    nodes listed for Slurm's reason alone: the cluster's own tests kill and revive nodes while these
    run beside them (a fresh-clone run listed n3, down for a node-failure test, beside bob's marks)."""
    return [row for row in json.loads(out)["nodes"] if row["marks"]]


def listed(user: str, root: Path, *args: str) -> dict[str, dict[str, Any]]:
    """The nodes the health record marks, as `user`'s `hpcdist nodes --json` shows them (``in_record``:
    not those Slurm alone lists as down while the cluster's tests kill nodes beside these; a fresh-clone
    run listed n3 beside alice's n2)."""
    shown = nodes(user, root, "--json", *args)
    assert shown.code == 0, shown.text
    return {row["node"]: row for row in in_record(shown.out)}


def render(user: str, root: Path, *sets: str) -> Run:
    return as_user(user, "-m", "hpcdist.cli", "render", str(REPO / "jobs" / "smoke.yaml"), "--site", "local-group",
                   "--set", f"site.storage.scratch={root}", *[a for s in sets for a in ("--set", s)])


PLANT_2100 = """
import json, os, sys, time
when = 4102444800.0  # 2100-01-01
path = os.path.join(sys.argv[1], f"n3.{int(when * 1e9)}-1-deadbeef.mark.json")
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
os.write(fd, json.dumps({"node": "n3", "reason": "for ever", "when": when, "job_id": "", "source": "user",
                         "user": "bob", "host": "x"}).encode())
os.close(fd)
os.utime(path, (when, when))
soon = time.time() + 240  # 4 minutes ahead: a clock that runs fast, within the slack
path = os.path.join(sys.argv[1], f"n6.{int(soon * 1e9)}-1-deadbeef.mark.json")
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
os.write(fd, json.dumps({"node": "n6", "reason": "fast clock", "when": soon, "job_id": "", "source": "user",
                         "user": "bob", "host": "x"}).encode())
os.close(fd)
shared = os.path.join(sys.argv[1], f"n5.{time.time_ns()}-1-deadbeef.mark.json")  # anyone in the group could rewrite it
open(shared, "w").write(json.dumps({"node": "n5", "reason": "x", "when": time.time(), "job_id": "", "source": "user",
                                    "user": "bob", "host": "x"}))
os.chmod(shared, 0o664)
"""


def test_a_mark_dated_2100_is_ignored_and_one_a_few_minutes_ahead_counts_from_when_written(scratch: Path) -> None:
    before = time.time()
    assert as_user("bob", "-c", PLANT_2100, str(scratch / "node-health")).code == 0
    shown = nodes("alice", scratch, "--json")
    assert "/n5." in shown.err and "(owner bob, mode 0664): group- or world-writable" in shown.err, shown.text
    assert (f"ignored 1 marks in {scratch / 'node-health'} dated more than 5 minutes ahead of now "
            "(up to 2100-01-01, bob's)") in shown.err and shown.err.count("node health:") == 1, shown.err
    assert [row["node"] for row in in_record(shown.out)] == ["n6"]  # n3 is dated 2100: no mark
    row = listed("alice", scratch)["n6"]
    assert row["excluded"], row
    (said,) = row["marks"]
    assert said["user"] == "bob" and before - 5 <= said["when"] <= time.time()  # counted from when bob wrote it
    until = calendar.timegm(time.strptime(row["excluded_until"], "%Y-%m-%dT%H:%M:%SZ"))
    assert until <= time.time() + 24 * 3600 + 5, row["excluded_until"]  # 24 h from now, not 4 minutes later
    rendered = render("alice", scratch)
    assert "#SBATCH --exclude=n6\n" in rendered.out, rendered.text
    time.sleep(0.1)  # longer than a window of 0.00001 h (36 ms): bob's mark is older than that now
    expired = render("alice", scratch, "site.health.exclude_for_h=0.00001")
    assert expired.code == 0 and "--exclude" not in expired.out, expired.text
    assert not listed("alice", scratch, "--set", "site.health.exclude_for_h=0.00001")["n6"]["excluded"]


def test_a_member_clears_a_colleagues_mark_by_the_documented_rule_and_root_removes_it(scratch: Path) -> None:
    record = scratch / "node-health"
    assert nodes("bob", scratch, "--mark", "n4", "--reason", "fan failure", umask="077").code == 0
    cleared = nodes("alice", scratch, "--clear", "n4")
    assert cleared.code == 0 and "Traceback" not in cleared.text and cleared.err == "", cleared.text
    assert "forgot 1 mark of n4" in cleared.out and "bob's: a clear mark of yours, newer" in cleared.out
    assert "n4" not in listed("bob", scratch)  # every reader honours alice's clear mark
    assert "--exclude" not in render("bob", scratch).out
    assert [p.owner() for p in record.glob("n4.*.mark.json")] == ["bob"]  # bob's file is his: alice removed nothing
    # bob's newer mark stands again; the admin (root) removes every file
    assert nodes("bob", scratch, "--mark", "n4", "--reason", "fan again").code == 0
    assert [m["reason"] for m in listed("alice", scratch)["n4"]["marks"]] == ["fan again"]
    from tests.support.cli import run_cli

    removed = run_cli("nodes", "--site", "local-group", "--set", f"site.storage.scratch={scratch}", "--clear", "n4")
    assert removed.code == 0 and "forgot 2 marks of n4" in removed.out, removed.text
    assert list(record.iterdir()) == []


FLOOD = """
import os, sys, time
folder, now = sys.argv[1], time.time_ns()
for i in range(20000):
    name = f"n1.{now - i * 1000}-1-{i:08x}.mark.json" if i % 4 else f"junk-{i}"
    os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_WRONLY, 0o640))
"""

COUNT_OPENS = """
import sys
opened = []
folder = sys.argv[1]
sys.addaudithook(lambda event, args: opened.append(args[0])
                 if event == "open" and str(args[0]).startswith(folder + "/") else None)
from hpcdist.cli import main
code = main(sys.argv[2:])
print("OPENED", len(opened), code, file=sys.stderr)
"""


def test_twenty_thousand_junk_files_give_one_warning_and_a_bounded_read(scratch: Path) -> None:
    record = scratch / "node-health"
    assert as_user("bob", "-c", FLOOD, str(record), umask="027").code == 0
    assert nodes("alice", scratch, "--mark", "n2", "--reason", "ECC errors").code == 0  # the newest mark
    got = as_user("alice", "-c", COUNT_OPENS, str(record), "nodes", "--site", "local-group",
                  "--set", f"site.storage.scratch={record.parent}", "--json")
    *warned, counted = got.err.strip().splitlines()
    _, opened, code = counted.split()
    assert code == "0" and int(opened) <= MAX_READ, got.text
    assert [row["node"] for row in in_record(got.out)] == ["n2"]
    assert len(warned) == 1 and warned[0].startswith("node health: skipped"), got.err
    assert f"more files in {record} left unread" in warned[0] and "(bob's)" in warned[0]
    assert "5000 entries of" in warned[0] and "are not marks by their names" in warned[0]
    rendered = render("alice", scratch)
    assert "#SBATCH --exclude=n2" in rendered.out and rendered.err.count("node health:") == 1, rendered.text


FUTURE_FLOOD = """
import json, os, sys, time
folder, now = sys.argv[1], time.time()
for i in range(20000):  # named for 2286, the last time 19 digits hold: first by name for ever
    node = "n1" if i < 300 else f"x{i}"
    path = os.path.join(folder, f"{node}.{9999999999000000000 - i}-1-{i:08x}.mark.json")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o640)
    if i < 300:  # real marks of n1, but for their date
        os.write(fd, json.dumps({"node": node, "reason": "for ever", "when": now, "job_id": "", "source": "user",
                                 "user": "bob", "host": "x"}).encode())
    os.close(fd)
"""


def test_marks_dated_2286_hide_neither_a_colleagues_mark_nor_a_clear_mark(scratch: Path) -> None:
    """bob marks n1 once today, then writes 20,000 names dated 2286, 300 of them marks of n1 (before:
    the 256 newest by name were all his, so "no node is marked bad", alice's n2 went unread and her
    clear of n1 was never read either)."""
    record = scratch / "node-health"
    assert nodes("alice", scratch, "--mark", "n2", "--reason", "ECC errors").code == 0
    assert nodes("bob", scratch, "--mark", "n1", "--reason", "today").code == 0
    assert as_user("bob", "-c", FUTURE_FLOOD, str(record), umask="027").code == 0
    got = as_user("alice", "-c", COUNT_OPENS, str(record), "nodes", "--site", "local-group",
                  "--set", f"site.storage.scratch={scratch}", "--json")
    *warned, counted = got.err.strip().splitlines()
    assert counted.split()[1:] == ["2", "0"], got.text  # the two real marks opened, none of bob's 20,000
    assert len(warned) == 1 and "ignored 20000 marks in" in warned[0] and "(up to 2286-11-20, bob's)" in warned[0]
    rows = {row["node"]: row for row in in_record(got.out)}
    assert sorted(rows) == ["n1", "n2"] and [m["reason"] for m in rows["n1"]["marks"]] == ["today"], rows
    cleared = nodes("alice", scratch, "--clear", "n1")
    assert cleared.code == 0 and "bob's: a clear mark of yours, newer" in cleared.out, cleared.text
    assert sorted(listed("alice", scratch)) == ["n2"]
    assert "#SBATCH --exclude=n2\n" in render("bob", scratch).out


def test_a_health_folder_a_member_made_is_refused_with_the_admins_command(bare_scratch: Path) -> None:
    record = bare_scratch / "node-health"
    missing = nodes("bob", bare_scratch, "--mark", "n3", "--reason", "fan")
    assert missing.code == 2 and len(missing.err.strip().splitlines()) == 1, missing.text
    assert f"there is no node health record {record}" in missing.err
    assert f"the admin runs: mkdir {record}; chown root:mlgroup {record}; chmod 3770 {record}" in missing.err
    assert not record.exists()  # hpcdist made nothing on bob's behalf
    # bob makes it himself, group-writable, and marks a node in it
    squat = ("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o2770); "
             "os.close(os.open(os.path.join(sys.argv[1], 'n1.%d-1-ab.mark.json' % __import__('time').time_ns()), "
             "os.O_CREAT | os.O_WRONLY, 0o640))")
    assert as_user("bob", "-c", squat, str(record)).code == 0
    refused = nodes("alice", bare_scratch, "--mark", "n3", "--reason", "fan")
    assert refused.code == 2 and len(refused.err.strip().splitlines()) == 1, refused.text
    assert f"{record} (owner bob, mode 2770) was made by bob, not by the site's admin" in refused.err
    assert f"the admin runs: mv {record} {record}.old; mkdir {record};" in refused.err
    rendered = render("alice", bare_scratch)  # a submit goes on, reading nothing from bob's folder
    assert rendered.code == 0 and "--exclude" not in rendered.out, rendered.text
    assert rendered.err.count("\n") == 1 and "node health: ignoring" in rendered.err and "chmod 3770" in rendered.err
