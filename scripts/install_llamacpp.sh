#!/usr/bin/env bash
# Build and install llama-cpp-python for this CPU into the given Python (default .venv/bin/python).
#
# The default build (GGML_NATIVE) segfaults on its first eval on these machines: its AMX code
# paths are the culprit. We disable native detection and AMX, and enable AVX-512 only where the
# CPU has it (measured ~5 % faster than AVX2 there; see docs/performance.md). The wheel is cached
# under ~/.cache/specdec/wheels keyed by the flags, so a rebuild happens only when they change;
# pip itself never reuses a wheel built with other flags (--no-cache-dir).
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=0.3.36

flags="-DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
if [ "${SPECDEC_LLAMACPP_AVX512:-auto}" != "off" ] && grep -qw avx512f /proc/cpuinfo && grep -qw avx512_vnni /proc/cpuinfo \
   && grep -qw avx512_vbmi /proc/cpuinfo && grep -qw avx512_bf16 /proc/cpuinfo; then
  flags="$flags -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
else
  flags="$flags -DGGML_AVX512=OFF"
fi

key=$(printf '%s %s' "$VERSION" "$flags" | sha256sum | cut -c1-16)
if "$PY" - "$key" <<'PY' 2>/dev/null; then
import sys, importlib.metadata as md, pathlib
dist = md.distribution("llama-cpp-python")
stamp = pathlib.Path(dist.locate_file("llama_cpp")) / ".specdec-build"
sys.exit(0 if stamp.is_file() and stamp.read_text().strip() == sys.argv[1] else 1)
PY
  echo "llama-cpp-python $VERSION already built with these flags"
  exit 0
fi

cache=${XDG_CACHE_HOME:-$HOME/.cache}/specdec/wheels/llama-cpp-python-$key
if ! ls "$cache"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $VERSION with: $flags (a few minutes)"
  mkdir -p "$cache.tmp"
  CMAKE_ARGS="$flags" "$PY" -m pip wheel --no-cache-dir --no-deps -w "$cache.tmp" "llama-cpp-python==$VERSION"
  rm -rf "$cache" && mv "$cache.tmp" "$cache"
fi
"$PY" -m pip install --no-deps --force-reinstall "$cache"/llama_cpp_python-*.whl
"$PY" - "$key" <<'PY'
import sys, importlib.metadata as md, pathlib
stamp = pathlib.Path(md.distribution("llama-cpp-python").locate_file("llama_cpp")) / ".specdec-build"
stamp.write_text(sys.argv[1] + "\n")
PY
