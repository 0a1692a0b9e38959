#!/usr/bin/env bash
# Node faults on one emulated node, for tests (tests/netfault.py wraps this), beside netfault.sh:
#   nodefault.sh kill NODE     the node dies as hardware does: its link cut, then its slurmd and
#                              every process in its network namespace (slurmstepd, the job's
#                              tasks) killed with SIGKILL; nothing tells Slurm, which declares the
#                              node DOWN once it has not answered for SlurmdTimeout (lib.sh)
#   nodefault.sh revive NODE   the node back: link restored, slurmd started, the node resumed in
#                              Slurm; returns once Slurm shows it idle (always safe to run)
#   nodefault.sh show NODE     its link, its slurmd, how many processes run in it, Slurm's state
# Needs the cluster up in netns mode (cluster/up.sh); says so in one line otherwise.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"
# shellcheck source=net.sh
source "$HERE/net.sh"

usage() { echo "usage: $0 kill NODE | revive NODE | show NODE" >&2; exit 2; }
(($# == 2)) || usage
action=$1 node=$2
mode=$(cat "$MODE_FILE" 2>/dev/null || echo "down")
[[ $mode == netns ]] || { echo "nodefault: the cluster is not in netns mode ($mode); run cluster/up.sh" >&2; exit 1; }
is_node "$node" || { echo "nodefault: no node '$node'; nodes are ${NODES[*]}" >&2; exit 2; }
pidfile=$STATE/run/slurmd-$node.pid

# node_pids: every process in the node's network namespace (its slurmd, slurmstepd, the tasks
# and whatever they started), found by /proc/PID/ns/net, which the namespace's processes share.
node_pids() {
  local d pid
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    netns_matches "$pid" "$node" && echo "$pid"
  done
  return 0
}

slurm_state() { sinfo -h -n "$node" -o '%T' 2>/dev/null | head -n1; }

case $action in
  kill)
    "$HERE/netfault.sh" cut "$node" 2>/dev/null
    # slurmd first, so it forks no new slurmstepd; then everything else, until nothing is left
    # (a task may fork while we kill).
    pid=$(cat "$pidfile" 2>/dev/null) || pid=
    proc_is "$pid" slurmd && kill -KILL "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
      pids=$(node_pids)
      [[ -z $pids ]] && break
      # shellcheck disable=SC2086 # one pid a word
      kill -KILL $pids 2>/dev/null || true
      sleep 0.1
    done
    [[ -z $(node_pids) ]] || { log "nodefault: processes still live in $node: $(node_pids | xargs)"; exit 1; }
    log "nodefault: $node killed (link cut, every process in it killed); Slurm marks it DOWN after ${SLURMD_TIMEOUT} s"
    ;;
  revive)
    "$HERE/netfault.sh" restore "$node"
    if ! slurmd_ok "$node"; then
      since=$(date +%s)
      start_slurmd "$node" || { log "nodefault: slurmd -N $node did not start; see $STATE/log/slurmd-$node.log"; exit 1; }
      # Slurm has heard from the new slurmd (before that it may still show the dead one's state).
      registered() {
        local t
        t=$(scontrol show node "$node" -o 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*') || return 1
        t=$(date -d "${t#*=}" +%s 2>/dev/null) || return 1
        ((t >= since))
      }
      wait_for 30 registered || { log "nodefault: $node's new slurmd did not register within 30 s"; exit 1; }
    fi
    # DOWN (not responding) or DRAIN: back into service. An idle node refuses, harmlessly.
    case $(slurm_state) in
      idle | mixed | allocated) ;;
      *) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
    esac
    idle() { [[ $(slurm_state) =~ ^(idle|mixed|allocated)$ ]]; }
    wait_for 30 idle || { log "nodefault: $node is $(slurm_state) in Slurm 30 s after revival"; exit 1; }
    log "nodefault: $node revived ($(slurm_state))"
    ;;
  show)
    ip -br link show "$(node_veth "$node")"
    pid=$(cat "$pidfile" 2>/dev/null) || pid=
    if proc_is "$pid" slurmd; then echo "slurmd: pid $pid"; else echo "slurmd: not running"; fi
    echo "processes in $node: $(node_pids | wc -l)"
    echo "slurm: $(slurm_state)"
    ;;
  *) usage ;;
esac
