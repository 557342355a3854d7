"""Sharded checkpoints: written between steps, visible only when complete, resumed to the bit.

One checkpoint is a directory `<root>/step_00000010` holding

    state/         torch.distributed.checkpoint (DCP) of {"model", "optim"}: every rank writes
                   its own shards (no gather to one rank); keys are parameter names, so the
                   export needs no process group and no GPU
    rank_00000.pt  what each rank's next step reads besides the weights: RNG states (torch,
                   CUDA, Python, NumPy), prompt-loader position, step counters, LR scheduler,
                   KL controller, reward normaliser (`run_state.Checkpointer.rank_state`)
    hf/            config.json + tokenizer of the policy: what `python -m hybrid_rl.export` needs
    meta.json      step, world size, model fingerprint, format version, and the resolved config of
                   the run that wrote it (checked on resume)
    manifest.json  every other file with its size and SHA-256 (checkpoint/manifest.py), written last

Commit protocol: everything is written into `<root>/.tmp-step_00000010`; after every rank
has written its part (a failure anywhere is agreed on by all ranks), the ranks hash the files
(each its share), rank 0 writes meta.json, then the manifest (atomically), and renames the
directory into place. A rename is atomic, so a crash or a full disk while saving leaves the
previous checkpoints as they were, and `latest` never returns a partial one; a failed save says
where it failed, what the checkpoint needed (bytes) and what is kept. Resume verifies a checkpoint
against its manifest first (`damage`): `trainer.resume=auto` skips a damaged one for the newest
intact one, saying so, and damaged or later checkpoints are moved to `<root>/set_aside/`, never
deleted. A checkpoint resumes only on the world size that wrote it: the
per-rank RNG streams and the rank slices of each batch are what make resume bit-exact,
and they do not reshard (DCP could reshard the weights, but the run would not be the
same run); `check_compatible` refuses it before anything is built or overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import time
import warnings
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from hybrid_rl.checkpoint import manifest
from hybrid_rl.runtime import distributed as D
from hybrid_rl.runtime.errors import UserError

FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")

# Config keys that may change between a run and its resume: where and how the run reports,
# how long it runs, how it checkpoints, what it keeps off the device (bit-exact either way),
# and its memory layout (below).
RESUMABLE_CHANGES = (
    "trainer.total_steps",
    "trainer.resume",
    "trainer.resume_ignore",
    "trainer.save_every",
    "trainer.keep_last",
    "trainer.checkpoint_dir",
    "trainer.out_dir",
    "trainer.progress_bar",
    "trainer.log_every",
    "trainer.loggers",
    "trainer.project",
    "trainer.experiment",
    "trainer.wandb_mode",
    "trainer.dist_timeout_s",
    "trainer.val_every",
    "trainer.val_before_train",
    "trainer.val_n",
    "trainer.val_sample_rows",
    "trainer.log_rollouts",
    "model.path",
    "offload.",
    # (not data.val_split: the held-out rows leave the training set, so it changes what the run trains on)
    "data.val_path",
    "data.val_size",
    "data.val_batch_size",
    # How the same computation is laid out in memory: after an out-of-memory error the run resumes with
    # smaller micro-batches. Same run, but no longer bit-exact (float sums in another order).
    "trainer.micro_batch_size",
    "trainer.max_tokens_per_micro_batch",
    "trainer.packing",
    "trainer.keep_host_memory",
    "model.gradient_checkpointing",
    "model.attn_implementation",
    "rollout.mem_fraction",
    "rollout.bucket_mb",
    "rollout.cuda_graphs",  # the same decode step, captured or eager (graphs pad the batch: not bit-exact)
    "reward.max_tokens_per_micro_batch",
)
# The model fields that decide whether saved shards fit the model being built.
_MODEL_KEYS = (
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


# What a failed read or write raises: DCP's CheckpointException (its ranks' errors) derives from BaseException.
_FAILURES = (Exception, CheckpointException)
SET_ASIDE = "set_aside"  # <root>/set_aside/: damaged checkpoints and those after an older one resumed


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or resumed; the message names it, what is wrong and what to do."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "meta.json")):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def checkpoint_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step_* directory under `root`, complete or damaged, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := _STEP_DIR.match(n))]
    return sorted(p for p in found if os.path.isdir(p[1]))


def latest(root: str) -> Optional[str]:
    """The newest complete checkpoint under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isdir(path):
        raise CheckpointError(
            f"checkpoint {path!r} does not exist; pass a step_* directory under "
            "<out_dir>/checkpoints, or trainer.resume=auto"
        )
    if not os.path.isfile(meta_path):
        raise CheckpointError(
            f"checkpoint {path!r} is incomplete (no meta.json: its save did not finish); "
            "resume from an older one, or trainer.resume=auto to take the newest complete one"
        )
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path!r} is damaged: meta.json does not parse ({type(err).__name__}: {err}); resume from "
            "an older one, or trainer.resume=auto to take the newest intact one"
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path!r} is damaged: meta.json holds no JSON object")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r} has format {meta.get('format')}, this library reads {FORMAT}")
    return meta


def model_fingerprint(model_config: dict) -> dict:
    return {k: model_config[k] for k in _MODEL_KEYS if k in model_config}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def check_compatible(
    path: str, config: dict, model_config: dict, world_size: int, ignore=(), defaults: Optional[dict] = None
) -> dict:
    """Raise `CheckpointError` naming what differs if the run in `config` cannot resume from `path`.

    config: the new run's resolved config as a nested dict; model_config: its model's
    config.json. Returns the checkpoint's meta.
    """
    meta = read_meta(path)
    if meta["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {path!r} was written by {meta['world_size']} ranks, this run has {world_size}; resume with "
            f"--nproc_per_node (x nodes) = {meta['world_size']}, or start a new run in another trainer.out_dir. "
            "Resuming on "
            "another world size is refused: per-rank RNG streams and batch slices would change, so it would not "
            "continue the same run"
        )
    theirs, ours = meta["model"], model_fingerprint(model_config)
    diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if diff:
        detail = ", ".join(f"{k}: checkpoint {theirs.get(k)!r} vs model.path {ours.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"checkpoint {path!r} holds another model ({detail}); point model.path at the model "
            "the run started from, or start a new run in another trainer.out_dir"
        )
    saved = flatten(meta["config"])
    new = flatten(config)
    # A key the checkpoint's config lacks was added to the schema after it was written: the run that wrote it ran
    # with what that key's default does, so only another value is a change (`defaults`: the schema's own config).
    for k, v in flatten(defaults or {}).items():
        saved.setdefault(k, v)
    allowed = tuple(RESUMABLE_CHANGES) + tuple(ignore)
    if new.get("optim.lr_schedule", "constant") != "constant" and "trainer.total_steps" not in ignore:
        # A decaying lr spans the run's length: another total_steps changes the lr of every later
        # step (the decay is re-planned over the new length), so it is no longer the same run.
        allowed = tuple(a for a in allowed if a != "trainer.total_steps")
    changed = sorted(
        k
        for k in set(saved) | set(new)
        if saved.get(k) != new.get(k) and not any(k == a or (a.endswith(".") and k.startswith(a)) for a in allowed)
    )
    if changed:
        detail = "; ".join(
            f"{k}: {saved.get(k)!r} -> {new.get(k)!r}"
            + (
                f" (the {new['optim.lr_schedule']} lr schedule decays over it: the lr would jump to "
                "the new schedule's at the next step)"
                if k == "trainer.total_steps"
                else ""
            )
            for k in changed
        )
        raise CheckpointError(
            f"config differs from checkpoint {path!r} in keys that change the run: {detail}. Set them "
            "back, list them in trainer.resume_ignore to resume anyway (no longer the same run), "
            "or start a new run in another trainer.out_dir"
        )
    return meta


# -- verify -------------------------------------------------------------------
def damage(path: str) -> list[str]:
    """What is wrong with checkpoint `path`, one phrase per file ([] when intact). Collective: every rank calls
    it; rank 0 reads meta.json and the manifest and checks presence and sizes, then each rank hashes its share
    of the files (checkpoint/manifest.py)."""
    problems, files = None, None
    if D.is_main():
        problems, files = _cheap_damage(path)
    problems, files = D.broadcast_object_from((problems, files), 0)
    if problems or not files:
        return problems
    names = sorted(files)[D.rank() :: D.world_size()]
    mine = manifest.checksum_problems(path, {n: files[n] for n in names})
    return sorted(p for part in D.all_gather_object(mine) for p in part)


def _cheap_damage(path: str) -> tuple[list[str], Optional[dict]]:
    """(problems found without reading the files, the manifest's entries or None)."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return ["meta.json is missing"], None
    except (OSError, ValueError) as err:
        return [f"meta.json does not parse ({type(err).__name__}: {err})"], None
    if not isinstance(meta, dict):
        return ["meta.json holds no JSON object"], None
    try:
        files = manifest.read(path)
    except ValueError as err:
        return [str(err)], None
    if files is None:  # written before manifests
        return manifest.legacy_problems(path, int(meta.get("world_size", 1))), None
    return manifest.size_problems(path, files), files


def describe_damage(problems: list[str]) -> str:
    return "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")


def newest_intact(root: str) -> tuple[Optional[str], list[tuple[str, list[str]]]]:
    """(the newest intact checkpoint under `root` or None, [(path, problems)] of the damaged ones newer than it).
    Collective. Raises when checkpoints exist and none is intact: starting over silently would lose the run."""
    found = D.broadcast_object_from(checkpoint_dirs(root) if D.is_main() else None, 0)
    damaged = []
    for _, path in reversed(found):
        problems = damage(path)
        if not problems:
            return path, damaged
        damaged.append((path, problems))
    if damaged:
        detail = " | ".join(f"{os.path.basename(p)}: {describe_damage(pr)}" for p, pr in damaged)
        raise CheckpointError(
            f"no intact checkpoint under {root} (trainer.resume=auto): {detail}. Nothing was moved or deleted. To "
            f"start over, run with trainer.resume=none in another trainer.out_dir (or move the step_* directories "
            f"out of {root})"
        )
    return None, []


def check_intact(path: str, root: str) -> None:
    """Raise (every rank) naming each damaged file of checkpoint `path` and the command that recovers: the
    newest intact checkpoint older than it (verified here, only when `path` is damaged)."""
    if D.broadcast_object_from(os.path.isdir(path) if D.is_main() else None, 0):
        problems = damage(path)
    else:
        problems = []  # read_meta names a path that does not exist
    if not problems:
        return
    older = [p for _, p in D.broadcast_object_from(checkpoint_dirs(root) if D.is_main() else None, 0)]
    if is_step_dir(path):
        older = [p for p in older if _step_of(p) < _step_of(os.path.normpath(path))]
    fallback = next((p for p in reversed(older) if not damage(p)), None)
    fix = (
        f"resume from the newest intact one before it: trainer.resume={fallback}"
        if fallback
        else "no intact checkpoint precedes it: start over with trainer.resume=none in another trainer.out_dir"
    )
    raise CheckpointError(f"checkpoint {path!r} is damaged: {describe_damage(problems)}. To recover, {fix}")


def _step_of(path: str) -> int:
    return int(_STEP_DIR.match(os.path.basename(path)).group(1))


def is_step_dir(path: str) -> bool:
    """`path` is named as a checkpoint (step_00000010), whatever it holds."""
    return bool(_STEP_DIR.match(os.path.basename(os.path.normpath(path))))


def set_aside(path: str, reason: str) -> str:
    """Rank 0: move checkpoint `path` to `<its root>/set_aside/<name>-<reason>` (a free name); returns where.
    Nothing a checkpoint holds is deleted by resume: the user decides."""
    root, name = os.path.split(os.path.normpath(path))
    target = os.path.join(root, SET_ASIDE, f"{name}-{reason}")
    n = 1
    while os.path.exists(target + ("" if n == 1 else f".{n}")):
        n += 1
    target += "" if n == 1 else f".{n}"
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(path, target)
    return target


# -- RNG ----------------------------------------------------------------------
def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python's and NumPy's global generators: a run starts from the
    same state whatever ran before it in the process (a notebook, a test session)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict:
    """This process's random number generators, in a form `torch.load(weights_only=True)` accepts.

    CUDA: only this rank's device (the current one, which `distributed.init` set), the one its
    kernels draw from. A list over every visible GPU (`get_rng_state_all`) could not be restored
    by a resume that sees fewer of them."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved; CUDA goes to this rank's (current) device only.

    Earlier checkpoints (same format) kept the CUDA state of every visible GPU as a list: this
    rank's entry is the one at its device's index (`pick_device` gave the rank that index then too)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" not in state or not torch.cuda.is_available():
        return  # without a GPU nothing draws from a CUDA generator
    device = torch.cuda.current_device()
    cuda = state["cuda"]
    if isinstance(cuda, (list, tuple)):  # the old layout: one state per GPU the saving rank saw
        if device >= len(cuda):
            raise CheckpointError(
                f"the checkpoint's rank file holds CUDA random-number states for {len(cuda)} GPU(s) (the old layout, "
                f"one per visible GPU) and this rank runs on cuda:{device}, which is not among them; resume with the "
                "GPUs visible as when it was saved (CUDA_VISIBLE_DEVICES, --nproc_per_node)"
            )
        cuda = cuda[device]
    torch.cuda.set_rng_state(cuda, device)


# -- save ---------------------------------------------------------------------
def save(
    root: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank_state: dict,
    meta: dict,
    write_hf,
    trainable_only: bool = False,
    extra: Optional[dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]] = None,
) -> str:
    """Write checkpoint `step` under `root` on every rank; returns its path once complete.

    rank_state: this rank's state (torch-saveable, weights_only-loadable). meta: JSON-safe
    (rank 0's is written). write_hf(dir): rank 0 writes the model config and tokenizer there.
    trainable_only: the weights that train and nothing else (LoRA: the adapters; the frozen base is model.path's).
    extra: more trained models by name, each with its optimizer (PPO's critic: {"critic": (critic, its AdamW)}),
    saved beside the policy as state/'s "<name>" and "<name>_optim".
    On any failure every rank raises `CheckpointError` and nothing under `root` changes
    except the removal of the temporary directory.
    """
    from torch.distributed.checkpoint import save as dcp_save

    final = step_dir(root, step)
    tmp = os.path.join(root, f".tmp-step_{step:08d}")
    model_sd, optim_sd = _state_dicts(model, optimizer, trainable_only)
    state = {"model": model_sd, "optim": optim_sd, **_extra_state(extra)}
    # What the weights and optimizer state take on disk, every rank's: the full-disk message names it.
    need = int(D.all_reduce_sum(torch.tensor([_tensor_bytes(*state.values())], dtype=torch.float64)).item())
    commit = _Commit(root, tmp, final, need)
    failure: Optional[BaseException] = None
    if D.is_main():
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that crashed earlier
            os.makedirs(tmp)
            write_hf(os.path.join(tmp, "hf"))
        except _FAILURES as err:  # every rank must hear of it, whatever it is
            failure = err
    commit.agree(failure, "preparing")
    try:
        with quiet_single_process():
            dcp_save(
                state,
                checkpoint_id=os.path.join(tmp, "state"),
                no_dist=not D.is_dist(),
                process_group=D.scope_group(),
            )  # split: the learner ranks
        torch.save(rank_state, os.path.join(tmp, f"rank_{D.rank():05d}.pt"))
    except _FAILURES as err:  # DCP raises on every rank when one rank's write fails
        failure = err
    del model_sd, optim_sd, state
    commit.agree(failure, "writing")
    files = None
    if D.is_main():
        try:
            files = _written_files(tmp)
        except _FAILURES as err:
            failure = err
    commit.agree(failure, "checking")
    files = D.broadcast_object_from(files, 0)
    entries: dict = {}
    try:  # each rank hashes its share of the files: a big checkpoint is not read by one rank alone
        entries = manifest.describe(tmp, files[D.rank() :: D.world_size()])
    except _FAILURES as err:
        failure = err
    commit.agree(failure, "checksumming")
    entries = {k: v for part in D.all_gather_object(entries) for k, v in part.items()}
    if D.is_main():
        try:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(
                    {
                        "format": FORMAT,
                        "step": step,
                        "world_size": D.world_size(),
                        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        **meta,
                    },
                    f,
                    indent=1,
                )
                f.flush()
                os.fsync(f.fileno())
            entries.update(manifest.describe(tmp, ["meta.json"]))
            manifest.write(tmp, entries)  # last, atomically: a checkpoint with a manifest is whole
            _replace_dir(tmp, final)
        except _FAILURES as err:
            failure = err
    commit.agree(failure, "committing")
    return final


def _tensor_bytes(*state_dicts: dict) -> float:
    """Bytes of this rank's tensors (its shards) in nested state dicts."""
    total = 0
    for sd in state_dicts:
        for v in flatten(sd).values():
            if torch.is_tensor(v):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return float(total)


def _written_files(tmp: str) -> list[str]:
    """Rank 0, after every rank wrote its part: the files to list in the manifest; OSError when a part is absent."""
    # Ranks on other nodes write through their own view of `root`: without a shared
    # filesystem their parts are not here, and the checkpoint must not look complete.
    absent = [
        f"rank_{r:05d}.pt" for r in range(D.world_size()) if not os.path.isfile(os.path.join(tmp, f"rank_{r:05d}.pt"))
    ]
    if absent or not os.path.isfile(os.path.join(tmp, "state", ".metadata")):
        raise OSError(
            f"{', '.join(absent) or 'state/.metadata'} missing from {tmp!r} after every rank wrote "
            "its part: trainer.out_dir / trainer.checkpoint_dir must be on a filesystem that every "
            "node sees"
        )
    return manifest.listing(tmp)


class _Commit:
    """One save's failure protocol: every rank learns whether any rank failed at a stage, then all raise together
    (nobody waits forever) with one message: where it failed, what the checkpoint needed, what was kept."""

    def __init__(self, root: str, tmp: str, final: str, need: int):
        self.root, self.tmp, self.final, self.need = root, tmp, final, need

    def agree(self, failure: Optional[BaseException], what: str) -> None:
        failed = D.all_reduce_max(torch.tensor([0.0 if failure is None else float(D.rank() + 1)]))
        if failed.item() == 0:
            return
        free = _free_bytes(self.root)  # before the partial checkpoint's removal frees its bytes
        if D.is_main():
            shutil.rmtree(self.tmp, ignore_errors=True)
        bad_rank = int(failed.item()) - 1  # the highest failing rank
        raise CheckpointError(self.message(failure, what, bad_rank, free)) from failure

    def message(self, failure: Optional[BaseException], what: str, bad_rank: int, free: Optional[int]) -> str:
        head = f"saving checkpoint {self.final!r} failed while {what} on rank {bad_rank}"
        space = f"the checkpoint needs about {human_bytes(self.need)} ({self.need} bytes of weights and optimizer)"
        if free is not None:
            space += f" and {human_bytes(free)} are free there"
        if failure is None:
            cause = f" (see rank {bad_rank}'s log; {space})"
        elif disk_full(failure, free, self.need):
            where = _failed_path(failure) or self.tmp
            cause = f": the disk is full at {where} ({_first_line(failure)}); {space}"
        else:  # (DCP's CheckpointException only wraps what a rank raised: its last line names that)
            kind = "" if isinstance(failure, CheckpointException) else f"{type(failure).__name__}: "
            cause = f": {kind}{_first_line(failure)}"
        kept = [s for s, _ in complete_checkpoints(self.root)]
        many = "s" if len(kept) > 1 else ""
        kept_text = (
            f"the checkpoint{many} of step{many} {', '.join(map(str, kept))} under {self.root}, untouched (resume "
            f"from step {kept[-1]} with trainer.resume=auto)"
            if kept
            else "no earlier checkpoint exists"
        )
        fix = " Free space, or set trainer.checkpoint_dir to a larger disk." if "disk is full" in cause else ""
        return f"{head}{cause}. Kept: {kept_text}; the partial {self.tmp!r} was removed.{fix}"


def disk_full(err: BaseException, free: Optional[int], need: int) -> bool:
    """True when `err` (or what caused it) is the disk or a quota running out. torch's zip writer reports a short
    write as `unexpected pos ... vs ...` without the errno: then a filesystem with less room than the checkpoint
    needs is the cause."""
    seen = set()
    e: Optional[BaseException] = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return "unexpected pos" in str(err) and free is not None and free < need


def _failed_path(err: BaseException) -> Optional[str]:
    e: Optional[BaseException] = err
    while e is not None:
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
        e = e.__cause__ or e.__context__
    return None


def _first_line(err: BaseException) -> str:
    """The line of `err` that says what failed: DCP's CheckpointException lists each rank's traceback, whose last
    line is the error itself."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [type(err).__name__]
    return (lines[-1] if isinstance(err, CheckpointException) else lines[0])[:300]


def _free_bytes(path: str) -> Optional[int]:
    """Free bytes on the filesystem holding `path` (its nearest existing parent), None if unknown."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def human_bytes(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} bytes"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if n < 1000 or unit == "GB":
            break
    return f"{n:.2f} {unit}"


def _replace_dir(tmp: str, final: str) -> None:
    """Make `tmp` visible as `final`; an existing `final` (the same step saved again) is replaced."""
    if os.path.isdir(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)  # meta.json goes with it: never a partial `final`
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def prune(root: str, keep_last: int) -> list[str]:
    """Rank 0: delete all but the newest `keep_last` complete checkpoints (0 = keep all) and stale temporaries."""
    removed = []
    if not D.is_main():
        return removed
    found = complete_checkpoints(root)
    for _, path in found[:-keep_last] if keep_last and len(found) > keep_last else []:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_stale_temporaries(root: str) -> list[str]:
    """Rank 0: remove what a save that was killed left (never loadable, only in the way), saying so; returns the
    lines said. A `step_*.old` whose checkpoint is missing (killed between the two renames of a re-save) is the
    only copy of that step: it is renamed back, not removed."""
    said: list[str] = []
    if not (D.is_main() and os.path.isdir(root)):
        return said
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.endswith(".old") and _STEP_DIR.match(name[:-4]) and not os.path.exists(path[:-4]):
            os.replace(path, path[:-4])
            said.append(f"checkpoint: restored {path[:-4]} from {name}, left by a save stopped while replacing it")
        elif name.startswith(".tmp-step_") or name.endswith(".old"):
            shutil.rmtree(path, ignore_errors=True)
            said.append(
                f"checkpoint: removed {path}, left by a save that did not finish (never a complete checkpoint; the "
                "complete ones are untouched)"
            )
    for line in said:
        print(line, flush=True)
    return said


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when no group exists: on one rank that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- load ---------------------------------------------------------------------
def _options(trainable_only: bool):
    """The state-dict options of a checkpoint: with `trainable_only` the frozen parameters are left out (and not
    asked for on load: what DCP cannot find for the parameters that remain still raises)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _extra_state(extra: Optional[dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]]) -> dict:
    """{"<name>": model state, "<name>_optim": its optimizer's} for each extra trained model."""
    out = {}
    for name, (m, o) in (extra or {}).items():
        out[name], out[f"{name}_optim"] = _state_dicts(m, o, False)
    return out


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool) -> tuple[dict, dict]:
    """(model, optimizer) state dicts of a checkpoint. torch's ignore_frozen_params keeps a tied weight's second
    name (a tied LM head: the frozen embedding again), so the model's is filtered by requires_grad here too."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
    if trainable_only:
        trains = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trains}
    return model_sd, optim_sd


def load(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainable_only: bool = False,
    extra: Optional[dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]] = None,
) -> dict:
    """Load weights and optimizer state (in place, this rank's shards) and return this rank's state.
    trainable_only, extra: as `save` wrote them (LoRA: the adapters; the base stays as model.path loaded it)."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import set_state_dict

    rank_file = os.path.join(path, f"rank_{D.rank():05d}.pt")
    if not os.path.isfile(rank_file):
        raise CheckpointError(
            f"checkpoint {path!r} has no {os.path.basename(rank_file)}: it was written by fewer ranks or is damaged"
        )
    options = _options(trainable_only)
    model_sd, optim_sd = _state_dicts(model, optimizer, trainable_only)  # creates the optimizer state to load into
    state = {"model": model_sd, "optim": optim_sd, **_extra_state(extra)}
    # Verified before (`damage`), so an error here is a file changed since, or a checkpoint without a manifest:
    # name the checkpoint and the part, never only torch's words from deep inside it.
    with _reading(path, "state/ (the weights and optimizer state)"), quiet_single_process():
        dcp_load(
            state, checkpoint_id=os.path.join(path, "state"), no_dist=not D.is_dist(), process_group=D.scope_group()
        )
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    for name, (m, o) in (extra or {}).items():
        set_state_dict(m, o, model_state_dict=state[name], optim_state_dict=state[f"{name}_optim"])
    with _reading(path, os.path.basename(rank_file)):
        return torch.load(rank_file, weights_only=True)


@contextlib.contextmanager
def _reading(path: str, part: str) -> Iterator[None]:
    try:
        yield
    except _FAILURES as err:
        raise CheckpointError(
            f"checkpoint {path!r} is damaged: reading {part} failed ({type(err).__name__}: {_first_line(err)}); "
            "resume from an older one (trainer.resume=<its step_* directory>), or move this one out of the "
            "checkpoint directory and use trainer.resume=auto"
        ) from err
