"""Settings the Trainer hands to what it builds: `rollout.cuda_graphs` to the native engine, and the process
groups' timeout (`trainer.dist_timeout_s`, null: derived from the rollout) to `distributed.init`."""

from __future__ import annotations

import pytest

from hybrid_rl import load_config
from hybrid_rl.config.schema import DECODE_STEP_BOUND_MS, DIST_TIMEOUT_FLOOR_S


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """A Trainer with rollout.cuda_graphs=false, and the timeout it gave distributed.init (read by name)."""
    from hybrid_rl import Trainer
    from hybrid_rl.runtime import distributed as D

    seen = []
    real = D.init
    overrides = [
        f"model.path={tiny_model_dir}",
        "data.batch_size=4",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "trainer.total_steps=1",
        f"trainer.out_dir={tmp_path_factory.mktemp('settings')}",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "rollout.cuda_graphs=false",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "init", lambda device="auto", timeout_s=300: seen.append(timeout_s) or real(device, timeout_s))
        trainer = Trainer(load_config(None, overrides))
    return trainer, seen


def test_rollout_cuda_graphs_reaches_the_native_engine(built):
    """Catches: rollout.cuda_graphs not passed to the engine (it would capture graphs on CUDA whatever the key
    says, and the GPU script's eager-against-graphs comparison would compare graphs with graphs)."""
    from hybrid_rl.rollout.native.decode_path import choose_decode_path

    trainer, _ = built
    assert trainer.engine.cuda_graphs is False
    path = choose_decode_path("cuda", trainer.engine.cuda_graphs, trainer.engine.lean_step, None, True, "sdpa")
    assert path.name == "lean", "on CUDA the engine decodes eagerly through the lean step"
    assert choose_decode_path("cuda", None, None, None, True, "sdpa").name == "cuda_graph", "null: graphs on CUDA"


def test_rollout_cuda_graphs_is_refused_for_the_other_engines():
    for engine in ("vllm", "sglang"):
        with pytest.raises(ValueError, match="config key 'rollout.cuda_graphs'"):
            load_config(None, [f"rollout.engine={engine}", "rollout.cuda_graphs=false"])


def test_the_trainer_opens_its_process_groups_with_the_derived_timeout(built):
    """Catches: the process group opened with a fixed 300 s (the old default) or with trainer.dist_timeout_s's
    null instead of the timeout derived from the rollout."""
    trainer, seen = built
    assert trainer.cfg.trainer.dist_timeout_s is None
    assert seen == [trainer.cfg.process_group_timeout_s] == [DIST_TIMEOUT_FLOOR_S]


def test_the_derived_timeout_grows_with_the_longest_rollout_and_a_number_wins():
    """Catches: a default that a long generation outlasts (300 s ended multi-GPU runs whose rollout took longer:
    the ranks that finished first wait in the next collective), and rounds or turns left out of the bound."""
    tokens = 32768

    def timeout(*overrides: str) -> int:
        return load_config(None, list(overrides)).process_group_timeout_s

    assert timeout() == DIST_TIMEOUT_FLOOR_S >= 1800
    one = timeout(f"rollout.max_new_tokens={tokens}")
    assert one == tokens * DECODE_STEP_BOUND_MS // 1000 > 2 * 3600
    rounds = timeout(
        f"rollout.max_new_tokens={tokens}", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"
    )
    assert rounds == 3 * one
    turns = timeout(f"rollout.max_new_tokens={tokens}", "env.name=tiny_ask", "rollout.max_turns=2")
    assert turns == 2 * one
    assert timeout(f"rollout.max_new_tokens={tokens}", "trainer.dist_timeout_s=77") == 77
    with pytest.raises(ValueError, match="config key 'trainer.dist_timeout_s'"):
        load_config(None, ["trainer.dist_timeout_s=0"])
