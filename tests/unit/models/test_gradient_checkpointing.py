"""Gradient checkpointing acts in the update, and the planner's activation estimate matches what
autograd keeps.

transformers recomputes a checkpointed decoder layer only while it is in train mode, so the update
must put the policy in train mode (`update.policy_update`); rollout, scoring and the reference stay
in eval mode. What a layer recomputes is seen by counting its sublayers' calls: pre-hooks, because
they sit inside the checkpoint whether transformers checkpoints a layer's `__call__` (5.19) or its
`forward` (later releases), and because the non-reentrant recompute may stop before a sublayer
finishes. The bytes the forward keeps for the backward are read with
`torch.autograd.graph.saved_tensors_hooks`, plus the layer inputs a checkpoint holds itself.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.config.load import load_config
from hybrid_rl.loop.update import logprob_function, train_mode
from hybrid_rl.models.fsdp import prepare_policy
from hybrid_rl.models.loading import decoder_layers
from hybrid_rl.plan.memory import ModelArch, activation_estimate, activation_parts
from hybrid_rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _record_calls(model: torch.nn.Module) -> tuple[list, list]:
    """Pre-hooks on the model and on every decoder layer's sublayers; each call appends
    (name, grad enabled, module in train mode). Returns (calls, hook handles)."""
    calls, handles = [], []

    def hook(name):
        def pre(module, args):
            calls.append((name, torch.is_grad_enabled(), module.training))

        return pre

    handles.append(model.register_forward_pre_hook(hook("model")))
    for i, layer in enumerate(decoder_layers(model)):
        for child_name, child in layer.named_children():
            handles.append(child.register_forward_pre_hook(hook(f"layer{i}.{child_name}")))
    return calls, handles


@pytest.mark.parametrize("checkpointing", [True, False])
def test_trainer_update_recomputes_every_layer_in_train_mode(tiny_trainer_overrides, checkpointing):
    # Two epochs: SCORE runs the policy's forward for old log-probs; the KL in the loss brings the reference.
    trainer = Trainer(
        load_config(
            None,
            [
                *tiny_trainer_overrides,
                f"model.gradient_checkpointing={checkpointing}",
                "algorithm.ppo_epochs=2",
                "algorithm.kl_coef=0.05",
                "algorithm.kl_placement=loss",
            ],
        )
    )
    try:
        assert trainer.ref is not None
        policy_calls, handles = _record_calls(trainer.policy)
        ref_calls, ref_handles = _record_calls(trainer.ref)
        trainer.step()
        for h in handles + ref_handles:
            h.remove()
        forwards = sum(1 for name, grad, _ in policy_calls if name == "model" and grad)
        assert forwards >= 2, "the update ran no forward with gradients"
        sublayers = sorted({name for name, _, _ in policy_calls if name != "model"})
        assert sublayers, "no decoder-layer sublayer was called"
        per_forward = 2 if checkpointing else 1  # the forward, and with checkpointing the backward's recompute
        for name in sublayers:
            n = sum(1 for other, grad, _ in policy_calls if other == name and grad)
            assert n == per_forward * forwards, (
                f"{name} ran {n} times with gradients over {forwards} update forwards; expected {per_forward} "
                f"each (checkpointing={checkpointing})"
            )
        assert all(training for _, grad, training in policy_calls if grad), "the update ran the policy in eval mode"
        no_grad = [training for _, grad, training in policy_calls if not grad]
        assert no_grad and not any(no_grad), "scoring (and rollout) must run the policy in eval mode"
        assert ref_calls and not any(grad or training for _, grad, training in ref_calls), (
            "the reference must run without gradients, in eval mode"
        )
        for name, model in (("policy", trainer.policy), ("reference", trainer.ref)):
            assert not any(m.training for m in model.modules()), f"the {name} was left in train mode"
    finally:
        trainer.close()


def test_train_mode_restores_each_submodule():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).eval()
    model[1].train()  # a mixed state comes back as it was, not flattened to the root's mode
    with train_mode(model):
        assert all(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [False, False, True]


def _qwen2(
    dtype=torch.float32, hidden=64, intermediate=256, layers=4, heads=4, kv_heads=2, vocab=512, **config
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()


def _batch(vocab: int, N: int = 4, L: int = 48, P: int = 20) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (N, L), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :5] = 0  # a left-padded prompt
    attn[1, P + 10 :] = 0  # a short response
    return ids, attn, P


def test_prepare_policy_turns_dropout_off_and_keeps_the_config():
    model = _qwen2(attention_dropout=0.5)
    ids, attn, P = _batch(512)
    forward = logprob_function(packing=False)
    with torch.no_grad():
        eval_logp, _ = forward(model, ids, attn, P, 1.0)
        with train_mode(model):
            noisy, _ = forward(model, ids, attn, P, 1.0)
        assert not torch.allclose(noisy, eval_logp, atol=1e-4), "the test needs dropout that acts in train mode"
        prepare_policy(model, gradient_checkpointing=True)
        with train_mode(model):
            train_logp, _ = forward(model, ids, attn, P, 1.0)
    torch.testing.assert_close(train_logp, eval_logp, rtol=0, atol=1e-6)
    assert model.config.attention_dropout == 0.5, "the saved config keeps the user's value"


def test_checkpointed_gradients_equal_plain_ones():
    plain, checkpointed = _qwen2(), prepare_policy(_qwen2(), gradient_checkpointing=True)
    ids, attn, P = _batch(512)
    grads = []
    for model in (plain, checkpointed):
        with train_mode(model):
            logp, ent = logprob_function(packing=False)(model, ids, attn, P, 1.0)
            (logp.sum() + 0.1 * ent.sum()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _saved_bytes(model: torch.nn.Module, ids, attn, P: int) -> int:
    """Bytes of the distinct storages the update's forward keeps for its backward, parameters aside:
    what autograd saves, and the inputs each checkpointed layer holds to recompute from."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()

    def pack(t):
        keep(t)
        return t

    def layer_inputs(module, args, kwargs):
        for x in (*args, *kwargs.values()):
            for t in x if isinstance(x, tuple) else (x,):
                if isinstance(t, torch.Tensor):
                    keep(t)

    handles = [layer.register_forward_pre_hook(layer_inputs, with_kwargs=True) for layer in decoder_layers(model)]
    try:
        with train_mode(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = logprob_function(packing=False)(model, ids, attn, P, 1.0)
    finally:
        for h in handles:
            h.remove()
    total = sum(kept.values())
    logp.sum().backward()  # the graph was complete
    return total


# GQA with KV heads repeated for attention, and plain multi-head attention with another MLP width.
SHAPES = {
    "gqa": dict(hidden=64, intermediate=256, layers=4, heads=4, kv_heads=2, vocab=512),
    "mha": dict(hidden=96, intermediate=160, layers=3, heads=6, kv_heads=6, vocab=300),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_estimate_matches_the_saved_bytes(shape, dtype):
    dims = SHAPES[shape]
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    N, L = 4, 48
    ids, attn, P = _batch(dims["vocab"], N, L)
    measured = {}
    for checkpointing in (False, True):
        model = prepare_policy(_qwen2(torch_dtype, **dims), gradient_checkpointing=checkpointing)
        arch = ModelArch.from_hf_config(model.config.to_dict())
        measured[checkpointing] = _saved_bytes(model, ids, attn, P)
        parts = activation_parts(arch, dtype, N, L, checkpointing)
        # Stated factor: the estimate's saved part is within 25% of the measurement (it was 0.88-1.04 when
        # written; the attention mask and rotary tables are not billed).
        ratio = parts["saved"] / measured[checkpointing]
        assert 0.8 <= ratio <= 1.25, (
            f"checkpointing={checkpointing}: estimate {parts['saved']} bytes saved for "
            f"backward, measured {measured[checkpointing]} (ratio {ratio:.2f})"
        )
        assert activation_estimate(arch, dtype, N, L, checkpointing) == sum(parts.values())
        assert (parts["recompute"] > 0) == checkpointing
    # Checkpointing keeps one hidden state per layer instead of about 28: the reason to turn it on.
    assert measured[True] < measured[False] / 5


def test_head_sizes_follow_the_kernel():
    import hybrid_rl.plan.memory as plan
    from hybrid_rl.kernels import lm_head

    assert (plan._HEAD_CHUNK_BYTES, plan._HEAD_ONE_CHUNK_BYTES, plan._HEAD_MIN_CHUNKS) == (
        lm_head._CHUNK_BYTES,
        lm_head._ONE_CHUNK_BYTES,
        lm_head._MIN_CHUNKS,
    )
    arch = plan.builtin_arch("Qwen2.5-7B")
    # 16 rows x 1024 tokens: the head holds about 2.25 chunks of 256 MiB, not the (16k, V) fp32 logits.
    assert activation_parts(arch, "bf16", 16, 1024)["head"] == 9 * lm_head._CHUNK_BYTES // 4


def _fsdp_update_fn(rank: int, model_dir: str) -> dict:
    """One update of the FSDP2-sharded tiny policy on this rank's 4 rows, without and with checkpointing:
    {checkpointing: (loss, full gradients, {sublayer: calls with gradients}, update forwards)}."""
    import functools

    from hybrid_rl.batch import TrainBatch
    from hybrid_rl.config.schema import AlgorithmConfig
    from hybrid_rl.loop.update import UpdateSettings, policy_update
    from hybrid_rl.models.fsdp import load_sharded
    from hybrid_rl.models.logprobs import build_sequences
    from hybrid_rl.runtime import distributed as D

    dev = D.init("cpu", timeout_s=60)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 15, (2 + i % 3,), generator=g).tolist() for i in range(8)]
    responses = [torch.randint(4, 15, (1 + (i * 5) % 6,), generator=g).tolist() for i in range(8)]
    ids, attn, mask, P = build_sequences(prompts, responses, pad_id=0)
    rows = slice(4 * rank, 4 * rank + 4)
    adv = torch.randn(8, generator=g)[rows, None] * mask[rows].float()
    out = {}
    for checkpointing in (False, True):
        (policy,) = load_sharded(
            model_dir, dev, False, "sdpa", [functools.partial(prepare_policy, gradient_checkpointing=checkpointing)]
        )
        calls, handles = _record_calls(policy)
        opt = torch.optim.SGD(policy.parameters(), lr=0.0)
        batch = TrainBatch(ids_NL=ids[rows], attn_NL=attn[rows], mask_NT=mask[rows].float(), P=P, adv_NT=adv)
        settings = UpdateSettings(
            algo=AlgorithmConfig(kl_coef=0.0), temperature=1.0, micro_batch_size=2, grad_clip=1e9, norm_length=6
        )
        metrics = policy_update(
            policy=policy,
            optimizer=opt,
            scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
            batch=batch,
            settings=settings,
            seed=0,
        )
        for h in handles:
            h.remove()
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in policy.named_parameters()
        }
        counts = {}
        for name, grad, _ in calls:
            counts[name] = counts.get(name, 0) + int(grad)
        out[checkpointing] = (metrics["actor/loss"], grads, counts, policy.training)
    return out


@pytest.mark.slow
def test_fsdp2_checkpointed_update_matches_plain(tiny_model_dir):
    """Two gloo ranks, FSDP2 per layer and root (as on GPU): the non-reentrant recompute runs inside
    FSDP2's backward, every sublayer twice per forward, and the gradients equal the plain update's."""
    from tests.distributed.launch import run_ranks

    for rank, out in enumerate(run_ranks(_fsdp_update_fn, world=2, args=(tiny_model_dir,))):
        (loss0, grads0, counts0, train0), (loss1, grads1, counts1, train1) = out[False], out[True]
        forwards = counts0["model"]
        assert forwards == counts1["model"] == 2, f"rank {rank}: two micro-batches, one forward each"
        for name, n in counts0.items():
            if name != "model":
                assert (n, counts1[name]) == (forwards, 2 * forwards), f"rank {rank}: {name} ran {n}, {counts1[name]}"
        assert not train0 and not train1, "the policy leaves the update in eval mode"
        assert loss1 == pytest.approx(loss0, rel=1e-6)
        for name, g in grads0.items():
            torch.testing.assert_close(grads1[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"rank {rank} {name}: {m}")
