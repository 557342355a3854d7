"""FSDP2 over 2 gloo ranks trains exactly like one plain process on the same batch.

Compared at every step: the loss, the gradient norm before clipping (AdamW's update is
nearly blind to a gradient's scale, so a lost world-size factor or a skipped normaliser
all-reduce shows in the norm, not in the weights), and the weights. Both sides run the same
update on the same batch (its mask from `build_sequences`), so this pins sharding and the global
normaliser, not the loss itself (tests/unit/test_batch.py and tests/unit/envs/test_episode_batch.py
compare the update's gradient with a naive per-sequence loop)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow


def _batch(model_dir: str):
    """A fixed global batch of 8 sequences: prompt lengths 2..5, response lengths 1..6."""
    from hybrid_rl.models.logprobs import build_sequences

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 15, (2 + i % 4,), generator=g).tolist() for i in range(8)]
    responses = [torch.randint(4, 15, (1 + (i * 5) % 6,), generator=g).tolist() for i in range(8)]
    ids, attn, mask, P = build_sequences(prompts, responses, pad_id=0)
    adv = torch.randn(8, generator=g)
    return ids, attn, mask.float(), P, adv


def _train(
    model_dir: str,
    rows: slice,
    steps: int,
    loss_agg: str,
    keep_model: str = "",
    max_tokens: int = 0,
    packing: bool = False,
):
    from hybrid_rl.batch import TrainBatch
    from hybrid_rl.config.schema import AlgorithmConfig
    from hybrid_rl.loop.update import UpdateSettings, policy_update, score_logprobs
    from hybrid_rl.models.fsdp import shard_model
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.runtime import distributed as D

    dev = D.init("cpu", timeout_s=60)
    if packing:  # every micro-batch packed, even one where packing would save little
        from hybrid_rl.models import packing as packing_mod

        packing_mod.MIN_SAVING = 0.0
    torch.manual_seed(0)
    model = shard_model(load_causal_lm(model_dir), dev, mixed_precision=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids, attn, mask, P, adv = _batch(model_dir)
    # Shift the old policy a little so the clipped ratio is not identically 1.
    shift = 0.1 * torch.sin(torch.arange(mask.numel(), dtype=torch.float32)).view_as(mask)
    ids, attn, mask, adv, shift = ids[rows], attn[rows], mask[rows], adv[rows], shift[rows]
    algo = AlgorithmConfig(loss_agg=loss_agg, kl_coef=0.0)
    losses = []
    for step in range(steps):
        old = (
            score_logprobs(model, ids, attn, P, 1.0, micro_batch_size=3, max_tokens=max_tokens, packing=packing) + shift
        )
        batch = TrainBatch(ids_NL=ids, attn_NL=attn, mask_NT=mask, P=P, adv_NT=adv[:, None] * mask, old_logp_NT=old)
        m = policy_update(
            policy=model,
            optimizer=opt,
            scheduler=sched,
            batch=batch,
            seed=step,
            settings=UpdateSettings(
                algo=algo,
                temperature=1.0,
                micro_batch_size=3,
                grad_clip=1.0,
                norm_length=6,
                max_tokens_per_micro_batch=max_tokens,
                packing=packing,
            ),
        )
        # The gradient of the step just taken (clipped in place; kept until the next zero_grad).
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        losses.append((m["actor/loss"], m["actor/grad_norm"], grads))
    full = {n: _full(p) for n, p in model.named_parameters()}
    if keep_model:
        from hybrid_rl.models.loading import load_tokenizer
        from hybrid_rl.models.saving import save_pretrained

        save_pretrained(model, load_tokenizer(model_dir), keep_model)
    return full, losses


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _all_configs_fn(rank: int, model_dir: str, configs: list) -> dict:
    """Every config on this rank in one launch (a launch costs more than a config's three steps); a config
    that raises is returned as its traceback, so only its own test fails."""
    import traceback

    from hybrid_rl.models import packing as packing_mod

    default, out = packing_mod.MIN_SAVING, {}
    for loss_agg, max_tokens, packing in configs:
        try:
            out[(loss_agg, max_tokens, packing)] = _train(
                model_dir,
                slice(rank * 4, rank * 4 + 4),
                steps=3,
                loss_agg=loss_agg,
                max_tokens=max_tokens,
                packing=packing,
            )
        except Exception:  # noqa: BLE001 - reported by the config's own test
            out[(loss_agg, max_tokens, packing)] = traceback.format_exc()
        packing_mod.MIN_SAVING = default
    return out


def _save_fn(rank: int, model_dir: str, out: str):
    weights, _ = _train(model_dir, slice(rank * 4, rank * 4 + 4), steps=1, loss_agg="token-mean", keep_model=out)
    return weights


def test_two_rank_save_writes_the_full_trained_model(tiny_model_dir, tmp_path):
    import json

    from hybrid_rl.models.loading import load_causal_lm

    out = str(tmp_path / "saved")
    w0, _ = run_ranks(_save_fn, world=2, args=(tiny_model_dir, out))
    with open(f"{out}/config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen2ForCausalLM"], (
            "FSDP's class name must not leak into the checkpoint"
        )
    loaded = dict(load_causal_lm(out).named_parameters())
    for name, ref in w0.items():
        assert torch.equal(loaded[name].detach(), ref), name


CONFIGS = [
    ("token-mean", 0, False),
    ("seq-mean-token-sum", 0, False),
    ("seq-mean-token-mean", 0, False),
    ("seq-mean-token-sum-norm", 0, False),
    ("seq-mean-token-mean", 16, False),
    ("token-mean", 0, True),
    ("seq-mean-token-sum-norm", 16, True),
]


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model_dir):
    """{config: (rank 0's result, rank 1's result)}, every config run on the same 2 gloo ranks."""
    r0, r1 = run_ranks(_all_configs_fn, world=2, args=(tiny_model_dir, CONFIGS))
    return {c: (r0[c], r1[c]) for c in CONFIGS}


@pytest.mark.parametrize("loss_agg,max_tokens,packing", CONFIGS)
def test_two_rank_fsdp_matches_one_process(tiny_model_dir, two_rank_runs, loss_agg, max_tokens, packing):
    """max_tokens=16: micro-batches by a token budget; rank 0's rows pack into 4 groups, rank 1's
    into 3, so rank 1 must split one to keep the FSDP collectives in step (else: a hang).
    packing: the ranks score and train padding-free, the single process padded: same gradients."""
    r0, r1 = two_rank_runs[(loss_agg, max_tokens, packing)]
    for rank, r in enumerate((r0, r1)):
        assert not isinstance(r, str), f"rank {rank} failed:\n{r}"
    (w0, l0), (w1, l1) = r0, r1
    ref_w, ref_l = _train(tiny_model_dir, slice(0, 8), steps=3, loss_agg=loss_agg)
    assert [x[:2] for x in l0] == [x[:2] for x in l1], "both ranks must report the same global loss and grad norm"
    for step, ((loss, norm, grads), (ref_loss, ref_norm, ref_grads)) in enumerate(zip(l0, ref_l)):
        assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6), f"step {step}: loss"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"step {step}: gradient norm before clipping"
        assert ref_norm > 1e-3, "a vanishing gradient would make the comparison meaningless"
        for name, g in ref_grads.items():
            torch.testing.assert_close(
                grads[name], g, rtol=1e-3, atol=1e-6, msg=lambda m: f"step {step} grad {name}: {m}"
            )
    moved = 0.0
    for name, ref in ref_w.items():
        torch.testing.assert_close(w1[name], w0[name], rtol=0, atol=0)
        if name.endswith("k_proj.bias"):
            # Softmax over keys is invariant to a key bias: its true gradient is 0, what autograd
            # returns is round-off, and AdamW turns round-off into lr-sized steps. Not comparable.
            continue
        # Loose: AdamW divides by sqrt(v), so where a gradient is near 0 round-off moves the weight
        # by up to lr; the gradients above are the exact comparison.
        torch.testing.assert_close(w0[name], ref, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
        moved = max(moved, (ref - load_initial(tiny_model_dir)[name]).abs().max().item())
    assert moved > 1e-3, "training must actually change the weights for the comparison to mean anything"


_INITIAL: dict = {}


def load_initial(model_dir: str) -> dict:
    if model_dir not in _INITIAL:
        from hybrid_rl.models.loading import load_causal_lm

        _INITIAL[model_dir] = {n: p.detach() for n, p in load_causal_lm(model_dir).named_parameters()}
    return _INITIAL[model_dir]
