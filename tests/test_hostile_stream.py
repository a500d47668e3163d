"""Hostile bytes around streaming reads (layer-wise transfer): what a peer's publish board, its
side-channel Status polls and its notifications can do to the other side. Each costs the peer
an error or a slower read, never a fault, a hang past the read's timeout, or another request's
blocks. CPU, one process, real NIXL."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import fkv
from fkv.connector import EngineDesc, connect, serve
from fkv.connector.transport import _board, _side
from fkv.connector.transport._base import SideChannelError, TransferFailed
from fkv.errors import FkvError

pytestmark = pytest.mark.transport

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                       num_layers=3)


def engine(name: str) -> EngineDesc:
    return EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=2)


def _filled_caches() -> list[torch.Tensor]:
    caches = fkv.allocate(SPEC)
    for i, layer in enumerate(caches):
        layer.copy_(torch.arange(layer.numel()).view(layer.shape) % 251 + 1000 * i)
    return caches


def _read_in_a_thread(client: object, timeout: float) -> tuple[threading.Thread, dict]:
    out: dict = {}
    reader = threading.Thread(target=lambda: out.update(
        r=client.read("s1", [1, 2], [3, 5], timeout=timeout, stream=True)))
    reader.start()
    return reader, out


@pytest.mark.parametrize("cma", ["0", "1"])
def test_a_board_cut_between_the_requests_slot_and_its_sequence_falls_back_to_the_long_poll(
        monkeypatch: pytest.MonkeyPatch, cma: str) -> None:
    """A process of the prefill's user cuts the board's file so that the request's slot still
    reads but the sequence after the slots does not. The server stops writing the board (it
    shrank); the reader must then ask the long poll, which always works. Before: the board
    still "held" the request, so no poll was asked, and with no sequence to sleep on the reader
    spun on the stale count until the read's timeout (ok=False after 6 s, "layer 1 of 3 was not
    published", one core busy). Now the NIXL read lands every layer; a same-host copy (CMA)
    learns of layer 1 too and then, as designed, refuses bytes from a server whose board reads
    as stopped: ok=False at once, not at the timeout."""
    monkeypatch.setenv("FKV_PUBLISH_BOARD", "1")
    monkeypatch.setenv("FKV_CMA", cma)
    caches = _filled_caches()
    with serve(engine("p"), SPEC, caches) as server:
        local = fkv.allocate(SPEC)
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            server.hold("s1", [3, 5], layers_ready=0)
            t0 = time.monotonic()
            reader, out = _read_in_a_thread(client, timeout=6)
            time.sleep(0.1)
            server.publish("s1", 1)
            time.sleep(0.1)
            slot, _ = _board._slot(server._board.salt, "s1")
            os.truncate(server._board.path, 16 * slot + 16)  # the slot stays, the sequence goes
            for n in range(2, SPEC.num_layers + 1):
                time.sleep(0.05)
                server.publish("s1", n)
            reader.join(30)
            result = out["r"]
            assert time.monotonic() - t0 < 3.0, result
            if cma == "1":
                assert not result.ok and "stopped serving (its publish board says so)" in \
                    result.error, result.error
                return
            assert result.ok, result.error
            for mine, theirs in zip(local, caches, strict=True):
                assert torch.equal(mine[1:3], theirs[[3, 5]])


@pytest.mark.parametrize("request_id", [["r"], {"r": 1}, b"r", 5, ""])
def test_a_request_id_that_is_not_a_str_is_refused_naming_the_field(request_id: object) -> None:
    """``hold``, ``publish`` and ``layers_ready`` take the local user's request id; one that is
    not a non-empty str raises FkvError naming it. Before: an unhashable id (a list, a dict)
    raised TypeError "unhashable type: 'list'" from the table lookup, and ``publish(5, 1)``
    said request 5 "is not held" instead of what an id must be."""
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        calls = {"hold": lambda: server.hold(request_id, [1], layers_ready=0),
                 "publish": lambda: server.publish(request_id, 1),
                 "layers_ready": lambda: server.layers_ready(request_id)}
        for name, call in calls.items():
            with pytest.raises(FkvError, match=r"'request_id' must be a non-empty str") as e:
                call()
            assert repr(request_id)[:20] in str(e.value), (name, str(e.value))
        assert server.pending() == set() and list(server.errors) == []


@pytest.mark.parametrize("cma", ["0", "1"])
def test_a_prefill_that_closes_mid_stream_fails_a_board_reader_at_once(
        monkeypatch: pytest.MonkeyPatch, cma: str) -> None:
    """The prefill's server closes after publishing layer 1 of 3. A same-host reader asleep on
    the board must hear it as a reader of the long poll does (the side channel closed: ok=False
    in 0.2 s), not wait for a publish that never comes. Before: the board kept the request's
    stale count, so the reader asked no long poll and failed only at its timeout (8.0 s, "layer
    1 of 3 was not published ... before the read's timeout"). Now closing clears the counts and
    wakes the board's sleepers; nothing is reported as done either way."""
    monkeypatch.setenv("FKV_PUBLISH_BOARD", "1")
    monkeypatch.setenv("FKV_CMA", cma)
    server = serve(engine("p"), SPEC, _filled_caches())
    try:
        local = fkv.allocate(SPEC)
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            server.hold("s1", [3, 5], layers_ready=0)
            t0 = time.monotonic()
            reader, out = _read_in_a_thread(client, timeout=8)
            time.sleep(0.1)
            server.publish("s1", 1)
            time.sleep(0.1)
            assert client._state.watch().boards  # the read sleeps on the board
            server.close()
            reader.join(30)
            result = out["r"]
            assert time.monotonic() - t0 < 3.0, result
            assert not result.ok and "closed the connection" in result.error, result.error
            assert "layers 0..0 landed of 3" in result.error
    finally:
        server.close()


def test_a_closed_board_is_cleared_and_a_board_that_shrank_is_still_closed_and_removed() -> None:
    """``Board.close`` clears every count and advances the sequence (readers asleep wake up and
    ask the long poll). A board whose file a process of this user cut is still closed: its
    descriptor and mapping released, its name removed. Before: ``close`` returned at once once
    the board had stopped writing (``_words`` None), leaking both and leaving the file."""
    board = _board.Board()
    view = _board.BoardView(board.name, board.salt)
    try:
        board.set("r1", 2, 1)
        seq = view.sequence()
        board.close()
        assert view.layers("r1", True) is None and view.layers("r1", False) is None
        assert view.sequence() == seq + 1 and view.stopped()
        board.set("r1", 3, 3)  # after close: nothing written, no error
        assert view.layers("r1", True) is None
    finally:
        view.close()
    cut = _board.Board()
    fd = cut._fd
    os.truncate(cut.path, 0)
    cut.set("r1", 1, 1)  # finds the file shrunk: stops writing
    cut.close()
    assert not os.path.exists(cut.path) and cut._fd is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_board_announcing_more_layers_than_the_spec_fails_the_read_and_notifies_nobody(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A board (a prefill of the reader's user) says 65535 layers of a 3-layer request are
    published: the read fails at once naming both counts, moves no layer past the spec and
    notifies no prefill rank (the request stays held, nothing accepted)."""
    monkeypatch.setenv("FKV_PUBLISH_BOARD", "1")
    monkeypatch.setenv("FKV_CMA", "0")
    with serve(engine("p"), SPEC, _filled_caches()) as server:
        local = fkv.allocate(SPEC)
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            server.hold("s1", [3, 5], layers_ready=0)
            reader, out = _read_in_a_thread(client, timeout=8)
            time.sleep(0.1)
            with server._lock:
                server._board.set("s1", 65535, 65535)
            reader.join(30)
            result = out["r"]
            assert not result.ok and result.seconds < 3.0, result
            assert "announced 65535 layers published of the 3 its spec has; nothing is " \
                   "reported as done" in result.error, result.error
            time.sleep(0.2)
            assert server.pending() == {"s1"}
            counts = server.diagnostics()["counts"]
            assert (counts["accepted"], counts["premature"]) == (0, 0)


def test_a_renewal_with_layers_ready_does_not_make_a_whole_request_streaming() -> None:
    """``hold`` of a request held as fully written, renewed with ``layers_ready=0`` (the table
    keeps its count: all 3 layers), stays a whole request: ``publish`` refuses it as such and
    changes nothing. Before: the renewal recorded 0 layers published, so ``publish(w, 1)``
    passed the server's check, recorded 1 published layer, then failed in the table with
    "'layers_ready' must be an int in [3, 3] (layers already published never go back ..."
    (the server's count left at 1, the count a ``recorded`` reader is answered with)."""
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        server.hold("w", [1])
        server.hold("w", None, layers_ready=0)  # a renewal: the count is kept
        with pytest.raises(FkvError, match=r"request 'w' is not a streaming request on this "
                           r"rank \(it was held as fully written\)"):
            server.publish("w", 1)
        assert server.layers_ready("w") == SPEC.num_layers
        assert "w" not in server._published
        # a streaming hold renewed with layers_ready keeps its own published count
        server.hold("s", [2], layers_ready=1)
        server.publish("s", 2)
        server.hold("s", None, layers_ready=0)
        server.publish("s", 3)
        assert server.layers_ready("s") == 3


@pytest.mark.parametrize("board", ["0", "1"])
def test_a_streaming_request_released_mid_read_fails_the_read_at_once(
        monkeypatch: pytest.MonkeyPatch, board: str) -> None:
    """The prefill rank releases a streaming request while a decode rank reads it (its lease
    ran out after layer 1 of 3: no publish renewed it). The reader had seen the rank hold the
    request, so a later answer "not held" means no layer will come: ok=False at once, naming
    the rank, nothing reported as done and no layer claimed. Before: the reader kept asking
    until its timeout (10 s here), on the board as on the long poll. A rank that does not hold
    the request *yet* (a read started before the hold) is still waited for (the read lands)."""
    monkeypatch.setenv("FKV_PUBLISH_BOARD", board)
    caches = _filled_caches()
    with serve(engine("p"), SPEC, caches, lease=0.5) as server:
        local = fkv.allocate(SPEC)
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            reader, out = _read_in_a_thread(client, timeout=10)  # before the hold
            time.sleep(0.2)
            server.hold("s1", [3, 5], layers_ready=0, lease=5.0)
            for n in range(1, SPEC.num_layers + 1):
                time.sleep(0.05)
                server.publish("s1", n)
            reader.join(30)
            assert out["r"].ok, out["r"].error
            for mine, theirs in zip(local, caches, strict=True):
                assert torch.equal(mine[1:3], theirs[[3, 5]])

            server.hold("s2", [3, 5], layers_ready=1)  # the server's lease: 0.5 s
            t0 = time.monotonic()
            result = client.read("s2", [1, 2], [3, 5], timeout=10, stream=True)
            assert time.monotonic() - t0 < 3.0, result
            assert not result.ok and result.layer_seconds == ()
            assert "s2" not in server.pending()
            assert result.error == (
                "streaming request 's2': layers 0..0 landed of 3; prefill rank 0 of engine 'p' no "
                "longer holds the request (released before this read ended: its lease ran out, "
                "or its server released it); nothing is reported as done"), result.error


# -- hostile Status answers, in process: a Watch over scripted prefill ranks and a hand-moved clock


class _Clock:
    """A fake ``time`` for ``_stream``: each ``monotonic`` read advances it by 1 us."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now


class _Rank:
    """A prefill rank's side channel as a Watch sees it (a ``_side.Dealer``): ``sent`` records
    each request; the i-th Status sent is answered by ``script[i]``, ``(at, reply)`` with reply
    ``(layers_ready, held)`` or a ``_side.Error`` message (str), seen once the clock is at
    ``at``; a Status past the script is never answered. ``wait`` moves the clock to its reply
    or its deadline."""

    def __init__(self, clock: _Clock, script: list[tuple[float, object]] | None = None) -> None:
        self.clock, self.script = clock, list(script or [])
        self.sent: list[_side.Status] = []
        self.due: dict[int, tuple[float, object]] = {}

    def send(self, msg: _side.Status) -> None:
        if len(self.sent) < len(self.script):
            at, answer = self.script[len(self.sent)]
            reply = (_side.Error(message=answer, token=msg.token) if isinstance(answer, str)
                     else _side.Layers(token=msg.token, layers_ready=answer[0], held=answer[1]))
            self.due[msg.token] = (at, reply)
        self.sent.append(msg)

    def ready(self, token: int) -> object:
        at, reply = self.due.get(token, (float("inf"), None))
        return self.due.pop(token)[1] if at <= self.clock.now else None

    def wait(self, token: int, deadline: float) -> object:
        at, _ = self.due.get(token, (float("inf"), None))
        self.clock.now = max(self.clock.now, min(at, deadline))
        return self.ready(token)

    def close(self) -> None:
        pass


def _watch(monkeypatch: pytest.MonkeyPatch, *scripts: list[tuple[float, object]],
           boards: dict[int, object] | None = None) -> tuple[object, _Clock, list[_Rank]]:
    """A Watch of one rank per script (its dealer a ``_Rank``), on a fake clock."""
    from fkv.connector.transport import _stream

    clock = _Clock()
    monkeypatch.setattr(_stream, "time", clock)
    monkeypatch.setattr(_stream, "_yield", lambda: None)
    watch = _stream.Watch(None, [], (), "P", boards=boards)
    ranks = [_Rank(clock, script) for script in scripts]
    watch.dealers.update(enumerate(ranks))
    return watch, clock, ranks


def test_a_rank_that_does_not_hold_the_request_counts_no_layer_whatever_it_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Layers(layers_ready=3, held=False)``: a rank that does not hold the request (yet) has
    published nothing of it, whatever count it names: the read waits (asking again) until its
    deadline and learns of 0 layers."""
    watch, clock, (rank,) = _watch(monkeypatch, [(0.0, (3, False))])
    watch.start("s1")
    deadline = clock.now + 0.5
    assert watch.beyond("s1", 0, deadline) == 0
    assert clock.now >= deadline
    assert [(m.request_id, m.after) for m in rank.sent] == [("s1", 0), ("s1", 0)]


def test_a_late_answer_to_the_previous_requests_poll_counts_nothing_for_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The poll of request a is still out when the read of b starts; its answer (3 layers of a)
    then comes: it is not taken for b, which is asked for on its own and, never answered,
    reads as 0 layers at the deadline."""
    watch, clock, (rank,) = _watch(monkeypatch, [(0.0, (3, True))])
    watch.start("a")
    watch.ask("a", 0)
    watch.start("b")
    assert watch.beyond("b", 0, clock.now + 0.5) == 0
    assert [m.request_id for m in rank.sent] == ["a", "b"]


def test_a_layer_is_readable_once_every_rank_published_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 says 3 layers, rank 1 says 1: the watch answers 1. Asked past 1, only rank 1 gets
    a poll (rank 0 already said more), and a rank with a poll out is not asked again; a rank
    that never answers holds the count at 0. Each poll asks for news past ``after`` (a long
    poll of ``LONG_POLL`` s) with the caller's ``recorded``."""
    from fkv.connector.transport import _stream

    watch, clock, ranks = _watch(monkeypatch, [(0.0, (3, True)), (0.0, (2, True))],
                                 [(0.0, (1, True))])
    watch.start("s1")
    watch.ask("s1", 0)
    watch.ask("s1", 0)
    assert [len(r.sent) for r in ranks] == [1, 1]
    assert watch.beyond("s1", 0, clock.now + 0.5) == 1
    watch.ask("s1", 1, recorded=True)
    assert [len(r.sent) for r in ranks] == [1, 2]
    token = ranks[1].sent[1].token
    assert ranks[1].sent[1] == _side.Status(token=token, request_id="s1", after=1,
                                            wait=_stream.LONG_POLL, recorded=True)
    deadline = clock.now + 0.5
    assert watch.beyond("s1", 1, deadline, recorded=True) == 1  # rank 1 silent: the deadline
    assert clock.now >= deadline
    watch.start("s2")                                       # rank 0 answers 2, rank 1 nothing
    assert watch.beyond("s2", 0, clock.now + 0.5) == 0
    assert ranks[0].sent[-1] == _side.Status(token=ranks[0].sent[-1].token, request_id="s2",
                                             after=0, wait=_stream.LONG_POLL, recorded=False)


def test_a_count_going_backwards_takes_back_no_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank says 3 layers, then (asked past 3) 1: the 3 stand (a published layer is never
    unpublished); the wait goes on to its deadline."""
    watch, clock, (rank,) = _watch(monkeypatch, [(0.0, (3, True)), (0.0, (1, True))])
    watch.start("s1")
    assert watch.beyond("s1", 0, clock.now + 0.5) == 3
    assert watch.beyond("s1", 3, clock.now + 0.5) == 3
    assert [m.after for m in rank.sent] == [0, 3, 3]


def test_a_new_read_forgets_the_counts_of_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """3 layers of a were heard; a read of another request (``beyond`` of c alone, or
    ``start`` of b) counts from 0; a poll still out is collected, not sent again."""
    watch, clock, (rank,) = _watch(monkeypatch, [(0.0, (3, True))])
    watch.start("a")
    assert watch.beyond("a", 0, clock.now + 0.5) == 3
    assert watch.beyond("c", 0, clock.now, wait=False) == 0
    watch.start("b")
    assert watch.beyond("b", 0, clock.now, wait=False) == 0
    assert [m.request_id for m in rank.sent] == ["a", "c"]  # c's poll, still out, is kept


def test_a_rank_refusing_the_status_fails_the_read_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``Error`` answer to a Status (no ``layers_ready``, no ``held``) fails the read with
    TransferFailed naming the rank and quoting the refusal."""
    watch, clock, (rank,) = _watch(monkeypatch, [(0.0, "no streaming here")])
    watch.start("s1")
    with pytest.raises(TransferFailed) as e:
        watch.beyond("s1", 0, clock.now + 0.5)
    assert str(e.value) == "prefill rank 0 of engine 'P' refused the layer status: no " \
                           "streaming here"


def test_a_status_that_cannot_be_sent_fails_as_a_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose side channel refuses the request (``send`` raises SideChannelError): ``ask``
    and ``beyond`` raise TransferFailed naming the engine, the cause after it."""
    watch, clock, (rank,) = _watch(monkeypatch, [])

    def refuse(msg: object) -> None:
        raise SideChannelError("the request to tcp://x:1 could not be sent (EPIPE): the prefill "
                               "rank is not reachable")

    monkeypatch.setattr(rank, "send", refuse)
    watch.start("s1")
    for call in (lambda: watch.ask("s1", 0), lambda: watch.beyond("s1", 0, clock.now + 0.5)):
        with pytest.raises(TransferFailed) as e:
            call()
        assert str(e.value) == "layer status from prefill engine 'P': the request to tcp://x:1 " \
                               "could not be sent (EPIPE): the prefill rank is not reachable"


def test_a_rank_without_a_side_channel_address_cannot_be_watched() -> None:
    from fkv.connector.transport import _stream

    entry = type("Entry", (), {"address": ""})()
    with pytest.raises(TransferFailed) as e:
        _stream.Watch(None, [entry], (0,), "P")
    assert str(e.value) == "prefill rank 0 of engine 'P' announced no side-channel address: it " \
                           "cannot serve streaming requests"


class _Board:
    """A same-host rank's publish board on the fake clock: it holds the request from
    ``held_at`` on (before: no word of it), its count the publishes in ``times`` already past;
    ``wait`` sleeps until the next hold or publish, or its timeout (a wake-up takes 100 us)."""

    def __init__(self, clock: _Clock, times: list[float], held_at: float = 0.0, pid: int = 0,
                 can_wait: bool = True) -> None:
        self.clock, self.times, self.held_at = clock, times, held_at
        self.pid, self.can_wait = pid, can_wait

    def _count(self) -> int:
        return sum(t <= self.clock.now for t in self.times)

    def sequence(self) -> int:
        return self._count() + (self.clock.now >= self.held_at)

    def layers(self, request_id: str, recorded: bool) -> int | None:
        return self._count() if self.clock.now >= self.held_at else None

    def wait(self, sequence: int, seconds: float) -> bool:
        start = self.clock.now
        nxt = min((t for t in [*self.times, self.held_at] if t > start), default=start + seconds)
        self.clock.now = min(start + seconds, nxt) + 0.0001
        return True

    def close(self) -> None:
        pass


def test_boards_and_long_polls_together_give_the_smallest_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 answers only by its long poll (2 layers, at 100.008); the boards of ranks 1 and 2
    say 3 layers by 100.003 and 1 layer at 100.005. The wait sleeps on the boards and naps on
    rank 0's poll, and ends when all three are past layer 0: 1 layer, at 100.008."""
    watch, clock, ranks = _watch(monkeypatch, [(100.008, (2, True))], [], [])
    watch.boards.update({1: _Board(clock, [100.001, 100.002, 100.003]),
                         2: _Board(clock, [100.005])})
    watch.start("r")
    assert watch.beyond("r", 0, clock.now + 1.0) == 1
    assert 0 <= round((clock.now - 100.008) * 1e6) <= 10
    assert [len(r.sent) for r in ranks] == [1, 0, 0]  # the boards' ranks are asked nothing


def test_a_board_that_cannot_be_slept_on_still_gets_a_long_poll(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked past layer 0: rank 0's board holds the request but has no futex (it would be read
    in a busy loop), rank 1's holds it and can be slept on, rank 2's does not hold it. Ranks 0
    and 2 get a long poll, rank 1 none."""
    watch, clock, ranks = _watch(monkeypatch, [], [], [])
    watch.boards.update({0: _Board(clock, [], can_wait=False), 1: _Board(clock, []),
                         2: _Board(clock, [], held_at=float("inf"))})
    watch.start("r")
    watch.ask("r", 0)
    assert [len(r.sent) for r in ranks] == [1, 0, 1]


def test_a_board_whose_process_is_gone_fails_the_wait_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A board announcing process 2147483647 (no such process) that never publishes: the wait
    fails within ``ALIVE_CHECK`` s naming the rank, the process and the awaited layer. A board
    of a live process (ours) is waited on until the deadline."""
    from fkv.connector.transport import _stream

    watch, clock, _ = _watch(monkeypatch, [])
    watch.boards[0] = _Board(clock, [], pid=2147483647)
    watch.start("r")
    start = clock.now
    with pytest.raises(TransferFailed) as e:
        watch.beyond("r", 0, clock.now + 1.0)
    assert str(e.value) == "prefill rank 0 of engine 'P' (process 2147483647) exited before it " \
                           "published layer 0"
    assert clock.now - start < _stream.ALIVE_CHECK + 0.003
    watch.boards[0] = _Board(clock, [100.0], pid=os.getpid())
    deadline = clock.now + 0.05
    assert watch.beyond("r", 1, deadline) == 1
    assert clock.now >= deadline


def test_a_not_held_answer_to_a_poll_sent_before_the_hold_is_not_a_release(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The read starts before the hold: the board has no word of the request, so a long poll
    goes out. The hold comes at 100.001 (the board wakes the reader, who now sees the rank
    hold it); the poll's answer, computed before the hold ("not held"), arrives at 100.0012.
    That answer says nothing about a release: the read waits for layer 1 (100.004). Before:
    the reader had noted the rank holding the request (from the board) and took the late
    answer for a release, failing the read ("no longer holds the request")."""
    watch, clock, (rank,) = _watch(monkeypatch, [(100.0012, (0, False))])
    watch.boards[0] = _Board(clock, [100.004], held_at=100.001)
    watch.start("r")
    assert watch.beyond("r", 0, clock.now + 1.0) == 1
    assert len(rank.sent) == 1


def test_a_board_count_going_backwards_takes_back_no_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A board says 3 layers, then 1 (a hostile or cut board): the 3 stand, and the wait for
    layer 3 goes on to its deadline."""
    watch, clock, _ = _watch(monkeypatch, [])
    board = _Board(clock, [100.0, 100.0, 100.0])
    watch.boards[0] = board
    watch.start("r")
    assert watch.beyond("r", 0, clock.now + 1.0) == 3
    board.times = [100.0]
    deadline = clock.now + 0.01
    assert watch.beyond("r", 3, deadline) == 3
    assert clock.now >= deadline


def test_a_board_whose_futex_fails_hands_the_wait_to_the_long_poll_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The board's futex wait fails (its page went away: the view stops waiting on it, as
    ``BoardView.wait`` does): the rank is asked by long poll and the wait naps on its socket
    from then on, rather than reading the board busy for ``BOARD_SPIN`` s first."""
    from fkv.connector.transport import _stream

    watch, clock, (rank,) = _watch(monkeypatch, [(100.02, (1, True))])
    board = _Board(clock, [])
    naps: list[float] = []
    futex: list[float] = []
    real_wait = rank.wait

    def failing(sequence: int, seconds: float) -> bool:
        futex.append(clock.now)
        board.can_wait = False
        return False

    def nap(token: int, deadline: float) -> object:
        naps.append(clock.now)
        return real_wait(token, deadline)

    monkeypatch.setattr(board, "wait", failing)
    monkeypatch.setattr(rank, "wait", nap)
    watch.boards[0] = board
    watch.start("r")
    assert watch.beyond("r", 0, clock.now + 1.0) == 1
    assert len(futex) == 1 and len(rank.sent) == 1
    assert naps and 0 <= round((naps[0] - futex[0]) * 1e6) <= 20, (futex, naps[:3])
    assert all(round((b - a) * 1e6) <= round(_stream.BOARD_NAP * 1e6) + 20
               for a, b in zip(naps, naps[1:]))
