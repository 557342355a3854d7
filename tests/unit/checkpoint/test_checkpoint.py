"""Checkpoints on one rank: resume is bit-exact (plain, at an epoch boundary, with optimizer
offload copying, with dynamic sampling, with the adaptive KL controller), saves are atomic,
and every bad checkpoint is refused before anything is overwritten."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.checkpoint_helpers import ROOT, assert_same_run, overrides, straight_and_resumed

K = 3


@pytest.mark.parametrize(
    "extra,offload_copies",
    [
        ((), False),
        # 12 prompts = 3 batches of 4: the checkpoint sits exactly at the end of an epoch.
        (("data.num_prompts=12",), False),
        (("offload.optimizer=true",), True),
        (("algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"), False),
        (
            (
                "algorithm.kl_coef=0.05",
                "algorithm.kl_controller=adaptive",
                "algorithm.target_kl=0.001",
                "optim.warmup_steps=10",
            ),
            False,
        ),
    ],
    ids=["plain", "epoch_boundary", "optimizer_offload", "dynamic_sampling", "adaptive_kl_warmup"],
)
def test_resume_is_bit_exact(tiny_model_dir, tmp_path, extra, offload_copies):
    """A comparison of two runs of the same code: it pins what a checkpoint carries, and is blind to what both
    runs compute alike (the batch's loss mask: tests/unit/test_batch.py; the loss: tests/unit/loop/)."""
    result = straight_and_resumed(tiny_model_dir, str(tmp_path), K, *extra, offload_copies=offload_copies)
    if "data.num_prompts=12" in extra:
        assert result["loader"][1]["epoch"] >= 1, "the run must cross the epoch boundary"
    assert_same_run(result)
    with open(os.path.join(result["resumed_dir"], "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, 2 * K + 1)), f"metrics.jsonl after resume: steps {steps}"


def _trainer(model_dir, out, *extra):
    from hybrid_rl import Trainer, load_config

    return Trainer(load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides(model_dir, out, *extra)))


@pytest.fixture
def two_checkpoints(tiny_model_dir, tmp_path):
    """A run dir with checkpoints at steps 2 and 4 (keep_last=2)."""
    out = str(tmp_path / "run")
    tr = _trainer(tiny_model_dir, out, "trainer.total_steps=4", "trainer.save_every=2")
    tr.fit()
    return tr, out


def test_auto_takes_newest_complete_and_ignores_partial(two_checkpoints, tiny_model_dir):
    """A killed save leaves a temporary (removed at start, said); a step dir without meta.json is damaged: auto
    skips it for the newest intact one and sets it aside (test_damaged_checkpoint.py has the other damages)."""
    from hybrid_rl.checkpoint import sharded as C

    tr, out = two_checkpoints
    root = os.path.join(out, "checkpoints")
    assert [s for s, _ in C.complete_checkpoints(root)] == [2, 4]
    shutil.copytree(os.path.join(root, "step_00000004"), os.path.join(root, "step_00000006"))
    os.remove(os.path.join(root, "step_00000006", "meta.json"))
    os.makedirs(os.path.join(root, ".tmp-step_00000008", "state"))
    resumed = _trainer(tiny_model_dir, out, "trainer.total_steps=6")
    assert resumed.step_idx == 4 and resumed.resume_from.endswith("step_00000004")
    assert not os.path.exists(os.path.join(root, ".tmp-step_00000008")), "stale temporaries are removed at start"
    aside = os.path.join(root, "set_aside", "step_00000006-damaged")
    assert os.path.isdir(aside) and not os.path.exists(os.path.join(root, "step_00000006"))
    with pytest.raises(C.CheckpointError, match=r"is damaged: meta\.json is missing\. To recover.*step_00000004"):
        _trainer(tiny_model_dir, out, f"trainer.resume={aside}")


def test_refuses_to_mix_with_later_checkpoints(two_checkpoints, tiny_model_dir, tmp_path):
    """A fresh run in a used out_dir would write its checkpoints next to another run's: keep_last (highest
    steps kept) would delete the new ones as soon as they are written. Refused before anything is written;
    elsewhere a fresh run starts at step 0. (Resuming an older checkpoint sets the later ones aside:
    test_damaged_checkpoint.py.)"""
    from hybrid_rl.checkpoint import sharded as C

    _, out = two_checkpoints
    root = os.path.join(out, "checkpoints")
    before = _unchanged(out)
    with pytest.raises(C.CheckpointError, match=r"holds checkpoints \(steps 2, 4\).*another trainer\.out_dir"):
        _trainer(tiny_model_dir, out, "trainer.resume=none")
    assert _unchanged(out) == before
    assert [s for s, _ in C.complete_checkpoints(root)] == [2, 4]
    fresh = _trainer(tiny_model_dir, str(tmp_path / "elsewhere"), "trainer.resume=none")
    assert fresh.step_idx == 0
    # Resuming the newest one is the normal case and has nothing after it; after an out-of-memory
    # error it resumes with smaller micro-batches, gradient checkpointing or another attention kernel
    # (memory layout only).
    assert (
        _trainer(
            tiny_model_dir,
            out,
            "trainer.total_steps=6",
            "trainer.micro_batch_size=1",
            "model.gradient_checkpointing=true",
            "trainer.max_tokens_per_micro_batch=64",
            "model.attn_implementation=eager",
        ).step_idx
        == 4
    )


def test_keep_last_prunes_oldest(tiny_model_dir, tmp_path):
    from hybrid_rl.checkpoint import sharded as C

    out = str(tmp_path / "run")
    _trainer(tiny_model_dir, out, "trainer.total_steps=5", "trainer.save_every=1", "trainer.keep_last=2").fit()
    assert [s for s, _ in C.complete_checkpoints(os.path.join(out, "checkpoints"))] == [4, 5]


def _unchanged(out):
    """What a refused resume must not touch: the metrics and config of the run dir."""
    files = {}
    for name in ("metrics.jsonl", "config.yaml"):
        with open(os.path.join(out, name)) as f:
            files[name] = f.read()
    return files


def test_refuses_other_config_world_and_model_before_writing(two_checkpoints, tiny_model_dir, tmp_path):
    from hybrid_rl.checkpoint import sharded as C
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    _, out = two_checkpoints
    before = _unchanged(out)
    with pytest.raises(C.CheckpointError, match=r"optim\.lr: 0\.002 -> 0\.01.*rollout\.n: 4 -> 8"):
        _trainer(tiny_model_dir, out, "optim.lr=1e-2", "rollout.n=8", "trainer.total_steps=6")
    # A held-out split takes rows out of the training set: it changes what the run trains on.
    with pytest.raises(C.CheckpointError, match=r"data\.val_split: 0\.0 -> 0\.25"):
        _trainer(tiny_model_dir, out, "data.val_split=0.25", "trainer.total_steps=6")
    assert _unchanged(out) == before
    # Listed in trainer.resume_ignore: allowed (no longer the same run, the user said so).
    tr = _trainer(tiny_model_dir, out, "optim.lr=1e-2", "trainer.resume_ignore=[optim.lr]", "trainer.total_steps=6")
    assert tr.step_idx == 4
    before = _unchanged(out)  # that resume rewrote config.yaml: compare from here on
    other = build_tiny_model_dir(str(tmp_path / "other"), DIGIT_WORDS, hidden_size=48, num_layers=2)
    with pytest.raises(C.CheckpointError, match=r"another model.*hidden_size"):
        _trainer(other, out, "trainer.total_steps=6")
    meta_path = os.path.join(out, "checkpoints", "step_00000004", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["world_size"] = 2
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    _rewrite_manifest(os.path.dirname(meta_path))  # as if saved so: an edit alone reads as damage
    with pytest.raises(C.CheckpointError, match=r"written by 2 ranks, this run has 1"):
        _trainer(tiny_model_dir, out, "trainer.total_steps=6")
    assert _unchanged(out) == before


def _rewrite_manifest(path):
    from hybrid_rl.checkpoint import manifest

    manifest.write(path, manifest.describe(path, manifest.listing(path)))


def test_length_of_a_decaying_lr_is_part_of_the_run(tiny_model_dir, tmp_path):
    """With a cosine lr, another total_steps re-plans the decay (the lr of the next step would jump): refused
    unless resume_ignore lists it. A constant lr takes any length (test_resume_is_bit_exact extends k -> 2k)."""
    from hybrid_rl.checkpoint import sharded as C

    out = str(tmp_path / "run")
    _trainer(tiny_model_dir, out, "optim.lr_schedule=cosine", "trainer.total_steps=2", "trainer.save_every=2").fit()
    with pytest.raises(C.CheckpointError, match=r"trainer\.total_steps: 2 -> 4 \(the cosine lr schedule decays"):
        _trainer(tiny_model_dir, out, "optim.lr_schedule=cosine", "trainer.total_steps=4")
    same = _trainer(tiny_model_dir, out, "optim.lr_schedule=cosine", "trainer.total_steps=2")
    assert same.step_idx == 2
    replanned = _trainer(
        tiny_model_dir,
        out,
        "optim.lr_schedule=cosine",
        "trainer.total_steps=4",
        "trainer.resume_ignore=[trainer.total_steps]",
    )
    assert replanned.step_idx == 2
    # The next update uses the new schedule's lr for step 3 of 4: the cosine half-way down, not the floor.
    replanned.fit(1)
    assert replanned.state.history[-1]["actor/lr"] == pytest.approx(
        replanned.cfg.optim.lr * 0.5 * (1 + math.cos(math.pi * 2 / 3))
    )


def test_full_disk_keeps_previous_checkpoint(two_checkpoints, tiny_model_dir, monkeypatch):
    from hybrid_rl.checkpoint import sharded as C

    tr, out = two_checkpoints
    root = os.path.join(out, "checkpoints")
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):
        if str(f).endswith(".pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *a, **kw)

    tr.cfg.trainer.save_every = 0
    tr.fit(1)  # step 5
    monkeypatch.setattr(C.torch, "save", full_disk)
    with pytest.raises(C.CheckpointError, match=r"step_00000005.*No space left on device.*untouched"):
        tr.save_checkpoint()
    monkeypatch.undo()
    assert [s for s, _ in C.complete_checkpoints(root)] == [2, 4]
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")], "the temporary directory is removed"
    resumed = _trainer(tiny_model_dir, out, "trainer.total_steps=6")
    assert resumed.step_idx == 4


def test_save_while_optimizer_offloaded_equals_resident(tiny_model_dir, tmp_path):
    """Optimizer state on the host at save time: saved from there (as DTensors / tensors of the right
    shape), and left offloaded afterwards."""

    tr = _trainer(tiny_model_dir, str(tmp_path / "run"), "trainer.total_steps=2", "offload.optimizer=true")
    tr.phases.opt_offload.always_copy = True
    tr.fit()
    a = tr.save_checkpoint()
    tr.phases.opt_offload.offload()
    tr.cfg.trainer.checkpoint_dir = str(tmp_path / "offloaded")
    b = tr.save_checkpoint()
    assert not tr.phases.opt_offload.on_device, "the save must leave the optimizer where the switch keeps it"
    sa = torch.load(os.path.join(a, "rank_00000.pt"), weights_only=True)
    sb = torch.load(os.path.join(b, "rank_00000.pt"), weights_only=True)
    assert sa["step"] == sb["step"] == 2
    from torch.distributed.checkpoint import FileSystemReader

    ma = FileSystemReader(os.path.join(a, "state")).read_metadata().state_dict_metadata
    mb = FileSystemReader(os.path.join(b, "state")).read_metadata().state_dict_metadata
    assert ma.keys() == mb.keys() and any(k.startswith("optim.state.") for k in ma)
    for i, d in enumerate((a, b)):  # both resume; the resident save restores the optimizer state exactly
        fresh = _trainer(tiny_model_dir, str(tmp_path / f"check{i}"), f"trainer.resume={d}")
        assert fresh.step_idx == 2
        if d == a:
            got, want = fresh.optimizer.state_dict()["state"], tr.optimizer.state_dict()["state"]
            for j in want:
                for key in want[j]:
                    assert torch.equal(torch.as_tensor(got[j][key]), torch.as_tensor(want[j][key]).cpu())


def test_export_cli_writes_the_policy(two_checkpoints, tmp_path):
    from hybrid_rl.models.loading import load_causal_lm

    tr, out = two_checkpoints
    hf = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_rl.export", os.path.join(out, "checkpoints"), str(hf)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    exported = dict(load_causal_lm(str(hf)).named_parameters())
    trained = dict(tr.policy.named_parameters())
    assert exported.keys() == trained.keys()
    for name, p in trained.items():
        assert torch.equal(exported[name], p.detach()), name
    bad = subprocess.run(
        [sys.executable, "-m", "hybrid_rl.export", str(tmp_path / "nothing"), str(tmp_path / "x")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    assert not (tmp_path / "x").exists()


def test_export_keeps_the_source_models_dtype(tiny_model_dir, tmp_path):
    """A model that declares bf16 trains in fp32 on CPU; its checkpoint and export still declare bf16,
    and the export's weights are bf16 (half the bytes of the fp32 copy). An explicit dtype is declared as written."""
    from safetensors import safe_open

    from hybrid_rl.checkpoint.export import export_checkpoint
    from hybrid_rl.models.loading import load_causal_lm

    src = tmp_path / "bf16_model"
    shutil.copytree(tiny_model_dir, src)
    with open(src / "config.json") as f:
        config = json.load(f)
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    with open(src / "config.json", "w") as f:
        json.dump(config, f)
    out = str(tmp_path / "run")
    tr = _trainer(str(src), out, "trainer.total_steps=1", "trainer.save_every=1")
    tr.fit()

    def declared_and_stored(hf):
        with open(os.path.join(hf, "config.json")) as f:
            declared = json.load(f)["dtype"]
        with safe_open(os.path.join(hf, "model.safetensors"), "pt") as st:
            stored = {st.get_tensor(k).dtype for k in st.keys()}
        return declared, stored

    ckpt_dir = os.path.join(out, "checkpoints", "step_00000001")
    with open(os.path.join(ckpt_dir, "hf", "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert declared_and_stored(export_checkpoint(ckpt_dir, str(tmp_path / "auto"))) == ("bfloat16", {torch.bfloat16})
    exported = dict(load_causal_lm(str(tmp_path / "auto")).named_parameters())
    for name, p in tr.policy.named_parameters():
        assert torch.equal(exported[name], p.detach().bfloat16().float()), name
    assert declared_and_stored(export_checkpoint(ckpt_dir, str(tmp_path / "f16"), "float16")) == (
        "float16",
        {torch.float16},
    )
    assert declared_and_stored(export_checkpoint(ckpt_dir, str(tmp_path / "f32"), "float32")) == (
        "float32",
        {torch.float32},
    )


def test_sigint_mid_step_finishes_the_step_then_checkpoints(tiny_model_dir, tmp_path, capsys):
    """Ctrl-C inside step 2's reward: step 2 completes, a checkpoint of step 2 is written, the loggers
    are closed, and fit raises TrainingInterrupted (exit status 130); the handlers are restored. Its
    message is the last line fit prints (after the time split), as a clean stop should read."""
    import signal

    from hybrid_rl.runtime.stop import TrainingInterrupted
    from tests import checkpoint_helpers as H

    out = str(tmp_path / "run")
    H.CALLS.update(n=0, signal_at=3)  # call 1 is the start-up probe, call 2 is step 1
    tr = _trainer(
        tiny_model_dir, out, "trainer.total_steps=10", "reward.fn=tests.checkpoint_helpers:interrupting_digits"
    )
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted) as info:
        tr.fit()
    assert info.value.code == 128 + signal.SIGINT and info.value.step == 2
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == info.value.message and "time split over 2 steps" in printed[-2], printed[-3:]
    assert signal.getsignal(signal.SIGINT) is before
    assert info.value.checkpoint.endswith("step_00000002") and os.path.isfile(
        os.path.join(info.value.checkpoint, "meta.json")
    )
    assert tr.loggers == [], "the loggers are closed"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    H.CALLS.update(n=0, signal_at=0)
    resumed = _trainer(
        tiny_model_dir, out, "trainer.total_steps=3", "reward.fn=tests.checkpoint_helpers:interrupting_digits"
    )
    assert resumed.step_idx == 2


def test_no_checkpoint_inside_a_phase(tiny_model_dir, tmp_path):
    from hybrid_rl.switch.phases import PhaseError

    tr = _trainer(tiny_model_dir, str(tmp_path / "run"), "trainer.total_steps=1")
    with tr.phases.rollout():
        with pytest.raises(PhaseError, match="between steps"):
            tr.save_checkpoint()
    assert not os.path.exists(os.path.join(str(tmp_path / "run"), "checkpoints", "step_00000000"))


def test_resume_with_a_normalised_reward_model_is_bit_exact(tiny_model_dir, tmp_path):
    """The running mean/std of the model scores is state the next step reads: it is checkpointed."""
    from hybrid_rl.rewards.tiny_model import random_reward_model_dir

    rm = random_reward_model_dir(str(tmp_path / "rm"))
    result = straight_and_resumed(
        tiny_model_dir,
        str(tmp_path),
        K,
        f"reward.model_path={rm}",
        "reward.normalize_model=true",
        "reward.weights.rule=1.0",
        "reward.weights.model=0.5",
    )
    assert_same_run(result)
