"""Multi-turn episodes on 2 real gloo ranks (issue 28): one Trainer step of the tiny ask-then-answer task.

Catches: ranks running episodes of the same dataset rows (a loader slice or the runner ignoring the rank),
episode/* metrics left per rank, and a reduction that needs every rank's environment to report the same
metric names (here only rank 0's environments report `hint`: reducing the names each rank happens to have
mismatches the collective, or averages over one rank's episodes only).
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow


class _RankAsk:
    """tiny_ask whose metrics() names differ by rank: only rank 0's episodes report `hint`."""

    def __init__(self, row: dict):
        from hybrid_rl.envs.tiny_ask import AskEnv

        self.inner = AskEnv(row)
        self.reset, self.step = self.inner.reset, self.inner.step

    def metrics(self) -> dict:
        from hybrid_rl.runtime import distributed as D

        return {"hint": 1.0} if D.rank() == 0 else {}


def rank_ask(row: dict) -> _RankAsk:
    return _RankAsk(row)


def _step_on_rank(rank: int, overrides: list[str]):
    import hybrid_rl.envs.episodes as episodes_mod
    from hybrid_rl import trainer as trainer_mod
    from hybrid_rl.config.load import load_config
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    uids, run = [], episodes_mod.EpisodeRunner.run

    def spy_run(self, rows, G, params):
        out = run(self, rows, G, params)
        uids.extend(rows[e.row_index]["uid"] for e in out)
        return out

    episodes_mod.EpisodeRunner.run = spy_run
    tr = trainer_mod.Trainer(load_config(None, overrides))
    m = tr.step()
    return {"uids": uids, "metrics": {k: v for k, v in m.items() if k.startswith("episode/")}}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from hybrid_rl.envs.tiny_ask import ask_rows, build_ask_model_dir

    root = tmp_path_factory.mktemp("ask_ranks")
    build_ask_model_dir(str(root / "model"))
    rows = [{**r, "uid": i} for i, r in enumerate(ask_rows(32, seed=0))]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"model.path={root / 'model'}",
        "data.task=jsonl",
        f"data.path={root / 'rows.jsonl'}",
        f"env.fn={__name__}:rank_ask",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=2",
        "rollout.max_episode_tokens=32",
        "rollout.n=2",
        "data.batch_size=8",
        "trainer.total_steps=1",
        f"trainer.out_dir={root / 'out'}",
        "trainer.progress_bar=false",
        "trainer.log_every=0",
        "trainer.device=cpu",
    ]
    return run_ranks(_step_on_rank, world=2, args=(overrides,), timeout=180)


def test_each_rank_runs_episodes_of_its_own_rows(two_ranks):
    r0, r1 = two_ranks
    assert len(r0["uids"]) == len(r1["uids"]) == 4 * 2, "4 rows x G=2 episodes on each rank"
    assert not set(r0["uids"]) & set(r1["uids"]), f"both ranks ran rows {set(r0['uids']) & set(r1['uids'])}"


def test_episode_metrics_are_reduced_over_ranks_even_with_differing_names(two_ranks):
    m0, m1 = two_ranks[0]["metrics"], two_ranks[1]["metrics"]
    assert set(m0) == set(m1) and "episode/turns" in m0
    for key in m0:
        assert m0[key] == pytest.approx(m1[key], rel=1e-12, abs=1e-12), key
    assert m0["episode/hint"] == pytest.approx(0.5), "rank 0's 8 episodes report 1, rank 1's 8 report nothing"
