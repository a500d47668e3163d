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
from fkv.connector.transport import _board
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
