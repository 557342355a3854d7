"""Weights, learner ranks -> rollout ranks, after each optimizer step of the split placement.

The learner ranks gather the full weights from their FSDP2 shards bucket by bucket, each shard cast to
the inference dtype before the gather (models/weights.iter_weight_buckets, the colocated sync's own
code: the gather is a collective of the learner group's mesh, so every learner rank iterates); learner
rank 0 flattens each bucket into one tensor and broadcasts it over the sync group (learner rank 0 +
every rollout rank). A rollout rank applies each bucket through the engine's weight-update API
(begin_weight_update / update_weights / end_weight_update, rollout/base.py), so every engine that
takes colocated syncs takes these: the peak extra memory on either side is one bucket.

Each bucket is three broadcasts: a header [MAGIC, version, dtype, manifest bytes, elements], the
manifest (JSON names and shapes, so the receiver needs no copy of the learner's parameter order),
then the flat tensor. A header with no manifest ends the sync. Both sides return bytes and seconds
for the metrics (split/sync_bytes, split/sync_s); the version in every header lets the receiver refuse
a sync it did not expect instead of decoding with stale weights. A header with version STOP instead of
the expected one (`send_stop`) tells the rollout ranks that the learners stopped early (a signal): the
receiver raises SyncStopped and its loop ends at once instead of waiting out the timeout.

LoRA (model.lora.enabled): the base is frozen, and every rollout rank loads it from model.path itself
(split/roles.py load_rollout_models), so a sync sends the adapters only (`adapters=True`): the lora_A / lora_B
tensors under their peft names (models/lora.py peft_name), in buckets whose header carries ADAPTER_MAGIC, so a
receiver expecting adapters refuses full weights and the reverse. A rollout rank applies them through its
`AdapterTarget`: an engine that serves adapters (update_adapter: vLLM, SGLang) takes the whole adapter with its
config, as the colocated switch gives it; the native engine decodes on the rollout rank's own peft-injected
module, whose LoRA parameters are copied in place. Bytes per sync: the adapters' (split/sync_bytes).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from hybrid_rl.models import lora as L
from hybrid_rl.models.weights import iter_weight_buckets
from hybrid_rl.runtime import distributed as D
from hybrid_rl.split.transport import PeerError

MAGIC = 0x5EED_3E16
ADAPTER_MAGIC = 0x5EED_AD47  # the header of an adapter-only sync (LoRA)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADER_LEN = 5
STOP = -1  # the version of a header that ends the rollout ranks' loop


class SyncStopped(Exception):
    """The learners sent STOP where weights were expected: this fit() makes no more batches."""


@dataclass(frozen=True)
class SyncStats:
    version: int
    bytes: int  # payload bytes broadcast (0 on learner ranks other than the sender)
    seconds: float
    buckets: int


def _bcast(t: torch.Tensor, src: int, group, timeout_s: float, what: str) -> None:
    try:
        D.broadcast_tensor_(t, src, group=group, timeout_s=timeout_s)
    except Exception as err:  # noqa: BLE001 - gloo raises RuntimeError, NCCL DistBackendError
        raise PeerError(
            f"split weight sync: {what} failed within {timeout_s:g} s: a peer died or hangs "
            f"({type(err).__name__}: {str(err).strip().splitlines()[0][:200]})"
        ) from err


def _header(version: int, dtype: torch.dtype, manifest: bytes, numel: int, magic: int = MAGIC) -> torch.Tensor:
    return torch.tensor([magic, version, DTYPES.index(dtype), len(manifest), numel], dtype=torch.int64)


def send_weights(
    model: torch.nn.Module,
    version: int,
    *,
    src: int,
    group,
    dtype: torch.dtype,
    bucket_bytes: int,
    timeout_s: float,
    adapters: bool = False,
) -> SyncStats:
    """On every learner rank (the gathers are collectives of the learner group); global rank `src` broadcasts
    each gathered bucket in `dtype` to `group` (src + the rollout ranks). adapters: send the LoRA adapters only,
    under their peft names (module docstring)."""
    t0, sent, buckets = time.perf_counter(), 0, 0
    sender = dist.get_rank() == src
    for manifest, flat in gathered_buckets(model, dtype, bucket_bytes, adapters, sender):
        sent += send_bucket(manifest, flat, version, src, group, timeout_s, adapters)
        buckets += 1
    if sender:
        send_end(version, dtype, src, group, timeout_s, adapters)
    return SyncStats(version, sent, time.perf_counter() - t0, buckets)


def gathered_buckets(
    model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int, adapters: bool, sender: bool
) -> Iterator[tuple[bytes, torch.Tensor]]:
    """(manifest, flat host tensor) per bucket on the `sender` (learner rank 0), nothing on the other learner ranks,
    which still iterate: every learner rank's shards go into each gather (a collective of the learner group)."""
    if dtype not in DTYPES:
        raise ValueError(f"inference dtype {dtype} cannot be synced; use one of {list(DTYPES)}")
    named = [(L.peft_name(n), p) for n, p in model.named_parameters() if L.peft_name(n)] if adapters else None
    if adapters and not named:
        raise RuntimeError("an adapter-only sync of a policy without LoRA adapters (apply_lora first)")
    for bucket in iter_weight_buckets(model, bucket_bytes, dtype=dtype, named=named):
        if sender:
            manifest = json.dumps([[name, list(t.shape)] for name, t in bucket]).encode()
            yield manifest, torch.cat([t.reshape(-1) for _, t in bucket]).cpu()


def send_bucket(
    manifest: bytes, flat: torch.Tensor, version: int, src: int, group, timeout_s: float, adapters: bool = False
) -> int:
    """One bucket of version `version` from global rank `src` to `group`: header, manifest, flat; returns its bytes."""
    what = f"broadcasting a bucket of version {version} from rank {src}"
    magic = ADAPTER_MAGIC if adapters else MAGIC
    _bcast(_header(version, flat.dtype, manifest, flat.numel(), magic), src, group, timeout_s, what)
    _bcast(torch.frombuffer(bytearray(manifest), dtype=torch.uint8), src, group, timeout_s, what)
    _bcast(flat, src, group, timeout_s, what)
    return flat.numel() * flat.element_size()


def send_end(version: int, dtype: torch.dtype, src: int, group, timeout_s: float, adapters: bool = False) -> None:
    """The header with no manifest that ends the sync of `version`."""
    end = _header(version, dtype, b"", 0, ADAPTER_MAGIC if adapters else MAGIC)
    _bcast(end, src, group, timeout_s, f"ending the sync of version {version}")


def send_stop(*, src: int, group, timeout_s: float) -> None:
    """On global rank `src` (learner rank 0): tell the rollout ranks, waiting for the next weights, to stop."""
    _bcast(_header(STOP, DTYPES[0], b"", 0), src, group, timeout_s, "telling the rollout ranks to stop")


def _receive_bucket(
    src: int, group, timeout_s: float, expect_version: int, device: Optional[torch.device], expect_magic: int = MAGIC
) -> Optional[list[tuple[str, torch.Tensor]]]:
    """One bucket as (name, tensor) views of one flat buffer; None at the end of the sync."""
    who = f"learner rank {src}"
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    _bcast(header, src, group, timeout_s, f"receiving weights of version {expect_version} from {who}")
    magic, version, dtype_idx, manifest_len, numel = header.tolist()
    if magic == MAGIC and version == STOP:
        raise SyncStopped(f"{who} stopped the run before version {expect_version}")
    if magic != expect_magic or version != expect_version:
        kind = "LoRA adapters" if expect_magic == ADAPTER_MAGIC else "full weights"
        raise PeerError(
            f"split weight sync: {who} sent {header.tolist()}, expected {kind} of version "
            f"{expect_version}: the ranks disagree on which version is synced, or on model.lora"
        )
    if manifest_len == 0:
        return None
    raw = torch.empty(manifest_len, dtype=torch.uint8)
    _bcast(raw, src, group, timeout_s, f"receiving a bucket manifest from {who}")
    flat = torch.empty(numel, dtype=DTYPES[dtype_idx])
    _bcast(flat, src, group, timeout_s, f"receiving a weight bucket from {who}")
    if device is not None:
        flat = flat.to(device)
    out, pos = [], 0
    for name, shape in json.loads(bytes(raw.tolist()).decode()):
        n = 1
        for d in shape:
            n *= d
        out.append((name, flat[pos : pos + n].view(shape)))
        pos += n
    if pos != numel:
        raise PeerError(f"split weight sync: a bucket from {who} holds {numel} elements, its manifest {pos}")
    return out


def receive_weights(
    engine,
    version: int,
    *,
    src: int,
    group,
    timeout_s: float,
    device: Optional[torch.device] = None,
    adapter: Optional["AdapterTarget"] = None,
) -> SyncStats:
    """On a rollout rank: apply the sync of `version` from global rank `src` through the engine's weight-update
    API, or with `adapter` the adapter-only sync through it. An interrupted sync is aborted on the engine, which
    then expects every weight again."""
    if adapter is not None:
        return _receive_adapter(engine, version, adapter, src, group, timeout_s, device)
    t0, got, buckets = time.perf_counter(), 0, 0
    engine.begin_weight_update()
    try:
        while (bucket := _receive_bucket(src, group, timeout_s, version, device)) is not None:
            engine.update_weights(bucket)
            got += sum(t.numel() * t.element_size() for _, t in bucket)
            buckets += 1
        engine.end_weight_update()
    except BaseException:
        engine.abort_weight_update()
        raise
    return SyncStats(version, got, time.perf_counter() - t0, buckets)


class AdapterTarget:
    """Where a rollout rank puts an adapter-only sync, from its own peft-injected copy of the policy (the same
    model.lora settings as the learners'): the adapter's config and the module name of each peft name."""

    def __init__(self, model: torch.nn.Module):
        self.config = L.adapter_config(model)
        self.names = {L.peft_name(n): n for n, _ in model.named_parameters() if L.peft_name(n)}

    def apply(self, engine, named: list[tuple[str, torch.Tensor]]) -> None:
        """The whole adapter (peft names) into `engine`: update_adapter where the engine serves adapters, else
        a weight update of the module's LoRA parameters (the native engine decodes on that module)."""
        got = {n for n, _ in named}
        if got != set(self.names):
            missing, extra = sorted(set(self.names) - got)[:3], sorted(got - set(self.names))[:3]
            raise PeerError(
                f"split weight sync: the adapter sent is not this rank's adapter (missing {missing}, "
                f"unknown {extra}): the ranks disagree on model.lora"
            )
        if hasattr(engine, "update_adapter"):
            engine.update_adapter(named_tensors=named, config=self.config)
            return
        engine.begin_weight_update()
        try:
            engine.update_weights([(self.names[n], t) for n, t in named])
            engine.end_weight_update()
        except BaseException:
            engine.abort_weight_update()
            raise


def _receive_adapter(
    engine, version: int, adapter: AdapterTarget, src: int, group, timeout_s: float, device: Optional[torch.device]
) -> SyncStats:
    """Every adapter bucket of `version`, then the whole adapter applied at once (vLLM and SGLang load an adapter
    whole; it is small)."""
    t0, named, buckets = time.perf_counter(), [], 0
    while (bucket := _receive_bucket(src, group, timeout_s, version, device, ADAPTER_MAGIC)) is not None:
        named += bucket
        buckets += 1
    adapter.apply(engine, named)
    got = sum(t.numel() * t.element_size() for _, t in named)
    return SyncStats(version, got, time.perf_counter() - t0, buckets)
