"""The outbox: a same-host decode rank's notifications written into a file in /dev/shm that the
prefill rank's server loop reads (``fkv.connector.transport._outbox``), the ring itself, the
checks on what a peer announces and writes, and a real connection that uses it (CPU, NIXL)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

import fkv
from fkv.connector import EngineDesc, connect, serve
from fkv.connector.transport import _side
from fkv.connector.transport._ipc import host_identity
from fkv.connector.transport._outbox import (
    MAX_MESSAGE,
    RECORD_BYTES,
    SLOTS,
    Outbox,
    OutboxCorrupt,
    OutboxReader,
)
from fkv.errors import FkvError

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

_BYTES = 64 + SLOTS * RECORD_BYTES


@pytest.fixture
def box() -> Outbox:
    b = Outbox()
    yield b
    b.close()


def test_messages_arrive_in_order_across_the_ring_and_the_read_count_comes_back(
        box: Outbox) -> None:
    reader = OutboxReader(box.name, box.token)
    try:
        got = []
        for i in range(3 * SLOTS + 5):
            assert box.put(f"m{i}".encode())
            if i % 7 == 6:
                got += reader.take()
        got += reader.take()
        assert got == [f"m{i}".encode() for i in range(3 * SLOTS + 5)]
        assert reader.take() == [] and reader.taken == box.sent == 3 * SLOTS + 5
        with open(box.path, "rb") as f:
            header = f.read(32)
        assert header[:16] == box.token
        assert int.from_bytes(header[16:24], "little") == 3 * SLOTS + 5  # written
        assert int.from_bytes(header[24:32], "little") == 3 * SLOTS + 5  # read, by the reader
    finally:
        reader.close()


def test_a_full_ring_or_a_long_message_is_refused_so_the_caller_uses_nixl(box: Outbox) -> None:
    reader = OutboxReader(box.name, box.token)
    try:
        assert not box.put(b"x" * (MAX_MESSAGE + 1))
        assert box.put(b"y" * MAX_MESSAGE)
        for _ in range(SLOTS - 1):
            assert box.put(b"z")
        assert not box.put(b"one too many")  # the reader is SLOTS behind
        got = reader.take()
        assert got == [b"y" * MAX_MESSAGE] + [b"z"] * (SLOTS - 1)
        assert box.put(b"room again") and reader.take() == [b"room again"]
    finally:
        reader.close()


def test_a_reader_that_stops_says_so_and_the_writer_then_uses_nixl(box: Outbox) -> None:
    reader = OutboxReader(box.name, box.token)
    assert box.put(b"read") and reader.take() == [b"read"]
    reader.close()  # a prefill server closing, or dropping the outbox
    assert not box.put(b"after")
    with open(box.path, "rb") as f:
        assert f.read(40)[32:] == (1).to_bytes(8, "little")
    with pytest.raises(FkvError) as e:  # and nobody reads it again
        OutboxReader(box.name, box.token)
    assert str(e.value) == (f"outbox {box.name}: announced with 1 records written, 1 read, the "
                            f"closed flag 1 and the ended flag 0 (expected an empty, open ring)")


def test_a_writer_that_closes_ends_the_outbox_once_its_records_were_taken() -> None:
    b = Outbox()
    reader = OutboxReader(b.name, b.token)
    try:
        assert b.put(b"one") and b.put(b"two")
        b.close()  # the ended flag, after its records
        assert reader.take() == [b"one", b"two"] and not reader.ended
        assert reader.take() == [] and reader.ended  # the next look confirms: nothing came since
    finally:
        reader.close()


def test_a_closed_outbox_is_gone_and_takes_nothing() -> None:
    b = Outbox()
    path = b.path
    b.close()
    b.close()  # idempotent
    assert not os.path.exists(path) and not b.put(b"m")


@pytest.mark.parametrize(("name", "token", "why"), [
    ("fkv-outbox-xyz", bytes(16), "outbox name 'fkv-outbox-xyz': expected 'fkv-outbox-' and 32 hex "
                                  "digits"),
    ("../etc/passwd", bytes(16), "outbox name '../etc/passwd': expected 'fkv-outbox-' and 32 hex "
                                 "digits"),
    (None, bytes(16), "outbox name 'None': expected 'fkv-outbox-' and 32 hex digits"),
    ("fkv-outbox-" + "0" * 32, b"short", "outbox token: expected 16 bytes"),
    ("fkv-outbox-" + "0" * 32, bytes(16), "outbox fkv-outbox-00000000000000000000000000000000: "
                                          "cannot open it (No such file or directory)"),
])
def test_what_a_peer_announces_is_checked_before_anything_is_opened(name: object, token: object,
                                                                   why: str) -> None:
    with pytest.raises(FkvError) as e:
        OutboxReader(name, token)
    assert str(e.value) == why


def test_an_announced_file_must_be_the_outbox_it_claims(box: Outbox) -> None:
    with pytest.raises(FkvError) as e:
        OutboxReader(box.name, bytes(16))
    assert str(e.value) == f"outbox {box.name}: its token is not the one announced"
    assert box.put(b"early")
    with pytest.raises(FkvError) as e:
        OutboxReader(box.name, box.token)
    assert str(e.value) == (f"outbox {box.name}: announced with 1 records written, 0 read, the "
                            f"closed flag 0 and the ended flag 0 (expected an empty, open ring)")
    os.truncate(box.path, 100)
    with pytest.raises(FkvError) as e:
        OutboxReader(box.name, box.token)
    assert str(e.value) == (f"outbox {box.name}: expected a regular file of {_BYTES} bytes owned "
                            f"by uid {os.getuid()} with one link (got mode 0o100600, 100 bytes, "
                            f"uid {os.getuid()}, 1 links)")


def test_a_hard_link_to_another_file_is_not_an_outbox(box: Outbox) -> None:
    """A name that links to a file of the outbox's size (say, a prefill rank's own publish board)
    is refused: the reader would write its counts into that file."""
    name = "fkv-outbox-" + os.urandom(16).hex()
    os.link(box.path, os.path.join("/dev/shm", name))
    try:
        with pytest.raises(FkvError) as e:
            OutboxReader(name, box.token)
        assert str(e.value).endswith(f"(got mode 0o100600, {_BYTES} bytes, uid {os.getuid()}, "
                                     f"2 links)")
    finally:
        os.unlink(os.path.join("/dev/shm", name))


def test_a_symlink_in_place_of_an_outbox_is_not_followed(tmp_path) -> None:
    name = "fkv-outbox-" + os.urandom(16).hex()
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(_BYTES))
    link = os.path.join("/dev/shm", name)
    os.symlink(target, link)
    try:
        with pytest.raises(FkvError) as e:
            OutboxReader(name, bytes(16))
        assert str(e.value) == f"outbox {name}: cannot open it (Too many levels of symbolic links)"
    finally:
        os.unlink(link)


def _poke(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("written", "why"), [
    (SLOTS + 1, f"{SLOTS + 1} records written with 0 read (expected 1 to {SLOTS} more)"),
    (1 << 63, f"{1 << 63} records written with 0 read (expected 1 to {SLOTS} more)"),
])
def test_impossible_counts_close_the_outbox(box: Outbox, written: int, why: str) -> None:
    reader = OutboxReader(box.name, box.token)
    _poke(box.path, 16, written.to_bytes(8, "little"))
    with pytest.raises(OutboxCorrupt) as e:
        reader.take()
    assert str(e.value) == f"outbox {box.name}: {why}; it is closed"
    assert reader.take() == []  # closed: nothing more is read


def test_a_count_going_back_closes_the_outbox(box: Outbox) -> None:
    reader = OutboxReader(box.name, box.token)
    assert box.put(b"a") and box.put(b"b") and reader.take() == [b"a", b"b"]
    _poke(box.path, 16, (1).to_bytes(8, "little"))
    with pytest.raises(OutboxCorrupt) as e:
        reader.take()
    assert str(e.value) == (f"outbox {box.name}: 1 records written with 2 read (expected 1 to "
                            f"{SLOTS} more); it is closed")


def test_a_record_longer_than_a_record_closes_the_outbox(box: Outbox) -> None:
    reader = OutboxReader(box.name, box.token)
    assert box.put(b"fine")
    _poke(box.path, 64, (RECORD_BYTES - 1).to_bytes(2, "little"))
    with pytest.raises(OutboxCorrupt) as e:
        reader.take()
    assert str(e.value) == (f"outbox {box.name}: record 0 is {RECORD_BYTES - 1} bytes long (at "
                            f"most {MAX_MESSAGE}); it is closed")


def test_a_truncated_outbox_reads_as_nothing_on_both_sides(box: Outbox) -> None:
    reader = OutboxReader(box.name, box.token)
    try:
        assert box.put(b"before")
        os.truncate(box.path, 20)
        assert reader.take() == []  # short reads: no news, no fault
        assert not box.put(b"after")  # the writer cannot read the read count: NIXL instead
    finally:
        reader.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(16, _BYTES - 1), st.binary(min_size=1, max_size=64)),
                max_size=8),
       st.integers(0, 2 * SLOTS))
def test_any_bytes_a_peer_writes_give_messages_within_bounds_or_a_closed_outbox(
        pokes: list[tuple[int, bytes]], before: int) -> None:
    b = Outbox()
    try:
        reader = OutboxReader(b.name, b.token)
        for i in range(before):
            if not b.put(b"m%d" % i):
                reader.take()
        for offset, data in pokes:
            _poke(b.path, offset, data[:_BYTES - offset])
        taken = 0
        for _ in range(3):
            try:
                got = reader.take()
            except OutboxCorrupt:
                assert reader.take() == []
                break
            assert len(got) <= SLOTS and all(len(m) <= MAX_MESSAGE for m in got)
            taken += len(got)
        reader.close()
    finally:
        b.close()


# -- a real connection ------------------------------------------------------------------------------
SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                       num_layers=2)


def engine(name: str) -> EngineDesc:
    return EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=2)


def _released(server, request_id: str) -> dict[str, str]:
    deadline = time.monotonic() + 10
    while request_id in server.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    return server.released()


@pytest.mark.transport
@pytest.mark.parametrize("offered", ["1", "0"])
def test_a_same_host_read_notifies_through_the_outbox_unless_turned_off(
        monkeypatch: pytest.MonkeyPatch, offered: str) -> None:
    monkeypatch.setenv("FKV_OUTBOX", offered)
    caches = fkv.allocate(SPEC)
    for i, layer in enumerate(caches):
        layer.copy_(torch.arange(layer.numel()).view(layer.shape) + 1000 * i)
    with serve(engine("p"), SPEC, caches) as server:
        local = fkv.allocate(SPEC)
        with connect(engine("d"), SPEC, local, remote_address=server.address) as client:
            link = client._state.link
            sent = []
            monkeypatch.setattr(link.local.agent, "notify",
                                lambda name, m: sent.append((name, m)) or
                                type(link.local.agent).notify(link.local.agent, name, m))
            server.hold("r1", [3, 5])
            result = client.read("r1", [1, 2], [3, 5], timeout=20)
            assert result.ok, result.error
            for mine, theirs in zip(local, caches, strict=True):
                assert torch.equal(mine[1:3], theirs[[3, 5]])
            assert _released(server, "r1") == {"r1": "notified"}
            if offered == "1":
                assert list(link.outboxes) == [0] and link.outboxes[0].sent == 1
                assert [b.taken for b in server._outboxes.values()] == [1]
                assert sent == []  # nothing through NIXL
                path = link.outboxes[0].path
                assert not os.path.exists(path)  # its name went once the prefill rank opened it
                # nothing held now: the server still reads the outbox (every OUTBOX_IDLE_LOOK s)
                assert server.pending() == frozenset()
                assert link.outboxes[0].put(link.notif("ghost"))
                deadline = time.monotonic() + 10
                while not server.stats()["refused_messages"] and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert server.stats()["refused_messages"] == {"unknown_request": 1}
            else:
                assert link.outboxes == {} and server._outboxes == {}
                assert sent == [(link.names[0], link.notif("r1"))]
                path = None
            assert server.stats()["notifications"] == (2 if offered == "1" else 1)
        if path is not None:  # the client closed: its outbox file is gone, the server drops it
            assert not os.path.exists(path)
            deadline = time.monotonic() + 10
            while server._outboxes and time.monotonic() < deadline:
                time.sleep(0.005)
            assert server._outboxes == {}


def _hello(server, agent: str, outbox: object) -> object:
    ctx = zmq.Context()
    try:
        return _side.request(ctx, server.address, _side.Hello(
            engine_id=f"rogue-{agent}", rank=0, tp_size=1, agent=agent, secret=os.urandom(16),
            outbox=outbox), 5.0)
    finally:
        ctx.term()


@pytest.mark.transport
def test_a_hello_whose_outbox_fails_its_checks_is_answered_without_one_and_counted() -> None:
    with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
        here = host_identity()
        missing = _side.OutboxInfo(host=here, name="fkv-outbox-" + "ab" * 16, token=bytes(16))
        reply = _hello(server, "agent-a", missing)
        assert reply == _side.Ok(engine_id="p", outbox=False)
        assert server.stats()["refused_messages"] == {"outbox": 1}
        assert any("fkv-outbox-" + "ab" * 16 + ": cannot open it" in e for e in server.errors)
        b = Outbox()
        try:  # another host's outbox is not opened at all (nor counted: it is no offence)
            far = _side.OutboxInfo(host="elsewhere", name=b.name, token=b.token)
            assert _hello(server, "agent-b", far) == _side.Ok(engine_id="p", outbox=False)
            ok = _side.OutboxInfo(host=here, name=b.name, token=b.token)
            assert _hello(server, "agent-c", ok) == _side.Ok(engine_id="p", outbox=True)
            # the same outbox announced for another agent: one reader per outbox
            assert _hello(server, "agent-e", ok) == _side.Ok(engine_id="p", outbox=False)
            assert server.stats()["refused_messages"] == {"outbox": 2}
            assert any(f"outbox {b.name} is read for another agent" in e for e in server.errors)
            assert list(server._outboxes) == ["agent-c"]
            # then the peer scribbles over its count: the server closes it and keeps serving
            _poke(b.path, 16, (SLOTS + 7).to_bytes(8, "little"))
            deadline = time.monotonic() + 10
            while "agent-c" in server._outboxes and time.monotonic() < deadline:
                time.sleep(0.005)
            assert "agent-c" not in server._outboxes
            assert server.stats()["refused_messages"] == {"outbox": 3}
            assert any(f"outbox {b.name}: {SLOTS + 7} records written" in e for e in server.errors)
            assert _hello(server, "agent-d", None) == _side.Ok(engine_id="p", outbox=False)
        finally:
            b.close()


@pytest.mark.transport
def test_an_outbox_the_server_closed_sends_the_next_notification_through_nixl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode rank scribbles over its own outbox's count: the prefill rank closes it (counted),
    and the decode rank's next read still releases its blocks, its notification through NIXL."""
    monkeypatch.setenv("FKV_OUTBOX", "1")
    caches = fkv.allocate(SPEC)
    with serve(engine("p"), SPEC, caches) as server:
        with connect(engine("d"), SPEC, fkv.allocate(SPEC), remote_address=server.address) as client:
            link = client._state.link
            box = link.outboxes[0]
            server.hold("r1", [1])
            assert client.read("r1", [2], [1], timeout=20).ok
            assert _released(server, "r1") == {"r1": "notified"} and box.sent == 1
            assert not os.path.exists(box.path)  # unlinked once the hello was answered
            os.pwrite(box._fd, (1 + SLOTS + 1).to_bytes(8, "little"), 16)
            deadline = time.monotonic() + 10
            while server._outboxes and time.monotonic() < deadline:
                time.sleep(0.005)
            assert server._outboxes == {}
            assert server.stats()["refused_messages"] == {"outbox": 1}
            sent = []
            monkeypatch.setattr(link.local.agent, "notify",
                                lambda name, m: sent.append(m) or
                                type(link.local.agent).notify(link.local.agent, name, m))
            server.hold("r2", [3])
            assert client.read("r2", [4], [3], timeout=20).ok
            assert _released(server, "r2") == {"r1": "notified", "r2": "notified"}
            assert sent == [link.notif("r2")] and box.sent == 1


@pytest.mark.transport
def test_past_the_most_outboxes_a_hello_evicts_the_least_recently_active(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Outboxes of decode processes that died without closing are not kept forever: past
    MAX_OUTBOXES the least recently active one is closed (its writer then uses NIXL)."""
    from fkv.connector.transport import _server

    monkeypatch.setattr(_server, "MAX_OUTBOXES", 2)
    boxes = [Outbox() for _ in range(3)]
    try:
        with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
            here = host_identity()
            for i, b in enumerate(boxes[:2]):
                info = _side.OutboxInfo(host=here, name=b.name, token=b.token)
                assert _hello(server, f"agent-{i}", info) == _side.Ok(engine_id="p", outbox=True)
            # agent-0 stays active (a stray record, taken at the next look); agent-1 does not
            assert boxes[0].put(b"stray")
            deadline = time.monotonic() + 10
            while server._outboxes["agent-0"].taken == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            info = _side.OutboxInfo(host=here, name=boxes[2].name, token=boxes[2].token)
            assert _hello(server, "agent-2", info) == _side.Ok(engine_id="p", outbox=True)
            assert sorted(server._outboxes) == ["agent-0", "agent-2"]
            assert not boxes[1].put(b"after")  # closed by the server: NIXL from now on
            assert boxes[0].put(b"still")
    finally:
        for b in boxes:
            b.close()


# -- holes found by mutation (2026-12-04) ------------------------------------------------------------
def _header(path: str) -> tuple[int, int, int, int]:
    """The written count, read count, closed flag and ended flag of an outbox file."""
    with open(path, "rb") as f:
        raw = f.read(48)[16:]
    return tuple(int.from_bytes(raw[i:i + 8], "little") for i in (0, 8, 16, 24))


def test_a_read_count_ahead_of_the_written_one_makes_the_writer_write_nothing(box: Outbox) -> None:
    """A prefill rank claiming it read records never written: the writer uses NIXL and leaves
    the ring alone."""
    _poke(box.path, 24, (5).to_bytes(8, "little"))
    assert not box.put(b"m") and box.sent == 0
    assert _header(box.path) == (0, 5, 0, 0)
    with open(box.path, "rb") as f:
        assert f.read(64 + RECORD_BYTES)[64:] == bytes(RECORD_BYTES)


def test_a_record_written_short_advances_no_written_count(box: Outbox,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The record goes first and the count only after the whole record: a short write of the
    record (a file the reader truncated under us) publishes nothing."""
    reader = OutboxReader(box.name, box.token)
    try:
        real = os.pwrite

        def short_records(fd: int, data: bytes, offset: int) -> int:
            return real(fd, data[:-1], offset) if offset >= 64 else real(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", short_records)
        assert not box.put(b"cut") and box.sent == 0
        monkeypatch.setattr(os, "pwrite", real)
        assert _header(box.path) == (0, 0, 0, 0) and reader.take() == []
        assert box.put(b"whole") and reader.take() == [b"whole"]
    finally:
        reader.close()


def test_an_outbox_owned_by_another_user_is_refused(box: Outbox,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The file belongs to this process's user; the reader is made to run as another one (no
    root needed to give a file away)."""
    owner = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: owner + 54321)
    with pytest.raises(FkvError) as e:
        OutboxReader(box.name, box.token)
    assert str(e.value) == (f"outbox {box.name}: expected a regular file of {_BYTES} bytes owned "
                            f"by uid {owner + 54321} with one link (got mode 0o100600, {_BYTES} "
                            f"bytes, uid {owner}, 1 links)")


def test_an_outbox_announced_ended_or_with_huge_counts_is_refused_and_equal_counts_read_on(
        box: Outbox) -> None:
    _poke(box.path, 40, (1).to_bytes(8, "little"))
    with pytest.raises(FkvError) as e:
        OutboxReader(box.name, box.token)
    assert str(e.value) == (f"outbox {box.name}: announced with 0 records written, 0 read, the "
                            f"closed flag 0 and the ended flag 1 (expected an empty, open ring)")
    _poke(box.path, 40, bytes(8))
    huge = (1 << 62) + 1
    _poke(box.path, 16, huge.to_bytes(8, "little") * 2)
    with pytest.raises(FkvError) as e:
        OutboxReader(box.name, box.token)
    assert str(e.value) == (f"outbox {box.name}: announced with {huge} records written, {huge} "
                            f"read, the closed flag 0 and the ended flag 0 (expected an empty, "
                            f"open ring)")
    # equal counts are an empty ring: the reader starts there, not at record 0
    _poke(box.path, 16, (3).to_bytes(8, "little") * 2)
    reader = OutboxReader(box.name, box.token)
    try:
        assert reader.take() == []
        _poke(box.path, 64 + 3 * RECORD_BYTES, (4).to_bytes(2, "little") + b"four")
        _poke(box.path, 16, (4).to_bytes(8, "little"))
        assert reader.take() == [b"four"] and _header(box.path) == (4, 4, 0, 0)
    finally:
        reader.close()


def test_the_ended_flag_ends_the_outbox_only_when_a_later_look_finds_nothing_new(
        box: Outbox) -> None:
    """The flag seen once is not the end: records written before it (or, from a hostile
    writer, after it) are still taken; only a look that sees the flag again and no new record
    ends the outbox."""
    reader = OutboxReader(box.name, box.token)
    try:
        _poke(box.path, 40, (1).to_bytes(8, "little"))
        assert reader.take() == [] and not reader.ended
        assert box.put(b"late")
        assert reader.take() == [b"late"] and not reader.ended
        assert reader.take() == [] and reader.ended
    finally:
        reader.close()


def test_a_record_too_long_leaves_the_outbox_closed_for_good(box: Outbox) -> None:
    reader = OutboxReader(box.name, box.token)
    assert box.put(b"fine") and box.put(b"also")
    _poke(box.path, 64 + RECORD_BYTES, (MAX_MESSAGE + 1).to_bytes(2, "little"))
    with pytest.raises(OutboxCorrupt) as e:
        reader.take()
    assert str(e.value) == (f"outbox {box.name}: record 1 is {MAX_MESSAGE + 1} bytes long (at "
                            f"most {MAX_MESSAGE}); it is closed")
    assert reader.take() == []  # closed: not read again, nothing delivered
    assert _header(box.path) == (2, 0, 1, 0) and not box.put(b"after")


def test_a_ring_cut_inside_a_record_delivers_only_the_whole_records_before_the_cut(
        box: Outbox) -> None:
    reader = OutboxReader(box.name, box.token)
    try:
        assert box.put(b"a") and box.put(b"b") and box.put(b"c")
        os.truncate(box.path, 64 + 2 * RECORD_BYTES + 10)
        assert reader.take() == [b"a", b"b"] and reader.taken == 2
        assert _header(box.path)[:2] == (3, 2)  # record 2 is not counted as read
        assert reader.take() == [] and not reader.ended
    finally:
        reader.close()


def test_a_ring_cut_inside_its_last_slot_delivers_no_record_after_the_cut(box: Outbox) -> None:
    """Record SLOTS - 1 (the last slot) cut short, record SLOTS (slot 0) whole: nothing is
    delivered, not the later record out of order."""
    reader = OutboxReader(box.name, box.token)
    try:
        for i in range(SLOTS - 1):
            assert box.put(b"f")
        assert reader.take() == [b"f"] * (SLOTS - 1)
        assert box.put(b"last slot") and box.put(b"slot zero")
        os.truncate(box.path, 64 + (SLOTS - 1) * RECORD_BYTES + 10)
        assert reader.take() == [] and reader.taken == SLOTS - 1
        assert _header(box.path)[:2] == (SLOTS + 1, SLOTS - 1)
    finally:
        reader.close()


def test_a_header_cut_short_reads_as_nothing_and_never_as_ended(box: Outbox) -> None:
    reader = OutboxReader(box.name, box.token)
    try:
        os.truncate(box.path, 20)
        assert reader.take() == [] and reader.take() == [] and not reader.ended
    finally:
        reader.close()


def test_a_written_count_written_short_fails_the_put(box: Outbox,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A count the reader may not see: the caller must send the message some other way."""
    real = os.pwrite

    def short_count(fd: int, data: bytes, offset: int) -> int:
        return real(fd, data[:-1], offset) if offset == 16 else real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", short_count)
    assert not box.put(b"m") and box.sent == 0


def test_a_long_announced_name_is_quoted_cut_to_64_characters() -> None:
    with pytest.raises(FkvError) as e:
        OutboxReader("x" * 1000, bytes(16))
    assert str(e.value) == f"outbox name {'x' * 64!r}: expected 'fkv-outbox-' and 32 hex digits"


def test_an_outbox_never_closed_is_removed_when_its_process_exits() -> None:
    """Its name normally goes once the prefill rank answered; a decode process that exits
    before that, without closing, leaves nothing in /dev/shm either."""
    done = subprocess.run([sys.executable, "-c",
                           "from fkv.connector.transport._outbox import Outbox\n"
                           "box = Outbox()\nprint(box.path)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    path = done.stdout.strip()
    assert path.startswith("/dev/shm/fkv-outbox-") and not os.path.exists(path)


def _reader_hello(server, agent: str, outbox: object, secret: bytes) -> object:
    ctx = zmq.Context()
    try:
        return _side.request(ctx, server.address, _side.Hello(
            engine_id="d", rank=0, tp_size=1, agent=agent, secret=secret, outbox=outbox), 5.0)
    finally:
        ctx.term()


@pytest.mark.transport
def test_a_new_hello_closes_the_outbox_the_agent_or_its_reader_had() -> None:
    """Decode reader ('d', 0) says Hello as agent-a with one outbox, again as agent-a with a new
    one (the old one is closed: its writer uses NIXL), then reconnects as agent-b without one
    (agent-a is no longer bound: its outbox is closed too)."""
    here = host_identity()
    one, two = Outbox(), Outbox()
    secret = os.urandom(16)
    try:
        with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
            info = _side.OutboxInfo(host=here, name=one.name, token=one.token)
            assert _reader_hello(server, "agent-a", info, secret) == \
                _side.Ok(engine_id="p", outbox=True)
            info = _side.OutboxInfo(host=here, name=two.name, token=two.token)
            assert _reader_hello(server, "agent-a", info, secret) == \
                _side.Ok(engine_id="p", outbox=True)
            assert not one.put(b"after")  # closed by the server
            assert [b.name for b in server._outboxes.values()] == [two.name]
            assert two.put(b"open")
            assert _reader_hello(server, "agent-b", None, secret) == \
                _side.Ok(engine_id="p", outbox=False)
            assert server._outboxes == {}
            assert not two.put(b"after")
    finally:
        one.close()
        two.close()


@pytest.mark.transport
def test_outboxes_are_read_every_turn_while_something_is_held_else_every_idle_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With OUTBOX_IDLE_LOOK an hour: nothing held, an outbox is read once (at the first turn
    after its hello) and then not again; once a request is held it is read at once (the stray
    record then counted refused). A server that stops closes its outboxes."""
    from fkv.connector.transport import _server

    monkeypatch.setattr(_server, "OUTBOX_IDLE_LOOK", 3600.0)
    b = Outbox()
    try:
        with serve(engine("p"), SPEC, fkv.allocate(SPEC)) as server:
            info = _side.OutboxInfo(host=host_identity(), name=b.name, token=b.token)
            assert _hello(server, "agent-a", info) == _side.Ok(engine_id="p", outbox=True)
            deadline = time.monotonic() + 10
            while server._outbox_due == 0.0 and time.monotonic() < deadline:
                time.sleep(0.005)  # the first look, right after the hello
            assert server._outbox_due > time.monotonic() + 3000
            assert b.put(b"stray")
            time.sleep(0.3)
            assert server._outboxes["agent-a"].taken == 0
            server.hold("r1", [1])
            deadline = time.monotonic() + 10
            while server._outboxes["agent-a"].taken == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert server._outboxes["agent-a"].taken == 1
            assert server.stats()["refused_messages"] == {"malformed": 1}
        assert not b.put(b"after")  # the server closed the outbox as it stopped
    finally:
        b.close()
