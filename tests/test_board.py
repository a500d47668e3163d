"""The publish board: a prefill rank's streaming layer counts in ``/dev/shm``, read by same-host
decode ranks without asking (``fkv.connector.transport._board``). Counts under the request's own
tag only, cleared on release; a hostile board file (wrong name, size, kind, truncated later, on
another host) costs a fallback to the long poll, never a fault; streaming reads take their news
from it. CPU, real NIXL."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

import fkv
from fkv.connector import EngineDesc, connect, serve
from fkv.connector.transport import _board
from fkv.connector.transport._board import Board, BoardView, open_beneath, open_board
from fkv.connector.wire import BoardInfo, decode_untrusted, encode
from fkv.errors import FkvError, FkvWireError

pytestmark = pytest.mark.transport

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                       num_layers=3)


def engine(name: str) -> EngineDesc:
    return EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=2)


@pytest.fixture
def board() -> Board:
    b = Board()
    yield b
    b.close()


def test_counts_are_read_under_the_requests_own_tag_and_cleared(board: Board) -> None:
    view = BoardView(board.name, board.salt)
    try:
        assert view.layers("r1", True) is None  # nothing written yet
        board.set("r1", 5, 3)
        assert (view.layers("r1", True), view.layers("r1", False)) == (5, 3)
        assert view.layers("r2", True) is None
        board.clear("r2")  # another request's clear leaves r1 alone
        assert view.layers("r1", True) == 5
        board.clear("r1")
        assert view.layers("r1", True) is None and view.layers("r1", False) is None
        # a reader with another salt finds nothing (its tags differ)
        board.set("r1", 2, 2)
        other = BoardView(board.name, bytes(16))
        assert other.layers("r1", True) is None
        other.close()
    finally:
        view.close()


def test_a_slot_taken_by_another_request_reads_as_no_news(board: Board) -> None:
    # find two request ids that share a slot under this salt
    seen: dict[int, str] = {}
    for i in range(20000):
        rid = f"req-{i}"
        slot, _ = _board._slot(board.salt, rid)
        if slot in seen:
            first, second = seen[slot], rid
            break
        seen[slot] = rid
    else:  # pragma: no cover - 20000 ids over 4096 slots always collide
        pytest.fail("no two ids shared a slot")
    view = BoardView(board.name, board.salt)
    try:
        board.set(first, 7, 7)
        board.set(second, 1, 0)
        assert view.layers(first, True) is None       # never the other request's count
        assert (view.layers(second, True), view.layers(second, False)) == (1, 0)
        board.clear(first)                              # not its slot any more: kept
        assert view.layers(second, True) == 1
    finally:
        view.close()


def test_words_are_whole_native_words_and_slots_are_remembered_within_a_bound(
        board: Board, monkeypatch: pytest.MonkeyPatch) -> None:
    """``set`` writes each count as one 8-byte word ``tag << 16 | count`` in native order (what
    ``BoardView`` decodes) and bumps the sequence; the slot of each request is hashed once and
    remembered until its ``clear``, and never more than ``_SLOT_MEMO`` are remembered."""
    slot, tag = _board._slot(board.salt, "r1")
    raw = pathlib.Path(board.path).read_bytes()
    seq = int.from_bytes(raw[_board._SEQ:_board._SEQ + 4], "little")
    board.set("r1", 7, 5)
    raw = pathlib.Path(board.path).read_bytes()
    assert int.from_bytes(raw[16 * slot:16 * slot + 8], sys.byteorder) == tag << 16 | 7
    assert int.from_bytes(raw[16 * slot + 8:16 * slot + 16], sys.byteorder) == tag << 16 | 5
    assert int.from_bytes(raw[_board._SEQ:_board._SEQ + 4], "little") == seq + 1
    assert board._slots == {"r1": (slot, tag)}
    board.clear("r1")
    assert board._slots == {}
    assert pathlib.Path(board.path).read_bytes()[16 * slot:16 * slot + 16] == bytes(16)
    monkeypatch.setattr(_board, "_SLOT_MEMO", 4)
    view = BoardView(board.name, board.salt)
    try:
        for i in range(10):
            board.set(f"q{i}", i, i)
            assert len(board._slots) <= 4
        # forgetting a slot never loses a count (it is hashed again): every id reads back,
        # except where two of them share a slot (then the later one owns it)
        owners = {_board._slot(board.salt, f"q{i}")[0]: i for i in range(10)}
        for i in range(10):
            expected = i if owners[_board._slot(board.salt, f"q{i}")[0]] == i else None
            assert view.layers(f"q{i}", True) == expected
        board.clear("q9")  # remembered or not, the clear finds its slot
        assert view.layers("q9", True) is None
    finally:
        view.close()


def test_the_file_is_private_and_removed_at_close() -> None:
    b = Board()
    path = b.path
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.path.getsize(path) == _board.SLOTS * 16 + 64  # the slots, then the sequence
    b.close()
    assert not os.path.exists(path)
    b.close()  # idempotent


@pytest.mark.parametrize("name", ["../etc/passwd", "fkv-board-xyz", "fkv-board-" + "0" * 31,
                                  "fkv-board-" + "A" * 32, "", "fkv-board-" + "0" * 32 + "/x"])
def test_bad_board_names_are_refused_before_anything_is_opened(name: str) -> None:
    with pytest.raises(FkvError, match="publish board name .*: expected 'fkv-board-' and 32 hex"):
        BoardView(name, bytes(16))


def test_wrong_salt_missing_file_wrong_size_kind_or_link_are_refused(tmp_path: object) -> None:
    with pytest.raises(FkvError, match="publish board salt: expected 16 bytes"):
        BoardView("fkv-board-" + "0" * 32, b"short")
    with pytest.raises(FkvError, match=r"publish board fkv-board-0{32}: cannot open it"):
        BoardView("fkv-board-" + "0" * 32, bytes(16))
    name = "fkv-board-" + os.urandom(16).hex()
    path = os.path.join("/dev/shm", name)
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        with pytest.raises(FkvError, match=r"expected a regular file of 65600 bytes .* 100 bytes"):
            BoardView(name, bytes(16))
        os.unlink(path)
        os.mkfifo(path)
        with pytest.raises(FkvError, match="expected a regular file"):
            BoardView(name, bytes(16))  # opened non-blocking: a FIFO never hangs the open
        os.unlink(path)
        real = Board()
        os.symlink(real.path, path)
        with pytest.raises(FkvError, match="cannot open it"):
            BoardView(name, real.salt)  # links are not followed
        real.close()
    finally:
        if os.path.lexists(path):
            os.unlink(path)


def test_a_board_truncated_after_opening_reads_as_no_news(board: Board) -> None:
    view = BoardView(board.name, board.salt)
    try:
        board.set("r1", 2, 2)
        assert view.layers("r1", True) == 2
        os.truncate(board.path, 0)  # a peer shrinking its file: short reads, never a fault
        assert view.layers("r1", True) is None
    finally:
        view.close()


def test_a_wait_sleeps_until_a_count_is_written(board: Board) -> None:
    """``BoardView.wait`` sleeps on the board's sequence (a futex): a ``set`` from another thread
    ends it at once, a sequence already passed returns at once, and a board truncated by its
    peer makes the view stop waiting (``EFAULT``), never fault."""
    view = BoardView(board.name, board.salt)
    try:
        assert view.can_wait and view.sequence() == 0
        seq = view.sequence()
        timer = threading.Timer(0.2, board.set, ("r1", 1, 1))
        t0 = time.monotonic()
        timer.start()
        assert view.wait(seq, 10.0)
        woke = time.monotonic() - t0
        timer.join()
        assert 0.15 < woke < 5.0, woke                    # woken by the set, not the timeout
        assert view.sequence() == 1 and view.layers("r1", True) == 1
        t0 = time.monotonic()
        assert view.wait(seq, 10.0) and time.monotonic() - t0 < 1.0  # already moved on
        t0 = time.monotonic()
        assert view.wait(1, 0.05) and time.monotonic() - t0 >= 0.04  # nothing new: the timeout
        os.truncate(board.path, 0)
        assert view.sequence() is None
        assert not view.wait(1, 1.0) and not view.can_wait
    finally:
        view.close()


def _filled_caches() -> list[torch.Tensor]:
    caches = fkv.allocate(SPEC)
    for i, layer in enumerate(caches):
        layer.copy_(torch.arange(layer.numel()).view(layer.shape) % 251 + 1000 * i)
    return caches


def _read_s1_in_a_thread(client: object) -> tuple[threading.Thread, dict[str, object]]:
    """Start the streamed read of s1 (remote blocks 3, 5 into local 1, 2); ``out["r"]`` gets
    its result."""
    out: dict[str, object] = {}
    reader = threading.Thread(target=lambda: out.update(
        r=client.read("s1", [1, 2], [3, 5], timeout=20, stream=True)))
    reader.start()
    return reader, out


def _streamed_read(pause: float) -> tuple[bool, int]:
    """A streaming read of request s1 (blocks 3, 5 -> 1, 2) started before the first publish,
    one layer published every ``pause`` s; checks every layer's bytes. Returns whether the
    client read a board and how many waits the board ended."""
    caches = _filled_caches()
    with serve(engine("p"), SPEC, caches) as server:
        local = fkv.allocate(SPEC)
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            server.hold("s1", [3, 5], layers_ready=0)
            reader, out = _read_s1_in_a_thread(client)
            for n in range(1, SPEC.num_layers + 1):
                time.sleep(pause)
                server.publish("s1", n)
            reader.join(30)
            result = out["r"]
            assert result.ok, result.error
            for mine, theirs in zip(local, caches, strict=True):
                assert torch.equal(mine[1:3], theirs[[3, 5]])
            watch = client._state.watch()
            return bool(watch.boards), watch.board_news


def _count_statuses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the request id of every Status a server handles (its long polls)."""
    from fkv.connector.transport import _server, _side

    seen: list[str] = []
    real = _server.Server._handle

    def handle(self: object, msg: object) -> object:
        if isinstance(msg, _side.Status):
            seen.append(msg.request_id)
        return real(self, msg)

    monkeypatch.setattr(_server.Server, "_handle", handle)
    return seen


def test_a_reader_on_the_board_asks_no_long_poll_and_publish_leaves_the_server_thread_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While the board holds the request, a same-host reader sleeps on it and parks no Status
    on the prefill rank, so a publish has nothing to wake the server thread for; without the
    board the same read asks long polls, which publishes wake the server thread to answer."""
    from fkv.connector.transport import _server

    wakes: list[int] = []
    real_wake = _server.Server._wake
    monkeypatch.setattr(_server.Server, "_wake", lambda self: (wakes.append(1), real_wake(self)))
    statuses = _count_statuses(monkeypatch)
    monkeypatch.setenv("FKV_PUBLISH_BOARD", "1")
    boards, news = _streamed_read(pause=0.05)
    assert boards and news >= 1
    assert statuses == []
    assert len(wakes) == 2  # the hold's and the close's: the publishes found no poll parked
    monkeypatch.setenv("FKV_PUBLISH_BOARD", "0")
    wakes.clear()
    boards, news = _streamed_read(pause=0.05)
    assert not boards and news == 0
    assert statuses and set(statuses) == {"s1"}
    assert len(wakes) > 2  # publishes woke the server thread for parked polls


def test_a_reader_whose_board_slot_is_taken_asks_the_long_poll(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When another request takes the slot mid-read, the board no longer holds this one: the
    reader falls back to the long poll and still lands every layer's bytes."""
    monkeypatch.setenv("FKV_PUBLISH_BOARD", "1")
    statuses = _count_statuses(monkeypatch)
    caches = _filled_caches()
    with serve(engine("p"), SPEC, caches) as server:
        slot = _board._slot(server._board.salt, "s1")[0]
        other = next(rid for rid in (f"other-{i}" for i in range(200000))
                     if _board._slot(server._board.salt, rid)[0] == slot)
        local = fkv.allocate(SPEC)
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            server.hold("s1", [3, 5], layers_ready=0)
            reader, out = _read_s1_in_a_thread(client)
            time.sleep(0.1)
            server.publish("s1", 1)
            time.sleep(0.1)
            assert statuses == []              # the board answered so far
            server.hold(other, [6], layers_ready=0)  # takes s1's slot
            time.sleep(0.1)
            for n in range(2, SPEC.num_layers + 1):
                server.publish("s1", n)
                time.sleep(0.05)
            reader.join(30)
            result = out["r"]
            assert result.ok, result.error
            for mine, theirs in zip(local, caches, strict=True):
                assert torch.equal(mine[1:3], theirs[[3, 5]])
            assert "s1" in statuses            # the long poll took over


def test_a_streaming_read_sleeps_on_the_board_between_layers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A streaming read waiting for slow layers sleeps on the board's futex (it spins only
    ``BOARD_SPIN_FUTEX`` s per wait) and still lands every layer's bytes."""
    from fkv.connector.transport import _stream

    monkeypatch.setenv("FKV_PUBLISH_BOARD", "1")
    sleeps: list[float] = []
    real_wait = BoardView.wait

    def counted(self: BoardView, sequence: int, seconds: float) -> bool:
        sleeps.append(seconds)
        return real_wait(self, sequence, seconds)

    monkeypatch.setattr(BoardView, "wait", counted)
    _streamed_read(pause=0.1)
    assert sleeps and max(sleeps) <= _stream.BOARD_SLEEP


def test_a_board_on_another_host_is_not_opened(board: Board) -> None:
    from fkv.connector.transport._ipc import host_identity

    assert open_board(None) is None
    assert open_board(BoardInfo(host="elsewhere/boot/1", name=board.name, salt=board.salt)) is None
    view = open_board(BoardInfo(host=host_identity(), name=board.name, salt=board.salt))
    assert view is not None
    view.close()


def test_the_wire_carries_the_board_and_refuses_bad_fields() -> None:
    caches = fkv.allocate(SPEC)
    regions = [(t.data_ptr(), SPEC.region_bytes) for t in caches]
    info = BoardInfo(host="h/b/1", name="fkv-board-" + "ab" * 16, salt=bytes(range(16)))
    peer = decode_untrusted(encode(engine("p"), SPEC, regions, board=info))
    assert peer.board == info
    assert decode_untrusted(encode(engine("p"), SPEC, regions)).board is None
    for bad, why in [(BoardInfo(host="h", name="fkv-board-12", salt=bytes(16)), "name"),
                     (BoardInfo(host="h", name=info.name, salt=b"x" * 15), "salt"),
                     (BoardInfo(host="h\x00", name=info.name, salt=bytes(16)), "board.host")]:
        with pytest.raises(FkvError, match=why):
            encode(engine("p"), SPEC, regions, board=bad)
    # what a peer sends is checked the same way on the way in
    import msgspec

    from fkv.connector import wire

    good = msgspec.msgpack.decode(encode(engine("p"), SPEC, regions, board=info))
    good["board"]["name"] = "../../etc/passwd"
    with pytest.raises(FkvWireError, match="board"):
        wire.decode_untrusted(msgspec.msgpack.encode(good))
    # the process id (same-host copies read from it): a positive C int or 0, nothing else
    with_pid = BoardInfo(host="h/b/1", name=info.name, salt=info.salt, pid=4242)
    assert decode_untrusted(encode(engine("p"), SPEC, regions, board=with_pid)).board.pid == 4242
    for pid in (-1, 1 << 31, 1 << 63, "4242", 1.5, True):
        bad = msgspec.msgpack.decode(encode(engine("p"), SPEC, regions, board=info))
        bad["board"]["pid"] = pid
        with pytest.raises(FkvWireError, match="board.pid"):
            wire.decode_untrusted(msgspec.msgpack.encode(bad))


def test_the_server_writes_holds_and_publishes_and_clears_releases() -> None:
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        b = server._board
        view = BoardView(b.name, b.salt)
        try:
            assert view.layers("s1", True) is None
            server.hold("s1", [1, 2], layers_ready=0)
            assert (view.layers("s1", True), view.layers("s1", False)) == (0, 0)
            server.publish("s1", 2)
            assert (view.layers("s1", True), view.layers("s1", False)) == (2, 2)
            server.hold("whole", [3])
            assert view.layers("whole", False) == SPEC.num_layers
            server.hold("short", [4], lease=0.05)
            deadline = time.monotonic() + 5
            while "short" in server.pending() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert view.layers("short", False) is None  # the lease ran out: cleared
        finally:
            view.close()
        path = b.path
    assert not os.path.exists(path)  # removed with the server


@pytest.mark.parametrize("use_board", [True, False])
def test_a_streaming_read_takes_its_news_from_the_board(monkeypatch: pytest.MonkeyPatch,
                                                        use_board: bool) -> None:
    monkeypatch.setenv("FKV_PUBLISH_BOARD", "1" if use_board else "0")
    boards, news = _streamed_read(pause=0.05)
    assert boards is use_board
    # the board ended waits (the long poll may still win one on a loaded machine)
    assert (news >= 1) if use_board else news == 0, news


def test_a_reads_seconds_count_the_whole_call_its_checks_included(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ReadResult.seconds`` is the whole call and ``layer_seconds`` count from its start: time
    spent checking the block ids (here made 50 ms each) is in both, as a caller waits for it."""
    from fkv.connector.transport import _client

    real = _client.check_block_ids

    def slow(*args: object, **kwargs: object) -> object:
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(_client, "check_block_ids", slow)
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        with connect(engine("d"), SPEC, fkv.allocate(SPEC),
                     remote_address=server.address) as client:
            server.hold("w", [3, 5])
            started = time.perf_counter()
            result = client.read("w", [1, 2], [3, 5])
            took = time.perf_counter() - started
            assert result.ok, result.error
            assert 0.1 <= result.seconds <= took
            assert len(result.layer_seconds) == SPEC.num_layers
            assert all(0.1 <= t <= took for t in result.layer_seconds)


class _Clock:
    """A fake ``time`` for ``_stream``: each ``monotonic`` read advances it by 1 us (a loop's
    step), a board's ``wait`` by its sleep."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now


class _PacedBoard:
    """A board whose layers are published at fixed (fake) times; ``wait`` sleeps until the
    next publish or its timeout, and records each sleep as ``(start, end)``."""

    can_wait = True

    def __init__(self, clock: _Clock, times: list[float]) -> None:
        self.clock, self.times = clock, times
        self.sleeps: list[tuple[float, float]] = []

    def _count(self) -> int:
        return sum(t <= self.clock.now for t in self.times)

    def sequence(self) -> int:
        return self._count()

    def layers(self, request_id: str, recorded: bool) -> int:
        return self._count()

    def wait(self, sequence: int, seconds: float) -> bool:
        start = self.clock.now
        nxt = min((t for t in self.times if t > start), default=start + seconds)
        self.clock.now = min(start + seconds, nxt) + 0.0001  # a futex wake-up takes 100 us
        self.sleeps.append((start, self.clock.now))
        return True

    def close(self) -> None:
        pass


def _paced_watch(monkeypatch: pytest.MonkeyPatch, times: list[float]
                 ) -> tuple[object, _Clock, _PacedBoard]:
    import socket

    import zmq

    from fkv.connector.transport import _stream

    clock = _Clock()
    board = _PacedBoard(clock, times)
    monkeypatch.setattr(_stream, "time", clock)
    monkeypatch.setattr(_stream, "_yield", lambda: None)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ctx = zmq.Context()
    entry = type("Entry", (), {"address": "tcp://127.0.0.1:%d" % listener.getsockname()[1]})()
    watch = _stream.Watch(ctx, [entry], (0,), "P", boards={0: board})

    def cleanup() -> None:
        watch.close()
        ctx.term()
        listener.close()

    monkeypatch.setattr(watch, "cleanup", cleanup, raising=False)
    return watch, clock, board


def test_a_steady_stream_is_heard_spinning_ahead_of_each_predicted_publish(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers published every 10 ms: the first two news come through the futex (100 us late),
    which gives the pace; from then on the wait sleeps until 1 ms (a tenth of the pace) before
    the predicted publish, spins, and hears each layer within a spin's step of its publish."""
    times = [100.010 + 0.010 * k for k in range(6)]
    watch, clock, board = _paced_watch(monkeypatch, times)
    try:
        watch.start("r")
        heard = []
        for after in range(6):
            assert watch.beyond("r", after, clock.now + 1.0) == after + 1
            heard.append(clock.now)
        late = [round((h - t) * 1e6) for h, t in zip(heard, times, strict=True)]
        assert all(100 <= x <= 110 for x in late[:2]), late  # futex wake-ups
        assert all(0 <= x <= 10 for x in late[2:]), late     # heard spinning: a few steps
        assert watch.spun_news == 4
        # the last sleep before each spun publish ends at the window, about 1 ms early (the
        # window is dated from news that came 100 us late), not at the publish
        ends = [round((max(end for _, end in board.sleeps if end < t) - t) * 1e6)
                for t in times[2:]]
        assert all(-1000 <= x <= -790 for x in ends), ends
    finally:
        watch.cleanup()


def test_the_wait_calls_ahead_once_as_each_spin_window_opens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ahead`` (a streamed read's prime of the awaited layer) runs once per wait that spins,
    as the window opens, told the seconds until the predicted publish; what it spends (here
    300 us) comes out of the spin, and each layer is still heard spinning. No pace, no call."""
    times = [100.010 + 0.010 * k for k in range(6)]
    watch, clock, board = _paced_watch(monkeypatch, times)
    calls: list[tuple[int, float, float]] = []
    try:
        watch.start("r")
        for after in range(6):
            def ahead(seconds: float, after: int = after) -> None:
                calls.append((after, clock.now, seconds))
                clock.now += 0.0003
            assert watch.beyond("r", after, clock.now + 1.0, ahead=ahead) == after + 1
            assert 0 <= round((clock.now - times[after]) * 1e6) <= (110 if after < 2 else 10)
        assert [a for a, _, _ in calls] == [2, 3, 4, 5]
        for after, now, seconds in calls:
            # the window opens 1 ms before the predicted publish and the sleep that ends there
            # wakes 100 us into it; the prediction is off by the 100 us the first news were late
            assert 790 <= round(seconds * 1e6) <= 1000, (after, seconds)
            assert -110 <= round((now + seconds - times[after]) * 1e6) <= 110
        assert watch.spun_news == 4
    finally:
        watch.cleanup()


def test_a_publish_late_for_its_window_is_heard_through_the_futex(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer that comes 5 ms after its predicted time: the spin gives up at the end of the
    window (1 ms after the prediction) and the wait sleeps on the futex again; a stream that was
    there at once gives no pace (the next request starts without one)."""
    times = [100.010, 100.020, 100.030, 100.045]
    watch, clock, board = _paced_watch(monkeypatch, times)
    try:
        watch.start("r")
        for after in range(3):
            watch.beyond("r", after, clock.now + 1.0)
        spun = watch.spun_news
        start = clock.now
        assert watch.beyond("r", 3, clock.now + 1.0) == 4
        assert watch.spun_news == spun
        assert 0 <= round((clock.now - times[3]) * 1e6) <= 110  # a sleep heard it, not a spin
        # the window, from the news of layer 3 (heard spinning at 100.030): 100.039 to 100.041;
        # no sleep starts inside it (a spin), the next one starts at its end
        starts = [a for a, _ in board.sleeps if a > start]
        assert not [a for a in starts if 100.0393 < a < 100.0405], starts
        assert [a for a in starts if 100.0405 <= a <= 100.0412], starts
        watch.start("r2")
        assert watch.beyond("r2", 0, clock.now + 1.0) == 4     # there at once: no pace
        assert watch._pace is None and watch._last_news is None  # noqa: SLF001
    finally:
        watch.cleanup()


def _hear_three_layers(watch: Any, clock: Any) -> None:
    """Start watching request "r" and hear its layers 1, 2 and 3 one at a time."""
    watch.start("r")
    for after in range(3):
        assert watch.beyond("r", after, clock.now + 1.0) == after + 1


def test_a_stream_that_speeds_up_is_paced_by_its_newest_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers 10 ms apart, then one 4 ms after the last: the pace follows the faster newest
    interval (about 4.1 ms, the news of each came through a 100 us futex wake-up), not the
    running mean (7 ms): spinning early costs a little CPU, late a wake-up."""
    times = [100.010, 100.020, 100.024]
    watch, clock, board = _paced_watch(monkeypatch, times)
    try:
        _hear_three_layers(watch, clock)
        assert 0 <= round((clock.now - times[2]) * 1e6) <= 110  # a futex wake-up heard it
        assert 4000 <= round(watch._pace * 1e6) <= 4110, watch._pace  # noqa: SLF001
    finally:
        watch.cleanup()


def test_a_publish_right_after_the_wait_starts_is_heard_spinning_before_any_sleep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer comes 200 us into the wait, inside its first ``BOARD_SPIN_FUTEX`` s (0.5 ms):
    read without sleeping, within a few loop steps, no futex wait at all."""
    watch, clock, board = _paced_watch(monkeypatch, [100.0002])
    try:
        watch.start("r")
        assert watch.beyond("r", 0, clock.now + 1.0) == 1
        assert board.sleeps == []
        assert 0 <= round((clock.now - 100.0002) * 1e6) <= 10
    finally:
        watch.cleanup()


def test_a_wait_on_the_board_ends_at_its_deadline_not_a_sleep_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No layer comes before a deadline 3 ms away: the futex sleeps (2 ms at most each) are cut
    to the time left, so the wait returns 0 layers within a wake-up (100 us) of its deadline."""
    watch, clock, board = _paced_watch(monkeypatch, [])
    try:
        watch.start("r")
        deadline = clock.now + 0.003
        assert watch.beyond("r", 0, deadline) == 0
        assert 0 <= round((clock.now - deadline) * 1e6) <= 110
        assert len(board.sleeps) == 2
        assert all(end <= deadline + 0.00011 for _, end in board.sleeps), board.sleeps
    finally:
        watch.cleanup()


def test_a_deadline_inside_the_spin_window_ends_the_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers every 10 ms, then none: the wait for layer 3 spins from 1 ms before its predicted
    time (100.040); its deadline, 100.040, ends the spin there, not at the window's end."""
    times = [100.010, 100.020, 100.030]
    watch, clock, board = _paced_watch(monkeypatch, times)
    try:
        _hear_three_layers(watch, clock)
        assert watch.spun_news == 1
        deadline = 100.040
        window = _stream_module().spin_window(watch._last_news, watch._last_count,  # noqa: SLF001
                                              watch._pace, 3)  # noqa: SLF001
        assert window[0] < deadline < window[1], window
        assert watch.beyond("r", 3, deadline) == 3
        assert 0 <= round((clock.now - deadline) * 1e6) <= 10
    finally:
        watch.cleanup()


def _stream_module() -> object:
    from fkv.connector.transport import _stream
    return _stream


def test_a_closing_server_marks_its_board_stopped_and_a_cut_board_reads_stopped() -> None:
    """Same-host copies read the flag after each copy: a server that closed (or a board file
    someone truncated) must read as stopped, a serving one never."""
    server = serve(engine("p"), SPEC, fkv.allocate(SPEC))
    b = server._board
    view = BoardView(b.name, b.salt)
    other = BoardView(b.name, b.salt)
    try:
        server.hold("s1", [1], layers_ready=0)
        server.publish("s1", 1)
        assert not view.stopped() and not other.stopped()
        os.truncate(b.path, 0)  # a peer of this user cutting the file: no fault, "stopped"
        assert other.stopped()
        from fkv.connector.transport._board import _BYTES

        os.truncate(b.path, _BYTES)  # back, before the server's own mapping writes again
    finally:
        server.close()
    assert view.stopped()  # the name is gone; the open file says the server stopped
    assert server._board._fd is None
    view.close()
    other.close()
    assert view.stopped()  # a closed view: nothing to trust


def test_a_server_whose_board_was_truncated_stops_writing_it_without_a_fault() -> None:
    """A process of this user truncating the board's file: the server's next ``set`` or
    ``clear`` would store into a page that is gone (SIGBUS). It checks the size first and stops
    writing the board (readers then ask through the side channel). Run in a child: a fault
    would kill the process."""
    code = textwrap.dedent("""
        import os
        from fkv.connector.transport._board import Board, BoardView
        board = Board()
        view = BoardView(board.name, board.salt)
        board.set("r1", 1, 1)
        assert view.layers("r1", True) == 1
        os.truncate(board.path, 0)
        board.set("r1", 2, 2)
        board.clear("r1")
        os.truncate(board.path, 65600)  # grown back: the board stays unwritten
        board.set("r1", 3, 3)
        print(view.layers("r1", True))
        board.close()
        view.close()
    """)
    assert _child(code)[0] == "None"


def test_the_board_vouches_for_exactly_the_process_and_regions_its_server_announced(
        board: Board) -> None:
    view = BoardView(board.name, board.salt)
    try:
        regions = ((0x7F0000001000, 4096), (0x7F0000100000, 8192))
        assert not view.vouches(1234, regions)  # nothing vouched yet
        board.vouch_for(1234, regions)
        assert view.vouches(1234, regions)
        assert view.vouches(1234, list(regions))
        for pid, other in [(1235, regions), (1234, regions[::-1]), (1234, regions[:1]),
                           (1234, ((0x7F0000001000, 4097), regions[1])), (1234, ()),
                           (1234, ((-1, 4096),)), (1234, ((1 << 64, 1),)),
                           (1234, ((float(0x7F0000001000), 4096), regions[1])),
                           (1234, ((1, 2, 3),))]:
            assert not view.vouches(pid, other), (pid, other)
    finally:
        view.close()


def test_an_announced_name_crosses_no_mount_point_and_no_link(tmp_path: pathlib.Path) -> None:
    """A peer could mount a file system that never answers (FUSE) on the name it announces; the
    open refuses a mount point before asking it anything (``openat2``, ``RESOLVE_NO_XDEV``).
    ``/proc`` is a mount point on every Linux host."""
    with pytest.raises(OSError) as e:
        open_beneath("/", "proc", os.O_RDONLY)
    assert e.value.errno == errno.EXDEV
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError) as e:
        open_beneath(str(tmp_path), "link", os.O_RDONLY)
    assert e.value.errno == errno.ELOOP
    fd = open_beneath(str(tmp_path), "real", os.O_RDONLY)
    try:
        assert os.read(fd, 8) == b"x"
    finally:
        os.close(fd)


# -- holes found by mutation (2026-12-04) ------------------------------------------------------------
def _slot_and_tag(salt: bytes, request_id: str) -> tuple[int, int]:
    """The board format, computed here independently of the library (it is shared between
    processes, so it must not drift): a keyed blake2b-64 of the id, little-endian; the low 48
    bits the tag (never 0), the high 16 the slot modulo SLOTS."""
    import hashlib

    d = int.from_bytes(hashlib.blake2b(request_id.encode(), key=salt, digest_size=8).digest(),
                       "little")
    return (d >> 48) % _board.SLOTS, d & ((1 << 48) - 1) or 1


@pytest.fixture
def handmade() -> str:
    """A board file written by hand, as a peer could (all zeros, the board's size)."""
    name = "fkv-board-" + os.urandom(16).hex()
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(bytes(_board._BYTES))
    os.chmod(path, 0o600)
    yield name
    os.unlink(path)


def _poke(name: str, offset: int, data: bytes) -> None:
    fd = os.open(os.path.join("/dev/shm", name), os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def test_a_count_is_the_low_16_bits_under_the_whole_48_bit_tag(handmade: str) -> None:
    salt = bytes(range(16))
    rid = next(r for r in (f"r{i}" for i in range(100)) if _slot_and_tag(salt, r)[1] & 1)
    slot, tag = _slot_and_tag(salt, rid)
    _poke(handmade, 16 * slot, (tag << 16 | 0xFFFF).to_bytes(8, "little")
          + ((tag ^ 1) << 16 | 7).to_bytes(8, "little"))  # the second: a tag one bit off
    view = BoardView(handmade, salt)
    try:
        assert view.layers(rid, True) == 0xFFFF
        assert view.layers(rid, False) is None
    finally:
        view.close()


def test_the_empty_request_id_reads_its_own_slot_not_an_empty_word(handmade: str) -> None:
    view = BoardView(handmade, bytes(16))
    try:
        assert view.layers("", True) is None  # slot 0 holds 0: a word of tag 0, no request's
        slot, tag = _slot_and_tag(bytes(16), "")
        _poke(handmade, 16 * slot, (tag << 16 | 9).to_bytes(8, "little"))
        assert view.layers("", True) == 9
    finally:
        view.close()


def test_a_board_file_larger_than_a_board_is_refused(handmade: str) -> None:
    os.truncate(os.path.join("/dev/shm", handmade), _board._BYTES + 1)
    with pytest.raises(FkvError) as e:
        BoardView(handmade, bytes(16))
    assert str(e.value) == (f"publish board {handmade}: expected a regular file of "
                            f"{_board._BYTES} bytes (got mode 0o100600, {_board._BYTES + 1} bytes)")


def test_a_sequence_cut_short_stops_the_futex_at_once(board: Board) -> None:
    """The page of the sequence may still exist (the file cut inside the word): the view must
    stop sleeping on it the moment the read comes short."""
    view = BoardView(board.name, board.salt)
    try:
        assert view.can_wait
        os.truncate(board.path, _board._SEQ + 2)
        assert view.sequence() is None and not view.can_wait
        assert not view.wait(0, 0.01)
    finally:
        view.close()


def test_a_count_past_16_bits_is_not_written(board: Board) -> None:
    view = BoardView(board.name, board.salt)
    try:
        board.set("r1", 1 << 16, 1)
        assert view.layers("r1", True) is None and view.layers("r1", False) is None
        assert view.sequence() == 0
        board.set("r1", 0xFFFF, 0xFFFF)
        assert (view.layers("r1", True), view.layers("r1", False)) == (0xFFFF, 0xFFFF)
    finally:
        view.close()


def test_the_board_vouches_only_when_the_whole_digest_matches(board: Board) -> None:
    view = BoardView(board.name, board.salt)
    try:
        board.vouch_for(4242, ((4096, 8192),))
        assert view.vouches(4242, ((4096, 8192),))
        digest = _board.vouch(4242, ((4096, 8192),))
        flipped = digest[:31] + bytes([digest[31] ^ 1])  # the last byte one bit off
        fd = os.open(board.path, os.O_WRONLY)
        try:
            os.pwrite(fd, flipped, _board._VOUCH)
        finally:
            os.close(fd)
        assert not view.vouches(4242, ((4096, 8192),))
    finally:
        view.close()


def test_a_server_whose_board_was_cut_just_below_its_sequence_stops_writing_it() -> None:
    """Cut at the sequence's page: the slots are all there, the sequence's page is gone, so the
    next ``set`` would fault storing the sequence. Run in a child: a fault kills the process."""
    code = textwrap.dedent(f"""
        import os
        from fkv.connector.transport._board import Board, BoardView
        board = Board()
        view = BoardView(board.name, board.salt)
        os.truncate(board.path, {_board._SEQ})
        board.set("r1", 3, 3)
        print(view.layers("r1", True))
        board.close()
        view.close()
    """)
    assert _child(code) == ["None"]


def test_a_directory_of_the_boards_size_is_not_a_board(monkeypatch: pytest.MonkeyPatch) -> None:
    """On tmpfs a directory's size grows with its entries: a peer can give one the board's exact
    size, and a directory opens read-only. The size is faked here (how many entries reach it
    depends on the file system); the mode is the directory's own."""
    name = "fkv-board-" + os.urandom(16).hex()
    path = os.path.join("/dev/shm", name)
    os.mkdir(path, 0o700)
    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            return st
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid,
                               st.st_gid, _board._BYTES, 0, 0, 0))
    monkeypatch.setattr(os, "fstat", fstat)
    try:
        with pytest.raises(FkvError) as e:
            BoardView(name, bytes(16))
        assert str(e.value) == (f"publish board {name}: expected a regular file of "
                                f"{_board._BYTES} bytes (got mode 0o40700, {_board._BYTES} bytes)")
    finally:
        os.rmdir(path)


def test_any_nonzero_stopped_word_reads_stopped(handmade: str) -> None:
    view = BoardView(handmade, bytes(16))
    try:
        assert not view.stopped()
        _poke(handmade, _board._STOPPED, (2).to_bytes(8, "little"))
        assert view.stopped()
    finally:
        view.close()


def test_a_request_id_with_a_lone_surrogate_has_a_slot(board: Board) -> None:
    view = BoardView(board.name, board.salt)
    try:
        board.set("r\udc80", 2, 1)
        assert (view.layers("r\udc80", True), view.layers("r\udc80", False)) == (2, 1)
        board.clear("r\udc80")
        assert view.layers("r\udc80", True) is None
    finally:
        view.close()


def test_a_wait_on_a_board_cut_under_its_mapping_stops_the_futex(board: Board) -> None:
    """No sequence read first: the futex itself meets the page that is gone (EFAULT), and the
    view stops waiting rather than return at once forever."""
    view = BoardView(board.name, board.salt)
    try:
        assert view.can_wait
        os.truncate(board.path, 0)
        assert not view.wait(0, 1.0) and not view.can_wait
    finally:
        view.close()


def test_a_long_board_name_is_quoted_cut_to_64_characters() -> None:
    with pytest.raises(FkvError) as e:
        BoardView("fkv-board-" + "0" * 1000, bytes(16))
    assert str(e.value) == (f"publish board name {('fkv-board-' + '0' * 1000)[:64]!r}: expected "
                            f"'fkv-board-' and 32 hex digits")


# -- what a process that never closes its board leaves behind ---------------------------------------
def _child(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return done.stdout.split()


def test_a_board_never_closed_is_removed_when_its_process_exits() -> None:
    (path,) = _child("""
        from fkv.connector.transport._board import Board
        board = Board()
        print(board.path)
    """)
    assert path.startswith("/dev/shm/fkv-board-") and not os.path.exists(path)


def test_a_server_never_closed_leaves_no_board_when_its_process_exits() -> None:
    """The user's case: a script or notebook kernel that ends without closing its server."""
    (path,) = _child("""
        import fkv
        from fkv.connector import EngineDesc, serve
        spec = fkv.KVCacheSpec(num_blocks=4, block_size=16, num_kv_heads=2, head_size=8)
        server = serve(EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=2),
                       spec, fkv.allocate(spec))
        print(server._board.path)
    """)
    assert path.startswith("/dev/shm/fkv-board-") and not os.path.exists(path)


def test_a_server_never_closed_is_closed_by_an_exit_handler_before_the_shutdown() -> None:
    """Without the exit handler the interpreter's shutdown ended the server thread where it took
    the GIL back from a NIXL call, unwinding through C++ frames: the process aborted (status 134,
    "terminate called without an active exception"), 6 exits in 100 under load. The handler
    registered first runs last: by then the thread was joined and the agent released."""
    out = _child("""
        import atexit
        servers = []
        atexit.register(lambda: print(servers[0]._thread.is_alive(), servers[0]._agent is None))
        import fkv
        from fkv.connector import EngineDesc, serve
        spec = fkv.KVCacheSpec(num_blocks=4, block_size=16, num_kv_heads=2, head_size=8)
        servers.append(serve(EngineDesc(engine_id="p", tp_size=1, tp_rank=0,
                                        total_num_kv_heads=2), spec, fkv.allocate(spec)))
    """)
    assert out == ["False", "True"]


def test_a_forked_child_exiting_leaves_its_parents_server_serving() -> None:
    """The exit handler closes only the servers its own process started: a forked child exiting
    through the interpreter's shutdown must not stop its parent's board."""
    out = _child("""
        import os, sys
        import fkv
        from fkv.connector import EngineDesc, serve
        from fkv.connector.transport._board import BoardView
        spec = fkv.KVCacheSpec(num_blocks=4, block_size=16, num_kv_heads=2, head_size=8)
        server = serve(EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=2),
                       spec, fkv.allocate(spec))
        view = BoardView(server._board.name, server._board.salt)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print(status, view.stopped(), server._thread.is_alive())
        server.close()
        print(view.stopped())
    """)
    assert out == ["0", "False", "True", "True"]


def test_a_forked_child_exiting_leaves_its_parents_board() -> None:
    """The child exits through the interpreter's own shutdown (its exit handlers run), then the
    parent finds its board still there, and removes it at its own exit."""
    path, there, gone_in_child = _child("""
        import os, sys
        from fkv.connector.transport._board import Board
        board = Board()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print(board.path, os.path.exists(board.path), status)
    """)
    assert (there, gone_in_child) == ("True", "0") and not os.path.exists(path)


def test_closing_a_board_removes_it_once() -> None:
    board = Board()
    path = board.path
    board.close()
    assert not os.path.exists(path)
    with open(path, "wb"):  # the name taken again by someone else: a second close leaves it
        pass
    try:
        board.close()
        board._remove()
        assert os.path.exists(path)
    finally:
        os.unlink(path)


# -- boards that outlived a killed process --------------------------------------------------------
def _handmade_board(owner: bytes, size: int = _board._BYTES) -> str:
    name = "fkv-board-" + os.urandom(16).hex()
    fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        if size >= _board._OWNER + 16:
            os.pwrite(fd, owner, _board._OWNER)
    finally:
        os.close(fd)
    return name


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("case", ["parent, its start", "parent, another start", "gone",
                                  "gone, another namespace", "no owner record",
                                  "gone, not a board's size", "gone, another user's"])
def test_only_boards_of_processes_that_are_gone_are_removed(case: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ns = _board._pid_namespace()
    parent = os.getppid()
    start = _board._start_time(parent)
    assert ns and start is not None
    record = {"parent, its start": (parent, ns, start),
              "parent, another start": (parent, ns, start + 1),  # the pid is another process's
              "gone": (_dead_pid(), ns, 5),
              "gone, another namespace": (_dead_pid(), ns ^ 1, 5),
              "no owner record": (0, 0, 0),
              "gone, not a board's size": (_dead_pid(), ns, 5),
              "gone, another user's": (_dead_pid(), ns, 5)}[case]
    size = _board._BYTES - 8 if "size" in case else _board._BYTES
    name = _handmade_board(struct.pack("<IIQ", *record), size)
    if "user" in case:
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    try:
        removed = _board.remove_stale_boards()
        gone = case in ("parent, another start", "gone")
        assert (name in removed, os.path.exists(os.path.join("/dev/shm", name))) == (gone,
                                                                                    not gone)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", name))


def test_a_board_of_a_killed_server_is_removed_by_the_next_board_and_a_live_one_is_kept() -> None:
    code = textwrap.dedent("""
        import sys
        from fkv.connector.transport._board import Board
        board = Board()
        print(board.name, flush=True)
        sys.stdin.read()
    """)
    victim, alive = (subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True) for _ in range(2))
    try:
        names = [p.stdout.readline().strip() for p in (victim, alive)]
        victim.kill()
        victim.wait()
        assert all(os.path.exists(os.path.join("/dev/shm", n)) for n in names)
        board = Board()  # sweeps first
        try:
            assert not os.path.exists(os.path.join("/dev/shm", names[0]))
            assert os.path.exists(os.path.join("/dev/shm", names[1]))
        finally:
            board.close()
    finally:
        alive.stdin.close()
        alive.wait(30)
        victim.stdin.close()
        for p in (victim, alive):
            p.stdout.close()
    assert not os.path.exists(os.path.join("/dev/shm", names[1]))  # removed at its exit
