"""rollout.min_new_tokens: no stop token before the n-th generated token (vLLM's min_tokens, SGLang's
min_new_tokens), in the native engine's token loop.

Catches: a loop that bans stops one token too long or too short (off-by-one on t), a ban that misses the
extra stop_token_ids or EOS, logprobs that still count the banned stops (the engine's logprob must be the
sampled distribution's, as vLLM's processed_logprobs are), and a config that accepts min > max.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.models.logprobs import build_sequences, position_ids
from hybrid_rl.rollout.native.engine import NativeEngine
from hybrid_rl.types import SamplingParams
from tests.unit.rollout.native.test_native_engine import EOS, PAD, PROMPTS, ForceTokens

pytestmark = pytest.mark.usefixtures("torch_one_thread")
STOP = 7  # an extra stop id (rollout.stop_token_ids)


def _forced(model, calls: int):
    """Every row is pushed to stop at every call: EOS for even calls, the extra stop for odd ones."""
    return ForceTokens(
        model, {c: [(r, EOS if c % 2 == 0 else STOP) for r in range(len(PROMPTS))] for c in range(calls)}
    )


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("min_new", [0, 1, 3])
def test_no_stop_before_min_new_tokens_then_the_forced_stop(sharp_model, greedy, min_new):
    sp = SamplingParams(
        max_new_tokens=8, greedy=greedy, temperature=1.0, seed=5, stop_token_ids=(STOP,), min_new_tokens=min_new
    )
    comps = NativeEngine(_forced(sharp_model, 8), pad_id=PAD, eos_id=EOS).generate(PROMPTS, sp)
    for c in comps:
        assert len(c.token_ids) == min_new + 1 and c.finish_reason == "stop", (min_new, c.token_ids)
        assert not {EOS, STOP} & set(c.token_ids[:-1]), "a stop token before min_new_tokens"
        assert c.token_ids[-1] == (EOS if min_new % 2 == 0 else STOP)


def test_logprobs_are_the_distribution_with_the_stops_removed(sharp_model):
    """Before min_new_tokens the engine samples from softmax over the non-stop tokens, and reports that
    distribution's logprob (finite, larger than the unmasked one), not the model's raw one."""
    min_new = 4
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, seed=1, stop_token_ids=(STOP,), min_new_tokens=min_new)
    comps = NativeEngine(sharp_model, pad_id=PAD, eos_id=EOS).generate(PROMPTS, sp)
    responses = [c.token_ids for c in comps]
    ids, attn, _, P = build_sequences(PROMPTS, responses, PAD)
    with torch.no_grad():
        logits = sharp_model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn)).logits.float()
    for i, c in enumerate(comps):
        assert len(c.token_ids) >= min_new + (c.finish_reason == "stop")
        for t, tok in enumerate(c.token_ids):
            row = logits[i, P - 1 + t] / 0.8
            if t < min_new:
                row = row.index_fill(0, torch.tensor([EOS, STOP]), float("-inf"))
            want = torch.log_softmax(row, -1)[tok]
            assert abs(c.logprobs[t] - want.item()) < 1e-4, (i, t)


def test_bad_min_new_tokens_is_refused_naming_the_key():
    from hybrid_rl.config.schema import RolloutConfig

    with pytest.raises(ValueError, match="rollout.min_new_tokens"):
        RolloutConfig(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(ValueError, match="rollout.min_new_tokens"):
        RolloutConfig(min_new_tokens=-1)
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=2, min_new_tokens=3)


def test_the_rollout_stage_passes_it_to_the_engine():
    from types import SimpleNamespace

    from hybrid_rl.config.schema import Config
    from hybrid_rl.loop.rollout_stage import RolloutStage

    cfg = Config()
    cfg.rollout.min_new_tokens = 3
    stage = SimpleNamespace(cfg=cfg, stop_token_ids=(1,))
    assert RolloutStage.sampling_params(stage, step=0, round_idx=0).min_new_tokens == 3
