"""A KV cache allocated once per generate call, whose finished rows can be dropped in place.

The native engine decodes left-padded prompts in lockstep: every row writes its
keys and values to the same slot at each step, so one slot counter serves the whole
batch. The buffers of a layer are allocated at its first update (the prefill), at
their final size, and never grow: slot P + t holds the t-th fed-back token, and the
last sampled token is never fed back, so S = P + max_new_tokens - 1 slots.

Two read modes:
* prefix (eager, CPU and CUDA): `update` returns the S_written slots filled so far,
  so attention costs what a growing cache costs, without the per-token concatenation.
* full-length (CUDA graphs): `update` writes at a device-side slot index and returns
  all S slots; the caller masks the unwritten ones. Shapes and addresses stay fixed.

Dropping rows copies the live rows to the front of the same buffers (the data
pointers never change), and the layers then expose the first M rows only. A prefill
may run in chunks of prompts (`prefill_window`), or in pieces at any slot (`window`: length
buckets, a row's own tokens after its shared prompt): each piece's forward sees its own rows.

Legend: N rows allocated, M rows live (M <= N), H KV heads, S slots, D head dim,
Q query tokens of one forward.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values: buffers (N, H, S, D), views of the first M rows."""

    is_sliding = False

    def __init__(self, owner: "StaticKVCache"):
        super().__init__()
        # A proxy, not the cache itself: cache -> layers -> cache would be a reference cycle, and a cycle's
        # buffers (the whole KV cache) outlive their batch until Python's cyclic collector happens to run;
        # the next batch then allocates its cache beside the last one (the rollout's memory bill counts one).
        self.owner = weakref.proxy(owner)
        self.buf_k: torch.Tensor | None = None
        self.buf_v: torch.Tensor | None = None

    @property
    def is_compileable(self) -> bool:
        # transformers then builds a fixed-length mask; in prefix mode it may skip an all-ones decode mask.
        return self.owner.full_length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self.owner
        # Zeros, not empty: in full-length mode unwritten slots are read with weight 0,
        # and 0 * NaN from uninitialised memory would still poison the output.
        self.buf_k = key_states.new_zeros((o.max_rows, key_states.shape[1], o.max_len, key_states.shape[-1]))
        self.buf_v = value_states.new_zeros((o.max_rows, value_states.shape[1], o.max_len, value_states.shape[-1]))
        self.is_initialized = True
        self.show_rows(o.row0, o.row0 + o.rows)

    def show_rows(self, a: int, b: int) -> None:
        """Expose rows [a, b) of the buffers as this layer's keys and values."""
        self.keys, self.values = self.buf_k[a:b], self.buf_v[a:b]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: (M, H, Q, D). Returns the cached keys and values (M, H, S_read, D)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        assert key_states.shape[0] == o.rows, f"{key_states.shape[0]} rows fed, {o.rows} live in the cache"
        if o.full_length:
            self.keys.index_copy_(2, o.write_slot, key_states)
            self.values.index_copy_(2, o.write_slot, value_states)
            return self.keys, self.values
        end = o.length + key_states.shape[2]
        if end > o.max_len:
            raise RuntimeError(f"KV cache overflow: {end} slots needed, {o.max_len} allocated")
        self.keys[:, :, o.length : end].copy_(key_states)
        self.values[:, :, o.length : end].copy_(value_states)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.owner.full_length:
            return self.owner.max_len, 0
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.max_len


class StaticKVCache(Cache):
    """A transformers `Cache` over preallocated (N, H, S, D) buffers per layer.

    The engine calls `advance(Q)` after each forward (all layers have written Q slots)
    and `keep_rows(idx_M)` to drop finished rows. Layers are created at their first
    update, so the model's config need not be read here (the engine may wrap the model).
    """

    def __init__(self, max_rows: int, max_len: int):
        if max_rows < 1 or max_len < 1:
            raise ValueError(f"need at least one row and one slot, got {max_rows} rows, {max_len} slots")
        super().__init__(layers=[])
        self.max_rows, self.max_len = max_rows, max_len
        self.rows = max_rows  # M
        self.row0 = 0  # first buffer row the layers expose (nonzero only inside a chunked prefill)
        self.length = 0  # slots written, the same for every row
        self.full_length = False
        self.write_slot: torch.Tensor | None = None  # (1,) long, the slot a full-length forward writes

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(_SlotLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    # The cache's own length, not its first layer's: the first forward (layers not yet created) may start at a
    # slot > 0 (`window`), and transformers reads the past length before any layer exists.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self.max_len, 0) if self.full_length else (self.length + query_length, 0)

    def advance(self, n: int) -> None:
        """Every layer has written `n` more slots."""
        self.length += n

    def set_full_length(self, on: bool, device: torch.device | None = None) -> None:
        """Full-length mode: `write_slot` (kept equal to `length` by `sync_write_slot`) says where to write."""
        self.full_length = on
        if on and self.write_slot is None:
            self.write_slot = torch.zeros(1, dtype=torch.long, device=device)

    def sync_write_slot(self) -> None:
        """Point the device-side slot index at `length` (a fill kernel, no host sync)."""
        self.write_slot.fill_(self.length)

    def prefill_rows(self, u: int) -> None:
        """The next forward (the prefill) writes u <= N rows; `expand_rows` then makes them N."""
        self.prefill_window(0, u)

    def prefill_window(self, a: int, b: int) -> None:
        """The next forward writes prompt rows [a, b) at slots 0.. (one chunk of a chunked prefill).

        Nothing advances until every chunk has run: call prefill_window(0, U), then advance(P).
        """
        if not 0 <= a < b <= self.max_rows or self.length:
            raise ValueError(f"prefill_window({a}, {b}) needs 0 <= a < b <= {self.max_rows} before anything is written")
        self.row0, self.rows = a, b - a
        for layer in self.layers:
            layer.show_rows(a, b)

    def window(self, a: int, b: int, slot: int) -> None:
        """Expose rows [a, b) as the live rows with `slot` slots written: the next forward writes its Q tokens at
        slots slot .. slot + Q - 1 of these rows and reads slots 0 .. slot + Q - 1 (a prefill in pieces: row chunks,
        length buckets, a row's own tokens after its shared prompt). Nothing advances: when every piece is
        written, window(0, U, S) exposes the U rows with their S slots."""
        if not 0 <= a < b <= self.max_rows or not 0 <= slot <= self.max_len:
            raise ValueError(f"window({a}, {b}, {slot}) needs 0 <= a < b <= {self.max_rows}, slot <= {self.max_len}")
        self.row0, self.rows, self.length = a, b - a, slot
        for layer in self.layers:
            layer.show_rows(a, b)

    def expand_rows(self, src_N: torch.Tensor) -> None:
        """Row n becomes a copy of prefilled row src_N[n] (a prompt shared by several samples is prefilled once)."""
        n = int(src_N.numel())
        if n > self.max_rows:
            raise ValueError(f"{n} rows do not fit the {self.max_rows} allocated")
        for layer in self.layers:
            layer.buf_k[:n, :, : self.length] = layer.keys[src_N, :, : self.length]
            layer.buf_v[:n, :, : self.length] = layer.values[src_N, :, : self.length]
            layer.keys, layer.values = layer.buf_k[:n], layer.buf_v[:n]
        self.rows = n

    def keep_rows(self, idx_M: torch.Tensor) -> None:
        """Keep rows idx_M (indices into the current M rows), moved to the front of the buffers.

        Only the written slots are copied. The gather makes a temporary of the kept rows
        (once per compaction, not per token); the buffers themselves stay where they are.
        """
        m = int(idx_M.numel())
        for layer in self.layers:
            for view in (layer.keys, layer.values):
                # index_select, not view[idx_M]: the same gather at ~2.4x the speed on CPU
                # (advanced indexing builds a general index iterator over all four dims).
                view[:m, :, : self.length] = view[:, :, : self.length].index_select(0, idx_M)
            layer.keys, layer.values = layer.buf_k[:m], layer.buf_v[:m]
        self.rows = m

    def rows_kv(self, idx_A: torch.Tensor, mask_AS: torch.Tensor) -> list[torch.Tensor]:
        """The keys and values of live rows idx_A at the slots mask_AS marks (a row's real tokens, in slot order), each
        row as one host tensor (layers, 2, H, L, D): what a partial rollout keeps of a row it carries
        (rollout.partial_kv=keep), off the device so that the cache's memory goes back with the rollout."""
        out, first = [], self.layers[0].keys
        for a, mask_S in zip(idx_A.tolist(), mask_AS):
            slots = torch.nonzero(mask_S).squeeze(1)
            # One host tensor, filled a layer at a time: the device holds one layer's gather at most, not the row's.
            row = torch.empty((len(self.layers), 2, first.shape[1], slots.numel(), first.shape[3]), dtype=first.dtype)
            for i, layer in enumerate(self.layers):
                row[i, 0].copy_(layer.keys[a].index_select(1, slots))
                row[i, 1].copy_(layer.values[a].index_select(1, slots))
            out.append(row)
        return out

    def write_rows_kv(self, a: int, kv: list[torch.Tensor], end: int, device: torch.device) -> None:
        """Buffer rows a, a+1, ... get the kept rows `kv` (rows_kv's tensors), each at the L slots that end before
        `end` (left-padded: a row's real slots stay contiguous); the layers are made here, on `device`, when nothing
        was written yet."""
        if not kv:
            return
        if a + len(kv) > self.max_rows:
            raise ValueError(f"{len(kv)} kept rows from buffer row {a} do not fit the {self.max_rows} allocated")
        while len(self.layers) < kv[0].shape[0]:
            layer = _SlotLayer(self)
            layer.lazy_initialization(*(x[None].to(device) for x in kv[0][len(self.layers)]))
            self.layers.append(layer)
        for j, row in enumerate(kv):
            L = row.shape[3]
            for i, layer in enumerate(self.layers):
                layer.buf_k[a + j, :, end - L : end].copy_(row[i, 0])
                layer.buf_v[a + j, :, end - L : end].copy_(row[i, 1])

    def nbytes(self) -> int:
        """Bytes of the allocated buffers (all N rows and S slots, whatever is live)."""
        return sum(
            t.numel() * t.element_size() for layer in self.layers for t in (layer.buf_k, layer.buf_v) if t is not None
        )

    def data_ptrs(self) -> list[int]:
        """Addresses of every buffer (for tests: they must not change during a generate call)."""
        return [t.data_ptr() for layer in self.layers for t in (layer.buf_k, layer.buf_v) if t is not None]
