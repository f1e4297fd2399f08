#!/usr/bin/env bash
# `make test-containers`: the Dockerfile and compose files, for real, with podman.
#
#  1. installs what a Debian machine lacks: podman with runc, netavark and aardvark-dns (networks
#     with DNS names), catatonit (compose's `init: true`), iptables (published ports), mmdebstrap;
#  2. builds the image (scripts/containers/build-image.sh: the official base when podman has it,
#     else a Debian bookworm base built here; torch from the PyTorch index or a local wheel);
#  3. serves podman's Docker-compatible API on a socket of its own and runs tests/containers
#     (marker `containers`) with the Docker Compose binary of the dev dependencies against it;
#  4. stops that API service. Timings and figures land in artifacts/containers/.
#
# podman reads scripts/containers/containers.conf (CONTAINERS_CONF): runc, cgroupfs, rlimits a
# host without CAP_SYS_RESOURCE can grant. Nothing under /etc/containers is changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
here="$root/scripts/containers"
PY=${PY:-$root/.venv/bin/python}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}
export SPECDEC_IMAGE=${SPECDEC_IMAGE:-specdec:latest}
artifacts="${SPECDEC_ARTIFACTS_DIR:-$root/artifacts}/containers"
mkdir -p "$artifacts"
t0=$(date +%s)
# The conf's rlimits, lowered to this host's hard limits where those are lower (setrlimit fails above them).
read -r nofile nproc < <(sed -n 's/^default_ulimits = \["nofile=\([0-9]*\):[0-9]*", "nproc=\([0-9]*\):[0-9]*"\]/\1 \2/p' "$CONTAINERS_CONF")
lower=0
hard=$(ulimit -Hn); if [ -n "${nofile:-}" ] && [ "$hard" != unlimited ] && [ "$hard" -lt "$nofile" ]; then nofile=$hard; lower=1; fi
hard=$(ulimit -Hu); if [ -n "${nproc:-}" ] && [ "$hard" != unlimited ] && [ "$hard" -lt "$nproc" ]; then nproc=$hard; lower=1; fi
if [ "$lower" = 1 ]; then
  mkdir -p /run/specdec-containers
  sed "s/^default_ulimits = .*/default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]/" \
    "$CONTAINERS_CONF" > /run/specdec-containers/containers.conf
  export CONTAINERS_CONF=/run/specdec-containers/containers.conf
  echo "rlimits lowered to this host's hard limits: nofile=$nofile nproc=$nproc"
fi

if [ "$(id -u)" != 0 ]; then
  echo "make test-containers runs podman as root (a rootful engine: memory limits and published ports)" >&2
  exit 1
fi
packages=(podman runc netavark aardvark-dns catatonit iptables mmdebstrap curl ca-certificates)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || { echo "missing: ${missing[*]} (and no apt-get to install them)" >&2; exit 1; }
  echo "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "$(podman --version), $(runc --version | head -n1), $("$root/.venv/bin/docker-compose" version)"

t_build=$(date +%s)
bash "$here/build-image.sh" "$SPECDEC_IMAGE" 2>&1 | tee "$artifacts/build.log"
build_s=$(( $(date +%s) - t_build ))

# podman's Docker API, on a socket of its own (a system service elsewhere keeps its own).
run_dir=/run/specdec-containers
mkdir -p "$run_dir"
sock="$run_dir/podman.sock"
rm -f "$sock"
podman system service --time=0 "unix://$sock" >"$artifacts/podman-service.log" 2>&1 &
service_pid=$!
trap 'kill "$service_pid" 2>/dev/null; wait "$service_pid" 2>/dev/null || true; rm -f "$sock"' EXIT
for _ in $(seq 1 50); do
  curl -fsS --unix-socket "$sock" http://d/_ping >/dev/null 2>&1 && break
  sleep 0.2
done
curl -fsS --unix-socket "$sock" http://d/_ping >/dev/null
export DOCKER_HOST="unix://$sock"

t_test=$(date +%s)
status=0
"$PY" -m pytest -ra -p no:cacheprovider -m containers tests/containers "$@" || status=$?
test_s=$(( $(date +%s) - t_test ))
total_s=$(( $(date +%s) - t0 ))
printf '{"build_s": %d, "tests_s": %d, "total_s": %d, "image_bytes": %s}\n' "$build_s" "$test_s" "$total_s" \
  "$(podman image inspect --format '{{.Size}}' "$SPECDEC_IMAGE")" > "$artifacts/timings.json"
echo "make test-containers: build ${build_s} s, tests ${test_s} s, total ${total_s} s (exit $status)"
exit $status
