# `make test` and `make demo` set up what they need on a fresh machine: a virtualenv in .venv with
# the CPU build of torch pinned when no torch is present (an unpinned torch pulls a CUDA build).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# DeepSpeed's JIT ops are built into this virtualenv, not the user-wide cache other checkouts share
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: install test test-long test-gpu demo bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]'
	@echo "building DeepSpeed's CPU Adam and shared-memory comm ops (once per virtualenv, 2-4 minutes on 2 cores)"
	$(PY) -m ds_ulysses.train.ops
	touch $@

test: $(STAMP)
	DS_ACCELERATOR=cpu $(PY) -m pytest

# What make test leaves out to stay under 20 minutes on 2 cores (marker `long`): the benchmark harness's
# Trainer, Accelerate and TRL loops and the GPU benchmark's checkpointing arm, launched as on a benchmark run
# (about 4 minutes).
test-long: $(STAMP)
	DS_ACCELERATOR=cpu $(PY) -m pytest -m long

# On a machine with CUDA: the GPU checks (tests/gpu, marker `gpu`; skipped without a CUDA device).
# flash-attn is optional: pip install -e '.[gpu]' where it can be built.
test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu tests/gpu

# The demo: SP 2 over 2 CPU processes on 16K-token sequences of the stdlib's source, ZeRO-3 with CPU
# offload, tiled loss; then the checkpoint exported to a plain HF directory and evaluated without SP.
# OMP_NUM_THREADS=1: one core per rank (two ranks sharing all cores run ~10x slower).
DEMO_DIR   ?= runs/demo
DEMO_ARGS  ?= --seq-len 16384 --steps 30 --save-every 10 --eval-samples 4
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(VENV)/bin/deepspeed --num_gpus 2 examples/train.py \
		--deepspeed_config examples/ds_config_cpu.json --out $(DEMO_DIR) $(DEMO_ARGS)
	DS_ACCELERATOR=cpu $(VENV)/bin/ds-ulysses export $(DEMO_DIR)/checkpoints $(DEMO_DIR)/hf
	DS_ACCELERATOR=cpu $(VENV)/bin/ds-ulysses eval $(DEMO_DIR)/hf --seq-len 16384 --samples 4

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
