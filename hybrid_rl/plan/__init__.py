"""The memory planner, one package, torch-free but for from_config.py (which reads a run's tokenizer):

arch.py           a decoder's numbers: built-in architectures, parameter count, dtype bytes
rollout_memory.py what a rollout costs beyond the weights: native decode batch, vLLM and SGLang KV pools
memory.py         roles x phases per GPU, residency, offload, the margin: `plan_memory`
fixes.py          the smallest changes that make a plan fit, ranked
report.py         the printed plan
from_config.py    one plan from a run's Config (the recipes' --dry-run, the trainer's offload.auto)
rates.py          placement rates: each half as a / n + c, fitted from runs' metrics
placement.py      colocated vs split predictions from those rates
cli.py            `python -m hybrid_rl.plan`
"""
