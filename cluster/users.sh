#!/usr/bin/env bash
# The shared-site test bed (called by up.sh; idempotent, about a second when already done):
#   - ordinary accounts: alice and bob, members of group mlgroup, and carol, outside it; each
#     known to Slurm's accounting (sacctmgr), with a 0700 home
#   - the group storage root $GROUP_ROOT (root:mlgroup, 3770: setgid and sticky, as an admin
#     makes a project folder) holding the four roots of site_configs/local-group.yaml, each 3770,
#     and the node-health record's folder scratch/node-health (root:mlgroup, 3770)
#   - an hpcdist installation they can run: a venv at $USERS_VENV built from Debian's
#     /usr/bin/python3 (this machine's default python lives in root's 0700 home), torch 2.13.0 (the
#     CPU wheel on disk) and hpcdist's dependencies from this repository; tests put the
#     repository first on PYTHONPATH, so the code under test is the working tree's
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
# shellcheck source=lib.sh
source "$HERE/lib.sh"

((EUID == 0)) || { log "users.sh must run as root"; exit 1; }

GROUP=mlgroup
MEMBERS=(alice bob)
OUTSIDER=carol
GROUP_ROOT=${HPCDIST_GROUP_ROOT:-/var/tmp/hpcdist-group}
USERS_VENV=${HPCDIST_USERS_VENV:-/opt/hpcdist-users/venv}

getent group "$GROUP" >/dev/null || { groupadd "$GROUP"; log "added group $GROUP"; }
for user in "${MEMBERS[@]}" "$OUTSIDER"; do
  if ! id "$user" >/dev/null 2>&1; then
    useradd -m -s /bin/bash -U "$user"
    log "added user $user"
  fi
  chmod 700 "/home/$user"
done
for user in "${MEMBERS[@]}"; do
  id -nG "$user" | tr ' ' '\n' | grep -qx "$GROUP" || usermod -a -G "$GROUP" "$user"
done

# Rootless podman for the members (docs/containers.md): their subuid/subgid ranges come with useradd.
# This machine's nodes share one kernel with cgroup v1 and v2 mounted side by side ("hybrid"), which
# crun refuses ("cgroups in hybrid mode not supported"): runc, with cgroupfs (no limits, rootless on
# v1); storage on the kernel's own overlay (/dev/fuse is root's here, so no fuse-overlayfs); and
# --ipc=host needs /dev/mqueue, which a node's service manager mounts and this machine does not.
if command -v podman >/dev/null; then
  for user in "${MEMBERS[@]}"; do
    conf=/home/$user/.config/containers
    runuser -u "$user" -- mkdir -p "$conf"
    printf '[storage]\ndriver = "overlay"\n' | runuser -u "$user" -- tee "$conf/storage.conf" >/dev/null
    printf '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n' |
      runuser -u "$user" -- tee "$conf/containers.conf" >/dev/null
  done
  mountpoint -q /dev/mqueue || { mkdir -p /dev/mqueue && mount -t mqueue mqueue /dev/mqueue; }
fi

# Slurm's accounting: an association per user under the cluster's root account.
known=$(sacctmgr -n -P show assoc format=user 2>/dev/null | sort -u)
for user in "${MEMBERS[@]}" "$OUTSIDER"; do
  grep -qx "$user" <<<"$known" && continue
  out=$(sacctmgr -i add user "$user" account=root 2>&1) || grep -qi 'nothing new\|already exists' <<<"$out" ||
    { log "sacctmgr add user $user: $out"; exit 1; }
  log "added $user to Slurm's accounting"
done

# The group's storage: made by the admin (here), never by hpcdist.
mkdir -p "$GROUP_ROOT"
for dir in "$GROUP_ROOT" "$GROUP_ROOT"/{results,checkpoints,scratch,logs}; do
  mkdir -p "$dir"
  chown root:"$GROUP" "$dir"
  chmod 3770 "$dir"
done
# The node-health record (hpcdist nodes) is the admin's folder too: hpcdist makes none on a group's
# root. One a member made (an earlier build let the first mark make it) goes; marks in it were tests'.
health=$GROUP_ROOT/scratch/node-health
if [[ -L $health ]] || { [[ -e $health ]] && [[ $(stat -c %u "$health") != 0 ]]; }; then
  rm -rf "$health"
  log "removed $health, made by a member, not the admin"
fi
mkdir -p "$health"
chown root:"$GROUP" "$health"
chmod 3770 "$health"

# What the accounts run: a venv outside root's home, rebuilt when pyproject.toml changes.
stamp=$USERS_VENV/.hpcdist-deps
want=$(sha256sum "$REPO/pyproject.toml" | cut -c1-16)
if [[ $(cat "$stamp" 2>/dev/null) != "$want" ]]; then
  log "building $USERS_VENV from /usr/bin/python3 (torch 2.13.0 and hpcdist's dependencies; a few minutes)"
  rm -rf "$USERS_VENV"
  mkdir -p "$(dirname "$USERS_VENV")"
  /usr/bin/python3 -m venv "$USERS_VENV"
  "$USERS_VENV/bin/python" -m pip install -q torch==2.13.0
  "$USERS_VENV/bin/python" -m pip install -q "$REPO" pytest
  echo "$want" >"$stamp"
fi
chmod -R a+rX "$(dirname "$USERS_VENV")"

# Everything the accounts read of this checkout: the folders down to it must be searchable.
dir=$REPO
while [[ $dir != / ]]; do
  perms=$(stat -c %A "$dir")
  [[ ${perms:9:1} == [xt] ]] || { log "the accounts cannot reach $REPO: $dir is $perms (chmod o+x $dir)"; exit 1; }
  dir=$(dirname "$dir")
done
log "accounts ${MEMBERS[*]} ($GROUP) and $OUTSIDER; group root $GROUP_ROOT (3770); venv $USERS_VENV"
