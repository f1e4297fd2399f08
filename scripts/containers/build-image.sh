#!/usr/bin/env bash
# Build the project image with podman from the Dockerfile, on the locally built base
# (scripts/containers/build-base.sh) when the official one cannot be pulled:
#
#   bash scripts/containers/build-image.sh [IMAGE]        # default specdec:latest
#
# Base image: PYTHON_IMAGE if set; else python:3.11-slim-bookworm if it is already in podman's
# store; else the local base (built when missing). torch: the PyTorch CPU index when it answers;
# otherwise a CPU torch wheel already on this machine (SPECDEC_TORCH_WHEELS, or the find-links
# folders of pip's configuration) is bind-mounted into the build and the rest comes from PyPI.
set -euo pipefail
IMAGE=${1:-${SPECDEC_IMAGE:-specdec:latest}}
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/scripts/containers"
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}
torch=$(sed -n 's/^ARG TORCH_VERSION=//p' "$root/Dockerfile")

args=()
if [ -z "${PYTHON_IMAGE:-}" ]; then
  if podman image exists docker.io/library/python:3.11-slim-bookworm; then
    PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm
  else
    PYTHON_IMAGE=localhost/specdec-base:bookworm
    bash "$here/build-base.sh" "$PYTHON_IMAGE"
  fi
fi
args+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
# Named although it is the Dockerfile's default: podman before 4.4 (Debian bookworm has 4.3) resolves
# the stage `FROM llamacpp-${TORCH_VARIANT}` names only from a --build-arg, not from the default.
args+=(--build-arg TORCH_VARIANT=cpu)

if curl -fsS --max-time 15 -o /dev/null "https://download.pytorch.org/whl/cpu/torch/" 2>/dev/null; then
  echo "torch $torch from the PyTorch CPU index"
else
  wheel=""
  dirs="${SPECDEC_TORCH_WHEELS:-} ${PIP_FIND_LINKS:-} $(pip3 config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | tr '\n' ' ')"
  for dir in $dirs; do
    dir=${dir#file://}
    found=$(ls "$dir"/torch-"$torch"+cpu-cp311-cp311-*x86_64.whl 2>/dev/null | head -n1 || true)
    if [ -n "$found" ]; then wheel=$found; break; fi
  done
  if [ -z "$wheel" ]; then
    echo "download.pytorch.org cannot be reached and no torch-$torch+cpu wheel was found" \
         "(set SPECDEC_TORCH_WHEELS to a folder holding it)" >&2
    exit 1
  fi
  echo "torch $torch from $wheel (the PyTorch index cannot be reached), its dependencies from PyPI"
  args+=(--volume "$(dirname "$wheel"):/torch-wheels:ro" --build-arg TORCH_FIND_LINKS=/torch-wheels
         --build-arg TORCH_INDEX_URL=https://pypi.org/simple)
fi

start=$(date +%s)
nice -n 10 podman build --layers "${args[@]}" -t "$IMAGE" -f "$root/Dockerfile" "$root"
echo "built $IMAGE in $(( $(date +%s) - start )) s: $(podman image inspect --format '{{.Size}}' "$IMAGE") bytes"
