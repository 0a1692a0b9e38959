#!/usr/bin/env bash
# Start a real Slurm cluster on this machine: munged, MariaDB, slurmdbd and slurmctld on the host,
# and HPCDIST_NODES (2..8, default 4) slurmd daemons emulating nodes n1..nN, each in its own
# network namespace with its own hostname and address (see README.md). Where namespaces cannot be
# made (or with HPCDIST_CLUSTER_NET=single-host) it says so in one line and runs every slurmd on
# the host, on loopback; $STATE/mode records which. A cluster started with another node count is
# brought to this one (nodes added, or the extra ones stopped and their namespaces removed). Idempotent: what already runs with the current
# configuration is left alone, so a second run takes about a second. State and logs live under
# $HPCDIST_SLURM_STATE (default /var/tmp/hpcdist-slurm); configs go to /etc/slurm so clients need
# no SLURM_CONF.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"
# shellcheck source=net.sh
source "$HERE/net.sh"

((EUID == 0)) || { log "up.sh must run as root"; exit 1; }
command -v slurmctld >/dev/null || { log "Slurm is not installed: run $HERE/install-deps.sh"; exit 1; }

HOST=$(hostname -s)

# ensure_not_running COMM: fail when a COMM process runs that none of our pid files names
# (say one started with another HPCDIST_SLURM_STATE): a second daemon would lose the port. The
# variants' and releases' daemons (variants.sh, releases.sh: their own ports) are known too.
ensure_not_running() {
  local comm=$1 ours=" " f d pid
  # (|| true: a pattern that matches nothing stays as it is, and a failed cat would end the script)
  for f in "$STATE"/run/*.pid "$VARIANTS_STATE"/*/run/*.pid "$RELEASES_STATE"/*/state/run/*.pid; do ours+="$(cat "$f" 2>/dev/null || true) "; done
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    proc_is "$pid" "$comm" && [[ $ours != *" $pid "* ]] || continue
    fail "$comm (pid $pid) runs but not from $STATE; stop it first (down.sh with its HPCDIST_SLURM_STATE)"
  done
}

# ---------------------------------------------------------------------------------------
# Directories and the fake GPU devices (character devices like /dev/null, as gres.conf
# insists on device files; nothing ever opens them).
mkdir -p "$STATE"/{log,run,ctld,dev,render,active}
for n in "${NODES[@]}"; do mkdir -p "$STATE/spool/$n" "$STATE/tmpfs/$n"; done
for i in 0 1 2 3; do
  dev=$STATE/dev/nvidia$i
  [[ -c $dev ]] || { rm -f "$dev"; mknod "$dev" c 1 3; chmod 666 "$dev"; }
done

# ---------------------------------------------------------------------------------------
# The nodes' network: namespaces when this machine allows them, else the single-host fallback.
why=
case ${HPCDIST_CLUSTER_NET:-netns} in
  netns) why=$(net_probe) || true ;;
  single-host) why="asked for by HPCDIST_CLUSTER_NET=single-host" ;;
  *) log "HPCDIST_CLUSTER_NET must be netns or single-host, not '$HPCDIST_CLUSTER_NET'"; exit 1 ;;
esac
if [[ -z $why ]]; then
  NET_MODE=netns
  net_up
  hosts_lines=()
  for n in "${NODES[@]}"; do hosts_lines+=("$(node_addr "$n") $n"); done
  hosts_set "${hosts_lines[@]}"
  echo netns >"$MODE_FILE"
else
  NET_MODE=single-host
  log "network namespaces unavailable ($why): single-host mode, ${NODES[*]} all on 127.0.0.1"
  hosts_set "127.0.0.1 ${NODES[*]}"
  install -m 755 "$HERE/single-host-task-prolog.sh" "$STATE/single-host-task-prolog.sh"
  echo "single-host: $why" >"$MODE_FILE"
fi

# ---------------------------------------------------------------------------------------
# Configuration, rendered into $STATE/render and installed into /etc/slurm. A copy of what
# the running daemons were started with is kept in $STATE/active: a daemon whose config
# differs from the new one is restarted (even if an earlier run died half-way).
render_slurm_conf() {
  local ctld_addr=127.0.0.1 n
  [[ $NET_MODE == netns ]] && ctld_addr=$HOST_ADDR
  cat <<EOF
# Written by hpcdist cluster/up.sh ($NET_MODE mode); edits are overwritten.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$HOST($ctld_addr)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
# %n is the node name, so the slurmd on this host keep apart.
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmdSpoolDir=$STATE/spool/%n
# Per-node TmpFS keeps the PMIx plugin's per-step directories from colliding.
TmpFS=$STATE/tmpfs/%n
# Trust the node lines below over the hardware (CPUs=8 on a 2-core machine).
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Backfill every 5 s (default 30): a job whose start time passed or that was requeued starts
# within seconds, as on a busy real cluster's frequent passes, not half a minute later.
SchedulerParameters=bf_interval=5
MpiDefault=none
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
JobRequeue=1
ReturnToService=2
# A node that stops answering is DOWN after this many seconds, and its jobs end NODE_FAIL (and are
# requeued): Slurm's default is 300 s; short here so the node-failure tests take seconds.
SlurmdTimeout=$SLURMD_TIMEOUT
# Keep finished jobs visible to squeue/scontrol for 5 minutes; quick kills for quick tests.
MinJobAge=300
InactiveLimit=0
KillWait=5
SlurmctldDebug=info
SlurmdDebug=info
EOF
  # Single-host only: the nodes share memory without knowing it, and Open MPI's shared-memory
  # transport crashes between them, so every task gets TCP (unless it chose a transport).
  [[ $NET_MODE == netns ]] || echo "TaskProlog=$STATE/single-host-task-prolog.sh"
  echo
  if [[ $NET_MODE == netns ]]; then
    for n in "${NODES[@]}"; do
      echo "NodeName=$n NodeHostname=$n NodeAddr=$(node_addr "$n") CPUs=8 RealMemory=10000 Gres=gpu:4 State=UNKNOWN"
    done
  else
    echo "NodeName=n[1-$NODE_COUNT] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[17001-$((17000 + NODE_COUNT))] CPUs=8 RealMemory=10000 Gres=gpu:4 State=UNKNOWN"
  fi
  cat <<EOF
PartitionName=cpu Nodes=n[1-$NODE_COUNT] Default=YES MaxTime=60 State=UP
PartitionName=gpu Nodes=n[1-$NODE_COUNT] MaxTime=60 State=UP
EOF
}

render_gres_conf() {
  cat <<EOF
# Written by hpcdist cluster/up.sh: four fake GPUs per node (character devices, c 1 3).
AutoDetect=off
Name=gpu File=$STATE/dev/nvidia[0-3]
EOF
}

render_slurmdbd_conf() {
  cat <<EOF
# Written by hpcdist cluster/up.sh; edits are overwritten.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
}

# install_conf NAME MODE: render NAME and install it into /etc/slurm if different.
install_conf() {
  local name=$1 mode=$2 new=$STATE/render/$1 dest=$SLURM_ETC/$1
  "render_${name//./_}" >"$new"
  cmp -s "$new" "$dest" && return 0
  install -m "$mode" -o root -g root "$new" "$dest"
  log "wrote $dest"
}
# stale NAME...: true when a daemon reading these files was started with other contents.
stale() {
  local name
  for name in "$@"; do cmp -s "$STATE/render/$name" "$STATE/active/$name" || return 0; done
  return 1
}
# mark_active NAME...: record these files as what the running daemons use.
mark_active() {
  local name
  for name in "$@"; do install -m 600 "$STATE/render/$name" "$STATE/active/$name"; done
}

mkdir -p "$SLURM_ETC"
install_conf slurm.conf 644
install_conf gres.conf 644
install_conf slurmdbd.conf 600

# ---------------------------------------------------------------------------------------
# munged, run as the munge user.
if ! munge_ok; then
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 755 /run/munge
  install -d -o munge -g munge -m 700 /var/log/munge /var/lib/munge
  log "starting munged"
  runuser -u munge -- munged
  wait_for 10 munge_ok || fail "munged did not start" /var/log/munge/munged.log
fi

# ---------------------------------------------------------------------------------------
# MariaDB through mysqld_safe, plus the accounting database and its user.
if ! mariadb_ok; then
  install -d -o mysql -g mysql -m 755 /run/mysqld
  if [[ ! -d /var/lib/mysql/mysql ]]; then
    log "initialising /var/lib/mysql"
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$STATE/log/mariadb-install.log" 2>&1 ||
      fail "mariadb-install-db failed" "$STATE/log/mariadb-install.log"
  fi
  touch "$STATE/log/mariadb.log"
  chown mysql:mysql "$STATE/log/mariadb.log"
  log "starting mariadb"
  # In its own session, away from our stdout, so callers piping up.sh do not wait on it.
  setsid mysqld_safe --log-error="$STATE/log/mariadb.log" </dev/null >/dev/null 2>&1 &
  echo $! >"$STATE/run/mysqld_safe.pid"
  wait_for 30 mariadb_ok || fail "mariadb did not start" "$STATE/log/mariadb.log"
fi
mariadb --protocol=socket <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL PRIVILEGES ON $DB_NAME.* TO '$DB_USER'@'localhost';
EOF

# ---------------------------------------------------------------------------------------
# slurmdbd, then the cluster record it must know before slurmctld registers.
stale slurmdbd.conf && stop_pidfile "$STATE/run/slurmdbd.pid" slurmdbd
if ! slurmdbd_ok; then
  stop_pidfile "$STATE/run/slurmdbd.pid" slurmdbd # a live pid that does not answer
  ensure_not_running slurmdbd
  log "starting slurmdbd"
  slurmdbd
  wait_for 30 slurmdbd_ok || fail "slurmdbd did not answer" "$STATE/log/slurmdbd.log" "$STATE/log/mariadb.log"
fi
mark_active slurmdbd.conf
if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER_NAME"; then
  out=$(sacctmgr -i add cluster "$CLUSTER_NAME" 2>&1) || grep -qi 'already exists' <<<"$out" ||
    fail "sacctmgr add cluster: $out" "$STATE/log/slurmdbd.log"
  log "added cluster $CLUSTER_NAME to accounting"
fi

# ---------------------------------------------------------------------------------------
# slurmctld and the slurmd; a changed slurm.conf/gres.conf restarts them all (running jobs live
# on in their slurmstepd). Nodes beyond the count asked for are stopped.
if stale slurm.conf gres.conf; then
  for n in $(known_nodes); do stop_pidfile "$STATE/run/slurmd-$n.pid" slurmd; done
  stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
fi
if ! slurmctld_ok; then
  stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
  ensure_not_running slurmctld
  log "starting slurmctld"
  slurmctld
  wait_for 30 slurmctld_ok || fail "slurmctld did not answer" "$STATE/log/slurmctld.log"
fi
# slurmd_placed NODE: its slurmd runs in the network namespace this mode wants.
slurmd_placed() {
  local pid
  pid=$(cat "$STATE/run/slurmd-$1.pid" 2>/dev/null) || return 1
  if [[ $NET_MODE == netns ]]; then
    netns_matches "$pid" "$1"
  else
    [[ $(readlink "/proc/$pid/ns/net") == "$(readlink /proc/self/ns/net)" ]]
  fi
}
declare -A started_at=() # node -> epoch second its slurmd was started by this run
for n in "${NODES[@]}"; do
  if slurmd_ok "$n" && ! slurmd_placed "$n"; then
    stop_pidfile "$STATE/run/slurmd-$n.pid" slurmd
  fi
  if ! slurmd_ok "$n"; then
    ensure_not_running slurmd
    log "starting slurmd -N $n ($NET_MODE)"
    started_at[$n]=$(date +%s)
    if [[ $NET_MODE == netns ]]; then
      start_slurmd "$n" || fail "slurmd -N $n did not start" "$STATE/log/slurmd-$n.log"
    else
      setsid bash -c "$(supervised_slurmd "$n")" </dev/null >/dev/null 2>&1 &
    fi
    # The forked daemon writes its pid file a moment later; the next node's check needs it.
    wait_for 10 slurmd_ok "$n" || fail "slurmd -N $n did not start" "$STATE/log/slurmd-$n.log"
  fi
done
mark_active slurm.conf gres.conf
# Namespaces left by an earlier netns run, or by nodes no longer configured, now that no slurmd
# runs in them.
if [[ $NET_MODE == netns ]]; then net_down_extra; else net_down; fi

# ---------------------------------------------------------------------------------------
# Wait until both nodes take jobs and accounting answers. Nodes left DOWN or DRAINED by an
# earlier configuration (their state survives in StateSaveLocation) are resumed.
node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }
node_reasons() { sinfo -h -N -o '%N=%T (%E)' 2>/dev/null | sort -u | paste -sd ' '; }
# registered NODE EPOCH: slurmctld heard from a slurmd of NODE started at or after EPOCH.
# (slurmctld still shows a node idle for a while after its slurmd died.)
registered() {
  local t
  t=$(scontrol show node "$1" -o 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*') || return 1
  t=$(date -d "${t#*=}" +%s 2>/dev/null) || return 1
  ((t >= $2))
}
ready() {
  local states busy n
  for n in "${!started_at[@]}"; do registered "$n" "${started_at[$n]}" || return 1; done
  states=$(node_states) || return 1
  busy=$(awk '$2 !~ /^(idle|mixed|allocated)$/' <<<"$states")
  [[ -n $states && -z $busy ]] && sacct -n -X -S now-1minutes >/dev/null 2>&1
}
declare -A resumed=()
resume_bad_nodes() {
  local node state
  while read -r node state; do
    case $state in
      down | drained | draining | fail | failing | inval)
        [[ -n ${resumed[$node]:-} ]] || log "resuming $node (was $state)"
        resumed[$node]=1
        scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
    esac
  done < <(node_states)
}
node_logs=()
for n in "${NODES[@]}"; do node_logs+=("$STATE/log/slurmd-$n.log"); done
deadline=$((SECONDS + 60))
next_resume=$SECONDS
until ready; do
  # A daemon that died (a port in use, a bad config) will not come back: report it now.
  pid_alive "$STATE/run/slurmctld.pid" slurmctld || fail "slurmctld died" "$STATE/log/slurmctld.log"
  for n in "${NODES[@]}"; do
    slurmd_ok "$n" || fail "slurmd -N $n died" "$STATE/log/slurmd-$n.log"
  done
  ((SECONDS < deadline)) || {
    log "node states: $(node_reasons)"
    fail "nodes not idle or sacct not working after 60 s" \
      "$STATE/log/slurmctld.log" "${node_logs[@]}" "$STATE/log/slurmdbd.log"
  }
  if ((SECONDS >= next_resume)); then
    resume_bad_nodes
    next_resume=$((SECONDS + 5))
  fi
  sleep 0.5
done

# The shared-site test bed: ordinary accounts, the group's storage root, a venv they can run.
bash "$HERE/users.sh"

echo "[cluster] up ($(cat "$MODE_FILE")): cluster $CLUSTER_NAME, nodes $(node_states | awk "{printf \"%s=%s \", \$1, \$2}")| partitions cpu (default), gpu | state $STATE"
