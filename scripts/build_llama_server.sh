#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench from the llama.cpp vendored in the
# llama-cpp-python sdist that scripts/install_llamacpp.sh builds, with the same GGML flags, so
# evaluation/peer.py compares specdec against exactly the llama.cpp its draft runs on.
#
#   scripts/build_llama_server.sh [PYTHON]     build once (PYTHON runs pip; default .venv/bin/python)
#                                              and print the folder holding the result
#   scripts/build_llama_server.sh --print-flags   only the GGML flags chosen for this CPU
#
# The folder is ${SPECDEC_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/specdec}/llama-server-<key>, keyed by
# the version and every cmake flag: bin/llama-server, bin/llama-bench, llama.cpp's converter
# (convert_hf_to_gguf.py with its conversion/ package and gguf-py/) and build-info.json.
# Progress goes to stderr; stdout carries only the folder, for callers.
set -euo pipefail
VERSION=0.3.36  # the same as scripts/install_llamacpp.sh

ggml_flags() {
  # The same choice as scripts/install_llamacpp.sh (tests/unit/test_peer.py runs both and compares):
  # no native detection and no AMX (its code paths segfault on these machines), AVX-512 only
  # with the full set of extensions llama.cpp's AVX-512 kernels use.
  local flags="-DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  if [ "${SPECDEC_LLAMACPP_AVX512:-auto}" != "off" ] && grep -qw avx512f /proc/cpuinfo && grep -qw avx512_vnni /proc/cpuinfo \
     && grep -qw avx512vbmi /proc/cpuinfo && grep -qw avx512_bf16 /proc/cpuinfo; then
    flags="$flags -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
  else
    flags="$flags -DGGML_AVX512=OFF"
  fi
  printf '%s\n' "$flags"
}

if [ "${1:-}" = "--print-flags" ]; then
  ggml_flags
  exit 0
fi

PY=${1:-.venv/bin/python}
flags=$(ggml_flags)
# Static binaries, so the cached folder can be copied and run anywhere; no OpenSSL, no curl and
# no prebuilt web UI, because their configure steps reach for the network or system packages the
# benchmark does not need.
extra="-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF"
key=$(printf '%s %s %s' "$VERSION" "$flags" "$extra" | sha256sum | cut -c1-16)
root=${SPECDEC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specdec}
dir=$root/llama-server-$key

complete() { [ -x "$1/bin/llama-server" ] && [ -x "$1/bin/llama-bench" ] && [ -f "$1/convert_hf_to_gguf.py" ] && [ -f "$1/build-info.json" ]; }

if complete "$dir"; then
  echo "$dir"
  exit 0
fi

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v c++ >/dev/null || command -v g++ >/dev/null || missing+=("a C++ compiler")
command -v make >/dev/null || command -v ninja >/dev/null || missing+=("make or ninja")
if [ ${#missing[@]} -gt 0 ]; then
  echo "error: building llama-server needs ${missing[*]}: install cmake and build-essential (Debian/Ubuntu: apt-get install cmake build-essential)" >&2
  exit 2
fi
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  echo "error: $PY cannot run pip (run 'make setup' first, or pass a Python that has pip)" >&2
  exit 2
fi

mkdir -p "$root"
# two benchmarks started together build once
if command -v flock >/dev/null; then
  exec 9>"$dir.lock"
  flock 9
  if complete "$dir"; then
    echo "$dir"
    exit 0
  fi
fi

work=$(mktemp -d "$root/llama-server-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log=$dir.build.log

echo "fetching the llama-cpp-python $VERSION sdist (the llama.cpp source it vendors)" >&2
if ! "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$work/sdist" >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "error: could not download llama-cpp-python==$VERSION from PyPI (full log: $log)" >&2
  exit 1
fi
tar xzf "$work/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$work"
pkg=$work/llama_cpp_python-$VERSION
src=$pkg/vendor/llama.cpp
if [ ! -f "$src/CMakeLists.txt" ]; then
  echo "error: the sdist holds no vendor/llama.cpp (looked in $src)" >&2
  exit 1
fi
# The sdist carries no git metadata, so llama.cpp's own build info says "unknown"; the
# changelog names the upstream commit each release vendors.
commit=$(awk -v v="## [$VERSION]" 'index($0, v) == 1 {f = 1; next} /^## \[/ {f = 0} f' "$pkg/CHANGELOG.md" \
         | grep -o 'llama\.cpp@[0-9a-f]\+' | head -n 1 | cut -d@ -f2 || true)

echo "building llama-server and llama-bench (llama.cpp vendored in llama-cpp-python $VERSION${commit:+, upstream $commit})" >&2
echo "  with: $flags" >&2
echo "  this takes several minutes on 2 cores, once; log: $log" >&2
t0=$(date +%s)
# shellcheck disable=SC2086  # the flags are meant to split into separate arguments
if ! { cmake -S "$src" -B "$work/build" $extra $flags && \
       cmake --build "$work/build" --config Release --target llama-server llama-bench -j "${SPECDEC_BUILD_JOBS:-2}"; } >>"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "error: the llama.cpp build failed (full log: $log)" >&2
  exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s" >&2

out=$work/out
mkdir -p "$out/bin"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-bench" "$out/bin/"
cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$src/LICENSE" "$out/"
compiler=$( (c++ --version 2>/dev/null || g++ --version) | head -n 1)
"$PY" - "$out/build-info.json" "$VERSION" "$commit" "$flags" "$extra" "$compiler" <<'PY'
import json, sys, time
path, version, commit, flags, extra, compiler = sys.argv[1:]
info = {"llama_cpp_python": version, "llama_cpp_commit": commit or None,
        "source": f"llama-cpp-python {version} vendored llama.cpp" + (f" (ggml-org/llama.cpp@{commit})" if commit else ""),
        "ggml_flags": flags.split(), "cmake_flags": extra.split(), "compiler": compiler,
        "built": time.strftime("%Y-%m-%dT%H:%M:%S")}
with open(path, "w") as f:
    json.dump(info, f, indent=1)
PY
rm -rf "$dir"
mv "$out" "$dir"
echo "$dir"
