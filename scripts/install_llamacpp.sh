#!/usr/bin/env bash
# Build and install llama-cpp-python for this CPU into the given Python (default .venv/bin/python),
# and keep llama.cpp's model converter from the same source (convert_hf_to_gguf.py, conversion/,
# gguf-py/) under <prefix>/share/specdec/llama.cpp: specdec.model.gguf_convert runs it to make a GGUF
# draft from any Hugging Face model.
#
# The default build (GGML_NATIVE) segfaults on its first eval on these machines: its AMX code
# paths are the culprit. We disable native detection and AMX, and enable AVX-512 only where the
# CPU has it (faster than AVX2 there: docs/benchmarks.md, "llama.cpp build"). The wheel is cached
# under ~/.cache/specdec/wheels keyed by the flags, so a rebuild happens only when they change;
# pip itself never reuses a wheel built with other flags (--no-cache-dir).
#
# SPECDEC_LLAMACPP_CUDA=1 adds llama.cpp's CUDA backend (-DGGML_CUDA=on), so the draft can offload
# layers to a GPU (SPECDEC_DRAFT_GPU_LAYERS). The build needs the CUDA toolkit (nvcc, cuBLAS) and
# compiles for llama.cpp's default list of GPU architectures (no GPU needed at build time; tens of
# minutes); the wheel needs libcudart and libcublas of the same CUDA major version at run time
# (a CUDA build of torch brings them) and the NVIDIA driver.
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=0.3.36

flags="-DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
if [ "${SPECDEC_LLAMACPP_AVX512:-auto}" != "off" ] && grep -qw avx512f /proc/cpuinfo && grep -qw avx512_vnni /proc/cpuinfo \
   && grep -qw avx512vbmi /proc/cpuinfo && grep -qw avx512_bf16 /proc/cpuinfo; then
  flags="$flags -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
else
  flags="$flags -DGGML_AVX512=OFF"
fi
if [ "${SPECDEC_LLAMACPP_CUDA:-0}" = "1" ]; then
  flags="$flags -DGGML_CUDA=on"
fi

key=$(printf '%s %s' "$VERSION" "$flags" | sha256sum | cut -c1-16)
root=${XDG_CACHE_HOME:-$HOME/.cache}/specdec/wheels

# The sdist, once: the wheel is built from it and the converter comes out of it. Only this package
# as source (--no-binary llama-cpp-python): the build backend's own requirements, which pip may
# need to read the sdist's metadata, come as wheels.
sdist=$root/llama_cpp_python-$VERSION.tar.gz
fetch_sdist() {
  if [ ! -f "$sdist" ]; then
    mkdir -p "$root"
    echo "fetching the llama-cpp-python $VERSION sdist"
    tmp=$(mktemp -d "$root/sdist.XXXXXX")
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$tmp"
    mv "$tmp/llama_cpp_python-$VERSION.tar.gz" "$sdist"
    rm -rf "$tmp"
  fi
}

install_converter() {
  local converter
  converter=$("$PY" -c 'import sys; print(sys.prefix)')/share/specdec/llama.cpp
  if [ -f "$converter/VERSION" ] && [ "$(cat "$converter/VERSION")" = "llama-cpp-python-$VERSION" ]; then
    return
  fi
  fetch_sdist
  tmp=$(mktemp -d)
  src=llama_cpp_python-$VERSION/vendor/llama.cpp
  tar xzf "$sdist" -C "$tmp" "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$src/LICENSE"
  rm -rf "$converter" && mkdir -p "$(dirname "$converter")"
  mv "$tmp/$src" "$converter"
  rm -rf "$tmp" "$converter/gguf-py/tests" "$converter/gguf-py/examples"
  echo "llama-cpp-python-$VERSION" > "$converter/VERSION"
  echo "llama.cpp's converter kept in $converter"
}

if "$PY" - "$key" <<'PY' 2>/dev/null; then
import sys, importlib.metadata as md, pathlib
dist = md.distribution("llama-cpp-python")
stamp = pathlib.Path(dist.locate_file("llama_cpp")) / ".specdec-build"
sys.exit(0 if stamp.is_file() and stamp.read_text().strip() == sys.argv[1] else 1)
PY
  echo "llama-cpp-python $VERSION already built with these flags"
  install_converter
  exit 0
fi

cache=$root/llama-cpp-python-$key
if ! ls "$cache"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  # On every core, and only what the binding loads: the multimodal library (LLAVA_BUILD, mtmd) is
  # never loaded by specdec. Neither choice changes the library built, so neither is in the key.
  jobs=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  echo "building llama-cpp-python $VERSION with: $flags ($jobs parallel jobs; a few minutes)"
  fetch_sdist
  mkdir -p "$cache.tmp"
  start=$SECONDS
  # pip prints nothing while cmake compiles: say that it is still going
  ( while sleep 30; do echo "  still compiling llama.cpp ($((SECONDS - start)) s)"; done ) &
  ticker=$!
  trap 'kill $ticker 2>/dev/null || true' EXIT
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs CMAKE_ARGS="$flags -DLLAVA_BUILD=OFF" \
    "$PY" -m pip wheel --quiet --no-cache-dir --no-deps -w "$cache.tmp" "$sdist"
  kill $ticker 2>/dev/null || true; trap - EXIT
  echo "llama-cpp-python built in $((SECONDS - start)) s"
  rm -rf "$cache" && mv "$cache.tmp" "$cache"
fi
"$PY" -m pip install --no-deps --force-reinstall "$cache"/llama_cpp_python-*.whl
"$PY" - "$key" <<'PY'
import sys, importlib.metadata as md, pathlib
stamp = pathlib.Path(md.distribution("llama-cpp-python").locate_file("llama_cpp")) / ".specdec-build"
stamp.write_text(sys.argv[1] + "\n")
PY
install_converter
