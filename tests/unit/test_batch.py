"""Batch construction (hybrid_rl/batch.py) pinned by tables written by hand.

Hand-written completions of known lengths (a stop token, a truncation at max_new_tokens, a completion that is
only its stop token, an empty one; an episode with holes) go through `RolloutBatch.build`, the ADVANTAGE stage's
`TrainBatch` and the ways a batch is cut (`response_ends`, `micro_batches`, `trimmed`, the packed and
shared-prefix layouts). Every expected value below is a literal table or a naive loop over the hand-written
token lists: nothing is read back from the object under test, so a mask or a column off by one shows here
whatever the code under test does to its own expectations.

Legend: B = 2 prompts, G = 2 samples each, N = 4 rows, P = 3 prompt columns (left-padded), T = 4 response
columns (right-padded), pad id 0, stop (EOS) id 1.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from hybrid_rl.batch import RolloutBatch, micro_batches, response_ends, trimmed
from hybrid_rl.config.schema import AlgorithmConfig
from hybrid_rl.loop.advantage_stage import advantage_stage
from hybrid_rl.loop.update import UpdateSettings, policy_update
from hybrid_rl.models.packing import pack
from hybrid_rl.models.shared_prefix import build_layout
from hybrid_rl.types import Completion

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7], [8, 9]]
COMPLETIONS = [
    Completion([10, 11, 1], [-0.1, -0.2, -0.3], "stop"),  # ends with its stop token
    Completion([12, 13, 14, 4], [-0.4, -0.5, -0.6, -0.7], "length"),  # cut at max_new_tokens = 4
    Completion([1], [-0.8], "stop"),  # the stop token alone
    Completion([], [], "stop"),  # nothing at all
]
REWARDS = [1.0, 0.0, 0.5, 0.0]

# The tables, by hand: [pad .. prompt | response .. pad].
IDS_NL = [
    [5, 6, 7, 10, 11, 1, 0],
    [5, 6, 7, 12, 13, 14, 4],
    [0, 8, 9, 1, 0, 0, 0],
    [0, 8, 9, 0, 0, 0, 0],
]
ATTN_NL = [
    [1, 1, 1, 1, 1, 1, 0],
    [1, 1, 1, 1, 1, 1, 1],
    [0, 1, 1, 1, 0, 0, 0],
    [0, 1, 1, 0, 0, 0, 0],
]
RESP_MASK_NT = [
    [1, 1, 1, 0],
    [1, 1, 1, 1],
    [1, 0, 0, 0],
    [0, 0, 0, 0],
]
ENGINE_LOGP_NT = [
    [-0.1, -0.2, -0.3, 0.0],
    [-0.4, -0.5, -0.6, -0.7],
    [-0.8, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
]
TRUNCATED_N = [False, True, False, False]


def _rollout_batch(completions=COMPLETIONS, prompts=PROMPTS, loss_masks=None) -> RolloutBatch:
    r = torch.tensor(REWARDS[: len(completions)])
    rows = [{"prompt": str(i)} for i in range(len(prompts))]
    G = len(completions) // len(prompts)
    return RolloutBatch.build(rows, prompts, completions, G, r, r.clone(), 0, CPU, loss_masks=loss_masks)


def _naive_mask(completions, T: int, drop_truncated: bool = False) -> list[list[float]]:
    """1.0 on each completion's own tokens (stop token included), 0.0 after; a truncated row all 0.0 when the
    overlong filter drops it."""
    rows = []
    for c in completions:
        keep = not (drop_truncated and c.finish_reason == "length")
        rows.append([1.0 if keep and t < len(c.token_ids) else 0.0 for t in range(T)])
    return rows


def _naive_grpo(rewards: list[float], G: int) -> list[float]:
    """(r - group mean) / (unbiased group std + 1e-6), group by group."""
    out = []
    for g in range(0, len(rewards), G):
        rs = rewards[g : g + G]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
        out += [(r - mean) / (std + 1e-6) for r in rs]
    return out


# ---------------------------------------------------------------------------- RolloutBatch.build
def test_single_turn_batch_is_the_hand_written_table():
    """Catches: the single-turn loss mask shifted by a token (the pad after a stop token trained, or a first
    response token dropped), a mask taken from the prompt's columns, an empty or stop-only completion given a
    token, prompts padded on the wrong side, engine log-probs in the wrong column, truncation read from length."""
    b = _rollout_batch()
    assert b.P == 3 and len(b) == 4 and b.group_size == 2
    assert b.ids_NL.tolist() == IDS_NL
    assert b.attn_NL.tolist() == ATTN_NL
    assert b.resp_mask_NT.tolist() == RESP_MASK_NT
    assert b.resp_mask_NT.tolist() == _naive_mask(COMPLETIONS, 4)
    assert torch.equal(b.engine_logp_NT, torch.tensor(ENGINE_LOGP_NT))
    assert b.truncated_N.tolist() == TRUNCATED_N
    assert b.group_ids_N.tolist() == [0, 0, 1, 1]
    assert b.resp_mask_NT.dtype == torch.float32 and b.ids_NL.dtype == torch.long


def test_truncation_is_the_finish_reason_not_the_length():
    """Catches: truncated_N read from a row filling the batch's columns (a stop token at exactly max_new_tokens
    would then leave the loss under the overlong filter, and an episode cut short by its token budget stay)."""
    comps = [Completion([10, 11, 12, 1], [-0.1] * 4, "stop"), Completion([13, 14], [-0.2] * 2, "length")]
    b = _rollout_batch(comps, [[5, 6]])
    assert b.truncated_N.tolist() == [False, True]
    assert b.resp_mask_NT.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_a_batch_of_empty_completions_keeps_one_response_column():
    """Catches: T = 0 for a batch whose completions are all empty (nothing to index, a crash in the update)."""
    b = _rollout_batch([Completion([], [], "stop")] * 2, [[5, 6]])
    assert b.ids_NL.tolist() == [[5, 6, 0], [5, 6, 0]]
    assert b.attn_NL.tolist() == [[1, 1, 0], [1, 1, 0]]
    assert b.resp_mask_NT.tolist() == [[0.0], [0.0]]


# An episode's response: its turns as sampled (mask 1) and the observations between them (mask 0); the last row
# is the episode whose reset added tokens to its group's shared prompt (envs: group_prompts moves them here, 0).
EPISODES = [
    ([10, 1, 7, 8, 11, 1], [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4], [1, 1, 0, 0, 1, 1]),
    ([12, 1, 9], [-0.5, -0.6, 0.0], [1, 1, 0]),
    ([4, 13, 1], [-0.7, -0.8, -0.9], [1, 1, 1]),
    ([6, 6, 4, 1], [0.0, 0.0, -1.0, -1.1], [0, 0, 1, 1]),
]
EPISODE_MASK_NT = [
    [1, 1, 0, 0, 1, 1],
    [1, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0],
    [0, 0, 1, 1, 0, 0],
]
EPISODE_ATTN_RESPONSE_NT = [  # observations are attended (the model reads them), only the loss skips them
    [1, 1, 1, 1, 1, 1],
    [1, 1, 1, 0, 0, 0],
    [1, 1, 1, 0, 0, 0],
    [1, 1, 1, 1, 0, 0],
]


def test_multi_turn_holes_are_the_hand_written_mask():
    """Catches: observation tokens in the loss (the mask built from the attention mask), a hole shifted by a
    token, the loss masks paired with the wrong completions, padding after an episode in the loss."""
    comps = [Completion(ids, lps, "stop") for ids, lps, _ in EPISODES]
    b = _rollout_batch(comps, loss_masks=[m for _, _, m in EPISODES])
    assert b.P == 3
    assert b.resp_mask_NT.tolist() == EPISODE_MASK_NT
    assert b.attn_NL[:, 3:].tolist() == EPISODE_ATTN_RESPONSE_NT
    assert b.ids_NL[:, 3:].tolist() == [
        [10, 1, 7, 8, 11, 1],
        [12, 1, 9, 0, 0, 0],
        [4, 13, 1, 0, 0, 0],
        [6, 6, 4, 1, 0, 0],
    ]


def test_batch_refuses_a_mask_that_is_not_zero_one():
    with pytest.raises(ValueError, match="loss mask"):
        _rollout_batch([Completion([5, 6], [0.0, 0.0], "stop")] * 2, [[4]], loss_masks=[[1, 2], [1, 1]])


# ---------------------------------------------------------------------------- the TrainBatch (ADVANTAGE)
@pytest.mark.parametrize("overlong_filter", [False, True])
def test_train_batch_mask_advantages_and_loss_tokens(overlong_filter):
    """Catches: the loss mask off by a token, `response/loss_tokens` counting padding (a larger token-mean
    denominator) or the truncated rows the overlong filter drops, an advantage on a padding column.

    response/loss_tokens is the mean number of trained tokens per row: (3 + 4 + 1 + 0) / 4 = 2.0, and with the
    overlong filter (the truncated row out) (3 + 1 + 0) / 4 = 1.0."""
    b = _rollout_batch()
    tb, acc = advantage_stage(b, None, None, 0.0, AlgorithmConfig(overlong_filter=overlong_filter))
    m = acc.reduce()
    want_mask = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]] if overlong_filter else RESP_MASK_NT
    assert tb.mask_NT.tolist() == want_mask
    assert tb.mask_NT.tolist() == _naive_mask(COMPLETIONS, 4, drop_truncated=overlong_filter)
    assert m["response/loss_tokens"] == (1.0 if overlong_filter else 2.0)
    if overlong_filter:
        assert m["response/overlong_filtered"] == 0.25
    assert tb.ids_NL.tolist() == IDS_NL and tb.attn_NL.tolist() == ATTN_NL and tb.P == 3 and tb.group_size == 2
    assert torch.equal(tb.engine_logp_NT, torch.tensor(ENGINE_LOGP_NT))
    # Sequence-level advantages sit on every response token of the row (the filter masks the loss, not them).
    adv = _naive_grpo(REWARDS, 2)
    want_adv = [[adv[i] * m for m in RESP_MASK_NT[i]] for i in range(4)]
    torch.testing.assert_close(tb.adv_NT, torch.tensor(want_adv), rtol=1e-6, atol=1e-7)


def test_episode_train_batch_counts_generated_tokens_only():
    """Catches: `response/loss_tokens` or the loss mask counting an episode's observation tokens or its padding:
    (4 + 2 + 3 + 2) / 4 generated tokens per row."""
    comps = [Completion(ids, lps, "stop") for ids, lps, _ in EPISODES]
    b = _rollout_batch(comps, loss_masks=[m for _, _, m in EPISODES])
    tb, acc = advantage_stage(b, None, None, 0.0, AlgorithmConfig())
    assert tb.mask_NT.tolist() == EPISODE_MASK_NT
    assert acc.reduce()["response/loss_tokens"] == 11 / 4


# ---------------------------------------------------------------------------- how the batch is cut
def test_response_ends_trims_and_micro_batches_of_the_hand_written_batch():
    """Catches: a trim that cuts a row's last trained token or keeps a padding column, response ends read from
    the attention mask's prompt, packed micro-batches that split a prompt's group or misprice a group."""
    tb, _ = advantage_stage(_rollout_batch(), None, None, 0.0, AlgorithmConfig())
    assert response_ends(tb.mask_NT) == [3, 4, 1, 0]
    ids, attn, mask, T = trimmed(tb, torch.tensor([0, 2]))
    assert T == 3
    assert ids.tolist() == [[5, 6, 7, 10, 11, 1], [0, 8, 9, 1, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, attn, mask, T = trimmed(tb, torch.tensor([2, 3]))
    assert T == 1 and ids.tolist() == [[0, 8, 9, 1], [0, 8, 9, 0]] and mask.tolist() == [[1], [0]]
    ids, _, _, T = trimmed(tb, torch.tensor([3]))
    assert T == 1 and ids.tolist() == [[0, 8, 9, 0]], "an empty row still gets one (masked) column"
    # Packed, whole groups: group 0 costs P + 3 + 4 = 10 tokens, group 1 P + 1 + 1 (an empty row costs 1) = 5.
    ends = [3, 4, 1, 0]
    assert micro_batches([0, 1, 2, 3], ends, 3, 4, 15, packed=True, group_size=2) == [[2, 3, 0, 1]]
    assert micro_batches([0, 1, 2, 3], ends, 3, 4, 14, packed=True, group_size=2) == [[2, 3], [0, 1]]
    # Padded, by row: a micro-batch costs rows x (P + its longest response).
    assert micro_batches([0, 1, 2, 3], ends, 3, 4, 12, packed=False) == [[3, 2], [0], [1]]


def test_packed_and_shared_prefix_layouts_score_exactly_the_response_tokens():
    """Catches: a packed or shared-prefix layout that scores a padding slot or a prompt token, drops the stop
    token, or maps a response token to the wrong (row, column) of the padded layout."""
    b = _rollout_batch()
    # Response tokens in row order, with the padded (row, column) each log-prob goes back to.
    targets = [10, 11, 1, 12, 13, 14, 4, 1]
    rows = [0, 0, 0, 1, 1, 1, 1, 2]
    cols = [0, 1, 2, 0, 1, 2, 3, 0]
    one = pack(b.ids_NL, b.attn_NL, b.P, one_row=True)
    # One row, longest sequence first (first-fit-decreasing): row 1 (7 tokens), row 0 (6), row 2 (3), row 3 (2).
    assert one.ids_RC.tolist() == [[5, 6, 7, 12, 13, 14, 4, 5, 6, 7, 10, 11, 1, 8, 9, 1, 8, 9]]
    assert one.pos_RC.tolist() == [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1]]
    # Token q is predicted by the slot before it: 9, 10, 11 for row 0; 2..5 for row 1; 14 for row 2.
    assert one.pred_Q.tolist() == [9, 10, 11, 2, 3, 4, 5, 14]
    assert (one.target_Q.tolist(), one.row_Q.tolist(), one.col_Q.tolist()) == (targets, rows, cols)
    assert one.real_tokens == 6 + 7 + 3 + 2
    shared = build_layout(b.ids_NL, b.attn_NL, b.P)
    assert shared.prompts == 2
    # The distinct tokens: prompts [5, 6, 7] and [8, 9] once, then each response without its last token.
    assert shared.ids_1K.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    assert shared.pos_1K.tolist() == [[0, 1, 2, 0, 1, 3, 4, 3, 4, 5]]
    assert (shared.target_Q.tolist(), shared.row_Q.tolist(), shared.col_Q.tolist()) == (targets, rows, cols)
    # Predicted by: row 0's tokens from 7, 10, 11; row 1's from 7, 12, 13, 14; row 2's from 9 (distinct index).
    assert shared.pred_Q.tolist() == [2, 5, 6, 2, 7, 8, 9, 4]


# ---------------------------------------------------------------------------- the loss, by a naive loop
def _naive_grads(model, loss_agg: str) -> dict[str, torch.Tensor]:
    """The policy-gradient loss by hand: each completion scored alone (its prompt, then its own tokens, no
    padding), a term -A_i * logp for each of its tokens; token-mean over all tokens, or the mean over rows of
    each row's token mean (a row without tokens is not counted: aggregation's empty-row rule)."""
    model = copy.deepcopy(model)
    adv = _naive_grpo(REWARDS, 2)
    per_row, counts = [], []
    for i, c in enumerate(COMPLETIONS):
        if not c.token_ids:
            continue
        p = PROMPTS[i // 2]
        logits = model(input_ids=torch.tensor([p + c.token_ids])).logits[0].float()
        logp = torch.log_softmax(logits[len(p) - 1 : -1], -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        per_row.append(sum(-adv[i] * torch.exp(lp - lp.detach()) for lp in logp))
        counts.append(len(c.token_ids))
    if loss_agg == "token-mean":
        loss = sum(per_row) / sum(counts)
    else:
        loss = sum(s / n for s, n in zip(per_row, counts)) / len(per_row)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("packing", [False, True])
def test_the_update_trains_each_completions_own_tokens(tiny_model, loss_agg, packing):
    """Catches: the loss training the pad token after a stop token (with the row's advantage and a larger
    token-mean denominator), or missing a row's first or last token, on the padded and the packed path."""
    algo = AlgorithmConfig(loss_agg=loss_agg)
    tb, _ = advantage_stage(_rollout_batch(), None, None, 0.0, algo)
    model = copy.deepcopy(tiny_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    settings = UpdateSettings(algo=algo, temperature=1.0, micro_batch_size=4, grad_clip=1e9, norm_length=4)
    settings = dataclasses.replace(settings, packing=packing)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    policy_update(policy=model, optimizer=opt, scheduler=sched, batch=tb, settings=settings, seed=0)
    want = _naive_grads(tiny_model, loss_agg)
    for n, p in model.named_parameters():
        got = before[n] - p.detach()  # one SGD step of lr 1, no clipping: the gradient itself
        err = (got - want[n]).norm() / want[n].norm().clamp_min(1e-12)
        assert err < 1e-4, f"{n}: relative error {err:.2e}"
