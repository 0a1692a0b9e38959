# Shared settings and helpers for the local Slurm cluster scripts. Sourced, never run.
# shellcheck shell=bash

# Everything the cluster writes (state, logs, spool, pid files, fake GPU devices) lives here.
STATE=${HPCDIST_SLURM_STATE:-/var/tmp/hpcdist-slurm}
CLUSTER_NAME=hpcdist
# The emulated nodes n1..nN: HPCDIST_NODES of them (2..8, default 4). The test suite's 2-node jobs
# run on any two; the node-failure tests need four (a node killed, the job going on on the rest).
NODE_COUNT=${HPCDIST_NODES:-4}
if [[ ! $NODE_COUNT =~ ^[2-8]$ ]]; then
  echo "[cluster] HPCDIST_NODES must be a number of nodes from 2 to 8, not '$NODE_COUNT'" >&2
  exit 2
fi
NODES=()
for ((i = 1; i <= NODE_COUNT; i++)); do NODES+=("n$i"); done
unset i
# Slurm declares a node that stops answering DOWN after this many seconds (slurm.conf
# SlurmdTimeout; Slurm's default is 300). Short here, so a killed node's job is requeued within
# half a minute; longer than a link cut the network tests make (about the job's 10 s timeout).
SLURMD_TIMEOUT=20
SLURM_ETC=/etc/slurm
# The three extra, smaller clusters of cluster/variants.sh (README.md, "Variants"): one state folder
# and one config folder each, below these. up.sh counts their daemons as known, not as strays.
VARIANTS_STATE=${HPCDIST_SLURM_VARIANTS_STATE:-/var/tmp/hpcdist-slurm-variants}
VARIANTS_ETC=/etc/slurm-variants
# Other Slurm releases of cluster/releases.sh (README.md, "Releases"): a Debian root, wrappers, state
# and logs per release below this. up.sh counts their daemons as known, not as strays.
RELEASES_STATE=${HPCDIST_SLURM_RELEASES_STATE:-/var/tmp/hpcdist-releases}

# Accounting database (local socket only; the password never leaves this machine).
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=hpcdist-slurm

MUNGE_PIDFILE=/run/munge/munged.pid

# The nodes' network (see README.md): a bridge on the host side, one network namespace per node
# with a veth whose node end is NODE_IFNAME. Traffic stays inside this subnet: no route leaves it.
NET_PREFIX=10.251.0
NET_BITS=24
BRIDGE=hpbr0
HOST_ADDR=$NET_PREFIX.1 # the bridge's address: slurmctld and srun on the login side
NODE_IFNAME=eth0        # the node end of each veth, inside its namespace
# Written by up.sh: "netns" or "single-host: <why>". Tests read it.
MODE_FILE=$STATE/mode
HOSTS_FILE=/etc/hosts
HOSTS_BEGIN="# >>> hpcdist local cluster (cluster/up.sh; removed by cluster/down.sh) >>>"
HOSTS_END="# <<< hpcdist local cluster <<<"

node_index() { echo "${1#n}"; }                          # n2 -> 2
is_node() { [[ " ${NODES[*]} " == *" $1 "* ]]; }         # one of this cluster's nodes
# known_nodes: every node a pid file or a namespace says ran here, configured now or not (a
# cluster started with more nodes than HPCDIST_NODES now asks for).
known_nodes() {
  local f names=()
  for f in "$STATE"/run/slurmd-n*.pid /run/netns/hpn*; do
    [[ -e $f ]] || continue
    f=${f##*/}; f=${f#slurmd-}; f=${f%.pid}; f=${f#hp}
    [[ $f =~ ^n[0-9]+$ ]] && names+=("$f")
  done
  printf '%s\n' "${NODES[@]}" "${names[@]}" | sort -u -V
}
node_addr() { echo "$NET_PREFIX.$((10 + ${1#n}))"; }     # n2 -> 10.251.0.12
node_netns() { echo "hp$1"; }                            # n2 -> hpn2
node_veth() { echo "hpv-$1"; }                           # n2 -> hpv-n2 (host end, on the bridge)
in_netns() { nsenter --net="/run/netns/$(node_netns "$1")" "${@:2}"; }

log() { echo "[cluster] $*" >&2; }

# fail MSG LOGFILE...: report MSG with the tail of each daemon log, then exit non-zero.
fail() {
  local msg=$1 f
  shift
  log "FAILED: $msg"
  for f in "$@"; do
    [[ -r $f ]] || continue
    echo "----- tail of $f -----" >&2
    tail -n 30 "$f" >&2
  done
  exit 1
}

# proc_is PID COMM: true when PID is a live process whose command name is COMM. Zombies do
# not count: a daemon that failed after forking can linger as one until PID 1 reaps it.
proc_is() {
  local stat
  [[ $1 =~ ^[0-9]+$ ]] || return 1
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  [[ $stat == "$1 ($2) "[!Z]* ]] # "PID (COMM) STATE ..."
}
proc_gone() { ! proc_is "$@"; }

# pid_alive PIDFILE COMM: true when PIDFILE names a live process whose command name is COMM.
pid_alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1 # the daemon may remove it as it exits
  proc_is "$pid" "$2"
}
pid_gone() { ! pid_alive "$@"; }

# wait_for SECONDS CMD...: rerun CMD every half second until it succeeds or SECONDS pass.
wait_for() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

# stop_pidfile PIDFILE COMM: SIGTERM the daemon named by PIDFILE and wait until the process
# is gone (daemons drop their pid file before they exit); SIGKILL it after 15 s.
stop_pidfile() {
  local pidfile=$1 comm=$2 pid
  pid=$(cat "$pidfile" 2>/dev/null) || return 0
  if proc_is "$pid" "$comm"; then
    log "stopping $comm (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_for 15 proc_gone "$pid" "$comm"; then
      log "$comm (pid $pid) ignored SIGTERM; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      wait_for 5 proc_gone "$pid" "$comm" || true
    fi
  fi
  rm -f "$pidfile"
}

# Liveness probes that ask the daemon itself, not just its pid file.
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
mariadb_ok() { mysqladmin --protocol=socket ping >/dev/null 2>&1; }
slurmdbd_ok() { pid_alive "$STATE/run/slurmdbd.pid" slurmdbd && sacctmgr -n show cluster >/dev/null 2>&1; }
slurmctld_ok() { pid_alive "$STATE/run/slurmctld.pid" slurmctld && scontrol ping 2>/dev/null | grep -q 'is UP'; }
slurmd_ok() { pid_alive "$STATE/run/slurmd-$1.pid" slurmd; }

# start_slurmd NODE: slurmd -N NODE in the node's network namespace under its hostname (netns
# mode); returns once its pid file names it. Not `ip netns exec`: that remounts /sys, and slurmd
# then finds no cgroup filesystem.
start_slurmd() {
  nsenter --net="/run/netns/$(node_netns "$1")" unshare --uts setsid bash -c "hostname $1; $(supervised_slurmd "$1")" \
    </dev/null >/dev/null 2>&1 &
  # The daemon writes its pid file a moment later; the next node's check needs it.
  wait_for 10 slurmd_ok "$1"
}

# supervised_slurmd NODE: the shell loop that runs slurmd -N NODE in the foreground and starts it
# again when it crashes (SIGABRT, SIGSEGV, SIGBUS, SIGFPE), as a node's service manager would:
# Slurm 22.05.8's slurmd aborted here once with heap corruption ("malloc(): unaligned fastbin
# chunk", in unpack_msg) while launching two array tasks at once, and a node left down fails
# every later test. A slurmd killed (nodefault.sh kill: SIGKILL) or stopped (down.sh: SIGTERM)
# stays down, and the loop ends with it. For bash. It works in the log folder, where a crash
# leaves its core, and first closes every descriptor it was given beyond 0-2: it lives as long as
# the node and must not hold a caller's open file (a `flock` lock taken around cluster-up would
# never be released).
supervised_slurmd() {
  local log="$STATE/log/slurmd-$1.log"
  echo "cd $STATE/log || exit 1; for fd in /proc/\$\$/fd/*; do fd=\${fd##*/}; ((fd > 2)) && eval \"exec \$fd>&-\" 2>/dev/null; done;" \
       "while :; do slurmd -D -N $1; rc=\$?; case \$rc in 134|135|136|139) ;; *) exit \$rc;; esac;" \
       "echo \"[cluster] \$(date -Is) slurmd -N $1 crashed (exit \$rc); started again\" >> $log; sleep 1; done"
}
