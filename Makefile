# Two entry points for a fresh machine with Python 3.11+:
#   make demo   AdamA against Adam + gradient accumulation at 2,048-token
#               micro-batches: trains the tiny GPT both ways on the offline
#               corpus (held-out loss), compiles GPT-2 small's step (memory).
#   make test   lint (ruff), types (mypy on optax_adama) and the test suite
#               (heavy runs marked `slow` are left out).
# Both create .venv and install the package with its extras if needed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
VENV_MIN  := .venv-min
STAMP_MIN := $(VENV_MIN)/.installed
CONSTRAINTS_MIN := .ci/constraints-min.txt
# The jax of .venv; the accelerator environments pin their extras to it, so a
# compile for a TPU or a GPU runs the same jax as the CPU numbers beside it.
JAX_VERSION := 0.10.2
VENV_TPU  := .venv-tpu
STAMP_TPU := $(VENV_TPU)/.installed
VENV_GPU  := .venv-gpu
STAMP_GPU := $(VENV_GPU)/.installed

.PHONY: demo test test-all test-min test-compilers venv-tpu venv-gpu validate notebooks bench-gpu bench-gpu-capacity gpu-convergence clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m models.demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -m "not slow" -n 2 --dist loadgroup --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup

# The fast suite against the dependency floors: pyproject.toml's `>=` versions,
# pinned exactly in $(CONSTRAINTS_MIN). Not part of the default CI run.
$(STAMP_MIN): pyproject.toml $(CONSTRAINTS_MIN)
	test -x $(VENV_MIN)/bin/python || $(PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_MIN)/bin/python -m pip install --quiet -c $(CONSTRAINTS_MIN) -e ".[test]"
	touch $(STAMP_MIN)

test-min: $(STAMP_MIN)
	$(VENV_MIN)/bin/python -m pytest -m "not slow" -n 2 --dist loadgroup

# Compile-only memory for real accelerators without one (optax_adama.memory's
# targets, `--target` of models.bench and benchmarks/scripts/oom_reports.py;
# docs/design.md, "How we measure memory"). Each its own environment: libtpu
# and the CUDA plugin would change what .venv's tests compile for.
#   venv-tpu: the package, then jax[tpu] (libtpu from PyPI, no TPU needed).
#   venv-gpu: the package, then jax[cuda12-local] (XLA's GPU compiler, no GPU
#             needed) and nvidia-cuda-nvcc-cu12 (ptxas, which it calls).
# Install times on 2 cores from PyPI, pip's cache warm from .venv: venv-tpu 53 s
# (libtpu 0.0.42.1), venv-gpu 60 s (jax-cuda12-plugin 0.10.2, nvcc 12.9.86).
$(STAMP_TPU): pyproject.toml
	test -x $(VENV_TPU)/bin/python || $(PYTHON) -m venv $(VENV_TPU)
	$(VENV_TPU)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_TPU)/bin/python -m pip install --quiet -e ".[test]"
	$(VENV_TPU)/bin/python -m pip install --quiet "jax[tpu]==$(JAX_VERSION)"
	touch $(STAMP_TPU)

venv-tpu: $(STAMP_TPU)

$(STAMP_GPU): pyproject.toml
	test -x $(VENV_GPU)/bin/python || $(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_GPU)/bin/python -m pip install --quiet -e ".[test]"
	$(VENV_GPU)/bin/python -m pip install --quiet "jax[cuda12-local]==$(JAX_VERSION)" \
	    nvidia-cuda-nvcc-cu12
	touch $(STAMP_GPU)

venv-gpu: $(STAMP_GPU)

# The real compilers' smokes (CI runs them after `make test`): one AdamA step
# compiled by libtpu for a TPU v3-8 and by XLA's GPU compiler for an H100, each
# in its own environment (tests/library/test_targets.py; the 7B ones stay `slow`).
test-compilers: $(STAMP_TPU) $(STAMP_GPU)
	ALLOW_MULTIPLE_LIBTPU_LOAD=1 $(VENV_TPU)/bin/python -m pytest tests/library/test_targets.py \
	    tests/zoo/test_plan_target.py tests/benchmark_scripts/test_oom_reports_tpu.py -m slow -k tpu -n 0
	$(VENV_GPU)/bin/python -m pytest tests/library/test_targets.py -m slow -k h100 -n 0

validate: $(STAMP)
	$(BIN)/python -m models.validate

# On a machine with a GPU: memory and step times of every accumulation method,
# gpt2_small and gpt2_medium, N = 4, unrolled and scanned ->
# benchmarks/results/gpu/gpu_<device>.md and benchmarks/results/gpu/raw/gpu_<device>.json.
# Runs on the machine's own Python, whose jax has CUDA (.venv's is the CPU build).
# Other presets through BENCH_GPU_ARGS (benchmarks/results/gpu/live_runs.md,
# "Waiting for a GPU").
bench-gpu:
	$(PYTHON) -m models.gpu_bench $(BENCH_GPU_ARGS)

# The largest GPT each method trains on the device (a call of its own).
bench-gpu-capacity:
	$(PYTHON) -m models.gpu_bench --capacity $(BENCH_GPU_ARGS)

# On a machine with a GPU: GPU_PRESET (GPT-2 small; llama_small, a Llama of its
# size), 2,000 steps, Adam + accumulation and then the default AdamA on the same
# mini-batch (GPU_BATCH sequences of 256 tokens in GPU_N micro-batches, seed
# GPU_SEED), one run at a time, raw runs into GPU_OUT, named by the preset;
# `PYTHONPATH=. python benchmarks/scripts/gpu_convergence.py` tables them.
# GPU_EXTRA_ARGS go last, so they override (the CPU test's few steps).
GPU_PRESET ?= gpt2_small
GPU_MODEL = $(if $(filter llama%,$(GPU_PRESET)),llama,gpt)
GPU_N ?= 8
GPU_BATCH ?= 32
GPU_SEED ?= 1
GPU_OUT ?= benchmarks/results/gpu/raw
GPU_EXTRA_ARGS ?=
# Which optimizers run, and a tag after the optimizer in the raw names.
GPU_OPTIMIZERS ?= adam adama
GPU_TAG ?=
GPU_CONVERGENCE_ARGS = --model $(GPU_MODEL) --preset $(GPU_PRESET) --dtype bfloat16 \
  --seq-len 256 --steps 2000 --learning-rate 6e-4 --warmup-steps 100 \
  --max-bytes 100000000 --eval-batches 32 --no-progress --num-micro-batches $(GPU_N) \
  --batch-size $(GPU_BATCH) --seed $(GPU_SEED) $(GPU_EXTRA_ARGS)
gpu-convergence:
	for optimizer in $(GPU_OPTIMIZERS); do \
	  $(PYTHON) -m models.train $(GPU_CONVERGENCE_ARGS) --optimizer $$optimizer \
	    --metrics-out $(GPU_OUT)/gpu_$(GPU_PRESET)_n$(GPU_N)_b$(GPU_BATCH)_seed$(GPU_SEED)_$${optimizer}$(GPU_TAG).json \
	    || exit 1; \
	done

notebooks: $(STAMP)
	$(BIN)/python notebooks/build.py

clean:
	rm -rf $(VENV) $(VENV_MIN) $(VENV_TPU) $(VENV_GPU) build dist *.egg-info
