#!/usr/bin/env bash
# Runs submitit 1.5.4's own executor tests against plain submitit (baseline) and against
# hpcdist.Executor (the same tests with the executor they build replaced), and prints both pass
# counts and hpcdist's failures. See README.md next to this script. Writes only under this folder.
#
#   ./run.sh              # PER_TEST_TIMEOUT=120 by default (seconds, per test, pytest-timeout)
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MAIN="$(cd "$HERE/../.." && pwd)"  # this checkout; its .venv (make install) has submitit and hpcdist
PY="$MAIN/.venv/bin/python"
STAMP="$MAIN/.venv/.hpcdist-installed"
WANT=1.5.4
WORK="${PARITY_DIR:-${TMPDIR:-/tmp}/hpcdist-submitit-parity}"  # what runs make, outside the checkout
SRC="$WORK/submitit-src"          # pristine copy of the installed submitit, tests included (never patched)
OUT="$WORK/out"                   # everything a run makes (remade each run)
PER_TEST_TIMEOUT="${PER_TEST_TIMEOUT:-120}"
RUN_TIMEOUT=1800                  # safety net around each pytest run, on top of the per-test one

# The tests run: all of test_local.py (its one slow test stays skipped), the three executor tests
# of test_helpers.py, and the harness's own two tests (test_hpcdist_helpers.py, not submitit's).
TESTS=(
  submitit/local/test_local.py
  submitit/test_helpers.py::test_as_completed
  submitit/test_helpers.py::test_job_use_snapshot_cwd
  submitit/test_helpers.py::test_job_use_snapshot_modules
  submitit/test_hpcdist_helpers.py
  submitit/test_pickle.py::test_weakref_with_pickle
  submitit/test_pickle.py::test_nested_pickling
  submitit/test_pickle.py::test_submitit_respects_main
  submitit/auto/test_auto.py::test_redirect_stdout_stderr
)

[ $# -eq 0 ] || { echo "usage: $0" >&2; exit 2; }

die() { echo "run.sh: $*" >&2; exit 2; }
T0=$(date +%s)

# --- 0. wait for hpcdist's virtual environment ---------------------------------------------------
waited=0
until [ -e "$STAMP" ]; do
  [ $waited -ge 3600 ] && die "$STAMP still missing after 1 h (make install in $MAIN not finished?)"
  [ $waited -eq 0 ] && echo "waiting for $STAMP ..."
  sleep 10; waited=$((waited + 10))
done

# --- 1. submitit's source with its tests: its wheel ships them; copied once -------------------
SITE_SUBMITIT=$(cd / && "$PY" -c 'import importlib.metadata as m, os, submitit
assert m.version("submitit") == submitit.__version__, (m.version("submitit"), submitit.__version__)
print(submitit.__version__, os.path.dirname(submitit.__file__))') || die "cannot import submitit in $PY"
read -r INSTALLED_VERSION SITE_SUBMITIT <<<"$SITE_SUBMITIT"
[ "$INSTALLED_VERSION" = "$WANT" ] || die "the venv has submitit $INSTALLED_VERSION, not $WANT"
[ -e "$SITE_SUBMITIT/local/test_local.py" ] || die "$SITE_SUBMITIT has no tests (a submitit built without them)"
if [ ! -e "$SRC/.copied-from" ]; then
  rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp" || die "cannot make $SRC.tmp"
  cp -a "$SITE_SUBMITIT" "$SRC.tmp/submitit" && find "$SRC.tmp" -name __pycache__ -prune -exec rm -rf {} + \
    || die "cannot copy $SITE_SUBMITIT"
  echo "$SITE_SUBMITIT ($INSTALLED_VERSION)" > "$SRC.tmp/.copied-from"
  rm -rf "$SRC" && mv "$SRC.tmp" "$SRC"
fi
diff -rq -x __pycache__ "$SRC/submitit" "$SITE_SUBMITIT" >/dev/null \
  || die "$SITE_SUBMITIT differs from the copy in $SRC: remove $WORK and run again"

# --- 2. the two test trees ---------------------------------------------------------------------
rm -rf "$OUT" && mkdir -p "$OUT" || die "cannot remake $OUT"
make_tree() {  # name; a copy of the source as a git repository (RsyncSnapshot needs one)
  local tree="$OUT/$1"
  cp -a "$SRC" "$tree" && rm -f "$tree/.copied-from" || die "cannot copy $SRC"
  cp "$HERE/test_hpcdist_helpers.py" "$tree/submitit/test_hpcdist_helpers.py"
  if [ "$1" = hpcdist ]; then
    "$PY" "$HERE/patch_tests.py" "$SRC" "$tree" || die "patching the tests failed (submitit's tests changed?)"
  fi
  ( cd "$tree" && git init -q && git add -A \
    && git -c user.name=submitit-parity -c user.email=submitit-parity@localhost \
           -c commit.gpgsign=false commit -q -m "submitit $WANT tests ($1)" ) || die "git init in $tree failed"
  # the tree's `submitit` is what its tests import: check it is the tree's own copy
  local got; got=$(cd "$tree" && "$PY" -c 'import submitit; print(submitit.__file__)')
  [ "$got" = "$tree/submitit/__init__.py" ] || die "in $tree, import submitit gives $got"
}
make_tree baseline
make_tree hpcdist
(cd "$HERE" && diff -ru -x .git -x .extracted-from submitit-src out/hpcdist > "$OUT/hpcdist-tests.diff")

# --- 3/4. run pytest in each tree --------------------------------------------------------------
if (cd / && "$PY" -c 'import pytest_timeout' 2>/dev/null); then
  TIMEOUT_OPTS=(--timeout="$PER_TEST_TIMEOUT")
  OUTER=(timeout -k 30 "$RUN_TIMEOUT")
else
  TIMEOUT_OPTS=()
  OUTER=(timeout -k 30 900)
fi

kill_leftovers() {  # processes the tests started that outlived pytest (their cwd or command names $OUT)
  local pid me=$$ found=()
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$pid" = "$me" ] && continue
    if { tr '\0' ' ' < "/proc/$pid/cmdline"; } 2>/dev/null | grep -qF "$OUT/" \
       || [[ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" == "$OUT/"* ]]; then
      found+=("$pid")
    fi
  done
  if [ ${#found[@]} -gt 0 ]; then
    echo "  $1: ${#found[@]} process(es) left running after pytest, ended: ${found[*]}"
    for pid in "${found[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    sleep 2
    for pid in "${found[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  fi
}

run_tests() {  # name
  local name=$1 t=$(date +%s) rc pythonpath=(-u PYTHONPATH)
  ( cd "$OUT/$name" && env -u SUBMITIT_SLOW_TESTS -u HPCDIST_SITE -u PYTEST_ADDOPTS "${pythonpath[@]}" \
      HPCDIST_STATE="$OUT/hpcdist-state-$name" \
      "${OUTER[@]}" "$PY" -m pytest -p no:cacheprovider "${TIMEOUT_OPTS[@]}" -v -rfE \
      --basetemp="$OUT/tmp-$name" --junitxml="$OUT/$name.xml" "${TESTS[@]}" ) > "$OUT/$name.log" 2>&1
  rc=$?
  echo "  $name: pytest exit $rc in $(( $(date +%s) - t )) s; log $OUT/$name.log"
  kill_leftovers "$name"
}

echo "hpcdist: $MAIN at $(git -C "$MAIN" rev-parse --short HEAD 2>/dev/null)" \
     "with $(git --no-optional-locks -C "$MAIN" status --porcelain 2>/dev/null | wc -l) changed file(s)"
echo "running (per-test timeout ${TIMEOUT_OPTS[*]:-none}; outer ${OUTER[*]}):"
run_tests baseline
run_tests hpcdist

echo
"$PY" "$HERE/report.py" "$OUT/baseline.xml" "$OUT/hpcdist.xml"
echo
echo "took $(( $(date +%s) - T0 )) s; the patch applied to the tests: $OUT/hpcdist-tests.diff"
