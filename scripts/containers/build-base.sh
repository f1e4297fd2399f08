#!/usr/bin/env bash
# Build a Debian bookworm + Python 3.11 base image locally, for machines that cannot pull
# python:3.11-slim-bookworm from a registry, and import it into podman:
#
#   bash scripts/containers/build-base.sh [IMAGE]      # default localhost/specdec-base:bookworm
#   podman build --build-arg PYTHON_IMAGE=localhost/specdec-base:bookworm ...
#
# The root filesystem comes from mmdebstrap with this machine's own apt sources (its mirror), and
# holds what the Dockerfile expects of the official image: `python` (Debian's python3, 3.11 on
# bookworm) with venv, CA certificates, netbase. The host's local CA certificates
# (/usr/local/share/ca-certificates) are trusted inside too, and pip is told to use the system
# bundle, so a build behind a TLS-intercepting proxy reaches PyPI. The image is rebuilt only when
# this script or the apt sources change (a label holds their hash).
set -euo pipefail
IMAGE=${1:-localhost/specdec-base:bookworm}
RELEASE=bookworm
here=$(cd "$(dirname "$0")" && pwd)

sources=$(python3 "$here/apt_sources.py" "$RELEASE")
local_cas=$(find /usr/local/share/ca-certificates -name '*.crt' 2>/dev/null | sort || true)
key=$( { cat "$0" "$here/apt_sources.py"; echo "$sources"; for f in $local_cas; do cat "$f"; done; } | sha256sum | cut -c1-16)
if [ "$(podman image inspect --format '{{ index .Labels "specdec.base-key" }}' "$IMAGE" 2>/dev/null)" = "$key" ]; then
  echo "base image $IMAGE is up to date"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "$sources" > "$work/sources.list"
hooks=()
if [ -n "$local_cas" ]; then
  mkdir -p "$work/cas"
  cp $local_cas "$work/cas/"
  hooks+=(--customize-hook="copy-in $(echo "$work"/cas/*.crt | tr '\n' ' ') /usr/local/share/ca-certificates/")
fi
hooks+=(--customize-hook='chroot "$1" update-ca-certificates >/dev/null')
# pip in a virtualenv otherwise trusts only its own bundle.
hooks+=(--customize-hook='printf "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n" > "$1/etc/pip.conf"')
hooks+=(--customize-hook='chroot "$1" python --version')

echo "building $IMAGE with mmdebstrap from:"
sed 's/^/  /' "$work/sources.list"
nice -n 10 mmdebstrap --variant=minbase --mode=root --quiet \
  --include=python3,python3-venv,python-is-python3,ca-certificates,netbase \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --aptopt='APT::Install-Recommends "false"' \
  "${hooks[@]}" \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  "$RELEASE" "$work/rootfs.tar" "$work/sources.list"

podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --change "LABEL specdec.base-key=$key" \
  "$work/rootfs.tar" "$IMAGE" >/dev/null
echo "imported $IMAGE: $(podman run --rm --runtime runc --cgroup-manager cgroupfs --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --network none "$IMAGE" python --version)"
