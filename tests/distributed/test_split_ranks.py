"""The split placement's wires on real gloo ranks (hybrid_rl/split/transport.py, weight_sync.py).

One launch of 2 ranks (rank 0 the learner, rank 1 the rollout rank, as `Layout(2, 1)` places them) runs
the scenarios in order, each returning its result or its traceback so that only its own test fails:
  groups     rank 1 sends finished groups, rank 0 gets them back bit-exact (partial-rollout versions too);
  weights    rank 0's policy, FSDP2-sharded over the learner group's own mesh and changed as by an
             optimizer step, is synced in bf16 buckets to rank 1's native engine: its weights must equal
             the learner's full tensors cast to bf16, bit for bit (a sync that skips a bucket fails);
  hang       rank 1 stays silent: rank 0's receive ends after its short timeout naming rollout rank 1;
  dead       rank 1 leaves (its sockets close, as a killed process's do): rank 0's receive fails at once,
             naming rollout rank 1.
A second 2-rank launch kills the other side: the learner leaves while the rollout rank waits for weights,
whose receive fails at once naming learner rank 0, and the engine is left expecting a whole sync again.
A 3-rank launch syncs from 2 learner ranks (the gathers span both shards) to 1 rollout rank.
"""

from __future__ import annotations

import time
import traceback

import pytest
import torch

from tests.distributed.launch import run_ranks

TIMEOUT_S = 5  # the receive timeouts here; the launcher's own bound is far above (a hang detector)
BUCKET = 4 << 10  # small buckets: the tiny model's sync takes many


def _groups():
    from hybrid_rl.split.staleness import VersionedGroup
    from hybrid_rl.types import Completion

    g = torch.Generator().manual_seed(0)
    lp = [torch.randn(3, generator=g, dtype=torch.float64).tolist() for _ in range(4)]
    comps = [Completion([4, 5, 1], lp[0], "stop"), Completion([6, 7, 8], lp[1], "length")]
    partial = [Completion([9], lp[2][:1], "abort"), Completion([], [], "stop")]
    return [
        VersionedGroup(7, [2, 3, 4], comps, [1.0, 1 / 3], [0.5, -2.0 / 7], 4),
        VersionedGroup(11, [2], partial, [0.0, 0.1], [0.0, 0.2], 5, [[6], []]),
    ]


def _learner_model(model_dir: str, learners: list[int]):
    """The tiny policy, fp32, FSDP2-sharded over a mesh of the learner ranks only, changed as by a step."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from hybrid_rl.models.fsdp import decoder_layers
    from hybrid_rl.models.loading import load_causal_lm

    mesh = DeviceMesh("cpu", torch.tensor(learners))  # every rank builds it; only the learners are in it
    model = load_causal_lm(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-2)
    if torch.distributed.get_rank() not in learners:
        return None
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _weights(rank: int, model_dir: str, world: int) -> dict:
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.weights import full_tensor
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.split.placement import Layout
    from hybrid_rl.split.weight_sync import receive_weights, send_weights

    lay = Layout(world, 1)
    model = _learner_model(model_dir, lay.learners)
    sync_group = torch.distributed.new_group([0, *lay.rollouts], backend="gloo")  # learner rank 0 + rollout ranks
    if not lay.is_rollout(rank):
        expected = {n: full_tensor(p.detach()).to(torch.bfloat16) for n, p in model.named_parameters()}
        stats = send_weights(
            model, 1, src=0, group=sync_group, dtype=torch.bfloat16, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S
        )
        return {"expected": expected, "stats": stats}
    engine_model = load_causal_lm(model_dir, dtype=torch.bfloat16)  # the rollout rank's own copy, unchanged
    before = {n: p.detach().clone() for n, p in engine_model.named_parameters()}
    engine = NativeEngine(engine_model, pad_id=0, eos_id=1)
    stats = receive_weights(engine, 1, src=0, group=sync_group, timeout_s=TIMEOUT_S)
    got = {n: p.detach().clone() for n, p in engine_model.named_parameters()}
    from hybrid_rl.types import SamplingParams

    out = engine.generate([[2, 5, 6]], SamplingParams(max_new_tokens=3, seed=1))
    return {"got": got, "before": before, "stats": stats, "generated": len(out[0].token_ids)}


def _capture(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - each scenario reports its own failure to its own test
        return {"error": traceback.format_exc()}


def _silent_then_dead(rank: int) -> dict:
    """Each case on a group of its own: a timed-out gloo receive closes its group's connections."""
    from hybrid_rl.split.transport import PeerError, recv_groups

    groups = {case: torch.distributed.new_group([0, 1], backend="gloo") for case in ("hang", "dead")}
    out = {}
    if rank == 0:
        for case in ("hang", "dead"):
            t0 = time.monotonic()
            try:
                recv_groups(1, TIMEOUT_S, group=groups[case], peer="rollout rank 1")
                out[case] = {"error": "received groups from a silent peer"}
            except PeerError as err:
                out[case] = {"message": str(err), "seconds": time.monotonic() - t0}
            if case == "hang":
                torch.distributed.barrier()  # rank 1 leaves only after the timeout was seen
        return out
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # every group's sockets close, as a killed process's do
    return out


def _two_ranks(rank: int, model_dir: str) -> dict:
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.split.transport import recv_groups, send_groups

    D.init("cpu", timeout_s=60)
    res = {}
    if rank == 1:
        res["groups"] = _capture(lambda: {"bytes": send_groups(_groups(), 0, TIMEOUT_S, peer="learner rank 0")})
    else:
        res["groups"] = _capture(lambda: dict(zip(("groups", "bytes"), recv_groups(1, TIMEOUT_S))))
    res["weights"] = _capture(_weights, rank, model_dir, 2)
    res.update(_silent_then_dead(rank))
    return res


@pytest.fixture(scope="module")
def two(tiny_model_dir):
    return run_ranks(_two_ranks, world=2, args=(tiny_model_dir,), timeout=180)


def _ok(result: dict) -> dict:
    assert "error" not in result, result["error"]
    return result


def test_groups_arrive_bit_exact(two):
    learner, rollout = _ok(two[0]["groups"]), _ok(two[1]["groups"])
    assert learner["groups"] == _groups()  # dataclass equality: ids, float64 log-probs, rewards, versions
    assert learner["groups"][1].token_versions == [[6], []] and learner["groups"][0].token_versions is None
    assert learner["bytes"] == rollout["bytes"] > 0


def _check_sync(learner: dict, rollout: dict) -> None:
    expected, got = learner["expected"], rollout["got"]
    assert set(got) == set(expected)
    changed = [n for n in got if not torch.equal(rollout["before"][n], expected[n])]
    assert changed == list(got), "every learner weight must differ from the engine's start, or the test shows nothing"
    stale = [n for n in got if not torch.equal(got[n], expected[n])]
    assert not stale, f"after the sync these engine weights differ from the learner's: {stale}"
    numel = sum(t.numel() for t in expected.values())
    assert learner["stats"].bytes == rollout["stats"].bytes == numel * 2  # bf16 on the wire
    assert learner["stats"].buckets == rollout["stats"].buckets > 1 and rollout["stats"].version == 1
    assert rollout["generated"] >= 1


def test_weight_sync_makes_the_engine_equal_the_learner(two):
    _check_sync(_ok(two[0]["weights"]), _ok(two[1]["weights"]))


def test_silent_rollout_rank_is_named_after_the_timeout(two):
    hang = _ok(two[0]["hang"])
    assert "rollout rank 1" in hang["message"] and f"within {TIMEOUT_S} s" in hang["message"], hang
    assert hang["seconds"] < TIMEOUT_S + 10, hang


def test_dead_rollout_rank_is_named(two):
    dead = _ok(two[0]["dead"])
    assert "rollout rank 1" in dead["message"] and "died or hangs" in dead["message"], dead
    assert dead["seconds"] < TIMEOUT_S + 10, dead


def _three_ranks(rank: int, model_dir: str) -> dict:
    from hybrid_rl.runtime import distributed as D

    D.init("cpu", timeout_s=60)
    return _capture(_weights, rank, model_dir, 3)


def test_weight_sync_gathers_from_two_learner_shards(tiny_model_dir):
    learner0, learner1, rollout = run_ranks(_three_ranks, world=3, args=(tiny_model_dir,), timeout=180)
    _check_sync(_ok(learner0), _ok(rollout))
    assert _ok(learner1)["stats"].bytes == 0  # it gathered, only learner rank 0 sends


def _learner_leaves(rank: int, model_dir: str) -> dict:
    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.split.transport import PeerError
    from hybrid_rl.split.weight_sync import receive_weights

    D.init("cpu", timeout_s=60)
    sync_group = torch.distributed.new_group([0, 1], backend="gloo")
    torch.distributed.barrier()
    if rank == 0:
        torch.distributed.destroy_process_group()  # every socket closes, as a killed learner's do
        return {}
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.rollout.native.engine import NativeEngine

    engine = NativeEngine(load_causal_lm(model_dir, dtype=torch.float32), pad_id=0, eos_id=1)
    t0 = time.monotonic()
    try:
        receive_weights(engine, 1, src=0, group=sync_group, timeout_s=TIMEOUT_S)
        return {"error": "weights received from a learner that left"}
    except PeerError as err:
        return {"message": str(err), "seconds": time.monotonic() - t0}


def test_dead_learner_rank_is_named_by_the_waiting_rollout_rank(tiny_model_dir):
    _, rollout = run_ranks(_learner_leaves, world=2, args=(tiny_model_dir,), timeout=120)
    got = _ok(rollout)
    assert "learner rank 0" in got["message"] and "died or hangs" in got["message"], got
    assert got["seconds"] < TIMEOUT_S + 10, got
