# Set-up and entry points. Each target creates .venv if needed and installs
# torch==2.13.0 BEFORE the package, so no unpinned torch ever resolves (that would
# pull several GB of CUDA wheels on a CPU machine).
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: install demo test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: install
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) recipes/grpo_tiny.py $(ARGS)

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) benchmarks/phase_swap.py

clean:
	rm -rf $(VENV) runs .pytest_cache
