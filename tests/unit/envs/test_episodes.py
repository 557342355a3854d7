"""envs/episodes.py: multi-turn episodes, token-exact, with the loss mask on sampled tokens only.

`_check_against_engine` replays an episode against what the engine was asked and answered: each
turn starts where the engine's prompt for it ends, the tokens after it are that completion's ids
and logprobs (mask 1), and everything between one turn and the next engine prompt is observation
(mask 0, logprob 0). The scripted engine samples text NON-canonically (character by character,
so `####` is four tokens where the tokenizer would make one): re-tokenizing a turn, or masking an
observation token in, fails these tests. The native-engine test checks the same on a real model,
plus that the engine's logprobs are the model's own at each masked-in position.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hybrid_rl.data.chat_delta import encode
from hybrid_rl.envs.base import EnvError, Step
from hybrid_rl.envs.episodes import EpisodeRunner, EpisodeSettings, episode_metrics
from hybrid_rl.envs.gsm8k_calc import gsm8k_calculator
from hybrid_rl.types import Completion, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from hybrid_rl.models.tiny_text import build_text_tokenizer

    return build_text_tokenizer()


class ScriptedEngine:
    """Answers each prompt with `script(prompt text)`, sampled one character per token; records every call."""

    def __init__(self, tok, script, stop=True):
        self.tok, self.script, self.stop, self.calls = tok, script, stop, []
        self._lp = 0.0

    def generate(self, prompt_ids, params):
        out = []
        for p in prompt_ids:
            ids = [i for ch in self.script(self.tok.decode(p)) for i in encode(self.tok, ch)]
            if self.stop:
                ids.append(self.tok.eos_token_id)
            ids = ids[: params.max_new_tokens]
            reason = "stop" if self.stop and len(ids) and ids[-1] == self.tok.eos_token_id else "length"
            lps = []
            for _ in ids:
                self._lp -= 0.001
                lps.append(self._lp)  # distinct values: a shifted or dropped logprob cannot go unnoticed
            out.append(Completion(ids, lps, reason))
        self.calls.append(([list(p) for p in prompt_ids], params, out))
        return out


def _calc_script(text):
    """Call the calculator first; once a tool result is in the context, answer (row 0 answers at once)."""
    if "q0" in text or "<|im_start|>tool" in text:
        return "so #### 42"
    return CALL


ROWS = [{"prompt": f"q{i}", "ground_truth": "42"} for i in range(3)]


def _check_against_engine(ep, engine):
    records = [(p, c) for prompts, _, comps in engine.calls for p, c in zip(prompts, comps)]
    seq, pos, sampled = ep.token_ids, len(ep.prompt_ids), 0
    assert len(ep.loss_mask) == len(ep.logprobs) == len(ep.response_ids)
    used = engine.__dict__.setdefault("used", set())  # each completion belongs to one episode only
    while pos < len(seq):
        at = pos - len(ep.prompt_ids)
        # the engine was asked for exactly this prefix (a group's episodes share it: the logprobs tell them apart)
        asked = [(k, c) for k, (p, c) in enumerate(records) if p == seq[:pos] and k not in used]
        assert asked, "no engine call had this episode's tokens so far as its prompt"
        k, comp = next(((k, c) for k, c in asked if c.logprobs[:1] == ep.logprobs[at : at + 1]), asked[0])
        used.add(k)
        n = min(len(comp.token_ids), len(seq) - pos)  # the last turn may have been cut to the episode budget
        assert seq[pos : pos + n] == comp.token_ids[:n], "a turn's ids are not the ones the engine sampled"
        assert ep.loss_mask[at : at + n] == [1] * n
        assert ep.logprobs[at : at + n] == comp.logprobs[:n]
        pos, sampled = pos + n, sampled + n
        if pos < len(seq):
            nxt = min(len(p) for p, _ in records if len(p) > pos and p == seq[: len(p)])
            assert ep.loss_mask[at + n : nxt - len(ep.prompt_ids)] == [0] * (nxt - pos), "observation in the loss"
            assert ep.logprobs[at + n : nxt - len(ep.prompt_ids)] == [0.0] * (nxt - pos)
            pos = nxt
    assert sum(ep.loss_mask) == sampled


def _runner(engine, tok, factory=gsm8k_calculator, **settings):
    return EpisodeRunner(engine, tok, factory, "env_under_test", EpisodeSettings(**settings))


def test_episode_tokens_are_prompt_turns_and_observations(tok):
    engine = ScriptedEngine(tok, _calc_script)
    episodes = _runner(engine, tok, max_turns=4).run(ROWS, 2, SamplingParams(max_new_tokens=200))
    assert [(e.row_index, e.sample) for e in episodes] == [(r, g) for r in range(3) for g in range(2)]
    for ep in episodes:
        _check_against_engine(ep, engine)
        assert ep.end == "done" and ep.finish_reason == "stop" and ep.reward == 1.0
        assert ep.turn_texts[-1] == "so #### 42"
    # the final `####` was sampled as four '#' tokens and kept so: never re-encoded into one
    hashes = tok.convert_tokens_to_ids("#")
    assert all(ep.response_ids.count(hashes) >= 4 for ep in episodes)
    tooled = episodes[2]
    assert tooled.turns == 2 and tooled.turn_texts[0] == CALL
    obs = [t for t, m in zip(tooled.response_ids, tooled.loss_mask) if m == 0]
    assert tok.decode(obs) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_one_generate_call_per_turn_and_finished_episodes_leave(tok):
    engine = ScriptedEngine(tok, _calc_script)
    episodes = _runner(engine, tok).run(ROWS, 2, SamplingParams(max_new_tokens=200, seed=5))
    assert [len(prompts) for prompts, _, _ in engine.calls] == [6, 4]  # row 0 answered in turn 1
    assert [params.seed for _, params, _ in engine.calls] == [5, 5 + 1_000_003]  # turns do not share a stream
    m = episode_metrics(episodes)
    assert m["episode/turns"] == pytest.approx(10 / 6) and m["episode/tool_calls"] == pytest.approx(4 / 6)
    assert m["episode/malformed_calls"] == 0 and m["episode/end_done"] == 1.0
    assert m["episode/observation_tokens"] == pytest.approx(sum(e.observation_tokens for e in episodes) / 6)


def test_max_turns_ends_with_length(tok):
    engine = ScriptedEngine(tok, lambda text: CALL)  # never answers
    episodes = _runner(engine, tok, max_turns=3, max_episode_tokens=4096).run(
        ROWS[1:], 1, SamplingParams(max_new_tokens=200)
    )
    for ep in episodes:
        _check_against_engine(ep, engine)
        assert (ep.turns, ep.end, ep.finish_reason) == (3, "max_turns", "length")
        assert ep.loss_mask[-1] == 1  # the episode ends on a generated turn, no dangling observation
        assert ep.env_metrics["tool_calls"] == 3


@pytest.mark.parametrize("room", [20, 84, 100, 150])  # cuts turn 1 / no room after it / obs does not fit / cuts turn 2
def test_max_episode_tokens_cuts_and_ends_with_length(tok, room):
    from hybrid_rl.data.chat_delta import prompt_ids

    rows = [ROWS[1], {"prompt": "q2 is a longer question", "ground_truth": "42"}]
    budget = len(prompt_ids(tok, gsm8k_calculator(rows[1]).reset(rows[1]))) + room
    engine = ScriptedEngine(tok, lambda text: CALL)
    episodes = _runner(engine, tok, max_turns=10, max_episode_tokens=budget).run(
        rows, 2, SamplingParams(max_new_tokens=200)
    )
    # one call for both rows: its limit is the short prompt's room, so the long one's turn is cut to its own
    assert engine.calls[0][1].max_new_tokens > budget - len(engine.calls[0][0][-1])
    for ep in episodes:
        _check_against_engine(ep, engine)
        assert len(ep.token_ids) <= budget and ep.finish_reason == "length"
        # a turn cut to "<" holds no tool call: the env may take it as the (cut) final answer
        assert ep.end == "max_episode_tokens" or (ep.end == "done" and ep.loss_mask[-1] == 1)
    assert any(ep.end == "max_episode_tokens" for ep in episodes)


def test_a_cut_turn_gets_its_end_token_as_observation(tok):
    engine = ScriptedEngine(tok, _calc_script, stop=False)  # turns never close themselves
    episodes = _runner(engine, tok, max_turns=2).run(ROWS[1:2], 1, SamplingParams(max_new_tokens=200))
    ep = episodes[0]
    _check_against_engine(ep, engine)
    first_obs = ep.loss_mask.index(0)
    assert ep.response_ids[first_obs] == tok.eos_token_id and ep.finish_reason == "length"
    answered = _runner(engine, tok).run(ROWS[:1], 1, SamplingParams(max_new_tokens=200))[0]
    # done, but on a turn without its stop token: the overlong rules must see it as cut
    assert (answered.end, answered.finish_reason, answered.turns) == ("done", "length", 1)


def test_budget_below_the_prompt_is_an_error_before_any_generation(tok):
    engine = ScriptedEngine(tok, _calc_script)
    with pytest.raises(ValueError, match="rollout.max_episode_tokens"):
        _runner(engine, tok, max_episode_tokens=10).run(ROWS, 1, SamplingParams())
    assert engine.calls == []


class _Scripted:
    def __init__(self, row, on_step):
        self.row, self.on_step, self.turn = row, on_step, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turn += 1
        return self.on_step(self.row, self.turn)


def test_a_slow_step_times_out_alone_and_nothing_hangs(tok):
    release = threading.Event()

    def on_step(row, turn):
        if row["prompt"] == "q1":
            release.wait(60)  # blocks far past the timeout
        return Step([], 1.0, True)

    engine = ScriptedEngine(tok, lambda text: "a")
    try:
        episodes = _runner(engine, tok, factory=lambda row: _Scripted(row, on_step), timeout_s=0.3).run(
            ROWS, 1, SamplingParams(max_new_tokens=8)
        )
    finally:
        release.set()
    assert [(e.end, e.finish_reason, e.reward) for e in episodes] == [
        ("done", "stop", 1.0),
        ("timeout", "length", 0.0),
        ("done", "stop", 1.0),
    ]
    assert episode_metrics(episodes)["episode/end_timeout"] == pytest.approx(1 / 3)


def test_an_env_that_raises_names_the_row_and_turn(tok):
    def on_step(row, turn):
        if row["prompt"] == "q2" and turn == 2:
            raise ZeroDivisionError("boom")
        return Step([{"role": "user", "content": "more"}], 0.0, False)

    engine = ScriptedEngine(tok, lambda text: "a")
    with pytest.raises(EnvError, match=r"'env_under_test'.*ZeroDivisionError: boom.*row 2 \(sample 0\), turn 2"):
        _runner(engine, tok, factory=lambda row: _Scripted(row, on_step)).run(ROWS, 1, SamplingParams())


def test_an_env_returning_the_wrong_type_names_the_episode(tok):
    engine = ScriptedEngine(tok, lambda text: "a")
    with pytest.raises(EnvError, match=r"'env_under_test'.*dict without observation.*row 0 \(sample 0\), turn 1"):
        _runner(engine, tok, factory=lambda row: _Scripted(row, lambda r, t: {"done": True})).run(
            ROWS[:1], 2, SamplingParams()
        )


def test_native_engine_on_the_tiny_ask_model(tmp_path):
    """A real engine: the sequence invariants hold, and each masked-in logprob is the model's own there."""
    from hybrid_rl.envs.tiny_ask import ask_rows, build_ask_model_dir
    from hybrid_rl.models.loading import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.native.engine import NativeEngine

    path = build_ask_model_dir(str(tmp_path / "ask"))
    tok, model = load_tokenizer(path), load_causal_lm(path, dtype=torch.float32).eval()
    with torch.no_grad():  # sharpen the random model so turns differ and `ask` comes up now and then
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    recorder = ScriptedEngine(tok, None)
    native = NativeEngine(model, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)

    def generate(prompt_ids, params):
        out = native.generate(prompt_ids=prompt_ids, params=params)
        recorder.calls.append((prompt_ids, params, out))
        return out

    recorder.generate = generate

    def on_step(row, turn):  # always answers with the digit, so every episode has observations between turns
        return Step([{"role": "tool", "content": row["secret"]}], 0.0, turn == 3)

    episodes = _runner(recorder, tok, factory=lambda row: _Scripted(row, on_step), max_turns=3).run(
        ask_rows(8, 0), 4, SamplingParams(max_new_tokens=3, seed=3)
    )
    for ep in episodes:
        _check_against_engine(ep, recorder)
        ids = torch.tensor([ep.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        P = len(ep.prompt_ids)
        own = logp[P - 1 :, :].gather(1, ids[0, P:, None])[:, 0]
        mask = torch.tensor(ep.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(own[mask], torch.tensor(ep.logprobs)[mask], atol=1e-4, rtol=0)
    assert all(e.turns == 3 and e.observation_tokens > 0 for e in episodes)
    assert len({tuple(e.response_ids) for e in episodes}) > 1  # sampled, not one fixed answer


def test_soft_overlong_penalty_ramps_on_the_room_left_before_the_episode_cut():
    """DAPO's soft penalty for an episode reads its distance to the rollout.max_episode_tokens cut (prompt,
    turns and observations together), with the same buffer and factor as for a single completion. Catches: the
    penalty reading the response's length (turns + observations) against max_new_tokens, which charges every
    multi-turn episode the full factor, or the generated tokens alone, which misses observations filling the
    budget."""
    from hybrid_rl.config.load import load_config
    from hybrid_rl.envs.episodes import Episode
    from hybrid_rl.loop.reward_setup import RewardSetup

    cfg = load_config(
        None,
        [
            "env.name=tiny_ask",
            "rollout.max_new_tokens=8",
            "rollout.max_episode_tokens=40",
            "algorithm.overlong_penalty_factor=1.0",
            "algorithm.overlong_buffer_len=4",
        ],
    )
    setup = RewardSetup.resolve(cfg)

    def episode(prompt: int, turns: list[int], obs: list[int]) -> Completion:
        ep = Episode(0, 0, [1] * prompt, reward=1.0)
        for t, o in zip(turns, obs):
            ep.response_ids += [2] * t + [3] * o
            ep.loss_mask += [1] * t + [0] * o
        ep.logprobs = [0.0] * len(ep.response_ids)
        ep.finish_reason = "stop"
        return ep.as_completion()

    # room before the cut at 40: 18, 4 (the buffer's edge), 2 (half-way), 0 (at the cut); generated 12, 12, 14, 16
    eps = [
        episode(10, [6, 6], [0, 0]),
        episode(10, [6, 6], [7, 7]),
        episode(10, [7, 7], [7, 7]),
        episode(10, [8, 8], [9, 5]),
    ]
    rewards_N, scores_N, _ = setup.score([{}], eps, 4, None, set())
    assert rewards_N.tolist() == [1.0] * 4
    assert (scores_N - rewards_N).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
