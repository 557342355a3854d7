"""The critic's part of a PPO step (hybrid_rl/loop/critic_update.py): SCORE's values and TRAIN's update run the
actor's forward layout (trainer.packing) and its micro-batch cut.

The padded forward (models/value.py response_values) is the oracle of the packed one: it is pinned to a naive
per-prefix loop in tests/unit/models/test_value.py (test_values_match_the_naive_per_prefix_loop). These are
comparisons of two library paths over the same inputs, so what both read wrong (the batch's masks, its P) they
cannot see; tests/unit/test_batch.py pins those.

Legend: N sequences, G samples per prompt, P prompt columns, T response columns.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from hybrid_rl.batch import TrainBatch
from hybrid_rl.loop import critic_update as C
from hybrid_rl.loop.critic_update import CriticSettings, critic_update, score_values
from hybrid_rl.models.logprobs import build_sequences
from hybrid_rl.models.value import load_value_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")

G = 4
REAL_VALUE_FUNCTION = C.value_function  # the spies below wrap this one, not each other


@pytest.fixture(scope="module")
def critic(tiny_model_dir):
    """The tiny critic with seeded noise on every matrix, so values depend on the context (as test_value.py's)."""
    model = load_value_model(tiny_model_dir)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.15 * torch.randn(p.shape, generator=g))
    return model


def _batch(groups: int = 6, seed: int = 0):
    """G samples of each prompt (1-5 tokens), responses of 1-7 tokens (one of 7), ids 3..14."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 15) for _ in range(rng.randint(1, 5))] for _ in range(groups)]
    responses = [[rng.randrange(3, 15) for _ in range(rng.randint(1, 7))] for _ in range(groups * G)]
    responses[3] = [9] * 7
    ids, attn, mask, P = build_sequences([p for p in prompts for _ in range(G)], responses, pad_id=0)
    return ids, attn, mask.float(), P


@pytest.mark.parametrize("max_tokens", [0, 40])
def test_score_values_packed_equal_padded_in_every_micro_batch(critic, max_tokens):
    """Several micro-batches (8 rows, or a 40-token budget), packed (micro-batches of whole prompt groups, each
    distinct prompt once) against padded: the same values, 0 on padding. Catches: packed values written to the
    wrong rows of the (N, T) result, a micro-batch cut that loses rows, padding not 0."""
    ids, attn, mask, P = _batch()
    with torch.no_grad():
        padded = score_values(critic, ids, attn, P, 8, max_tokens, group_size=G, packing=False)
        packed = score_values(critic, ids, attn, P, 8, max_tokens, group_size=G, packing=True)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    assert not packed[mask == 0].any() and not padded[mask == 0].any()
    assert packed[mask != 0].std() > 0.05, "values barely vary"


def test_score_values_runs_the_layout_asked_for(critic, monkeypatch):
    """Catches: SCORE ignoring trainer.packing (the critic padded while the actor packs: twice the actor's
    forward at GRPO shapes, benchmarks/results/ppo_cpu_2026-11-28.md)."""
    ids, attn, _, P = _batch()
    asked = []
    real = REAL_VALUE_FUNCTION
    monkeypatch.setattr(C, "value_function", lambda *, packing: asked.append(packing) or real(packing=packing))
    for packing in (True, False):
        score_values(critic, ids, attn, P, 8, group_size=G, packing=packing)
    assert asked == [True, False]


def _one_update(critic, batch, packing: bool, monkeypatch, micro_batch_size: int = 8):
    """One critic_update over `batch` (24 rows: 2 mini-batches x 2 micro-batches) with plain SGD, so the step is the
    gradient itself; returns (metrics, the critic after, the forwards it ran)."""
    model = copy.deepcopy(critic)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    settings = CriticSettings(
        cliprange_value=0.2,
        grad_clip=1e9,
        loss_agg="token-mean",
        norm_length=7,
        ppo_epochs=1,
        mini_batch_size=len(batch) // 2,
        micro_batch_size=micro_batch_size,  # 8: 12-row mini-batches of 8 + 4 rows, padded or packed
        packing=packing,
    )
    ran = []
    real = REAL_VALUE_FUNCTION

    def spy(*, packing):
        def forward(model, ids, attn, P):
            ran.append((packing, ids.shape[0]))
            return real(packing=packing)(model, ids, attn, P)

        return forward

    monkeypatch.setattr(C, "value_function", spy)
    metrics = critic_update(critic=model, optimizer=opt, scheduler=sched, batch=batch, settings=settings, seed=3)
    return metrics, model, ran


def test_critic_update_packed_equals_padded(critic, monkeypatch):
    """The update with the packed forward takes the padded update's step (every parameter within 1e-5 relative in
    norm of the step) and reports its metrics. Catches: the packed path's gradients differing from the padded
    one's (a head read at the wrong slot in the backward), its micro-batches losing rows."""
    ids, attn, mask, P = _batch()
    with torch.no_grad():
        old = score_values(critic, ids, attn, P, 64, group_size=G)
    g = torch.Generator().manual_seed(0)
    returns = (old + torch.randn(old.shape, generator=g)) * mask
    batch = TrainBatch(
        ids_NL=ids,
        attn_NL=attn,
        mask_NT=mask,
        P=P,
        adv_NT=torch.zeros_like(mask),
        group_size=G,
        values_NT=old,
        returns_NT=returns,
    )
    m_pad, padded, ran_pad = _one_update(critic, batch, False, monkeypatch)
    m_pack, packed, ran_pack = _one_update(critic, batch, True, monkeypatch)
    assert ran_pad == [(False, 8), (False, 4)] * 2 and ran_pack == [(True, 8), (True, 4)] * 2
    start = dict(critic.named_parameters())
    for (n, a), (_, b) in zip(padded.named_parameters(), packed.named_parameters()):
        step = a.detach() - start[n].detach()
        rel = float((b.detach() - a.detach()).norm() / step.norm().clamp(min=1e-12))
        assert rel <= 1e-5, f"{n}: the packed step differs by {rel:.2e} of the padded one in norm"
    assert set(m_pack) == set(m_pad)
    for k in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm", "critic/vf_clipfrac"):
        assert m_pack[k] == pytest.approx(m_pad[k], rel=1e-5, abs=1e-6), k


def test_packed_micro_batches_hold_whole_prompt_groups(critic, monkeypatch):
    """micro_batch_size 6 with G = 4: packed, each 12-row mini-batch runs as three micro-batches of one whole group
    (4 rows, so its prompt runs once, as the actor's packed update cuts them); padded, as two of 6 rows. Catches:
    the critic's micro-batches cut by the padded rule while the actor packs (groups split between forwards)."""
    ids, attn, mask, P = _batch()
    with torch.no_grad():
        old = score_values(critic, ids, attn, P, 64, group_size=G)
    batch = TrainBatch(
        ids_NL=ids, attn_NL=attn, mask_NT=mask, P=P, adv_NT=mask * 0, group_size=G, values_NT=old, returns_NT=old + 1
    )
    _, _, ran_pack = _one_update(critic, batch, True, monkeypatch, micro_batch_size=6)
    _, _, ran_pad = _one_update(critic, batch, False, monkeypatch, micro_batch_size=6)
    assert ran_pack == [(True, 4)] * 6
    assert ran_pad == [(False, 6)] * 4
