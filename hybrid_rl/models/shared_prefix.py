"""Scoring a micro-batch with each distinct prompt computed once: GRPO's G samples share it.

A GRPO micro-batch holds G samples of each prompt. The padded layout runs every
prompt G times (and every row to the longest); packing (`models.packing`) drops the
padding but still runs each prompt G times. Here the model runs on ONE row of the
distinct tokens: each distinct prompt's real tokens once, then every response's real
tokens, with the positions of the padded layout (`position_ids`: real tokens only).
Everything per token (projections, MLP, norms, the LM head) costs the distinct tokens
only: at 4-token prompts and ~22-token answers, 8 samples each, that is 13% fewer
tokens than packing; at GSM8K prompt lengths far more. Each row's last response token
is left out too: it is a target, but no log-prob is read at its position, so feeding it
would cost one token per sequence for nothing.

Attention is the one step that mixes tokens. The layout goes down to every layer as a
keyword argument of the model's forward (`shared_prefix=`), and the attention function
registered here (`install`) runs it in two parts, each in a padded layout gathered from
the distinct tokens: every distinct prompt's columns over themselves (U rows), and every
row's response columns over its prompt's columns and its own (N rows). Each distinct
token then takes its output from the one query slot that holds it. The keys each query
sees, and their order, are the padded layout's, so values equal the padded path's up to
summation order, and gradients reach a prompt token from all G of its samples through
the gathers' backward; no prompt query is computed twice. On CPU, parts with up to
`SMALL_ATTENTION_MAX_LEN` keys run the attention as two batched products (faster than
torch's CPU flash kernel at a few dozen keys); everything else runs sdpa.

A forward without the keyword goes to the base implementation unchanged, so the
installed name is `sdpa` (or `eager`) for every other forward of the model (generation,
the engine), and an activation-checkpointed layer recomputed in the backward gets the
keyword again. Supported: decoders whose attention is plain scaled dot-product over
rotated q and k (`SUPPORTED`, every layer full attention); others use `models.packing`.

Legend: N sequences, P prompt columns (left-padded), T response columns, L = P + T,
K distinct tokens (one row), U distinct prompts, Q scored response tokens, H query
heads, KV key/value heads, D head dim.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybrid_rl.models.loading import all_full_attention, attention_implementation, model_config
from hybrid_rl.models.logprobs import head_logprobs, position_ids, scatter_responses

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
BASES = ("sdpa", "eager")
_PREFIX = "hybrid_rl_shared_prefix+"
SMALL_ATTENTION_MAX_LEN = 64  # on CPU, keys up to this many: attention as two batched products (`_small_attention`)


def _rows(x_1hKD: torch.Tensor, gather_RL: torch.Tensor) -> torch.Tensor:
    """(R, h, L, D): the distinct tokens' per-head vectors (1, h, K, D) at the slots of gather_RL."""
    R, L = gather_RL.shape
    h, D = x_1hKD.shape[1], x_1hKD.shape[-1]
    # Gathered along the first dim of a (K, h, D) view (the projections' own layout): its backward, an
    # index_add_ over dim 0, runs ~4x faster on CPU than one over dim 1.
    return x_1hKD[0].transpose(0, 1).index_select(0, gather_RL.reshape(-1)).view(R, L, h, D).transpose(1, 2)


@dataclass
class AttentionPart:
    """One attention call in a padded layout: R rows, queries at Lq slots, keys at Lk slots."""

    gather_q: torch.Tensor  # (R, Lq) distinct token of each query slot (0 at padding: read, never used)
    gather_k: torch.Tensor  # (R, Lk)
    mask: torch.Tensor  # (R, 1, Lq, Lk) bool, True = may attend; a padding query sees every key (finite, discarded)
    _bias: torch.Tensor | None = None  # additive mask of the short-row attention, built at its first layer

    def run(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, dropout: float
    ) -> torch.Tensor:
        """(R * Lq, H, D): the attention output of every query slot, row-major."""
        q, k, v = _rows(query, self.gather_q), _rows(key, self.gather_k), _rows(value, self.gather_k)
        (R, H, Lq, D), KV, Lk = q.shape, k.shape[1], k.shape[2]
        if q.device.type == "cpu" and Lk <= SMALL_ATTENTION_MAX_LEN and dropout == 0.0:
            out_RHQD = self._small_attention(q, k, v, D**-0.5 if scaling is None else scaling)
        else:
            if KV != H:  # query head h reads kv head h // (H / KV), transformers' repeat_kv order
                k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
            out_RHQD = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=dropout, scale=scaling)
        return out_RHQD.transpose(1, 2).reshape(R * Lq, H, D)

    def _small_attention(self, q_RHQD, k_RKLD, v_RKLD, scale: float) -> torch.Tensor:
        """Attention written out as two batched products, for short rows.

        At a few dozen keys, torch's CPU flash kernel spends its time per (row, head) tile;
        two batched products over (row, kv head) with the G query heads of a kv head stacked
        (no repeated keys) and one softmax cost about half. The scores are materialised,
        (R, H, Lq, Lk), which is why this is for short rows only.
        """
        R, H, Lq, D = q_RHQD.shape
        KV, Lk = k_RKLD.shape[1], k_RKLD.shape[2]
        G = H // KV
        if self._bias is None or self._bias.shape[0] != R * KV or self._bias.dtype != q_RHQD.dtype:
            bias_R1QL = torch.zeros(self.mask.shape, dtype=q_RHQD.dtype, device=q_RHQD.device)
            bias_R1QL.masked_fill_(~self.mask, float("-inf"))
            self._bias = bias_R1QL.expand(R, H, Lq, Lk).reshape(R * KV, G * Lq, Lk)
        scores = torch.baddbmm(
            self._bias, q_RHQD.reshape(R * KV, G * Lq, D), k_RKLD.reshape(R * KV, Lk, D).transpose(1, 2), alpha=scale
        )
        out = torch.bmm(scores.softmax(-1), v_RKLD.reshape(R * KV, Lk, D))
        return out.view(R, H, Lq, D)


@dataclass
class SharedPrefixLayout:
    """One row of distinct tokens and the maps between it and the padded (N, L) layout.

    Attention runs in two parts: each distinct prompt's P columns over themselves (U rows),
    and every row's Ti fed response columns over its prompt's P columns and its own Ti
    (N rows), so no prompt query is computed more than once. Ti is the longest response
    less one: a row's last token is a target only (`build_layout`).
    """

    ids_1K: torch.Tensor
    pos_1K: torch.Tensor
    gather_NL: torch.Tensor  # (N, P + Ti) distinct token at each fed slot (0 at padding and each row's last token)
    prompt: AttentionPart  # (U, P) queries over (U, P) keys
    response: AttentionPart  # (N, Ti) queries over (N, P + Ti) keys
    owner_K: torch.Tensor  # slot of distinct token k in the two parts' outputs laid end to end (U * P + N * Ti)
    pred_Q: torch.Tensor  # distinct token whose hidden state predicts response token q
    target_Q: torch.Tensor
    row_Q: torch.Tensor  # (n, t) of response token q in the padded layout
    col_Q: torch.Tensor
    prompts: int  # U

    @property
    def tokens(self) -> int:
        return self.ids_1K.shape[1]

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, dropout: float
    ) -> torch.Tensor:
        """query (1, H, K, D), key and value (1, KV, K, D) of the distinct tokens -> (1, K, H, D)."""
        outs = [part.run(query, key, value, scaling, dropout) for part in (self.prompt, self.response)]
        return torch.cat(outs).index_select(0, self.owner_K)[None]


def _attention(base: str):
    def attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout: float = 0.0,
        scaling: float | None = None,
        shared_prefix: SharedPrefixLayout | None = None,
        **kwargs,
    ):
        if shared_prefix is None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            return ALL_ATTENTION_FUNCTIONS[base](
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
            raise NotImplementedError("shared-prefix attention supports full attention without softcapping only")
        return shared_prefix.attend(query, key, value, scaling, dropout), None

    return attention


# Set while `shared_prefix_logprobs` runs the model: transformers then builds no mask (the
# layout carries its own), instead of a (K, K) one from the restarting position ids.
_BUILDING_SHARED = contextvars.ContextVar("hybrid_rl_shared_prefix_forward", default=False)


def _mask(base: str):
    """The base implementation's mask builder, skipped in a shared-prefix forward (the layout has its own)."""

    def mask(*args, **kwargs):
        if _BUILDING_SHARED.get():
            return None
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, **kwargs)

    return mask


def _register(base: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = _PREFIX + base
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(name, _attention(base))
        AttentionMaskInterface.register(name, _mask(base))
    return name


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run the shared-prefix layout (None when it can)."""
    kind = getattr(model_config(model), "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} is not one of {SUPPORTED}"
    impl = attention_implementation(model)
    if impl.removeprefix(_PREFIX) not in BASES:
        return f"attention implementation {impl!r} is not one of {BASES}"
    if not all_full_attention(model):
        return "not every layer attends to the whole past (a sliding window or attention chunks)"
    return None


def install(model: torch.nn.Module) -> None:
    """Route the model's attention through the shared-prefix function (idempotent).

    The name stays installed: every forward without the `shared_prefix=` keyword runs
    the base implementation (attention and mask builder) as before, and an
    activation-checkpointed layer recomputed in the backward finds the same function
    it ran in the forward.
    """
    impl = attention_implementation(model)
    if not impl.startswith(_PREFIX):
        model_config(model)._attn_implementation = _register(impl)


def build_layout(ids_NL: torch.Tensor, attn_NL: torch.Tensor, P: int) -> SharedPrefixLayout:
    """The distinct-token row of a left-padded prompt / right-padded response batch.

    Rows whose real prompt tokens are equal share them (found on the host: one copy of
    the prompt columns per micro-batch). A row's last response token predicts nothing:
    it is scored (a target) but never fed to the model, so the model runs on the prompt
    columns and the first r - 1 response tokens of a row with r (`fed_NT`, `attn_in` below).
    """
    N = ids_NL.shape[0]
    dev = ids_NL.device
    attn = attn_NL.bool()
    p_N, r_N = attn[:, :P].sum(1), attn[:, P:].sum(1)
    if bool((p_N == 0).any()):
        raise ValueError(
            "every row needs at least one real prompt token (its last one predicts the first response token)"
        )
    first: dict[tuple[int, ...], int] = {}
    src, rep = [], []
    for n, (row, p) in enumerate(zip(ids_NL[:, :P].tolist(), p_N.tolist())):
        key = tuple(row[P - p :])
        if key not in first:
            first[key] = len(first)
            rep.append(n)
        src.append(first[key])
    # The fed layout: Ti response columns (the longest response less its last token), Li = P + Ti.
    Ti = max(int(r_N.max()) - 1, 0) if N else 0
    Li = P + Ti
    fed_NT = torch.arange(Ti, device=dev)[None, :] < (r_N - 1)[:, None]
    attn_in = torch.cat([attn[:, :P], fed_NT], 1)
    src_N = torch.tensor(src, device=dev)
    rep_U = torch.tensor(rep, device=dev)
    p_U = p_N[rep_U]
    Kp = int(p_U.sum())
    poff_U = torch.cumsum(p_U, 0) - p_U
    fed_N = fed_NT.sum(1)
    roff_N = Kp + torch.cumsum(fed_N, 0) - fed_N
    col_L = torch.arange(Li, device=dev)
    j_NL = col_L - (P - p_N)[:, None]  # place in the prompt (prompt columns)
    t_NL = col_L - P  # place in the response (response columns)
    gather_NL = torch.where(col_L < P, poff_U[src_N][:, None] + j_NL, roff_N[:, None] + t_NL)
    gather_NL = torch.where(attn_in, gather_NL, 0)
    # Distinct tokens, in order: each distinct prompt's (row rep_U[u]'s prompt columns), then each row's fed response.
    attn_UP = attn[rep_U, :P]
    pos_NL = position_ids(attn_NL)
    ids_1K = torch.cat([ids_NL[rep_U, :P][attn_UP], ids_NL[:, P:Li][fed_NT]])[None]
    pos_1K = torch.cat([pos_NL[rep_U, :P][attn_UP], pos_NL[:, P:Li][fed_NT]])[None]
    causal_PP = torch.ones((P, P), dtype=torch.bool, device=dev).tril()
    prompt = AttentionPart(
        gather_q=gather_NL[rep_U, :P],
        gather_k=gather_NL[rep_U, :P],
        mask=((causal_PP[None] & attn_UP[:, None, :]) | ~attn_UP[:, :, None])[:, None],
    )
    sees_TL = col_L[None, :] <= P + torch.arange(Ti, device=dev)[:, None]  # response column t sees slots <= P + t
    response = AttentionPart(
        gather_q=gather_NL[:, P:],
        gather_k=gather_NL,
        mask=((sees_TL[None] & attn_in[:, None, :]) | ~fed_NT[:, :, None])[:, None],
    )
    # The same order over the parts' query slots: the real slots of each part, row-major.
    owner_K = torch.cat(
        [attn_UP.reshape(-1).nonzero().squeeze(1), len(rep) * P + fed_NT.reshape(-1).nonzero().squeeze(1)]
    )
    # Response token t of row n is predicted at slot (n, P + t - 1): the prompt's last token for t = 0.
    row_Q, col_Q = attn[:, P:].nonzero(as_tuple=True)
    pred_Q = gather_NL[row_Q, P + col_Q - 1]
    return SharedPrefixLayout(
        ids_1K=ids_1K,
        pos_1K=pos_1K,
        gather_NL=gather_NL,
        prompt=prompt,
        response=response,
        owner_K=owner_K,
        pred_Q=pred_Q,
        target_Q=ids_NL[row_Q, P + col_Q],
        row_Q=row_Q,
        col_Q=col_Q,
        prompts=len(rep),
    )


def shared_prefix_logprobs(
    model: torch.nn.Module,
    ids_NL: torch.Tensor,
    attn_NL: torch.Tensor,
    P: int,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    layout: SharedPrefixLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) logp and entropy of the response tokens (0 at padding), each distinct prompt run once."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"the shared-prefix layout cannot run this model: {reason}")
    install(model)
    layout = layout or build_layout(ids_NL, attn_NL, P)

    def select(hidden_1KH: torch.Tensor) -> torch.Tensor:
        return hidden_1KH[0].index_select(0, layout.pred_Q)

    token = _BUILDING_SHARED.set(True)
    try:
        logp_Q, ent_Q = head_logprobs(
            model,
            select,
            layout.target_Q,
            temperature,
            chunk_tokens,
            input_ids=layout.ids_1K,
            position_ids=layout.pos_1K,
            attention_mask=None,
            logits_to_keep=0,
            shared_prefix=layout,
        )
    finally:
        _BUILDING_SHARED.reset(token)
    return scatter_responses((logp_Q, ent_Q), layout.row_Q, layout.col_Q, ids_NL.shape[0], ids_NL.shape[1] - P)
