"""Which tokens end a completion: the same set in every engine and in the reward's view of the text."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hybrid_rl.config.load import load_config
from hybrid_rl.models.loading import model_eos_ids
from hybrid_rl.trainer import Trainer


def test_model_eos_ids_reads_both_configs(tiny_model_dir, tmp_path):
    d = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir, d)
    assert model_eos_ids(d) == {1}
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, 7]}, f)
    os.remove(os.path.join(d, "config.json"))
    assert model_eos_ids(d) == {1, 7}


def test_every_engine_stops_on_the_eos_ids_the_model_configs_declare(tiny_model_dir, tiny_trainer_overrides, tmp_path):
    """generation_config.json may list an EOS the tokenizer does not call eos_token (Qwen2.5-Instruct:
    <|im_end|> and <|endoftext|>). SGLang stops on it whatever it is asked; the native engine must too,
    and the reward must see the completion without it."""
    from hybrid_rl.types import Completion

    d = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir, d)
    gen_path = os.path.join(d, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [gen["eos_token_id"], 7]
    with open(gen_path, "w") as f:
        json.dump(gen, f)
    trainer = Trainer(load_config(None, [*tiny_trainer_overrides, f"model.path={d}", "rollout.stop_token_ids=[9]"]))
    assert trainer.stop_token_ids == (1, 7, 9) and 7 in trainer.rollout_stage.sampling_params(0, 0).stop_token_ids
    rows = [{"prompt": "1 2 3 =", "answer": "234"}]
    words = trainer.tokenizer.convert_tokens_to_ids(["2", "3", "4"])
    done = Completion(token_ids=[*words, 7], logprobs=[0.0] * 4, finish_reason="stop")
    rewards, _, _ = trainer.rollout_stage.score(rows, [done] * trainer.cfg.rollout.n)
    assert float(rewards[0]) == pytest.approx(1.0), "the body without the model's EOS scores as a finished answer"
    trainer.close()
