"""The rate model's partial rollouts (hybrid_rl/plan/rates.py predict_partial, `python -m hybrid_rl.plan --partial`):
the colocated step without and with rollout.partial, from named seconds and from a run's metrics.jsonl, on either
side of rollout.partial, and the input it refuses. Expected seconds are arithmetic written out here from the
model's statement (rates.py's docstring), never read back from the code."""

from __future__ import annotations

import json

import pytest

from hybrid_rl.plan import cli as plan
from hybrid_rl.plan.rates import Prediction, predict_partial

# The hand example: on 8 ranks a step's rollout half is 60 s, its training half 30 s, the switch 4 s (a 94 s step);
# 30 s of the rollout is the fixed generation term, so decode is lam = 30 / 60 = 0.5 latency-bound. The tail is
# 40% of the rollout, 24 s, the body 36 s. With 1.5 x the batch's groups in flight the batch is done 2 / 1.5 - 1 =
# 1/3 of the way into the tail: 2/3 of it, 16 s, is cut. Cutting saves its latency, 0.5 x 16 = 8 s; its tokens are
# decoded in the next body, the other 8 s. The carried rows, (1.5 - 1) x the batch, re-prefill prefixes of the
# body's length: 0.5 / (3/4) = 2/3 of the body's tokens, at the per-token part of the body's cost, scaled by
# --prefill-cost 0.25: 0.25 x 0.5 x 2/3 x 36 = 3 s. With partial: 60 - 16 + 8 + 3 = 55 s, the step 55 + 34 = 89 s.
# HAND_ARGV is README.md's example line as written (it quotes 94 s without, 89 s with).
HAND = dict(rollout=60.0, rest=34.0, tail=24.0, cut=16.0, saved=8.0, carried=8.0, reprefill=3.0, with_rollout=55.0)
HAND_ARGV = [
    "--gpus",
    "8",
    "--placement",
    "colocated",
    "--rollout-s",
    "60",
    "--train-s",
    "30",
    "--switch-s",
    "4",
    "--rollout-fixed-s",
    "30",
    "--partial",
    "--tail-frac",
    "0.4",
    "--prefill-cost",
    "0.25",
]


def _colocated(rollout: float, rest: float) -> Prediction:
    return Prediction("colocated", 0, 0, rollout, rest, 0.0, rollout + rest, 0.0, "rollout")


def _run(argv, capsys) -> tuple[list[str], dict]:
    assert plan.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return out, json.loads(out[-1])


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        plan.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_the_hand_example(capsys):
    """Catches: the tail counted twice (cut and kept), the cut tokens' decode or the re-prefill dropped, the cut share
    or the re-prefill ratio off, the training half or the switch left out of either step."""
    p = predict_partial(_colocated(60.0, 34.0), tail_share=0.4, over=1.5, latency_share=0.5, prefill_cost=0.25)
    assert (p.tail_s, p.tail_cut_s, p.saved_s) == pytest.approx((HAND["tail"], HAND["cut"], HAND["saved"]))
    assert (p.carried_decode_s, p.reprefill_s) == pytest.approx((HAND["carried"], HAND["reprefill"]))
    assert (p.rollout_without_s, p.rollout_with_s) == pytest.approx((60.0, 55.0))
    assert (p.step_without_s, p.step_with_s, p.net_saving_s) == pytest.approx((94.0, 89.0, 5.0))
    assert p.speedup == pytest.approx(94.0 / 89.0)

    out, res = _run(HAND_ARGV, capsys)
    part = res["partial"]
    assert part["measured"] == "without" and part["decode"] == "fit"
    assert part["latency_share"] == pytest.approx(0.5)
    assert (part["step_without_s"], part["step_with_s"]) == pytest.approx((94.0, 89.0))
    assert (part["carried_decode_s"], part["reprefill_s"]) == pytest.approx((8.0, 3.0))
    assert res["predictions"][0]["step_s"] == pytest.approx(94.0)  # the table's colocated row stays the step without
    text = "\n".join(out)
    assert "without --partial: rollout 60.000 s, step 94.000 s" in text
    assert "with --partial:    rollout 55.000 s, step 89.000 s" in text
    assert "the tail costs 24.000 s per step; 16.000 s of it is cut" in text
    assert "net +5.000 s per step" in text and "assumptions:" in text


def test_the_decode_bounds_and_the_groups_in_flight():
    """Latency-bound decode: carried tokens and their re-prefill ride free, the cut tail is saved whole. Throughput-
    bound: the cut tail's tokens cost what it did, so only the re-prefill is left (a loss). over = 1 cuts nothing and
    carries nothing; over = 2 cuts the whole tail.
    Catches: the decode modes swapped, the cut tail saved in throughput mode, a cut at over = 1."""
    c = _colocated(10.0, 5.0)  # tail 0.5 x 10 = 5 s, body 5 s
    lat = predict_partial(c, 0.5, over=1.5, latency_share=1.0)
    assert lat.rollout_with_s == pytest.approx(10.0 - 2.0 / 3.0 * 5.0)
    thr = predict_partial(c, 0.5, over=1.5, latency_share=0.0)
    assert thr.carried_decode_s == pytest.approx(2.0 / 3.0 * 5.0) and thr.saved_s == pytest.approx(0.0)
    assert thr.rollout_with_s == pytest.approx(10.0 + 2.0 / 3.0 * 5.0)  # re-prefill: 1 x 1 x 2/3 x 5 s
    assert thr.net_saving_s == pytest.approx(-10.0 / 3.0)
    none = predict_partial(c, 0.5, over=1.0, latency_share=0.7)
    assert (none.tail_cut_s, none.reprefill_s, none.rollout_with_s) == pytest.approx((0.0, 0.0, 10.0))
    whole = predict_partial(c, 0.5, over=2.0, latency_share=1.0)
    assert whole.tail_cut_s == pytest.approx(5.0) and whole.rollout_with_s == pytest.approx(5.0)


def test_a_run_with_partial_on_predicts_the_step_without():
    """The hand example seen from the other side: a run with rollout.partial on measured the 55 s rollout (89 s
    step); with the tail share of a rollout without (0.4) the step without is 94 s, as from the first side.
    Catches: the measured side taken for the other (no inversion), an inversion that is not the forward model's."""
    p = predict_partial(_colocated(55.0, 34.0), 0.4, 1.5, 0.5, measured="with", prefill_cost=0.25)
    assert p.measured == "with"
    assert (p.rollout_without_s, p.rollout_with_s) == pytest.approx((60.0, 55.0))
    assert (p.step_without_s, p.step_with_s) == pytest.approx((94.0, 89.0))


def _record(step: int, **over) -> dict:
    """A colocated step of a 2-rank run: rollout half 4 + 1 s (tail 2 s: 40%), training half 3 s, switch 0.5 s."""
    rec = {
        "step": step,
        "time/rollout": 4.0,
        "time/reward": 1.0,
        "time/rollout_tail": 2.0,
        "rollout/tokens_generated": 4096.0,
        "time/score": 1.0,
        "time/advantage": 0.0,
        "time/train": 2.0,
        "time/switch": 0.5,
        "switch/resume_weights_s": 0.4,
    }
    rec.update(over)
    rec["time/step"] = sum(rec[k] for k in ("time/rollout", "time/reward", "time/score", "time/train", "time/switch"))
    return rec


def _metrics(tmp_path, records, name="metrics.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _records(**over) -> list[dict]:
    """Step 1 pays one-off costs (skipped, as the rates skip it: its tail share is 9 / 11); steps 2-6 as `_record`
    with tails of 1, 1.5, 2, 2.5 and 3 s: shares 0.2 to 0.6, median 0.4 (0.45 with step 1 counted)."""
    first = _record(1, **{"time/rollout": 10.0, "time/rollout_tail": 9.0})
    return [first, *[_record(s, **{"time/rollout_tail": 0.5 * s, **over}) for s in range(2, 7)]]


def test_from_run_reads_the_tail_from_time_rollout_tail(tmp_path, capsys):
    """tau = 0.4 from the records (the median step's 2 s of 4 + 1). One rank count measured: no fixed generation
    term, so decode is taken as throughput-bound and says so: the step gets slower by the re-prefill,
    1 x 2/3 x (5 - 2) = 2 s. With --decode latency the cut 2/3 x 2 s is saved: 5 - 4/3 s. The step without is the
    run's 8.5 s.
    Catches: a tail share read from the first step, a tail taken as seconds instead of its share, a default that
    picks latency-bound decode from one run without saying so."""
    path = _metrics(tmp_path, _records())
    argv = ["--from-run", path, "--run-gpus", "2", "--gpus", "2", "--placement", "colocated", "--partial"]
    out, res = _run(argv, capsys)
    part = res["partial"]
    assert part["tail_share"] == pytest.approx(0.4) and part["latency_share"] == 0.0
    assert part["step_without_s"] == pytest.approx(8.5)
    assert part["rollout_with_s"] == pytest.approx(5.0 + 2.0)
    assert any("taken as throughput-bound" in line for line in out)
    assert any("from the runs' time/rollout_tail" in line for line in out)

    _, res = _run([*argv, "--decode", "latency"], capsys)
    assert res["partial"]["rollout_with_s"] == pytest.approx(5.0 - 2.0 / 3.0 * 2.0)
    assert res["partial"]["step_with_s"] == pytest.approx(8.5 - 4.0 / 3.0)

    _, res = _run([*argv, "--decode", "latency", "--partial-over", "2"], capsys)
    assert res["partial"]["step_with_s"] == pytest.approx(8.5 - 2.0)  # the whole tail

    # --rollout-tail-s instead: 1 s of the run's 5 s rollout half, whatever the records say
    _, res = _run([*argv, "--decode", "latency", "--rollout-tail-s", "1"], capsys)
    assert res["partial"]["tail_share"] == pytest.approx(0.2)
    assert res["partial"]["rollout_with_s"] == pytest.approx(5.0 - 2.0 / 3.0 * 1.0)


def test_from_runs_at_two_rank_counts_the_decode_latency_is_measured(tmp_path, capsys):
    """A 2-rank run with a 5 s rollout half and a 1-process run with 6 s: a / n + c through (2, 5) and (1, 6) is
    a = 2, c = 4, so on 2 ranks 4 of the 5 s do not shrink with rows: lam = 0.8 (--decode fit, the default).
    tau = 0.4 (both runs); with partial: 5 - 0.8 x 2/3 x 2 + 0.2 x 2/3 x 3 = 4.333 s.
    Catches: lam read on the wrong rank count, or left at 0 where two runs measured a fixed term."""
    two = _metrics(tmp_path, _records(), "w2.jsonl")
    one = _metrics(
        tmp_path, _records(**{"time/rollout": 4.8, "time/reward": 1.2, "time/rollout_tail": 2.4}), "w1.jsonl"
    )
    argv = ["--from-run", two, "--from-run", one, "--run-gpus", "2,1", "--gpus", "2", "--placement", "colocated"]
    _, res = _run([*argv, "--partial"], capsys)
    part = res["partial"]
    assert part["latency_share"] == pytest.approx(0.8) and part["tail_share"] == pytest.approx(0.4)
    assert part["rollout_with_s"] == pytest.approx(5.0 - 0.8 * 2.0 / 3.0 * 2.0 + 0.2 * 2.0 / 3.0 * 3.0)


def test_from_a_run_with_partial_on(tmp_path, capsys):
    """Records with rollout/carried: the run had rollout.partial on. Without --partial the planner says so; with it,
    the tail must be given (--tail-frac) and the step without is predicted: the run's 5 s rollout half with
    tau = 0.4, lam = 1 is 1 - 2/3 x 0.4 = 11/15 of the one without, 75/11 s.
    Catches: a partial run's residual tail taken for the tail it cut, a partial run read as one without."""
    path = _metrics(tmp_path, _records(**{"rollout/carried": 12.0, "time/rollout_tail": 0.3}))
    base = ["--from-run", path, "--run-gpus", "2", "--gpus", "2", "--placement", "colocated"]
    out, res = _run(base, capsys)
    assert any("had rollout.partial on" in line for line in out) and res["partial"] is None
    err = _refused([*base, "--partial"], capsys)
    assert "rollout.partial on" in err and "--tail-frac" in err
    err = _refused([*base, "--partial", "--rollout-tail-s", "1"], capsys)
    assert "--rollout-tail-s" in err and "--tail-frac" in err
    out, res = _run([*base, "--partial", "--tail-frac", "0.4", "--decode", "latency"], capsys)
    part = res["partial"]
    assert part["measured"] == "with" and any("the step without is predicted" in line for line in out)
    assert part["rollout_with_s"] == pytest.approx(5.0) and part["step_with_s"] == pytest.approx(8.5)
    assert part["rollout_without_s"] == pytest.approx(5.0 * 15.0 / 11.0)
    assert part["step_without_s"] == pytest.approx(5.0 * 15.0 / 11.0 + 3.5)


@pytest.mark.parametrize(
    "over, words",
    [
        ({"time/rollout_tail": 4.5}, ["longer than time/rollout", "step 2"]),
        ({"time/rollout_tail": -0.5}, ["must be >= 0"]),
        ({"time/rollout_tail": -1.0}, ["--partial needs", "--tail-frac", "--rollout-tail-s"]),
        ({"time/rollout_tail": None}, ["--partial needs", "--tail-frac", "--rollout-tail-s"]),
    ],
    ids=["tail-longer-than-rollout", "negative-tail", "tail-not-measured", "no-tail-key"],
)
def test_bad_records_are_refused_naming_the_run(tmp_path, capsys, over, words):
    """Catches: a tail longer than its rollout or negative read as a share, a run without time/rollout_tail (or an
    engine's -1) planned with a tail of 0 instead of refused."""
    recs = _records(**over)
    for r in recs[1:]:
        if r["time/rollout_tail"] is None:
            del r["time/rollout_tail"]
    path = _metrics(tmp_path, recs)
    err = _refused(["--from-run", path, "--run-gpus", "2", "--gpus", "2", "--partial"], capsys)
    assert path in err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--tail-frac", "-0.1"], ["--tail-frac", "[0, 1)"]),
        (["--tail-frac", "1"], ["--tail-frac", "[0, 1)"]),
        (["--rollout-tail-s", "-2"], ["--rollout-tail-s", ">= 0"]),
        (["--rollout-tail-s", "61"], ["--rollout-tail-s", "shorter than the rollout half"]),
        (["--rollout-tail-s", "6", "--tail-frac", "0.1"], ["--tail-frac", "--rollout-tail-s", "not both"]),
        (["--rollout-tail-s", "6", "--partial-over", "0.5"], ["--partial-over", ">= 1"]),
        (["--rollout-tail-s", "6", "--prefill-cost", "-1"], ["--prefill-cost", "[0, 1]"]),
        ([], ["--partial needs the rollout's tail", "--rollout-tail-s", "--tail-frac"]),
    ],
    ids=["frac-negative", "frac-one", "tail-s-negative", "tail-longer", "both", "over-below-1", "prefill", "no-tail"],
)
def test_bad_flags_are_refused_naming_the_flag(capsys, extra, words):
    argv = ["--gpus", "8", "--placement", "colocated", "--rollout-s", "60", "--train-s", "30", "--partial", *extra]
    err = _refused(argv, capsys)
    for w in words:
        assert w in err, err


def test_partial_flags_need_partial_and_the_colocated_placement(capsys):
    """Catches: a --tail-frac silently ignored without --partial, a split-only plan given a partial step."""
    named = ["--gpus", "8", "--rollout-s", "60", "--train-s", "30"]
    err = _refused([*named, "--tail-frac", "0.4"], capsys)
    assert "--tail-frac is read with --partial only" in err
    err = _refused([*named, "--placement", "split", "--partial", "--tail-frac", "0.4"], capsys)
    assert "--partial" in err and "colocated" in err


def test_runs_that_mix_partial_on_and_off_are_refused(tmp_path, capsys):
    off = _metrics(tmp_path, _records(), "off.jsonl")
    on = _metrics(tmp_path, _records(**{"rollout/carried": 4.0}), "on.jsonl")
    argv = ["--from-run", off, "--from-run", on, "--run-gpus", "2,1", "--gpus", "2", "--partial", "--tail-frac", "0.4"]
    assert "mix rollout.partial on and off" in _refused(argv, capsys)
    mixed = _metrics(tmp_path, [*_records(), _record(7, **{"rollout/carried": 4.0})], "mixed.jsonl")
    err = _refused(["--from-run", mixed, "--run-gpus", "2", "--gpus", "2", "--partial", "--tail-frac", "0.4"], capsys)
    assert mixed in err and "mix rollout.partial on and off" in err
    out, _ = _run(["--from-run", mixed, "--run-gpus", "2", "--gpus", "2"], capsys)  # without --partial: a note
    assert any("mix rollout.partial on and off" in line for line in out)


def test_rollout_tail_seconds_are_on_the_run_ranks(capsys):
    """--rollout-s 60 and --rollout-tail-s 24 measured on 4 ranks: tau = 0.4, planned on 8 ranks (linear: a 30 s
    rollout half, a 12 s tail); latency-bound decode cuts 2/3 of it: 30 - 8 = 22 s.
    Catches: the tail's seconds compared with the rollout half on the planned ranks (tau 0.8)."""
    argv = ["--gpus", "8", "--run-gpus", "4", "--placement", "colocated", "--rollout-s", "60", "--train-s", "30"]
    _, res = _run([*argv, "--partial", "--rollout-tail-s", "24", "--decode", "latency"], capsys)
    part = res["partial"]
    assert part["tail_share"] == pytest.approx(0.4) and part["tail_s"] == pytest.approx(12.0)
    assert (part["rollout_without_s"], part["rollout_with_s"]) == pytest.approx((30.0, 22.0))
