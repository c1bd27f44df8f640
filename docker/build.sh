#!/usr/bin/env bash
# Builds the image from docker/Dockerfile and runs a command in it: by default the image's own
# command, the test suite.
#
#   bash docker/build.sh                          build, then run the test suite in the image
#   bash docker/build.sh bash scripts/demo.sh     build, then run the 2-worker demo in it
#   bash docker/build.sh --build-only             build only
#
# Works where `docker build` alone does not: it uses docker if a daemon answers, else podman
# (installed from Debian when missing, as root) with docker/containers.conf; makes the base image
# locally with debootstrap when python:3.11-slim-bookworm cannot be pulled; carries the host's apt
# sources, extra CA certificates and pip settings into the build (docker/local/), so that it builds
# behind the same proxy as the host; and hands the build the Horovod and mpi4py wheels
# scripts/setup.sh cached on the host, so that the image compiles neither (run scripts/setup.sh on
# the host first; without them the image builds them itself, about 15 minutes on 2 cores).
#
# Environment:
#   HOROVOD_TWOBIT_IMAGE   the image's name (default: horovod-twobit)
#   HOROVOD_TWOBIT_CACHE   the host's wheel cache, as for scripts/setup.sh
#   HOROVOD_TWOBIT_ENGINE  docker or podman, instead of choosing
#   HOROVOD_TWOBIT_PULL    0: do not try to pull the public base image, make it locally
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${HOROVOD_TWOBIT_IMAGE:-horovod-twobit}"
CACHE="${HOROVOD_TWOBIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod-twobit}"
PUBLIC_BASE=python:3.11-slim-bookworm
LOCAL_BASE=localhost/python:3.11-slim-bookworm   # the stand-in, made with debootstrap
CARRY="$REPO/docker/local"
WORK="$REPO/build/docker"
LOG="$WORK/build.log"

mkdir -p "$WORK" "$CARRY"
: >"$LOG"
T0=$(date +%s)
stage() { printf '[docker %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; echo "=== $* ===" >>"$LOG"; }
fail() {
  echo "[docker] FAILED: $1" >&2
  echo "[docker] last lines of $LOG:" >&2
  tail -n 40 "$LOG" >&2 || true
  echo "[docker] what to do: $2" >&2
  exit 1
}
run() { "$@" >>"$LOG" 2>&1; }

BUILD_ONLY=0
if [ "${1:-}" = "--build-only" ]; then BUILD_ONLY=1; shift; fi

apt_install() {
  [ "$(id -u)" = 0 ] || fail "missing: $*" "run as root, or: sudo apt-get install -y $*"
  stage "installing Debian packages: $*"
  export DEBIAN_FRONTEND=noninteractive
  run apt-get update || fail "apt-get update" "check the machine reaches Debian's mirrors"
  run apt-get install -y --no-install-recommends "$@" || fail "apt-get install $*" "install them by hand and rerun"
}

# ---------------------------------------------------------------- engine
ENGINE="${HOROVOD_TWOBIT_ENGINE:-}"
if [ -z "$ENGINE" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=podman; fi
fi
case "$ENGINE" in
  docker)
    stage "engine: docker ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
    docker info >/dev/null 2>&1 || fail "no Docker daemon answers" "start it, or unset HOROVOD_TWOBIT_ENGINE to use podman"
    ;;
  podman)
    missing=()
    command -v podman >/dev/null || missing+=(podman)
    command -v runc >/dev/null || missing+=(runc)
    ((${#missing[@]} == 0)) || apt_install "${missing[@]}"
    # runc, cgroupfs, ulimits the host allows, a file event log: see docker/containers.conf.
    export CONTAINERS_CONF="${CONTAINERS_CONF:-$REPO/docker/containers.conf}"
    run podman info || fail "podman info (with CONTAINERS_CONF=$CONTAINERS_CONF)" "read $LOG"
    stage "engine: podman $(podman version --format '{{.Client.Version}}' 2>/dev/null) (CONTAINERS_CONF=$CONTAINERS_CONF)"
    ;;
  *) fail "unknown engine '$ENGINE'" "set HOROVOD_TWOBIT_ENGINE to docker or podman" ;;
esac
E=("$ENGINE")
has_image() { "${E[@]}" image inspect "$1" >/dev/null 2>&1; }

# ---------------------------------------------------------------- what the host carries over
# Written only where the content changed, keeping times, so that the build cache stays valid.
stage "carrying the host's apt sources, CA certificates, pip settings and wheels into docker/local/"
NEW="$WORK/carry.new"
rm -rf "$NEW" && mkdir -p "$NEW/apt/sources" "$NEW/apt/conf" "$NEW/ca-certificates" "$NEW/wheels"
cp "$CARRY/README.md" "$NEW/" 2>/dev/null || true
# apt: Debian's sources (others need keyrings the image lacks); proxy, certificate and date settings
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -s "$f" ] && grep -qE '^[^#]*debian\.(org|net)|^[^#]*/debian(-security)?\b' "$f" && cp -p "$f" "$NEW/apt/sources/"
done
for f in /etc/apt/apt.conf /etc/apt/apt.conf.d/*; do
  [ -f "$f" ] && grep -qiE '^[^/#]*Acquire.*(Proxy|Check-Valid-Until|Check-Date|Verify-Peer|CaInfo)' "$f" \
    && cp -p "$f" "$NEW/apt/conf/$(basename "$f")"
done
# extra CA certificates (a proxy that inspects TLS)
find /usr/local/share/ca-certificates -name '*.crt' -type f -exec cp -p {} "$NEW/ca-certificates/" \; 2>/dev/null || true
# pip: its settings as the host's pip sees them (files and PIP_* variables); local find-links
# folders become wheels/ (mounted during the build only), local indexes are left out
HOST_PY=$(command -v python3 || true)
[ -n "$HOST_PY" ] || fail "no python3 on the host" "install python3 (scripts/setup.sh needs it too)"
cert=(); [ -n "$(ls -A "$NEW/ca-certificates")" ] && cert=(--cert)
run "$HOST_PY" "$REPO/docker/pip_settings.py" "$NEW" "${cert[@]}" || fail "reading pip's settings" "read $LOG"
# the wheels scripts/setup.sh cached on the host (Horovod's, mpi4py's)
for w in "$CACHE"/wheels/*/*.whl; do
  [ -f "$w" ] || continue
  d="$NEW/cache/wheels/$(basename "$(dirname "$w")")"
  mkdir -p "$d" && { ln "$w" "$d/" 2>/dev/null || cp -p "$w" "$d/"; }
done
if ls "$NEW"/cache/wheels/horovod-*/horovod-*.whl >/dev/null 2>&1; then
  HVD_NOTE="the host's cached wheels: $(ls "$NEW/cache/wheels" | tr '\n' ' ')"
else
  HVD_NOTE="no cached Horovod wheel under $CACHE/wheels: the image builds Horovod (about 12 minutes; run scripts/setup.sh first to avoid it)"
fi
# replace docker/local/ by the new tree where it differs
if ! diff -r -q "$NEW" "$CARRY" >/dev/null 2>&1; then
  find "$CARRY" -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
  mv -f "$NEW"/* "$CARRY"/
fi
rm -rf "$NEW"
# a digest of docker/local/ (names and sizes; contents of the small files) for the build cache
HOST_FILES=$(cd "$CARRY" && { find . -type f -printf '%p %s\n'; find . -type f -size -1M -exec sha256sum {} +; } \
             | sort | sha256sum | cut -c1-16)
stage "$HVD_NOTE"
TORCH_VERSION=$(sed -n 's/^TORCH_VERSION=//p' "$REPO/scripts/setup.sh")
BUILD_ARGS=(--build-arg "HOST_FILES=$HOST_FILES")
if ls "$CARRY"/wheels/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
  # pip's find-links serve torch's CPU wheel: no need for (nor maybe access to) its own index
  BUILD_ARGS+=(--build-arg TORCH_INDEX=)
  stage "torch $TORCH_VERSION (CPU) from the host's pip find-links"
fi

# ---------------------------------------------------------------- base image
if has_image "docker.io/library/$PUBLIC_BASE"; then
  BASE="docker.io/library/$PUBLIC_BASE"
  stage "base image: $BASE (present)"
elif ! has_image "$LOCAL_BASE" && [ "${HOROVOD_TWOBIT_PULL:-1}" != 0 ] && stage "pulling $PUBLIC_BASE" \
     && run timeout 300 "${E[@]}" pull "docker.io/library/$PUBLIC_BASE"; then
  BASE="docker.io/library/$PUBLIC_BASE"
else
  if has_image localhost/bookworm-base; then
    stage "Debian 12 base: localhost/bookworm-base (made earlier)"
  else
    stage "no $PUBLIC_BASE to pull: making a Debian 12 stand-in with debootstrap"
    command -v debootstrap >/dev/null || apt_install debootstrap
    MIRROR=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\/debian\/\{0,1\}\)[[:space:]]*$/\1/p' \
               /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
    [ -n "$MIRROR" ] || MIRROR=$(sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\{0,1\}\([^[:space:]]*\/debian\/\{0,1\}\)[[:space:]]\+.*/\2/p' \
               /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -1)
    MIRROR="${MIRROR:-http://deb.debian.org/debian}"
    ROOTFS="$WORK/rootfs"
    rm -rf "$ROOTFS"
    stage "debootstrap --variant=minbase bookworm from $MIRROR (about a minute)"
    run debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" \
      || fail "debootstrap" "read $LOG; the mirror comes from /etc/apt/sources.list.d/*.sources"
    stage "importing it as localhost/bookworm-base"
    tar -C "$ROOTFS" -c . | run "${E[@]}" import --change 'CMD ["/bin/bash"]' - localhost/bookworm-base \
      || fail "importing the root file system" "read $LOG"
    rm -rf "$ROOTFS"
  fi
  # rebuilt every time: the layer cache makes it take seconds unless its Dockerfile changed
  stage "building $LOCAL_BASE: Debian's Python 3.11 (docker/bookworm-python.Dockerfile)"
  run "${E[@]}" build --network host "${BUILD_ARGS[@]}" --build-arg BASE=localhost/bookworm-base \
      -f "$REPO/docker/bookworm-python.Dockerfile" -t "$LOCAL_BASE" "$REPO" \
    || fail "building the Python base image" "read $LOG"
  BASE="$LOCAL_BASE"
fi

# ---------------------------------------------------------------- the image
stage "building $IMAGE from docker/Dockerfile (BASE=$BASE; log: $LOG)"
run "${E[@]}" build --network host "${BUILD_ARGS[@]}" --build-arg "BASE=$BASE" \
    -f "$REPO/docker/Dockerfile" -t "$IMAGE" "$REPO" \
  || fail "building the image" "read $LOG (scripts/setup.sh's own output is in it)"
stage "built $IMAGE ($("${E[@]}" image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.1f GB", $1/1e9}'))"
((BUILD_ONLY)) && exit 0

# ---------------------------------------------------------------- run
stage "running in $IMAGE: ${*:-its default command (bash scripts/test.sh)}"
set +e
"${E[@]}" run --rm --network host --shm-size=1g "$IMAGE" "$@"
rc=$?
set -e
stage "finished in $IMAGE with exit code $rc"
exit $rc
