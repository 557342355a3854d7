"""Shared by the engine adapter tests (vLLM, the SGLang stand-in): prompts over the digits vocabulary,
trained-looking weights for a policy before a sync, and one rollout through the phase switch."""

from __future__ import annotations

import torch

PROMPTS = [[5, 6, 7, 14], [8, 14], [11, 12, 13, 4, 5, 6, 14]]


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Trained-looking weights: neither the checkpoint nor the engine's dummy init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def rollout(pm, prompts, params):
    """Generate through the phase switch (resume, sync, generate), then back to TRAIN (release)."""
    with pm.rollout() as engine:
        out = engine.generate(prompts, params)
    with pm.train():
        pass
    return out


def vllm_model_dir(tmp_path_factory, name: str) -> str:
    """The tiny digits model, wide enough for vLLM: its CPU attention needs head_dim 32 (hidden 128, 4 heads)."""
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(
        str(tmp_path_factory.mktemp(name) / "model"), DIGIT_WORDS, hidden_size=128, num_layers=2
    )


class SwapAt:
    """A types.WeightUpdates for one test: at its `at`-th poll (1-based) it applies `new` (name -> tensor, the
    policy's HF names) through the engine's weight-update API and reports one version; every other poll, none."""

    def __init__(self, engine, new: dict, at: int):
        self.engine, self.new, self.at, self.polls = engine, new, at, 0

    def poll(self) -> int:
        self.polls += 1
        if self.polls != self.at:
            return 0
        self.engine.begin_weight_update()
        self.engine.update_weights(list(self.new.items()))
        self.engine.end_weight_update()
        return 1


@torch.no_grad()
def stale_kv_greedy(model, new: dict, prompt: list[int], mark: int, T: int, stops: set[int], min_new: int = 0):
    """The in-flight oracle, written with transformers' own cache (no engine code): greedy decoding of one prompt
    whose weights become `new` in place from token `mark` on (the forward that yields token `mark`'s logits runs the
    new weights), the cache written so far kept as the old weights wrote it. Returns (tokens, logprobs), ending after
    a stop id (min_new: stops banned before that many tokens) or at T tokens. `model` is changed in place."""
    from transformers import DynamicCache

    def swap():
        params = dict(model.named_parameters())
        for name, t in new.items():
            params[name].copy_(t)

    cache, pos = DynamicCache(), len(prompt)
    if mark == 0:
        swap()
    logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
    toks, lps = [], []
    for j in range(T):
        z = logits.double().clone()
        if j < min_new:
            z[list(stops)] = float("-inf")
        tok = int(z.argmax())
        toks.append(tok)
        lps.append(float(torch.log_softmax(z, -1)[tok]))
        if tok in stops or j == T - 1:
            break
        if j + 1 == mark:
            swap()
        out = model(
            input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]), past_key_values=cache, use_cache=True
        )
        logits, pos = out.logits[0, -1], pos + 1
    return toks, lps
