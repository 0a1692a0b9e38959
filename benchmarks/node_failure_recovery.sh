#!/usr/bin/env bash
# Time from a node's death to the job running again on the survivors, on the local cluster:
# elastic_sgd.py on 4 nodes x 1 task (min_nodes 2) under `submit --wait`; once it has committed
# step 10, cluster/nodefault.sh kills NODE (default n4); prints each change of the job's state
# with the seconds since the kill, until it runs again without NODE; then revives NODE and
# cancels the job. Slurm's own requeue hold (BeginTime, ~121 s) is kept, as a user would see it.
#   benchmarks/node_failure_recovery.sh [NODE]
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
node=${1:-n4}
R=/var/tmp/hpcdist-shared/t-recovery-$$
mkdir -p "$R"
S=()
for k in results checkpoints scratch logs; do S+=(--set "site.storage.$k=$R/$k"); done
PYTHONPATH=. .venv/bin/python -m hpcdist.cli submit --site local-slurm --set resources.nodes=4 \
  --set resources.min_nodes=2 --set on_node_failure=requeue --set timeout_s=10 "${S[@]}" --wait \
  -- tests/scripts/elastic_sgd.py --steps 2000 --step-s 0.25 >"$R/submit.out" 2>&1 &
until J=$(grep -o "submitted job [0-9]*" "$R/submit.out" | cut -d' ' -f3) && [[ -n $J ]] &&
  [[ -e $R/checkpoints/elastic_sgd/step_00000010.h5 ]]; do sleep 0.2; done
t0=$(date +%s.%N)
cluster/nodefault.sh kill "$node"
seen=
while :; do
  s=$(squeue -h -j "$J" -o "%T %N")
  if [[ $s != "$seen" ]]; then
    printf '%6.1f s  %s  ExcNodeList=%s\n' "$(echo "$(date +%s.%N) - $t0" | bc)" "$s" \
      "$(scontrol -o show job "$J" | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2)"
  fi
  seen=$s
  [[ $s == RUNNING* ]] && ! scontrol show hostnames "${s#RUNNING }" | grep -qx "$node" && break
  sleep 0.5
done
cluster/nodefault.sh revive "$node"
scancel "$J"
echo "job $J; $(uptime)"
