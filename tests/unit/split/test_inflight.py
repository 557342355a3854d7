"""The pieces of the in-flight update (issue 37, trainer.inflight_update=continue; split/inflight.py) that need no
process group: per-token versions from an engine's marks, the rollout rank's poller, the engine wrapper, and the
refusals naming the key. The protocol itself runs on gloo ranks in tests/distributed/test_split_inflight.py."""

from __future__ import annotations

import pytest

from hybrid_rl.split.inflight import STOP_OFFER, InflightEngine, TakeOffered, offer_key
from hybrid_rl.types import Completion, SamplingParams, token_versions


@pytest.mark.parametrize(
    "marks, row, n, start, applied, expected",
    [
        ([], 0, 3, 4, [], [4, 4, 4]),  # no update
        ([[2]], 0, 5, 4, [5], [4, 4, 5, 5, 5]),  # tokens from the mark on are the new version's
        ([[0]], 0, 2, 4, [5], [5, 5]),  # before the first token: all new
        ([[7]], 0, 3, 4, [5], [4, 4, 4]),  # the row had ended (mark past its tokens): all old
        ([[1, 3], [2, 3]], 1, 5, 0, [1, 2], [0, 0, 0, 2, 2]),  # two versions at one mark: the newer wins
        ([[1, 3], [2, 4]], 0, 4, 0, [1, 2], [0, 1, 2, 2]),
    ],
)
def test_token_versions_against_a_hand_table(marks, row, n, start, applied, expected):
    assert token_versions(marks, row, n, start, applied) == expected


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.reads = 0

    def set(self, key, value):
        self.data[key] = str(value).encode()

    def check(self, keys):
        self.reads += 1
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


class Side:
    """A rollout rank's version and validation schedule, as RolloutSide keeps them."""

    def __init__(self, version=0, due=()):
        self.version, self.due, self.received = version, set(due), []

    def receive(self, v):
        if v == STOP_OFFER:
            raise AssertionError("a STOP offer is received as the next version, never as STOP_OFFER itself")
        self.received.append(v)
        self.version = v
        return 0.5


def _poller(store, side, rank=3):
    p = TakeOffered(store, rank, side.receive, lambda: side.version, side.due.__contains__, every_s=0.0)
    p.start("fit1")
    return p


def test_poll_takes_every_offered_version_in_order_and_nothing_unoffered():
    store, side = FakeStore(), Side(version=2)
    p = _poller(store, side)
    assert p.poll() == 0 and side.received == []  # nothing offered yet: no key
    store.set(offer_key("fit0", 3), 9)  # an earlier fit's offer is not this fit's
    assert p.poll() == 0
    store.set(offer_key("fit1", 3), 5)
    store.set(offer_key("fit1", 4), 9)  # another rank's offer is not this rank's
    assert p.poll() == 3 and side.received == [3, 4, 5] and p.applied == [3, 4, 5]
    assert p.poll() == 0 and p.seconds == pytest.approx(1.5)


def test_a_version_due_for_validation_is_left_for_its_batch_and_blocks_later_ones():
    """Version 4 is validated by this fit: taken before its batch (syncs_before), never in flight; 5 waits behind it."""
    store, side = FakeStore(), Side(version=2, due={4})
    p = _poller(store, side)
    store.set(offer_key("fit1", 3), 6)
    assert p.poll() == 1 and side.received == [3]
    side.due.discard(4)  # validated at the batch boundary
    side.version = 4
    assert p.poll() == 2 and side.received == [3, 5, 6]


def test_a_stop_offer_is_received_as_the_next_version():
    """STOP is queued after the versions before it; the receive of the next version meets the STOP header (SyncStopped
    in weight_sync), so poll asks for version + 1, not for STOP_OFFER."""
    store, side = FakeStore(), Side(version=2)
    store.set(offer_key("fit1", 3), STOP_OFFER)
    calls = []

    def receive(v):
        calls.append(v)
        raise RuntimeError("SyncStopped")

    p = TakeOffered(store, 3, receive, lambda: side.version, lambda v: False, every_s=0.0)
    p.start("fit1")
    with pytest.raises(RuntimeError, match="SyncStopped"):
        p.poll()
    assert calls == [3]


def test_the_store_is_read_at_most_every_poll_interval(monkeypatch):
    """Polls closer than every_s apart take nothing and read nothing; the first one after it reads and takes."""
    from hybrid_rl.split import inflight

    clock = iter([0.0, 0.004, 0.009, 0.011, 0.05])
    monkeypatch.setattr(inflight.time, "perf_counter", lambda: next(clock))
    store, side = FakeStore(), Side(version=0)
    p = TakeOffered(store, 3, side.receive, lambda: side.version, side.due.__contains__, every_s=0.01)
    p.start("fit1")
    store.set(offer_key("fit1", 3), 1)
    assert p.poll() == 1 and store.reads == 1  # t = 0: reads
    store.set(offer_key("fit1", 3), 2)
    assert p.poll() == 0 and p.poll() == 0 and store.reads == 1  # 4 and 9 ms after: nothing read
    assert p.poll() == 1 and store.reads == 2 and side.received == [1, 2]  # 11 ms: reads again


class FakeEngine:
    """Two polls per call; marks as a native engine would report them; `lie` adds a mark nothing applied."""

    def __init__(self, lie=False):
        self.lie, self.last_tail_s = lie, 0.25

    def generate(self, prompt_ids, params, partial=None, updates=None):
        self.last_update_marks = []
        for held in (0, 2):
            for _ in range(updates.poll()):
                self.last_update_marks.append([held] * len(prompt_ids))
        if self.lie:
            self.last_update_marks.append([1] * len(prompt_ids))
        return [Completion([7, 8, 9], [0.0] * 3, "length"), Completion([7], [0.0], "stop")]


def test_the_engine_wrapper_tags_each_token_and_refuses_marks_it_did_not_apply():
    store, side = FakeStore(), Side(version=1)
    p = _poller(store, side)
    wrapped = InflightEngine(FakeEngine(), p)
    out = wrapped.generate([[1], [2]], SamplingParams(max_new_tokens=3))
    assert [c.versions for c in out] == [[1, 1, 1], [1]]  # nothing offered
    store.set(offer_key("fit1", 3), 2)
    out = wrapped.generate([[1], [2]], SamplingParams(max_new_tokens=3))
    assert [c.versions for c in out] == [[2, 2, 2], [2]]  # taken before the first token (held 0)
    assert wrapped.last_tail_s == 0.25  # the engine's own metrics pass through
    with pytest.raises(RuntimeError, match="marked 1 weight updates, 0 were applied"):
        InflightEngine(FakeEngine(lie=True), p).generate([[1], [2]], SamplingParams(max_new_tokens=3))


@pytest.mark.parametrize(
    "extra, says",
    [
        ([], "trainer.placement=split"),
        (["trainer.placement=split", "rollout.engine=sglang"], "rollout.engine='sglang'"),
        (["trainer.placement=split", "rollout.engine=vllm", "rollout.tp_size=2"], "rollout.tp_size=1"),
        (["trainer.placement=split", "rollout.engine=vllm", "rollout.enable_prefix_caching=true"], "prefix_caching"),
        (["trainer.placement=split", "rollout.engine=vllm", "model.lora.rank=8"], "LoRA on vLLM"),
        (["trainer.placement=split", "env.name=tiny_ask"], "multi-turn"),
    ],
)
def test_what_continue_cannot_run_with_is_refused_naming_the_key(extra, says):
    from hybrid_rl import load_config

    with pytest.raises(ValueError, match="config key 'trainer.inflight_update'") as err:
        load_config(None, ["data.path=rows.jsonl", "trainer.inflight_update=continue", *extra])
    assert says in str(err.value)


def test_a_sender_sends_a_version_only_once_its_rank_waits_for_it(monkeypatch):
    """Learner rank 0's sender for rank 3: it offers version 5 at once but sends it only after rank 3 says it entered
    the receive of 5 (want_key); STOP is offered as the next version and sent once rank 3 waits for 6. Without that
    wait a version due for validation would sit k batches inside a broadcast's timeout.
    Catches: sending before the rank waits, STOP sent where another version number is awaited."""
    import time

    from hybrid_rl.split import inflight

    sent = []
    monkeypatch.setattr(inflight, "send_bucket", lambda m, f, v, *a: sent.append(("bucket", v)) or 0)
    monkeypatch.setattr(inflight, "send_end", lambda v, *a: sent.append(("end", v)))
    monkeypatch.setattr(inflight, "send_stop", lambda **kw: sent.append(("stop",)))
    store = FakeStore()
    offers = inflight.Offers({3: None}, store, timeout_s=5)
    offers.start("fitA")
    offers._put(inflight._Version(5, [(b"[]", None)], None, False))
    offers.stop()

    def until(cond):
        for _ in range(500):
            if cond():
                return True
            time.sleep(0.002)
        return False

    assert until(lambda: store.data.get(offer_key("fitA", 3)) == b"5")
    time.sleep(0.02)
    assert sent == [], "sent before the rank waits for it"
    store.set(inflight.want_key("fitA", 3, 5), 1)
    assert until(lambda: sent == [("bucket", 5), ("end", 5)])
    assert until(lambda: store.data.get(offer_key("fitA", 3)) == str(STOP_OFFER).encode())
    time.sleep(0.02)
    assert sent == [("bucket", 5), ("end", 5)]
    store.set(inflight.want_key("fitA", 3, 6), 1)
    offers.finish()
    assert sent[-1] == ("stop",) and offers.threads == []


def test_an_abandoned_fit_s_sender_ends_instead_of_waiting_for_its_rank(monkeypatch):
    """A fit that fails while a version waits for its rank's receive (the rollout rank is gone): abandon() ends the
    sender thread at its next wait on the store; a new fit's start() abandons the old one's too. Catches: senders left
    waiting on the store for good (they have no timeout there: a version due for validation waits k batches)."""
    import time

    from hybrid_rl.split import inflight

    monkeypatch.setattr(inflight, "send_bucket", lambda *a: 0)
    monkeypatch.setattr(inflight, "send_end", lambda *a: None)
    offers = inflight.Offers({3: None, 4: None}, FakeStore(), timeout_s=5)
    offers.start("fitA")
    offers._put(inflight._Version(5, [(b"[]", None)], None, False))
    threads = list(offers.threads)
    time.sleep(0.02)
    assert all(t.is_alive() for t in threads), "the senders should wait for their ranks"
    offers.abandon()
    for t in threads:
        t.join(timeout=2)
    assert not any(t.is_alive() for t in threads)
    offers.start("fitB")
    offers._put(inflight._Version(1, [(b"[]", None)], None, False))
    older = list(offers.threads)
    offers.start("fitC")  # a new fit ends the last one's waiting senders
    for t in older:
        t.join(timeout=2)
    assert not any(t.is_alive() for t in older)
