#!/usr/bin/env bash
# What a lent GPU should run, in ONE call of the device tool, within GPU_SESSION_BUDGET_S (400 s) of wall time.
# docs/gpu_session.md says what each part measures and how to read the results.
#
#   here, once (a machine with the package index):  make gpu-kit        # .gpu_kit/: omegaconf's wheels + GSM8K
#   then:   device run(command="bash benchmarks/gpu_session.sh", carry=[".gpu_kit"], timeout_s=600)
#   on CPU: bash benchmarks/gpu_session.sh --dry       # the same parts at tiny sizes (CI runs it: a check of this)
#
# The GPU image has torch (CUDA), transformers, safetensors, peft, triton, pytest (+ pytest-timeout), no network,
# no omegaconf, no SGLang, no vLLM; what a call carries beside the repository is at most 64 MiB (the kit is ~5 MiB).
# The parts, in order, each under its own time limit (cut to what the budget has left; a part with under 5 s
# left is skipped, and says so), so a hang costs only its share:
#   preflight   (seconds) every module the parts import, installing the kit's wheels into a temporary site
#               when one is missing; CUDA; GSM8K; which engines import. A failure stops here with one line.
#   gpu_tests   pytest -m gpu -v --timeout=60 --durations=15: the tests that pin issue 38's fixes first (the
#               reference in bf16 and the ledger's reserved bytes in a real Trainer step, rollout.cuda_graphs,
#               the cache handed back, the one pinned optimizer buffer, vLLM's seeds), then the rest of tests/gpu
#               and the compiled Triton kernel
#   quickstart  the README's one-GPU quickstart at its real shape for two steps (benchmarks/gpu_quickstart.py: a
#               random Qwen2.5-1.5B-shaped model built on the GPU, vocabulary 151,936, bf16, GSM8K, 512 new tokens)
#   rollout     decode at that shape: the lean step eager against CUDA graphs, 64 and 512 rows, 512 new tokens
#   phase_swap  every stage of the phase switch at that shape (both native engine modes), one warm-up and one
#               measured cycle each; a line per cycle as it ends (45 s with two measured cycles was not enough)
# The limits add up to 60 + 120 + 150 + 70 + 75 = 475 s, more than the 385 s the budget leaves after RESERVE_S:
# each part gets min(its limit, what is left). The first H200 session (2026-11-28) took 9 + 74 + 108 + 60 s
# before phase_swap, leaving it 134 s for its 75; a part that runs to its limit cuts the tail (phase_swap first).
# Then benchmarks/gpu_session_report.py writes $OUT/summary.txt (its first line says what ran and what could not)
# and $OUT/gpu_session_<date>_<device>.tar.gz (every log and result). $OUT: the device tool's, else ./gpu_out.
# Exit status: 0 when every part passed, 3 when the pre-flight failed, 1 otherwise.
set -u
DRY=0
case "${1:-}" in
  --dry) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_session.sh [--dry]" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu_out}
KIT=${GPU_KIT:-$ROOT/.gpu_kit}
BUDGET_S=${GPU_SESSION_BUDGET_S:-400}
RESERVE_S=15  # after the last part: a killed part's grace (timeout -k 5) and the report
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX")  # the model (GBs) lives here, outside what is archived
WORK=$SCRATCH/work
SITE=$SCRATCH/site
mkdir -p "$OUT" "$WORK" "$SITE"
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
: > "$WORK/parts.tsv"

part() {  # part NAME LIMIT COMMAND...: under min(LIMIT, the budget's rest), output into $WORK/NAME.log
  local name=$1 limit=$2 left t0=$SECONDS code
  shift 2
  left=$((BUDGET_S - RESERVE_S - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    printf '%s\tskipped\t0\t0\n' "$name" >> "$WORK/parts.tsv"
    echo "$name: skipped, the budget of $BUDGET_S s is spent"
    return
  fi
  timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  code=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - t0))" "$limit" >> "$WORK/parts.tsv"
  echo "$name: exit $code in $((SECONDS - t0)) s (limit $limit s)"
}

report() {
  "$PY" benchmarks/gpu_session_report.py --work "$WORK" --out "$OUT" --budget "$BUDGET_S"
  rm -rf "$SCRATCH"
}

DRY_FLAG=()
[ "$DRY" = 1 ] && DRY_FLAG=(--dry)
part preflight 60 "$PY" benchmarks/gpu_preflight.py --kit "$KIT" --site "$SITE" --report "$WORK/preflight.json" \
  ${DRY_FLAG[@]+"${DRY_FLAG[@]}"}
if ! grep -q '"ok": true' "$WORK/preflight.json" 2> /dev/null; then
  tail -n 1 "$WORK/preflight.log"
  report
  exit 3
fi
GSM8K=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["gsm8k"])' "$WORK/preflight.json")

# The GPU tests that pin the fixes first (pytest keeps the order of the files it is given), then the rest.
FIRST=(tests/gpu/test_trainer_cuda.py tests/gpu/test_memory_cuda.py tests/gpu/test_offload_cuda.py
  tests/gpu/test_rollout_seeds_cuda.py)
REST=()
for f in tests/gpu/test_*.py; do
  case " ${FIRST[*]} " in *" $f "*) ;; *) REST+=("$f") ;; esac
done
part gpu_tests 120 "$PY" -m pytest -v -rs -p no:cacheprovider -m gpu --timeout=60 --durations=15 \
  "${FIRST[@]}" "${REST[@]}" tests/unit/kernels/test_kernels.py

part quickstart 150 "$PY" benchmarks/gpu_quickstart.py --out "$WORK/quickstart" --model-dir "$SCRATCH/model" \
  --data "$GSM8K" --steps 2 ${DRY_FLAG[@]+"${DRY_FLAG[@]}"}

if [ "$DRY" = 1 ]; then
  part rollout 60 "$PY" benchmarks/rollout_throughput.py --device cpu --models tiny --batch 2,4 --new-tokens 4 \
    --scenarios full --paths lean,new --prompt-len 8 --vocab 64
  part phase_swap 60 "$PY" benchmarks/phase_swap.py --device cpu --hidden 64 --layers 2 --heads 4 --kv-heads 2 \
    --vocab 256 --k 1 --warmup 0
else
  # Qwen2.5-1.5B's shape (benchmarks/rollout_throughput.py MODELS["1.5b"]), built on the GPU.
  part rollout 70 "$PY" benchmarks/rollout_throughput.py --device cuda --models 1.5b --batch 64,512 \
    --new-tokens 512 --scenarios full --paths lean,new --prompt-len 128 --repeats 1
  # ~50 s on an H200: ~10 s of imports and CUDA start, ~15 s building the model, its reference, engine copy and
  # AdamW state (12 GB), the 12 GB pinned host buffers (optimizer offload, and the bare-copy reference), then 4
  # cycles of ~3 s (the optimizer's 12 GB out and back each, a 64 x (128 + 16) rollout, the reference's 3 GB).
  part phase_swap 75 "$PY" benchmarks/phase_swap.py --device cuda --hidden 1536 --layers 28 --intermediate 8960 \
    --heads 12 --kv-heads 2 --vocab 151936 --batch 64 --prompt-len 128 --new-tokens 16 --k 1 --warmup 1
fi

STATUS=0
awk -F'\t' '$2 != "0" { bad = 1 } END { exit bad }' "$WORK/parts.tsv" || STATUS=1
report
exit $STATUS
