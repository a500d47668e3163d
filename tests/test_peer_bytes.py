"""Peer bytes that once cost more than an error (a fuzzing campaign's findings, fixed): a deeply
nested side-channel message, a published engine too large for one Fetch reply, peer-supplied
addresses the resolver chokes on, a pack peer that never stops sending, a pid past a C int.
CPU, one process (the side-channel cases against a real ``serve()``)."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest

import fkv
from fkv.connector import EngineDesc, serve
from fkv.connector import wire as W
from fkv.connector.transport import _side
from fkv.connector.transport._base import SideChannelError
from fkv.connector.transport._base import process_alive as _alive
from fkv.connector.transport._sidelimits import FrameClient, _split_address, frame_request
from fkv.errors import FkvError

pytestmark = pytest.mark.transport

#: a msgpack map nested 1000 deep: msgspec raises RecursionError on it
BOMB = b"\x81\xa1a" * 1000 + b"\xc0"
SPEC = fkv.KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8)


def engine(rank: int, tp: int = 1) -> EngineDesc:
    return EngineDesc(engine_id="p", tp_size=tp, tp_rank=rank, total_num_kv_heads=4)


def ask(address: str, payload: bytes, timeout: float = 10.0) -> object:
    return _side.decode_reply(frame_request(address, payload, timeout=timeout,
                                            max_frame=_side.MAX_SIDE_MESSAGE_BYTES))


@pytest.mark.parametrize("decode", [_side.decode_request, _side.decode_reply])
def test_a_deeply_nested_message_is_a_side_channel_error(decode) -> None:
    with pytest.raises(SideChannelError, match="refused: RecursionError"):
        decode(BOMB)


def test_nested_requests_are_answered_and_keep_no_connection() -> None:
    """80 such requests, each on its own connection (more than the server's 64 connection
    slots), each get an Error; the server then still answers, with no connection left held
    (before: no reply, the connection held forever, the side channel full after 64)."""
    with serve(engine(0), SPEC, fkv.allocate(SPEC)) as server:
        for _ in range(80):
            reply = ask(server.address, BOMB)
            assert isinstance(reply, _side.Error)
            assert reply.message.startswith("side-channel request refused: RecursionError")
        assert ask(server.address, _side.encode_message(_side.Ping())) == _side.Ok(engine_id="p")
        deadline = time.monotonic() + 5
        while server._sock.stats()["connections"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server._sock.stats()["connections"] == 0
        assert server.stats()["refused_messages"] == {"undecodable": 80}


def test_a_publish_that_would_outgrow_one_fetch_reply_is_refused() -> None:
    """Ranks 1-3 of a 4-rank engine publish 16 MiB of NIXL metadata each (the most the wire
    allows one rank): the third would make the engine's Fetch reply larger than a side-channel
    message, so it is refused naming the sizes, and Fetch keeps being answered (before: every
    Fetch went unanswered, each holding its connection)."""
    with serve(engine(0, 4), SPEC, fkv.allocate(SPEC)) as server:
        replies = []
        for r in (1, 2, 3):
            peer = W.encode(engine(r, 4), SPEC, [(1 << 30, SPEC.region_bytes)],
                            agent_metadata=b"\0" * W.MAX_AGENT_METADATA_BYTES)
            replies.append(ask(server.address, _side.encode_message(_side.Publish(
                rank=r, peer=peer, mem_type="DRAM", secret=bytes([r]) * 16)), timeout=60))
        assert replies[:2] == [_side.Ok(engine_id="p")] * 2
        assert isinstance(replies[2], _side.Error)
        assert replies[2].message.startswith("publish refused: with this rank's ")
        assert f"more than the side channel's {_side.MAX_SIDE_MESSAGE_BYTES}" in replies[2].message
        reply = ask(server.address, _side.encode_message(_side.Fetch()))
        assert reply.message.startswith("prefill engine 'p': ranks [3] of tp_size 4")
        assert list(server.errors) == []


BAD_ADDRESSES = ["tcp://" + "a" * 64 + ":1", "tcp://a..b:1", "tcp://127.0.0.1:" + "9" * 30,
                 "tcp://127.0.0.1:65536", "tcp://x:1\n", "tcp://[zz]:1", "udp://x:1", "tcp://:1"]


@pytest.mark.parametrize("address", BAD_ADDRESSES)
def test_peer_addresses_are_checked_before_the_resolver_sees_them(address: str) -> None:
    """A rank's address comes from peers: the wire refuses a malformed one, and code given one
    raises FkvError (before: UnicodeError from the IDNA codec, OverflowError from the port)."""
    with pytest.raises(FkvError, match="'address' must be a"):
        _split_address(address)
    if not address.endswith(":65536"):  # the wire's pattern takes any 5-digit port
        with pytest.raises(msgspec.ValidationError, match="Expected `str` matching regex"):
            msgspec.convert({"peer": b"", "mem_type": "DRAM", "address": address},
                            _side.RankEntry)
    with pytest.raises(SideChannelError, match="is not reachable"):
        _side.Dealer(None, address)
    with pytest.raises(FkvError):
        FrameClient(address, timeout=1.0)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "tcp://[::1]:65535",
                                     "tcp://host-1.example.com:80", ""])
def test_good_addresses_pass_the_wire(address: str) -> None:
    entry = msgspec.convert({"peer": b"", "mem_type": "DRAM", "address": address},
                            _side.RankEntry)
    assert entry.address == address


def test_a_pack_peer_that_never_stops_sending_cannot_hold_a_drain() -> None:
    """A peer at a pack address that streams empty frames without end: one drain returns after
    at most MAX_DRAIN frames (before: it never returned)."""
    from fkv.connector.transport._packed_path import MAX_DRAIN, _Dealer

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def flood() -> None:
        conn, _ = listener.accept()
        with conn:
            while not stop.is_set():
                try:
                    conn.sendall(b"\0\0\0\0" * 4096)
                except OSError:
                    return

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    dealer = _Dealer(None, f"tcp://127.0.0.1:{listener.getsockname()[1]}")
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        dealer.drain()
        assert time.monotonic() - t0 < 5.0
        assert MAX_DRAIN == 4096
    finally:
        stop.set()
        dealer.close()
        listener.close()
        thread.join(timeout=5)


def test_a_pid_past_a_c_int_is_refused_and_never_raises() -> None:
    """The wire refuses an IPC pid past a C int; the liveness check of one (os.kill raised
    OverflowError out of a read) counts it as gone."""
    assert _alive(1 << 31) is False and _alive((1 << 63) + 5) is False
    ipc = {"host": "h", "device_uuid": "u", "handles": [], "offsets": []}
    assert msgspec.convert({**ipc, "pid": (1 << 31) - 1}, W._Ipc).pid == (1 << 31) - 1
    with pytest.raises(msgspec.ValidationError, match="Expected `int` <= 2147483647"):
        msgspec.convert({**ipc, "pid": 1 << 31}, W._Ipc)


# -- holes found by mutation (2026-12-04) -----------------------------------------------------------

def test_side_messages_are_bounded_before_they_are_decoded() -> None:
    limit = _side.MAX_SIDE_MESSAGE_BYTES
    with pytest.raises(SideChannelError) as e:
        _side.decode_request(bytes(limit + 1))
    assert str(e.value) == f"side-channel request is {limit + 1} bytes; the limit is {limit}"
    with pytest.raises(SideChannelError) as e:   # at the limit: the decoder sees it
        _side.decode_reply(bytes(limit))
    assert str(e.value) == ("side-channel reply refused: ValidationError: Expected `object`, "
                            "got `int`")


@pytest.mark.parametrize("data", ["ping", None, 7, [b"\x80"]])
def test_side_messages_must_be_bytes(data) -> None:
    for decode, what in ((_side.decode_request, "request"), (_side.decode_reply, "reply")):
        with pytest.raises(SideChannelError) as e:
            decode(data)
        assert str(e.value) == f"side-channel {what} must be bytes (got {type(data).__name__})"
    ping = _side.encode_message(_side.Ping())
    assert _side.decode_request(bytearray(ping)) == _side.decode_request(memoryview(ping)) \
        == _side.Ping()


def test_a_side_message_refusal_quotes_at_most_400_characters() -> None:
    detail = "Invalid value '" + "x" * 1000 + "' - at `$.type`"
    with pytest.raises(SideChannelError) as e:
        _side.decode_request(msgspec.msgpack.encode({"type": "x" * 1000}))
    assert str(e.value) == f"side-channel request refused: ValidationError: {detail[:400]}"


def _peer(frames: list[bytes], hold: threading.Event | None = None
          ) -> tuple[socket.socket, threading.Thread]:
    """A listener whose one connection gets ``frames`` (framed) and is then closed (once
    ``hold`` is set, if given)."""
    from fkv.connector.transport._sidelimits import encode_frame

    listener = socket.create_server(("127.0.0.1", 0))

    def send() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"".join(encode_frame(f) for f in frames))
            if hold is not None:
                hold.wait(10)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return listener, thread


def test_a_dealer_keeps_at_most_64_replies_to_other_tokens() -> None:
    others = [_side.encode_message(_side.Error(message="x", token=t)) for t in range(1, 101)]
    mine = _side.Packed(token=500, slot=1, offset=0, nbytes=8)
    hold = threading.Event()
    listener, thread = _peer([*others, _side.encode_message(mine)], hold)
    dealer = _side.Dealer(None, f"tcp://127.0.0.1:{listener.getsockname()[1]}")
    try:
        assert dealer.wait(500, time.monotonic() + 5) == mine
        assert [r.token for r in dealer._replies] == list(range(1, 65))
        assert dealer.ready(64) == _side.Error(message="x", token=64)
        assert dealer.ready(65) is None
    finally:
        hold.set()
        thread.join(timeout=5)
        dealer.close()
        listener.close()


def test_a_dealer_ready_takes_at_most_64_frames_per_call() -> None:
    """200 frames that answer nothing, then the peer closes: each ``ready`` looks at 64 of them
    and returns None; only the fourth call reaches the close."""
    listener, thread = _peer([b"\xc1"] * 200)
    dealer = _side.Dealer(None, f"tcp://127.0.0.1:{listener.getsockname()[1]}")
    try:
        thread.join(timeout=5)
        time.sleep(0.05)  # the bytes and the close reach this side
        assert [dealer.ready(1) for _ in range(3)] == [None, None, None]
        with pytest.raises(SideChannelError, match="closed the connection"):
            dealer.ready(1)
    finally:
        dealer.close()
        listener.close()


def test_a_multipart_zmq_request_comes_back_without_a_payload() -> None:
    """On the CURVE ROUTER, a message of several body frames is handed over as payload None
    (the caller refuses it), never as its first frame."""
    zmq = pytest.importorskip("zmq")
    from fkv.connector.transport._side import SideServer
    from fkv.connector.transport._sidelimits import CurveKeys, curve_keypair, harden_client

    server_pub, server_sec = curve_keypair()
    pub, sec = curve_keypair()
    ctx = zmq.Context()
    server = SideServer(ctx, "127.0.0.1", 0, curve=CurveKeys(server_pub, server_sec,
                                                             allowed=frozenset({pub})))
    sock = ctx.socket(zmq.DEALER)
    try:
        harden_client(sock, curve=CurveKeys(pub, sec, server=server_pub))
        sock.connect(server.address)
        got = []
        for frames in ([b"", b"a", b"b"], [b"", b"one"]):
            sock.send_multipart(frames)
            for _ in range(50):
                got += server.poll(0.1)
                if len(got) == (1 if frames[1] == b"a" else 2):
                    break
        assert [payload for _, payload in got] == [None, b"one"]
        assert server.reply(got[1][0], b"ok") is True
        assert sock.poll(5000) and sock.recv_multipart() == [b"", b"ok"]
    finally:
        sock.close(0)
        server.close()
        ctx.term()


_OUTBOX = {"host": "h", "name": "fkv-outbox-" + "0" * 32, "token": b"\0" * 16}
_REQUEST_BASES = {
    "publish": {"rank": 0, "peer": b"", "mem_type": "DRAM"},
    "pack": {"token": 1, "request_id": "r", "block_ids": [0], "heads": [0, 1], "num_tokens": 1,
             "timeout": 1.0},
    "status": {"token": 1, "request_id": "r"},
    "hello": {"engine_id": "e", "rank": 0, "tp_size": 1, "agent": "a"},
    "fetch": {},
    "ping": {},
}
_REPLY_BASES = {
    "packed": {"token": 1, "slot": 1, "offset": 0, "nbytes": 0},
    "layers": {"token": 1, "layers_ready": 0, "held": True},
    "error": {"message": ""},
    "ranks": {"ranks": []},
    "ok": {},
}
_MiB32 = 32 << 20

#: (tag, field, the last value taken, the first value refused, msgspec's complaint)
BOUNDS = [
    ("publish", "rank", 1 << 16, (1 << 16) + 1, "Expected `int` <= 65536 - at `$.rank`"),
    ("publish", "peer", bytes(_MiB32), bytes(_MiB32 + 1),
     "Expected `bytes` of length <= 33554432 - at `$.peer`"),
    ("publish", "secret", bytes(64), bytes(65), "Expected `bytes` of length <= 64 - at `$.secret`"),
    ("publish", "address", "tcp://" + ".".join(["a" * 63] * 4) + "." + "b" * 36 + ":1",
     "tcp://" + ".".join(["a" * 63] * 4) + "." + "b" * 37 + ":1",
     "Expected `str` of length <= 300 - at `$.address`"),
    ("pack", "block_ids", [0] * (1 << 21), [0] * ((1 << 21) + 1),
     "Expected `array` of length <= 2097152 - at `$.block_ids`"),
    ("pack", "block_ids", [(1 << 40) - 1], [],
     "Expected `array` of length >= 1 - at `$.block_ids`"),
    ("pack", "block_ids", [(1 << 40) - 1], [1 << 40],
     "Expected `int` <= 1099511627775 - at `$.block_ids[0]`"),
    ("pack", "num_tokens", 1, 0, "Expected `int` >= 1 - at `$.num_tokens`"),
    ("pack", "timeout", 1e-9, 0.0, "Expected `float` > 0.0 - at `$.timeout`"),
    ("pack", "request_id", "x", "", "Expected `str` of length >= 1 - at `$.request_id`"),
    ("status", "request_id", "x" * 4096, "x" * 4097,
     "Expected `str` of length <= 4096 - at `$.request_id`"),
    ("status", "after", -1, -2, "Expected `int` >= -1 - at `$.after`"),
    ("status", "wait", 0.0, -0.001, "Expected `float` >= 0.0 - at `$.wait`"),
    ("status", "wait", 1.0, 1.001, "Expected `float` <= 1.0 - at `$.wait`"),
    ("hello", "secret", bytes(64), bytes(65), "Expected `bytes` of length <= 64 - at `$.secret`"),
    ("hello", "rank", (1 << 16) - 1, 1 << 16, "Expected `int` <= 65535 - at `$.rank`"),
    ("hello", "outbox", _OUTBOX, {**_OUTBOX, "token": bytes(15)},
     "Expected `bytes` of length >= 16 - at `$.outbox.token`"),
    ("hello", "outbox", _OUTBOX, {**_OUTBOX, "token": bytes(17)},
     "Expected `bytes` of length <= 16 - at `$.outbox.token`"),
    ("packed", "expires_in", 1e9, 1e9 + 1, "Expected `float` <= 1000000000.0 - at `$.expires_in`"),
    ("layers", "layers_ready", 1 << 16, (1 << 16) + 1,
     "Expected `int` <= 65536 - at `$.layers_ready`"),
    ("error", "message", "x" * (1 << 16), "x" * ((1 << 16) + 1),
     "Expected `str` of length <= 65536 - at `$.message`"),
    ("ranks", "ranks", [{"peer": b"", "mem_type": "DRAM"}] * (1 << 16),
     [{"peer": b"", "mem_type": "DRAM"}] * ((1 << 16) + 1),
     "Expected `array` of length <= 65536 - at `$.ranks`"),
]


def _message(tag: str, **fields) -> tuple[object, str, bytes]:
    bases = _REQUEST_BASES if tag in _REQUEST_BASES else _REPLY_BASES
    decode, what = ((_side.decode_request, "request") if bases is _REQUEST_BASES
                    else (_side.decode_reply, "reply"))
    return decode, what, msgspec.msgpack.encode({"type": tag, **bases[tag], **fields})


@pytest.mark.parametrize(("tag", "field", "good", "bad", "complaint"), BOUNDS,
                         ids=[f"{b[0]}.{b[1]}-{i}" for i, b in enumerate(BOUNDS)])
def test_decoded_fields_are_bounded_exactly(tag, field, good, bad, complaint) -> None:
    decode, what, data = _message(tag, **{field: good})
    assert getattr(decode(data), field) is not None
    decode, what, data = _message(tag, **{field: bad})
    with pytest.raises(SideChannelError) as e:
        decode(data)
    assert str(e.value) == f"side-channel {what} refused: ValidationError: {complaint}"


def test_the_outbox_name_is_matched_whole() -> None:
    for name in ("fkv-outbox-" + "0" * 32 + "0", "x" + "fkv-outbox-" + "0" * 32,
                 "fkv-outbox-" + "0" * 32 + "\n", "fkv-outbox-" + "A" * 32):
        _, _, data = _message("hello", outbox={**_OUTBOX, "name": name})
        with pytest.raises(SideChannelError, match=r"regex .* - at `\$\.outbox\.name`$"):
            _side.decode_request(data)


@pytest.mark.parametrize("tag", [*_REQUEST_BASES, *_REPLY_BASES])
def test_every_message_round_trips_and_refuses_unknown_fields(tag) -> None:
    decode, what, data = _message(tag)
    msg = decode(data)
    assert type(msg).__struct_config__.tag == tag
    assert decode(_side.encode_message(msg)) == msg
    _, _, data = _message(tag, extra=1)
    with pytest.raises(SideChannelError) as e:
        decode(data)
    assert str(e.value) == (f"side-channel {what} refused: ValidationError: Object contains "
                            f"unknown field `extra`")


def test_a_whole_request_pack_leaves_its_layers_out() -> None:
    pack = _side.Pack(token=1, request_id="r", block_ids=[3], heads=(0, 1), num_tokens=4,
                      timeout=1.0)
    assert msgspec.msgpack.decode(_side.encode_message(pack)) == {
        "type": "pack", "token": 1, "request_id": "r", "block_ids": [3], "heads": [0, 1],
        "num_tokens": 4, "timeout": 1.0}
    layered = msgspec.structs.replace(pack, layers=(0, 2))
    assert msgspec.msgpack.decode(_side.encode_message(layered))["layers"] == [0, 2]


def _announcer(length: int) -> tuple[socket.socket, threading.Thread, threading.Event]:
    """A listener whose one connection gets a frame header announcing ``length`` bytes."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def send() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 16)
            conn.sendall(length.to_bytes(4, "big"))
            done.wait(10)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return listener, thread, done


@pytest.mark.parametrize("length", [_side.MAX_SIDE_MESSAGE_BYTES + 1, 64 << 20])
def test_side_clients_refuse_a_reply_over_the_side_message_limit(length: int) -> None:
    limit = _side.MAX_SIDE_MESSAGE_BYTES
    refusal = (f"side-channel frame of {length} bytes announced; the limit is {limit} "
               f"(max_frame): the connection is dropped")
    listener, thread, done = _announcer(length)
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(SideChannelError) as e:
            _side.request(None, address, _side.Ping(), timeout=5)
        assert str(e.value) == (f"prefill side channel at {address}: {refusal} (is the prefill "
                                f"engine serving there?)")
    finally:
        done.set()
        thread.join(timeout=5)
    listener2, thread, done = _announcer(length)
    address = f"tcp://127.0.0.1:{listener2.getsockname()[1]}"
    dealer = _side.Dealer(None, address)
    try:
        dealer.send(_side.Ping())
        with pytest.raises(SideChannelError) as e:
            dealer.wait(1, time.monotonic() + 5)
        assert str(e.value) == f"the prefill side channel at {address}: {refusal}"
    finally:
        done.set()
        thread.join(timeout=5)
        dealer.close()
        listener.close()
        listener2.close()


def test_side_request_wraps_an_unreachable_address() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    with pytest.raises(SideChannelError) as e:
        _side.request(None, address, _side.Ping(), timeout=1)
    assert str(e.value).startswith(f"prefill side channel at {address}: could not reach the "
                                   f"side channel at {address}: ")
    assert str(e.value).endswith(" (is the prefill engine serving there?)")


def test_a_side_server_takes_frames_up_to_the_side_message_limit_and_two_in_all() -> None:
    """The plain side server's limits are the side channel's: a frame announcing one byte more
    than a side message is dropped, and two unfinished frames of the most a message may be
    fill its budget, so a third is dropped."""
    limit = _side.MAX_SIDE_MESSAGE_BYTES
    server = _side.SideServer(None, "127.0.0.1", 0)
    host, port = server.address[6:].rsplit(":", 1)
    conns = [socket.create_connection((host, int(port)), timeout=2) for _ in range(4)]
    try:
        def settle(done) -> None:
            for _ in range(100):
                server.poll(0.01)
                if done(server.stats()):
                    return

        conns[0].sendall((limit + 1).to_bytes(4, "big"))
        settle(lambda s: s["closed_oversize"] == 1)
        for i, c in enumerate(conns[1:3]):
            c.sendall(limit.to_bytes(4, "big"))
            settle(lambda s, n=(i + 1) * limit: s["reserved"] == n)
        conns[3].sendall((1).to_bytes(4, "big"))
        settle(lambda s: s["closed_budget"] == 1)
        s = server.stats()
        assert (s["closed_oversize"], s["closed_budget"], s["reserved"], s["connections"]) == \
            (1, 1, 2 * limit, 2)
    finally:
        for c in conns:
            c.close()
        server.close()


def _tp2(rank: int, engine_id: str = "p", tp: int = 2) -> EngineDesc:
    return EngineDesc(engine_id=engine_id, tp_size=tp, tp_rank=rank, total_num_kv_heads=tp)


def _publish(rank: int = 1, *, engine: EngineDesc | None = None, spec=SPEC,
             secret: bytes = b"s" * 16) -> bytes:
    peer = W.encode(engine or _tp2(rank), spec, [(1 << 30, spec.region_bytes)],
                    agent_metadata=b"\0" * 64)
    return _side.encode_message(_side.Publish(rank=rank, peer=peer, mem_type="DRAM",
                                              secret=secret))


NOT_JOINED = _side.Error(message="prefill engine 'p': ranks [1] of tp_size 2 have not joined yet",
                         retry=True)


@pytest.mark.parametrize(("payload", "why"), [
    (_publish(engine=_tp2(1, engine_id="q")), "engine_id 'q' is not 'p'"),
    (_publish(engine=_tp2(1, tp=4)), "tp_size 4 is not 2"),
    (_publish(0, engine=_tp2(0)), "rank 0 (engine says 0) must be in [1, 2)"),
    (_publish(1, engine=_tp2(0)), "rank 1 (engine says 0) must be in [1, 2)"),
    (_publish(2, engine=_tp2(1)), "rank 2 (engine says 1) must be in [1, 2)"),
    (_publish(spec=SPEC.evolve(num_blocks=4)),
     f"spec {SPEC.evolve(num_blocks=4)!r} differs from rank 0's {SPEC!r} (every rank of an "
     f"engine must share one spec, num_blocks included)"),
    (_publish(secret=b"s" * 15), "the secret is 15 bytes; at least 16 random bytes are needed "
                                 "(every rank > 0 draws one at start: upgrade that rank's fkv)"),
])
def test_a_publish_that_is_not_this_engines_next_rank_is_refused_naming_why(payload: bytes,
                                                                            why: str) -> None:
    """Rank 0 keeps a Publish only from a rank ``1..tp-1`` of its own engine (the rank the
    message names being the one its metadata says), with rank 0's spec and a 16-byte secret: a
    Publish for rank 0 itself would replace the metadata every decode rank reads. A refused one
    changes nothing (Fetch still waits for rank 1) and is counted; a good one then joins."""
    with serve(_tp2(0), SPEC, fkv.allocate(SPEC)) as server:
        assert ask(server.address, payload) == _side.Error(message="publish refused: " + why)
        assert server.stats()["refused_messages"] == {"publish": 1}
        assert ask(server.address, _side.encode_message(_side.Fetch())) == NOT_JOINED
        assert ask(server.address, _publish()) == _side.Ok(engine_id="p")
        ranks = ask(server.address, _side.encode_message(_side.Fetch()))
        assert isinstance(ranks, _side.Ranks) and len(ranks.ranks) == 2
        assert [W.decode_untrusted(r.peer).engine.tp_rank for r in ranks.ranks] == [0, 1]
        assert list(server.errors) == []


def test_a_rank_above_0_answers_packs_only() -> None:
    """Rank 1 of a 2-rank engine (joined through rank 0) refuses Fetch and Publish, naming rank
    0; rank 0 answers the engine's Fetch with both ranks."""
    with serve(_tp2(0), SPEC, fkv.allocate(SPEC)) as rank0, \
            serve(_tp2(1), SPEC, fkv.allocate(SPEC), join=rank0.address) as rank1:
        refused = _side.Error(message="prefill rank 1 answers pack requests only; ask rank 0 for "
                              "the engine's metadata")
        assert ask(rank1._sock.address, _side.encode_message(_side.Fetch())) == refused
        assert ask(rank1._sock.address, _publish()) == refused
        assert ask(rank1._sock.address, _side.encode_message(_side.Ping())) == \
            _side.Ok(engine_id="p")
        ranks = ask(rank0.address, _side.encode_message(_side.Fetch()))
        assert [r.address for r in ranks.ranks] == [rank0.address, rank1._sock.address]


@pytest.mark.parametrize("length", [0, 15])
def test_a_hello_with_a_secret_under_16_bytes_is_refused_and_16_are_enough(length: int) -> None:
    with serve(_tp2(0, tp=1), SPEC, fkv.allocate(SPEC)) as server:
        hello = _side.Hello(engine_id="d", rank=0, tp_size=1, agent="agent-d",
                            secret=b"k" * length)
        assert ask(server.address, _side.encode_message(hello)) == _side.Error(
            message=f"hello refused: the secret is {length} bytes; at least 16 random bytes are "
                    f"needed (every decode process draws one at start: upgrade that rank's fkv)")
        assert server.stats()["refused_messages"] == {"hello": 1}
        assert server.diagnostics()["counts"]["bindings"] == 0
        hello = msgspec.structs.replace(hello, secret=b"k" * 16)
        assert ask(server.address, _side.encode_message(hello)) == \
            _side.Ok(engine_id="p", outbox=False)
        assert server.diagnostics()["counts"]["bindings"] == 1


def test_a_publish_whose_metadata_does_not_decode_is_refused_and_counted() -> None:
    with serve(_tp2(0), SPEC, fkv.allocate(SPEC)) as server:
        reply = ask(server.address, _side.encode_message(_side.Publish(
            rank=1, peer=b"\x93junk", mem_type="DRAM", secret=b"s" * 16)))
        assert isinstance(reply, _side.Error) and not reply.retry, reply
        assert server.stats()["refused_messages"] == {"publish": 1}
        assert ask(server.address, _side.encode_message(_side.Fetch())) == NOT_JOINED
        assert list(server.errors) == []


# -- holes found by mutation, second pass (2026-12-04) ------------------------------------------------
PSPEC = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8,
                        num_layers=3)


def _pack(token: int, request_id: str = "r", blocks: tuple = (1,), **kw) -> bytes:
    return _side.encode_message(_side.Pack(token=token, request_id=request_id,
                                           block_ids=list(blocks), heads=(0, 2),
                                           num_tokens=4 * len(blocks), timeout=30.0, **kw))


def test_a_pack_to_a_rank_without_a_pack_buffer_is_refused_with_its_token() -> None:
    with serve(engine(0), PSPEC, fkv.allocate(PSPEC), pack_bytes=0) as server:
        assert ask(server.address, _pack(7)) == _side.Error(
            message="prefill rank 0 serves no pack buffer (serve(..., pack_bytes=0))", token=7)
        assert list(server.errors) == []


def test_a_pack_that_finds_the_buffer_full_takes_the_waiting_frees_first(monkeypatch) -> None:
    """The buffer holds one pack (3 layers x 256 bytes). The second pack finds it full; the free
    of the first slot is waiting among the notifications (handed over only once the pack was
    refused): the server takes it and packs into the freed slot. A free is no reader's
    notification: nothing counted, nothing refused."""
    from fkv.connector.transport._packer import FREE_PREFIX

    with serve(engine(0), PSPEC, fkv.allocate(PSPEC), pack_bytes=768) as server:
        first = ask(server.address, _pack(1))
        assert isinstance(first, _side.Packed) and (first.offset, first.nbytes) == (0, 768)
        waiting: list = []
        agent, packer = server._agent, server._packer
        real_notifications, real_pack = agent.notifications, packer.pack

        def notifications() -> list:
            out, waiting[:] = list(waiting), []
            return out + real_notifications()

        def pack(msg, *args, **kw):
            reply = real_pack(msg, *args, **kw)
            if isinstance(reply, _side.Error) and reply.retry:
                waiting.append(("agent-d", FREE_PREFIX + str(first.slot).encode()))
            return reply

        monkeypatch.setattr(agent, "notifications", notifications)
        monkeypatch.setattr(packer, "pack", pack)
        second = ask(server.address, _pack(2, blocks=(5,)))
        assert isinstance(second, _side.Packed), second
        assert (second.token, second.offset, second.nbytes) == (2, 0, 768)
        assert second.slot != first.slot and server.packs_held() == 1
        assert server.stats()["notifications"] == 0
        assert server.stats()["refused_messages"] == {}
        assert list(server.errors) == []


def test_a_layer_range_packs_only_published_layers_of_a_held_request() -> None:
    with serve(engine(0), PSPEC, fkv.allocate(PSPEC), pack_bytes=4096) as server:
        server.hold("s1", [1, 2], layers_ready=1)
        assert ask(server.address, _pack(1, "s1", (1, 2), layers=(0, 2))) == _side.Error(
            message="pack refused: layers (0, 2) of streaming request 's1' asked but only 1 of 3 "
                    "layers are published on this rank (layers [0, 1)); a reader packs only "
                    "published layers; nothing was packed", token=1)
        assert ask(server.address, _pack(2, "s2", (1, 2), layers=(0, 1))) == _side.Error(
            message="pack refused: 'layers' (0, 1) asks a layer range of request 's2', which "
                    "this rank does not hold (a layer range is packed only for a held streaming "
                    "request; it may have been released or its lease expired); nothing was "
                    "packed", token=2)
        assert server.packs_held() == 0
        ok = ask(server.address, _pack(3, "s1", (1, 2), layers=(0, 1)))
        assert isinstance(ok, _side.Packed) and (ok.token, ok.nbytes) == (3, 512), ok
        assert server.packs_held() == 1


@pytest.mark.parametrize("where", ["_gather", "sync"])
def test_a_pack_whose_gather_fails_is_refused_with_its_token_and_frees_its_slot(
        monkeypatch, where: str) -> None:
    """The gather raising as it is launched, or when the server waits for it before the reply:
    the requester gets an error naming it (with its token), no slot stays reserved, and the
    server keeps packing."""
    with serve(engine(0), PSPEC, fkv.allocate(PSPEC), pack_bytes=768) as server:
        packer = server._packer
        real = getattr(packer, where)
        calls = []

        def fail(*args, **kw):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("device lost")
            return real(*args, **kw)

        monkeypatch.setattr(packer, where, fail)
        assert ask(server.address, _pack(4)) == _side.Error(
            message="pack failed on prefill rank 0: RuntimeError: device lost", token=4)
        assert server.packs_held() == 0
        again = ask(server.address, _pack(5))  # the whole buffer: nothing of the first is held
        assert isinstance(again, _side.Packed) and again.nbytes == 768, again
        assert list(server.errors) == []


def test_a_publish_making_a_fetch_reply_of_exactly_the_side_message_limit_is_kept() -> None:
    """Rank 3's metadata is sized so that the engine's Fetch reply is exactly
    MAX_SIDE_MESSAGE_BYTES: kept (a byte more is refused naming both sizes), the Fetch reply
    goes out whole, and rank 3 retrying its Publish (replacing its entry, not adding one) is
    accepted."""
    limit, big = _side.MAX_SIDE_MESSAGE_BYTES, W.MAX_AGENT_METADATA_BYTES

    def publish(r: int, filler: int) -> _side.Publish:
        peer = W.encode(engine(r, 4), SPEC, [(1 << 30, SPEC.region_bytes)],
                        agent_metadata=b"\0" * filler)
        return _side.Publish(rank=r, peer=peer, mem_type="DRAM", secret=bytes([r]) * 16)

    def entry(msg: _side.Publish) -> _side.RankEntry:
        return _side.RankEntry(peer=msg.peer, mem_type=msg.mem_type, address=msg.address,
                               pack_base=msg.pack_base, pack_bytes=msg.pack_bytes)

    with serve(engine(0, 4), SPEC, fkv.allocate(SPEC)) as server:
        ones = [publish(1, big), publish(2, big)]
        own = server._ranks[0]

        def size(filler: int) -> int:
            return len(_side.encode_message(_side.Ranks(
                ranks=[own, *map(entry, ones), entry(publish(3, filler))])))

        filler = (1 << 20) + limit - size(1 << 20)
        assert size(filler) == limit
        for msg in ones:
            assert ask(server.address, _side.encode_message(msg), timeout=60) == \
                _side.Ok(engine_id="p")
        over = publish(3, filler + 1)
        assert ask(server.address, _side.encode_message(over), timeout=60) == _side.Error(
            message=f"publish refused: with this rank's {len(over.peer)} bytes of metadata the "
                    f"engine's ranks would make a {limit + 1}-byte reply, more than the side "
                    f"channel's {limit}")
        exact = _side.encode_message(publish(3, filler))
        assert ask(server.address, exact, timeout=60) == _side.Ok(engine_id="p")
        reply = frame_request(server.address, _side.encode_message(_side.Fetch()), timeout=60,
                              max_frame=limit)
        assert len(reply) == limit
        assert [r.peer for r in _side.decode_reply(reply).ranks] == \
            [own.peer, *(m.peer for m in ones), publish(3, filler).peer]
        assert ask(server.address, exact, timeout=60) == _side.Ok(engine_id="p")  # a retry
        assert server.stats()["refused_messages"] == {"publish": 1}
        assert list(server.errors) == []


def test_a_connection_whose_reply_cannot_be_sent_is_closed(monkeypatch) -> None:
    """Sending a reply raises: the server notes it and closes that connection (its requester
    learns at once instead of waiting out its timeout), then keeps answering."""
    from fkv.connector.transport._sidelimits import SideLimitError

    with serve(engine(0), SPEC, fkv.allocate(SPEC)) as server:
        sock = server._sock
        real, calls = sock.reply, []

        def reply(envelope, payload):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("wire cut")
            return real(envelope, payload)

        monkeypatch.setattr(sock, "reply", reply)
        ping = _side.encode_message(_side.Ping())
        sent = time.monotonic()
        with pytest.raises(SideLimitError, match="closed the"):
            frame_request(server.address, ping, timeout=10.0,
                          max_frame=_side.MAX_SIDE_MESSAGE_BYTES)
        assert time.monotonic() - sent < 5.0
        assert list(server.errors) == ["reply not sent: RuntimeError: wire cut"]
        assert ask(server.address, ping) == _side.Ok(engine_id="p")


def test_a_request_of_several_frames_is_refused_and_counted() -> None:
    """On the CURVE ROUTER a request of two body frames is answered "expected one message frame"
    and counted refused ``frames``; the connection's next request is answered."""
    zmq = pytest.importorskip("zmq")
    from fkv.connector import CurveKeys, curve_keypair
    from fkv.connector.transport._sidelimits import harden_client

    server_pub, server_sec = curve_keypair()
    pub, sec = curve_keypair()
    curve = CurveKeys(server_pub, server_sec, allowed=frozenset({pub}))
    with serve(engine(0), SPEC, fkv.allocate(SPEC), curve=curve) as server:
        sock = server._ctx.socket(zmq.DEALER)
        try:
            harden_client(sock, curve=CurveKeys(pub, sec, server=server_pub))
            sock.connect(server.address)
            sock.send_multipart([b"", _side.encode_message(_side.Ping()), b"more"])
            assert sock.poll(10000)
            empty, reply = sock.recv_multipart()
            assert _side.decode_reply(reply) == _side.Error(message="expected one message frame")
            assert server.stats()["refused_messages"] == {"frames": 1}
            sock.send_multipart([b"", _side.encode_message(_side.Ping())])
            assert sock.poll(10000)
            assert _side.decode_reply(sock.recv_multipart()[1]) == _side.Ok(engine_id="p")
        finally:
            sock.close(0)


def _inject(monkeypatch, server) -> list:
    """Notifications put in the returned list reach the server thread as if NIXL had delivered
    them (an exception put there is raised by the next look instead)."""
    waiting: list = []
    agent = server._agent
    real = agent.notifications

    def notifications() -> list:
        if waiting and isinstance(waiting[0], BaseException):
            raise waiting.pop(0)
        out, waiting[:] = list(waiting), []
        return out + real()

    monkeypatch.setattr(agent, "notifications", notifications)
    return waiting


def test_a_free_sent_to_a_rank_without_a_pack_buffer_is_ignored_and_counted(monkeypatch) -> None:
    from fkv.connector.transport._packer import FREE_PREFIX

    with serve(engine(0), PSPEC, fkv.allocate(PSPEC), pack_bytes=0) as server:
        _inject(monkeypatch, server).append(("agent-d", FREE_PREFIX + b"12"))
        deadline = time.monotonic() + 10
        while not server.errors and time.monotonic() < deadline:
            time.sleep(0.005)
        assert list(server.errors) == [
            f"ignored a free of no held slot {FREE_PREFIX + b'12'!r}"]
        assert server.stats()["refused_messages"] == {"unknown_slot": 1}
        assert server.stats()["notifications"] == 0


def test_an_undecodable_batch_of_notifications_is_reported_counted_and_serving_goes_on(
        monkeypatch) -> None:
    from fkv.connector.transport._agent import UndecodableNotifications
    from fkv.connector.transport._packer import FREE_PREFIX

    with serve(engine(0), PSPEC, fkv.allocate(PSPEC)) as server:
        waiting = _inject(monkeypatch, server)
        waiting.append(UndecodableNotifications("a batch had a sender name that is not UTF-8"))
        deadline = time.monotonic() + 10
        while waiting and time.monotonic() < deadline:
            time.sleep(0.005)
        waiting.append(("agent-d", FREE_PREFIX + b"12"))  # the next batch is still taken
        while len(server.errors) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert list(server.errors) == ["a batch had a sender name that is not UTF-8",
                                       f"ignored a free of no held slot {FREE_PREFIX + b'12'!r}"]
        assert server.stats()["refused_messages"] == {"undecodable_notifications": 1,
                                                      "unknown_slot": 1}


def test_a_ranks_publish_with_its_own_secret_replaces_its_entry() -> None:
    """Rank 1 publishing again with the secret of its first Publish (the same process) replaces
    its entry: Fetch answers the new one."""
    with serve(_tp2(0), SPEC, fkv.allocate(SPEC)) as server:
        first = _side.decode_request(_publish())
        assert ask(server.address, _side.encode_message(first)) == _side.Ok(engine_id="p")
        moved = msgspec.structs.replace(first, address="tcp://127.0.0.1:9", pack_bytes=4096)
        assert ask(server.address, _side.encode_message(moved)) == _side.Ok(engine_id="p")
        ranks = ask(server.address, _side.encode_message(_side.Fetch())).ranks
        assert (ranks[1].address, ranks[1].pack_bytes) == ("tcp://127.0.0.1:9", 4096)
        assert server.stats()["refused_messages"] == {}
