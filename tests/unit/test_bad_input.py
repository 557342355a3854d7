"""Bad input fails at `Trainer(cfg)` with an error that names what to fix, before a training step.

Where the check can run before the model is loaded, `no_model_build` makes loading
the model an assertion failure, so the test also pins *when* the error comes.
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil

import pytest

from hybrid_rl.config import load_config
from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
from hybrid_rl.rewards.base import register_reward
from hybrid_rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")


# ---------------------------------------------------------------------------- test rewards
def _register(name, fn):
    try:
        register_reward(name)(fn)
    except ValueError:  # already registered (module imported twice)
        pass
    return name


def _raises(prompts, completions, metadata):
    raise KeyError("solution")


def _nan(prompts, completions, metadata):
    return [0.0] + [math.nan] * (len(completions) - 1)


def _inf(prompts, completions, metadata):
    return [math.inf for _ in completions]


def _short(prompts, completions, metadata):
    return [0.0]


def _not_a_number(prompts, completions, metadata):
    return ["1.0" for _ in completions]


R_RAISES = _register("test_bad_input.raises", _raises)
R_NAN = _register("test_bad_input.nan", _nan)
R_INF = _register("test_bad_input.inf", _inf)
R_SHORT = _register("test_bad_input.short", _short)
R_STR = _register("test_bad_input.str", _not_a_number)


# ---------------------------------------------------------------------------- helpers
@pytest.fixture
def no_model_build(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr("hybrid_rl.models.fsdp.load_causal_lm", fail)


def _trainer(overrides, *extra):
    return Trainer(load_config(None, [*overrides, *extra]))


def _copy_model_dir(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _drop_special_token(model_dir, which):
    """Remove `which` ("eos_token" / "pad_token") from the saved tokenizer's config files."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            data = json.load(open(path))
            data.pop(which, None)
            json.dump(data, open(path, "w"), indent=2)


def _tokenizer_only_dir(model_dir, dst):
    os.makedirs(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(model_dir, name)):
            shutil.copy(os.path.join(model_dir, name), dst)
    return str(dst)


# ---------------------------------------------------------------------------- control
def test_good_input_builds_a_trainer(tiny_trainer_overrides, tmp_path):
    tr = _trainer(tiny_trainer_overrides)
    assert tr.tokenizer.eos_token_id == 1 and tr.tokenizer.pad_token_id == 0
    assert os.path.isfile(os.path.join(tr.out_dir, "config.yaml"))
    assert tr.state.loader.batch_size == 4


# ---------------------------------------------------------------------------- model directory
def test_missing_model_dir(tiny_trainer_overrides, tmp_path, no_model_build):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, f"model.path={missing}")
    assert "'model.path'" in str(err.value) and missing in str(err.value)


def test_missing_model_dir_in_loaders(tmp_path):
    missing = str(tmp_path / "no_such_model")
    for load in (load_tokenizer, load_causal_lm):
        with pytest.raises(FileNotFoundError, match="model.path"):
            load(missing)


def test_model_dir_without_config_json(tiny_trainer_overrides, tmp_path, no_model_build):
    with pytest.raises(ValueError, match=r"'model\.path'.*config\.json"):
        _trainer(tiny_trainer_overrides, f"model.path={tmp_path}")


def test_model_dir_without_safetensors(tiny_model_dir, tiny_trainer_overrides, tmp_path):
    d = _copy_model_dir(tiny_model_dir, tmp_path / "no_weights")
    for f in glob.glob(os.path.join(d, "*.safetensors")):
        os.remove(f)
    with pytest.raises(FileNotFoundError) as err:
        _trainer(tiny_trainer_overrides, f"model.path={d}")
    assert "safetensors" in str(err.value) and d in str(err.value)
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # failed before the run started


# ---------------------------------------------------------------------------- tokenizer
def test_tokenizer_dir_without_special_token(tiny_model_dir, tmp_path):
    """A tokenizer saved without EOS (and no model config.json beside it) is rejected by name; one without
    a pad token pads with EOS, as TRL and verl do, and says so."""
    d = _tokenizer_only_dir(tiny_model_dir, tmp_path / "tok")
    _drop_special_token(d, "eos_token")
    with pytest.raises(ValueError) as err:
        load_tokenizer(d)
    assert "no EOS token" in str(err.value) and "eos_token" in str(err.value)
    d = _tokenizer_only_dir(tiny_model_dir, tmp_path / "tok_no_pad")
    _drop_special_token(d, "pad_token")
    with pytest.warns(UserWarning, match="no pad token.*padding with its EOS token"):
        tok = load_tokenizer(d)
    assert tok.pad_token_id == tok.eos_token_id is not None


def test_tokenizer_built_without_eos_or_pad(tmp_path):
    """Same via a tokenizer constructed without the tokens and saved with `save_pretrained`."""
    from transformers import PreTrainedTokenizerFast

    from hybrid_rl.models.tiny import BOS, EOS, PAD, build_word_tokenizer
    from hybrid_rl.rewards.toy import DIGIT_WORDS

    backend = build_word_tokenizer(DIGIT_WORDS).backend_tokenizer
    for missing in ("eos_token", "pad_token"):
        kw = dict(pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token="<unk>")
        kw.pop(missing)
        d = str(tmp_path / missing)
        PreTrainedTokenizerFast(tokenizer_object=backend, **kw).save_pretrained(d)
        if missing == "eos_token":
            with pytest.raises(ValueError, match="no EOS token"):
                load_tokenizer(d)
        else:
            with pytest.warns(UserWarning, match="no pad token"):
                assert load_tokenizer(d).pad_token == EOS


# In a model directory (config.json with model_type qwen2) AutoTokenizer picks Qwen2Tokenizer, which
# substitutes an added '<|endoftext|>' (id 15 == vocab_size, outside the embedding) for a missing
# EOS / pad token; load_tokenizer must still treat it as missing.
def test_model_dir_tokenizer_without_special_token(tiny_model_dir, tmp_path):
    d = _copy_model_dir(tiny_model_dir, tmp_path / "model")
    _drop_special_token(d, "eos_token")
    with pytest.raises(ValueError, match="(?i)EOS"):
        load_tokenizer(d)
    d = _copy_model_dir(tiny_model_dir, tmp_path / "model_no_pad")
    _drop_special_token(d, "pad_token")
    with pytest.warns(UserWarning, match="outside the model's vocab_size"):
        tok = load_tokenizer(d)
    assert tok.pad_token_id == tok.eos_token_id < 15


def test_trainer_without_eos_is_refused_and_without_pad_trains_padding_with_eos(tiny_model_dir, tiny_trainer_overrides,
                                                                               tmp_path):
    # No EOS: the Trainer would build and every rollout run to max_new_tokens (never stop). No pad: before the
    # fallback the first rollout died in the embedding ("index out of range"); now pad = EOS and padding is
    # masked, so a step with the same seed gives the same metrics as with the real pad token.
    d = _copy_model_dir(tiny_model_dir, tmp_path / "model")
    _drop_special_token(d, "eos_token")
    with pytest.raises(ValueError, match="(?i)EOS"):
        _trainer(tiny_trainer_overrides, f"model.path={d}")
    d = _copy_model_dir(tiny_model_dir, tmp_path / "model_no_pad")
    _drop_special_token(d, "pad_token")
    with pytest.warns(UserWarning, match="no pad token"):
        padded_with_eos = _trainer(tiny_trainer_overrides, f"model.path={d}")
    reference = _trainer(tiny_trainer_overrides, f"trainer.out_dir={tmp_path / 'ref'}")
    a, b = padded_with_eos.step(), reference.step()
    for key in ("reward/mean", "actor/grad_norm", "actor/loss", "response/length"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


# ---------------------------------------------------------------------------- dataset
def test_jsonl_row_without_prompt(tiny_trainer_overrides, tmp_path, no_model_build):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "1 2 3 =", "answer": "234"}, {"prompt": "4 5 6 =", "answer": "567"},
        {"question": "7 8 9 =", "answer": "890"},  # row 2: wrong key
        {"prompt": "0 0 0 =", "answer": "111"},
    ]) + "\n")
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}")
    msg = str(err.value)
    assert "row 2" in msg and "'prompt'" in msg and "data.prompt_key" in msg and str(path) in msg
    assert "7 8 9 =" in msg  # shows the offending row


@pytest.mark.parametrize("row", [{"prompt": ""}, {"prompt": "   "}, {"prompt": 3}, {"prompt": None}, ["a list"]])
def test_jsonl_row_with_unusable_prompt(tmp_path, row):
    from hybrid_rl.data.prompts import load_rows

    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="row 1"):
        load_rows("jsonl", str(path))


def test_jsonl_bad_json_names_the_line(tiny_trainer_overrides, tmp_path, no_model_build):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1 ="}\n{"prompt": "2 =", \n')
    with pytest.raises(ValueError, match=f"{path}:2: not valid JSON"):
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}")


def test_jsonl_missing_or_empty_file(tiny_trainer_overrides, tmp_path, no_model_build):
    with pytest.raises(FileNotFoundError, match="data.path"):
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={tmp_path / 'nope.jsonl'}")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no rows"):
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={empty}")


def test_dataset_smaller_than_batch(tiny_trainer_overrides):
    with pytest.raises(ValueError, match="fewer than data.batch_size=4"):
        _trainer(tiny_trainer_overrides, "data.num_prompts=3")


# ---------------------------------------------------------------------------- reward functions
def test_reward_that_raises(tiny_trainer_overrides, no_model_build):
    with pytest.raises(RuntimeError) as err:
        _trainer(tiny_trainer_overrides, f"reward.name={R_RAISES}")
    msg = str(err.value)
    assert R_RAISES in msg and "KeyError" in msg and "solution" in msg
    assert isinstance(err.value.__cause__, KeyError)


@pytest.mark.parametrize("name,bad", [(R_NAN, "nan"), (R_INF, "inf"), (R_STR, "'1.0'")])
def test_reward_returning_non_finite_or_non_float(tiny_trainer_overrides, no_model_build, name, bad):
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, f"reward.name={name}")
    msg = str(err.value)
    assert name in msg and bad in msg and "finite" in msg


def test_reward_returning_wrong_count(tiny_trainer_overrides, no_model_build):
    with pytest.raises(ValueError, match=rf"{R_SHORT}.*returned 1 rewards for 2 completions"):
        _trainer(tiny_trainer_overrides, f"reward.name={R_SHORT}")


def test_unknown_reward_name(tiny_trainer_overrides, no_model_build):
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "reward.name=no_such_reward")
    msg = str(err.value)
    assert "no_such_reward" in msg and "'reward.name'" in msg and "digits" in msg  # lists what is registered


# ---------------------------------------------------------------------------- group size, ranks
def test_fewer_than_two_samples_per_prompt(tiny_trainer_overrides):
    """A group baseline needs two samples; REINFORCE++ whitens over the batch and runs with one (verl's usual
    setting for it), unless dynamic sampling needs groups."""
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "rollout.n=1")
    assert "'rollout.n'" in str(err.value) and "at least 2" in str(err.value) and "group" in str(err.value)
    with pytest.raises(ValueError, match="'rollout.n'.*dynamic sampling"):
        _trainer(tiny_trainer_overrides, "rollout.n=1", "algorithm.advantage=reinforce_pp",
                 "algorithm.dynamic_sampling=true")
    m = _trainer(tiny_trainer_overrides, "rollout.n=1", "algorithm.advantage=reinforce_pp", "data.batch_size=8").step()
    assert m["actor/grad_norm"] > 0 and m["response/length"] > 0


def test_mini_batch_counts_sequences_and_keeps_groups_whole(tiny_trainer_overrides):
    """verl's ppo_mini_batch_size counts prompts; ours counts sequences. A count that would split a
    prompt's group (a verl value typed as is, e.g. 6 with n=4) is refused and the units named."""
    with pytest.raises(ValueError, match="'algorithm.mini_batch_size'.*multiple of rollout.n=4.*verl"):
        _trainer(tiny_trainer_overrides, "rollout.n=4", "data.batch_size=6", "algorithm.mini_batch_size=6")


def test_batch_not_divisible_over_ranks(tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.batch_size=32"])
    cfg.validate_runtime(4)
    with pytest.raises(ValueError) as err:
        cfg.validate_runtime(3)
    msg = str(err.value)
    assert "'data.batch_size'" in msg and "3 ranks" in msg and "multiple of 3" in msg


# ---------------------------------------------------------------------------- GSM8K and file datasets
def _two_args(prompts, completions):  # a reward function with the wrong signature (for reward.fn)
    return [0.0 for _ in completions]


NOT_A_FUNCTION = [1.0]


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _gsm8k_dir(tmp_path, train_rows, test_rows=None):
    d = tmp_path / "gsm8k"
    d.mkdir()
    _write_rows(d / "train.jsonl", train_rows)
    if test_rows is not None:
        _write_rows(d / "test.jsonl", test_rows)
    return str(d)


GOOD = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(6)]


def test_gsm8k_directory_without_a_train_file(tiny_trainer_overrides, tmp_path, no_model_build):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        _trainer(tiny_trainer_overrides, "data.task=gsm8k", f"data.path={tmp_path / 'empty_dir'}", "reward.name=gsm8k")
    assert "data.path" in str(err.value) and "train.jsonl" in str(err.value) and "empty_dir" in str(err.value)


@pytest.mark.parametrize("bad,words", [
    ({"question": "How many?", "answer": "Two and two make four."}, ["row 3", "#### <number>", "four"]),
    ({"query": "How many?", "answer": "#### 4"}, ["row 3", "'question'"]),
    ({"question": "How many?", "answer": 4}, ["row 3", "'answer'"]),
])
def test_gsm8k_rows_without_question_or_final_answer(tiny_trainer_overrides, tmp_path, no_model_build, bad, words):
    d = _gsm8k_dir(tmp_path, GOOD[:3] + [bad] + GOOD[3:], GOOD)
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "data.task=gsm8k", f"data.path={d}", "reward.name=gsm8k")
    msg = str(err.value)
    assert os.path.join(d, "train.jsonl") in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_jsonl_row_without_the_answer_key(tiny_trainer_overrides, tmp_path, no_model_build):
    path = _write_rows(tmp_path / "d.jsonl", [{"q": "1 2 3 =", "a": "234"}, {"q": "4 5 6 ="}])
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}", "data.prompt_key=q", "data.answer_key=a")
    assert "row 1" in str(err.value) and "'a'" in str(err.value) and "data.answer_key" in str(err.value)


def test_math_reward_rejects_an_answer_without_a_number(tiny_trainer_overrides, tmp_path, no_model_build):
    rows = [{"q": f"{i} =", "a": f"#### {i}"} for i in range(4)] + [{"q": "x =", "a": "about five"}]
    path = _write_rows(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}", "data.prompt_key=q",
                 "data.answer_key=a", "reward.name=gsm8k")
    assert f"{path}: row 4" in str(err.value) and "about five" in str(err.value)


def test_val_path_missing(tiny_trainer_overrides, tmp_path, no_model_build):
    path = _write_rows(tmp_path / "d.jsonl", [{"prompt": f"{i} 1 2 ="} for i in range(8)])
    with pytest.raises(FileNotFoundError, match="data.val_path"):
        _trainer(tiny_trainer_overrides, "data.task=jsonl", f"data.path={path}", f"data.val_path={tmp_path / 'v.jsonl'}")


# ---------------------------------------------------------------------------- reward functions by import / argument
@pytest.mark.parametrize("fn,words", [
    ("no_such_module_xyz:score", ["'reward.fn'", "cannot import module 'no_such_module_xyz'"]),
    ("hybrid_rl.rewards.toy:no_such_fn", ["'reward.fn'", "has no attribute 'no_such_fn'"]),
    ("tests.unit.test_bad_input:NOT_A_FUNCTION", ["not a callable"]),
    ("tests.unit.test_bad_input:_two_args", ["cannot be called as fn(prompts, completions, metadata)", "_two_args(prompts, completions)"]),
])
def test_reward_fn_that_cannot_be_used(tiny_trainer_overrides, no_model_build, fn, words):
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, f"reward.fn={fn}")
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_reward_fn_not_of_the_module_function_form(tiny_trainer_overrides):
    with pytest.raises(ValueError, match="'reward.fn'.*package.module:function"):
        _trainer(tiny_trainer_overrides, "reward.fn=just_a_name")


def test_reward_kwargs_the_function_does_not_take(tiny_trainer_overrides, no_model_build):
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "reward.name=digits", "reward.kwargs.mode=strict")
    assert "reward.kwargs" in str(err.value) and "mode" in str(err.value)


def test_reward_fn_argument_and_config_key_together(tiny_trainer_overrides, no_model_build):
    with pytest.raises(ValueError, match="'reward.fn'.*give one of them"):
        Trainer(load_config(None, [*tiny_trainer_overrides, "reward.fn=hybrid_rl.rewards.toy:digits_reward"]),
                reward_fn=_nan)


def test_reward_fn_that_raises_names_the_sample(tiny_trainer_overrides, no_model_build):
    from hybrid_rl.rewards.toy import digits_rows

    second = digits_rows(4096, 0)[1]["prompt"]

    def picky(prompts, completions, metadata):
        return [1.0 / (m["prompt"] != second) for m in metadata]  # ZeroDivisionError on the probe's 2nd sample

    with pytest.raises(RuntimeError) as err:
        Trainer(load_config(None, tiny_trainer_overrides), reward_fn=picky)
    msg = str(err.value)
    assert "ZeroDivisionError" in msg and "completion 1" in msg and repr(second) in msg and "picky" in msg


def test_reward_fn_returning_nan_names_the_sample(tiny_trainer_overrides, no_model_build):
    with pytest.raises(ValueError) as err:
        Trainer(load_config(None, tiny_trainer_overrides), reward_fn=_nan)
    msg = str(err.value)
    assert "nan" in msg and "completion 1" in msg and "of prompt" in msg and "finite" in msg


# ---------------------------------------------------------------------------- chat templates, prompt lengths, validation
@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    from hybrid_rl.models.tiny_text import build_tiny_text_model_dir

    return build_tiny_text_model_dir(str(tmp_path_factory.mktemp("tiny_text") / "model"))


def test_chat_template_that_fails(text_model_dir, tiny_trainer_overrides, tmp_path, no_model_build):
    d = _copy_model_dir(text_model_dir, tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text("{{ raise_exception('no user turns here') }}")
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, f"model.path={d}")
    msg = str(err.value)
    assert "chat template" in msg and d in msg and "row 0" in msg and "no user turns here" in msg
    assert "data.chat_template=false" in msg


def test_chat_template_required_but_absent(tiny_trainer_overrides, no_model_build):
    with pytest.raises(ValueError, match="'data.chat_template'.*has no chat template"):
        _trainer(tiny_trainer_overrides, "data.chat_template=true")


def test_every_prompt_longer_than_the_limit(tiny_trainer_overrides, no_model_build):
    with pytest.raises(ValueError, match=r"every train prompt .* longer than data.max_prompt_tokens=2 .*4 tokens"):
        _trainer(tiny_trainer_overrides, "data.max_prompt_tokens=2")


def test_validation_set_smaller_than_its_batch(tiny_trainer_overrides, no_model_build):
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, "data.num_prompts=30", "data.val_split=0.1", "trainer.val_every=1")
    msg = str(err.value)
    assert "3 prompts, fewer than its batch of 4" in msg and "data.val_batch_size" in msg


def test_validation_without_a_validation_set(tiny_trainer_overrides, no_model_build):
    with pytest.raises(ValueError, match="'trainer.val_every'.*data.val_path or data.val_split"):
        _trainer(tiny_trainer_overrides, "trainer.val_every=5")


def test_a_builtin_reward_on_another_builtin_task_warns(tiny_trainer_overrides):
    with pytest.warns(UserWarning, match=r"reward.name=gsm8k is the reward of data.task=gsm8k.*data.task=digits"):
        _trainer(tiny_trainer_overrides, "reward.name=gsm8k")


def _short_context_model(src, dst, positions):
    d = _copy_model_dir(src, dst)
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = positions
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return d


def test_prompts_that_leave_no_room_for_the_answer_in_the_context(tiny_model_dir, tiny_trainer_overrides, tmp_path,
                                                                  no_model_build):
    """A prompt plus rollout.max_new_tokens must fit the model's context (SGLang rejects the whole
    batch otherwise): the digits prompts have 4 tokens, so a context of 8 with 4 new tokens keeps
    prompts of at most 8 - 4 - 1 = 3 tokens, none of them."""
    d = _short_context_model(tiny_model_dir, tmp_path / "model", 8)
    with pytest.raises(ValueError, match=r"every train prompt .* longer than 3 tokens \(the model's context of 8 less "
                                         r"rollout.max_new_tokens=4 and one\) \(the shortest has 4 tokens\).*lower "
                                         r"rollout.max_new_tokens"):
        _trainer(tiny_trainer_overrides, f"model.path={d}", "rollout.max_new_tokens=4")
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens=7 leaves no room for a prompt in the model's "
                                         r"context of 8 tokens"):
        _trainer(tiny_trainer_overrides, f"model.path={d}", "rollout.max_new_tokens=7")


def test_reward_numbers_from_numpy_and_torch_are_accepted():
    """np.float32(1.0) or a 0-d tensor is a real number: accepted as its float; a string, a list or a
    many-element tensor is not a reward, and a non-finite numpy value is still refused."""
    import numpy as np
    import torch

    from hybrid_rl.rewards.base import RewardSpec, compute_rewards

    def run(values):
        return compute_rewards("r", RewardSpec(lambda p, c, m: values), ["p"] * len(values), ["c"] * len(values),
                               [{}] * len(values))

    got = run([np.float32(0.5), np.int64(1), torch.tensor(0.25), np.array(2.0), torch.tensor([0.75]), True, 3])
    assert got == [0.5, 1.0, 0.25, 2.0, 0.75, 1.0, 3.0] and all(type(v) is float for v in got)
    for bad in ("1.0", [1.0], torch.tensor([1.0, 2.0]), np.float32("nan"), torch.tensor(float("inf")), None, 1j):
        with pytest.raises(ValueError, match="finite real numbers"):
            run([0.0, bad])


def test_a_config_changed_after_loading_is_checked_again(tiny_trainer_overrides, no_model_build):
    """In a notebook `cfg.rollout.n = 1` after load_config skipped every check: Trainer checks the config
    again (values and types) before building anything; a string override list is named for what it is."""
    from hybrid_rl import Trainer, load_config

    for section, key, value, match in [("rollout", "n", 1, "'rollout.n'"), ("data", "batch_size", 0, "'data.batch_size'"),
                                       ("optim", "lr", "fast", "'optim.lr'.*could not be converted")]:
        cfg = load_config(None, tiny_trainer_overrides)
        setattr(getattr(cfg, section), key, value)
        with pytest.raises(ValueError, match=match):
            Trainer(cfg)
    with pytest.raises(TypeError, match=r"pass \['optim.lr=1e-5'\]"):
        load_config(None, "optim.lr=1e-5")
