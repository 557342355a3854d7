#!/usr/bin/env bash
# Everything only a GPU can show, in ONE call of the device tool (a lent H100 or H200: device
# time is scarce, and each call that starts a machine costs minutes of it).
#
#   here, once (the GPU image has no omegaconf):
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl omegaconf==2.4.0
#   then:  device run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# The image has torch 2.11+cu130, transformers, triton, pytest and PyYAML; no SGLang, so the
# real-SGLang tests skip (sglang-api.md section 8 says what staging them would take). Each part
# runs under its own time limit (together 545 s, inside one call's 600), so a hang costs only its
# share. Results go to $OUT (the device tool brings back 8 files at most; without $OUT: ./gpu_out):
#   summary.txt              one line per part: exit code and seconds (124 = its time limit)
#   env.txt                  nvidia-smi, torch / CUDA / transformers versions
#   gpu_tests.log            pytest -m gpu: Trainer.step on CUDA in bf16 (and on 2 GPUs when there are two),
#                            the native engine's decode paths and CUDA-graph capture on the FSDP2 policy,
#                            offload freeing device memory, shared-prefix and packed scoring, the Triton kernel
#   rollout_throughput.log   decode tokens/s and the fraction of the HBM roofline, Qwen2.5-0.5B's shape, batch 64
#   logprob_memory.log       peak memory and time of the chunked vs naive log-prob + entropy at V = 151,936
#   phase_swap.log           what each step of the phase switch costs on the device
# DEVICE=cpu runs the same plumbing on a CPU at tiny sizes (the GPU tests then skip): a check of this script.
set -u
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
: > "$OUT/summary.txt"

part() {  # part NAME SECONDS COMMAND...: run it into $OUT/NAME.log, note its exit code and time
  local name=$1 limit=$2 t0=$SECONDS code
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  code=$?
  echo "$name: exit $code in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

if ! $PY -c "import omegaconf" 2> /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    || echo "omegaconf missing and no .whl/ to install it from (see the top of this script)" | tee -a "$OUT/summary.txt"
fi
part install 60 $PY -m pip install --no-index --no-deps --no-build-isolation -e .
if ! $PY -c "import hybrid_rl.kernels" 2> /dev/null; then
  # An old setuptools installs in develop mode, which does not map kernels/ to hybrid_rl.kernels.
  ln -sfn ../kernels hybrid_rl/kernels
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  echo "install: hybrid_rl.kernels linked by hand" | tee -a "$OUT/summary.txt"
fi
{ nvidia-smi 2>&1 || echo "no nvidia-smi"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
} > "$OUT/env.txt" 2>&1

if [ "$DEVICE" = cuda ]; then
  part gpu_tests 240 $PY -m pytest -q -m gpu -rs -p no:cacheprovider tests/gpu tests/unit/kernels/test_kernels.py
  # --vocab 151936: Qwen2.5's vocabulary (also the script's default on CUDA), so the tied head (27% of the
  # 0.5B weights) and the sampler's pass over the vocabulary are in the step, as in the real model.
  part rollout_throughput 140 $PY benchmarks/rollout_throughput.py --device cuda --models 0.5b --vocab 151936 \
    --batch 64 --new-tokens 128,512 --scenarios full,ragged --paths old,new --repeats 2
  part logprob_memory 45 $PY benchmarks/logprob_memory.py --device cuda --dtype bfloat16 --tokens 2048 8192 16384
  part phase_swap 60 $PY benchmarks/phase_swap.py --device cuda
else
  part gpu_tests 120 $PY -m pytest -q -m gpu -rs -p no:cacheprovider tests/gpu
  part rollout_throughput 120 $PY benchmarks/rollout_throughput.py --device cpu --models tiny --batch 8 \
    --new-tokens 8 --scenarios full --paths new
  part logprob_memory 60 $PY benchmarks/logprob_memory.py --device cpu --tokens 64 --vocab 1024 --hidden 64
  part phase_swap 120 $PY benchmarks/phase_swap.py --device cpu --hidden 64 --layers 2 --heads 4 --kv-heads 2 \
    --vocab 256 --k 1 --warmup 0
fi
