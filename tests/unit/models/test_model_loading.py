"""Loading the policy (hybrid_rl/models/loading.py and the start-up checks of model.path): a model
directory without config.json or weights, and a tokenizer without an EOS or pad token, fail at
`Trainer(cfg)` (or in the loader) with an error that names what to fix.

Where the check can run before the model is loaded, `no_model_build` (tests/conftest.py) makes
loading the model an assertion failure, so the test also pins *when* the error comes.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from hybrid_rl.config.load import load_config
from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
from hybrid_rl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")


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


# ---------------------------------------------------------------------------- model directory
def test_missing_model_dir(tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: the start-up check of model.path dropped (transformers would then read the missing
    path as a Hub repo id, after the run started, with an error that names no config key)."""
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError) as err:
        _trainer(tiny_trainer_overrides, f"model.path={missing}")
    assert "'model.path'" in str(err.value) and missing in str(err.value)


def test_missing_model_dir_in_loaders(tmp_path):
    """Catches: load_tokenizer / load_causal_lm handing a missing directory to transformers instead
    of refusing it by its config key (they are called outside the Trainer too)."""
    missing = str(tmp_path / "no_such_model")
    for load in (load_tokenizer, load_causal_lm):
        with pytest.raises(FileNotFoundError, match="model.path"):
            load(missing)


def test_model_dir_without_config_json(tiny_trainer_overrides, tmp_path, no_model_build):
    """Catches: a directory without config.json accepted at start-up (it fails later, inside
    transformers, without naming model.path)."""
    with pytest.raises(ValueError, match=r"'model\.path'.*config\.json"):
        _trainer(tiny_trainer_overrides, f"model.path={tmp_path}")


def test_model_dir_without_safetensors(tiny_model_dir, tiny_trainer_overrides, tmp_path):
    """Catches: the safetensors check dropped from load_causal_lm, or the run started (its metrics
    file written) before the weights were found missing."""
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
    a pad token pads with EOS, as TRL and verl do, and says so.

    Catches: load_tokenizer accepting a tokenizer without EOS (generation could never stop), or
    refusing one without a pad token, or padding with EOS silently."""
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
    """Same via a tokenizer constructed without the tokens and saved with `save_pretrained`.

    Catches: the checks reading only the saved config files' keys, not the tokenizer transformers
    builds from them."""
    from transformers import PreTrainedTokenizerFast

    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import BOS, EOS, PAD, build_word_tokenizer

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


def test_model_dir_tokenizer_without_special_token(tiny_model_dir, tmp_path):
    """In a model directory (config.json with model_type qwen2) AutoTokenizer picks Qwen2Tokenizer, which
    substitutes an added '<|endoftext|>' (id 15 == vocab_size, outside the embedding) for a missing
    EOS / pad token; load_tokenizer must still treat it as missing.

    Catches: taking that class default for a real EOS or pad token (ids outside the model's
    vocab_size: generation never stops, padding indexes past the embedding)."""
    d = _copy_model_dir(tiny_model_dir, tmp_path / "model")
    _drop_special_token(d, "eos_token")
    with pytest.raises(ValueError, match="(?i)EOS"):
        load_tokenizer(d)
    d = _copy_model_dir(tiny_model_dir, tmp_path / "model_no_pad")
    _drop_special_token(d, "pad_token")
    with pytest.warns(UserWarning, match="outside the model's vocab_size"):
        tok = load_tokenizer(d)
    assert tok.pad_token_id == tok.eos_token_id < 15


def test_trainer_without_eos_is_refused_and_without_pad_trains_padding_with_eos(
    tiny_model_dir, tiny_trainer_overrides, tmp_path
):
    """Catches: a Trainer built on a tokenizer without EOS, or padding with EOS that is not masked
    like a pad (the step's metrics would differ from those with the real pad token)."""
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
