"""Make the hpcdist copy of submitit 1.5.4's tests: the executor each test BUILDS becomes hpcdist's.

    python patch_tests.py SRC_TREE DST_TREE

SRC_TREE is the pristine extracted submitit source (never written); DST_TREE is a copy of it whose
test files listed below are overwritten with their patched text. Every replacement is an explicit
(old, new, expected count) triple and the count is asserted, so that a change in submitit's tests
(a new executor construction, a renamed fixture) stops this script instead of silently leaving a
test on submitit's own executor. Nothing but the listed strings changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

# (old, new, how many times `old` must occur in the pristine file)
Replacement = tuple[str, str, int]

PATCHES: dict[str, list[Replacement]] = {
    # submitit/local/test_local.py: the LocalExecutor / AutoExecutor the tests build.
    # `local.start_controller`, `local.LocalJob(...)`, `job._process` and the now unused
    # `from submitit import AutoExecutor` stay as they are.
    "submitit/local/test_local.py": [
        ("import pytest\n", "import pytest\n\nimport hpcdist\n", 1),
        # 11 = 10 tests + test_long_running_job (skipped unless SUBMITIT_SLOW_TESTS is set)
        ("local.LocalExecutor(tmp_path)", "hpcdist.Executor(folder=tmp_path)", 11),
        ("local.LocalExecutor(tmp_path, max_num_timeout=1)",
         "hpcdist.Executor(folder=tmp_path, max_num_timeout=1)", 2),  # test_requeuing, test_custom_checkpoint
        ('local.LocalExecutor(weird_tmp_path / "%j")',
         'hpcdist.Executor(folder=weird_tmp_path / "%j")', 1),  # test_weird_dir
        ('executor = AutoExecutor(tmp_path, cluster="local")',
         'executor = hpcdist.AutoExecutor(tmp_path, cluster="local")', 1),  # test_setup
    ],
    # submitit/conftest.py: the `executor` fixture (used by test_helpers.py's executor tests and by
    # test_hpcdist_helpers.py). Its `-> LocalExecutor` annotation and import are left as they are.
    "submitit/conftest.py": [
        ("import pytest\n", "import pytest\n\nimport hpcdist\n", 1),
        ("    return LocalExecutor(tmp_path)\n", "    return hpcdist.Executor(folder=tmp_path)\n", 1),
    ],
    # submitit/test_helpers.py: its three executor tests already take the `executor` fixture, so
    # the patched conftest gives them hpcdist's; the file is copied unchanged. The "replacements"
    # below are identity checks that they still do (a submitit change would be noticed).
    "submitit/test_helpers.py": [
        *((sig, sig, 1) for sig in (
            "def test_as_completed(executor) -> None:\n",
            "def test_job_use_snapshot_cwd(executor, tmp_path: Path) -> None:\n",
            "def test_job_use_snapshot_modules(executor, tmp_path: Path) -> None:\n",
        )),
    ],
    # submitit/test_pickle.py: the LocalExecutor its pickling tests build (two of them submitit marks
    # xfail itself; the DebugExecutor one tests submitit's in-process executor and stays as it is).
    "submitit/test_pickle.py": [
        ("import pytest\n", "import pytest\n\nimport hpcdist\n", 1),
        ("    ex = LocalExecutor(tmp_path)\n", "    ex = hpcdist.Executor(folder=tmp_path)\n", 3),
    ],
    # submitit/auto/test_auto.py: test_redirect_stdout_stderr takes the `executor` fixture (identity check).
    "submitit/auto/test_auto.py": [
        ("def test_redirect_stdout_stderr(executor) -> None:\n",
         "def test_redirect_stdout_stderr(executor) -> None:\n", 1),
    ],
}

# Strings that must NOT be left in a patched file: any executor construction we did not replace.
LEFTOVERS: dict[str, list[str]] = {
    "submitit/local/test_local.py": ["LocalExecutor(", " AutoExecutor("],
    "submitit/conftest.py": ["return LocalExecutor("],
    "submitit/test_helpers.py": ["LocalExecutor(", "DebugExecutor(", "AutoExecutor("],
    "submitit/test_pickle.py": ["ex = LocalExecutor("],
}


def patch(src_root: Path, dst_root: Path) -> list[str]:
    done = []
    for rel, replacements in PATCHES.items():
        text = (src_root / rel).read_text()
        for old, new, expected in replacements:
            found = text.count(old)
            assert found == expected, f"{rel}: {old!r} occurs {found} times, expected {expected} (submitit changed?)"
            text = text.replace(old, new)
        for bad in LEFTOVERS.get(rel, []):
            assert bad not in text, f"{rel}: {bad!r} is still there after patching (an executor not replaced)"
        (dst_root / rel).write_text(text)
        done.append(f"{rel}: {len(replacements)} replacement(s) checked")
    return done


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src_root, dst_root = Path(sys.argv[1]), Path(sys.argv[2])
    assert src_root.resolve() != dst_root.resolve(), "the pristine source tree is never patched in place"
    for line in patch(src_root, dst_root):
        print("patched", line)


if __name__ == "__main__":
    main()
