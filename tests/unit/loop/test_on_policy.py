"""On-policy updates skip the scoring forward of the policy: same step, one forward less."""

from __future__ import annotations

import copy

import pytest
import torch

from hybrid_rl.algorithms.aggregation import LOSS_AGG_MODES
from hybrid_rl.batch import TrainBatch
from hybrid_rl.config.schema import AlgorithmConfig
from hybrid_rl.loop.update import UpdateSettings, is_on_policy, policy_update, score_logprobs, scores_old_policy
from hybrid_rl.models.logprobs import build_sequences


def _step(model, batch_kwargs, old_from_scoring: bool):
    ids, attn, mask, P, adv = batch_kwargs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    old = score_logprobs(model, ids, attn, P, 1.0, micro_batch_size=3) if old_from_scoring else None
    algo = AlgorithmConfig(kl_coef=0.0)
    batch = TrainBatch(ids_NL=ids, attn_NL=attn, mask_NT=mask, P=P, adv_NT=adv[:, None] * mask, old_logp_NT=old)
    m = policy_update(
        policy=model,
        optimizer=opt,
        scheduler=sched,
        batch=batch,
        seed=0,
        settings=UpdateSettings(algo=algo, temperature=1.0, micro_batch_size=3, grad_clip=1.0, norm_length=6),
    )
    return {n: p.detach().clone() for n, p in model.named_parameters()}, m


def test_skipping_the_scoring_forward_gives_the_same_step(tiny_model):
    """Two paths of the update over one batch: it pins the on-policy shortcut, not the loss both compute (the
    loss is compared with a naive loop in tests/unit/test_batch.py)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 15, (2 + i % 3,), generator=g).tolist() for i in range(6)]
    responses = [torch.randint(4, 15, (1 + i % 4,), generator=g).tolist() for i in range(6)]
    ids, attn, mask, P = build_sequences(prompts, responses, pad_id=0)
    batch = (ids, attn, mask.float(), P, torch.randn(6, generator=g))
    w_scored, m_scored = _step(copy.deepcopy(tiny_model), batch, old_from_scoring=True)
    w_skip, m_skip = _step(copy.deepcopy(tiny_model), batch, old_from_scoring=False)
    assert m_skip["actor/ratio_max"] == m_skip["actor/ratio_min"] == 1.0
    assert abs(m_scored["actor/loss"] - m_skip["actor/loss"]) < 1e-6
    for n in w_scored:
        # 1-ulp logprob differences (scoring runs the full length, the update a trimmed one) become
        # ~1e-6 after AdamW normalises tiny gradients; a missing or wrong old policy is far larger.
        torch.testing.assert_close(w_skip[n], w_scored[n], rtol=1e-5, atol=1e-5)
    moved = max((w_skip[n] - p).abs().max().item() for n, p in tiny_model.named_parameters())
    assert moved > 1e-3


def test_on_policy_rule():
    assert is_on_policy(AlgorithmConfig(), 64)
    assert is_on_policy(AlgorithmConfig(mini_batch_size=64), 64)
    assert not is_on_policy(AlgorithmConfig(mini_batch_size=32), 64)
    assert not is_on_policy(AlgorithmConfig(ppo_epochs=2), 64)


def test_old_logprobs_are_scored_exactly_when_something_reads_them_before_the_update():
    assert not scores_old_policy(AlgorithmConfig(), 64)
    assert not scores_old_policy(AlgorithmConfig(kl_coef=0.1), 64), "KL in the loss reads only the update's forward"
    assert scores_old_policy(AlgorithmConfig(mini_batch_size=32), 64)
    assert scores_old_policy(AlgorithmConfig(ppo_epochs=2), 64)
    assert scores_old_policy(AlgorithmConfig(rollout_correction="tis_token"), 64)
    assert scores_old_policy(AlgorithmConfig(kl_placement="reward", kl_coef=0.1), 64)
    assert not scores_old_policy(AlgorithmConfig(kl_placement="reward", kl_coef=0.0), 64), "no reference, no KL"


def test_token_budget_micro_batches_cover_every_row_once_within_the_budget():
    from hybrid_rl.batch import micro_batches

    ends = [1, 6, 5, 4, 3, 2, 1, 6, 0]
    micros = micro_batches(list(range(9)), ends, P=5, micro_batch_size=3, max_tokens=20)
    assert sorted(r for mb in micros for r in mb) == list(range(9))
    for mb in micros:
        longest = max(5 + max(1, ends[r]) for r in mb)
        assert len(mb) == 1 or longest * len(mb) <= 20, mb
    lengths = [ends[r] for mb in micros for r in mb]
    assert lengths == sorted(lengths), "grouped by length"
    assert micro_batches(list(range(9)), ends, P=5, micro_batch_size=4, max_tokens=0) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8],
    ]


def test_packed_token_budget_counts_each_rows_tokens_not_the_longest():
    from hybrid_rl.batch import micro_batches

    ends = [1, 6, 5, 4, 3, 2, 1, 6, 0]
    cost = {r: 5 + max(1, e) for r, e in enumerate(ends)}  # 6, 11, 10, 9, 8, 7, 6, 11, 6
    micros = micro_batches(list(range(9)), ends, P=5, micro_batch_size=3, max_tokens=24, packed=True)
    assert sorted(r for mb in micros for r in mb) == list(range(9))
    assert all(sum(cost[r] for r in mb) <= 24 for mb in micros)
    assert [[cost[r] for r in mb] for mb in micros] == [[6, 6, 6], [7, 8, 9], [10, 11], [11]]
    # Padded, the same budget holds rows x the longest: 7 + 8 + 9 would cost 27.
    padded = micro_batches(list(range(9)), ends, P=5, micro_batch_size=3, max_tokens=24)
    assert [[cost[r] for r in mb] for mb in padded] == [[6, 6, 6], [7, 8], [9, 10], [11, 11]]


@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_token_budget_and_packing_give_the_same_update_as_padded_rows(tiny_model, loss_agg):
    """Micro-batches by a token budget and padding-free forwards change neither the loss nor its
    normaliser, in every aggregation mode: the same loss and gradient norm as padded row chunks. Every
    variant reads the same mask (`build_sequences`); that mask and the loss over it are pinned by hand
    and by a naive loop in tests/unit/test_batch.py."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 15, (2 + i % 3,), generator=g).tolist() for i in range(8)]
    responses = [torch.randint(4, 15, (1 + (i * 5) % 7,), generator=g).tolist() for i in range(8)]
    ids, attn, mask, P = build_sequences(prompts, responses, pad_id=0)
    adv = torch.randn(8, generator=g)
    out = {}
    for max_tokens, packing in ((0, False), (20, False), (0, True), (20, True)):
        model = copy.deepcopy(tiny_model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        batch = TrainBatch(ids_NL=ids, attn_NL=attn, mask_NT=mask.float(), P=P, adv_NT=adv[:, None] * mask.float())
        out[max_tokens, packing] = policy_update(
            policy=model,
            optimizer=opt,
            scheduler=sched,
            batch=batch,
            seed=0,
            settings=UpdateSettings(
                algo=AlgorithmConfig(kl_coef=0.0, loss_agg=loss_agg),
                temperature=1.0,
                micro_batch_size=3,
                grad_clip=1.0,
                norm_length=7,
                max_tokens_per_micro_batch=max_tokens,
                packing=packing,
            ),
        )
    want = out[0, False]
    for key, m in out.items():
        assert m["actor/loss"] == pytest.approx(want["actor/loss"], rel=1e-5), key
        assert m["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5), key


def test_mini_batches_are_shuffled_group_by_group():
    """A prompt's G samples stay together (so a micro-batch can share their prompt); the groups'
    order is random and every row comes once. Rows that do not divide into groups: one by one."""
    from hybrid_rl.batch import shuffled_rows

    gen = torch.Generator().manual_seed(0)
    orders = [shuffled_rows(24, 4, gen).tolist() for _ in range(5)]
    for order in orders:
        assert sorted(order) == list(range(24))
        for g in range(6):
            block = order[4 * g : 4 * g + 4]
            assert block == list(range(block[0], block[0] + 4)) and block[0] % 4 == 0, order
    assert len({tuple(o) for o in orders}) > 1
    assert sorted(shuffled_rows(10, 4, gen).tolist()) == list(range(10))
    assert (
        shuffled_rows(8, 1, torch.Generator().manual_seed(3)).tolist()
        == torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()
    )


def test_the_trainer_hands_the_group_size_to_the_update(tiny_trainer_overrides, monkeypatch):
    from hybrid_rl import trainer as trainer_module

    seen = []
    real = trainer_module.policy_update
    monkeypatch.setattr(trainer_module, "policy_update", lambda **kw: seen.append(kw["batch"].group_size) or real(**kw))
    from hybrid_rl import Trainer, load_config

    Trainer(load_config(None, [*tiny_trainer_overrides, "rollout.n=3"])).step()
    assert seen == [3]


def test_packed_row_micro_batches_take_whole_prompt_groups():
    """micro_batch_size 16 at G = 5 (grpo_7b.yaml): micro-batches of 15 rows, three whole groups each,
    whatever order the groups come in; padded, or with G above the size, plain chunks of the size."""
    from hybrid_rl.batch import micro_batches, shuffled_rows

    order = shuffled_rows(40, 5, torch.Generator().manual_seed(0)).tolist()
    micros = micro_batches(order, [3] * 40, P=5, micro_batch_size=16, max_tokens=0, packed=True, group_size=5)
    assert [len(mb) for mb in micros] == [15, 15, 10]
    assert sorted(r for mb in micros for r in mb) == list(range(40))
    for mb in micros:
        assert all(sum(1 for r in mb if r // 5 == k) in (0, 5) for k in range(8)), f"a prompt group split: {mb}"
    assert [len(mb) for mb in micro_batches(order, [3] * 40, 5, 16, 0, packed=False, group_size=5)] == [16, 16, 8]
    assert [len(mb) for mb in micro_batches(order, [3] * 40, 5, 4, 0, packed=True, group_size=5)] == [4] * 10


def test_packed_token_budget_keeps_a_prompts_rows_together():
    """With G rows per prompt, a micro-batch takes whole prompt groups, costed with the prompt once
    (P + the group's responses); a group over the budget is split into its rows."""
    from hybrid_rl.batch import micro_batches

    ends = [1, 6, 5, 4, 3, 2, 1, 6, 0, 9, 9, 9]  # 4 groups of 3 rows: costs 5+12, 5+9, 5+8, 5+27
    micros = micro_batches(list(range(12)), ends, P=5, micro_batch_size=3, max_tokens=30, packed=True, group_size=3)
    assert sorted(r for mb in micros for r in mb) == list(range(12))
    # Units by cost: group 2 (13), group 1 (14), rows 9, 10, 11 (14 each), group 0 (17).
    assert micros == [[6, 7, 8, 3, 4, 5], [9, 10], [11], [0, 1, 2]]
    cost = lambda rows: 5 + sum(max(1, ends[r]) for r in rows)  # noqa: E731
    for mb in micros:
        assert cost(mb) <= 30 or len(mb) == 1, mb
        whole = {r // 3 for r in mb if r < 9}
        assert all(set(range(3 * k, 3 * k + 3)) <= set(mb) for k in whole), f"group split: {mb}"
    assert [sorted(mb) for mb in micros if set(mb) & {9, 10, 11}] == [[9, 10], [11]], (
        "the over-budget group goes by rows"
    )


def test_update_settings_are_read_from_their_config_keys():
    """Catches UpdateSettings.from_config reading a neighbouring key (the sampling temperature for the
    scoring one, max_new_tokens vs micro_batch_size): the update would score or normalise differently."""
    from hybrid_rl.config.load import load_config

    cfg = load_config(
        None,
        [
            "rollout.temperature=0.7",
            "trainer.micro_batch_size=5",
            "optim.grad_clip=0.3",
            "rollout.max_new_tokens=9",
            "trainer.max_tokens_per_micro_batch=64",
            "trainer.packing=false",
        ],
    )
    s = UpdateSettings.from_config(cfg)
    assert s.algo is cfg.algorithm
    assert (s.temperature, s.micro_batch_size, s.grad_clip, s.norm_length, s.max_tokens_per_micro_batch, s.packing) == (
        0.7,
        5,
        0.3,
        9,
        64,
        False,
    )
