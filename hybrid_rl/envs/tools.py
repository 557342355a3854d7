"""A tool-calling environment: tools are plain Python functions, called in Qwen2.5's format.

The schema of a tool (OpenAI / Qwen2.5 `tools` form) comes from its signature and its docstring:
the first paragraph describes the function, a Google-style `Args:` section describes each
parameter, and type hints give JSON types. The model calls a tool by writing

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * 4"}}
    </tool_call>

(the format of Qwen2.5's chat template); each call's result comes back as a {"role": "tool"}
message. Nothing the model writes can crash the run: a call that is not JSON, names no known
tool, or whose arguments do not fit the signature is a MALFORMED call, and a tool that raises is
a TOOL ERROR; both become observations that say what went wrong (so the policy can learn from
them) and are counted in `metrics()`, which the episode runner sums into the rollout metrics.

The tool list is written into the system message by `reset` (`tool_system_prompt`), so it
reaches the model under any chat template, not only templates that render a `tools` argument.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from typing import Any, Callable, Optional, Sequence

from hybrid_rl.envs.base import Step

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_RESULT_CHARS = 2000  # a tool's answer is cut here: observations cost context and episode tokens


def _doc_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    head, _, rest = doc.partition("\nArgs:")
    description = " ".join(head.split("\n\n")[0].split())
    params: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        m = re.match(r"\s{2,}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
        if m:
            current = m.group(1)
            params[current] = m.group(2).strip()
        elif line.strip() and current is not None and line.startswith(" " * 6):
            params[current] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break  # the next section (Returns:, Raises:)
    return description, params


def _json_type(hint: Any) -> str:
    origin = typing.get_origin(hint) or hint
    return _JSON_TYPES.get(origin, "string")


def tool_schema(fn: Callable) -> dict:
    """The `tools` entry of a function: name, description, parameters (types from hints, text from the docstring)."""
    description, docs = _doc_parts(fn)
    if not description:
        raise ValueError(f"tool {fn.__name__!r} has no docstring; its first paragraph tells the model what it does")
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {fn.__name__!r}: *args / **kwargs cannot be described to the model")
        props[name] = {"type": _json_type(hints.get(name, str)), "description": docs.get(name, "")}
        if p.default is p.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def tool_system_prompt(schemas: Sequence[dict], preamble: str = "") -> str:
    """A system message listing the tools and the call format, worded as Qwen2.5's template words it."""
    listed = "\n".join(json.dumps(s) for s in schemas)
    return (
        (preamble + "\n\n" if preamble else "") + "# Tools\n\nYou may call one or more functions to assist "
        "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def parse_tool_calls(text: str) -> tuple[list[tuple[str, dict]], list[str]]:
    """(well-formed calls as (name, arguments), one problem description per malformed call) in `text`.

    A `<tool_call>` left open (the turn was cut) is malformed; so is a body that is not a JSON
    object with a string "name" and an object "arguments" (a JSON string holding one is accepted,
    as some models write it)."""
    calls, problems = [], []
    for m in _CALL_RE.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            problems.append(f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            problems.append('the tool call must be a JSON object with a string "name"')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            problems.append(f'the "arguments" of {obj["name"]!r} must be a JSON object')
            continue
        calls.append((obj["name"], args))
    opened, closed = text.count("<tool_call>"), text.count("</tool_call>")
    problems += ["a <tool_call> is not closed with </tool_call>"] * max(0, opened - closed)
    return calls, problems


class ToolEnv:
    """Runs the tools the model calls; a turn without a tool call is its final answer (`final`, to override).

    One object per episode (the factory makes a fresh one), so the counters are this episode's."""

    def __init__(self, tools: Sequence[Callable], preamble: str = "", max_calls_per_turn: int = 8):
        self.tools = {fn.__name__: fn for fn in tools}
        if len(self.tools) != len(tools):
            raise ValueError("tool names must be unique")
        self.schemas = [tool_schema(fn) for fn in tools]
        self.preamble, self.max_calls_per_turn = preamble, max_calls_per_turn
        self.counts = {"tool_calls": 0, "malformed_calls": 0, "tool_errors": 0}

    def reset(self, row: dict) -> list[dict]:
        return [
            {"role": "system", "content": tool_system_prompt(self.schemas, self.preamble)},
            {"role": "user", "content": str(row["prompt"])},
        ]

    def step(self, completion: str) -> Step:
        calls, problems = parse_tool_calls(completion)
        if not calls and not problems:
            return self.final(completion)
        observation = [self._message(f"error: {p}") for p in problems]
        self.counts["malformed_calls"] += len(problems)
        for name, args in calls[: self.max_calls_per_turn]:
            observation.append(self._message(self._call(name, args)))
        if len(calls) > self.max_calls_per_turn:
            self.counts["malformed_calls"] += len(calls) - self.max_calls_per_turn
            observation.append(
                self._message(f"error: at most {self.max_calls_per_turn} tool calls per turn; the rest were not run")
            )
        return Step(observation, 0.0, False)

    def final(self, completion: str) -> Step:
        """The turn holds no tool call: the episode ends here (subclasses score the answer)."""
        return Step([], 0.0, True)

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)

    def _call(self, name: str, args: dict) -> str:
        """One call's result text; a bad call or a raising tool is reported, counted, and never propagates."""
        fn: Optional[Callable] = self.tools.get(name)
        if fn is None:
            self.counts["malformed_calls"] += 1
            return f"error: unknown tool {name!r}; the tools are {sorted(self.tools)}"
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as err:
            self.counts["malformed_calls"] += 1
            return f"error: bad arguments for {name!r}: {err}"
        self.counts["tool_calls"] += 1
        try:
            result = fn(**args)
        except Exception as err:  # noqa: BLE001 - a tool's failure is an observation for the model
            self.counts["tool_errors"] += 1
            return f"error: {name} raised {type(err).__name__}: {err}"
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        return text[:MAX_RESULT_CHARS]

    @staticmethod
    def _message(content: str) -> dict:
        return {"role": "tool", "content": content}
