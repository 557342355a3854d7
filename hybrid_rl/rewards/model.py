"""A learned reward model: (prompt, completion) text -> one score per completion.

Two kinds, read from the directory's config.json:
  classifier  `AutoModelForSequenceClassification` (Skywork / InternLM-style reward models):
              the logit of label `reward.score_index` (0 when there is one label) at the
              sequence's last token;
  causal_lm   `AutoModelForCausalLM` with `reward.score_token` (or `reward.score_token_id`):
              that token's logit at the last position (a verifier answering "yes").

The reward model has its own tokenizer and chat template, which need not be the
policy's: every completion is re-tokenized from its TEXT (the prompt as the user turn,
the completion as the assistant turn when the tokenizer has a template; prompt +
completion otherwise). The policy's token ids never reach it.

Sequences are left-padded, with position ids counting real tokens only (as the
policy's scoring does), so every sequence ends at the last position: that is where
the score is read, whatever the pad id (a classifier's config gets a pad id no token
has, which makes Hugging Face's pooling pick exactly that position). Micro-batches
hold at most `reward.max_tokens_per_micro_batch` padded tokens; each forward is an
FSDP collective, so the ranks agree on the number (batch.micro_batches).

Frozen (requires_grad False, eval), FSDP2-sharded like the reference, bf16 on CUDA
with mixed precision and fp32 otherwise. Where it is resident is the phase switch's
business (switch/phases.py, the REWARD stage); this module only scores.

Legend: N completions, L tokens (left-padded), C labels.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import NoReturn, Optional, Sequence

import torch

from hybrid_rl.batch import micro_batches
from hybrid_rl.models.logprobs import left_pad, position_ids


@dataclass(frozen=True)
class RewardModelSpec:
    """What to load and where its score is read; built by `inspect_reward_model` before any model loads."""

    path: str
    kind: str  # classifier | causal_lm
    index: int  # classifier: the label whose logit is the score; causal_lm: the token id
    architecture: str
    chat_template: bool
    max_positions: int | None = None  # config's max_position_embeddings: the longest input it was built for


def _fail(key: str, msg: str) -> NoReturn:
    raise ValueError(f"config key '{key}': {msg}")


def _read_config(path: str) -> dict:
    if not path or not os.path.isdir(path):
        _fail(
            "reward.model_path", f"directory {path!r} does not exist; give a local Hugging Face reward model directory"
        )
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        _fail("reward.model_path", f"{path!r} has no config.json; is it a Hugging Face model directory?")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        _fail(
            "reward.model_path",
            f"{path!r} has no *.safetensors weights; save the reward model with "
            "`model.save_pretrained(path, safe_serialization=True)`",
        )
    with open(cfg_path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            _fail("reward.model_path", f"{cfg_path} is not valid JSON ({err})")


def num_labels(cfg: dict) -> int:
    """Labels of a classifier config, as transformers counts them (2 when the config names none)."""
    return len(cfg["id2label"]) if cfg.get("id2label") else int(cfg.get("num_labels") or 2)


def load_reward_tokenizer(path: str, vocab_size: Optional[int] = None):
    """The reward model's own tokenizer; it must have a pad token inside the model's vocabulary."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # a directory without tokenizer files, or broken ones
        _fail(
            "reward.model_path",
            f"cannot load the reward model's tokenizer from {path!r} "
            f"({type(err).__name__}: {err}); save its tokenizer next to the weights",
        )
    pad = tok.pad_token_id
    if pad is None or (vocab_size is not None and pad >= vocab_size):
        why = (
            ""
            if pad is None
            else f" (only a class default {tok.pad_token!r}, id {pad}, outside vocab_size {vocab_size})"
        )
        _fail(
            "reward.model_path",
            f"the tokenizer in {path!r} has no pad token{why}: completions cannot be batched. "
            "Set `pad_token` in its tokenizer_config.json (an unused special token will do)",
        )
    return tok


def inspect_reward_model(
    path: str, score_index: int = -1, score_token: str = "", score_token_id: int = -1
) -> tuple[RewardModelSpec, object]:
    """(spec, tokenizer) of the reward model in `path`; every check that needs no weights loaded.

    Raises naming the key to fix: a missing directory or weights, a model that is neither a
    sequence classifier nor a causal LM with a score token, a classifier with several labels
    and no `reward.score_index`, a tokenizer without a pad token, a score token the
    tokenizer does not have as one token.
    """
    cfg = _read_config(path)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else str(cfg.get("model_type", "unknown"))
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    token_given = bool(score_token) or score_token_id >= 0
    if arch.endswith("ForSequenceClassification"):
        if token_given:
            _fail(
                "reward.score_token",
                f"{path!r} is a sequence classifier ({arch}); a score token is for a causal "
                "LM reward model. Unset reward.score_token / reward.score_token_id",
            )
        labels = num_labels(cfg)
        if labels > 1 and score_index < 0:
            _fail(
                "reward.score_index",
                f"the reward model in {path!r} has {labels} labels; say which label's logit "
                f"is the reward (reward.score_index=0..{labels - 1})",
            )
        index = score_index if score_index >= 0 else 0
        if index >= labels:
            _fail("reward.score_index", f"{score_index} is out of range: {path!r} has {labels} label(s)")
        kind = "classifier"
    elif arch.endswith("ForCausalLM") and token_given:
        kind, index = "causal_lm", -1
    elif arch.endswith("ForCausalLM"):
        _fail(
            "reward.model_path",
            f"{path!r} is a causal LM ({arch}), not a sequence-classification reward model; to "
            "score it by the logit of one token at the last position, set reward.score_token "
            "(or reward.score_token_id)",
        )
    else:
        _fail(
            "reward.model_path",
            f"{path!r} is a {arch}, not a sequence-classification model "
            "(AutoModelForSequenceClassification, architectures '*ForSequenceClassification') "
            "or a causal LM with reward.score_token",
        )
    tok = load_reward_tokenizer(path, vocab)
    if kind == "causal_lm":
        if score_token and score_token_id >= 0:
            _fail("reward.score_token", "give reward.score_token or reward.score_token_id, not both")
        if score_token:
            ids = tok(score_token, add_special_tokens=False).input_ids
            if len(ids) != 1 or ids[0] == tok.unk_token_id:
                _fail(
                    "reward.score_token",
                    f"{score_token!r} is {len(ids)} token(s) {ids} for the tokenizer in "
                    f"{path!r}; it must be exactly one known token (or give reward.score_token_id)",
                )
            index = ids[0]
        else:
            index = score_token_id
        if vocab is not None and index >= vocab:
            _fail("reward.score_token_id", f"{index} is outside the reward model's vocab_size {vocab}")
    max_positions = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    spec = RewardModelSpec(
        path=path,
        kind=kind,
        index=index,
        architecture=arch,
        chat_template=bool(getattr(tok, "chat_template", None)),
        max_positions=max_positions,
    )
    return spec, tok


def load_reward_model(
    spec: RewardModelSpec, device: torch.device, bf16: bool, mesh=None, whole: bool = False
) -> torch.nn.Module:
    """The frozen module (bf16 weights when `bf16`, else fp32), FSDP2-sharded over every rank, of which only
    rank 0 reads the weights (`models.fsdp.load_sharded`); or over `mesh` only (the split placement's rollout
    ranks, each of which reads them); or, `whole`, one unsharded copy on this rank (a split run's only rollout
    rank: no peer to shard with, and no collective in its forward)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from hybrid_rl.models.fsdp import load_sharded

    hf_logging.disable_progress_bar()
    cls = AutoModelForSequenceClassification if spec.kind == "classifier" else AutoModelForCausalLM
    dtype = torch.bfloat16 if bf16 else torch.float32

    def load() -> torch.nn.Module:
        try:
            model = cls.from_pretrained(spec.path, dtype=dtype, attn_implementation="sdpa")
        except Exception as err:
            _fail("reward.model_path", f"cannot load {spec.path!r} as {cls.__name__} ({type(err).__name__}: {err})")
        model.config.use_cache = False
        return model

    def frozen(model: torch.nn.Module) -> None:
        model.requires_grad_(False).eval()
        if spec.kind == "classifier":
            # Left padding puts every sequence's last token at the last position; a pad id that no token
            # has makes Hugging Face's pooling ("rightmost non-pad token") pick exactly that position,
            # even when the real last token shares its id with the tokenizer's pad (pad = EOS models).
            model.config.pad_token_id = -1
            model.config.get_text_config().pad_token_id = -1

    if whole:
        model = load()
        frozen(model)
        return model.to(device)
    # Already in its final dtype: no mixed-precision policy (nothing of it is trained).
    return load_sharded(spec.path, device, False, "sdpa", [frozen], load=load, model_class=cls, dtype=dtype, mesh=mesh)[
        0
    ]


def encode_texts(tokenizer, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
    """Token ids of each (prompt, completion) for the reward model, from text, with its chat template if any."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if getattr(tokenizer, "chat_template", None):
        texts = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            try:
                texts.append(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
                    )
                )
            except Exception as err:  # jinja errors and whatever else a template raises
                raise ValueError(
                    f"the reward model's chat template failed on completion {i} ({c[:80]!r}): "
                    f"{type(err).__name__}: {err}"
                ) from err
        return tokenizer(texts, add_special_tokens=False).input_ids
    # No template: the text as the policy wrote it, with the tokenizer's own special tokens.
    return tokenizer([p + c for p, c in zip(prompts, completions)]).input_ids


def left_pad_batch(
    ids: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids_NL, attn_NL: right-aligned, so every sequence's last token is at position L - 1."""
    if any(len(x) == 0 for x in ids):
        raise ValueError("a reward model input has no tokens; the prompt and completion are both empty")
    return left_pad(ids, pad_id, device)


def score_forward(
    model: torch.nn.Module, ids_NL: torch.Tensor, attn_NL: torch.Tensor, kind: str, index: int
) -> torch.Tensor:
    """score_N (fp32) of left-padded sequences: label `index`'s logit, or token `index`'s logit, at the last
    position."""
    if ids_NL.shape != attn_NL.shape or ids_NL.dim() != 2:
        raise ValueError(f"ids_NL {tuple(ids_NL.shape)} and attn_NL {tuple(attn_NL.shape)} must be the same 2-d shape")
    pos_NL = position_ids(attn_NL)
    if kind == "classifier":
        logits_NC = model(input_ids=ids_NL, attention_mask=attn_NL, position_ids=pos_NL).logits
        return logits_NC[:, index].float()
    logits_N1V = model(input_ids=ids_NL, attention_mask=attn_NL, position_ids=pos_NL, logits_to_keep=1).logits
    return logits_N1V[:, -1, index].float()


class RewardModelScorer:
    """Scores completions with a (resident) reward model module; knows the tokenizer and the budget."""

    def __init__(self, spec: RewardModelSpec, tokenizer, device: torch.device, max_tokens_per_micro_batch: int):
        if max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
        self.spec, self.tokenizer, self.device = spec, tokenizer, device
        self.max_tokens = max_tokens_per_micro_batch
        self.last_micro_batches = 0  # forwards of the last call (the token budget at work)

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, prompts: Sequence[str], completions: Sequence[str]) -> torch.Tensor:
        """score_N on the host (fp32), one per completion; every rank calls it together (FSDP forwards)."""
        ids = encode_texts(self.tokenizer, prompts, completions)
        lengths = [len(x) for x in ids]
        check_lengths(lengths, self.spec, prompts, completions)
        micros = micro_batches(list(range(len(ids))), lengths, 0, len(ids), self.max_tokens)
        score_N = torch.empty(len(ids), dtype=torch.float32)
        for rows in micros:
            ids_NL, attn_NL = left_pad_batch([ids[i] for i in rows], self.tokenizer.pad_token_id, self.device)
            score_N[rows] = score_forward(model, ids_NL, attn_NL, self.spec.kind, self.spec.index).cpu()
        self.last_micro_batches = len(micros)
        check_scores(score_N, prompts, completions, self.spec.path)
        return score_N


def check_lengths(
    lengths: Sequence[int], spec: RewardModelSpec, prompts: Sequence[str], completions: Sequence[str]
) -> None:
    """An input longer than the reward model's positions would be scored from positions it never saw
    (rotary embeddings extrapolate without an error): stop with the sample named instead."""
    if spec.max_positions is None or not lengths or max(lengths) <= spec.max_positions:
        return
    i = max(range(len(lengths)), key=lambda k: lengths[k])
    raise ValueError(
        f"completion {i} ({completions[i][:80]!r}, of prompt {prompts[i][:80]!r}) is {lengths[i]} tokens "
        f"for the reward model in {spec.path!r}, longer than its max_position_embeddings "
        f"{spec.max_positions}; lower rollout.max_new_tokens or data.max_prompt_tokens, or use a reward "
        "model with a longer context"
    )


def check_scores(score_N: torch.Tensor, prompts: Sequence[str], completions: Sequence[str], path: str) -> None:
    """A NaN or infinite score stops the run with the sample named (never silently dropped)."""
    bad = (~torch.isfinite(score_N)).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        raise ValueError(
            f"the reward model in {path!r} scored {score_N[i].item()} for completion {i} "
            f"({completions[i][:120]!r}, of prompt {prompts[i][:80]!r}) and {len(bad) - 1} more; "
            "scores must be finite: check the reward model's weights and dtype"
        )
