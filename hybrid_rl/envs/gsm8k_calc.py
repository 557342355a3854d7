"""GSM8K with a calculator tool: the model may call `calculator` any number of turns, then answers.

Rows are the GSM8K rows of data/gsm8k.py (`prompt` = question + instruction, `ground_truth`).
A turn without a tool call is the final answer, scored by the `gsm8k` rule reward (strict mode
by default: the number after the last `####`), so a tool-using run and a plain run are scored by
the same verifier and their curves compare.

    env.name=gsm8k_calculator     (registered below)
"""

from __future__ import annotations

from hybrid_rl.envs.base import Step, register_env
from hybrid_rl.envs.calculator import calculator
from hybrid_rl.envs.tools import ToolEnv
from hybrid_rl.rewards.math import gsm8k_reward

PREAMBLE = (
    "Solve the problem. Use the calculator tool for arithmetic when it helps; when you are done, "
    'write the final answer after "####" without calling a tool.'
)


class GSM8KCalculatorEnv(ToolEnv):
    def __init__(self, row: dict, mode: str = "strict"):
        super().__init__([calculator], preamble=PREAMBLE)
        self.row, self.mode = row, mode

    def final(self, completion: str) -> Step:
        # finish_reason "stop": the runner ends an episode whose turn was cut with finish reason "length",
        # which the overlong rules read; the env sees only text.
        meta = {**self.row, "finish_reason": "stop"}
        reward = gsm8k_reward([str(self.row.get("prompt", ""))], [completion], [meta], mode=self.mode)[0]
        return Step([], reward, True)


@register_env("gsm8k_calculator")
def gsm8k_calculator(row: dict) -> GSM8KCalculatorEnv:
    """One GSM8K-with-calculator episode for `row`."""
    return GSM8KCalculatorEnv(row)
