"""PPO with a critic through the Trainer (issue 36): values in SCORE, GAE, the critic's update on the actor's
mini-batches, its warm-up, its residency under the phase switch, its checkpoint, and the four-model ledger.

The algorithms themselves are tests/unit/algorithms/test_gae.py (a naive loop from the GAE paper) and the critic
model tests/unit/models/test_value.py; here the oracles are the Trainer's own parts seen from outside: which
weights moved, which rows each update read, the bytes of each module counted from its parameters.
"""

from __future__ import annotations

import os

import pytest
import torch

from hybrid_rl import Trainer, load_config
from tests.checkpoint_helpers import comparable, overrides

PPO = ["algorithm.advantage=gae", "rollout.n=2", "critic.lr=5e-3", "algorithm.lam=0.95", "algorithm.gamma=1.0"]


def _trainer(model_dir: str, out: str, *extra: str) -> Trainer:
    return Trainer(load_config(None, overrides(model_dir, out, *PPO, *extra)))


def _local(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in module.named_parameters()}


def _moved(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[n], after[n]) for n in before)


def test_a_ppo_step_scores_values_and_trains_actor_and_critic(tiny_model_dir, tmp_path):
    """Catches: the critic never stepped, GAE not reaching the batch, critic metrics missing."""
    tr = _trainer(tiny_model_dir, str(tmp_path), "trainer.total_steps=1")
    policy0, critic0 = _local(tr.policy), _local(tr.critic)
    m = tr.step()
    assert _moved(policy0, _local(tr.policy)) and _moved(critic0, _local(tr.critic))
    for key in (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/vf_explained_var",
        "critic/grad_norm",
        "critic/lr",
    ):
        assert key in m and m[key] == m[key], key
    assert m["critic/lr"] == pytest.approx(5e-3)
    tr.close()


def test_the_actor_waits_while_the_critic_warms_up(tiny_model_dir, tmp_path):
    """critic.warmup_steps=1: step 1 trains the critic only, step 2 both. Catches: the warm-up ignored, or the
    critic frozen with the actor."""
    tr = _trainer(tiny_model_dir, str(tmp_path), "trainer.total_steps=2", "critic.warmup_steps=1")
    policy0, critic0 = _local(tr.policy), _local(tr.critic)
    m1 = tr.step()
    policy1, critic1 = _local(tr.policy), _local(tr.critic)
    assert not _moved(policy0, policy1) and _moved(critic0, critic1)
    assert m1["critic/warmup"] == 1.0 and "actor/loss" not in m1
    m2 = tr.step()
    assert _moved(policy1, _local(tr.policy)) and _moved(critic1, _local(tr.critic))
    assert m2["critic/warmup"] == 0.0 and "actor/loss" in m2
    tr.close()


@pytest.mark.parametrize("packing", [True, False])
def test_the_critic_trains_on_the_actors_mini_batches(tiny_model_dir, tmp_path, monkeypatch, packing):
    """Two mini-batches over two epochs: the rows of each critic optimizer step are exactly the rows of the actor's
    step with the same index (read from the token ids each forward receives), and the critic runs the forward layout
    the actor runs (trainer.packing), in SCORE and TRAIN. Catches: a critic shuffle of its own, a critic padded while
    the actor packs (twice the actor's forward, benchmarks/results/ppo_cpu_2026-11-28.md)."""
    from hybrid_rl.loop import critic_update as C
    from hybrid_rl.loop import update as U

    seen = {"actor": [], "critic": []}
    asked = {"actor": set(), "critic": set()}
    real_forward, real_value_function = U.logprob_function(False), C.value_function

    def actor_forward(model, ids, attn, P, temperature):
        if torch.is_grad_enabled():  # the update's forwards, not SCORE's
            seen["actor"].append(sorted(map(tuple, ids.tolist())))
        return real_forward(model, ids, attn, P, temperature)

    def actor_function(packing):
        asked["actor"].add(packing)
        return actor_forward

    def critic_function(*, packing):
        asked["critic"].add(packing)
        real_values = real_value_function(packing=packing)

        def critic_values(model, ids, attn, P):
            if torch.is_grad_enabled():
                seen["critic"].append(sorted(map(tuple, ids.tolist())))
            return real_values(model, ids, attn, P)

        return critic_values

    monkeypatch.setattr(U, "logprob_function", actor_function)
    monkeypatch.setattr(C, "value_function", critic_function)
    tr = _trainer(
        tiny_model_dir,
        str(tmp_path),
        "trainer.total_steps=1",
        "algorithm.mini_batch_size=4",
        "algorithm.ppo_epochs=2",
        "trainer.micro_batch_size=8",
        f"trainer.packing={str(packing).lower()}",
    )
    tr.step()
    assert len(seen["actor"]) == 4, "2 epochs x 2 mini-batches of 4 sequences, one micro-batch each"
    assert seen["critic"] == seen["actor"]
    assert seen["actor"][0] != seen["actor"][1], "the two mini-batches of an epoch hold different rows"
    assert asked["critic"] == asked["actor"] == {packing}
    tr.close()


def test_ppo_resumes_bit_exact_with_the_critic(tiny_model_dir, tmp_path):
    """2 steps straight vs 1 step, a checkpoint, a new Trainer for 1 more: equal metrics and equal critic weights
    and optimizer state. Catches: the critic or its optimizer or its scheduler missing from the checkpoint."""
    straight = _trainer(tiny_model_dir, str(tmp_path / "straight"), "trainer.total_steps=2")
    full = straight.fit()
    first = _trainer(tiny_model_dir, str(tmp_path / "resumed"), "trainer.total_steps=1", "trainer.save_every=1")
    first.fit()
    first.close()
    second = _trainer(tiny_model_dir, str(tmp_path / "resumed"), "trainer.total_steps=2")
    assert second.step_idx == 1
    rest = second.fit()
    assert [comparable(m) for m in rest] == [comparable(m) for m in full[1:]]
    a, b = _local(straight.critic), _local(second.critic)
    assert not _moved(a, b)
    sa = [v for s in straight.critic_optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    sb = [v for s in second.critic_optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert len(sa) == len(sb) > 0 and all(torch.equal(x, y) for x, y in zip(sa, sb))
    assert second.critic_scheduler.last_epoch == straight.critic_scheduler.last_epoch
    straight.close()
    second.close()


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_the_ledger_shows_four_models_per_phase(tiny_model_dir, tmp_path):
    """Actor, critic, reference and reward model in one tiny CPU run, the critic's weights and optimizer state
    offloaded during ROLLOUT: each one's bytes at each boundary, against its own parameter count (fp32, one rank).
    Catches: the critic resident in ROLLOUT when offloaded, missing from SCORE or TRAIN, its optimizer state never
    onloaded, its bytes billed under another role."""
    from hybrid_rl.rewards.tiny_model import random_reward_model_dir

    rm_dir = random_reward_model_dir(os.path.join(str(tmp_path), "rm"))
    tr = _trainer(
        tiny_model_dir,
        str(tmp_path / "run"),
        "trainer.total_steps=2",
        "algorithm.kl_coef=0.01",
        "algorithm.kl_placement=reward",
        "algorithm.kl_estimator=k1",
        f"reward.model_path={rm_dir}",
        "reward.weights={model: 1.0}",
        "critic.offload_params=true",
        "critic.offload_optimizer=true",
        "offload.ref=true",
        "offload.reward_model=true",
    )
    for off in (tr.phases.critic_offload, tr.phases.critic_opt_offload, tr.phases.ref_offload, tr.phases.rm_offload):
        off.always_copy = True  # CPU: the real copies
    tr.step()
    tr.step()  # AdamW makes its state at the first step: the second step's boundaries hold all of it
    critic, ref, rm = _bytes(tr.critic), _bytes(tr.ref), _bytes(tr.rewards.module)
    adam = 2 * critic  # exp_avg + exp_avg_sq, fp32
    rows = {s.label: s.roles for s in tr.phases.ledger.snapshots if s.rollout == 2}
    assert critic > 0 and ref > 0 and rm > 0
    assert rows["rollout:ready"]["critic"] == 0 and rows["rollout:ready"]["critic_optimizer"] == 0
    assert rows["reward:ready"]["reward_model"] == rm and rows["reward:ready"]["critic"] == 0
    assert rows["score:ready"]["critic"] == critic and rows["score:ready"]["ref"] == ref
    assert rows["score:ready"]["critic_optimizer"] == 0
    assert rows["train:ready"]["critic"] == critic and rows["train:ready"]["critic_optimizer"] == adam
    assert rows["train:ready"]["ref"] == 0 and rows["train:ready"]["reward_model"] == 0
    assert rows["train:end"]["grads"] >= critic, "the critic's gradients count with the policy's"
    tr.close()


@pytest.mark.parametrize(
    "extra,match",
    [
        (
            ["algorithm.advantage=grpo", "algorithm.lam=1.0", "critic.lr=1e-4"],
            "critic.lr.*only algorithm.advantage=gae",
        ),
        (["algorithm.advantage=grpo"], "algorithm.lam.*set algorithm.advantage=gae"),
        (["algorithm.lam=1.2"], "algorithm.lam.*\\[0, 1\\]"),
        (["algorithm.gamma=-0.1"], "algorithm.gamma.*\\[0, 1\\]"),
        (["critic.lr=0"], "critic.lr.*> 0"),
        (["critic.cliprange_value=0"], "critic.cliprange_value"),
        (["critic.path=/no/such/critic"], "critic.path.*does not exist"),
    ],
)
def test_bad_ppo_settings_name_the_key(tiny_model_dir, tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        Trainer(load_config(None, overrides(tiny_model_dir, str(tmp_path), *PPO, *extra)))
    assert not os.path.exists(os.path.join(str(tmp_path), "checkpoints")), "nothing written"


def test_the_export_writes_the_critic_on_request(tiny_model_dir, tmp_path):
    """python -m hybrid_rl.export <ckpt> <dir> --critic <dir2>: the policy as always, and the trained critic, which
    load_value_model reads back equal to the Trainer's (head included). Catches: the critic exported untrained (a
    fresh head, the policy's body), or the flag accepted for a run without a critic."""
    from hybrid_rl.checkpoint.export import main as export_main
    from hybrid_rl.models.value import load_value_model

    tr = _trainer(tiny_model_dir, str(tmp_path / "run"), "trainer.total_steps=1", "trainer.save_every=1")
    tr.fit()
    trained = _local(tr.critic)
    tr.close()
    ckpt = str(tmp_path / "run" / "checkpoints")
    assert export_main([ckpt, str(tmp_path / "policy"), "--critic", str(tmp_path / "critic")]) == 0
    back = _local(load_value_model(str(tmp_path / "critic")))
    assert set(back) == set(trained) and not _moved(trained, back)
    fresh = _local(load_value_model(tiny_model_dir))
    assert _moved(fresh, back), "the export must carry the trained critic, not a fresh one"
    grpo = Trainer(load_config(None, overrides(tiny_model_dir, str(tmp_path / "grpo"), "trainer.total_steps=1")))
    grpo.fit()
    grpo.save_checkpoint()
    grpo.close()
    code = export_main([str(tmp_path / "grpo" / "checkpoints"), str(tmp_path / "p2"), "--critic", str(tmp_path / "c2")])
    assert code == 2
