"""Tests for the memory planner (hybrid_rl.plan.memory) and its CLI (hybrid_rl.plan.cli)."""

import json
import subprocess
import sys

import pytest

from hybrid_rl.plan.memory import (
    GB,
    GIB,
    PHASES,
    ROLES,
    ModelArch,
    builtin_arch,
    count_parameters,
    kv_cache_bytes,
    plan_memory,
    suggest_offload,
)

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _hf_count(config) -> tuple[int, dict]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), config.to_dict()


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("kind", ["qwen2", "llama", "llama_bias", "qwen3"])
def test_count_parameters_matches_transformers(kind, tie):
    import transformers

    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=tie)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=tie)
    elif kind == "llama_bias":
        cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=tie, attention_bias=True, mlp_bias=True)
    else:
        cfg = transformers.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=tie)
    expected, d = _hf_count(cfg)
    arch = ModelArch.from_hf_config(d)
    assert count_parameters(arch) == expected


def test_from_hf_config_path_and_dir(tmp_path):
    import transformers

    cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=False)
    cfg.save_pretrained(tmp_path)
    a_dir = ModelArch.from_hf_config(tmp_path)
    a_file = ModelArch.from_hf_config(str(tmp_path / "config.json"))
    assert (
        count_parameters(a_dir) == count_parameters(a_file) == count_parameters(ModelArch.from_hf_config(cfg.to_dict()))
    )
    assert a_dir.qkv_bias and a_dir.kv_heads == 2 and a_dir.head_dim == 8


@pytest.mark.parametrize(
    "name,n",
    [
        ("Qwen2.5-0.5B", 494_032_768),
        ("Qwen2.5-1.5B", 1_543_714_304),
        ("Qwen2.5-7B", 7_615_616_512),
        ("Qwen2.5-32B", 32_763_876_352),
        ("Llama-3-8B", 8_030_261_248),
        ("Llama-3-70B", 70_553_706_496),
    ],
)
def test_builtin_counts_match_published(name, n):
    assert count_parameters(builtin_arch(name)) == n
    assert builtin_arch(name.lower() + "-Instruct").name == name


def test_70b_bill():
    plan = plan_memory(ModelArch(num_params=int(70e9)), n_gpus=8, dtype="bf16", batch=64, context=4096)
    assert plan.bill["learner"] == 1120 * GB
    assert plan.bill["ref"] == 140 * GB
    assert plan.bill["engine_copy"] == 140 * GB
    learner = sum(plan.total[r] for r in ("policy_weights", "grads", "optimizer"))
    assert learner == 1120 * GB and plan.total["ref"] == 140 * GB
    assert plan.per_gpu["policy_weights"] == 6 * 70e9 / 8 and plan.per_gpu["grads"] == 2 * 70e9 / 8
    assert plan.per_gpu["optimizer"] == 8 * 70e9 / 8 and plan.per_gpu["engine_weights"] == 140 * GB
    assert plan.per_gpu["kv_cache"] == 0 and plan.notes  # no KV dims: said so
    # fp32: 4 + 4 + 8 = 16N as well
    p32 = plan_memory(ModelArch(num_params=10**9), 4, "fp32", 1, 1)
    assert p32.bill["learner"] == 16 * 10**9 and p32.per_gpu["policy_weights"] == 10**9
    assert p32.per_gpu["grads"] == 10**9 and p32.per_gpu["ref"] == 10**9


def test_kv_cache_hand_computation():
    a = builtin_arch("Qwen2.5-7B")  # 28 layers, 4 KV heads, head_dim 128
    per_token = 2 * 28 * 4 * 128 * 2
    assert per_token == 57_344
    # 256 seqs over 8 DP ranks = 32 seqs x 4096 tokens each
    assert kv_cache_bytes(a, "bf16", 256, 4096, n_gpus=8) == 32 * 4096 * 57_344 == 7_516_192_768
    # tp=2: 4 DP ranks -> 64 seqs each, heads split in 2
    assert kv_cache_bytes(a, "bf16", 256, 4096, n_gpus=8, tp_size=2) == 64 * 4096 * 57_344 // 2
    # ragged batch rounds up per rank; tp above KV heads replicates heads
    assert kv_cache_bytes(a, "fp32", 9, 10, n_gpus=8) == 2 * 10 * 2 * 28 * 4 * 128 * 4
    # tp=8 > 4 KV heads: 1 DP rank holds all 8 seqs, one (replicated) KV head per GPU
    assert kv_cache_bytes(a, "bf16", 8, 10, n_gpus=8, tp_size=8) == 8 * 10 * 2 * 28 * 1 * 128 * 2
    plan = plan_memory(a, 8, "bf16", 256, 4096)
    assert plan.per_gpu["kv_cache"] == 7_516_192_768
    # --params with explicit KV dims
    arch = ModelArch(num_params=int(70e9), num_hidden_layers=80, num_key_value_heads=8, head_dim_=128)
    assert kv_cache_bytes(arch, "bf16", 64, 4096, n_gpus=8) == 8 * 4096 * 2 * 80 * 8 * 128 * 2


def test_phase_rules_with_offload_flags():
    a = builtin_arch("Qwen2.5-1.5B")
    rm = builtin_arch("Qwen2.5-0.5B")
    none = plan_memory(a, 4, "bf16", 16, 1024, {}, reward_arch=rm)
    assert set(none.phases["train"]) == {"policy_weights", "grads", "optimizer", "ref", "reward_model"}
    assert set(none.phases["rollout"]) == {
        "engine_weights",
        "kv_cache",
        "policy_weights",
        "optimizer",
        "ref",
        "reward_model",
    }
    assert set(none.phases["score"]) == {"policy_weights", "optimizer", "ref", "reward_model"}
    for p in PHASES:
        assert none.phase_totals[p] == sum(none.phases[p].values())
        assert none.fits[p]
    assert set(none.per_gpu) == set(ROLES)
    assert none.per_gpu["reward_model"] == -(-2 * count_parameters(rm) // 4)

    allf = plan_memory(
        a, 4, "bf16", 16, 1024, {"optimizer": True, "params": True, "ref": True, "reward_model": True}, reward_arch=rm
    )
    assert set(allf.phases["train"]) == {"policy_weights", "grads", "optimizer"}
    assert set(allf.phases["rollout"]) == {"engine_weights", "kv_cache"}
    assert set(allf.phases["score"]) == {"policy_weights", "ref"}
    assert set(allf.phases["reward"]) == {"engine_weights", "reward_model"}  # the REWARD stage (switch/phases.py)

    opt = plan_memory(a, 4, "bf16", 16, 1024, {"optimizer": True}, reward_arch=rm)
    assert "optimizer" not in opt.phases["rollout"] and "optimizer" not in opt.phases["score"]
    assert "optimizer" in opt.phases["train"] and "ref" in opt.phases["train"]
    assert opt.phase_totals["rollout"] == none.phase_totals["rollout"] - none.per_gpu["optimizer"]


def test_activation_estimate_only_in_train():
    a = builtin_arch("Qwen2.5-0.5B")
    p = plan_memory(a, 2, "bf16", 8, 512, train_micro_batch=2)
    assert p.activations_estimate > 0
    assert p.phases["train"]["activations_estimate"] == p.activations_estimate
    assert "activations_estimate" not in p.phases["rollout"]


def test_activation_estimate_follows_gradient_checkpointing():
    # model.gradient_checkpointing=false keeps every layer's activations: the plan must bill them, not the
    # checkpointed estimate (the recipe passes the config's flag; the CLI takes --no-gradient-checkpointing).
    from hybrid_rl.plan.memory import activation_estimate

    a = builtin_arch("Qwen2.5-7B")
    on = plan_memory(a, 8, "bf16", 64, 2048, train_micro_batch=4)
    off = plan_memory(a, 8, "bf16", 64, 2048, train_micro_batch=4, gradient_checkpointing=False)
    assert on.activations_estimate == activation_estimate(a, "bf16", 4, 2048, checkpointing=True)
    assert off.activations_estimate == activation_estimate(a, "bf16", 4, 2048, checkpointing=False)
    assert off.activations_estimate > 3 * on.activations_estimate
    assert off.phase_totals["train"] - on.phase_totals["train"] == off.activations_estimate - on.activations_estimate
    assert (on.gradient_checkpointing, off.gradient_checkpointing) == (True, False)
    r = _cli(
        "--model",
        "Qwen2.5-7B",
        "--gpus",
        "8",
        "--batch",
        "64",
        "--context",
        "2048",
        "--train-micro-batch",
        "4",
        "--no-gradient-checkpointing",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["activations_estimate"] == off.activations_estimate
    assert "WITHOUT gradient checkpointing" in r.stdout


def test_suggest_offload_makes_7b_fit():
    a = builtin_arch("Qwen2.5-7B")
    args = (a, 8, "bf16", 896, 8192)  # rollout 83.1 GB: over the 79.46 GB usable (80 GiB less the margin)
    plan = plan_memory(*args, {}, gpu_mem_gib=80)
    assert not plan.fits["rollout"] and plan.fits["train"] and plan.shortfall["rollout"] > 0
    s = suggest_offload(*args, {}, gpu_mem_gib=80)
    assert s["fits"] and s["added"] == ["optimizer"]
    assert plan_memory(*args, s["offload"], gpu_mem_gib=80).fits_all
    # fits without anything: empty suggestion
    s0 = suggest_offload(a, 8, "bf16", 256, 4096, {})
    assert s0["fits"] and s0["added"] == [] and not any(s0["offload"].values())
    # user flags are kept
    s1 = suggest_offload(*args, {"ref": True}, gpu_mem_gib=80)
    assert s1["offload"]["ref"] and s1["offload"]["optimizer"]


def test_suggest_offload_nothing_fits():
    s = suggest_offload(builtin_arch("Llama-3-70B"), 8, "bf16", 64, 4096, {})
    assert not s["fits"] and s["phase"] in PHASES and s["shortfall_bytes"] > 0
    assert s["phase"] in s["message"] and "GB" in s["message"]


@pytest.mark.parametrize(
    "kw,word",
    [
        (dict(n_gpus=0), "n_gpus"),
        (dict(batch=-1), "batch"),
        (dict(context=0), "context"),
        (dict(gpu_mem_gib=0), "gpu_mem_gib"),
        (dict(dtype="int8"), "dtype"),
        (dict(tp_size=3), "tp_size"),
        (dict(offload={"weights": True}), "weights"),
    ],
)
def test_bad_inputs(kw, word):
    args = dict(arch=builtin_arch("Qwen2.5-0.5B"), n_gpus=4, dtype="bf16", batch=8, context=128)
    args.update(kw)
    with pytest.raises(ValueError, match=word):
        plan_memory(**args)


def test_bad_configs(tmp_path):
    with pytest.raises(ValueError, match="Qwen2.5-7B"):
        builtin_arch("Qwen9-1T")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "vocab_size": 10}))
    with pytest.raises(ValueError) as e:
        ModelArch.from_hf_config(tmp_path)
    msg = str(e.value)
    assert "intermediate_size" in msg and "num_hidden_layers" in msg and "config.json" in msg
    with pytest.raises(ValueError, match="not found"):
        ModelArch.from_hf_config(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="hidden_size"):
        count_parameters(ModelArch())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hybrid_rl.plan", *args], capture_output=True, text=True, timeout=60)


def test_cli_json_last_line_and_errors(tmp_path):
    r = _cli(
        "--model",
        "Qwen2.5-7B",
        "--gpus",
        "8",
        "--batch",
        "256",
        "--context",
        "4096",
        "--gpu-mem-gib",
        "80",
        "--offload",
        "optimizer,ref",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    d = json.loads(lines[-1])
    assert d["n_params"] == 7_615_616_512 and d["fits_all"] and d["offload"]["optimizer"]
    assert d["gpu_mem_bytes"] == 80 * GIB and d["per_gpu"]["kv_cache"] == 7_516_192_768
    assert "policy_weights" in r.stdout and "suggested offload" in r.stdout and "fits" in r.stdout

    r = _cli(
        "--params",
        "70e9",
        "--gpus",
        "8",
        "--batch",
        "64",
        "--context",
        "4096",
        "--layers",
        "80",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["bill"] == {
        "learner": 1120 * GB,
        "ref": 140 * GB,
        "engine_copy": 140 * GB,
        "reward_model": 0,
        "engine_replicas": 8,
    }
    assert "1,120.00 GB" in r.stdout and "does NOT fit (short by" in r.stdout
    assert d["per_gpu"]["kv_cache"] == 8 * 4096 * 2 * 80 * 8 * 128 * 2

    import transformers

    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    r = _cli("--model", str(tmp_path / "config.json"), "--gpus", "2", "--batch", "4", "--context", "64")
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout.strip().splitlines()[-1])

    for bad, word in [
        (["--model", "Qwen2.5-7B", "--gpus", "0", "--batch", "1", "--context", "1"], "--gpus"),
        (["--model", "nosuch", "--gpus", "1", "--batch", "1", "--context", "1"], "built-in names"),
        (["--model", "Qwen2.5-7B", "--gpus", "1", "--batch", "1", "--context", "1", "--offload", "weights"], "weights"),
        (["--gpus", "1", "--batch", "1", "--context", "1"], "--params"),
    ]:
        r = _cli(*bad)
        assert r.returncode != 0 and word in r.stderr, (bad, r.stderr)


def test_planner_cli_imports_no_torch():
    # The runtime ledger imports ROLES from the planner, never the other way round, so
    # sizing a run stays a quick, torch-free command (and hybrid_rl/__init__ stays lazy).
    code = "import sys, hybrid_rl.plan.cli; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", "hybrid_rl.plan.cli must stay free of torch imports"


def test_native_rollout_bills_prefill_sampling_and_caps_the_batch_by_hand():
    """Qwen2.5-7B on 8 x 80 GiB, the 7B recipe's native rollout: 5120 sequences (640 per GPU, 5 per
    prompt), prompts of 512 tokens, 1024 new, plain sampling, CUDA graphs."""
    a = builtin_arch("Qwen2.5-7B")
    n = count_parameters(a)
    cap = 80 * GIB
    plan = plan_memory(
        a,
        8,
        "bf16",
        5120,
        1536,
        {"ref": True},
        gpu_mem_gib=80,
        native_prompt_tokens=512,
        native_top_p=False,
        native_samples_per_prompt=5,
    )
    resident = 6 * n // 8 + 8 * n // 8 + 2 * n  # policy shard, optimizer shard, gathered bf16 weights
    margin = 2 * GIB + int(0.05 * cap)  # CUDA context + NCCL, and 5% for fragmentation (plan.memory.margin_bytes)
    free = cap - margin - resident
    kv_row = 2 * 28 * 4 * 128 * 2 * 1535  # S = 512 + 1024 - 1 slots
    dec_row = (
        152_064 * 10  # sampling: bf16 logits + fp32 copy + exp
        + 28 * 1535 * 14
        + 152_064 * 2
        + 8 * 3584
        + 2 * (3 * 18944 + 6 * 3584 + 36 * 128)  # decode step
        + 2 * 152_064 * 2  # graph pools: every graph size's logits
        + 4 * 1535 * 128 * 2
        + 12 * 1024
        + 1535
    )  # bookkeeping
    prefill_prompt = 512 * (2 * (3 * 18944 + 6 * 3584 + 36 * 128) + 8 * 3584) + 152_064 * 2
    rows = free // (kv_row + dec_row)
    assert 320 <= rows < 640  # all 640 at once do not fit: two batches of 320
    r = plan.native_rollout
    assert (r["rows"], r["rows_wanted"]) == (320, 640)
    assert r["prefill_rows"] == min(64, (free - 320 * kv_row) // prefill_prompt) == 64  # 64 distinct prompts
    assert r["prefill"] == 64 * prefill_prompt and r["sampling"] == 320 * 152_064 * 10
    assert r["working"] == max(r["prefill"], 320 * dec_row)
    assert plan.phases["rollout"]["kv_cache"] == plan.per_gpu["kv_cache"] == 320 * kv_row
    assert plan.phases["rollout"]["rollout_working"] == r["working"]
    assert plan.margin_bytes == margin and "rollout_headroom" not in plan.phases["rollout"]
    assert plan.phase_totals["rollout"] == resident + 320 * kv_row + r["working"] <= cap - margin
    # Without the native bill (SGLang sizes its own pool), the rollout phase holds the whole batch's cache.
    whole = plan_memory(a, 8, "bf16", 5120, 1536, {"ref": True})
    assert whole.per_gpu["kv_cache"] == 640 * 1536 * 57_344 and "rollout_working" not in whole.phases["rollout"]


def test_native_rollout_that_cannot_hold_one_sequence_does_not_fit():
    a = builtin_arch("Qwen2.5-7B")
    plan = plan_memory(
        a,
        1,
        "bf16",
        8,
        1536,
        {"optimizer": True, "ref": True, "params": True},
        gpu_mem_gib=15,
        native_prompt_tokens=512,
    )
    assert plan.native_rollout["fits_one_row"] == 0 and not plan.fits["rollout"]
    with pytest.raises(ValueError, match="no new tokens"):
        plan_memory(a, 8, "bf16", 8, 512, gpu_mem_gib=80, native_prompt_tokens=512)
    with pytest.raises(ValueError, match="full architecture"):
        plan_memory(ModelArch(num_params=7 * 10**9), 8, "bf16", 8, 1536, native_prompt_tokens=512)


def test_cli_prints_the_native_rollout_and_its_margin():
    r = _cli(
        "--model",
        "Qwen2.5-7B",
        "--gpus",
        "8",
        "--batch",
        "5120",
        "--context",
        "1536",
        "--offload",
        "ref",
        "--native-prompt-tokens",
        "512",
        "--native-sampler",
        "plain",
        "--samples-per-prompt",
        "5",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["native_rollout"]["rows"] == 320 and "rollout_working" in r.stdout
    assert "native rollout: 320 of 640 rows per GPU per decode batch (2 batches)" in r.stdout
    spare = d["gpu_mem_bytes"] - d["margin_bytes"] - d["phase_totals"]["rollout"]
    assert f"native rollout spare: {spare / GB:,.2f} GB per GPU" in r.stdout


def test_vllm_bills_its_weight_copy_and_the_kv_cache_it_allocates_by_hand():
    """engine="vllm": 1/tp of a bf16 copy, and the KV cache vLLM is given at start-up, whole: one batch in
    blocks of 128 tokens + 4 MiB spare (null), the configured bytes, or its device share minus its weights."""
    a = builtin_arch("Qwen2.5-7B")  # N = 7,615,616,512; 28 layers, 4 KV heads, head_dim 128: 57,344 B/token
    kw = dict(n_gpus=8, dtype="bf16", batch=256, context=4000, tp_size=2)
    generic = plan_memory(a, **kw)
    assert generic.per_gpu["kv_cache"] == 64 * 4000 * 57_344 // 2  # 4 engines x 64 sequences, heads split in 2
    plan = plan_memory(a, **kw, engine="vllm")
    assert plan.per_gpu["engine_weights"] == 7_615_616_512  # 2 bytes x N / tp 2
    assert plan.per_gpu["kv_cache"] == 64 * 4096 * 28_672 + 4 * 2**20 == 7_520_387_072  # 4000 -> 32 blocks
    assert plan.phases["rollout"]["kv_cache"] == 7_520_387_072
    assert plan.phases["rollout"]["engine_weights"] == 7_615_616_512
    assert "kv_cache" not in plan.phases["train"] and "engine_weights" not in plan.phases["score"]
    assert plan.phase_totals["rollout"] - generic.phase_totals["rollout"] == 7_520_387_072 - 64 * 4000 * 28_672
    assert plan_memory(a, **kw, engine="vllm", kv_cache_budget=20 * 10**9).per_gpu["kv_cache"] == 20 * 10**9
    # gpu_memory_utilization 0.5 of 80 GiB holds the engine's weights, the rest is KV cache
    half = plan_memory(a, **kw, engine="vllm", mem_fraction=0.5)
    assert half.per_gpu["kv_cache"] == 42_949_672_960 - 7_615_616_512 == 35_334_056_448
    small = plan_memory(a, **kw, engine="vllm", kv_cache_budget=10**9)
    assert any("below one batch's need" in n and "kv_cache_bytes" in n for n in small.notes), small.notes
    assert not plan.notes
    with pytest.raises(ValueError, match="engine='vllm'"):
        plan_memory(a, **kw, kv_cache_budget=10**9)
    with pytest.raises(ValueError, match="engine must be"):
        plan_memory(a, **kw, engine="tgi")


def test_vllm_adapter_sizes_its_kv_cache_with_the_planners_function(tmp_path):
    """rollout/vllm/setup.py gives vLLM exactly what the plan bills (one function, memory_rollout.vllm_kv_need)."""
    import torch

    from hybrid_rl.rollout.vllm import setup as S

    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **TINY}  # 2 KV heads of 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    need = S.kv_bytes_needed(str(tmp_path), torch.float32, 24, 50, 2)
    assert need == 24 * 128 * 2 * 2 * 1 * 8 * 4  # 24 sequences x one block, 2 layers x K, V x 1 head x 8 x fp32
    assert S.kv_budget(None, need, 24) == need + 4 * 2**20
    plan = plan_memory(ModelArch.from_hf_config(str(tmp_path)), 4, "fp32", 48, 50, tp_size=2, engine="vllm")
    assert plan.per_gpu["kv_cache"] == S.kv_budget(None, need, 24)  # 48 over 2 engines of 2 ranks


def _qwen7b_dir(tmp_path) -> str:
    a = builtin_arch("Qwen2.5-7B")
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "vocab_size": a.vocab_size,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_decide_offload_takes_vllms_weights_and_kv_cache_into_account(tmp_path, monkeypatch):
    """offload.auto on 8 fake 80 GiB GPUs (85.90 GB), a bf16 7B policy, 64 sequences of 1000 tokens. Per GPU
    ROLLOUT holds params 5.71 + optimizer 7.62 + reference 1.90 GB, the engine's copy (tp 1: 15.23 GB) and
    its KV cache. With vLLM's KV cache at 60 GB that is 90.46 GB: the optimizer must go (82.85 GB; the
    reference alone is not enough). At tp 2 the copy is 7.62 GB: 82.85 GB, nothing to offload.
    gpu_memory_utilization 0.9: KV = 77.31 - 15.23 = 62.08 GB, 92.54 GB in all: the optimizer goes."""
    import torch

    from hybrid_rl.config.schema import Config, DataConfig, ModelConfig, OffloadConfig, RolloutConfig, TrainerConfig
    from hybrid_rl.switch.advice import decide_offload

    props = type("Props", (), {"total_memory": 80 * GIB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    model = _qwen7b_dir(tmp_path)

    def flags(**rollout):
        # 16 prompts x 4 samples, 488 prompt + 512 new tokens; sglang at tp 1 is the generic bill.
        cfg = Config(
            model=ModelConfig(path=model),
            data=DataConfig(batch_size=16),
            rollout=RolloutConfig(**{"engine": "sglang", "n": 4, "max_new_tokens": 512, **rollout}),
            trainer=TrainerConfig(micro_batch_size=4),
            offload=OffloadConfig(auto=True),
        )
        d = decide_offload(cfg, torch.device("cuda"), 8, True, prompt_tokens=488)
        assert d.plan is not None and (d.plan.batch, d.plan.context) == (64, 1000)
        return d.optimizer, d.params

    # the generic bill and vLLM's null budget (one batch: 64 x 1024 tokens, 3.76 GB) fit without offload
    assert flags() == flags(engine="vllm") == (False, False)
    # (55 GB of KV + 15.2 GB of weights + the shards: the optimizer's 7.6 GB tip it over the 79.46 GB usable)
    assert flags(engine="vllm", kv_cache_bytes=55 * 10**9) == (True, False)
    assert flags(engine="vllm", kv_cache_bytes=55 * 10**9, tp_size=2) == (False, False)
    assert flags(engine="vllm", mem_fraction=0.8) == (True, False)


def test_cli_plans_vllm_as_the_trainer_does():
    # --engine vllm bills what vLLM allocates (one batch in 128-token blocks + 4 MiB, or --kv-cache-gb), not the
    # generic KV formula; the KV knobs without --engine vllm are refused (they would be ignored).
    base = ("--model", "Qwen2.5-7B", "--gpus", "8", "--batch", "256", "--context", "4000", "--tp", "2")
    r = _cli(*base, "--engine", "vllm")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["per_gpu"]["kv_cache"] == 7_520_387_072 and d["per_gpu"]["engine_weights"] == 7_615_616_512
    r = _cli(*base, "--engine", "vllm", "--kv-cache-gb", "20")
    assert json.loads(r.stdout.strip().splitlines()[-1])["per_gpu"]["kv_cache"] == 20 * GB
    generic = json.loads(_cli(*base).stdout.strip().splitlines()[-1])
    assert generic["per_gpu"]["kv_cache"] == 64 * 4000 * 57_344 // 2
    r = _cli(*base, "--kv-cache-gb", "20")
    assert r.returncode != 0 and "--engine vllm" in r.stderr


NO_SUGGESTION = {"fits": False, "message": "(not asked)"}


def _row(text: str, role: str) -> list[str]:
    """The cells of `role`'s line in the printed roles x phases table."""
    line = next(ln for ln in text.splitlines() if ln.startswith(role + " "))
    return line.split("|")[1].split()


def test_printed_table_says_cpu_where_an_offload_flag_parks_a_role():
    """Catches: the table printing "-" (not held) for a role that its offload flag parks on the host, and the
    reverse; the cells come from the same plan the fit lines use."""
    from hybrid_rl.plan.report import format_plan, shown_phases

    a = builtin_arch("Qwen2.5-1.5B")
    for flags, parked in (({}, "-"), ({"optimizer": True}, "cpu")):
        plan = plan_memory(a, 4, "bf16", 16, 1024, flags)
        cells = dict(zip(shown_phases(plan), _row(format_plan(plan, NO_SUGGESTION), "optimizer")))
        assert cells["rollout"] == (parked if flags else f"{plan.per_gpu['optimizer'] / GB:.2f}"), cells
        assert cells["train"] not in ("cpu", "-"), cells  # trained on the device either way


def test_more_tp_ranks_than_kv_heads_is_noted():
    """Catches: the "tp_size > KV heads" note never firing (the KV cache is then replicated, not split)."""
    from hybrid_rl.plan.report import format_plan

    a = builtin_arch("Qwen2.5-1.5B")  # 2 KV heads
    assert a.kv_heads == 2
    noted = [
        format_plan(p, NO_SUGGESTION)
        for p in (
            plan_memory(a, 8, "bf16", 16, 1024, {}, tp_size=4),
            plan_memory(a, 8, "bf16", 16, 1024, {}, tp_size=2),
        )
    ]
    assert "tp_size 4 > 2 KV heads" in noted[0]
    assert "KV heads are replicated" not in noted[1]


def test_the_70b_bill_gains_the_critics_16n():
    """PPO (issue 36): the critic is a second learner, 16 bytes per parameter like the policy (bf16 weights with
    fp32 masters 6N_c, grads 2N_c in the grads row, Adam 8N_c), its weights used in SCORE and TRAIN and its Adam
    state in TRAIN, each parked on the host by its own flag. Hand-computed for 70e9 parameters on 8 GPUs.
    Catches: the critic unbilled, its grads or optimizer forgotten, resident in the wrong phases."""
    n = int(70e9)
    arch = ModelArch(num_params=n)
    plan = plan_memory(arch, n_gpus=8, dtype="bf16", batch=64, context=4096, critic_arch=arch)
    assert plan.bill["critic"] == 1120 * GB == plan.bill["learner"]
    assert plan.per_gpu["critic"] == 6 * n / 8 and plan.per_gpu["critic_optimizer"] == 8 * n / 8
    assert plan.per_gpu["grads"] == (2 * n + 2 * n) / 8  # the policy's and the critic's
    assert "critic" in plan.phases["score"] and "critic" in plan.phases["train"]
    assert "critic_optimizer" in plan.phases["train"] and "critic_optimizer" in plan.phases["rollout"]  # no flag
    parked = plan_memory(arch, 8, "bf16", 64, 4096, {"critic": True, "critic_optimizer": True}, critic_arch=arch)
    assert "critic" not in parked.phases["rollout"] and "critic_optimizer" not in parked.phases["score"]
    assert parked.phases["train"]["critic"] == 6 * n / 8 and parked.phases["score"]["critic"] == 6 * n / 8
    grpo = plan_memory(arch, n_gpus=8, dtype="bf16", batch=64, context=4096)
    assert "critic" not in grpo.bill and not any("critic" in p for p in grpo.phases.values())
