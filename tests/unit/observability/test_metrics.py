"""Bottleneck report: per-step dominant phase and the run summary line."""

from hybrid_rl.observability.metrics import bottleneck, split_summary


def test_bottleneck_names_the_dominant_phase():
    m = {"time/rollout": 3.0, "time/reward": 0.5, "time/score": 1.0, "time/train": 2.0, "time/switch": 0.1}
    assert bottleneck(m) == "rollout-bound"
    m["time/train"] = 4.0
    assert bottleneck(m) == "training-bound"


def test_split_summary_shares_add_up():
    hist = [{"time/rollout": 1.0, "time/score": 1.0, "time/train": 2.0, "time/switch": 0.0}] * 4
    line = split_summary(hist)
    assert line == "time split over 4 steps: rollout 25% | scoring 25% | training 50% | switching 0% -> training-bound"


def test_accumulator_extremes_and_neutral_values():
    import torch

    from hybrid_rl.observability.metrics import MeanAccumulator

    a, b = MeanAccumulator(), MeanAccumulator()
    a.add_max("hi", torch.tensor(2.0))
    a.add_max("hi", float("-inf"))  # an empty micro-batch adds nothing
    a.add_min("lo", torch.tensor(0.5))
    b.add_min("lo", 0.25)
    b.add_min("lo", float("inf"))
    b.add_max("hi", 3.0)
    b.add("mean", 6.0, 3.0)
    a |= b
    assert a.reduce() == {"hi": 3.0, "lo": 0.25, "mean": 2.0}
