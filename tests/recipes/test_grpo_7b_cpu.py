"""recipes/grpo_7b.py: the 7B GSM8K job, run on CPU with a tiny model substituted, and its memory plan.

The end-to-end run launches the real script (as a user would, output to a pipe, so the log is
non-interactive) on the real GSM8K rows with the real reward, chat template, validation and
loggers. A tiny random model scores ~0 on GSM8K: the run checks the path, not the accuracy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.data_helpers import gsm8k_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "grpo_7b.py")
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import grpo_7b  # noqa: E402  (the recipe module itself: its planning helpers and main)

CPU_OVERRIDES = [
    "trainer.device=cpu",
    "data.batch_size=4",
    "rollout.n=4",
    "rollout.max_new_tokens=24",
    "data.max_prompt_tokens=384",
    "data.num_prompts=48",
    "data.val_size=4",
    "data.val_batch_size=4",
    "algorithm.mini_batch_size=0",
    "trainer.micro_batch_size=16",
    "trainer.total_steps=4",
    "trainer.val_every=2",
    "trainer.val_n=2",
    "trainer.val_sample_rows=2",
]


def _gsm8k_rows(split: str, n: int) -> list[dict]:
    with open(os.path.join(gsm8k_dir(), f"{split}.jsonl")) as f:
        return [json.loads(next(f)) for _ in range(n)]


@pytest.mark.slow
def test_gsm8k_recipe_runs_end_to_end_on_cpu(tmp_path):
    from hybrid_rl.data.gsm8k import INSTRUCTION
    from hybrid_rl.models.loading import load_tokenizer
    from hybrid_rl.models.tiny_text import build_tiny_text_model_dir

    gsm8k_dir()
    model = build_tiny_text_model_dir(str(tmp_path / "model"), max_positions=512)
    out = tmp_path / "run"
    loggers = "[console,tensorboard]" if importlib.util.find_spec("tensorboard") else "[console]"
    cmd = [
        sys.executable,
        RECIPE,
        f"model.path={model}",
        f"trainer.out_dir={out}",
        f"trainer.loggers={loggers}",
        *CPU_OVERRIDES,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout

    # The log: the engine it chose, the data it read (long prompts dropped and counted), one line per step.
    assert "rollout engine: native (sglang is not importable here" in log or "rollout engine: sglang" in log
    tok = load_tokenizer(model)
    rendered = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}], tokenize=False, add_generation_prompt=True
        )
        for r in _gsm8k_rows("train", 48)
    ]
    too_long = sum(len(tok(t, add_special_tokens=False).input_ids) > 384 for t in rendered)
    assert too_long > 0, "the test should exercise dropping"
    m = re.search(
        r"data: (\d+) train prompts from (\S+), dropped (\d+) longer than data.max_prompt_tokens=384.*"
        r"chat template on\)",
        log,
    )
    assert m and (int(m.group(1)), int(m.group(3))) == (48 - too_long, too_long), log[:2000]
    assert m.group(2).endswith(os.path.join("gsm8k", "train.jsonl"))
    assert "\r" not in log and "\r" not in proc.stderr, "a progress bar was drawn into the log"
    assert [line.split()[0] for line in log.splitlines() if line.startswith("step=")] == [
        f"step={i}" for i in (1, 2, 3, 4)
    ]
    assert [line.split()[1] for line in log.splitlines() if line.startswith("val ")] == ["step=0", "step=2", "step=4"]

    # metrics.jsonl: validation before training (step 0), after step 2 and at the end.
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert "reward/mean" not in records[0] and "val/pass@1" in records[0]
    assert [("val/pass@1" in r) for r in records[1:]] == [False, True, False, True]
    for r in records[1:]:
        assert {
            "reward/mean",
            "reward/accuracy",
            "response/length",
            "actor/kl_ref",
            "time/rollout",
            "time/switch",
        } <= set(r)
    for r in (records[0], records[2], records[4]):
        assert {"val/pass@1", "val/reward_mean", "val/mean@2", "val/pass@2", "val/response_length"} <= set(r)
        assert 0.0 <= r["val/pass@1"] <= 1.0 and r["val/prompts"] == 4

    # val_samples.jsonl: real GSM8K test prompts with their reference answers and the rewards they got.
    with open(out / "val_samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    assert [s["step"] for s in samples] == [0, 0, 2, 2, 4, 4]
    tests = {r["question"]: r["answer"].split("####")[-1].strip() for r in _gsm8k_rows("test", 8)}
    for s in samples:
        question = s["prompt"].removesuffix(" " + INSTRUCTION)
        assert s["prompt"].endswith(INSTRUCTION) and s["ground_truth"] == tests[question]
        assert s["reward"] in (0.0, 1.0) and len(s["samples"]) == 2

    # The run directory: resolved config, the saved policy (with its chat template), TensorBoard scalars.
    config = (out / "config.yaml").read_text()
    assert "task: gsm8k" in config and "name: gsm8k" in config and "engine: native" in config
    assert load_tokenizer(str(out / "final_model")).chat_template
    if "tensorboard" in loggers:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(out / "tensorboard"))
        acc.Reload()
        numeric = {k for r in records for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
        assert set(acc.Tags()["scalars"]) == numeric


def test_dry_run_prints_the_config_and_the_plan_for_8_x_80gb(capsys):
    result = grpo_7b.main(["--dry-run"])
    out = capsys.readouterr().out
    assert result["fits"] is True
    assert "task: gsm8k" in out and "batch_size: 1024" in out  # the resolved config
    assert "model Qwen2.5-7B: N = 7,615,616,512 params" in out
    assert "GPUs 8," in out and "batch 5120 seqs x context 1536 tokens; GPU memory 80 GiB" in out
    assert "learner 16N = 121.85 GB" in out
    # No tokenizer or weights here: the prompts are billed at data.max_prompt_tokens, and the output says so.
    assert "planned for prompts of 512 tokens: data.max_prompt_tokens (no tokenizer at model.path" in out
    assert "reward model billed: none (rule reward gsm8k)" in out
    for phase in ("train", "rollout", "score"):
        assert re.search(rf"^{phase} .* per GPU: fits", out, re.M), phase
    capsys.readouterr()
    grpo_7b.main(["--dry-run", "rollout.engine=sglang", "rollout.tp_size=2"])
    assert "rollout tp 2 x dp 4" in capsys.readouterr().out


def test_dry_run_prints_the_native_rollout_margin_for_8_x_80gb(capsys):
    """The native engine's 640 sequences per GPU do not all fit at once with a margin: the plan decodes
    two batches of 320, bills their prefill (64 prompts x 512 tokens), sampling and graph pools, and
    prints what is left."""
    result = grpo_7b.main(["--dry-run", "rollout.engine=native"])
    out = capsys.readouterr().out
    assert result["fits"] is True
    assert "native rollout: 320 of 640 rows per GPU per decode batch (2 batches), prefill in chunks of 64" in out
    m = re.search(r"native rollout spare: ([\d.]+) GB per GPU at the peak, beyond the 6\.44 GB margin", out)
    assert m and float(m.group(1)) > 5, out[-1500:]
    rollout = re.search(r"^rollout +([\d.]+) / 79\.46 GB usable per GPU: fits \(([\d.]+) GB spare\)", out, re.M)
    assert rollout and rollout.group(2) == m.group(1)
    assert re.search(r"^rollout_working +\d", out, re.M)


def test_dry_run_with_lora_fits_the_7b_policy_on_one_80gb_gpu(capsys):
    """Issue 29: rank-64 all-linear LoRA bills the frozen bf16 base (2N), 16 bytes per adapter parameter and no
    reference copy, so Qwen2.5-7B fits one 80 GiB GPU with the optimizer resident; the whole-model bill does not.
    Catches: the learner billed 16N (or a reference copy kept) under LoRA, or the label saying 16N when it is not."""
    # Per layer rank x (in + out): q and o 3584+3584, k and v 3584+512, gate, up and down 3584+18944; 28 layers.
    a = 28 * 64 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))
    result = grpo_7b.main(["--dry-run", "--gpus", "1", "model.lora.rank=64"])
    out = capsys.readouterr().out
    assert result["fits"] is True
    learner_gb = (2 * 7_615_616_512 + 16 * a) / 1e9
    assert f"learner 2N + 16A (LoRA: frozen base, A = {a:,} adapter params) = {learner_gb:.2f} GB" in out, out[-2500:]
    assert "reference = 0.00 GB" in out
    offloaded = next(ln for ln in out.splitlines() if ln.startswith("offload: "))
    assert "optimizer" not in offloaded, offloaded
    with pytest.raises(SystemExit, match="refusing to start"):
        grpo_7b.main(["--dry-run", "--gpus", "1"])
    assert "learner 16N = 121.85 GB" in capsys.readouterr().out


def test_dry_run_refuses_with_the_change_that_makes_it_fit(capsys):
    # SGLang at TP 2 with mem_fraction 0.9: the pool it sizes at start leaves too little for the optimizer
    # state made after it, unless that goes to host memory.
    sglang = ["--dry-run", "rollout.engine=sglang", "rollout.tp_size=2", "rollout.mem_fraction=0.9"]
    with pytest.raises(SystemExit) as err:
        grpo_7b.main(sglang)
    msg = str(err.value.code)
    assert "refusing to start: rollout (short by" in msg and "suggested change: offload.optimizer=true" in msg
    assert "does NOT fit" in capsys.readouterr().out  # the plan was printed first
    assert grpo_7b.main(sglang + ["offload.optimizer=true"])["fits"]
    # The native engine decodes fewer rows at once instead: at 75 GiB it fits, in two batches.
    assert grpo_7b.main(["--dry-run", "--gpu-mem-gib", "75", "rollout.engine=native"])["fits"]
    assert "320 of 640 rows" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="refusing to start"):
        grpo_7b.main(["--dry-run", "--gpu-mem-gib", "20", "rollout.engine=native"])


def test_a_real_start_refuses_before_any_weights_load(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(grpo_7b, "Trainer", lambda *a, **k: pytest.fail("the trainer was built"))
    with pytest.raises(SystemExit, match="refusing to start"):
        grpo_7b.main(
            [
                f"model.path={tiny_model_dir}",
                f"trainer.out_dir={tmp_path}",
                "trainer.device=cpu",
                "--gpu-mem-gib",
                "0.0001",
                "--gpus",
                "1",
            ]
        )
    assert "model model: N = " in capsys.readouterr().out  # planned from the directory's config.json


def _classifier_dir(path) -> str:
    """A reward model directory holding only its config.json: Qwen2.5-0.5B's shape as a 1-label classifier."""
    from hybrid_rl.plan.memory import builtin_arch

    a = builtin_arch("Qwen2.5-0.5B")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["Qwen2ForSequenceClassification"],
                "model_type": "qwen2",
                "num_labels": 1,
                "hidden_size": a.hidden_size,
                "intermediate_size": a.intermediate_size,
                "num_hidden_layers": a.num_hidden_layers,
                "num_attention_heads": a.num_attention_heads,
                "num_key_value_heads": a.num_key_value_heads,
                "vocab_size": a.vocab_size,
            },
            f,
        )
    return str(path)


def test_dry_run_bills_the_reward_model(tmp_path, capsys):
    """reward.model_path's config.json is billed as the trainer bills it (a REWARD phase holding the reward
    model); the recipe used to plan as if there were none. Mutation: plan_from_config without reward_arch."""
    rm = _classifier_dir(tmp_path / "rm")
    without = grpo_7b.main(["--dry-run", "rollout.engine=sglang"])
    capsys.readouterr()
    with_rm = grpo_7b.main(["--dry-run", "rollout.engine=sglang", f"reward.model_path={rm}"])
    out = capsys.readouterr().out
    assert without["phase_totals"]["reward"] == 0 and with_rm["phase_totals"]["reward"] > 0
    assert f"reward model billed: reward.model_path={rm}" in out
    cfg = grpo_7b.load_config(
        os.path.join(ROOT, "recipes", "grpo_7b.yaml"), ["rollout.engine=sglang", f"reward.model_path={rm}"]
    )
    plan, _, _ = grpo_7b.memory_plan(cfg, 8, 80.0)
    assert plan.reward_params == 494_032_768 + 896  # Qwen2.5-0.5B (tied: no lm_head) + a 1 x 896 score head
    assert plan.phases["reward"]["reward_model"] == plan.per_gpu["reward_model"] > 0


@pytest.mark.parametrize("engine", ["native", "sglang", "vllm"])
def test_the_dry_run_plan_is_decide_offloads_plan(tmp_path, monkeypatch, engine):
    """One plan from a config: with offload.auto, what the recipe prints for a prompt length is the plan the
    trainer's decide_offload takes its flags from (fake 80 GiB GPUs), reward model included. Mutation: any
    planner argument the two derive differently (micro-batch, engine, reward model, dtype) fails it."""
    import torch

    from hybrid_rl.plan.from_config import PromptTokens
    from hybrid_rl.switch.advice import decide_offload

    props = type("Props", (), {"total_memory": 80 * 2**30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    rm = _classifier_dir(tmp_path / "rm")
    overrides = [
        f"rollout.engine={engine}",
        "rollout.tp_size=1" if engine == "native" else "rollout.tp_size=2",
        f"reward.model_path={rm}",
        "offload.auto=true",
    ]
    cfg = grpo_7b.load_config(os.path.join(ROOT, "recipes", "grpo_7b.yaml"), overrides)
    recipe_plan, suggestion, _ = grpo_7b.memory_plan(cfg, 8, 80.0, PromptTokens(300, "test"))
    decision = decide_offload(cfg, torch.device("cuda"), 8, True, prompt_tokens=300)
    assert decision.plan == recipe_plan
    assert recipe_plan.reward_params > 0 and recipe_plan.context == 300 + cfg.rollout.max_new_tokens
    assert (decision.optimizer, decision.params) == (
        suggestion["offload"]["optimizer"],
        suggestion["offload"]["params"],
    )


def test_dry_run_measures_the_prompts_the_trainer_measures(tmp_path, monkeypatch, capsys):
    """With a local tokenizer and GSM8K the dry run bills the longest of the first 256 prompts the trainer keeps
    (chat template on, those over data.max_prompt_tokens dropped): the number the trainer hands decide_offload.
    Mutation: measuring before the long prompts are dropped, or without the chat template, fails it."""
    import hybrid_rl.trainer as trainer_mod
    from hybrid_rl.models.tiny_text import build_tiny_text_model_dir

    gsm8k_dir()
    model = build_tiny_text_model_dir(str(tmp_path / "model"), max_positions=512)
    overrides = [
        f"model.path={model}",
        "rollout.max_new_tokens=24",
        "data.max_prompt_tokens=200",
        "data.val_size=4",
        "data.val_batch_size=4",
        "trainer.device=cpu",
        f"trainer.out_dir={tmp_path / 'run'}",
        "trainer.micro_batch_size=16",
        "data.batch_size=4",
        "rollout.n=4",
        "algorithm.mini_batch_size=0",
    ]
    grpo_7b.main(["--dry-run", *overrides])
    m = re.search(
        r"planned for prompts of (\d+) tokens: the longest of the first 256 training prompts of \S+gsm8k",
        capsys.readouterr().out,
    )
    assert m, "the dry run did not measure the local prompts"

    class Seen(Exception):
        pass

    def spy(*args, prompt_tokens, **kwargs):
        raise Seen(prompt_tokens)

    monkeypatch.setattr(trainer_mod, "decide_offload", spy)
    cfg = grpo_7b.load_config(
        os.path.join(ROOT, "recipes", "grpo_7b.yaml"), ["rollout.engine=native", "rollout.tp_size=1", *overrides]
    )
    with pytest.raises(Seen) as seen:
        trainer_mod.Trainer(cfg)
    assert int(m.group(1)) == seen.value.args[0]


def test_engine_is_sglang_when_importable_else_native(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real(name, *a))
    assert grpo_7b.choose_engine([]) == ([], "rollout engine: sglang (importable here)")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    overrides, note = grpo_7b.choose_engine([])
    assert overrides == ["rollout.engine=native", "rollout.tp_size=1"] and "native" in note
    assert grpo_7b.choose_engine(["rollout.engine=sglang"])[0] == []  # the command line decides
    assert grpo_7b.choose_engine(["rollout.engine=native"])[0] == ["rollout.tp_size=1"]  # native has no TP


def test_dry_run_with_the_calculator_environment_bills_whole_episodes(capsys):
    """env.name=gsm8k_calculator: the recipe adds its episode bounds (the command line's win) and the plan bills
    rollout.max_episode_tokens as the context, what vLLM's max_model_len is and the longest episode trained.
    Catches: the planner billing prompt + max_new_tokens (1536) for episodes, the bounds not added, or added
    over the user's own."""
    result = grpo_7b.main(["--dry-run", "env.name=gsm8k_calculator", "rollout.engine=sglang", "rollout.tp_size=2"])
    out = capsys.readouterr().out
    assert result["fits"] is True
    assert "name: gsm8k_calculator" in out and "max_turns: 4" in out and "max_episode_tokens: 2048" in out
    assert "batch 5120 seqs x context 2048 tokens" in out
    grpo_7b.main(["--dry-run", "env.name=gsm8k_calculator", "rollout.max_episode_tokens=3072", "rollout.engine=native"])
    out = capsys.readouterr().out
    assert "max_episode_tokens: 3072" in out and "batch 5120 seqs x context 3072 tokens" in out
    assert grpo_7b.env_overrides(["rollout.n=4"]) == [] and grpo_7b.env_overrides(["env.name="]) == []


def test_ppo_dry_run_bills_the_critic_fits_8_gpus_and_ranks_fixes_on_1(capsys):
    """Issue 36: recipes/ppo_7b.yaml (verl's PPO settings) bills the critic as a second learner, 16N_c: the body
    without its LM head plus a value head of h + 1 (Qwen2.5-7B: N less the untied 152,064 x 3,584 head, plus
    3,585), resident in SCORE and TRAIN; 8 GPUs fit, 1 GPU refuses with the ranked change. Catches: the critic
    unbilled, billed with an LM head, or missing from SCORE."""
    ppo = ["--config", os.path.join(os.path.dirname(grpo_7b.__file__), "ppo_7b.yaml"), "--dry-run"]
    result = grpo_7b.main(ppo)
    out = capsys.readouterr().out
    assert result["fits"] is True and "advantage: gae" in out
    n_critic = 7_615_616_512 - 152_064 * 3_584 + 3_584 + 1
    assert f"critic 16N_c = {16 * n_critic / 1e9:,.2f} GB (PPO)" in out, out[-3000:]
    row = re.search(r"^critic +([\d.]+) +([\d.,]+) \| +([\d.]+) +(\S+) +([\d.]+)", out, re.M)
    assert row and row.group(4) == row.group(1) and row.group(5) == row.group(1), "resident in every phase here"
    assert abs(float(row.group(1)) - 6 * n_critic / 8 / 1e9) < 0.01  # bf16 + fp32 masters, over 8 GPUs
    assert re.search(r"^critic_optimizer +([\d.]+)", out, re.M).group(1) == f"{8 * n_critic / 8 / 1e9:.2f}"
    with pytest.raises(SystemExit, match="refusing to start.*suggested change: --gpus"):
        grpo_7b.main(ppo + ["--gpus", "1"])
    assert "to fit (" in capsys.readouterr().out
