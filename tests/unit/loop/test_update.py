"""The policy update (hybrid_rl/loop/update.py `policy_update`): what an entropy bonus, mini-batches and
epochs do to the step, and the mini-batch shuffle the trainer seeds per step.

Each test fails under a specific, plausible bug that the rest of the suite let through (its
docstring names it). One process, a tiny model, one thread; each test runs in seconds.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hybrid_rl.loop.update as update_mod
from hybrid_rl.batch import TrainBatch
from hybrid_rl.config.load import load_config
from hybrid_rl.config.schema import AlgorithmConfig
from hybrid_rl.loop.update import UpdateSettings, policy_update
from hybrid_rl.models.logprobs import build_sequences, response_logprobs
from hybrid_rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _trainer(overrides, *extra) -> Trainer:
    return Trainer(load_config(None, [*overrides, *extra]))


def _batch(n_rows: int, same_rows: bool = False, seed: int = 0):
    """A fixed batch of prompts and responses (token ids 4..14 are the digits and '=')."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 15, (2 + i % 3,), generator=g).tolist() for i in range(n_rows)]
    responses = [torch.randint(4, 15, (1 + i % 4,), generator=g).tolist() for i in range(n_rows)]
    if same_rows:
        prompts, responses = [prompts[0]] * n_rows, [[5, 6, 7]] * n_rows
    ids, attn, mask, P = build_sequences(prompts, responses, pad_id=0)
    return ids, attn, mask.float(), P


def _update(model, batch, adv_N, *, lr: float, algo: AlgorithmConfig, seed: int = 0, optimizer=None):
    ids, attn, mask, P = batch
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tb = TrainBatch(ids_NL=ids, attn_NL=attn, mask_NT=mask, P=P, adv_NT=adv_N[:, None] * mask)
    settings = UpdateSettings(algo=algo, temperature=1.0, micro_batch_size=64, grad_clip=1e9, norm_length=4)
    return policy_update(policy=model, optimizer=opt, scheduler=sched, batch=tb, settings=settings, seed=seed)


def _mean_entropy(model, batch) -> float:
    ids, attn, mask, P = batch
    with torch.no_grad():
        _, ent = response_logprobs(model, ids, attn, P)
    return ((ent * mask).sum() / mask.sum()).item()


def _mini_batch_orders(monkeypatch, run) -> list[list[int]]:
    """Rows of every micro-batch `policy_update` trains on during run() (one micro-batch per mini-batch)."""
    seen = []
    real = update_mod.trimmed

    def spy(b, rows):
        seen.append(rows.tolist())
        return real(b, rows)

    monkeypatch.setattr(update_mod, "trimmed", spy)
    run()
    return seen


# ---------------------------------------------------------------------------- entropy bonus
def test_entropy_bonus_raises_the_entropy(tiny_model):
    """Catches the entropy bonus with the wrong sign (loss + coef * entropy): the gradient norm
    is the same either way, so only the direction of the step tells them apart."""
    batch = _batch(6)
    before = _mean_entropy(tiny_model, batch)
    zero_adv = torch.zeros(6)  # the only gradient left is the entropy term's
    bonus = copy.deepcopy(tiny_model)
    _update(bonus, batch, zero_adv, lr=1e-2, algo=AlgorithmConfig(kl_coef=0.0, entropy_coef=0.5))
    assert _mean_entropy(bonus, batch) > before + 1e-4, "an entropy bonus must make the policy less certain"


# ---------------------------------------------------------------------------- mini-batches and epochs
def test_every_mini_batch_starts_from_a_zero_gradient(tiny_model):
    """Catches gradients accumulating across mini-batches (zero_grad missing in the mini-batch loop):
    with identical rows every mini-batch has the same gradient, and an optimizer with lr=0 keeps
    the weights fixed, so each optimizer step must see exactly one mini-batch's gradient."""
    adv = torch.full((8,), 0.7)
    batch = _batch(8, same_rows=True)
    algo = AlgorithmConfig(kl_coef=0.0, mini_batch_size=2)  # 4 mini-batches of 2 identical rows
    one = copy.deepcopy(tiny_model)
    half = tuple(t[:2] for t in batch[:3]) + (batch[3],)
    m_one = _update(
        one,
        half,
        adv[:2],
        lr=0.0,
        algo=AlgorithmConfig(kl_coef=0.0),
        optimizer=torch.optim.SGD(one.parameters(), lr=0.0),
    )
    many = copy.deepcopy(tiny_model)
    m_many = _update(many, batch, adv, lr=0.0, algo=algo, optimizer=torch.optim.SGD(many.parameters(), lr=0.0))
    assert m_one["actor/grad_norm"] > 1e-4
    assert m_many["actor/grad_norm"] == pytest.approx(m_one["actor/grad_norm"], rel=1e-4)
    for (n, p), q in zip(many.named_parameters(), one.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{n}: {m}")


def test_each_epoch_reshuffles_the_mini_batches(tiny_model, monkeypatch):
    """Catches the mini-batch permutation being redrawn from the same seed every epoch (so every
    epoch visits the mini-batches in the same order, with the same composition)."""
    batch = _batch(8)
    algo = AlgorithmConfig(kl_coef=0.0, ppo_epochs=3, mini_batch_size=2)
    calls = _mini_batch_orders(monkeypatch, lambda: _update(tiny_model, batch, torch.randn(8), lr=1e-3, algo=algo))
    assert len(calls) == 3 * 4
    epochs = [sum(calls[4 * e : 4 * e + 4], []) for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(8)), "each epoch visits every row once"
    assert len({tuple(o) for o in epochs}) == 3, "every epoch draws a new order"


def test_each_step_draws_its_own_mini_batch_order(tiny_trainer_overrides, monkeypatch):
    """Catches policy_update getting the same shuffle seed every step (trainer.seed without the step
    index): then every step splits its batch into mini-batches the same way."""
    tr = _trainer(
        tiny_trainer_overrides, "algorithm.mini_batch_size=2", "trainer.micro_batch_size=2", "trainer.total_steps=2"
    )
    calls = _mini_batch_orders(monkeypatch, lambda: (tr.step(), tr.step()))
    assert len(calls) == 2 * 4
    first, second = sum(calls[:4], []), sum(calls[4:], [])
    assert sorted(first) == sorted(second) == list(range(8))
    assert first != second, "the mini-batch shuffle must change from step to step"
