#!/bin/sh
# Slurm TaskProlog in single-host mode only (cluster/up.sh): n1 and n2 are one host there, and
# Open MPI's shared-memory transport crashes between "nodes" that share memory without knowing
# it, so ranks talk over TCP. A task that chose its own transports keeps them.
[ -n "${OMPI_MCA_btl:-}" ] || echo "export OMPI_MCA_btl=self,tcp"
