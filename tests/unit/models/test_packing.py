"""Padding-free scoring (models/packing.py) gives the padded path's log-probs, entropies and gradients.

The reference is `response_logprobs` on the padded layout, masked to the response tokens.
Legend: N sequences, P prompt columns, T response columns, R packed rows of C slots.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybrid_rl.models import packing
from hybrid_rl.models.loading import load_causal_lm
from hybrid_rl.models.logprobs import build_sequences, response_logprobs
from hybrid_rl.models.packing import first_fit_decreasing, pack, packed_response_logprobs

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _batch(n: int = 10, seed: int = 0):
    """Prompts of 1-5 tokens, responses of 0-9 (one empty, one at the maximum), ids 3..14."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 15) for _ in range(rng.randint(1, 5))] for _ in range(n)]
    responses = [[rng.randrange(3, 15) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    responses[1], responses[2] = [], [7] * 9
    ids, attn, mask, P = build_sequences(prompts, responses, pad_id=0)
    return ids, attn, mask.float(), P


def test_first_fit_decreasing_places_every_index_once_within_capacity():
    lengths = [5, 9, 1, 4, 4, 3, 9, 2]
    bins = first_fit_decreasing(lengths, 9)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 9 for b in bins)
    assert len(bins) == 5  # 9 | 9 | 5+4 | 4+3+2 | 1 would be 5 as well: sum 41 needs >= 5 rows of 9
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([3, 10], 9)


def test_first_fit_decreasing_equals_the_textbook_loop():
    """The scan skips bins too full for the shortest sequence; the bins must be the textbook ones."""

    def textbook(lengths, capacity):
        bins, room = [], []
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            for b in range(len(bins)):
                if room[b] >= lengths[i]:
                    break
            else:
                bins.append([])
                room.append(capacity)
                b = len(bins) - 1
            bins[b].append(i)
            room[b] -= lengths[i]
        return bins

    rng = random.Random(0)
    for _ in range(300):
        lo = rng.randint(1, 12)
        lengths = [rng.randint(lo, 20) for _ in range(rng.randint(1, 40))]
        capacity = max(lengths) + rng.choice([0, 0, 3, 17])
        assert first_fit_decreasing(lengths, capacity) == textbook(lengths, capacity), (lengths, capacity)


def test_layout_of_a_hand_made_batch():
    # Row 0: prompt [5, 6], response [7, 8];  row 1: prompt [9], response [10];  row 2: prompt [11, 12], response [].
    ids, attn, _, P = build_sequences([[5, 6], [9], [11, 12]], [[7, 8], [10], []], pad_id=0)
    lay = pack(ids, attn, P, one_row=False)
    # Capacity 4 (the longest sequence): row 0 holds sequence 0; row 1 holds 1 then 2 (longest first, ties in order).
    assert lay.ids_RC.tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert lay.pos_RC.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    # Response tokens 7, 8 (seq 0, t = 0, 1) are predicted from slots 1, 2; token 10 (seq 1, t = 0) from slot 4.
    assert lay.pred_Q.tolist() == [1, 2, 4]
    assert lay.target_Q.tolist() == [7, 8, 10]
    assert list(zip(lay.row_Q.tolist(), lay.col_Q.tolist())) == [(0, 0), (0, 1), (1, 0)]
    assert lay.real_tokens == 8 and 1.0 - lay.real_tokens / lay.ids_RC.numel() == 0.0

    one = pack(ids, attn, P, one_row=True)
    assert one.ids_RC.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert one.pos_RC.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1]]
    assert one.pred_Q.tolist() == [1, 2, 4]


def test_unused_slots_sit_at_the_end_of_a_row():
    ids, attn, _, P = build_sequences([[5, 6, 7], [9]], [[7, 8], [10]], pad_id=0)
    lay = pack(ids, attn, P, one_row=False)  # capacity 5: row 0 = seq 0, row 1 = seq 1 (2 tokens) + 3 unused
    assert lay.ids_RC.tolist() == [[5, 6, 7, 7, 8], [9, 10, 0, 0, 0]]
    assert lay.pos_RC.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 0, 0]]
    assert 1.0 - lay.real_tokens / lay.ids_RC.numel() == pytest.approx(0.3)


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", ["rows", "one_row", "shared"])
def test_packed_logprobs_and_gradients_equal_the_padded_path(tiny_model_dir, monkeypatch, attn_impl, layout):
    """rows: first-fit-decreasing rows; one_row: the layout flash-attention varlen gets, run here
    through the block-diagonal mask; shared: the distinct-token row (models/shared_prefix.py)."""
    if layout == "one_row":
        monkeypatch.setattr(packing, "attention_implementation", lambda model: "flash_attention_2")
    model = load_causal_lm(tiny_model_dir, attn_implementation=attn_impl)
    ids, attn, mask, P = _batch()
    ref_lp, ref_ent = response_logprobs(model, ids, attn, P, temperature=0.7)
    (ref_lp * mask).sum().backward(retain_graph=True)
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (ref_ent * mask).sum().backward()
    ref_ge = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    lp, ent = packed_response_logprobs(
        model,
        ids,
        attn,
        P,
        temperature=0.7,
        min_saving=0.0,  # never padded
        share_prompts=layout == "shared",
    )
    assert lp.shape == ent.shape == mask.shape
    torch.testing.assert_close(lp, ref_lp * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent * mask, rtol=1e-5, atol=1e-5)
    assert not lp[mask == 0].any() and not ent[mask == 0].any(), "padding reads 0"
    (lp * mask).sum().backward(retain_graph=True)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_g[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"logp grad {n}: {m}")
    model.zero_grad()
    (ent * mask).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_ge[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"entropy grad {n}: {m}")


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("similar", [False, True])
def test_micro_batch_packed_only_when_it_saves_slots(tiny_model_dir, monkeypatch, similar, share_prompts):
    """Sequences too long to share a row (15, 14, 15 tokens in rows of 15) and distinct prompts, so the shared
    layout runs 41 tokens of the 45 slots (each response less its last token): both would save under 10%,
    so the micro-batch is scored padded, with the same values and 0 on the one padded response slot."""
    model = load_causal_lm(tiny_model_dir)
    if similar:
        responses = [[7, 8] * 6, [10] * 11, [3, 3, 4] * 4]
        ids, attn, _, P = build_sequences([[5, 6, 7], [8, 9, 4], [5, 5, 5]], responses, pad_id=0)
    else:
        ids, attn, _, P = _batch()
    padded_calls = []
    real = packing.response_logprobs
    monkeypatch.setattr(packing, "response_logprobs", lambda *a, **k: padded_calls.append(1) or real(*a, **k))
    with torch.no_grad():
        lp, ent = packed_response_logprobs(model, ids, attn, P, share_prompts=share_prompts)
        ref_lp, ref_ent = real(model, ids, attn, P)
    assert len(padded_calls) == (1 if similar else 0)
    mask = attn[:, P:]
    torch.testing.assert_close(lp, ref_lp * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent * mask, rtol=1e-5, atol=1e-5)


def test_packing_runs_fewer_slots_than_padding(tiny_model_dir):
    ids, attn, _, P = _batch(n=32, seed=1)
    lay = pack(ids, attn, P, one_row=False)
    assert lay.ids_RC.numel() < 0.8 * ids.numel()
    assert lay.real_tokens == int(attn.sum())
