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

Commit protocol: everything is written into `<root>/.tmp-step_00000010`; after every rank
has written its part (a failure anywhere is agreed on by all ranks), rank 0 writes
meta.json and renames the directory into place. A rename is atomic, so a crash or a full
disk while saving leaves the previous checkpoints as they were, and `latest` never
returns a partial one. A checkpoint resumes only on the world size that wrote it: the
per-rank RNG streams and the rank slices of each batch are what make resume bit-exact,
and they do not reshard (DCP could reshard the weights, but the run would not be the
same run); `check_compatible` refuses it before anything is built or overwritten.
"""

from __future__ import annotations

import contextlib
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

from hybrid_rl.runtime import distributed as D

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


class CheckpointError(RuntimeError):
    pass


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
    with open(meta_path) as f:
        meta = json.load(f)
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


def check_compatible(path: str, config: dict, model_config: dict, world_size: int, ignore=()) -> dict:
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
) -> str:
    """Write checkpoint `step` under `root` on every rank; returns its path once complete.

    rank_state: this rank's state (torch-saveable, weights_only-loadable). meta: JSON-safe
    (rank 0's is written). write_hf(dir): rank 0 writes the model config and tokenizer there.
    trainable_only: the weights that train and nothing else (LoRA: the adapters; the frozen base is model.path's).
    On any failure every rank raises `CheckpointError` and nothing under `root` changes
    except the removal of the temporary directory.
    """
    from torch.distributed.checkpoint import save as dcp_save

    final = step_dir(root, step)
    tmp = os.path.join(root, f".tmp-step_{step:08d}")
    failure: Optional[BaseException] = None
    if D.is_main():
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that crashed earlier
            os.makedirs(tmp)
            write_hf(os.path.join(tmp, "hf"))
        except OSError as err:
            failure = err
    _agree(failure, tmp, final, "preparing")
    model_sd, optim_sd = _state_dicts(model, optimizer, trainable_only)
    try:
        with quiet_single_process():
            dcp_save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=os.path.join(tmp, "state"),
                no_dist=not D.is_dist(),
                process_group=D.scope_group(),
            )  # split: the learner ranks
        torch.save(rank_state, os.path.join(tmp, f"rank_{D.rank():05d}.pt"))
    except Exception as err:  # DCP raises on every rank when one rank's write fails
        failure = err
    del model_sd, optim_sd
    _agree(failure, tmp, final, "writing")
    if D.is_main():
        try:
            # Ranks on other nodes write through their own view of `root`: without a shared
            # filesystem their parts are not here, and the checkpoint must not look complete.
            absent = [
                f"rank_{r:05d}.pt"
                for r in range(D.world_size())
                if not os.path.isfile(os.path.join(tmp, f"rank_{r:05d}.pt"))
            ]
            if absent or not os.path.isfile(os.path.join(tmp, "state", ".metadata")):
                raise OSError(
                    f"{', '.join(absent) or 'state/.metadata'} missing from {tmp!r} after every rank wrote "
                    "its part: trainer.out_dir / trainer.checkpoint_dir must be on a filesystem that every "
                    "node sees"
                )
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
            _replace_dir(tmp, final)
        except OSError as err:
            failure = err
    _agree(failure, tmp, final, "committing")
    return final


def _agree(failure: Optional[BaseException], tmp: str, final: str, what: str) -> None:
    """All ranks learn whether any rank failed; then every rank raises together (nobody waits forever)."""
    failed = D.all_reduce_max(torch.tensor([0.0 if failure is None else float(D.rank() + 1)]))
    if failed.item() == 0:
        return
    if D.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    bad_rank = int(failed.item()) - 1  # the highest failing rank
    cause = f": {type(failure).__name__}: {failure}" if failure is not None else f" (see rank {bad_rank}'s log)"
    raise CheckpointError(
        f"saving checkpoint {final!r} failed while {what} on rank {bad_rank}{cause}. The temporary "
        f"directory {tmp!r} was removed; earlier checkpoints are untouched"
    ) from failure


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


def remove_stale_temporaries(root: str) -> None:
    """Rank 0: temporaries left by a save that crashed (never loadable, only in the way)."""
    if D.is_main() and os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(".tmp-step_") or name.endswith(".old"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


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


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool) -> tuple[dict, dict]:
    """(model, optimizer) state dicts of a checkpoint. torch's ignore_frozen_params keeps a tied weight's second
    name (a tied LM head: the frozen embedding again), so the model's is filtered by requires_grad here too."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
    if trainable_only:
        trains = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trains}
    return model_sd, optim_sd


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False) -> dict:
    """Load weights and optimizer state (in place, this rank's shards) and return this rank's state.
    trainable_only: as `save` wrote it (LoRA: the adapters; the base stays as model.path loaded it)."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import set_state_dict

    rank_file = os.path.join(path, f"rank_{D.rank():05d}.pt")
    if not os.path.isfile(rank_file):
        raise CheckpointError(
            f"checkpoint {path!r} has no {os.path.basename(rank_file)}: it was written by fewer ranks or is damaged"
        )
    options = _options(trainable_only)
    model_sd, optim_sd = _state_dicts(model, optimizer, trainable_only)  # creates the optimizer state to load into
    state = {"model": model_sd, "optim": optim_sd}
    with quiet_single_process():
        dcp_load(
            state, checkpoint_id=os.path.join(path, "state"), no_dist=not D.is_dist(), process_group=D.scope_group()
        )
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    return torch.load(rank_file, weights_only=True)
