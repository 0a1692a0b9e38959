#!/usr/bin/env bash
# Install the Debian packages the local Slurm cluster and its container image need. Idempotent:
# returns at once when everything is already installed, and runs `apt-get update` only when
# something is not.
set -euo pipefail

# charliecloud-runtime (ch-run) and debootstrap: the container image (cluster/image.sh); podman with
# uidmap (newuidmap), slirp4netns and runc: rootless podman for the members (cluster/users.sh);
# openssh-server and rsync: the login node a laptop submits to over ssh (cluster/sshd.sh)
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server openmpi-bin libopenmpi-dev hdf5-tools iproute2 python3-venv
  charliecloud-runtime debootstrap podman uidmap slirp4netns runc iptables openssh-server rsync)

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ $status == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  echo "[cluster] packages already installed: ${PACKAGES[*]}"
  exit 0
fi

if ((EUID != 0)); then
  echo "[cluster] need root to install: ${missing[*]}" >&2
  exit 1
fi

echo "[cluster] installing: ${missing[*]}"
# Debian's own switch that keeps its ssh service (port 22, every address) from starting, at install
# or boot: the test bed's sshd is cluster/sshd.sh's, on loopback, keys only.
[[ -e /etc/ssh/sshd_not_to_be_run ]] || { mkdir -p /etc/ssh && touch /etc/ssh/sshd_not_to_be_run; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q "${missing[@]}"
