#!/usr/bin/env bash
# The test bed's login node over ssh (docs/laptop.md): an OpenSSH sshd of its own that a "laptop"
# submits through (hpcdist --on HOST). Idempotent; run by `make cluster-up` after up.sh.
#
#   cluster/sshd.sh up     # start it (under a second when it runs); keys made once
#   cluster/sshd.sh down   # stop it; keys and config are kept
#   cluster/sshd.sh show   # port, host key, pid
#
# Who may use it: it listens on 127.0.0.1 only (traffic stays on this machine), port $PORT; it
# takes keys only (no password, no keyboard-interactive, no root), only from the members alice and
# bob, and only the keys in its own root-owned authorized_keys folder ($ETC) (one file per user); no
# forwarding of ports, agents or X11. The members' key pairs are made here, each in the member's
# own 0700 folder, 0600. Its sessions get the checkout on PYTHONPATH (SetEnv), as a site's module
# puts hpcdist on a login node's path; Debian's own ssh service stays off (install-deps.sh).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")

ROOT=${HPCDIST_SSHD_STATE:-/var/tmp/hpcdist-ssh}
PORT=${HPCDIST_SSHD_PORT:-6822}
USERS=(alice bob)
ETC=${HPCDIST_SSHD_ETC:-/etc/hpcdist-ssh}  # config, host key, authorized keys: under /etc, as StrictModes
# wants every folder above an authorized_keys file (/var/tmp is world-writable)
CONF=$ETC/sshd_config
PIDFILE=$ROOT/sshd.pid
LOG=$ROOT/sshd.log

log() { echo "[sshd] $*" >&2; }

running() {
  [[ -s $PIDFILE ]] || return 1
  local pid
  pid=$(cat "$PIDFILE")
  [[ -d /proc/$pid ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "-f $CONF"
}

config() {
  cat <<EOF
# written by cluster/sshd.sh: the test bed's login node, loopback only, keys only
Port $PORT
ListenAddress 127.0.0.1
HostKey $ETC/ssh_host_ed25519_key
PidFile $PIDFILE
AuthorizedKeysFile $ETC/authorized_keys/%u
AllowUsers ${USERS[*]}
PermitRootLogin no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM yes
DisableForwarding yes
PermitUserEnvironment no
StrictModes yes
PrintMotd no
MaxSessions 32
MaxStartups 32:30:64
SetEnv PYTHONPATH=$REPO
Subsystem sftp internal-sftp
EOF
}

up() {
  ((EUID == 0)) || { log "sshd.sh must run as root"; exit 1; }
  [[ -x /usr/sbin/sshd ]] || { log "no /usr/sbin/sshd: make system-deps installs openssh-server"; exit 1; }
  install -d -m 0755 -o root -g root "$ROOT" "$ROOT/users" "$ETC" "$ETC/authorized_keys"
  install -d -m 0755 /run/sshd  # sshd's privilege separation folder
  [[ -s $ETC/ssh_host_ed25519_key ]] || ssh-keygen -q -t ed25519 -N '' -C "hpcdist-test-login" -f "$ETC/ssh_host_ed25519_key"
  install -m 0644 "$ETC/ssh_host_ed25519_key.pub" "$ROOT/host_key.pub"  # what the test writes into known_hosts
  for user in "${USERS[@]}"; do
    id "$user" >/dev/null 2>&1 || { log "no user $user: cluster/users.sh (make cluster-up) makes the members"; exit 1; }
    install -d -m 0700 -o "$user" -g "$user" "$ROOT/users/$user"
    key=$ROOT/users/$user/id_ed25519
    [[ -s $key ]] || runuser -u "$user" -- ssh-keygen -q -t ed25519 -N '' -C "$user@hpcdist-laptop" -f "$key"
    install -m 0644 -o root -g root "$key.pub" "$ETC/authorized_keys/$user"
  done
  local new
  new=$(config)
  if [[ ! -f $CONF ]] || [[ $new != "$(cat "$CONF")" ]]; then
    printf '%s\n' "$new" >"$CONF.tmp" && chmod 0600 "$CONF.tmp" && mv "$CONF.tmp" "$CONF"
    /usr/sbin/sshd -t -f "$CONF" || { log "sshd -t refused $CONF"; exit 1; }
    if running; then kill -HUP "$(cat "$PIDFILE")"; log "config changed: sshd reloaded"; fi
  fi
  if running; then
    log "running on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"))"
    return 0
  fi
  /usr/sbin/sshd -f "$CONF" -E "$LOG"
  for _ in $(seq 50); do
    running && ss -ltn "sport = :$PORT" | grep -q 127.0.0.1 && break
    sleep 0.1
  done
  running || { log "sshd did not start: $(tail -n 3 "$LOG" 2>/dev/null)"; exit 1; }
  log "started on 127.0.0.1:$PORT (pid $(cat "$PIDFILE")); log $LOG"
}

down() {
  if running; then
    kill "$(cat "$PIDFILE")"
    log "stopped"
  fi
  rm -f "$PIDFILE"
}

show() {
  echo "port 127.0.0.1:$PORT"
  echo "host key $(cat "$ROOT/host_key.pub" 2>/dev/null || echo missing)"
  if running; then echo "pid $(cat "$PIDFILE")"; else echo "not running"; fi
}

case ${1:-} in
  up) up ;;
  down) down ;;
  show) show ;;
  *) echo "usage: $0 up|down|show" >&2; exit 2 ;;
esac
