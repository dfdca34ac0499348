#!/usr/bin/env bash
# A local stand-in for python:3.11-slim-bookworm, where public image registries cannot be reached:
# Debian bookworm (minbase, from apt's own mirror), Python 3.11 in a virtual environment at
# /usr/local (so that python and pip are on PATH at /usr/local/bin, as in the official image; bookworm's
# system Python refuses `pip install`), and useradd. Imported into podman as $TAG.
#   deploy/image/python-base.sh [TAG]       (root; about 3 minutes and 250 MB)
set -euo pipefail
TAG=${1:-localhost/specdec-python:3.11-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$(cd "$(dirname "$0")" && pwd)/containers.conf}
for tool in debootstrap podman; do
  command -v "$tool" >/dev/null || { echo "python-base: needs $tool (apt-get install debootstrap podman)" >&2; exit 1; }
done
root=$(mktemp -d /tmp/specdec-python-base.XXXXXX)
cleanup() { umount "$root/proc" 2>/dev/null || true; rm -rf "$root"; }
trap cleanup EXIT

debootstrap --variant=minbase bookworm "$root" "$MIRROR" >/dev/null
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount -t proc proc "$root/proc"
chroot "$root" /bin/sh -euc '
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends python3.11 python3.11-venv passwd ca-certificates >/dev/null
  python3.11 -m venv /usr/local
  /usr/local/bin/python -m pip --version
  apt-get clean
  rm -rf /var/lib/apt/lists/* /var/cache/apt/* /usr/share/doc/* /usr/share/man/* /usr/share/locale/*
'
umount "$root/proc"
: > "$root/etc/resolv.conf"

# Smoke check before import: the layout the Dockerfile relies on.
for path in /usr/local/bin/python /usr/local/bin/pip /usr/sbin/useradd; do
  [ -x "$root$path" ] || { echo "python-base: $path is missing" >&2; exit 1; }
done
tar --numeric-owner -C "$root" -c . | podman import \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$TAG" >/dev/null
podman run --rm "$TAG" python -c 'import sys, ssl; assert sys.version_info[:2] == (3, 11); print(sys.version.split()[0])'
echo "$TAG"
