"""The layer status of streaming requests as a long poll: a prefill rank keeps a ``Status`` with
``wait > 0`` until it has news (a publish, a hold, a publish event completing) or until the wait
ends, answers the rest at once, never keeps more than ``MAX_PARKED`` waiting, and refuses a wait
longer than ``MAX_STATUS_WAIT``. CPU, one process, real NIXL, plain frames and CURVE ZMQ."""

from __future__ import annotations

import os
import time

import pytest

import fkv
from fkv.connector import CurveKeys, EngineDesc, curve_keypair, serve
from fkv.connector.transport import _server, _side
from fkv.connector.transport._lifecycle import notification
from fkv.connector.transport._sidelimits import frame_request
from fkv.errors import FkvError

pytestmark = pytest.mark.transport

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                       num_layers=3)


def engine(name: str) -> EngineDesc:
    return EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=2)


def status(token: int, after: int = -1, wait: float = 0.0) -> _side.Status:
    return _side.Status(token=token, request_id="r1", after=after, wait=wait)


def layers(token: int, n: int, held: bool = True) -> _side.Layers:
    return _side.Layers(token=token, layers_ready=n, held=held)


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


@pytest.mark.parametrize("side", ["frames", "curve"])
def test_a_status_long_poll_is_answered_by_the_news_it_waits_for(side: str) -> None:
    curve = client_curve = None
    if side == "curve":
        server_pub, server_sec = curve_keypair()
        pub, sec = curve_keypair()
        curve = CurveKeys(server_pub, server_sec, allowed=frozenset({pub}))
        client_curve = CurveKeys(pub, sec, server=server_pub)
    with serve(engine("p"), SPEC, fkv.allocate(SPEC), curve=curve) as server:
        ctx = server._ctx
        dealer = _side.Dealer(ctx, server.address, client_curve)
        try:
            # not held yet: the poll waits through the hold of zero layers ...
            sent = time.monotonic()
            dealer.send(status(1, after=0, wait=1.0))
            assert dealer.wait(1, time.monotonic() + 0.2) is None
            server.hold("r1", [1, 2], layers_ready=0)
            assert dealer.wait(1, time.monotonic() + 0.2) is None
            # ... and is answered by the publish, not by the end of its wait
            server.publish("r1", 2)
            assert dealer.wait(1, soon()) == layers(1, 2)
            assert time.monotonic() < sent + 0.9
            # news already there: answered at once, whatever the wait
            dealer.send(status(2, after=1, wait=1.0))
            assert dealer.wait(2, soon()) == layers(2, 2)
            # no news: answered with what there is when the wait ends
            t0 = time.monotonic()
            dealer.send(status(3, after=2, wait=0.3))
            assert dealer.wait(3, soon()) == layers(3, 2)
            assert time.monotonic() - t0 >= 0.29
            # a plain Status (no wait) is answered at once, as before long polls existed
            dealer.send(_side.Status(token=4, request_id="r1"))
            assert dealer.wait(4, soon()) == layers(4, 2)
            # a wait over the limit is refused, naming the field
            dealer.send(status(5, after=2, wait=_side.MAX_STATUS_WAIT * 2))
            reply = dealer.wait(0, soon())
            assert isinstance(reply, _side.Error)
            assert "wait" in reply.message and "<= 1.0" in reply.message, reply.message
        finally:
            dealer.close()


def test_at_most_max_parked_polls_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_server, "MAX_PARKED", 2)
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        server.hold("r1", [1], layers_ready=1)
        dealers = [_side.Dealer(None, server.address) for _ in range(3)]
        try:
            for k, dealer in enumerate(dealers):
                dealer.send(status(10 + k, after=1, wait=1.0))
                time.sleep(0.1)  # in order
            # the third finds two waiting: answered at once with what there is
            assert dealers[2].wait(12, time.monotonic() + 0.5) == layers(12, 1)
            assert dealers[0].wait(10, time.monotonic() + 0.1) is None
            server.publish("r1", 3)
            assert [d.wait(10 + k, soon()) for k, d in enumerate(dealers[:2])] == \
                [layers(10, 3), layers(11, 3)]
        finally:
            for dealer in dealers:
                dealer.close()


def test_a_parked_poll_is_looked_at_only_on_news_or_at_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server thread loops every 2 ms; a parked poll's answer is computed again only when a
    hold, publish, event or release may have changed it, or when its wait ends (not on every
    loop: with 64 polls parked the process used 28 % of a core, now 9.5 %, bench/NOTES.md)."""
    looks: list[float] = []
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        server.hold("r1", [1], layers_ready=1)
        compute = server._layers

        def counted(msg: _side.Status) -> _side.Layers:
            looks.append(time.monotonic())
            return compute(msg)

        monkeypatch.setattr(server, "_layers", counted)
        dealer = _side.Dealer(None, server.address)
        try:
            dealer.send(status(1, after=1, wait=1.0))
            assert dealer.wait(1, time.monotonic() + 0.5) is None  # parked, ~250 loops
            assert 1 <= len(looks) <= 3, len(looks)  # when it came (and a news of the hold)
            server.publish("r1", 2)
            assert dealer.wait(1, soon()) == layers(1, 2)
            assert len(looks) <= 5, len(looks)
        finally:
            dealer.close()


class SlowEvent:
    """A stand-in for a CUDA event whose writes finish ``seconds`` after it is made."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()))


def test_a_publish_event_releases_the_layers_when_it_completes() -> None:
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        server.hold("r1", [1], layers_ready=0)
        dealer = _side.Dealer(None, server.address)
        try:
            event = SlowEvent(0.4)
            server.publish("r1", 1, event=event)
            sent = time.monotonic()
            dealer.send(status(1, after=0, wait=1.0))
            reply = dealer.wait(1, soon())
            assert reply == layers(1, 1)
            assert time.monotonic() >= event.at  # never before the writes finished
            assert time.monotonic() < sent + 0.9  # answered by the event, not the wait's end
            # an event-less publish of more layers supersedes a pending event
            server.publish("r1", 2, event=SlowEvent(1.5))
            server.publish("r1", 3)
            dealer.send(status(2, after=1, wait=1.0))
            assert dealer.wait(2, time.monotonic() + 0.5) == layers(2, 3)
        finally:
            dealer.close()
        assert server.layers_ready("r1") == 3
        assert list(server.errors) == []  # the server thread kept serving


def test_a_new_hold_of_a_released_id_starts_from_nothing() -> None:
    """The table releases a request under the server's lock; the server thread cleans up its
    published count, publish events and board entry after, outside it. A new hold of the same id
    in between starts from its own ``layers_ready`` (not the old hold's count), and the late
    cleanup leaves the new hold alone (before: ``publish`` refused it, first as going back below
    the old count, then as "held as fully written")."""
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        server.hold("r1", [1], layers_ready=0)
        server.publish("r1", 3)
        with server._lock:  # the table's release; the thread's cleanup has not run yet
            (release,) = server._table.expire(now=1e12)
        assert release.request_id == "r1"
        server.hold("r1", [2], layers_ready=0)
        server.publish("r1", 1)
        server._released_now(release)  # the old hold's cleanup, late
        server.publish("r1", 2)
        assert server.layers_ready("r1") == 2
        assert list(server.errors) == []


def test_one_connection_parks_at_most_max_parked_per_peer_polls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One CURVE connection can pipeline any number of Status polls; past
    ``MAX_PARKED_PER_PEER`` of its own waiting, its next ones are answered at once with what
    there is, and another connection's poll still waits for the news. Before: one peer could
    take every parked place, and every other reader's polls were answered at once."""
    monkeypatch.setattr(_server, "MAX_PARKED_PER_PEER", 2)
    server_pub, server_sec = curve_keypair()
    pub, sec = curve_keypair()
    curve = CurveKeys(server_pub, server_sec, allowed=frozenset({pub}))
    client_curve = CurveKeys(pub, sec, server=server_pub)
    with serve(engine("p"), SPEC, fkv.allocate(SPEC), curve=curve) as server:
        server.hold("r1", [1], layers_ready=1)
        hog = _side.Dealer(server._ctx, server.address, client_curve)
        other = _side.Dealer(server._ctx, server.address, client_curve)
        try:
            for token in (1, 2, 3):
                hog.send(status(token, after=1, wait=1.0))
            assert hog.wait(3, time.monotonic() + 0.5) == layers(3, 1)  # its third: at once
            other.send(status(9, after=1, wait=1.0))
            assert other.wait(9, time.monotonic() + 0.2) is None          # parked
            assert hog.wait(1, time.monotonic() + 0.05) is None
            server.publish("r1", 2)
            assert [hog.wait(1, soon()), hog.wait(2, soon()), other.wait(9, soon())] == \
                [layers(1, 2), layers(2, 2), layers(9, 2)]
        finally:
            hog.close()
            other.close()


def test_a_publish_after_the_table_released_the_request_is_refused_as_not_held() -> None:
    """Between the table's release (under the lock) and the server thread's clean-up the
    published count is still there: a publish then is refused as not held, changing nothing."""
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        server.hold("r1", [1], layers_ready=0)
        with server._lock:  # the table's release; the thread's cleanup has not run yet
            (release,) = server._table.expire(now=1e12)
        with pytest.raises(FkvError) as e:
            server.publish("r1", 1)
        assert str(e.value) == ("publish: request 'r1' is not a streaming request on this rank "
                                "(it is not held); start it with server.hold(request_id, "
                                "block_ids, layers_ready=0)")
        assert server._published == {"r1": 0}  # untouched until the clean-up
        server._released_now(release)
        assert server.layers_ready("r1") is None and server._published == {}


@pytest.mark.parametrize("event", [None, "slow"])
def test_a_publish_renews_the_lease_to_the_servers(event: object) -> None:
    """A held request's lease restarts at each publish, with the server's lease (here 60 s),
    whether its layers are visible at once or wait for their event."""
    with serve(engine("p"), SPEC, fkv.allocate(SPEC), lease=60.0) as server:
        server.hold("r1", [1], layers_ready=0, lease=0.5)
        server.publish("r1", 1, event=SlowEvent(0.5) if event else None)
        with server._lock:  # what the server thread's expiry would find 30 s from now
            early = server._table.expire(now=time.monotonic() + 30.0)
            late = server._table.expire(now=time.monotonic() + 61.0)
        assert early == []
        (release,) = late
        assert (release.request_id, release.reason) == ("r1", "lease expired")


def test_a_publish_that_completes_an_early_notified_request_releases_it_through_on_release(
        ) -> None:
    """Every expected reader notified before the last layer was published: the publish of the
    last layer releases the request, and the server thread runs ``on_release`` for it once."""
    released: list[tuple] = []
    with serve(engine("p"), SPEC, fkv.allocate(SPEC),
               on_release=lambda *a: released.append(a)) as server:
        reply = _side.decode_reply(frame_request(
            server.address, _side.encode_message(_side.Hello(
                engine_id="d", rank=0, tp_size=1, agent="agent-d", secret=os.urandom(16))),
            timeout=10.0, max_frame=_side.MAX_SIDE_MESSAGE_BYTES))
        assert reply == _side.Ok(engine_id="p", outbox=False), reply
        server.hold("r1", [4, 6], layers_ready=1, decode_engine_id="d", decode_tp=1)
        server._notified("agent-d", notification("r1", "d", 0), time.monotonic())
        assert server.diagnostics()["counts"]["premature"] == 1
        assert server.pending() == {"r1"} and released == []
        server.publish("r1", 3)
        deadline = soon()
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(r, list(b), why) for r, b, why in released] == [("r1", [4, 6], "notified")]
        assert server.pending() == set() and server.released() == {"r1": "notified"}
        assert list(server.errors) == []


def test_an_on_release_that_raises_is_reported_and_the_rest_of_its_batch_is_released() -> None:
    """Two releases delivered by the server thread in one batch: the first one's ``on_release``
    raises; it lands in ``server.errors`` and the second one's ``on_release`` still runs."""
    got: list[str] = []

    def on_release(request_id: str, block_ids: object, why: str) -> None:
        got.append(request_id)
        if request_id == "a":
            raise RuntimeError("boom")

    with serve(engine("p"), SPEC, fkv.allocate(SPEC), on_release=on_release) as server:
        server.hold("a", [1])
        server.hold("b", [2])
        with server._lock:  # both released at once, delivered by the thread in one batch
            releases = server._table.expire(now=1e12)
            server._due.extend(sorted(releases, key=lambda r: r.request_id))
        deadline = soon()
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == ["a", "b"]
        assert list(server.errors) == ["on_release('a') raised RuntimeError: boom"]
        assert server.pending() == set()


def test_a_lease_that_runs_out_is_released_and_counted() -> None:
    released: list[tuple] = []
    with serve(engine("p"), SPEC, fkv.allocate(SPEC),
               on_release=lambda *a: released.append(a)) as server:
        server.hold("r1", [3], lease=0.05)
        deadline = soon()
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(r, list(b), why) for r, b, why in released] == [("r1", [3], "lease expired")]
        assert server.released() == {"r1": "lease expired"}
        assert server.stats()["lease_expiries"] == 1


def test_a_look_without_waiting_takes_the_answer_already_on_the_socket() -> None:
    """``beyond(..., wait=False)`` (a streamed read's first look at each layer) takes a long
    poll's answer that has arrived, not only one read off the socket earlier: 2 layers."""
    import select

    from fkv.connector.transport import _stream

    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        server.hold("r1", [1, 2], layers_ready=2)
        entry = type("Entry", (), {"address": server.address})()
        watch = _stream.Watch(server._ctx, [entry], (0,), "p")
        try:
            watch.start("r1")
            watch.ask("r1", 0)
            assert select.select([watch.dealers[0]._plain], [], [], 5.0)[0]  # the answer is in
            assert watch.beyond("r1", 0, time.monotonic(), wait=False) == 2
        finally:
            watch.close()


class _RaisingEvent:
    """An event whose ``synchronize`` raises (a CUDA error): the waiter goes on regardless."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        raise RuntimeError("an illegal memory access was encountered")


def test_the_event_waiter_survives_a_failing_event_and_a_failing_callback() -> None:
    """The publish event waiter calls ``done`` after each event, even one whose ``synchronize``
    raised; a ``done`` that raises is reported in the server's errors, and the waiter keeps
    waiting for the next events."""
    import collections

    calls: list[int] = []
    errors: collections.deque[str] = collections.deque(maxlen=100)

    def done() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("done failed")

    waiter = _server._EventWaiter(done, errors)
    try:
        for event in (_RaisingEvent(), SlowEvent(0.0), SlowEvent(0.0)):
            waiter.put(event)
        deadline = soon()
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(calls) == 3
        assert list(errors) == ["publish event waiter: RuntimeError: done failed"]
        assert waiter._thread.is_alive()
    finally:
        waiter.stop()
    assert not waiter._thread.is_alive()
