#!/bin/sh
# Open MPI's remote-shell agent for the local cluster's nodes, in place of ssh (no sshd runs in
# them): `node_rsh.sh NODE CMD...` runs CMD, joined into one shell line as ssh does, in NODE's
# network namespace under NODE's hostname. For tests only (mpirun --mca plm_rsh_agent ...).
node=$1; shift
exec nsenter --net="/run/netns/hp$node" unshare --uts sh -c "hostname $node; $*"
