"""`build_sequences` and `position_ids` (hybrid_rl/models/logprobs.py) pinned by a table written by hand.

Many tests build their batches, and so their masks, with `build_sequences`: its layout is checked here against
literal tables (prompts left-padded, responses right-padded, an empty response), so those tests' masks do not
rest on the code they feed. Legend: N = 3 rows, P = 3 prompt columns, T = 3 response columns, pad id 0.
"""

from __future__ import annotations

from hybrid_rl.models.logprobs import build_sequences, position_ids


def test_build_sequences_is_the_hand_written_layout():
    """Catches: a response mask shifted by a column or taken over the prompt, padding on the wrong side, an
    empty response given a token, positions that count padding (a left-padded prompt must start at 0)."""
    ids, attn, mask, P = build_sequences([[5, 6, 7], [8], [9, 10]], [[11, 1], [12, 13, 1], []], pad_id=0)
    assert P == 3
    assert ids.tolist() == [[5, 6, 7, 11, 1, 0], [0, 0, 8, 12, 13, 1], [0, 9, 10, 0, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert position_ids(attn).tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3], [0, 0, 1, 1, 1, 1]]
