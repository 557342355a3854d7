"""The rate model of the placements (hybrid_rl/plan/rates.py), held against the event simulation of the
split protocol (split/schedule.py), read from metrics.jsonl records, and the planner's CLI for it."""

from __future__ import annotations

import json

import pytest

from hybrid_rl.plan import cli as plan
from hybrid_rl.plan.rates import (
    Rates,
    fit_placements,
    fit_rates,
    predict_all,
    predict_colocated,
    predict_split,
    rates_from_records,
    read_metrics,
    recommend,
)
from hybrid_rl.split.schedule import simulate, steady_period


def test_colocated_adds_the_halves_and_the_switch():
    p = predict_colocated(Rates(rollout_rank_s=0.16, train_rank_s=0.30, switch_s=0.05, sync_s=0.02), world=2)
    assert (p.rollout_s, p.train_s, p.step_s) == pytest.approx((0.08, 0.15, 0.28))
    assert p.idle_fraction == 0.0 and p.bottleneck == "train"


def test_split_overlaps_only_from_k1():
    rates = Rates(rollout_rank_s=6.0, train_rank_s=6.0, switch_s=1.0, sync_s=0.5)
    p0, p1 = predict_split(rates, 8, 2, 0), predict_split(rates, 8, 2, 1)
    assert (p0.rollout_s, p0.train_s) == pytest.approx((3.0, 1.0))
    assert p0.step_s == pytest.approx(3.0 + 1.0 + 0.5)
    assert p1.step_s == pytest.approx(3.0 + 0.5)
    assert p1.idle_fraction == pytest.approx(1 - 1.0 / 3.0) and p1.bottleneck == "rollout"


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("R", [1, 2, 3])
def test_the_model_is_the_simulations_steady_state(k, R):
    """The closed form equals the protocol simulated event by event (4 ranks, rates from a colocated run)."""
    rates = Rates(rollout_rank_s=4.0, train_rank_s=3.0, switch_s=0.3, sync_s=0.2)
    p = predict_split(rates, 4, R, k)
    sim = simulate(k, 40, gen_s=p.rollout_s, train_s=p.train_s, sync_s=rates.sync_s)
    assert steady_period(sim) == pytest.approx(p.step_s)


def test_bad_layouts_are_refused():
    rates = Rates(1.0, 1.0, 0.0, 0.0)
    for R in (0, 4):
        with pytest.raises(ValueError, match="rollout ranks < world size"):
            predict_split(rates, 4, R, 1)
    with pytest.raises(ValueError, match=">= 0"):
        Rates(-1.0, 1.0, 0.0, 0.0)


def test_recommendation_follows_the_bottleneck():
    """Training the longer half (the tiny recipe: train 0.15 s, rollout 0.08 s per step on 2 ranks): colocated.
    A run that pays a large switch and little sync, with balanced halves: split at the balancing R, k = 1."""
    tiny = Rates(rollout_rank_s=0.16, train_rank_s=0.30, switch_s=0.05, sync_s=0.05)
    assert recommend(predict_all(tiny, 2)).label == "colocated"
    gen_heavy = Rates(rollout_rank_s=24.0, train_rank_s=8.0, switch_s=2.0, sync_s=0.2)
    best = recommend(predict_all(gen_heavy, 8))
    assert best.label == "split R=6 k=1", [(p.label, p.step_s) for p in predict_all(gen_heavy, 8)]


def test_tp_size_limits_the_rollout_ranks():
    preds = predict_all(Rates(1.0, 1.0, 0.0, 0.0), 8, ks=(1,), tp_size=2, placements=("split",))
    assert [p.rollout_ranks for p in preds] == [2, 4, 6]


def _colocated_records() -> list[dict]:
    base = {
        "time/rollout": 0.2,
        "time/reward": 0.02,
        "time/score": 0.5,
        "time/advantage": 0.01,
        "time/train": 1.4,
        "time/switch": 0.06,
        "switch/resume_weights_s": 0.05,
        "reward/mean": 0.1,
    }
    first = {**base, "step": 1, "time/rollout": 9.0, "time/step": 11.0}  # one-off costs: skipped
    rest = [
        {**base, "step": s, "time/step": 2.19 + 0.01 * (s % 3), "time/train": 1.4 + 0.1 * (s % 2)} for s in range(2, 9)
    ]
    return [first, *rest, {"step": 8, "val/pass@1": 0.5}]


def test_rates_of_a_colocated_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _colocated_records()))
    records = read_metrics(str(path))
    assert len(records) == 8  # the validation row is not a step
    with pytest.raises(ValueError, match="--run-gpus"):
        rates_from_records(records)
    rates, meta = rates_from_records(records, world=2)
    assert meta == {"world": 2, "rollout_ranks": 0, "steps": 7}
    assert rates.rollout_rank_s == pytest.approx(0.22 * 2)
    # train: median of score + advantage + train (1.91, 4 of 7 steps) plus the median unaccounted rest
    assert rates.train_rank_s == pytest.approx((1.91 + 0.0) * 2, abs=0.03)
    assert rates.switch_s == pytest.approx(0.06) and rates.sync_s == pytest.approx(0.05)


def test_rates_of_a_split_run_use_its_pools():
    rec = {
        "time/step": 1.0,
        "time/rollout": 0.9,
        "time/reward": 0.1,
        "time/score": 0.2,
        "time/train": 0.6,
        "split/sync_s": 0.03,
        "switch/resume_weights_s": 9.0,
        "split/rollout_ranks": 3,
        "split/world_size": 4,
    }
    rates, meta = rates_from_records([rec, rec], skip=0)
    assert meta["rollout_ranks"] == 3 and meta["world"] == 4
    assert (rates.rollout_rank_s, rates.train_rank_s, rates.sync_s) == pytest.approx((3.0, 0.8, 0.03))


def test_plan_cli_from_run_prints_each_placement_and_a_recommendation(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _colocated_records()))
    assert plan.main(["--from-run", str(path), "--run-gpus", "2", "--gpus", "2", "--max-staleness", "0,1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    labels = [p["label"] for p in result["predictions"]]
    assert labels == ["colocated", "split R=1 k=0", "split R=1 k=1"]
    assert result["recommended"] == "colocated" and any("recommended: colocated" in line for line in out)


def test_plan_cli_split_from_named_assumptions(capsys):
    argv = [
        "--placement",
        "split",
        "--gpus",
        "8",
        "--rollout-s",
        "24",
        "--train-s",
        "8",
        "--switch-s",
        "2",
        "--sync-s",
        "0.2",
        "--max-staleness",
        "1",
    ]
    assert plan.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["rollout_ranks"] for p in result["predictions"]] == list(range(1, 8))
    assert result["recommended"] == "split R=6 k=1"


def test_plan_cli_needs_rates(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--placement", "split", "--gpus", "8"])
    assert "--from-run" in capsys.readouterr().err


def _run_records(world: int, truth) -> list[dict]:
    """Colocated steps on `world` ranks as the model says `truth` (a Rates) would measure them."""
    r, t = truth.rollout(world), truth.train(world)
    rec = {
        "time/rollout": r,
        "time/score": 0.0,
        "time/train": t,
        "time/switch": truth.switch_s,
        "switch/resume_weights_s": truth.sync_s,
        "time/step": r + t + truth.switch_s,
    }
    return [rec] * 4


def test_runs_at_two_rank_counts_measure_the_fixed_and_collective_terms(tmp_path, capsys):
    """A 1-process run and a 2-rank run of a truth with decode latency and FSDP collectives: the fit recovers
    every term, so split (1 learner: no collectives) is predicted as the truth says. One run alone
    (linear) is 2x off for the learner, the failure the benchmark showed (results/placement_cpu)."""
    truth = Rates(
        rollout_rank_s=0.06, train_rank_s=0.50, switch_s=0.01, sync_s=0.02, rollout_fixed_s=0.04, train_comm_s=0.35
    )
    two, one = rates_from_records(_run_records(2, truth), world=2), rates_from_records(_run_records(1, truth), world=1)
    fitted = fit_rates([two, one])
    for name in ("rollout_rank_s", "train_rank_s", "rollout_fixed_s", "train_comm_s", "switch_s", "sync_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name)), name
    for k in (0, 1):
        assert predict_split(fitted, 2, 1, k).step_s == pytest.approx(predict_split(truth, 2, 1, k).step_s)
    linear = fit_rates([two])
    assert linear.rollout_fixed_s == linear.train_comm_s == 0.0
    assert predict_split(linear, 2, 1, 1).train_s == pytest.approx(2 * truth.train(2))  # 1.7 s against 0.5
    assert predict_colocated(linear, 2).step_s == pytest.approx(predict_colocated(truth, 2).step_s)

    paths = []
    for w, recs in ((2, _run_records(2, truth)), (1, _run_records(1, truth))):
        paths.append(tmp_path / f"w{w}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert (
        plan.main(
            [
                "--from-run",
                str(paths[0]),
                "--from-run",
                str(paths[1]),
                "--run-gpus",
                "2,1",
                "--gpus",
                "2",
                "--max-staleness",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert not any("linear data-parallel scaling assumed" in line for line in out)
    got = {p["label"]: p["step_s"] for p in json.loads(out[-1])["predictions"]}
    assert got["split R=1 k=1"] == pytest.approx(predict_split(truth, 2, 1, 1).step_s)
    assert plan.main(["--from-run", str(paths[0]), "--run-gpus", "2", "--gpus", "2"]) == 0
    assert any("linear data-parallel scaling assumed" in line for line in capsys.readouterr().out.splitlines())
    with pytest.raises(SystemExit):
        plan.main(["--from-run", str(paths[0]), "--from-run", str(paths[1]), "--run-gpus", "2", "--gpus", "2"])
    assert "one per run" in capsys.readouterr().err


def test_a_fit_stays_in_the_physical_range():
    """Two ranks more than twice as fast (noise): the best line through 0, never a negative fixed term. Two
    ranks slower than one (decode latency-bound, benchmarks/results/placement_cpu long setting): a constant,
    never a speed-up from fewer rows per rank that a linear fallback would predict."""
    fast_two = (Rates(0.10, 0.2, 0.0, 0.0), {"world": 2, "rollout_ranks": 0})  # 0.05 s per rank
    one = (Rates(0.12, 0.3, 0.0, 0.0), {"world": 1, "rollout_ranks": 0})  # 0.12 s on one
    fitted = fit_rates([fast_two, one])
    assert fitted.rollout_fixed_s == 0.0 and fitted.train_comm_s == 0.0
    assert fitted.rollout(1) == pytest.approx((0.5 * 0.05 + 1 * 0.12) / (0.25 + 1))  # least squares, c = 0
    slow_two = (Rates(0.226, 0.2, 0.0, 0.0), {"world": 2, "rollout_ranks": 0})  # 0.113 s per rank
    slow_one = (Rates(0.100, 0.2, 0.0, 0.0), {"world": 1, "rollout_ranks": 0})
    fitted = fit_rates([slow_two, slow_one])
    assert fitted.rollout_rank_s == 0.0 and fitted.rollout(1) == fitted.rollout(2) == pytest.approx(0.1065)


def test_named_seconds_keep_their_meaning_with_fixed_and_collective_terms(capsys):
    """--rollout-s 50 --rollout-fixed-s 25 on 8 ranks: rollout(8) is still 50 s, and a 4-rank pool takes
    25 + 25 x 2 = 75 s (not 100: half of the generation does not shrink with fewer rows per rank)."""
    argv = [
        "--placement",
        "split",
        "--gpus",
        "8",
        "--rollout-s",
        "50",
        "--train-s",
        "42",
        "--switch-s",
        "5",
        "--sync-s",
        "1.5",
        "--rollout-fixed-s",
        "25",
        "--train-comm-s",
        "2",
        "--max-staleness",
        "0",
    ]
    assert plan.main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rates = Rates(**res["rates"])
    assert rates.rollout(8) == pytest.approx(50) and rates.train(8) == pytest.approx(42)
    assert rates.rollout(4) == pytest.approx(75) and rates.train(4) == pytest.approx(2 + 40 * 2)
    with pytest.raises(SystemExit):
        plan.main([*argv[:-2], "--rollout-fixed-s", "60"])


def test_a_split_run_gives_the_split_placements_its_pools_own_rates(tmp_path, capsys):
    """Colocated runs at 2 and 1 ranks of a truth, and a split k=0 run (1 + 1 ranks) in which each half ran 20%
    slower than in one colocated process (what the 2-core CPU showed): with the split run, split k=1 is
    predicted from its pools' rates, exactly; without it, 1 / 1.2 too fast. Colocated is predicted from the
    colocated runs either way. The fixed term the colocated runs measured stays (the split run has one R)."""
    truth = Rates(
        rollout_rank_s=0.06, train_rank_s=0.50, switch_s=0.01, sync_s=0.02, rollout_fixed_s=0.04, train_comm_s=0.35
    )
    slow = 1.2
    split_rec = {
        "time/rollout": truth.rollout(1) * slow,
        "time/train": truth.train(1) * slow,
        "split/sync_s": 0.03,
        "split/rollout_ranks": 1,
        "split/world_size": 2,
    }
    split_rec["time/step"] = split_rec["time/rollout"] + split_rec["time/train"] + 0.03
    runs = [
        rates_from_records(_run_records(2, truth), world=2),
        rates_from_records(_run_records(1, truth), world=1),
        rates_from_records([split_rec] * 4),
    ]
    colocated, split = fit_placements(runs)
    assert split is not None and fit_placements(runs[:2])[1] is None
    want = max(truth.rollout(1), truth.train(1)) * slow + 0.03
    assert predict_split(split, 2, 1, 1).step_s == pytest.approx(want)
    assert predict_split(colocated, 2, 1, 1).step_s == pytest.approx((want - 0.03) / slow + truth.sync_s)
    assert split.rollout_fixed_s == pytest.approx(truth.rollout_fixed_s)
    assert split.train_comm_s == pytest.approx(truth.train_comm_s)
    preds = {p.label: p.step_s for p in predict_all(colocated, 2, (1,), split_rates=split)}
    assert preds["colocated"] == pytest.approx(predict_colocated(truth, 2).step_s)
    assert preds["split R=1 k=1"] == pytest.approx(want)

    paths = []
    for i, recs in enumerate((_run_records(2, truth), _run_records(1, truth), [split_rec] * 5)):
        paths.append(tmp_path / f"run{i}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert (
        plan.main(
            [
                *[a for p in paths for a in ("--from-run", str(p))],
                "--run-gpus",
                "2,1,2",
                "--gpus",
                "2",
                "--max-staleness",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("split placements from the split runs' pools") for line in out)
    got = {p["label"]: p["step_s"] for p in json.loads(out[-1])["predictions"]}
    assert got["split R=1 k=1"] == pytest.approx(want)
