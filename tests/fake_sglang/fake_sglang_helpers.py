"""Helpers for tests that drive the sglang stand-in (importable once this directory is on sys.path).

They build trainer-side weights and per-rank flattened-bucket payloads the way an adapter
would, run producers in other processes, and give Hugging Face references to compare
the engine with. Producer processes import this module by name, so keep it light.

Legend: P prompt tokens, T response tokens, L = P + T, V vocab.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

FAKE_SGLANG_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(FAKE_SGLANG_DIR))


def trainer_weights(model_dir: str, seed: int = 1) -> dict:
    """The checkpoint's tensors plus seeded noise on every matrix, so outputs depend on the context
    and differ from both the checkpoint and load_format="dummy"."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    return {k: v + (0.15 * torch.randn(v.shape, generator=g) if v.dim() >= 2 else 0) for k, v in sorted(sd.items())}


def bucket_payload(weights: dict, names: list, output_str: bool = False):
    """One per-rank flattened-bucket payload, built from fresh copies: serializing a CPU tensor
    moves its storage into shared memory in place."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=[(n, weights[n].clone()) for n in names])
    return MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}, output_str=output_str)


def chunks(names: list, k: int = 2) -> list:
    return [names[i::k] for i in range(k)]


def sync(engine, per_bucket_payloads: list) -> None:
    """One session: begin, one update per bucket (a list with one payload per TP rank), end."""
    assert engine.begin_weight_update()[0]
    for payloads in per_bucket_payloads:
        ok, msg = engine.update_weights_from_tensor(payloads, load_format="flattened_bucket")
        assert ok, msg
    assert engine.end_weight_update()[0]


def full_sync(engine, weights: dict, tp: int, buckets: int = 2) -> list:
    """Send every tensor in `buckets` buckets, a separate copy per rank; return the payloads."""
    payloads = [[bucket_payload(weights, names) for _ in range(tp)] for names in chunks(sorted(weights), buckets)]
    sync(engine, payloads)
    return payloads


def hf_model(model_dir: str, weights: dict):
    """The Hugging Face model of `model_dir` holding `weights` (fp32, eval)."""
    from hybrid_rl.models.loading import load_causal_lm

    model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list, max_new: int, eos: int) -> list:
    """Argmax decoding with a full forward per step (no cache); includes the EOS it stops on."""
    ids = list(prompt)
    for _ in range(max_new):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == eos:
            break
    return ids[len(prompt):]


@torch.no_grad()
def hf_logprobs(model, prompt: list, out: list, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each token of `out`: shape (T,)."""
    logits_LV = model(torch.tensor([prompt + out])).logits[0]
    logp_TV = torch.log_softmax(logits_LV[len(prompt) - 1:-1] / temperature, dim=-1)
    return logp_TV.gather(-1, torch.tensor(out)[:, None])[:, 0]


def sibling_producer(model_dir: str, names_per_bucket: list, tp: int, out_q, done) -> None:
    """Target for a process spawned by the test: serialize payloads there, hand the bytes back,
    and stay alive until `done` (fd handles can be claimed only while the producer lives)."""
    weights = trainer_weights(model_dir)
    out_q.put([[bucket_payload(weights, names) for _ in range(tp)] for names in names_per_bucket])
    done.wait(300)


_UNRELATED_PRODUCER = """
import sys, torch.multiprocessing as tmp
tmp.set_sharing_strategy(sys.argv[1])
from fake_sglang_helpers import bucket_payload, chunks, trainer_weights
weights = trainer_weights(sys.argv[2])
for names in chunks(sorted(weights)):
    print(bucket_payload(weights, names, output_str=True), flush=True)
sys.stdin.readline()
"""


def start_unrelated_producer(strategy: str, model_dir: str):
    """A fresh interpreter with its own multiprocessing authkey, like another torchrun rank.

    Prints two base64 payloads (the two `chunks` of `trainer_weights`) and waits; finish it
    with `proc.communicate("\\n")`. Returns (proc, payloads).
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAKE_SGLANG_DIR, REPO_ROOT]))
    proc = subprocess.Popen([sys.executable, "-c", _UNRELATED_PRODUCER, strategy, model_dir], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return proc, [proc.stdout.readline().strip() for _ in range(2)]


def lora_tensors(weights: dict, rank: int, targets: tuple, seed: int = 0) -> dict:
    """A peft-named adapter over the Linears of `weights` whose leaf name is in `targets`:
    A (rank, in) and B (out, rank), both non-zero so the adapter moves the output."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in sorted(weights.items()):
        module = name[: -len(".weight")]
        if w.dim() != 2 or module.rsplit(".", 1)[-1] not in targets:
            continue
        out[f"base_model.model.{module}.lora_A.weight"] = 0.3 * torch.randn(rank, w.shape[1], generator=g)
        out[f"base_model.model.{module}.lora_B.weight"] = 0.3 * torch.randn(w.shape[0], rank, generator=g)
    return out


def merged_weights(weights: dict, lora: dict, scaling: float) -> dict:
    """`weights` with every adapted Linear replaced by W + scaling * B @ A (the reference for an adapter)."""
    out = dict(weights)
    for name, a in lora.items():
        if ".lora_A." in name:
            module = name[len("base_model.model."): -len(".lora_A.weight")]
            b = lora[name.replace(".lora_A.", ".lora_B.")]
            out[module + ".weight"] = weights[module + ".weight"] + scaling * (b @ a)
    return out
