#!/usr/bin/env bash
# Three more Slurm clusters on this machine beside up.sh's, each set up as a kind of real site is
# (README.md, "Variants"), so the suite meets clusters that differ as real ones do:
#   parts   partitions named otherwise (batch, short) with their own time and memory limits
#   gpus    typed GPUs on one node only, MpiDefault=pmix, accounting enforced (accounts, a QOS)
#   noacct  no accounting at all (sacct fails), as on sites without slurmdbd
# Each has its own slurmctld port, two emulated nodes (slurmd -N on 127.0.0.1, single-host style,
# each on its own port), its state under $VARIANTS_STATE/NAME and its configs in
# $VARIANTS_ETC/NAME; clients reach it with SLURM_CONF=$VARIANTS_ETC/NAME/slurm.conf. They share
# up.sh's munged and slurmdbd (run up.sh first: make cluster-up does).
#
#   variants.sh up [NAME...]    start all three, or the names given (idempotent: about a second
#                               when all runs; a daemon whose config changed is restarted)
#   variants.sh down [NAME...]  stop their daemons; state and logs are kept
#   variants.sh env NAME        print SLURM_CONF=... for NAME
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

MAIN_STATE=$STATE # up.sh's: its slurmdbd
ALL=(parts gpus noacct)
# Each variant's controller port, node names and first node port (the second node has the next).
# The main cluster has 6817 (slurmctld), 6818 (slurmd), 6819 (slurmdbd), 17001-17008 (single-host).
declare -A CTLD_PORT=([parts]=6831 [gpus]=6832 [noacct]=6833)
declare -A NODE_NAMES=([parts]="p1 p2" [gpus]="g1 g2" [noacct]="q1 q2")
declare -A NODE_PORT=([parts]=17011 [gpus]=17021 [noacct]=17031)
# gpus' short QOS. A QOS is global in slurmdbd: the prefix keeps it apart from the main cluster's.
QOS_SHORT="v-short"
QOS_SHORT_WALL=00:20:00
# gpus' sweep QOS, asked by name only: a user may have 3 jobs (array tasks) queued or running under it.
QOS_SWEEP="v-sweep"
QOS_SWEEP_SUBMIT=3
# gpus' MaxArraySize: an array's indices stay below it (Slurm's default is 1001).
GPUS_MAX_ARRAY=5
GPU_USERS=(alice bob)

usage() {
  echo "usage: variants.sh up [NAME...] | down [NAME...] | env NAME   (NAME: ${ALL[*]})" >&2
  exit 2
}
is_variant() { [[ " ${ALL[*]} " == *" $1 "* ]]; }

# use NAME: point STATE (which lib.sh's helpers read), ETC, SLURM_CONF (every Slurm command and
# daemon started from here on) and VNODES at variant NAME.
use() {
  V=$1
  STATE=$VARIANTS_STATE/$V
  ETC=$VARIANTS_ETC/$V
  export SLURM_CONF=$ETC/slurm.conf
  read -r -a VNODES <<<"${NODE_NAMES[$V]}"
}
accounting() { [[ $V != noacct ]]; }
conf_files() { echo slurm.conf; [[ $V != gpus ]] || echo gres.conf; }

# ---------------------------------------------------------------------------------------
# Configuration. What the main cluster's single-host mode uses (up.sh), with each variant's own
# select, MPI, accounting, nodes and partitions.
render_slurm_conf() {
  local port=${NODE_PORT[$V]} n gres
  cat <<EOF
# Written by hpcdist cluster/variants.sh (variant $V); edits are overwritten.
ClusterName=$V
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=${CTLD_PORT[$V]}
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmdSpoolDir=$STATE/spool/%n
TmpFS=$STATE/tmpfs/%n
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Both nodes are this host: Open MPI's shared memory between them crashes (up.sh's single-host mode).
TaskProlog=$STATE/single-host-task-prolog.sh
SelectType=select/cons_tres
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
JobRequeue=1
ReturnToService=2
SlurmdTimeout=$SLURMD_TIMEOUT
MinJobAge=300
InactiveLimit=0
KillWait=5
SlurmctldDebug=info
SlurmdDebug=info
EOF
  case $V in
    parts) cat <<EOF
# Memory is a resource here, so the partitions' DefMemPerCPU counts (a job asks for memory or gets it).
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
EOF
      ;;
    gpus) cat <<EOF
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=pmix
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
# A job needs an association (account), and its QOS's limits hold (v-short: 20 minutes at most).
AccountingStorageEnforce=associations,limits,qos
MaxArraySize=$GPUS_MAX_ARRAY
EOF
      ;;
    noacct) cat <<EOF
SelectTypeParameters=CR_Core
MpiDefault=none
AccountingStorageType=accounting_storage/none
EOF
      ;;
  esac
  echo
  for n in "${VNODES[@]}"; do
    gres=
    [[ $n != g1 ]] || gres=" Gres=gpu:a100:2"
    echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=4 RealMemory=4000$gres State=UNKNOWN"
    port=$((port + 1))
  done
  local nodes="${VNODES[0]},${VNODES[1]}"
  case $V in
    parts) cat <<EOF
PartitionName=batch Nodes=$nodes Default=YES MaxTime=30 DefaultTime=10 DefMemPerCPU=500 State=UP
PartitionName=short Nodes=$nodes MaxTime=5 DefMemPerCPU=250 State=UP
EOF
      ;;
    gpus) echo "PartitionName=gpu Nodes=$nodes Default=YES MaxTime=60 State=UP" ;;
    noacct) echo "PartitionName=debug Nodes=$nodes Default=YES MaxTime=15 State=UP" ;;
  esac
}

render_gres_conf() {
  cat <<EOF
# Written by hpcdist cluster/variants.sh: two fake A100s on g1 only (character devices, c 1 3).
AutoDetect=off
NodeName=g1 Name=gpu Type=a100 File=$STATE/dev/nvidia[0-1]
EOF
}

# install_conf NAME: render NAME into $STATE/render and install it into $ETC if different.
install_conf() {
  local name=$1 new=$STATE/render/$1 dest=$ETC/$1
  "render_${name//./_}" >"$new"
  cmp -s "$new" "$dest" && return 0
  install -m 644 -o root -g root "$new" "$dest"
  log "wrote $dest"
}
# stale: true when the running daemons were started with other configs than the rendered ones.
stale() {
  local name
  for name in $(conf_files); do cmp -s "$STATE/render/$name" "$STATE/active/$name" || return 0; done
  return 1
}
mark_active() {
  local name
  for name in $(conf_files); do install -m 600 "$STATE/render/$name" "$STATE/active/$name"; done
}

prepare() {
  local n i dev
  mkdir -p "$STATE"/{log,run,ctld,dev,render,active} "$ETC"
  for n in "${VNODES[@]}"; do mkdir -p "$STATE/spool/$n" "$STATE/tmpfs/$n"; done
  # Users' tasks run the TaskProlog and read the configs: the folders down to them must be searchable.
  chmod 755 "$VARIANTS_STATE" "$STATE" "$VARIANTS_ETC" "$ETC"
  if [[ $V == gpus ]]; then
    for i in 0 1; do
      dev=$STATE/dev/nvidia$i
      [[ -c $dev ]] || { rm -f "$dev"; mknod "$dev" c 1 3; chmod 666 "$dev"; }
    done
  fi
  cmp -s "$HERE/single-host-task-prolog.sh" "$STATE/single-host-task-prolog.sh" ||
    install -m 755 "$HERE/single-host-task-prolog.sh" "$STATE/single-host-task-prolog.sh"
  for n in $(conf_files); do install_conf "$n"; done
  [[ $V == gpus ]] || rm -f "$ETC/gres.conf" "$STATE/render/gres.conf" "$STATE/active/gres.conf"
}

# ---------------------------------------------------------------------------------------
# Accounting through up.sh's slurmdbd: the cluster's record (before its slurmctld registers) and,
# for gpus, its accounts, users and QOS.
sacctmgr_add() { # sacctmgr -i ARGS, where "nothing new" or "nothing modified" is no failure
  local out
  out=$(sacctmgr -i "$@" 2>&1) || grep -qi 'nothing new\|nothing modified\|already exist' <<<"$out" ||
    fail "sacctmgr $*: $out" "$MAIN_STATE/log/slurmdbd.log"
}

setup_accounting() {
  accounting || return 0
  # The clusters accounting knows, asked once a run (each sacctmgr takes a fifth of a second here).
  if [[ -z ${ACCT_CLUSTERS+set} ]]; then
    if ! pid_alive "$MAIN_STATE/run/slurmdbd.pid" slurmdbd ||
      ! ACCT_CLUSTERS=$(sacctmgr -n -P show cluster format=cluster 2>/dev/null); then
      fail "variant $V needs the main cluster's slurmdbd, which does not answer: run cluster/up.sh (make cluster-up) first" \
        "$MAIN_STATE/log/slurmdbd.log"
    fi
  fi
  if ! grep -qx "$V" <<<"$ACCT_CLUSTERS"; then
    sacctmgr_add add cluster "$V"
    log "added cluster $V to accounting"
  fi
  [[ $V == gpus ]] && gpu_accounts
  return 0
}

# What gpus' accounting holds once set up, one line per fact, as sacctmgr prints them.
gpu_accounts_now() {
  sacctmgr -n -P show qos "$QOS_SHORT,$QOS_SWEEP" format=name,maxwall,maxsubmitjobsperuser | sort
  sacctmgr -n -P show user withassoc where cluster=gpus name="$(IFS=,; echo "${GPU_USERS[*]}"),root" \
    format=user,defaultaccount,account,qos,defaultqos | sort
}
gpu_accounts_wanted() {
  local user
  echo "$QOS_SHORT|$QOS_SHORT_WALL|"
  echo "$QOS_SWEEP||$QOS_SWEEP_SUBMIT"
  {
    for user in "${GPU_USERS[@]}"; do echo "$user|proj-b|proj-b|normal,$QOS_SHORT,$QOS_SWEEP|$QOS_SHORT"; done
    echo "root|root|proj-a|normal|"
    echo "root|root|proj-b|normal|"
    echo "root|root|root|normal|"
  } | sort
}
# gpu_accounts: accounts proj-a and proj-b; alice and bob in proj-b (their default here, so a job
# needs no -A), allowed QOS normal, v-short and v-sweep, v-short by default; root in both. Written
# only when what accounting holds differs (a second run asks two questions and writes nothing).
gpu_accounts() {
  local users
  users=$(IFS=,; echo "${GPU_USERS[*]}")
  [[ $(gpu_accounts_now) == "$(gpu_accounts_wanted)" ]] && return 0
  log "setting up gpus' accounts proj-a, proj-b, users $users and QOS $QOS_SHORT"
  if [[ -z $(sacctmgr -n -P show qos "$QOS_SHORT" format=name) ]]; then
    sacctmgr_add add qos "$QOS_SHORT" MaxWall="$QOS_SHORT_WALL"
  else
    sacctmgr_add modify qos where name="$QOS_SHORT" set MaxWall="$QOS_SHORT_WALL"
  fi
  if [[ -z $(sacctmgr -n -P show qos "$QOS_SWEEP" format=name) ]]; then
    sacctmgr_add add qos "$QOS_SWEEP" MaxSubmitJobsPerUser="$QOS_SWEEP_SUBMIT"
  else
    sacctmgr_add modify qos where name="$QOS_SWEEP" set MaxSubmitJobsPerUser="$QOS_SWEEP_SUBMIT"
  fi
  sacctmgr_add add account proj-a,proj-b cluster=gpus Description=variant-gpus Organization=hpcdist
  sacctmgr_add add user root account=proj-a,proj-b cluster=gpus
  sacctmgr_add add user "$users" account=proj-b cluster=gpus DefaultAccount=proj-b
  sacctmgr_add modify user where name="$users" cluster=gpus account=proj-b \
    set QOS=normal,"$QOS_SHORT","$QOS_SWEEP" DefaultQOS="$QOS_SHORT"
  sacctmgr_add modify user where name="$users" cluster=gpus set DefaultAccount=proj-b
  [[ $(gpu_accounts_now) == "$(gpu_accounts_wanted)" ]] ||
    fail "gpus' accounting is not as set up: $(diff <(gpu_accounts_wanted) <(gpu_accounts_now) | paste -sd ' ')" \
      "$MAIN_STATE/log/slurmdbd.log"
}

# ---------------------------------------------------------------------------------------
# Daemons. A changed config restarts the variant's slurmctld and slurmd (running jobs live on in
# their slurmstepd); each slurmd runs in up.sh's restart loop (supervised_slurmd).
declare -A started_at=() # "variant node" -> epoch second its slurmd was started by this run

start_daemons() {
  local n
  if stale; then
    log "$V's config changed (or its daemons were never started from it): restarting them"
    for n in $(known_variant_nodes); do stop_pidfile "$STATE/run/slurmd-$n.pid" slurmd; done
    stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
  fi
  if ! slurmctld_ok; then
    stop_pidfile "$STATE/run/slurmctld.pid" slurmctld # a live pid that does not answer
    log "starting slurmctld of $V (port ${CTLD_PORT[$V]})"
    slurmctld
    wait_for 30 slurmctld_ok || fail "slurmctld of $V did not answer" "$STATE/log/slurmctld.log"
  fi
  for n in "${VNODES[@]}"; do
    slurmd_ok "$n" && continue
    log "starting slurmd -N $n ($V)"
    started_at["$V $n"]=$(date +%s)
    setsid bash -c "$(supervised_slurmd "$n")" </dev/null >/dev/null 2>&1 &
    wait_for 10 slurmd_ok "$n" || fail "slurmd -N $n ($V) did not start" "$STATE/log/slurmd-$n.log"
  done
  mark_active
}
# known_variant_nodes: the nodes configured and any a pid file names (a node renamed since).
known_variant_nodes() {
  local f names=("${VNODES[@]}")
  for f in "$STATE"/run/slurmd-*.pid; do
    [[ -e $f ]] || continue
    f=${f##*/slurmd-}
    names+=("${f%.pid}")
  done
  printf '%s\n' "${names[@]}" | sort -u
}

node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }
node_reasons() { sinfo -h -N -o '%N=%T (%E)' 2>/dev/null | sort -u | paste -sd ' '; }
registered() { # NODE EPOCH: slurmctld heard from a slurmd of NODE started at or after EPOCH
  local t
  t=$(scontrol show node "$1" -o 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*') || return 1
  t=$(date -d "${t#*=}" +%s 2>/dev/null) || return 1
  ((t >= $2))
}
ready() {
  local states busy n
  for n in "${VNODES[@]}"; do
    [[ -z ${started_at["$V $n"]:-} ]] || registered "$n" "${started_at["$V $n"]}" || return 1
  done
  states=$(node_states) || return 1
  busy=$(awk '$2 !~ /^(idle|mixed|allocated)$/' <<<"$states")
  [[ -n $states && -z $busy ]] || return 1
  ! accounting || sacct -n -X -S now-1minutes >/dev/null 2>&1
}
resume_bad_nodes() {
  local node state
  while read -r node state; do
    case $state in
      down | drained | draining | fail | failing | inval)
        log "resuming $node of $V (was $state)"
        scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
    esac
  done < <(node_states)
}

# wait_ready NAME...: until every variant's nodes take jobs (60 s), resuming nodes an earlier
# configuration left down; a daemon that died or the timeout fails with its log's tail.
wait_ready() {
  local deadline=$((SECONDS + 60)) next_resume=$((SECONDS + 5)) pending v n logs
  while :; do
    pending=()
    for v in "$@"; do
      use "$v"
      ready && continue
      pending+=("$v")
      pid_alive "$STATE/run/slurmctld.pid" slurmctld || fail "slurmctld of $V died" "$STATE/log/slurmctld.log"
      for n in "${VNODES[@]}"; do
        slurmd_ok "$n" || fail "slurmd -N $n ($V) died" "$STATE/log/slurmd-$n.log"
      done
      if ((SECONDS >= deadline)); then
        log "node states of $V: $(node_reasons)"
        logs=("$STATE/log/slurmctld.log")
        for n in "${VNODES[@]}"; do logs+=("$STATE/log/slurmd-$n.log"); done
        accounting && logs+=("$MAIN_STATE/log/slurmdbd.log")
        fail "variant $V: nodes not idle$(accounting && echo ' or sacct not working') after 60 s" "${logs[@]}"
      fi
      ((SECONDS < next_resume)) || resume_bad_nodes
    done
    ((${#pending[@]})) || return 0
    ((SECONDS < next_resume)) || next_resume=$((SECONDS + 5))
    sleep 0.5
  done
}

cmd_up() {
  local v names=("$@")
  ((${#names[@]})) || names=("${ALL[@]}")
  command -v slurmctld >/dev/null || { log "Slurm is not installed: run $HERE/install-deps.sh"; exit 1; }
  munge_ok || fail "munged does not answer: run cluster/up.sh (make cluster-up) first" /var/log/munge/munged.log
  HOST=$(hostname -s)
  mkdir -p "$VARIANTS_STATE" "$VARIANTS_ETC"
  for v in "${names[@]}"; do
    use "$v"
    prepare
    setup_accounting
    start_daemons
  done
  wait_ready "${names[@]}"
  for v in "${names[@]}"; do
    use "$v"
    log "variant $V up: SLURM_CONF=$SLURM_CONF, controller :${CTLD_PORT[$V]}, nodes $(node_states | awk '{printf "%s=%s ", $1, $2}')| partitions $(sinfo -h -o '%P' | paste -sd ' ')"
  done
}

cmd_down() {
  local v n names=("$@")
  ((${#names[@]})) || names=("${ALL[@]}")
  for v in "${names[@]}"; do
    use "$v"
    [[ -d $STATE ]] || continue
    for n in $(known_variant_nodes); do stop_pidfile "$STATE/run/slurmd-$n.pid" slurmd; done
    stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
  done
  log "variants ${names[*]} down"
}

(($#)) || usage
cmd=$1
shift
for v in "$@"; do is_variant "$v" || { log "no variant '$v'; variants are ${ALL[*]}"; exit 2; }; done
case $cmd in
  env) (($# == 1)) || usage; echo "SLURM_CONF=$VARIANTS_ETC/$1/slurm.conf" ;;
  up | down)
    ((EUID == 0)) || { log "variants.sh $cmd must run as root"; exit 1; }
    "cmd_$cmd" "$@" ;;
  *) usage ;;
esac
