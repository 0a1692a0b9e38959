#!/usr/bin/env bash
# Stop the local Slurm cluster started by up.sh: every slurmd (whatever HPCDIST_NODES it was
# started with), slurmctld, slurmdbd, MariaDB, munged, in that order; then remove the nodes'
# namespaces, veths, bridge and /etc/hosts block.
# Idempotent: fine when nothing runs. State and logs are kept.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"
# shellcheck source=net.sh
source "$HERE/net.sh"

((EUID == 0)) || { log "down.sh must run as root"; exit 1; }

for n in $(known_nodes); do stop_pidfile "$STATE/run/slurmd-$n.pid" slurmd; done
stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
stop_pidfile "$STATE/run/slurmdbd.pid" slurmdbd

# A clean shutdown also ends mysqld_safe (killing mysqld would make mysqld_safe restart it).
if mariadb_ok; then
  log "stopping mariadb"
  server=$(cat /run/mysqld/mysqld.pid 2>/dev/null || true)
  mysqladmin --protocol=socket shutdown
  wait_for 30 proc_gone "$server" mariadbd || log "mariadbd (pid $server) still shutting down"
fi
# mysqld_safe exits on its own once the server has; stop it should it linger.
wait_for 5 pid_gone "$STATE/run/mysqld_safe.pid" mysqld_safe || true
stop_pidfile "$STATE/run/mysqld_safe.pid" mysqld_safe

stop_pidfile "$MUNGE_PIDFILE" munged

net_down
hosts_set
rm -f "$MODE_FILE"
log "down"
