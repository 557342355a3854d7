"""A checkpoint written before the package layout moved (issue 35) resumes after it, to the bit.

tests/fixtures/premove_checkpoint/ was written by the code of 717a1ef (tests/fixtures/make_premove_checkpoint.py):
a tiny run stopped after step 2, and the metrics of step 3 of the same run left uninterrupted. Resuming the
checkpoint with today's code must give that step 3: the per-rank state (RNG streams, loader position, KL
controller) and the DCP shards are read by today's modules, and any name a pickle or a key carries from the old
layout would fail here.
"""

from __future__ import annotations

import json
import os
import shutil

from hybrid_rl import Trainer, load_config

FIXTURE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures", "premove_checkpoint"
)
# What a step computes from the same numbers; time/* and memory/* are the machine's.
COMPARED = ("reward/", "actor/", "response/", "rollout/", "kl", "critic/", "score/")


def test_premove_checkpoint_resumes_bit_exact(tmp_path):
    with open(os.path.join(FIXTURE, "expected_step3.json")) as f:
        expected = json.load(f)
    ckpt = tmp_path / "old" / "step_00000002"
    shutil.copytree(os.path.join(FIXTURE, "step_00000002"), ckpt)
    cfg = load_config(
        None,
        [
            *expected["overrides"],
            f"model.path={os.path.join(FIXTURE, 'model')}",
            f"trainer.out_dir={tmp_path / 'run'}",
            f"trainer.resume={ckpt}",
        ],
    )
    trainer = Trainer(cfg)
    history = trainer.fit()
    trainer.close()
    assert len(history) == 1 and history[0]["step"] == 3, "the resume must run step 3 only"
    got, want = history[0], expected["step3"]
    keys = sorted(k for k in want if k.startswith(COMPARED))
    assert "reward/mean" in keys and "actor/loss" in keys and "actor/grad_norm" in keys
    diff = {k: (got.get(k), want[k]) for k in keys if got.get(k) != want[k]}
    assert not diff, f"step 3 after resuming the pre-move checkpoint differs: {diff}"
