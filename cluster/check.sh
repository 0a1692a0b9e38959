#!/usr/bin/env bash
# Prove the local cluster works end to end: srun on every node, a GPU request, PMIx + mpi4py
# across every node, and sacct reporting a finished batch job as COMPLETED.
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

N=$NODE_COUNT
all_nodes="${NODES[*]} "
# 1. One task on each node.
out=$(run srun -N"$N" -n"$N" -t 1 hostname | sort -V) || true
[[ $(tr '\n' ' ' <<<"$out") == "$all_nodes" ]] && pass "srun -N$N -n$N hostname: $(tr '\n' ' ' <<<"$out")" ||
  bad "srun -N$N -n$N hostname: $out"
out=$(run srun -N"$N" -n"$N" -t 1 printenv SLURMD_NODENAME | sort -V | tr '\n' ' ') || true
[[ $out == "$all_nodes" ]] && pass "tasks ran on nodes: $out" || bad "SLURMD_NODENAME: $out"

# 2. The scheduler accepts every node x 4 GPUs x 4 tasks, and tasks see the GPUs.
out=$(run sbatch --test-only -p gpu -N"$N" --gpus-per-node=4 --ntasks-per-node=4 --wrap true) || true
grep -q 'to start at' <<<"$out" && pass "sbatch --test-only ${N}x4 GPUs: ${out#sbatch: }" ||
  bad "sbatch --test-only ${N}x4 GPUs: $out"
out=$(run srun -p gpu -N"$N" --gpus-per-node=4 --ntasks-per-node=4 -t 1 printenv CUDA_VISIBLE_DEVICES | sort | uniq -c | xargs) || true
[[ $out == "$((4 * N)) 0,1,2,3" ]] && pass "$((4 * N)) ranks see CUDA_VISIBLE_DEVICES=0,1,2,3" || bad "CUDA_VISIBLE_DEVICES: $out"

# 3. PMIx wire-up with mpi4py across every node.
if [[ -x $PY ]] && "$PY" -c 'import mpi4py' 2>/dev/null; then
  out=$(run srun --mpi=pmix -N"$N" -n"$N" -t 1 "$PY" -c \
    'import os; from mpi4py import MPI; print(MPI.COMM_WORLD.allreduce(1), os.environ["SLURMD_NODENAME"])' |
    sort -V | tr '\n' ' ') || true
  [[ $out == "$(for n in "${NODES[@]}"; do printf '%s %s ' "$N" "$n"; done)" ]] && pass "srun --mpi=pmix mpi4py allreduce: $out" || bad "mpi4py allreduce: $out"
else
  echo "[check] skip mpi4py allreduce: $PY cannot import mpi4py"
fi

# 4. A batch job reaches COMPLETED in accounting.
mkdir -p "$STATE/check"
jobid=$(sbatch --parsable -N"$N" -t 1 -o "$STATE/check/%j.out" --wrap 'srun hostname') || true
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
