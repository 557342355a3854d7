"""`env.*`: the environment of multi-turn episodes (issue 28), kept torch-free like the rest of the schema.

What the keys do is hybrid_rl/envs/ (the contract, the registry) and rollout/episodes.py (the runner);
`rollout.max_turns` and `rollout.max_episode_tokens` bound an episode. The checks that need the tokenizer,
the model's context or the dataset's rows (the factory probed on the first row) run at start-up in
envs/setup.py, before the first step."""
from __future__ import annotations

from dataclasses import dataclass

from hybrid_rl.config_checks import check


@dataclass
class EnvConfig:
    """`env.*`. Neither name nor fn set: single-turn completions, as without this section."""

    name: str = ""  # a registered environment (built in: tiny_ask, gsm8k_calculator); "" = none
    fn: str = ""  # package.module:factory, imported at start-up; used instead of `name`
    timeout_s: float = 30.0  # a step running longer ends its episode (counted as episode/end_timeout)
    max_workers: int = 16  # environment steps run at once, on host threads

    @property
    def enabled(self) -> bool:
        return bool(self.name or self.fn)

    def __post_init__(self) -> None:
        check(not (self.name and self.fn), "env.fn", f"and env.name ({self.name!r}) are both set; give one of them")
        check(not self.fn or (":" in self.fn and all(self.fn.partition(":")[::2])), "env.fn",
              f"{self.fn!r} is not of the form package.module:factory")
        check(self.timeout_s > 0, "env.timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        check(isinstance(self.max_workers, int) and self.max_workers >= 1, "env.max_workers",
              f"must be an integer >= 1, got {self.max_workers!r}")
