"""What a multi-turn run shows on its console line (observability/metrics.py `episode_troubles`, the episodes'
`generated_tokens` and `truncated`): the model's own tokens as `length`, the episodes the runner cut as
`truncated`, and environment steps that time out, tool calls that raise and malformed calls as a count and a
share in the step where they happen.

Catches: `length` counting observation tokens, `truncated` = 1.00 for episodes the environment ended (their last
turn cut by max_new_tokens), timeouts / tool errors / malformed calls visible only in metrics.jsonl, and a count
that is not the step's (a rate per rank, one sampling round).
"""

from __future__ import annotations

import json
import time

import pytest

from hybrid_rl import Trainer, load_config
from hybrid_rl.envs import Step
from hybrid_rl.observability.metrics import episode_troubles, format_line

pytestmark = pytest.mark.usefixtures("torch_one_thread")

OBSERVATION = "01234567890123"  # 14 tokens of the tiny ask vocabulary


class Slow:
    """Row 0's episodes time out at their second step; the others end (done) at their second turn, after a long
    observation; every turn is cut at max_new_tokens (the tiny random model never stops)."""

    def __init__(self, row):
        self.row, self.turn = row, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turn += 1
        if self.turn == 1:
            return Step(observation=[{"role": "tool", "content": OBSERVATION}])
        if self.row["slow"]:
            time.sleep(2.0)  # far past env.timeout_s: a loaded machine cannot blur the two
        return Step(reward=1.0, done=True)

    def metrics(self):
        return {"tool_calls": 2.0, "tool_errors": 1.0 if self.row["slow"] else 0.0, "malformed_calls": 1.0}


def make(row):
    return Slow(row)


@pytest.fixture
def slow_run(tmp_path):
    from hybrid_rl.envs.tiny_ask import build_ask_model_dir

    model = build_ask_model_dir(str(tmp_path / "model"))  # digits and a chat template that closes turns
    rows = [{"prompt": "?", "slow": i == 0} for i in range(4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            "data.task=jsonl",
            f"data.path={tmp_path / 'rows.jsonl'}",
            f"env.fn={__name__}:make",
            "env.timeout_s=0.5",
            "rollout.max_turns=3",
            "rollout.max_new_tokens=2",
            "rollout.max_episode_tokens=64",
            "rollout.n=2",
            "data.batch_size=4",
            "trainer.total_steps=1",
            f"trainer.out_dir={tmp_path / 'run'}",
            "trainer.progress_bar=false",
            "trainer.device=cpu",
        ],
    )
    return Trainer(cfg)


def test_the_console_line_counts_generated_tokens_real_truncations_and_troubles(slow_run, capsys):
    m = slow_run.fit()[0]
    assert m["episode/count"] == 8
    # Every episode generated two turns of 2 tokens (cut at max_new_tokens), with an observation between them.
    assert m["response/length"] == 4.0 and m["episode/observation_tokens"] > 10
    # Row 0's two episodes timed out (cut by the runner); the other six ended by the environment's done.
    assert m["episode/end_timeout"] == pytest.approx(2 / 8) and m["response/truncated"] == pytest.approx(2 / 8)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step=1"))
    assert "truncated=0.25  length=4.0" in line
    assert line.endswith(
        "  timeouts=2 (25% of 8 episodes)  tool_errors=2 (12% of 16 calls)  malformed_calls=8 (33% of call attempts)"
    ), line


def test_a_step_without_troubles_adds_nothing():
    quiet = {"step": 1, "reward/mean": 0.5, "episode/count": 8.0, "episode/end_timeout": 0.0, "episode/tool_calls": 1}
    assert episode_troubles(quiet) == "" and format_line(quiet) == "step=1  reward=0.500"
    assert episode_troubles({"step": 1, "reward/mean": 0.5}) == ""  # single-turn runs have no episode/count
