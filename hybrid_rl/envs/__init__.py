"""Environments for multi-turn episodes (issue 28): the public contract and the built-ins.

    from hybrid_rl.envs import Environment, Step, register_env

    class Echo:                                   # any object with reset and step will do
        def reset(self, row):  return [{"role": "user", "content": row["prompt"]}]
        def step(self, text):  return Step(observation=[], reward=float("42" in text), done=True)

    @register_env("echo")                         # env.name=echo; or env.fn=my_pkg.my_mod:make_echo
    def make_echo(row):  return Echo()            # called once per episode, with the dataset row

An environment may also have `metrics() -> dict[str, float]`, read once its episode ends and reported as
the step's `episode/<name>` mean over every episode on every rank; the names may differ between episodes
and ranks (the union is gathered first, and an episode without a name counts 0 for it).

Built-ins: `tiny_ask` (envs/tiny_ask.py: ask for a hidden digit, then answer it; learnable by the
tiny CPU model) and `gsm8k_calculator` (envs/gsm8k_calc.py, on envs/tools.py's tool-calling
environment and envs/calculator.py's AST-walking calculator). The `math` reward for LaTeX
answers is rewards/latex_math.py.

Design note: how this plugs into the trainer
--------------------------------------------
The pieces are self-contained; the trainer integration is meant to be a small step:

* Config (config/schema.py): `env.name` / `env.fn` / `env.timeout_s` / `env.max_workers`, and
  `rollout.max_turns` / `rollout.max_episode_tokens`; they map one-to-one onto
  `base.resolve_env(name, fn_path)` and `rollout.episodes.EpisodeSettings`. With an environment
  set, the rollout stage calls `EpisodeRunner(engine, tokenizer, spec.factory, name, settings)
  .run(rows, G, params)` instead of `engine.generate`; `require_chat_template` and a probe of
  the factory on the first row (`make_env`) run at start-up so bad input fails before step 1.
* Batch (batch.py): an `Episode` is a Completion (`as_completion()`: response ids = turns AND
  observations, engine logprobs with 0.0 under observations, finish_reason "stop"/"length") plus
  `loss_mask`. `RolloutBatch.build` takes an optional per-completion mask and sets
  `resp_mask_NT` from it instead of from the attention mask; everything downstream that already
  reads `resp_mask_NT` / `mask_NT` (packing, shared prefix, correction, KL, aggregation) then
  sees an episode as one sequence with holes in its mask. Token-mean aggregations count an
  episode's generated tokens; sequence-mean ones divide by them (not by observation tokens).
* Rewards: `Episode.reward` (sum of step rewards) is one more part for `reward.weights`
  ("env"); a rule reward, if also set, scores the concatenated turn texts (`turn_texts`).
* Metrics: `rollout.episodes.episode_metrics(episodes)` (turns, tokens, tool calls, malformed
  calls, tool errors, observation tokens, how episodes ended) goes into the step's metrics.
"""

from hybrid_rl.envs.base import (
    EnvError,
    Environment,
    EnvSpec,
    Step,
    as_step,
    get_env,
    load_env_factory,
    make_env,
    register_env,
    resolve_env,
)

__all__ = [
    "EnvError",
    "EnvSpec",
    "Environment",
    "Step",
    "as_step",
    "get_env",
    "load_env_factory",
    "make_env",
    "register_env",
    "resolve_env",
]
