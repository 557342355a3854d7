"""An episode reaches the loss as one sequence whose mask has holes (its observation tokens): every part of the
update must train exactly the generated tokens. Each case runs the real path (RolloutBatch.build with loss masks ->
advantage_stage -> policy_update, padded and packed, the shared-prefix layout of a group) and compares the
gradient with a naive per-episode loop that scores each episode unpadded and sums over its generated tokens only.

Catches: observation tokens in resp_mask_NT (batch.py built from the attention mask), an aggregation that counts
observation tokens in an episode's length, a KL or correction weight applied under the holes, a mismatch metric
taken over observation tokens (whose engine log-prob is a 0.0 placeholder).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybrid_rl.algorithms.kl import kl_estimate
from hybrid_rl.batch import RolloutBatch
from hybrid_rl.config.schema import AlgorithmConfig
from hybrid_rl.loop.advantage_stage import advantage_stage
from hybrid_rl.loop.update import UpdateSettings, policy_update, score_logprobs
from hybrid_rl.types import Completion

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = [[4, 5, 6], [7, 8]]  # B = 2 rows, G = 2 episodes each
# (response tokens, loss mask): 0 = an observation token (never sampled), 1 = generated
EPISODES = [
    ([9, 10, 11, 12, 13], [1, 1, 0, 0, 1]),
    ([9, 14], [1, 1]),
    ([5, 6, 7, 8, 9, 10], [1, 0, 0, 1, 1, 0]),
    ([4, 12, 13], [1, 0, 1]),
]
REWARDS = [1.0, 0.0, 0.2, 0.9]
NORM_LENGTH = 8


def _naive_adv() -> list[float]:
    """GRPO's advantages of REWARDS by hand, group by group (G = 2): (r - mean) / (unbiased std + 1e-6)."""
    out = []
    for g in range(0, len(REWARDS), 2):
        a, b = REWARDS[g : g + 2]
        std = abs(a - b) / 2**0.5  # two samples: sqrt(((a - m)^2 + (b - m)^2) / 1)
        out += [(a - (a + b) / 2) / (std + 1e-6), (b - (a + b) / 2) / (std + 1e-6)]
    return out


def _batch(engine_logp=None) -> RolloutBatch:
    comps = [
        Completion(ids, list(engine_logp[i]) if engine_logp else [-1.0] * len(ids), "stop")
        for i, (ids, _) in enumerate(EPISODES)
    ]
    r = torch.tensor(REWARDS)
    return RolloutBatch.build(
        [{"prompt": "a"}, {"prompt": "b"}],
        PROMPTS,
        comps,
        2,
        r,
        r.clone(),
        0,
        torch.device("cpu"),
        loss_masks=[m for _, m in EPISODES],
    )


def _naive_grads(model, adv, algo: AlgorithmConfig, ref_logp=None, weights=None) -> dict[str, torch.Tensor]:
    """The loss by hand: each episode scored alone (no padding), summed over its generated tokens only."""
    model = copy.deepcopy(model)
    per_row, n_gen = [], []
    for i, (ids, mask) in enumerate(EPISODES):
        p = PROMPTS[i // 2]
        logits = model(input_ids=torch.tensor([p + ids])).logits[0].float()
        logp = torch.log_softmax(logits[len(p) - 1 : -1], -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        terms = []
        for t, m in enumerate(mask):
            if not m:
                continue  # the observation: no term at all
            lt = -adv[i] * torch.exp(logp[t] - logp[t].detach()) * (weights[i][t] if weights else 1.0)
            if ref_logp is not None:
                lt = lt + algo.kl_coef * kl_estimate(logp[t : t + 1], ref_logp[i][t : t + 1], algo.kl_estimator)[0]
            terms.append(lt)
        per_row.append(torch.stack(terms).sum())
        n_gen.append(len(terms))
    agg = algo.loss_agg
    if agg == "token-mean":
        loss = sum(per_row) / sum(n_gen)
    elif agg == "seq-mean-token-mean":
        loss = sum(s / n for s, n in zip(per_row, n_gen)) / len(per_row)
    elif agg == "seq-mean-token-sum":
        loss = sum(per_row) / len(per_row)
    else:
        loss = sum(per_row) / (len(per_row) * NORM_LENGTH)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _update_grads(model, train_batch, algo: AlgorithmConfig, packing: bool, micro: int):
    """The gradient policy_update applies: one SGD step of lr 1 without clipping moves each weight by -grad."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    settings = UpdateSettings(
        algo=algo, temperature=1.0, micro_batch_size=micro, grad_clip=1e9, norm_length=NORM_LENGTH, packing=packing
    )
    metrics = policy_update(policy=model, optimizer=opt, scheduler=sched, batch=train_batch, settings=settings, seed=0)
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}, metrics


def _assert_close(got, want):
    for n in want:
        err = (got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-12)
        assert err < 1e-4, f"{n}: relative error {err:.2e}"


def _holes_are_masked(train_batch):
    for i, (_, mask) in enumerate(EPISODES):
        T = len(mask)
        assert train_batch.mask_NT[i, :T].tolist() == [float(m) for m in mask]
        assert train_batch.mask_NT[i, T:].abs().sum() == 0
        assert train_batch.attn_NL[i, train_batch.P : train_batch.P + T].tolist() == [1] * T  # observations attended


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("packing,micro", [(False, 4), (True, 4), (True, 1)])
def test_the_update_trains_generated_tokens_only(tiny_model, loss_agg, packing, micro):
    algo = AlgorithmConfig(loss_agg=loss_agg)
    batch = _batch()
    train_batch, _ = advantage_stage(batch, None, None, 0.0, algo)
    _holes_are_masked(train_batch)
    adv = _naive_adv()  # by hand, not read back from the batch: a wrong advantage must not cancel out
    hand_mask = torch.tensor([[float(m) for m in mask] + [0.0] * (6 - len(mask)) for _, mask in EPISODES])
    torch.testing.assert_close(train_batch.adv_NT * hand_mask, torch.tensor(adv)[:, None] * hand_mask)
    assert (train_batch.adv_NT * (1 - hand_mask)).abs().sum() == 0, "advantage under an observation"
    got, _ = _update_grads(tiny_model, train_batch, algo, packing, micro)
    _assert_close(got, _naive_grads(tiny_model, adv, algo))


@pytest.mark.parametrize("packing", [False, True])
def test_kl_in_the_loss_and_tis_weights_skip_the_holes(tiny_model, packing):
    """KL to a reference and TIS weights: both enter on generated tokens only; the engine's 0.0 placeholder
    under an observation must not reach the weights or the mismatch metric."""
    algo = AlgorithmConfig(kl_coef=0.1, kl_estimator="k3", rollout_correction="tis_token", correction_cap=2.0)
    P = max(len(p) for p in PROMPTS)
    ids = _batch()
    old = score_logprobs(tiny_model, ids.ids_NL, ids.attn_NL, ids.P, 1.0, 4)
    g = torch.Generator().manual_seed(0)
    # the engine's log-probs: near the trainer's on generated tokens, the runner's 0.0 on observation tokens
    engine = [
        [(old[i, t].item() + 0.3 * torch.randn((), generator=g).item()) if m else 0.0 for t, m in enumerate(mask)]
        for i, (_, mask) in enumerate(EPISODES)
    ]
    batch = _batch(engine)
    ref = old + 0.5 * torch.randn(old.shape, generator=g)
    train_batch, _ = advantage_stage(batch, old, ref, algo.kl_coef, algo)
    _holes_are_masked(train_batch)
    weights = [
        [min(2.0, float(torch.exp(old[i, t] - engine[i][t]))) if m else 0.0 for t, m in enumerate(mask)]
        for i, (_, mask) in enumerate(EPISODES)
    ]
    adv = _naive_adv()
    got, metrics = _update_grads(tiny_model, train_batch, algo, packing, 4)
    _assert_close(got, _naive_grads(tiny_model, adv, algo, ref_logp=[ref[i] for i in range(4)], weights=weights))
    gen = [(i, t) for i, (_, mask) in enumerate(EPISODES) for t, m in enumerate(mask) if m]
    mismatch = sum(abs(old[i, t].item() - engine[i][t]) for i, t in gen) / len(gen)
    assert metrics["rollout/logp_mismatch"] == pytest.approx(mismatch, rel=1e-4)
    assert P == 3


def test_batch_refuses_a_mask_of_the_wrong_length():
    r = torch.zeros(2)
    with pytest.raises(ValueError, match="loss mask"):
        RolloutBatch.build(
            [{}],
            [[4]],
            [Completion([5, 6], [0.0, 0.0], "stop")] * 2,
            2,
            r,
            r,
            0,
            torch.device("cpu"),
            loss_masks=[[1], [1, 0]],
        )
