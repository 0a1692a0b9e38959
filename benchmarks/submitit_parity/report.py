"""Print the two pass counts and hpcdist's failures from the two pytest JUnit XML files.

    python report.py BASELINE.xml HPCDIST.xml

A skipped test (test_long_running_job without SUBMITIT_SLOW_TESTS) counts as neither passed nor
run. A test that fails on hpcdist and also on plain submitit is marked "(fails on submitit too)".
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

# Baseline failures that are understood (README.md: the harness's own monitor_jobs test).
KNOWN_BASELINE = {
    "submitit/test_hpcdist_helpers.py::test_monitor_jobs_real_jobs":
        "the harness's own test; submitit's LocalJob.state is only RUNNING / INTERRUPTED / FINISHED, "
        "never FAILED, so its FAILED assertion fails on plain submitit too",
}


def results(xml: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, one-line error); outcome in passed/failed/error/skipped."""
    out: dict[str, tuple[str, str]] = {}
    if not xml.exists():
        return out
    for case in ET.parse(xml).getroot().iter("testcase"):
        # classname "submitit.local.test_local", name "test_weird_dir[a_0]"
        path = case.get("classname", "").replace(".", "/") + ".py"
        tid = f"{path}::{case.get('name')}"
        outcome, msg = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                msg = one_line(el.get("message") or el.text or "")
                break
        # a test can have both a call failure and a teardown error: the first element wins (call)
        if tid in out and out[tid][0] != "passed":
            continue
        out[tid] = (outcome, msg)
    return out


def one_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return "(no message)"
    # pytest's messages are often "ExcType: text" first; keep the first line, trimmed
    line = lines[0]
    return line if len(line) <= 220 else line[:217] + "..."


def cause(msg: str) -> str:
    """The message with paths, numbers and parametrize ids blurred, to group failures by cause."""
    msg = re.sub(r'^failed on \w+ with "(.*?)"?$', r"\1", msg)  # a fixture's error: the cause inside
    msg = re.sub(r"""PosixPath\((?:'[^']*'|"[^"]*")\)""", "PosixPath(<path>)", msg)
    msg = re.sub(r"'[^'\s]*/[^']*'" + r'|"[^"\s]*/[^"]*"', "<path>", msg)
    msg = re.sub(r"(?<![\w<])/[^\s'\"),]+", "<path>", msg)
    msg = re.sub(r"\b\d+\b", "N", msg)
    return msg


def counts(res: dict[str, tuple[str, str]]) -> tuple[int, int]:
    ran = [o for o, _ in res.values() if o != "skipped"]
    return sum(o == "passed" for o in ran), len(ran)


def main() -> None:
    base, hpc = results(Path(sys.argv[1])), results(Path(sys.argv[2]))
    bp, bn = counts(base)
    hp, hn = counts(hpc)
    print(f"submitit: {bp}/{bn} passed; hpcdist: {hp}/{hn} passed")
    if not base:
        print("  (no baseline results: the baseline pytest run did not write its report)")
    if not hpc:
        print("  (no hpcdist results: the hpcdist pytest run did not write its report)")
    missing = sorted(set(base) ^ set(hpc))
    if missing:
        print(f"  tests in one run only: {', '.join(missing)}")
    bfail = [(t, m) for t, (o, m) in base.items() if o in ("failed", "error")]
    if bfail:
        print(f"\nbaseline (plain submitit) failures ({len(bfail)}):")
        for t, m in bfail:
            print(f"  {t}: {m}")
            if t in KNOWN_BASELINE:
                print(f"    (expected: {KNOWN_BASELINE[t]})")
    hfail = [(t, m) for t, (o, m) in hpc.items() if o in ("failed", "error")]
    print(f"\nhpcdist failures ({len(hfail)}):")
    for t, m in hfail:
        too = "  (fails on submitit too)" if base.get(t, ("",))[0] in ("failed", "error") else ""
        print(f"  {t}: {m}{too}")
    if hfail:
        groups: dict[str, list[str]] = defaultdict(list)
        for t, m in hfail:
            groups[cause(m)].append(t.split("::", 1)[1])
        print(f"\nhpcdist failures by message ({len(groups)} distinct):")
        for c, tests in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(tests):2d} x {c}\n       {', '.join(tests)}")


if __name__ == "__main__":
    main()
