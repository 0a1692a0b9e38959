#!/usr/bin/env bash
# Prove the local cluster works end to end: two-node srun, a GPU request, PMIx + mpi4py
# across both nodes, and sacct reporting a finished batch job as COMPLETED.
# Python for the MPI check: $HPCDIST_PYTHON, default /work/main/.venv/bin/python
# (skipped when it cannot import mpi4py).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

PY=${HPCDIST_PYTHON:-/work/main/.venv/bin/python}
failures=0
pass() { echo "[check] ok   $*"; }
bad() { echo "[check] FAIL $*"; failures=$((failures + 1)); }
# Every step is bounded: a hang is a failure, not a stuck test run.
run() { timeout 60 "$@" 2>&1; }

echo "[check] mode: $(cat "$MODE_FILE" 2>/dev/null || echo 'unknown (no mode file)')"

# 1. One task on each node.
out=$(run srun -N2 -n2 -t 1 hostname) || true
[[ $(wc -l <<<"$out") == 2 ]] && pass "srun -N2 -n2 hostname: $(tr '\n' ' ' <<<"$out")" ||
  bad "srun -N2 -n2 hostname: $out"
out=$(run srun -N2 -n2 -t 1 printenv SLURMD_NODENAME | sort | tr '\n' ' ') || true
[[ $out == "n1 n2 " ]] && pass "tasks ran on nodes: $out" || bad "SLURMD_NODENAME: $out"

# 2. The scheduler accepts two nodes x 4 GPUs x 4 tasks, and tasks see the GPUs.
out=$(run sbatch --test-only -p gpu -N2 --gpus-per-node=4 --ntasks-per-node=4 --wrap true) || true
grep -q 'to start at' <<<"$out" && pass "sbatch --test-only 2x4 GPUs: ${out#sbatch: }" ||
  bad "sbatch --test-only 2x4 GPUs: $out"
out=$(run srun -p gpu -N2 --gpus-per-node=4 --ntasks-per-node=4 -t 1 printenv CUDA_VISIBLE_DEVICES | sort | uniq -c | xargs) || true
[[ $out == "8 0,1,2,3" ]] && pass "8 ranks see CUDA_VISIBLE_DEVICES=0,1,2,3" || bad "CUDA_VISIBLE_DEVICES: $out"

# 3. PMIx wire-up with mpi4py across both nodes.
if [[ -x $PY ]] && "$PY" -c 'import mpi4py' 2>/dev/null; then
  out=$(run srun --mpi=pmix -N2 -n2 -t 1 "$PY" -c \
    'import os; from mpi4py import MPI; print(MPI.COMM_WORLD.allreduce(1), os.environ["SLURMD_NODENAME"])' |
    sort | tr '\n' ' ') || true
  [[ $out == "2 n1 2 n2 " ]] && pass "srun --mpi=pmix mpi4py allreduce: $out" || bad "mpi4py allreduce: $out"
else
  echo "[check] skip mpi4py allreduce: $PY cannot import mpi4py"
fi

# 4. A batch job reaches COMPLETED in accounting.
mkdir -p "$STATE/check"
jobid=$(sbatch --parsable -N2 -t 1 -o "$STATE/check/%j.out" --wrap 'srun hostname') || true
state=
if [[ $jobid =~ ^[0-9]+$ ]]; then
  for _ in $(seq 60); do
    state=$(sacct -n -X -P -j "$jobid" -o State 2>/dev/null | head -n1)
    [[ $state =~ ^(COMPLETED|FAILED|CANCELLED.*|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)$ ]] && break
    sleep 0.5
  done
fi
[[ $state == COMPLETED ]] && pass "sacct -j $jobid: COMPLETED" || bad "sacct -j ${jobid:-?}: '${state}'"

if ((failures)); then
  echo "[check] $failures check(s) failed; logs in $STATE/log"
  exit 1
fi
echo "[check] all checks passed"
