"""The critic: a causal LM's transformer body with a scalar value head, and its per-token values.

Legend: N sequences, P prompt tokens (left-padded), T response tokens (right-padded),
L = P + T, K kept positions, Q scored response tokens (packed), H hidden size, V vocab.

The critic is the policy's architecture without its LM head: the body reads the same
Hugging Face directory (AutoModel takes the `model.*` weights of a *ForCausalLM
checkpoint and leaves lm_head.weight unread), and `value_head = nn.Linear(H, 1)` maps
each last hidden state to V(s). The head is fresh (verl initialises its critic from the
actor's model path the same way, with transformers' init: normal(0, initializer_range),
bias 0) unless the directory holds a trained one:

    <dir>/config.json, <dir>/*.safetensors   the body, an ordinary HF directory (AutoModel loads it)
    <dir>/value_head.safetensors             {"weight": (1, H), "bias": (1,)}, the head (VALUE_HEAD_FILE)

save_value_model writes both, atomically. No (N, L, V) logits exist at any time: no
LM head is loaded, so none can run.

Layout: response_values returns values_NT in response_logprobs' (N, T) layout: column t
is V of the state before response token t, the head at position P-1+t (verl's critic
takes values[:, -T-1:-1] the same way), so GAE reads values and log-probs column by column.

Padding-free: packed_response_values is the critic's twin of packing.packed_response_logprobs,
with the same layouts and the same choice between them (each distinct prompt once,
models/shared_prefix.py, where the model supports it; else first-fit-decreasing packed
rows; padded where neither saves MIN_SAVING of the slots). The head reads the hidden states
at the layout's `pred_Q` slots, the ones whose logits score response token q in the
actor's packed forward, so the values land in the same (N, T) layout, 0 on padding.

Parallelism stays in models/fsdp.py: ValueModel keeps the body under `.model` as a
*ForCausalLM does, so `decoder_layers` finds `.model.layers`, `fully_shard` wraps each
layer and then the root, which owns the value head with the embeddings and final norm;
`ValueModel.from_config` lets `load_sharded` build it on the meta device on every rank
but the first (pass `load=` and `model_class=ValueModel`).
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_rl.models import shared_prefix
from hybrid_rl.models.loading import attention_implementation
from hybrid_rl.models.logprobs import check_layout, position_ids, scatter_responses
from hybrid_rl.models.packing import MIN_SAVING, VARLEN_ATTENTION, pack, plan_rows
from hybrid_rl.models.saving import atomic_dir, full_state_dict, save_weights_quietly
from hybrid_rl.runtime import distributed as D

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "VALUE_HEAD_FILE",
    "ValueModel",
    "fresh_value_head",
    "read_value_head",
    "load_value_model",
    "save_value_model",
    "response_values",
    "packed_response_values",
]

VALUE_HEAD_FILE = "value_head.safetensors"
_BODY = "model."
_HEAD = "value_head."


class ValueModel(nn.Module):
    """A transformer body (`.model`, e.g. Qwen2Model) and a scalar head (`.value_head`, nn.Linear(H, 1)).

    forward(input_ids, attention_mask, position_ids, values_to_keep, value_slots) -> values_NK1 (float32):
    V(s) at the last `values_to_keep` positions (all L when 0); with `value_slots` (Q,) instead, (Q, 1) at
    those flat positions of the (N * L) hidden states (a packed layout's scored slots). The head runs in float32 on
    the last hidden states, so bf16 training keeps the regression target's precision at
    the output; its parameters stay in the body's dtype (FSDP2 shards them with the root's).
    """

    def __init__(self, body: nn.Module, value_head: nn.Linear) -> None:
        super().__init__()
        hidden = body.config.hidden_size
        if tuple(value_head.weight.shape) != (1, hidden) or value_head.bias is None:
            raise ValueError(f"value_head must be nn.Linear({hidden}, 1) with a bias, got {value_head}")
        self.model = body
        self.value_head = value_head
        # model_config() and the FSDP2 wrapping read the transformers config from the outermost module.
        self.config = body.config

    @classmethod
    def from_config(
        cls,
        config: PretrainedConfig,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        seed: int = 0,
    ) -> ValueModel:
        """An untrained critic of `config`'s architecture, built on the current default device (meta in
        `load_sharded`); its head from `fresh_value_head(seed)`."""
        from transformers import AutoModel

        body = AutoModel.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
        return cls(body, fresh_value_head(config, dtype, seed))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        values_to_keep: int = 0,
        value_slots: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        )
        hidden_NKH = out.last_hidden_state
        if value_slots is not None:  # only the scored slots reach the head
            hidden_NKH = hidden_NKH.reshape(-1, hidden_NKH.shape[-1]).index_select(0, value_slots)
        elif values_to_keep:
            hidden_NKH = hidden_NKH[:, -values_to_keep:]
        w, b = self.value_head.weight, self.value_head.bias
        # A fresh (N, K, 1) or (Q, 1) tensor, not a view: FSDP2 hooks the root's outputs for its pre-backward.
        return F.linear(hidden_NKH.float(), w.float(), b.float())

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Checkpoint every decoder layer of the body (models/fsdp.py prepare_policy calls this)."""
        enable = (
            getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
        )
        enable(gradient_checkpointing_kwargs)

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether the body's decoder layers recompute their forward in the backward (in train mode)."""
        return bool(getattr(self.model, "is_gradient_checkpointing", False))


def fresh_value_head(config: PretrainedConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Linear:
    """nn.Linear(H, 1) with transformers' init (weight ~ normal(0, initializer_range), bias 0), from its own
    generator seeded with `seed`, so building a critic neither reads nor advances the global RNG the policy's
    sampling and the data order depend on. On the meta device it is only allocated (`load_sharded` then fills it)."""
    # skip_init: nn.Linear's own init would draw from the global RNG.
    head = nn.utils.skip_init(nn.Linear, config.hidden_size, 1, dtype=dtype, device=torch.get_default_device())
    if head.weight.is_meta:
        return head
    std = float(getattr(config, "initializer_range", 0.02))
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g, dtype=torch.float32) * std)
        head.bias.zero_()
    return head


def _hidden_size(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    hidden = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
    if not isinstance(hidden, int):
        raise ValueError(f"{os.path.join(path, 'config.json')} declares no integer hidden_size; not a transformer LM")
    return hidden


def _require_critic_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"critic model directory {path!r} does not exist; point it at the policy's directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"critic model directory {path!r} has no config.json: not a Hugging Face model directory"
        )
    weights = [f for f in glob.glob(os.path.join(path, "*.safetensors")) if os.path.basename(f) != VALUE_HEAD_FILE]
    if not weights:
        raise FileNotFoundError(
            f"critic model directory {path!r} has no *.safetensors weights besides {VALUE_HEAD_FILE}; convert the "
            "checkpoint with `model.save_pretrained(path, safe_serialization=True)`"
        )


def read_value_head(path: str, hidden_size: int) -> dict[str, torch.Tensor] | None:
    """The head saved in directory `path` ({"weight": (1, H), "bias": (1,)}), or None when it holds none.

    Raises ValueError naming the file when it does not fit a body of `hidden_size` or holds NaN / inf."""
    from safetensors.torch import load_file

    file = os.path.join(path, VALUE_HEAD_FILE)
    if not os.path.isfile(file):
        return None
    state = load_file(file)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    if set(state) != {"weight", "bias"}:
        raise ValueError(f"{file} must hold exactly the tensors 'weight' and 'bias' of the value head, got {shapes}")
    if shapes["weight"] != (1, hidden_size) or shapes["bias"] != (1,):
        raise ValueError(
            f"{file} holds a value head for hidden size {shapes['weight'][-1] if shapes['weight'] else '?'} "
            f"(weight {shapes['weight']}, bias {shapes['bias']}) but the model in {path!r} has hidden size "
            f"{hidden_size}; delete the file to start from a fresh head, or point the critic at the directory "
            "it was saved with"
        )
    if not all(bool(torch.isfinite(v).all()) for v in state.values()):
        raise ValueError(f"{file} holds NaN or inf; resume from an earlier checkpoint or delete it for a fresh head")
    return state


def load_value_model(
    path: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", *, seed: int = 0
) -> ValueModel:
    """The critic of directory `path` on the CPU (placement and sharding come later, models/fsdp.py).

    The body is the transformer of `path` (a policy directory or one save_value_model wrote); the
    head is `path`'s VALUE_HEAD_FILE when present, else fresh (fresh_value_head(seed)). The head file
    is checked before the body is read, so a mismatched one costs no load.
    """
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    _require_critic_dir(path)
    saved = read_value_head(path, _hidden_size(path))
    hf_logging.disable_progress_bar()
    # transformers logs the unread lm_head.weight of an untied policy as a warning table; the keys are checked here.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        body, info = AutoModel.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    _check_loaded_keys(path, info)
    body.config.use_cache = False  # training default, as load_causal_lm leaves the policy
    head = fresh_value_head(body.config, dtype, seed)
    if saved is not None:
        with torch.no_grad():
            head.weight.copy_(saved["weight"])
            head.bias.copy_(saved["bias"])
    return ValueModel(body, head).eval()


def _check_loaded_keys(path: str, info: dict) -> None:
    """A body weight the directory lacks would stay randomly initialised: refuse it. The LM head is the one
    checkpoint tensor a critic leaves unread; any other is named in a warning, not dropped in silence."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(
            f"critic model directory {path!r} lacks {len(missing)} weights of its config's architecture "
            f"(first: {missing[:3]}); its safetensors and config.json do not belong together"
        )
    unread = sorted(k for k in info.get("unexpected_keys") or [] if not k.startswith("lm_head."))
    if unread:
        warnings.warn(f"critic model directory {path!r}: {len(unread)} tensors not read (first: {unread[:3]})")


def save_value_model(model: nn.Module, path: str, tokenizer=None) -> str:
    """Write the critic `model` (a ValueModel, sharded or not) to directory `path`; returns `path`.

    The body as an ordinary HF directory (config.json + safetensors; the tokenizer too when given) and the
    head as VALUE_HEAD_FILE, in one atomic rename, so load_value_model(path) gives the same critic back.
    Gathers the full weights (a collective): all ranks must call it; rank 0 writes.
    """
    if not isinstance(getattr(model, "value_head", None), nn.Linear) or not hasattr(model, "model"):
        raise TypeError(f"save_value_model needs a ValueModel (a body and a value_head), got {type(model).__name__}")
    state = full_state_dict(model)
    if D.is_main():
        body = {k[len(_BODY) :]: v for k, v in state.items() if k.startswith(_BODY)}
        head = {k[len(_HEAD) :]: v.contiguous() for k, v in state.items() if k.startswith(_HEAD)}
        other = sorted(set(state) - {_BODY + k for k in body} - {_HEAD + k for k in head})
        assert not other and set(head) == {"weight", "bias"}, f"unexpected critic state keys {other or sorted(head)}"
        _write(model.model, body, head, tokenizer, path)
    D.barrier()
    return path


def _write(body_module: nn.Module, body: dict, head: dict, tokenizer, path: str) -> None:
    from safetensors.torch import save_file

    with atomic_dir(path) as tmp:
        save_weights_quietly(body_module, tmp, state_dict=body)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file(head, os.path.join(tmp, VALUE_HEAD_FILE), metadata={"format": "pt"})


def response_values(model: nn.Module, ids_NL: torch.Tensor, attn_NL: torch.Tensor, P: int) -> torch.Tensor:
    """values_NT (float32): V of the state before each response token under the critic `model`.

    Column t is the value head at position P-1+t, the position whose logits predict response
    token t in response_logprobs, so both share one (N, T) layout and one mask. Every column is
    computed, padding included (garbage there; mask it as the log-probs are masked). Positions
    count real tokens only (logprobs.position_ids), so left padding does not change a value.

    Args:
        model: a ValueModel (or its FSDP2-wrapped self).
        ids_NL: (N, L) token ids, [pad .. prompt | response .. pad] (logprobs.build_sequences).
        attn_NL: (N, L) attention mask, 1 on real tokens.
        P: prompt columns (L = P + T, P >= 1, T >= 1).
    Returns:
        values_NT: (N, T) float32, with the graph of the critic's parameters when grad is enabled.
    """
    N, T = check_layout(ids_NL, attn_NL, P)
    # K = T + 1 kept positions, P-1 .. L-1; the last one is the state after the response, which GAE never reads.
    values_NK1 = model(
        input_ids=ids_NL, attention_mask=attn_NL, position_ids=position_ids(attn_NL), values_to_keep=T + 1
    )
    assert values_NK1.shape == (N, T + 1, 1), f"the critic returned {tuple(values_NK1.shape)}, not (N, T+1, 1)"
    return values_NK1[:, :-1, 0].contiguous()


def packed_response_values(
    model: nn.Module,
    ids_NL: torch.Tensor,
    attn_NL: torch.Tensor,
    P: int,
    min_saving: float | None = None,
    share_prompts: bool | None = None,
) -> torch.Tensor:
    """`response_values` without computing padding: values_NT (float32), 0 where attn_NL[:, P:] is 0.

    The layouts of packing.packed_response_logprobs, chosen the same way: where the model supports it
    (`shared_prefix.unsupported_reason`; share_prompts None) one row of distinct tokens, each distinct prompt
    once; otherwise (share_prompts False, varlen attention, another model) first-fit-decreasing packed rows;
    padded when the chosen layout would save less than `min_saving` (default MIN_SAVING) of the N x L slots
    (0: never padded). The head reads each layout's `pred_Q` slots: the state before response token q.
    """
    min_saving = MIN_SAVING if min_saving is None else min_saving
    N, T = check_layout(ids_NL, attn_NL, P)
    limit = (1.0 - min_saving) * ids_NL.numel()
    if share_prompts is None:
        share_prompts = shared_prefix.unsupported_reason(model) is None
    if share_prompts:
        values_Q, row_Q, col_Q = _shared_prefix_values(model, ids_NL, attn_NL, P, limit)
    else:
        values_Q, row_Q, col_Q = _packed_row_values(model, ids_NL, attn_NL, P, limit)
    if values_Q is None:
        return response_values(model, ids_NL, attn_NL, P) * attn_NL[:, P:]
    assert values_Q.shape == (row_Q.numel(), 1), f"the critic returned {tuple(values_Q.shape)}, not (Q, 1)"
    (values_NT,) = scatter_responses((values_Q[:, 0],), row_Q, col_Q, N, T)
    return values_NT


def _shared_prefix_values(model, ids_NL, attn_NL, P, limit):
    """(values_Q, row_Q, col_Q) from the distinct-token row, or Nones when it would not save the slots."""
    layout = shared_prefix.build_layout(ids_NL, attn_NL, P)
    if layout.tokens > limit:
        return None, None, None
    reason = shared_prefix.unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"the shared-prefix layout cannot run this critic: {reason}")
    shared_prefix.install(model)
    # As in shared_prefix_logprobs: transformers builds no (K, K) mask, the layout carries its own.
    token = shared_prefix._BUILDING_SHARED.set(True)
    try:
        values_Q1 = model(
            input_ids=layout.ids_1K,
            position_ids=layout.pos_1K,
            attention_mask=None,
            value_slots=layout.pred_Q,
            shared_prefix=layout,
        )
    finally:
        shared_prefix._BUILDING_SHARED.reset(token)
    return values_Q1, layout.row_Q, layout.col_Q


def _packed_row_values(model, ids_NL, attn_NL, P, limit):
    """(values_Q, row_Q, col_Q) from first-fit-decreasing packed rows, or Nones when they would not save the
    slots. Positions restart at 0 in each sequence and no mask is passed: transformers reads the block-diagonal
    layout from the position ids, as in the actor's packed forward."""
    one_row = attention_implementation(model) in VARLEN_ATTENTION
    plan = plan_rows(attn_NL, one_row)
    _, capacity, bins = plan
    if len(bins) * capacity > limit:
        return None, None, None
    layout = pack(ids_NL, attn_NL, P, one_row, plan)
    values_Q1 = model(
        input_ids=layout.ids_RC, position_ids=layout.pos_RC, attention_mask=None, value_slots=layout.pred_Q
    )
    return values_Q1, layout.row_Q, layout.col_Q
