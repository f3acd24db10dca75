# `make test` and `make demo` set up what they need on a fresh machine: a virtualenv in .venv with
# the CPU build of torch pinned when no torch is present (an unpinned torch pulls a CUDA build).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install test demo bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

test: $(STAMP)
	DS_ACCELERATOR=cpu $(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
