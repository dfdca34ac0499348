# specdec: every target sets up what it needs (virtual environment, pinned dependencies, generated code).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PROTOS := $(wildcard protos/specdec/v1/*.proto)
GENERATED := specdec/v1/.generated
PAIR ?= default_models/pair
PROMPT ?= def fibonacci(n):
HOST ?= 127.0.0.1

.PHONY: setup proto lint test test-long matrix run bench load-bench compare-bench host-bench link-bench prefix-bench gpu-bench sim-bench speculation-bench tree-bench cross-bench guidellm-bench soak wheel image python-base image-test models cross-models evaluate clean

setup: $(INSTALLED) $(GENERATED)

$(INSTALLED): requirements.lock
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	touch $@

# Generated gRPC code: produced from protos/ by the build, never committed, never edited by hand.
$(GENERATED): $(PROTOS) $(INSTALLED)
	rm -rf specdec
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	touch $@

proto: $(GENERATED)

lint: setup
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m mypy .

test: lint
	$(PY) -m pytest -q tests

# The long runs make test leaves out (pytest's `slow` marker): the 20,000-sample distribution tests, the
# one-minute soak, the wheel installed into a fresh environment, three hosts in network namespaces,
# bfloat16, the GPU script on tiny shapes, greedy identity with an unrelated draft at K = 4 and 8. CI runs
# them after make test.
test-long: setup
	$(PY) -m pytest -q tests -m slow

# Every architecture family of tests/architectures.py through the three services, batched and in the
# fallback (make test serves a subset of them).
matrix: setup
	$(PY) -m pytest -q tests/test_architectures.py -m "matrix or not matrix"

# A real speculative generation through three gRPC services on loopback, with the default pair.
run: setup
	$(PY) -m tools.local_stack --target-model $(PAIR)/target --draft-model $(PAIR)/draft --prompt "$(PROMPT)"

bench: setup
	$(PY) -m bench
	$(PY) -m bench.gateway
	$(PY) -m bench.gateway_hostile
	$(PY) -m bench.structured
	$(PY) -m bench.staggered --model target
	$(PY) -m bench.staggered --model draft
	$(PY) -m bench.staggered --model target --verify 2 --presence 0.7

# Throughput and latency under 1 to 16 concurrent clients (bench/load.py).
# Under load, 1 to 64 streams, beside Hugging Face's padded batch in the same run: the default pair, then the
# near-null pair pinned (README, "The control plane at a GPU's shape").
load-bench: setup
	$(PY) -m bench --concurrency 1,8,32,64 --prompts 32 --max-new-tokens 64
	$(PY) -m bench --pair null --placement pinned --concurrency 1,8,32,64 --prompts 32 --max-new-tokens 64 --reps 5 \
	  --only "target alone (K = 0),specdec fixed K = 4,HF generate() padded batch"

# This tree's load table against another revision's (AGAINST, default HEAD: the working tree's changes), both
# stacks up at once and the cells interleaved pair by pair (bench/compare.py; about 30 minutes).
AGAINST ?= HEAD
compare-bench: setup
	$(PY) -m bench.compare --against $(AGAINST)

# The hosts' CPU per generated token, every process (client included), on the near-null pair at 1, 8 and 64
# streams; AGAINST=REV runs that revision's stack beside this tree's, cells alternating (bench/host_cpu.py).
host-bench: setup
	$(PY) -m bench.host_cpu $(if $(AGAINST),--against $(AGAINST),)

# Sampled generation across rate-limited links (network namespaces, tbf; needs root), big-vocabulary pair.
link-bench: setup
	$(PY) -m bench.link --rates 1gbit,10gbit --concurrency 1,8 --reps 3

# Prefix caching on and off (multi-turn chat, a shared document), cache-aware routing over 2 target replicas
# against the least loaded, and the memory of one long prompt (bench/prefix.py).
prefix-bench: setup
	$(PY) -m bench.prefix --reps 2 --slacks 1,2,4

# On a GPU host, after installing the CUDA build of torch into $(VENV): random-weight 1B target and 100M
# drafts built on the device, C = 1, 8, 32 (bench/gpu.py).
gpu-bench: setup
	$(PY) -m bench.gpu --concurrency 1,8,32,64

# The load table in a GPU's regime (MODELED device time: --simulated-device on both services), beside its
# ideal: 8B and 70B targets, short and ~2,000-token contexts, 1 to 128 streams (bench/sim.py; most of an
# hour). QUICK=1 for a development run of a few minutes.
sim-bench: setup
	$(PY) -m bench.sim $(if $(QUICK),--quick,)

# The speculation cache's hit rate on the trained default pair, one stream (clock-free counts).
speculation-bench: setup
	$(PY) -m bench.speculation

# Token trees against chains at equal verify tokens on the trained default pair, one stream (clock-free
# counts, in-process: bench/tree.py; about 20 minutes).
tree-bench: setup
	$(PY) -m bench.tree

# A draft with another tokenizer (the shipped demo draft, default_models/cross_draft: TLI, and SLEM for greedy)
# against the default draft and the target alone, one stream, pinned. Without --draft: the proxy pair.
cross-bench: setup
	$(PY) -m bench.cross_pair --draft default_models/cross_draft

# guidellm (the vLLM project's load tool) against the gateway: synthetic prompts with ignore_eos, every request
# must complete (bench/guidellm.py). guidellm pins its own stack, so it gets a virtual environment of its own.
GUIDELLM_VENV ?= .venv-guidellm
guidellm-bench: setup
	test -x $(GUIDELLM_VENV)/bin/guidellm || { $(PYTHON) -m venv $(GUIDELLM_VENV) && $(GUIDELLM_VENV)/bin/pip install --quiet guidellm==0.8.1; }
	$(PY) -m bench.guidellm --guidellm $(GUIDELLM_VENV)/bin/guidellm

# Many clients with cancellations and bad requests for MINUTES (default 10); a 60-second run is in make test.
MINUTES ?= 10
soak: setup
	$(PY) -m bench.soak --minutes $(MINUTES)

# The installable wheel (gRPC code generated into it), in dist/.
wheel: setup
	$(PY) -m pip wheel . --no-deps --no-build-isolation -w dist

# The container image (deploy/Dockerfile) with podman, or docker where its daemon answers. VARIANT=cpu or
# cuda; PYTHON_IMAGE is the base: the public python:3.11-slim-bookworm unless named (make python-base
# builds a local stand-in where registries cannot be reached).
VARIANT ?= cpu
PYTHON_IMAGE ?= python:3.11-slim-bookworm
image: setup
	$(PY) deploy/image/image.py build --variant $(VARIANT) --python-image $(PYTHON_IMAGE)

python-base:
	deploy/image/python-base.sh localhost/specdec-python:3.11-bookworm

# Build the CPU image and run it as the Kubernetes base deploys it (needs root and podman; minutes).
image-test: setup
	$(PY) deploy/image/image.py test --python-image $(PYTHON_IMAGE)

# Retrain the default pair (about 2.5 hours on 2 CPU cores), then measure it and write its model card.
models: setup
	$(PY) -m default_models.train --out $(PAIR)
	$(PY) -m default_models.evaluate --pair $(PAIR)

# Retrain the cross-tokenizer demo draft (a SentencePiece-style tokenizer of its own; about 15 minutes on 2 CPU cores).
cross-models: setup
	$(PY) -m default_models.cross_draft --out default_models/cross_draft

evaluate: setup
	$(PY) -m default_models.evaluate --pair $(PAIR)

clean:
	rm -rf $(VENV) specdec .mypy_cache .ruff_cache .pytest_cache build dist
