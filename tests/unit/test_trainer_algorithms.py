"""The algorithm keys reach the Trainer: KL placement and controller, rollout correction,
entropy bonus, DAPO dynamic sampling / overlong shaping, epochs x mini-batches, and the temperature
SCORE takes the old-policy log-probs at.

Each test predicts a number from the pure functions in hybrid_rl/algorithms and checks
the Trainer (or the sampler) produces it. The inputs of a prediction come from outside the code under test:
the loss mask from the completions' token lists (`_naive_mask`), the old policy's log-probs from the engine
that sampled the tokens, the reference's from a forward of each sequence alone (`_naive_logprobs`); never from
the batch the Trainer built, whose mask would carry its own bug into the expectation. One process, a tiny
model, one thread.
"""

from __future__ import annotations

import math

import pytest
import torch

import hybrid_rl.loop.update as update_mod
import hybrid_rl.trainer as trainer_mod
from hybrid_rl.algorithms import grpo_advantages, kl_estimate, kl_penalty_rewards, overlong_penalty
from hybrid_rl.config.load import load_config
from hybrid_rl.loop.dynamic_sampling import GroupCollector
from hybrid_rl.rewards.base import register_reward
from hybrid_rl.runtime import distributed as D
from hybrid_rl.trainer import Trainer
from hybrid_rl.types import Completion

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@register_reward("test_constant_half")
def _constant_reward(prompts, completions, metadata):
    return [0.5] * len(completions)


def _trainer(overrides, *extra) -> Trainer:
    return Trainer(load_config(None, [*overrides, *extra]))


def _capture(monkeypatch, target, name):
    """Wrap target.name so every call's arguments and result are recorded (and the real function still runs).

    Each record is (kwargs, result): tests read arguments by name, never by position, so a
    reordered signature cannot make a test read the wrong argument (a missing name is a KeyError).
    """
    calls = []
    real = getattr(target, name)

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((kwargs, out))
        return out

    monkeypatch.setattr(target, name, spy)
    return calls


def _rollouts(monkeypatch, trainer: Trainer) -> list:
    """Record every RolloutBatch the trainer's ROLLOUT stage returns."""
    seen = []
    real = trainer.rollout_stage.run

    def spy(*args, **kwargs):
        batch, metrics = real(*args, **kwargs)
        seen.append(batch)
        return batch, metrics

    monkeypatch.setattr(trainer.rollout_stage, "run", spy)
    return seen


def _naive_mask(completions, T: int, drop_truncated: bool = False) -> torch.Tensor:
    """(N, T) 1.0 on each completion's own tokens (its stop token included), from the token lists alone."""
    rows = []
    for c in completions:
        keep = not (drop_truncated and c.finish_reason == "length")
        rows.append([1.0 if keep and t < len(c.token_ids) else 0.0 for t in range(T)])
    return torch.tensor(rows)


@torch.no_grad()
def _naive_logprobs(model, prompt_ids, completions, G: int, T: int) -> torch.Tensor:
    """(N, T) log-probs of each completion's tokens, each sequence run alone (no padding, no batch), 0 after."""
    out = torch.zeros(len(completions), T)
    for i, c in enumerate(completions):
        if not c.token_ids:
            continue
        p = prompt_ids[i // G]
        logits = model(input_ids=torch.tensor([p + c.token_ids])).logits[0].float()
        lp = torch.log_softmax(logits[len(p) - 1 : -1], -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        out[i, : len(lp)] = lp
    return out


def _perturb_ref(trainer: Trainer, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.ref.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _shift_engine_logprobs(trainer: Trainer, delta: float) -> None:
    """The engine reports logprobs shifted by delta: a fake engine/trainer mismatch."""
    real = trainer.engine.generate

    def generate(prompt_ids, params):
        out = real(prompt_ids, params)
        return [Completion(c.token_ids, [lp + delta for lp in c.logprobs], c.finish_reason) for c in out]

    trainer.engine.generate = generate


# ---------------------------------------------------------------------------- KL
def test_kl_in_reward_changes_advantages_as_kl_penalty_rewards_says(tiny_trainer_overrides, monkeypatch):
    coef = 0.5
    tr = _trainer(tiny_trainer_overrides, "rollout.n=4", "algorithm.kl_placement=reward", f"algorithm.kl_coef={coef}")
    assert tr.ref is not None
    _perturb_ref(tr)
    rollouts = _rollouts(monkeypatch, tr)
    updates = _capture(monkeypatch, trainer_mod, "policy_update")
    m = tr.step()
    batch, rollout = updates[0][0]["batch"], rollouts[0]
    scores, comps = rollout.scores_N, rollout.completions
    T = batch.mask_NT.shape[1]
    # Independent inputs: the mask from the token lists, pi_old from the engine that sampled them (on-policy,
    # the same weights; a different code path), the reference from each sequence run alone.
    mask = _naive_mask(comps, T)
    assert torch.equal(batch.mask_NT, mask)
    old = torch.tensor([c.logprobs + [0.0] * (T - len(c.logprobs)) for c in comps])
    ref = _naive_logprobs(tr.ref, rollout.prompt_ids, comps, 4, T)
    kl_NT = kl_estimate(old, ref, "k3", mask_NT=mask)
    assert kl_NT.sum() > 1e-3, "the perturbed reference must give a measurable KL"
    group_ids = torch.arange(len(scores)) // 4
    want = grpo_advantages(kl_penalty_rewards(scores, kl_NT, mask, coef), group_ids)
    torch.testing.assert_close(batch.adv_NT, want[:, None] * mask, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(want, grpo_advantages(scores, group_ids), atol=1e-3)
    assert m["reward/kl_penalty"] == pytest.approx(coef * kl_NT.sum().item() / len(scores), rel=1e-4)
    assert m["actor/kl_coef"] == coef and "actor/kl_loss" not in m, "the KL is in the reward, not the loss"


def test_kl_in_loss_and_no_reference_without_kl(tiny_trainer_overrides):
    m = _trainer(tiny_trainer_overrides, "algorithm.kl_coef=0.1").step()
    assert "actor/kl_loss" in m and "reward/kl_penalty" not in m and m["actor/kl_coef"] == 0.1
    for extra in (["algorithm.kl_coef=0.1", "algorithm.kl_placement=none"], ["algorithm.kl_coef=0"]):
        tr = _trainer(tiny_trainer_overrides, *extra)
        m = tr.step()
        assert tr.ref is None and "actor/kl_ref" not in m and "actor/kl_loss" not in m


def test_adaptive_kl_controller_follows_the_measured_kl(tiny_trainer_overrides):
    coef, target, horizon = 0.2, 1e-4, 40
    tr = _trainer(
        tiny_trainer_overrides,
        "algorithm.kl_placement=reward",
        f"algorithm.kl_coef={coef}",
        "algorithm.kl_controller=adaptive",
        f"algorithm.target_kl={target}",
        f"algorithm.kl_horizon={horizon}",
    )
    _perturb_ref(tr)
    m1, m2 = tr.step(), tr.step()
    n_seq = 4 * 2  # data.batch_size x rollout.n
    err = min(max(m1["actor/kl_ref"] / target - 1, -0.2), 0.2)
    assert m1["actor/kl_coef"] == coef
    assert m2["actor/kl_coef"] == pytest.approx(coef * (1 + err * n_seq / horizon), rel=1e-6)
    assert m2["actor/kl_coef"] > coef, "KL above target: the coefficient must grow"


# ---------------------------------------------------------------------------- rollout correction
@pytest.mark.parametrize(
    "mode,ratio,cap,grad_scale",
    [
        ("tis_token", 1.5, 2.0, 1.5),
        ("tis_token", 3.0, 2.0, 2.0),
        ("tis_seq", 1.25, 100.0, None),
        ("mis_token", 3.0, 2.0, 0.0),
    ],
)
def test_rollout_correction_weights_reach_the_gradient(tiny_trainer_overrides, mode, ratio, cap, grad_scale):
    """The engine claims every sampled token is `ratio` times less likely than the trainer computes.

    tis_token: weight min(ratio, cap) on every token, so the (pre-clip) gradient norm scales by it.
    tis_seq: weight min(ratio^len_i, cap) per sequence. mis_token: ratio > cap drops every token.
    """
    base = _trainer(tiny_trainer_overrides, "algorithm.rollout_correction=none").step()
    tr = _trainer(tiny_trainer_overrides, f"algorithm.rollout_correction={mode}", f"algorithm.correction_cap={cap}")
    _shift_engine_logprobs(tr, -math.log(ratio))
    m = tr.step()
    assert m["rollout/mismatch_abs_logp_mean"] == pytest.approx(math.log(ratio), rel=1e-4)
    assert base["reward/mean"] == m["reward/mean"], "same seed, same rollouts"
    if grad_scale is not None:
        assert m["actor/grad_norm"] == pytest.approx(grad_scale * base["actor/grad_norm"], rel=1e-4, abs=1e-9)
    else:
        assert m["actor/grad_norm"] > 1.2 * base["actor/grad_norm"]
    capped = 1.0 if (mode == "tis_token" and ratio > cap) else 0.0
    assert m["rollout/mismatch_frac_capped"] == pytest.approx(capped)
    assert m["rollout/mismatch_frac_masked"] == pytest.approx(1.0 if mode.startswith("mis") else 0.0)


# ---------------------------------------------------------------------------- entropy bonus, epochs
def test_entropy_bonus_gradient_is_linear_in_its_coefficient(tiny_trainer_overrides):
    # A constant reward gives zero advantages: the only gradient left is the entropy bonus.
    norms = []
    for coef in (0.0, 0.1, 0.2):
        m = _trainer(tiny_trainer_overrides, "reward.name=test_constant_half", f"algorithm.entropy_coef={coef}").step()
        norms.append(m["actor/grad_norm"])
    assert norms[0] == 0.0 and norms[1] > 0
    assert norms[2] == pytest.approx(2 * norms[1], rel=1e-4)


def test_epochs_and_mini_batches_score_old_logprobs_once(tiny_trainer_overrides, monkeypatch):
    scores = _capture(monkeypatch, trainer_mod, "score_logprobs")
    tr = _trainer(tiny_trainer_overrides, "algorithm.ppo_epochs=2", "algorithm.mini_batch_size=4")
    m = tr.step()
    assert len(scores) == 1, "old-policy logprobs are computed once per step, before the first epoch"
    assert tr.scheduler.last_epoch == 2 * 2, "optimizer steps: 2 epochs x (8 sequences / mini-batches of 4)"
    assert m["actor/ratio_max"] > m["actor/ratio_min"], "later mini-batches are off-policy w.r.t. the old logprobs"


def test_scoring_uses_the_sampling_temperature(tiny_trainer_overrides):
    """Catches SCORE computing the old-policy log-probs at temperature 1.0 instead of
    rollout.temperature: they must equal the engine's sampled-token log-probs, which are
    taken at the sampling temperature (the recipe runs at 1.0, where the two agree)."""
    # Two mini-batches: the update is off-policy, so SCORE runs the policy forward.
    m = _trainer(tiny_trainer_overrides, "rollout.temperature=0.5", "algorithm.mini_batch_size=4").step()
    assert m["rollout/logp_mismatch"] < 1e-5, "old-policy log-probs and the engine's must agree in fp32"


def test_ratio_extremes_are_the_steps_not_a_mean_of_micro_batches(tiny_trainer_overrides, monkeypatch):
    """actor/ratio_max and _min are what an off-policy blow-up shows in: the max / min over every
    micro-batch of the step, not a token-weighted mean of each micro-batch's extreme."""
    losses = _capture(monkeypatch, update_mod, "compute_policy_loss")
    m = _trainer(
        tiny_trainer_overrides, "algorithm.ppo_epochs=2", "algorithm.mini_batch_size=4", "trainer.micro_batch_size=2"
    ).step()
    highs = [pm["ratio_max"].item() for _, (_, pm) in losses]
    lows = [pm["ratio_min"].item() for _, (_, pm) in losses]
    assert len(highs) >= 4 and len(set(highs)) > 1, "the check needs micro-batches with different extremes"
    assert m["actor/ratio_max"] == pytest.approx(max(highs), rel=1e-6)
    assert m["actor/ratio_min"] == pytest.approx(min(lows), rel=1e-6)


def test_cispo_gets_no_lower_clip_bound_by_default(tiny_trainer_overrides, monkeypatch):
    losses = _capture(monkeypatch, update_mod, "compute_policy_loss")
    _trainer(tiny_trainer_overrides, "algorithm.policy_loss=cispo").step()
    assert losses and all(kw["clip_ratio_low"] is None and kw["clip_ratio_high"] == 0.2 for kw, _ in losses)


# ---------------------------------------------------------------------------- DAPO overlong
def test_overlong_filter_and_soft_penalty(tiny_trainer_overrides, monkeypatch):
    updates = _capture(monkeypatch, trainer_mod, "policy_update")
    tr = _trainer(
        tiny_trainer_overrides,
        "algorithm.overlong_filter=true",
        "algorithm.overlong_penalty_factor=0.5",
        "algorithm.overlong_buffer_len=2",
        "data.batch_size=8",
    )
    rollouts = _rollouts(monkeypatch, tr)
    m = tr.step()
    s, batch = rollouts[0], updates[0][0]["batch"]
    truncated = torch.tensor([c.finish_reason == "length" for c in s.completions])
    assert 0 < truncated.sum() < len(truncated), "a random policy truncates some completions, not all"
    assert torch.equal(batch.mask_NT.sum(1) == 0, truncated), "exactly the truncated rows leave the loss"
    assert torch.equal(batch.mask_NT, _naive_mask(s.completions, batch.mask_NT.shape[1], drop_truncated=True))
    kept_tokens = sum(len(c.token_ids) for c in s.completions if c.finish_reason != "length")
    assert m["response/loss_tokens"] == kept_tokens / len(s.completions)
    lengths = torch.tensor([len(c.token_ids) for c in s.completions])
    torch.testing.assert_close(s.scores_N - s.rewards_N, overlong_penalty(lengths, 4, 2, 0.5))
    assert m["response/overlong_filtered"] == pytest.approx(truncated.float().mean().item())
    assert m["reward/overlong_penalty"] == pytest.approx(overlong_penalty(lengths, 4, 2, 0.5).mean().item(), abs=1e-6)


def test_the_loss_trains_each_completions_own_tokens(tiny_trainer_overrides, monkeypatch):
    """Catches: the single-turn loss mask shifted by a token (every completion shorter than the batch's longest
    then also trains the pad after its stop token, with its advantage and a larger token-mean denominator):
    the mask and `response/loss_tokens` are compared with the completions' token lists, exactly."""
    updates = _capture(monkeypatch, trainer_mod, "policy_update")
    tr = _trainer(tiny_trainer_overrides, "data.batch_size=8", "rollout.max_new_tokens=8")
    rollouts = _rollouts(monkeypatch, tr)
    m = tr.step()
    comps, batch = rollouts[0].completions, updates[0][0]["batch"]
    lengths = [len(c.token_ids) for c in comps]
    assert min(lengths) < max(lengths) == batch.mask_NT.shape[1], "the test needs rows shorter than the longest"
    assert torch.equal(batch.mask_NT, _naive_mask(comps, max(lengths)))
    assert m["response/loss_tokens"] == sum(lengths) / len(comps)
    assert m["response/length"] == sum(lengths) / len(comps)


def test_overlong_buffer_longer_than_the_generation_is_refused(tiny_trainer_overrides):
    with pytest.raises(ValueError, match=r"'algorithm\.overlong_buffer_len'.*max_new_tokens=4"):
        _trainer(tiny_trainer_overrides, "algorithm.overlong_buffer_len=5")


# ---------------------------------------------------------------------------- dynamic sampling (sampler)
class _FakeRollout:
    """Prompts numbered 0, 1, 2, ...; a prompt is informative (its G rewards differ) iff informative(id)."""

    def __init__(self, per_batch: int, G: int, informative):
        self.per_batch, self.G, self.informative = per_batch, G, informative
        self.next_id, self.rounds_seen = 0, []

    def next_rows(self):
        rows = [{"id": self.next_id + i} for i in range(self.per_batch)]
        self.next_id += self.per_batch
        return rows

    def generate(self, rows, round_idx):
        self.rounds_seen.append(round_idx)
        return [Completion([r["id"], k], [0.0, 0.0], "stop") for r in rows for k in range(self.G)]

    def score(self, rows, completions):
        r = torch.tensor([float(c.token_ids[1] % 2) if self.informative(c.token_ids[0]) else 1.0 for c in completions])
        return r, r


def _sample(fake, dynamic=True, max_rounds=5):
    """Drive a GroupCollector the way Trainer._rollout does; the kept groups with .metrics attached."""
    groups = GroupCollector(fake.G, dynamic, max_rounds)
    while True:
        rows = fake.next_rows()
        completions = fake.generate(rows, groups.rounds)
        rewards, scores = fake.score(rows, completions)
        groups.add(rows, [[r["id"]] for r in rows], completions, rewards, scores)
        if not groups.need_another_round():
            break
    kept, metrics = groups.finish()
    kept.metrics = metrics
    return kept


def test_dynamic_sampling_keeps_only_informative_groups():
    fake = _FakeRollout(per_batch=4, G=3, informative=lambda i: i % 3 == 0)  # 4/3 informative per round
    out = _sample(fake)
    assert [r["id"] for r in out.rows] == [0, 3, 6, 9], "the first 4 informative prompts, in order"
    assert fake.rounds_seen == [0, 1, 2], "stops as soon as the batch is full; one round index (seed) per round"
    assert [c.token_ids[0] for c in out.completions] == [i for i in (0, 3, 6, 9) for _ in range(3)]
    for b in range(4):
        assert out.scores_N[3 * b : 3 * b + 3].unique().numel() > 1
    assert [p[0] for p in out.prompt_ids] == [0, 3, 6, 9], "prompt ids travel with their rows"
    # Reward metrics cover all 36 completions generated: 8 filtered groups of 1.0, 4 groups of (0, 1, 0).
    assert out.metrics["reward/mean"] == pytest.approx((8 * 3 + 4 * 1) / 36)
    assert out.metrics["response/length"] == 2.0
    assert out.metrics["sampling/rounds"] == 3 and out.metrics["sampling/groups_generated"] == 12
    assert out.metrics["sampling/groups_filtered"] == 8 and out.metrics["sampling/groups_kept"] == 4
    assert out.metrics["sampling/groups_surplus"] == 0 and out.metrics["sampling/batch_fill"] == 1.0


def test_dynamic_sampling_respects_max_rounds_and_never_pads():
    fake = _FakeRollout(per_batch=4, G=2, informative=lambda i: i % 5 == 0)  # ids 0, 5 in two rounds
    out = _sample(fake, max_rounds=2)
    assert fake.rounds_seen == [0, 1] and out.metrics["sampling/rounds"] == 2
    assert [r["id"] for r in out.rows] == [0, 5], "trains on fewer groups rather than on uninformative ones"
    assert out.metrics["sampling/batch_fill"] == 0.5
    nothing = _sample(_FakeRollout(4, 2, informative=lambda i: False), max_rounds=3)
    assert nothing.rows == [] and nothing.completions == [] and nothing.metrics["sampling/rounds"] == 3


def test_without_dynamic_sampling_every_group_is_kept_after_one_round():
    fake = _FakeRollout(per_batch=4, G=2, informative=lambda i: i == 1)
    out = _sample(fake, dynamic=False)
    assert [r["id"] for r in out.rows] == [0, 1, 2, 3] and fake.rounds_seen == [0]


def test_surplus_groups_beyond_the_batch_are_dropped():
    fake = _FakeRollout(per_batch=4, G=2, informative=lambda i: i % 4 != 0)  # 3 per round
    out = _sample(fake)
    assert [r["id"] for r in out.rows] == [1, 2, 3, 5] and out.metrics["sampling/groups_surplus"] == 2


def _two_rank_sampler(rank: int):
    D.init("cpu", timeout_s=60)
    # Rank 0 finds an informative group in every prompt, rank 1 in one prompt of four.
    fake = _FakeRollout(per_batch=4, G=2, informative=(lambda i: True) if rank == 0 else (lambda i: i % 4 == 0))
    out = _sample(fake, max_rounds=3)
    return [r["id"] for r in out.rows], fake.rounds_seen, out.metrics


@pytest.mark.slow
def test_ranks_agree_on_rounds_and_on_the_number_of_groups():
    from tests.distributed.launch import run_ranks

    (rows0, rounds0, m0), (rows1, rounds1, m1) = run_ranks(_two_rank_sampler, world=2, timeout=120)
    assert rounds0 == rounds1 == [0, 1, 2], "a full rank keeps generating while another still needs groups"
    assert rows1 == [0, 4, 8] and rows0 == [0, 1, 2], "both truncate to the smallest count (3 groups)"
    assert m0 == m1 and m0["sampling/groups_kept"] == 6 and m0["sampling/groups_surplus"] == (12 - 3) + (3 - 3)


# ---------------------------------------------------------------------------- dynamic sampling (trainer)
def test_trainer_dynamic_sampling_trains_only_on_informative_groups(tiny_trainer_overrides, monkeypatch):
    updates = _capture(monkeypatch, trainer_mod, "policy_update")
    tr = _trainer(
        tiny_trainer_overrides, "rollout.n=4", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=4"
    )
    m = tr.step()
    batch = updates[0][0]["batch"]
    adv_BG = batch.adv_NT[:, 0].view(-1, 4)  # every completion has a first token
    assert (adv_BG.abs().sum(1) > 0).all(), "every trained group has non-equal rewards (non-zero advantages)"
    assert len(batch) == 4 * m["sampling/groups_kept"] and m["sampling/rounds"] >= 1
    assert m["sampling/groups_generated"] == 4 * m["sampling/rounds"]


def test_trainer_skips_the_update_when_no_group_is_informative(tiny_trainer_overrides):
    tr = _trainer(
        tiny_trainer_overrides,
        "reward.name=test_constant_half",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_sampling_rounds=3",
    )
    before = {n: p.detach().clone() for n, p in tr.policy.named_parameters()}
    m = tr.step()
    assert m["sampling/rounds"] == 3 and m["sampling/groups_kept"] == 0 and m["sampling/groups_filtered"] == 12
    assert "actor/grad_norm" not in m and m["reward/mean"] == 0.5
    assert tr.state.loader.cursor == 3 * 4, "three rounds drew three batches of prompts"
    assert all(torch.equal(p, before[n]) for n, p in tr.policy.named_parameters())
    assert tr.step()["step"] == 2, "the phase cycle is intact after a skipped update"
