"""Partial rollouts through the Trainer (issue 37, rollout.partial; loop/partial.py): carried samples continue
from their prefix in the next step, train as prefix + continuation with their own log-probs, survive a retried
step and a checkpoint to the bit, and every bad setting is refused naming its key.

Oracles: the engine's own outputs recorded at the call (what was sampled when, by which step), a straight run
against a resumed one, a run whose step failed once against one that did not."""

from __future__ import annotations

import os

import pytest

from hybrid_rl import Trainer, load_config
from tests.checkpoint_helpers import ROOT, assert_same_run, comparable, overrides, straight_and_resumed

PARTIAL = ["rollout.partial=true", "trainer.max_staleness=2", "rollout.max_new_tokens=40"]


def _cfg(model_dir: str, out: str, *extra: str):
    return load_config(os.path.join(ROOT, "recipes", "grpo_tiny.yaml"), overrides(model_dir, out, *PARTIAL, *extra))


class Recorder:
    """Wraps the engine's generate: every call's prompts, request and completions, in order."""

    def __init__(self, engine):
        self.calls, self.inner = [], engine.generate
        engine.generate = self

    def __call__(self, prompt_ids, params, partial=None):
        out = self.inner(prompt_ids, params, partial)
        self.calls.append(([list(p) for p in prompt_ids], partial, out))
        return out


def test_a_carried_sample_continues_from_its_prefix_and_trains_whole(tiny_model_dir, tmp_path, monkeypatch):
    """Every row of the second call that continues a sample starts with a prompt + the tokens that sample got in the
    first call (cut "abort"), asks for the rest of its budget, and a group trained later holds prefix +
    continuation with the log-probs of both calls. Catches: a prefix re-sampled or lost, log-probs of the prefix
    replaced, a budget not reduced by the prefix."""
    from hybrid_rl.batch import RolloutBatch

    built = []
    real = RolloutBatch.build.__func__

    def spy(cls, rows, prompt_ids, completions, *a, **k):
        built.append([(list(c.token_ids), list(c.logprobs)) for c in completions])
        return real(cls, rows, prompt_ids, completions, *a, **k)

    monkeypatch.setattr(RolloutBatch, "build", classmethod(spy))
    tr = Trainer(_cfg(tiny_model_dir, str(tmp_path), "trainer.total_steps=3"))
    rec = Recorder(tr.engine)
    history = [tr.step() for _ in range(3)]
    (p1, _, out1), (p2, req2, out2) = rec.calls[0], rec.calls[1]
    cut = {tuple(p + c.token_ids): c for p, c in zip(p1, out1) if c.finish_reason == "abort" and c.token_ids}
    assert cut, "the first call must leave samples unfinished with tokens (longer budgets, or more rows)"
    continued = [i for i, p in enumerate(p2) if tuple(p) in cut]
    assert continued and history[1]["rollout/continued"] == len(continued)
    assert history[1]["rollout/continued_kept"] == 0  # partial_kv=recompute: every continued row re-prefilled
    for i in continued:
        prefix = cut[tuple(p2[i])].token_ids
        assert req2.max_new_tokens[i] == 40 - len(prefix)
        whole = (prefix + out2[i].token_ids, cut[tuple(p2[i])].logprobs + out2[i].logprobs)
        if out2[i].finish_reason != "abort":  # finished: in a batch of step 2 or 3, exactly so
            assert any(whole in b for b in built[1:]), "the continued sample never trained as prefix + rest"
    assert all(len(t) <= 40 for b in built for t, _ in b)
    assert max(m["rollout/version_span_max"] for m in history) >= 1
    tr.close()


def test_each_token_carries_the_version_of_the_step_that_sampled_it(tiny_model_dir, tmp_path):
    """Colocated step s samples with version s: every carried token's version is the index of the engine call that
    returned it, and rollout/version_span_mean is the mean over the step's trained samples of newest less oldest.
    Oracle: the engine's calls recorded in order (call i is step i) and each sample's tokens matched to the calls
    that returned them. Catches: tokens tagged one version ahead (the staleness rule then drops a step late), the
    span's mean over the wrong count."""
    tr = Trainer(_cfg(tiny_model_dir, str(tmp_path), "trainer.total_steps=4"))
    rec = Recorder(tr.engine)
    spans_seen = 0
    for step in range(4):
        m = tr.step()
        assert len(rec.calls) == step + 1
        # a carried sample's tokens: its prefix from earlier calls, then this call's; version = the call's index
        made = {}  # tuple(prompt + tokens so far) -> versions so far, built from the calls alone
        for i, (prompts, _, outs) in enumerate(rec.calls):
            for p, c in zip(prompts, outs):
                before = made.pop(tuple(p), [])
                made[tuple(p + c.token_ids)] = before + [i] * len(c.token_ids)
        for g in tr.state.partial.groups:
            for smp in g.samples:
                if smp.token_ids:
                    assert smp.versions == made[tuple(g.prompt_ids + smp.token_ids)]
        trained = [v for v in tr.rollout_stage.last_token_versions if v]
        if trained:
            want = sum(v[-1] - v[0] for v in trained) / len(trained)
            assert m["rollout/version_span_mean"] == pytest.approx(want)
            spans_seen += want > 0
    tr.close()
    assert spans_seen, "no trained sample spanned two versions: the span check would see nothing"


def test_resume_with_carried_samples_is_bit_exact(tiny_model_dir, tmp_path):
    """The checkpoint at step 3 holds the rows drawn, the groups in flight and every carried token, log-prob and
    version: the resumed run continues them exactly as the straight run does."""
    result = straight_and_resumed(tiny_model_dir, str(tmp_path), 3, *PARTIAL)
    assert sum(m["rollout/continued"] for m in result["straight"]) > 0, "nothing carried across the checkpoint"
    assert_same_run(result)


def test_a_retried_step_restores_the_carried_samples(tiny_model_dir, tmp_path, monkeypatch):
    """A step that fails after its rollout (the reward raising once) is retried from the same prompts and carried
    samples: the run equals one that never failed."""
    straight = Trainer(_cfg(tiny_model_dir, str(tmp_path / "a"), "trainer.total_steps=3"))
    want = [comparable(straight.step()) for _ in range(3)]
    straight.close()
    tr = Trainer(_cfg(tiny_model_dir, str(tmp_path / "b"), "trainer.total_steps=3"))
    got = [comparable(tr.step())]
    real, calls = tr.rollout_stage.score, {"n": 0}

    def failing_once(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("reward service down")
        return real(*a, **k)

    monkeypatch.setattr(tr.rollout_stage, "score", failing_once)
    with pytest.raises(RuntimeError, match="reward service down"):
        tr.step()
    got += [comparable(tr.step()), comparable(tr.step())]
    assert got == want
    tr.close()


def test_partial_recomputes_the_old_policy(tiny_model_dir, tmp_path, monkeypatch):
    """One update per step, KL in the loss: without rollout.partial pi_old comes from the update's own forward (no
    SCORE pass); a carried sample was made by older weights, so with it SCORE recomputes pi_old. Catches: the
    on-policy shortcut applied to carried tokens."""
    seen = {}
    for partial in ("false", "true"):
        tr = Trainer(
            _cfg(
                tiny_model_dir,
                str(tmp_path / partial),
                "trainer.total_steps=1",
                "algorithm.kl_placement=loss",
                f"rollout.partial={partial}",
            )
        )
        real = tr._score
        monkeypatch.setattr(tr, "_score", lambda batch, ref, real=real: seen.setdefault(partial, real(batch, ref)))
        tr.step()
        tr.close()
    assert seen["false"][0] is None and seen["true"][0] is not None


def test_switching_partial_on_resume_is_refused_then_follows_its_rule(tiny_model_dir, tmp_path):
    """On -> off: refused naming the key; with the key in trainer.resume_ignore the carried samples are dropped and
    said, and the run goes on."""
    out = str(tmp_path)
    first = Trainer(_cfg(tiny_model_dir, out, "trainer.total_steps=2", "trainer.save_every=2"))
    first.fit()
    carried = first.state.partial.carried_samples()
    first.close()
    assert carried > 0
    off = ["rollout.partial=false", "trainer.total_steps=3"]
    with pytest.raises(Exception, match="rollout.partial"):
        Trainer(_cfg(tiny_model_dir, out, *off))
    with pytest.warns(UserWarning, match=f"carries {carried} unfinished samples"):
        tr = Trainer(_cfg(tiny_model_dir, out, *off, "trainer.resume_ignore=[rollout.partial]"))
    assert tr.step_idx == 2 and tr.state.partial is None
    assert tr.step()["sampling/groups_kept"] == 4
    tr.close()


def test_dropping_stale_samples_says_what_to_do_once(tiny_model_dir, tmp_path):
    """k = 1 with a quarter of the batch enough to stop and twice the groups in flight: carried samples outlive k
    by step 3. The first step that drops any warns once, naming its count and the keys to change; later drops are
    only counted, and a run that drops nothing says nothing. Catches: a drop not said, said every step, or said
    without the keys."""
    import warnings

    tight = ["trainer.max_staleness=1", "rollout.partial_stop=0.25", "rollout.partial_over=2", "trainer.total_steps=5"]
    for extra, drops in ((tight, True), (["trainer.total_steps=3"], False)):
        tr = Trainer(_cfg(tiny_model_dir, str(tmp_path / str(drops)), *extra))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = [tr.step() for _ in range(tr.cfg.trainer.total_steps)]
        tr.close()
        said = [str(w.message) for w in caught if "dropped" in str(w.message)]
        dropping = [i for i, m in enumerate(history) if m["rollout/dropped_stale"] > 0]
        if not drops:
            assert not dropping and not said
            continue
        assert len(dropping) >= 2, "the setting must drop in two steps, so that the second is not said again"
        first = dropping[0]
        assert said == [said[0]], said
        n = int(history[first]["rollout/dropped_stale"])
        assert f"dropped {n} carried samples at step {first}" in said[0]
        for m in history:  # every dropped group takes its rollout.n samples with it
            assert m["rollout/dropped_stale"] == tr.cfg.rollout.n * m["rollout/dropped_stale_groups"]
        assert "trainer.max_staleness=1" in said[0] and "rollout.partial_over" in said[0]


@pytest.mark.parametrize(
    "extra,match",
    [
        (["trainer.max_staleness=0"], "trainer.max_staleness.*>= 1 with rollout.partial"),
        (["algorithm.dynamic_sampling=true"], "rollout.partial.*dynamic_sampling"),
        (["rollout.partial_over=0.5"], "rollout.partial_over.*>= 1"),
        (["rollout.partial_stop=0"], r"rollout.partial_stop.*\(0, 1\]"),
    ],
)
def test_bad_partial_settings_name_the_key(tiny_model_dir, tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tiny_model_dir, str(tmp_path), *extra)


def test_an_environment_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="rollout.partial.*multi-turn"):
        _cfg(tiny_model_dir, str(tmp_path), "env.name=calculator")


def test_an_engine_without_partial_generation_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    from hybrid_rl.rollout.native.engine import NativeEngine

    monkeypatch.setattr(NativeEngine, "generate", lambda self, prompt_ids, params: [])
    with pytest.raises(ValueError, match="rollout.partial.*cannot stop a rollout early"):
        Trainer(_cfg(tiny_model_dir, str(tmp_path)))


KEEP = ["rollout.partial_kv=keep"]


def test_keep_continues_each_cut_sample_over_the_cache_it_left(tiny_model_dir, tmp_path):
    """rollout.partial_kv=keep: every row of the next call that continues a sample cut with tokens comes with that
    sample's kept cache (the keys and values of all its tokens but the last, the engine's `last_kept_kv` of the
    call that cut it); a fresh row comes with none. Catches: caches not passed on, passed to the wrong sample, or
    kept from a call before the last one that advanced the sample."""
    tr = Trainer(_cfg(tiny_model_dir, str(tmp_path), "trainer.total_steps=3", *KEEP))
    rec, kept = Recorder(tr.engine), []
    real = rec.inner

    def keep_too(prompt_ids, params, partial=None):
        out = real(prompt_ids, params, partial)
        kept.append(list(tr.engine.last_kept_kv))
        return out

    rec.inner = keep_too
    history = [tr.step() for _ in range(3)]
    for m, (_, req, _) in zip(history, rec.calls):
        assert m["rollout/continued_kept"] == sum(kv is not None for kv in req.kv)
    for (p1, _, out1), kv1, (p2, req2, _) in zip(rec.calls, kept, rec.calls[1:]):
        cut = {
            tuple(p + c.token_ids): kv for p, c, kv in zip(p1, out1, kv1) if c.token_ids and c.finish_reason == "abort"
        }
        assert cut, "each call must leave samples unfinished with tokens"
        assert all(kv is not None for kv in cut.values())
        sent = dict(enumerate(req2.kv)) if req2.kv else {}
        for i, p in enumerate(p2):
            if tuple(p) in cut:
                assert sent.get(i) is cut[tuple(p)], f"row {i} continues a cut sample without its kept cache"
            elif sent.get(i) is not None:  # a row the last call did not start keeps the cache it had
                assert sent[i].shape[3] == len(p) - 1
    assert sum(1 for kv in (rec.calls[1][1].kv or ()) if kv is not None) > 0
    tr.close()


def test_resume_with_kept_caches_is_bit_exact(tiny_model_dir, tmp_path):
    """The checkpoint holds the carried samples' kept caches too: the resumed run continues over the same caches as
    the straight run. The correction weighs each token by its engine log-prob, so a cache recomputed under the resumed
    weights (other log-probs for the continued tokens) changes the weights the run ends with."""
    result = straight_and_resumed(
        tiny_model_dir, str(tmp_path), 3, *PARTIAL, *KEEP, "algorithm.rollout_correction=tis_token"
    )
    assert sum(m["rollout/continued"] for m in result["straight"]) > 0, "nothing carried across the checkpoint"
    assert_same_run(result)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["rollout.partial=false"], "rollout.partial_kv.*rollout.partial=true"),
        (["rollout.engine=vllm"], "rollout.partial_kv.*rollout.engine=native"),
    ],
)
def test_keep_where_it_cannot_run_is_refused_naming_the_key(tiny_model_dir, tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tiny_model_dir, str(tmp_path), *KEEP, *extra)


def test_switching_partial_kv_on_resume_is_refused_then_follows_its_rule(tiny_model_dir, tmp_path):
    """keep -> recompute: refused naming the key; with it in trainer.resume_ignore the saved caches are ignored (the
    carried samples continue, re-prefilled). recompute -> keep: the carried samples come back without caches, are
    re-prefilled once, then kept."""
    out = str(tmp_path / "a")
    first = Trainer(_cfg(tiny_model_dir, out, "trainer.total_steps=2", "trainer.save_every=2", *KEEP))
    first.fit()
    first.close()
    with pytest.raises(Exception, match="rollout.partial_kv"):
        Trainer(_cfg(tiny_model_dir, out, "trainer.total_steps=3"))
    tr = Trainer(_cfg(tiny_model_dir, out, "trainer.total_steps=3", "trainer.resume_ignore=[rollout.partial_kv]"))
    assert all(s.kv is None for g in tr.state.partial.groups for s in g.samples)
    m = tr.step()
    assert m["rollout/continued"] > 0 and m["rollout/continued_kept"] == 0
    tr.close()
    out = str(tmp_path / "b")
    first = Trainer(_cfg(tiny_model_dir, out, "trainer.total_steps=2", "trainer.save_every=2"))
    first.fit()
    first.close()
    tr = Trainer(
        _cfg(tiny_model_dir, out, "trainer.total_steps=4", "trainer.resume_ignore=[rollout.partial_kv]", *KEEP)
    )
    m3, m4 = tr.step(), tr.step()
    assert m3["rollout/continued"] > 0 and m3["rollout/continued_kept"] == 0
    assert m4["rollout/continued_kept"] > 0
    tr.close()
