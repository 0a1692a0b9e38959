#!/usr/bin/env bash
# Build the Charliecloud image the container tests run ranks in, at DIR:
#   bash cluster/image.sh DIR [MOUNTPOINT...]
# Debian bookworm (debootstrap --variant=minbase from the mirror apt uses) with Debian's python3,
# Open MPI + PMIx and python3-mpi4py (the host's packages, so MPI works across the container
# boundary), torch and hpcdist's dependencies from the wheels pip finds here, and hpcdist itself
# from this checkout (`pip wheel --no-deps`). No registry of images is asked.
#
# Three layers, each kept while its inputs are unchanged (recorded in DIR/.hpcdist-image):
#   base  debootstrap + Debian packages: this script, the suite, the mirror, the package list
#   deps  /usr/local (torch + pyproject.toml's dependencies): the base, the torch pin, that list
#   top   hpcdist's wheel and the mount points: a hash of the checkout's hpcdist files
# A run rebuilds only the first changed layer and those above it, into a sibling DIR.tmp.PID (the
# unchanged ones hard-linked from DIR), checks it, then renames it to DIR: never a half-built DIR.
# Unchanged inputs: nothing is written (about a second).
#
# Charliecloud 0.31 binds only onto targets that exist in the image: /etc/passwd, /etc/group,
# /etc/hosts, /etc/resolv.conf (ch-run's own) and the mount points (the suite's storage roots and
# Slurm's TmpFS, whose PMIx sockets srun --mpi=pmix ranks need, plus any MOUNTPOINT given).
#
# Environment: HPCDIST_IMAGE_SUITE (bookworm), HPCDIST_IMAGE_MIRROR (apt's), PYTHON (a Python 3.11
# with pip: .venv/bin/python, else python3), HPCDIST_IMAGE_TORCH (torch==2.13.0, as the Makefile).
set -euo pipefail
umask 022
export LC_ALL=C
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
SCRIPT="$HERE/$(basename "${BASH_SOURCE[0]}")"

log() { echo "[image] $*" >&2; }
die() { log "$*"; exit 1; }

(($# >= 1)) || die "usage: bash cluster/image.sh DIR [MOUNTPOINT...]"
[[ $1 == /* ]] || die "DIR must be an absolute path, not '$1'"
DIR=${1%/}
shift
MOUNTS=(/var/tmp/hpcdist-shared /var/tmp/hpcdist-group /var/tmp/hpcdist-slurm/tmpfs "$@")
for m in "${MOUNTS[@]}"; do
  [[ $m == /* && $m != *..* && $m != *$'\n'* ]] || die "a MOUNTPOINT must be an absolute path without '..', not '$m'"
done

((EUID == 0)) || die "needs root (debootstrap and chroot): run it as root"
for tool in debootstrap ch-run; do
  command -v "$tool" >/dev/null || die "$tool is missing: run cluster/install-deps.sh (make system-deps)"
done

SUITE=${HPCDIST_IMAGE_SUITE:-bookworm}
TORCH=${HPCDIST_IMAGE_TORCH:-torch==2.13.0}
# Debian's python3 and the MPI stack the host's Slurm and mpirun speak to. mpi4py from Debian:
# built against this very libopenmpi3, no compiler or headers in the image (pip would build it).
PACKAGES=python3,openmpi-bin,libopenmpi3,libpmix2,python3-mpi4py
# packages whose version must equal the host's (PMIx server in slurmstepd, orted from mpirun)
MATCH=(libopenmpi3 libpmix2 openmpi-bin)
SITE=usr/local/lib/python3.11/dist-packages # Debian's python3 reads it; pip's layer lives there

# The mirror apt uses for SUITE (deb822 .sources or one-line .list), else Debian's.
apt_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -r $f ]] || continue
    awk -v s="$SUITE" 'BEGIN{RS=""} { uri=""; ok=0
        for (i = 1; i <= NF; i++) { if ($i == "URIs:") uri = $(i+1); if ($i == s) ok = 1 }
        if (ok && uri != "") { print uri; exit } }' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r $f ]] || continue
    awk -v s="$SUITE" '$1 == "deb" && $3 == s { print $2; exit }' "$f"
  done
}
MIRROR=${HPCDIST_IMAGE_MIRROR:-$(apt_mirror | head -n 1)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

PY=${PYTHON:-}
[[ -n $PY ]] || { [[ -x $REPO/.venv/bin/python ]] && PY=$REPO/.venv/bin/python || PY=python3; }
"$PY" -c 'import sys, pip; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
  || die "PYTHON=$PY is not a Python 3.11 with pip (the image's python3 is 3.11: its wheels must match)"
mapfile -t DEPS < <("$PY" -c 'import tomllib, sys
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$REPO/pyproject.toml")

sha() { sha256sum | cut -c1-16; }
BASE_KEY=$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" | cat - "$SCRIPT" | sha)
DEPS_KEY=$(printf '%s\n' "$BASE_KEY" "$TORCH" "${DEPS[@]}" | sha)
CODE_KEY=$(cd "$REPO" && find hpcdist templates site_configs pyproject.toml -type f \
  ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum | sha)
TOP_KEY=$(printf '%s\n' "$DEPS_KEY" "$CODE_KEY" "${MOUNTS[@]}" | sha)

STAMP=.hpcdist-image
stamp_get() { sed -n "s/^$1=//p" "$DIR/$STAMP" 2>/dev/null || true; }

mkdir -p "$(dirname "$DIR")" # 0755 (umask 022): ordinary users reach the image through it
# one build at a time per DIR (two suite runs starting together)
exec 9>"$DIR.lock"
flock 9
START=$SECONDS

if [[ -d $DIR && $(stamp_get top) == "$TOP_KEY" ]]; then
  log "$DIR is up to date (hpcdist $CODE_KEY, torch and dependencies $DEPS_KEY, base $BASE_KEY): nothing to do ($((SECONDS - START)) s)"
  exit 0
fi

TMP=$DIR.tmp.$$
rm -rf "$DIR".tmp.* "$DIR.old"  # left by a run that was killed (we hold the lock)
trap 'rm -rf "$TMP"' EXIT

# pip's output less its warning for each index folder of this machine's config that lacks a package
quiet_pip() { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" >&2 || true; }

# pip_layer ROOT PIP-ARGS...: pip install into a fresh staging folder inside ROOT, then move what
# it made into ROOT/$SITE and its scripts into ROOT/usr/local/bin (run by the image's python3).
pip_layer() {
  local root=$1 stage=$1/.pip-stage item
  shift
  rm -rf "$stage"
  "$PY" -m pip install -q --disable-pip-version-check --no-warn-script-location --target "$stage" "$@" \
    2>&1 | quiet_pip || die "pip install into the image failed (pip's words above)"
  mkdir -p "$root/$SITE" "$root/usr/local/bin"
  if [[ -d $stage/bin ]]; then
    for item in "$stage"/bin/*; do
      sed -i '1s|^#!.*python.*$|#!/usr/bin/python3|' "$item"
      mv -f "$item" "$root/usr/local/bin/"
    done
    rmdir "$stage/bin"
  fi
  for item in "$stage"/* "$stage"/.[!.]*; do
    [[ -e $item ]] || continue
    rm -rf "${root:?}/$SITE/${item##*/}"
    mv "$item" "$root/$SITE/"
  done
  rmdir "$stage"
}

t=$SECONDS
if [[ -d $DIR && $(stamp_get base) == "$BASE_KEY" ]]; then
  cp -al "$DIR" "$TMP"  # hard links: no data written; every change below makes new files
  rm -f "$TMP/$STAMP"
  if [[ $(stamp_get deps) == "$DEPS_KEY" ]]; then
    rebuild=top
  else
    rebuild=deps
    rm -rf "${TMP:?}/usr/local/lib/python3.11" "${TMP:?}/usr/local/bin"
  fi
  log "reusing the base of $DIR ($BASE_KEY); rebuilding from the $rebuild layer"
else
  rebuild=base
  DEBS=$(dirname "$DIR")/.debs  # debootstrap's package cache: a changed script downloads nothing
  mkdir -p "$DEBS"
  log "base: debootstrap --variant=minbase $SUITE from $MIRROR with $PACKAGES"
  debootstrap --variant=minbase --include="$PACKAGES" --cache-dir="$DEBS" "$SUITE" "$TMP" "$MIRROR" \
    >"$TMP.debootstrap.log" 2>&1 || { tail -n 20 "$TMP.debootstrap.log" >&2; rm -f "$TMP.debootstrap.log"
                                     die "debootstrap failed (its log's tail above)"; }
  rm -f "$TMP.debootstrap.log"
  rm -rf "$TMP"/var/cache/apt/archives/*.deb "$TMP"/var/lib/apt/lists/* "$TMP"/var/log/* "$TMP/debootstrap"
  # the files ch-run binds its own over, made empty (Charliecloud 0.31 binds onto what exists)
  for f in /etc/passwd /etc/group /etc/hosts /etc/resolv.conf; do touch "$TMP$f"; done
  # every ordinary user runs the image (user namespace: the root-owned files count as other's)
  chmod -R a+rX "$TMP"
  log "base: done in $((SECONDS - t)) s"
fi

# versions the host's MPI must share with the image's
for pkg in "${MATCH[@]}"; do
  host=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null || true)
  image=$(dpkg-query --admindir="$TMP/var/lib/dpkg" -W -f='${Version}' "$pkg" 2>/dev/null || true)
  [[ -z $host || $host == "$image" ]] \
    || die "$pkg is $image in the image but $host on this host: MPI across the container boundary needs the same (upgrade the host's, or set HPCDIST_IMAGE_MIRROR)"
done

if [[ $rebuild != top ]]; then
  t=$SECONDS
  log "deps: $TORCH ${DEPS[*]} (with $PY)"
  pip_layer "$TMP" "$TORCH" "${DEPS[@]}"
  log "deps: done in $((SECONDS - t)) s"
fi

t=$SECONDS
WHEELS=$TMP/.wheel
rm -rf "$WHEELS" "$TMP/$SITE"/hpcdist "$TMP/$SITE"/hpcdist-*.dist-info "$TMP/usr/local/bin/hpcdist"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WHEELS" "$REPO" 2>&1 | quiet_pip \
  || die "pip wheel of $REPO failed (pip's words above)"
pip_layer "$TMP" --no-deps "$WHEELS"/hpcdist-*.whl
rm -rf "$WHEELS"
for m in "${MOUNTS[@]}"; do
  mkdir -p "$TMP$m"
  chmod a+rx "$TMP$m"
done
log "top: hpcdist wheel ($CODE_KEY) and mount points ${MOUNTS[*]} in $((SECONDS - t)) s"

# the image runs what a rank runs, before it replaces DIR
t=$SECONDS
versions=$(USER=${USER:-root} ch-run "$TMP" -- python3 -c \
  'import torch, numpy, h5py, mpi4py, hpcdist; print("torch", torch.__version__, "mpi4py", mpi4py.__version__, "hpcdist", hpcdist.__version__)') \
  || die "the new image at $TMP does not import torch, numpy, h5py, mpi4py and hpcdist (see above)"
unreadable=$(find "$TMP" -xdev ! -perm -o+r ! -type l -print -quit)
[[ -z $unreadable ]] || die "$unreadable in the new image is not readable by ordinary users"
log "check: $versions ($((SECONDS - t)) s)"

{
  echo "base=$BASE_KEY"
  echo "deps=$DEPS_KEY"
  echo "hpcdist=$CODE_KEY"
  echo "top=$TOP_KEY"
  echo "suite=$SUITE"
  echo "mirror=$MIRROR"
  echo "mounts=${MOUNTS[*]}"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$TMP/$STAMP"
chmod a+r "$TMP/$STAMP"

if [[ -d $DIR ]]; then
  mv "$DIR" "$DIR.old"
  mv "$TMP" "$DIR"
  rm -rf "$DIR.old"
else
  mv "$TMP" "$DIR"
fi
trap - EXIT
log "$DIR built (rebuilt from the $rebuild layer) in $((SECONDS - START)) s: $(du -sh "$DIR" | cut -f1)"
