"""The ROLLOUT stage's batch (hybrid_rl/loop/rollout_stage.py): hand-written completions in, the batch by hand out.

A scripted engine answers each prompt with completions written here (a stop token, a truncation, the stop token
alone, an empty one), so every expected table is a literal or a naive loop over those token lists (the tables of
tests/unit/test_batch.py), never read back from the batch. The stage pairs prompts, completions and rewards across
dynamic-sampling rounds and builds one `RolloutBatch`; with an environment, `group_prompts` moves what differs
between a group's opening prompts into each completion under loss mask 0.

Legend: B prompts, G = 2 samples each, N = B*G rows, P prompt columns, T response columns; pad 0, stop (EOS) 1.
"""

from __future__ import annotations

import torch

from hybrid_rl.config.load import load_config
from hybrid_rl.envs.episodes import EpisodeCompletion
from hybrid_rl.loop.advantage_stage import advantage_stage
from hybrid_rl.loop.reward_setup import RewardSetup
from hybrid_rl.loop.rollout_stage import RolloutStage, group_prompts
from hybrid_rl.observability.metrics import StageTimer
from hybrid_rl.rewards.base import register_reward
from hybrid_rl.types import Completion
from tests.unit.test_batch import ATTN_NL, COMPLETIONS, ENGINE_LOGP_NT, IDS_NL, RESP_MASK_NT, TRUNCATED_N


@register_reward("test_stage_tokens")
def _tokens_reward(prompts, completions, metadata):
    """1.0 for a completion of two or more tokens before its stop token: the rewards of the hand-written rows."""
    return [1.0 if m["response_tokens"] >= 2 else 0.0 for m in metadata]


class ScriptedEngine:
    """Answers prompt p's g-th sample with SCRIPT[tuple(p)][g]; records each call's prompts."""

    def __init__(self, script: dict[tuple, list[Completion]]):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, params):
        self.calls.append([list(p) for p in prompt_ids])
        seen: dict[tuple, int] = {}
        out = []
        for p in prompt_ids:
            g = seen.get(tuple(p), 0)
            seen[tuple(p)] = g + 1
            out.append(self.script[tuple(p)][g])
        return out


class ListLoader:
    """The rows of each round in turn (a PromptLoader's next_batch)."""

    def __init__(self, rounds: list[list[dict]]):
        self.rounds = list(rounds)

    def next_batch(self) -> list[dict]:
        return self.rounds.pop(0)


def _stage(overrides, tokenizer, *extra) -> RolloutStage:
    cfg = load_config(
        None, [*overrides, "rollout.n=2", "reward.name=test_stage_tokens", "trainer.log_rollouts=0", *extra]
    )
    eos = tokenizer.eos_token_id
    return RolloutStage(
        cfg, lambda row: row["ids"], RewardSetup.resolve(cfg), tokenizer, (eos,), {eos}, torch.device("cpu"), "."
    )


def test_one_round_gives_the_hand_written_batch(tiny_trainer_overrides, tiny_tokenizer):
    """Catches: the single-turn loss mask shifted by a token, completions paired with the wrong prompt, the
    stage's `response/length` or the ADVANTAGE stage's `response/loss_tokens` counting padding."""
    assert tiny_tokenizer.pad_token_id == 0 and tiny_tokenizer.eos_token_id == 1
    rows = [{"prompt": "a", "ids": [5, 6, 7]}, {"prompt": "b", "ids": [8, 9]}]
    engine = ScriptedEngine({(5, 6, 7): COMPLETIONS[:2], (8, 9): COMPLETIONS[2:]})
    batch, m = _stage(tiny_trainer_overrides, tiny_tokenizer).run(engine, ListLoader([rows]), 0, StageTimer())
    assert engine.calls == [[[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]], "each prompt G times, in row order"
    assert batch.ids_NL.tolist() == IDS_NL
    assert batch.attn_NL.tolist() == ATTN_NL
    assert batch.resp_mask_NT.tolist() == RESP_MASK_NT
    assert torch.equal(batch.engine_logp_NT, torch.tensor(ENGINE_LOGP_NT))
    assert batch.truncated_N.tolist() == TRUNCATED_N
    # Bodies without the stop token: 2, 4, 0, 0 tokens -> rewards 1, 1, 0, 0.
    assert batch.rewards_N.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert m["response/length"] == (3 + 4 + 1 + 0) / 4
    _, acc = advantage_stage(batch, None, None, 0.0, load_config(None, tiny_trainer_overrides).algorithm)
    assert acc.reduce()["response/loss_tokens"] == (3 + 4 + 1 + 0) / 4


def test_groups_kept_over_two_sampling_rounds_keep_their_prompts(tiny_trainer_overrides, tiny_tokenizer):
    """Catches: a kept group of a later dynamic-sampling round paired with another round's prompt or
    completions, or with the columns of a batch padded to one round's prompt length only."""
    r1 = [{"prompt": "a", "ids": [5, 6, 7]}, {"prompt": "b", "ids": [8, 9]}]
    r2 = [{"prompt": "c", "ids": [4]}, {"prompt": "d", "ids": [10, 11, 12, 13]}]
    stop = lambda ids: Completion(ids, [-0.5] * len(ids), "stop")  # noqa: E731
    engine = ScriptedEngine(
        {
            (5, 6, 7): [stop([4, 4, 1]), stop([5, 5, 1])],  # rewards 1, 1: no signal, filtered
            (8, 9): [stop([6, 6, 6, 1]), stop([1])],  # 1, 0: kept
            (4,): [stop([]), stop([7, 8])],  # 0, 1: kept
            (10, 11, 12, 13): [stop([1]), stop([2, 1])],  # 0, 0: filtered
        }
    )
    stage = _stage(
        tiny_trainer_overrides, tiny_tokenizer, "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"
    )
    batch, m = stage.run(engine, ListLoader([r1, r2]), 0, StageTimer())
    assert m["sampling/rounds"] == 2 and m["sampling/groups_kept"] == 2
    assert [r["prompt"] for r in batch.rows] == ["b", "c"] and batch.P == 2
    assert batch.ids_NL.tolist() == [
        [8, 9, 6, 6, 6, 1],
        [8, 9, 1, 0, 0, 0],
        [0, 4, 0, 0, 0, 0],
        [0, 4, 7, 8, 0, 0],
    ]
    assert batch.attn_NL.tolist() == [
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
    ]
    assert batch.resp_mask_NT.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
    assert batch.rewards_N.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_group_prompts_moves_differing_prompt_tokens_under_mask_zero():
    """Catches: tokens of an episode's own opening prompt (beyond what its group shares) trained, or dropped
    from the sequence, or a completion's loss mask and log-probs misaligned with its tokens after the move."""
    prompts = [[5, 6, 7, 8], [5, 6, 9], [4, 4], [4, 4]]
    episodes = [
        EpisodeCompletion([10, 1, 3, 11, 1], [-0.1, -0.2, 0.0, -0.3, -0.4], "stop", loss_mask=[1, 1, 0, 1, 1]),
        EpisodeCompletion([12, 1], [-0.5, -0.6], "stop", loss_mask=[1, 1]),
        EpisodeCompletion([13], [-0.7], "length", loss_mask=[1]),
        EpisodeCompletion([], [], "length", loss_mask=[]),
    ]
    shared, out = group_prompts(episodes, prompts, 2)
    assert shared == [[5, 6], [4, 4]]
    assert [c.token_ids for c in out] == [[7, 8, 10, 1, 3, 11, 1], [9, 12, 1], [13], []]
    assert [c.loss_mask for c in out] == [[0, 0, 1, 1, 0, 1, 1], [0, 1, 1], [1], []]
    assert [c.logprobs for c in out] == [[0.0, 0.0, -0.1, -0.2, 0.0, -0.3, -0.4], [0.0, -0.5, -0.6], [-0.7], []]
    assert [c.finish_reason for c in out] == ["stop", "stop", "length", "length"]


def test_call_tally_adds_up_each_calls_account():
    """CallTally: the tokens and tails of every call through it, summed; None only while no call measured one (an
    engine that does not measure its tail keeps engine_metrics' -1). Oracle: a hand-made list of calls."""
    from hybrid_rl.loop.rollout_stage import CallTally, engine_metrics

    class Engine:
        def __init__(self, accounts):
            self.accounts = list(accounts)

        def generate(self, prompt_ids, params=None):
            self.last_generated_tokens, self.last_tail_s = self.accounts.pop(0)
            return [prompt_ids, params]

    tally = CallTally(Engine([(3, None), (5, 0.25), (None, 0.5)]))
    assert (tally.last_generated_tokens, tally.last_tail_s) == (None, None)
    assert tally.generate([[1]], params="p") == [[[1]], "p"]  # the engine's outputs, its arguments as given
    assert (tally.last_generated_tokens, tally.last_tail_s) == (3, None)
    tally.generate(prompt_ids=[[2]])
    tally.generate([[3]])
    assert (tally.last_generated_tokens, tally.last_tail_s) == (8, 0.75)
    untimed = CallTally(Engine([(2, None), (4, None)]))
    untimed.generate([[1]])
    untimed.generate([[1]])
    assert (untimed.last_generated_tokens, untimed.last_tail_s) == (6, None)
    # engine_metrics: an unmeasured tail is -1 (the documented marker), a measured one of 0 s is 0
    assert engine_metrics(untimed) == {"time/rollout_tail": -1.0, "rollout/tokens_generated": 6.0}
    assert engine_metrics(Engine([]))["time/rollout_tail"] == -1.0
    zero = Engine([(1, 0.0)])
    zero.generate([[1]])
    assert engine_metrics(zero) == {"time/rollout_tail": 0.0, "rollout/tokens_generated": 1.0}


def test_run_partial_tags_tokens_with_the_engines_version_not_the_batch_index(tiny_trainer_overrides, tiny_tokenizer):
    """A split rollout rank makes batch 5 with weights of version 3 (its schedule runs k behind): every token the
    call returns carries version 3, in the pool and in the batch's `last_token_versions`. Catches: tokens tagged with
    the batch index, which undercounts their staleness. Oracle: the version the call was made with."""
    from hybrid_rl.loop.partial import PartialRollouts

    rows = [{"prompt": "a", "ids": [5, 6]}, {"prompt": "b", "ids": [8, 9]}]
    stop = lambda ids: Completion(ids, [-0.5] * len(ids), "stop")  # noqa: E731
    cut = lambda ids: Completion(ids, [-0.5] * len(ids), "abort")  # noqa: E731
    script = {(5, 6): [stop([4, 1]), stop([7, 1])], (8, 9): [cut([4, 4]), cut([6])]}

    class Engine(ScriptedEngine):
        def generate(self, prompt_ids, params, partial=None):
            return super().generate(prompt_ids, params)

    stage = _stage(tiny_trainer_overrides, tiny_tokenizer, "rollout.partial=true", "trainer.max_staleness=4")
    pool = PartialRollouts(2, 1, 2.0, 1.0, 8, 0, rows)
    batch, m = stage.run_partial(Engine(script), pool, ListLoader([rows]), 5, StageTimer(), version=3)
    assert [r["prompt"] for r in batch.rows] == ["a"]
    assert stage.last_token_versions == [[3, 3], [3, 3]]
    (carried,) = pool.groups
    assert [s.versions for s in carried.samples] == [[3, 3], [3]]
    assert m["rollout/carried"] == 2 and m["rollout/tokens_generated"] == 0  # a scripted engine measures nothing
