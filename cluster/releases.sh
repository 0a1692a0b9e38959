#!/usr/bin/env bash
# Other Slurm releases on this machine beside up.sh's 22.05 (README.md, "Releases"): each a
# cluster whose daemons AND client commands are that release, taken from the Debian suite that
# ships it (24.11: trixie; 26.05: forky), so the suite meets the Slurm its users log in to.
#
#   releases.sh up [RELEASE...]    start 24.11 and 26.05 (or those named): the root, its wrappers, slurmdbd,
#                                  slurmctld and two nodes, a node `kill` left dead among them
#                                  (idempotent: about a second when all runs)
#   releases.sh down [RELEASE...]  stop its daemons; root, state and logs are kept
#   releases.sh env RELEASE        print `export PATH=BIN:$PATH SLURM_CONF=...` for `eval`
#   releases.sh kill RELEASE NODE  the node dies as hardware does (nodefault.sh's kill for these
#                                  single-host nodes): its slurmd's port silenced, then its slurmd and
#                                  every process in its mount namespace (slurmstepd, the job's tasks)
#                                  killed with SIGKILL; Slurm marks it DOWN after SlurmdTimeout
#   releases.sh revive RELEASE NODE  the node back (its port answers, slurmd started as `up` starts
#                                  it); returns once Slurm shows every node of RELEASE in service
#
# The release's files come from a Debian root made once with debootstrap (--variant=minbase,
# Slurm's packages and what they need, no docs) at $RELEASES_STATE/RELEASE/root, cached as
# image.sh caches its image: a stamp of its inputs, rebuilt only when they change, built into a
# sibling ROOT.tmp.PID and renamed, never half-built. Its daemons and commands run on the host,
# not chrooted (jobs must see the host's venv, Python and storage): every Slurm program and plugin
# of the root has the root's dynamic loader and a DT_RPATH to the root's libraries (patchelf,
# run inside the root), slurm.conf's PluginDir is the root's, and slurmd is told the root's
# slurmstepd (-d). Clients reach it through small wrappers in $RELEASES_STATE/RELEASE/bin
# (sbatch, srun, scontrol, ...), first on PATH, each setting SLURM_CONF; a job inherits that PATH,
# so its steps run this release's srun too (the nodes are this machine).
#
# Shared with up.sh: munged (its socket and key: munge's wire format is the same across these
# releases; `up` checks a credential of the root's libmunge against the host's unmunge) and
# MariaDB (a database of its own). Slurm supports no slurmdbd older than its slurmctld, so each
# release runs its own slurmdbd on its own port, with the test bed's accounts alice, bob, carol.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

MAIN_STATE=$STATE # up.sh's: munged and MariaDB run from it
ALL=(24.11 26.05)
# Per release: the Debian suite that ships it, its ClusterName, slurmctld and slurmdbd ports, node
# names and first node port (the second node has the next). up.sh's cluster has 6817-6819 and
# 17001-17008, the variants 6831-6833 and 17011-17032.
declare -A SUITE=([24.11]=trixie [26.05]=forky)
declare -A CLUSTER=([24.11]=r2411 [26.05]=r2605)
declare -A CTLD_PORT=([24.11]=6841 [26.05]=6851)
declare -A DBD_PORT=([24.11]=6849 [26.05]=6859)
declare -A NODE_NAMES=([24.11]="t1 t2" [26.05]="u1 u2")
declare -A NODE_PORT=([24.11]=17041 [26.05]=17051)
# What the root holds: Slurm's daemons and commands, its slurmdbd, munge's library (and its
# client, for the compatibility check) and patchelf, which points Slurm's programs at the root.
PACKAGES=slurm-wlm,slurmdbd,munge,patchelf
# The commands a wrapper is made for (those hpcdist and its users run, and their neighbours).
COMMANDS=(sbatch srun salloc scontrol sinfo squeue scancel sacct sacctmgr sstat sprio sshare sreport sattach sbcast)
MEMBERS=(alice bob carol) # cluster/users.sh's accounts
RELEASES_ETC=/etc/slurm-releases

usage() {
  echo "usage: releases.sh up [RELEASE...] | down [RELEASE...] | env RELEASE | kill RELEASE NODE | revive RELEASE NODE" \
       "  (RELEASE: ${ALL[*]})" >&2
  exit 2
}
is_release() { [[ " ${ALL[*]} " == *" $1 "* ]]; }

# use RELEASE: point STATE (lib.sh's helpers read it), ROOT, BIN, ETC, SLURM_CONF and PATH (every
# Slurm command run from here on is the release's) at RELEASE.
use() {
  R=$1
  BASE=$RELEASES_STATE/$R
  ROOT=$BASE/root
  BIN=$BASE/bin
  STATE=$BASE/state
  ETC=$RELEASES_ETC/$R
  export SLURM_CONF=$ETC/slurm.conf
  export PATH="$BIN:${PATH_HOST:=$PATH}"
  read -r -a RNODES <<<"${NODE_NAMES[$R]}"
}

# ---------------------------------------------------------------------------------------
# The root. The mirror apt uses (as image.sh finds it), else Debian's.
apt_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -r $f ]] || continue
    awk 'BEGIN{RS=""} { for (i = 1; i <= NF; i++) if ($i == "URIs:") { print $(i+1); exit } }' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r $f ]] || continue
    awk '$1 == "deb" { print $2; exit }' "$f"
  done
}
MIRROR=${HPCDIST_RELEASES_MIRROR:-$(apt_mirror | grep -m1 -v security || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
LIBDIR=usr/lib/x86_64-linux-gnu
LOADER=$LIBDIR/ld-linux-x86-64.so.2

# patch_root TMP: every ELF program and plugin of Slurm's packages in TMP loads the libraries of
# ROOT (the name TMP will have): the root's loader, then a DT_RPATH (which, unlike DT_RUNPATH, also
# serves the plugins dlopen'ed and their libraries) to the root's library folders.
patch_root() {
  local tmp=$1 rpath="$ROOT/$LIBDIR/slurm-wlm:$ROOT/$LIBDIR:$ROOT/lib/x86_64-linux-gnu" f files=()
  while read -r f; do
    [[ -f $tmp$f && ! -L $tmp$f ]] || continue
    [[ $(head -c 4 "$tmp$f" | od -An -c | tr -d ' ') == 177ELF ]] || continue
    files+=("$f")
  done < <(chroot "$tmp" dpkg -L slurm-client slurmctld slurmd slurmdbd slurm-wlm-basic-plugins \
             slurm-wlm-mysql-plugin "$(libslurm_package "$tmp")" 2>/dev/null |
           grep -E '^/usr/(s?bin|lib/x86_64-linux-gnu)/' | sort -u)
  ((${#files[@]} > 20)) || die_build "found only ${#files[@]} ELF files of Slurm's packages in the root"
  for f in "${files[@]}"; do
    if [[ $f == /usr/bin/* || $f == /usr/sbin/* ]]; then
      chroot "$tmp" patchelf --set-interpreter "$ROOT/$LOADER" --force-rpath --set-rpath "$rpath" "$f"
    else
      chroot "$tmp" patchelf --force-rpath --set-rpath "$rpath" "$f"
    fi
  done
  log "pointed ${#files[@]} programs and plugins of Slurm at $ROOT's libraries"
}
# own_links TMP: the root's links to Debian's alternatives (/usr/sbin/slurmd -> /etc/alternatives/
# slurmd -> /usr/sbin/slurmd-wlm) name the host's files when followed from the host: each link of
# Slurm's programs names its file in ROOT instead.
own_links() {
  local tmp=$1 l
  for l in "$tmp"/usr/bin/s* "$tmp"/usr/sbin/slurm*; do
    [[ -L $l && $(readlink "$l") == /* ]] || continue
    ln -sfn "$ROOT$(chroot "$tmp" readlink -f "${l#"$tmp"}")" "$l"
  done
}
die_build() { fail "building the $R root: $*"; }
# libslurm_package TMP: the name of libslurm's package in TMP, which changes with its soname and
# Debian's transitions (24.11: libslurm42; 26.05: libslurm45t64).
libslurm_package() {
  chroot "$1" dpkg-query -W -f '${Package} ${Status}\n' 'libslurm[0-9]*' 2>/dev/null |
    awk '$NF == "installed" { print $1; exit }'
}
# debootstrap_script SUITE: debootstrap's script for SUITE. A Debian suite newer than this
# machine's debootstrap (forky on bookworm's 1.0.128) has none; every suite since bullseye is
# bootstrapped as sid is (the trixie script is a link to sid's), so sid's serves it.
debootstrap_script() {
  local dir=/usr/share/debootstrap/scripts
  if [[ -e $dir/$1 ]]; then echo "$dir/$1"; else echo "$dir/sid"; fi
}

# build_root: ROOT as the stamp of its inputs says it should be, else built anew into ROOT.tmp.PID
# and renamed (the old one removed after). The .debs cache beside it keeps a rebuild off the net.
root_key() {
  { printf '%s\n' "${SUITE[$R]}" "$MIRROR" "$PACKAGES" "$ROOT"; declare -f build_root patch_root own_links libslurm_package; } |
    sha256sum | cut -c1-16
}
build_root() {
  local key tmp=$ROOT.tmp.$$ debs=$RELEASES_STATE/.debs t=$SECONDS
  key=$(root_key)
  [[ -f $ROOT/.hpcdist-root && $(cat "$ROOT/.hpcdist-root") == "$key" ]] && return 0
  command -v debootstrap >/dev/null || fail "debootstrap is missing: run cluster/install-deps.sh"
  mkdir -p "$debs"
  rm -rf "$ROOT".tmp.* "$ROOT.old"
  trap 'rm -rf "$tmp" "$tmp.log"' EXIT
  log "building the Slurm $R root: debootstrap --variant=minbase ${SUITE[$R]} from $MIRROR with $PACKAGES"
  debootstrap --variant=minbase --include="$PACKAGES" --cache-dir="$debs" "${SUITE[$R]}" "$tmp" "$MIRROR" \
    "$(debootstrap_script "${SUITE[$R]}")" >"$tmp.log" 2>&1 || { tail -n 20 "$tmp.log" >&2; die_build "debootstrap failed (its log's tail above)"; }
  rm -f "$tmp.log"
  rm -rf "$tmp"/usr/share/{doc,man,info,locale}/* "$tmp"/var/cache/apt/* "$tmp"/var/lib/apt/lists/*
  [[ -x $tmp/usr/sbin/slurmstepd && -d $tmp/$LIBDIR/slurm-wlm ]] || die_build "no slurmstepd or plugin folder in it"
  patch_root "$tmp"
  own_links "$tmp"
  echo "$key" >"$tmp/.hpcdist-root"
  chmod 755 "$tmp"
  [[ ! -e $ROOT ]] || mv "$ROOT" "$ROOT.old"
  mv "$tmp" "$ROOT"
  rm -rf "$ROOT.old"
  trap - EXIT
  log "built $ROOT ($(du -sh "$ROOT" | cut -f1), $((SECONDS - t)) s)"
  REBUILT=1
}

# The release's version as its own slurmd says it ("slurm-wlm 24.11.5" -> 24.11; it reads no config).
check_version() {
  local v
  v=$("$ROOT/usr/sbin/slurmd" -V 2>&1) || fail "the $R root's slurmd does not run: $v"
  [[ $v == "slurm $R."* || $v == "slurm-wlm $R."* ]] || fail "the $R root's slurmd is '$v', not Slurm $R"
}

# make_wrappers: BIN/NAME runs the root's NAME with this release's SLURM_CONF.
make_wrappers() {
  local name tmp=$BIN.tmp.$$ want have
  want=$(for name in "${COMMANDS[@]}"; do echo "$name"; done)
  have=$(cat "$BIN/.commands" 2>/dev/null || true)
  [[ $have == "$want"$'\n'"$ROOT $SLURM_CONF" ]] && return 0
  rm -rf "$tmp"
  mkdir -p "$tmp"
  for name in "${COMMANDS[@]}"; do
    [[ -x $ROOT/usr/bin/$name ]] || continue
    cat >"$tmp/$name" <<EOF
#!/bin/sh
# Slurm $R's $name (hpcdist cluster/releases.sh): the $R root's program, for the cluster ${CLUSTER[$R]}.
SLURM_CONF=$SLURM_CONF
export SLURM_CONF
exec $ROOT/usr/bin/$name "\$@"
EOF
    chmod 755 "$tmp/$name"
  done
  printf '%s\n%s\n' "$want" "$ROOT $SLURM_CONF" >"$tmp/.commands"
  chmod 755 "$tmp"
  rm -rf "$BIN"
  mv "$tmp" "$BIN"
  log "wrote the $R commands' wrappers in $BIN"
}

# munge_compatible: a credential made by the root's munge client (its libmunge, through the host's
# munged) decodes with the host's unmunge.
munge_compatible() {
  local out
  out=$("$ROOT/$LOADER" --library-path "$ROOT/$LIBDIR" "$ROOT/usr/bin/munge" -n 2>&1 | unmunge 2>&1) ||
    fail "munge: the $R root's libmunge and the host's munged do not agree: $out" /var/log/munge/munged.log
}

# ---------------------------------------------------------------------------------------
# Configuration: the variants' single-host cluster (variants.sh), its own accounting.
render_slurm_conf() {
  local port=${NODE_PORT[$R]} n
  cat <<EOF
# Written by hpcdist cluster/releases.sh (Slurm $R); edits are overwritten.
ClusterName=${CLUSTER[$R]}
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
PluginDir=$ROOT/$LIBDIR/slurm-wlm
SlurmctldPort=${CTLD_PORT[$R]}
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
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5
MpiDefault=none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=${DBD_PORT[$R]}
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
  for n in "${RNODES[@]}"; do
    echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=4 RealMemory=4000 State=UNKNOWN"
    port=$((port + 1))
  done
  echo "PartitionName=main Nodes=${RNODES[0]},${RNODES[1]} Default=YES MaxTime=60 State=UP"
}

render_slurmdbd_conf() {
  cat <<EOF
# Written by hpcdist cluster/releases.sh (Slurm $R); edits are overwritten.
AuthType=auth/munge
DbdHost=localhost
DbdPort=${DBD_PORT[$R]}
SlurmUser=root
PluginDir=$ROOT/$LIBDIR/slurm-wlm
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$(db_name)
EOF
}
db_name() { echo "${DB_NAME}_${CLUSTER[$R]}"; }

# install_conf NAME MODE: render NAME into $STATE/render and install it into $ETC if different.
install_conf() {
  local name=$1 new=$STATE/render/$1 dest=$ETC/$1
  "render_${name//./_}" >"$new"
  cmp -s "$new" "$dest" && return 0
  install -m "$2" -o root -g root "$new" "$dest"
  log "wrote $dest"
}
stale() { # NAME...: the running daemons were started with other contents
  local name
  for name in "$@"; do cmp -s "$STATE/render/$name" "$STATE/active/$name" || return 0; done
  return 1
}
mark_active() {
  local name
  for name in "$@"; do install -m 600 "$STATE/render/$name" "$STATE/active/$name"; done
}

prepare() {
  local n
  mkdir -p "$STATE"/{log,run,ctld,render,active} "$ETC"
  for n in "${RNODES[@]}"; do mkdir -p "$STATE/spool/$n" "$STATE/tmpfs/$n"; done
  # Users' tasks run the TaskProlog and read the config: the folders down to them must be searchable.
  chmod 755 "$RELEASES_STATE" "$BASE" "$STATE" "$RELEASES_ETC" "$ETC"
  cmp -s "$HERE/single-host-task-prolog.sh" "$STATE/single-host-task-prolog.sh" ||
    install -m 755 "$HERE/single-host-task-prolog.sh" "$STATE/single-host-task-prolog.sh"
  install_conf slurm.conf 644
  install_conf slurmdbd.conf 600
}

# ---------------------------------------------------------------------------------------
# Daemons.
rslurmdbd_ok() { pid_alive "$STATE/run/slurmdbd.pid" slurmdbd && sacctmgr -n show cluster >/dev/null 2>&1; }

sacctmgr_add() { # sacctmgr -i ARGS, where "nothing new" or "already exists" is no failure
  local out
  out=$(sacctmgr -i "$@" 2>&1) || grep -qi 'nothing new\|nothing modified\|already exist' <<<"$out" ||
    fail "sacctmgr $*: $out" "$STATE/log/slurmdbd.log"
}

start_slurmdbd() {
  mariadb_ok || fail "MariaDB does not answer: run cluster/up.sh (make cluster-up) first" "$MAIN_STATE/log/mariadb.log"
  mariadb --protocol=socket <<EOF
CREATE DATABASE IF NOT EXISTS $(db_name);
GRANT ALL PRIVILEGES ON $(db_name).* TO '$DB_USER'@'localhost';
EOF
  stale slurmdbd.conf && stop_pidfile "$STATE/run/slurmdbd.pid" slurmdbd
  if ! rslurmdbd_ok; then
    stop_pidfile "$STATE/run/slurmdbd.pid" slurmdbd
    log "starting slurmdbd of $R (port ${DBD_PORT[$R]}, database $(db_name))"
    "$ROOT/usr/sbin/slurmdbd" 9>&- # not holding up's lock for as long as it runs
    wait_for 60 rslurmdbd_ok || fail "slurmdbd of $R did not answer" "$STATE/log/slurmdbd.log"
  fi
  mark_active slurmdbd.conf
}

# accounts: the cluster's record (before its slurmctld registers), alice, bob and carol in account
# root as users.sh makes them for 22.05; asked once, written only when one is missing.
accounts() {
  local known users
  sacctmgr -n -P show cluster format=cluster | grep -qx "${CLUSTER[$R]}" || {
    sacctmgr_add add cluster "${CLUSTER[$R]}"
    log "added cluster ${CLUSTER[$R]} to $R's accounting"
  }
  known=$(sacctmgr -n -P show assoc where cluster="${CLUSTER[$R]}" format=user | sort -u)
  users=$(for u in "${MEMBERS[@]}"; do grep -qx "$u" <<<"$known" || echo "$u"; done | paste -sd ,)
  [[ -z $users ]] && return 0
  sacctmgr_add add user "$users" account=root cluster="${CLUSTER[$R]}"
  log "added $users to account root of ${CLUSTER[$R]}"
}

# supervised_slurmd NODE: lib.sh's restart loop around the root's slurmd and slurmstepd.
supervised_slurmd() {
  local log="$STATE/log/slurmd-$1.log"
  echo "cd $STATE/log || exit 1; for fd in /proc/\$\$/fd/*; do fd=\${fd##*/}; ((fd > 2)) && eval \"exec \$fd>&-\" 2>/dev/null; done;" \
       "while :; do $ROOT/usr/sbin/slurmd -D -N $1 -d $ROOT/usr/sbin/slurmstepd; rc=\$?; case \$rc in 134|135|136|139) ;; *) exit \$rc;; esac;" \
       "echo \"[cluster] \$(date -Is) slurmd -N $1 crashed (exit \$rc); started again\" >> $log; sleep 1; done"
}

# The folder a slurmd's mount namespace sees as the host's PMIx folder (/$LIBDIR/pmix2): the root's
# PMIx, which Debian's mpi_pmix plugin dlopens by that path into the root's slurmstepd, and beside it
# the host's own libpmix and components (these win a name both have): the host's Open MPI in the
# job's tasks (mpirun, mpi4py), in the same namespace, opens them by the same folder
# (/$LIBDIR/libpmix.so.2 -> pmix2/lib/libpmix.so.2.6.2) and found no libpmix without them. Made once
# per root and host PMIx, into a folder of their own, so a running slurmd's is never changed.
pmix_folder() {
  local host dir f
  host=$(readlink -f "/$LIBDIR/libpmix.so.2" || true)
  dir=$STATE/pmix2-$(cat "$ROOT/.hpcdist-root")-${host##*/}
  if [[ ! -d $dir ]]; then
    rm -rf "$dir.tmp"
    cp -a "$ROOT/$LIBDIR/pmix2" "$dir.tmp"
    if [[ $host == /$LIBDIR/pmix2/lib/* ]]; then
      cp -a "$host" "$dir.tmp/lib/"
      for f in "/$LIBDIR/pmix2/lib/pmix/"*.so; do
        if [[ -e $f ]]; then cp -a "$f" "$dir.tmp/lib/pmix/"; fi
      done
    fi
    mv "$dir.tmp" "$dir"
  fi
  echo "$dir"
}

declare -A started_at=()
start_daemons() {
  local n bind
  if stale slurm.conf; then
    for n in "${RNODES[@]}"; do stop_pidfile "$STATE/run/slurmd-$n.pid" slurmd; done
    stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
  fi
  if ! slurmctld_ok; then
    stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
    log "starting slurmctld of $R (port ${CTLD_PORT[$R]})"
    "$ROOT/usr/sbin/slurmctld" 9>&-
    wait_for 30 slurmctld_ok || fail "slurmctld of $R did not answer" "$STATE/log/slurmctld.log"
  fi
  for n in "${RNODES[@]}"; do
    slurmd_ok "$n" && continue
    log "starting slurmd -N $n ($R)"
    started_at[$n]=$(date +%s)
    # In a mount namespace of its own where the host's PMIx folder is the root's (pmix_folder): Debian's
    # mpi_pmix plugin dlopens libpmix by that path (and libpmix its components), which from the host
    # would load the host's PMIx 4 into the root's slurmstepd. A root without PMIx (forky's 26.05 is
    # built without the mpi_pmix plugin) has nothing to bind.
    bind=true
    [[ -d $ROOT/$LIBDIR/pmix2 ]] && bind="mount --bind $(pmix_folder) /$LIBDIR/pmix2"
    setsid unshare -m --propagation slave bash -c "$bind && $(supervised_slurmd "$n")" </dev/null >/dev/null 2>&1 &
    wait_for 10 slurmd_ok "$n" || fail "slurmd -N $n ($R) did not start" "$STATE/log/slurmd-$n.log"
  done
  mark_active slurm.conf
}

node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }
registered() { # NODE EPOCH: slurmctld heard from a slurmd of NODE started at or after EPOCH
  local t
  t=$(scontrol show node "$1" -o 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*') || return 1
  t=$(date -d "${t#*=}" +%s 2>/dev/null) || return 1
  ((t >= $2))
}
ready() {
  local states n
  for n in "${RNODES[@]}"; do
    [[ -z ${started_at[$n]:-} ]] || registered "$n" "${started_at[$n]}" || return 1
  done
  states=$(node_states) || return 1
  [[ -n $states && -z $(awk '$2 !~ /^(idle|mixed|allocated)$/' <<<"$states") ]] || return 1
  sacct -n -X -S now-1minutes >/dev/null 2>&1
}
wait_ready() {
  local deadline=$((SECONDS + 60)) next_resume=$((SECONDS + 5)) node state n
  until ready; do
    pid_alive "$STATE/run/slurmctld.pid" slurmctld || fail "slurmctld of $R died" "$STATE/log/slurmctld.log"
    for n in "${RNODES[@]}"; do slurmd_ok "$n" || fail "slurmd -N $n ($R) died" "$STATE/log/slurmd-$n.log"; done
    ((SECONDS < deadline)) || fail "Slurm $R: nodes not idle or sacct not working after 60 s ($(node_states | paste -sd ' '))" \
      "$STATE/log/slurmctld.log" "$STATE/log/slurmd-${RNODES[0]}.log" "$STATE/log/slurmdbd.log"
    if ((SECONDS >= next_resume)); then
      next_resume=$((SECONDS + 5))
      while read -r node state; do
        case $state in down* | drain* | fail* | inval*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;; esac
      done < <(node_states)
    fi
    sleep 0.5
  done
}

cmd_up() {
  local r n names=("$@") t=$SECONDS
  ((${#names[@]})) || names=("${ALL[@]}")
  munge_ok || fail "munged does not answer: run cluster/up.sh (make cluster-up) first" /var/log/munge/munged.log
  HOST=$(hostname -s)
  mkdir -p "$RELEASES_STATE" "$RELEASES_ETC"
  for r in "${names[@]}"; do
    use "$r"
    mkdir -p "$BASE"
    exec 9>"$BASE/.lock"
    flock 9
    REBUILT=0
    build_root
    ((REBUILT == 0)) || stop_daemons # they run the files of the root it replaced
    check_version
    munge_compatible
    make_wrappers
    prepare
    start_slurmdbd
    accounts
    for n in "${RNODES[@]}"; do undrop "$n"; done # a node `kill` left dead
    start_daemons
    wait_ready
    log "Slurm $R up ($((SECONDS - t)) s): $(scontrol --version), cluster ${CLUSTER[$R]}, controller :${CTLD_PORT[$R]}," \
        "nodes $(node_states | paste -sd ' '); clients: eval \"\$(cluster/releases.sh env $R)\""
    exec 9>&-
  done
}

stop_daemons() {
  local n
  for n in "$STATE"/run/slurmd-*.pid; do [[ -e $n ]] && stop_pidfile "$n" slurmd; done
  stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
  stop_pidfile "$STATE/run/slurmdbd.pid" slurmdbd
}

cmd_down() {
  local r names=("$@")
  ((${#names[@]})) || names=("${ALL[@]}")
  for r in "${names[@]}"; do
    use "$r"
    [[ -d $STATE ]] || continue
    stop_daemons
  done
  log "Slurm ${names[*]} down"
}

# ---------------------------------------------------------------------------------------
# Node faults. A node of a release is a slurmd on this host in a mount namespace of its own
# (start_daemons), so a dead node is: its slurmd's port gives no reply (a DROP rule on lo, as a
# dead host's address gives none: a refused connection would prove a live kernel, and the in-job
# supervisor takes only silence for death), and every process of that namespace is gone.
drop_rule() { # NODE: the iptables rule (less the chain) that silences NODE's slurmd port
  local i=0 n
  for n in "${RNODES[@]}"; do
    [[ $n == "$1" ]] && break
    i=$((i + 1))
  done
  echo "-i lo -p tcp --dport $((NODE_PORT[$R] + i)) -m comment --comment hpcdist-releases-dead-$R-$1 -j DROP"
}
ns_pids() { # MNTNS: the processes in that mount namespace
  local d
  for d in /proc/[0-9]*; do
    [[ $(readlink "$d/ns/mnt" 2>/dev/null) == "$1" ]] && echo "${d#/proc/}"
  done
  return 0
}
release_node() { [[ " ${RNODES[*]} " == *" $1 "* ]] || { log "Slurm $R has no node '$1'; its nodes are ${RNODES[*]}"; exit 2; }; }

cmd_kill() {
  local node=$2 pid ns pids
  use "$1"
  release_node "$node"
  pid=$(cat "$STATE/run/slurmd-$node.pid" 2>/dev/null) || pid=
  proc_is "$pid" slurmd || fail "slurmd -N $node ($R) is not running: nothing to kill (releases.sh revive $R $node starts it)"
  ns=$(readlink "/proc/$pid/ns/mnt")
  [[ $ns != "$(readlink /proc/$$/ns/mnt)" ]] || fail "slurmd -N $node ($R) shares this shell's mount namespace: not killing it"
  # shellcheck disable=SC2046 # the rule's words
  iptables -I INPUT $(drop_rule "$node")
  # slurmd first, so it forks no new slurmstepd; then everything else, until nothing is left (a task may fork while we kill)
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    pids=$(ns_pids "$ns")
    [[ -z $pids ]] && break
    # shellcheck disable=SC2086 # one pid a word
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
  done
  [[ -z $(ns_pids "$ns") ]] || fail "processes still live in $node ($R): $(ns_pids "$ns" | xargs)"
  log "Slurm $R: $node killed (its slurmd's port silent, every process in it killed); Slurm marks it DOWN after $SLURMD_TIMEOUT s"
}

undrop() { # NODE: its slurmd's port answers again (no rule left; `up` runs it for every node)
  # shellcheck disable=SC2046 # the rule's words
  while iptables -D INPUT $(drop_rule "$1") 2>/dev/null; do :; done
}

cmd_revive() { # `up`: the port answers again, slurmd started, Slurm (ReturnToService=2) takes the node back
  use "$1"
  release_node "$2"
  cmd_up "$1"
}

(($#)) || usage
cmd=$1
shift
names=("$@")
if [[ $cmd == kill || $cmd == revive ]]; then names=("${@:1:1}"); fi # the second is a node
for r in "${names[@]}"; do is_release "$r" || { log "no release '$r' here; releases are ${ALL[*]}"; exit 2; }; done
case $cmd in
  env)
    (($# == 1)) || usage
    echo "export PATH=$RELEASES_STATE/$1/bin:\$PATH SLURM_CONF=$RELEASES_ETC/$1/slurm.conf" ;;
  up | down)
    ((EUID == 0)) || { log "releases.sh $cmd must run as root"; exit 1; }
    "cmd_$cmd" "$@" ;;
  kill | revive)
    (($# == 2)) || usage
    ((EUID == 0)) || { log "releases.sh $cmd must run as root"; exit 1; }
    "cmd_$cmd" "$@" ;;
  *) usage ;;
esac
