"""Pre-flight: the checks of a config that need the machine, the model directory or an engine.

The schema (config/) checks each value alone and imports no torch and no engine; what needs more runs here,
before any model is built: the model directories exist, the ranks divide the batch, the engine can serve
the LoRA adapter (each engine's own rule, from its folder), the split placement's layout. Every refusal is a
`ValueError` reading `config key 'section.key': ...`, like the schema's.
"""

from __future__ import annotations

import inspect
import os

from hybrid_rl.config.checks import check
from hybrid_rl.config.schema import Config, LoraSettings
from hybrid_rl.models.lora import check_model_dir
from hybrid_rl.rollout.base import engine_class
from hybrid_rl.rollout.sglang.lora import check_targets
from hybrid_rl.rollout.vllm.lora import max_lora_rank
from hybrid_rl.split.placement import check_placement


def check_engine(settings: LoraSettings, engine: str) -> None:
    """The rollout engines that serve adapters: native (the live module), vLLM (its LoRA API, rank in vLLM's
    allowed max_lora_rank values) and SGLang (its LoRA API, target modules among the ones it adapts)."""
    if not settings.enabled:
        return
    if engine == "vllm":
        max_lora_rank(settings.rank)  # raises for a rank vLLM cannot serve
        return
    if engine == "sglang":
        check_targets(settings.target_modules)  # raises for a module SGLang cannot adapt
        return
    if engine != "native":
        raise ValueError(
            f"config key 'model.lora.rank': rollout.engine={engine!r} has no adapter sync in this "
            "library yet; use rollout.engine=native, vllm or sglang, or model.lora.rank=0"
        )


def check_partial_engine(engine: str) -> None:
    """rollout.partial needs an engine that continues a sample from token ids and stops early (a `partial`
    argument to generate: rollout/base.py)."""
    params = inspect.signature(engine_class(engine).generate).parameters
    check(
        "partial" in params,
        "rollout.partial",
        f"rollout.engine={engine!r} cannot stop a rollout early or continue a carried sample (its generate takes "
        "no PartialRequest); use rollout.engine=native or set rollout.partial=false",
    )


def _check_model_dir(path: str, key: str, what: str) -> None:
    check(os.path.isdir(path), key, f"directory {path!r} does not exist; give a local Hugging Face {what} directory")
    check(
        os.path.isfile(os.path.join(path, "config.json")),
        key,
        f"{path!r} has no config.json; is it a Hugging Face model directory?",
    )


def validate_runtime(cfg: Config, world_size: int) -> None:
    """Checks that need the machine (paths, ranks); raised before any model is built."""
    check(bool(cfg.model.path), "model.path", "is empty; point it at a local Hugging Face model directory")
    _check_model_dir(cfg.model.path, "model.path", "model")
    if cfg.has_critic and cfg.critic.path:
        _check_model_dir(cfg.critic.path, "critic.path", "critic")
    if cfg.reward.model_path:
        _check_model_dir(cfg.reward.model_path, "reward.model_path", "reward model")
    # model.lora.*: the engine serves adapters, model.path is no adapter directory, every target matches a
    # Linear no narrower than the rank (the model built on the meta device from config.json: no weights read)
    check_engine(cfg.model.lora, cfg.rollout.engine)
    if cfg.rollout.partial:
        check_partial_engine(cfg.rollout.engine)
    check_model_dir(cfg.model.lora, cfg.model.path)
    if cfg.rollout.engine in ("sglang", "vllm"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        check(
            local % cfg.rollout.tp_size == 0,
            "rollout.tp_size",
            f"{cfg.rollout.tp_size} does not divide the {local} ranks of this node",
        )
    if cfg.trainer.placement == "split":  # refusals naming the key (split/placement.py); the learners train
        t, a = cfg.trainer, cfg.algorithm
        check_placement(
            world_size,
            t.rollout_ranks,
            t.max_staleness,
            t.stale_samples,
            tp_size=cfg.rollout.tp_size,
            batch_size=cfg.data.batch_size,
            group_size=cfg.rollout.n,
            mini_batch_size=a.mini_batch_size,
            rollout_correction=a.rollout_correction,
            engine=cfg.rollout.engine,
        )
        world_size -= t.rollout_ranks
    b = cfg.data.batch_size
    check(
        b % world_size == 0,
        "data.batch_size",
        f"{b} prompts do not divide over {world_size} ranks; use a multiple of {world_size}",
    )
    n_seq = b * cfg.rollout.n
    mb = cfg.algorithm.mini_batch_size or n_seq
    check(
        n_seq % mb == 0,
        "algorithm.mini_batch_size",
        f"{mb} does not divide the {n_seq} sequences of a step (data.batch_size x rollout.n)",
    )
    check(mb % world_size == 0, "algorithm.mini_batch_size", f"{mb} sequences do not divide over {world_size} ranks")
    check(
        mb % cfg.rollout.n == 0,
        "algorithm.mini_batch_size",
        f"counts sequences, and {mb} is not a multiple of rollout.n={cfg.rollout.n}: a mini-batch would split a "
        f"prompt's group (verl's ppo_mini_batch_size counts prompts: multiply it by rollout.n)",
    )
    buffer = cfg.algorithm.overlong_buffer_len
    check(
        buffer is None or buffer <= cfg.rollout.max_new_tokens,
        "algorithm.overlong_buffer_len",
        f"{buffer} is longer than rollout.max_new_tokens={cfg.rollout.max_new_tokens}; use at most that (or null)",
    )
