"""Side-channel limits (fkv.connector.transport._sidelimits) with real processes: what libzmq does with
big and many-frame messages (measured, pinned), the bounded framing server that replaces it for
untrusted peers, and ZMQ CURVE with a client allow-list."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import select
import selectors
import socket
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fkv.connector.transport import _sidelimits as S

zmq = pytest.importorskip("zmq")

pytestmark = pytest.mark.transport

MiB = 1 << 20
ROOT = str(pathlib.Path(S.__file__).resolve().parents[2])
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}

# A side-channel server in its own process: mode "frame" (FrameServer) or "router" (a hardened
# ROUTER; CURVE keys from argv). Answers b"rss" with its resident set size, anything else with
# b"pong <n bytes>". Prints its address; exits when its stdin closes.
SERVER = r"""
import os, sys, threading
import zmq
from fkv.connector.transport import _sidelimits as S

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def answer(req):
    return str(rss()).encode() if req == b"rss" else b"pong %d" % len(req)

threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
mode, max_frame = sys.argv[1], int(sys.argv[2])
if mode == "frame":
    server = S.FrameServer("tcp://127.0.0.1:0", max_frame=max_frame, max_connections=8,
                           max_buffered=4 * max_frame, idle_timeout=5)
    print(server.address, flush=True)
    while True:
        for conn, req in server.poll(0.05):
            server.reply(conn, answer(req))
else:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    curve = None
    if len(sys.argv) > 3:
        allowed = frozenset(k.encode() for k in sys.argv[5:]) or None
        curve = S.CurveKeys(sys.argv[3].encode(), sys.argv[4].encode(), allowed=allowed)
    auth = S.harden_server(sock, max_frame=max_frame, curve=curve)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    while True:
        if sock.poll(50):
            frames = sock.recv_multipart()
            sock.send_multipart([frames[0], answer(b"".join(frames[1:]))])
"""


class Server:
    def __init__(self, mode: str, max_frame: int, *curve: bytes) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, mode, str(max_frame), *(k.decode() for k in curve)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ENV, text=True)
        self.address = self.proc.stdout.readline().strip()
        assert self.address.startswith("tcp://"), self.address
        self.host, self.port = self.address[6:].rsplit(":", 1)
        self.port = int(self.port)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dealer_request(address: str, frames: list[bytes], timeout: float = 2.0, curve=None):
    """Send one (multipart) message with a DEALER; the reply, or None after ``timeout``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    S.harden_client(sock, max_frame=S.MAX_FRAME, curve=curve)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000)):
            return None
        return sock.recv_multipart()[-1]
    finally:
        sock.close(0)


def router_rss(address: str) -> int:
    return int(dealer_request(address, [b"rss"], timeout=10))


def zmtp_connect(port: int) -> socket.socket:
    """A raw TCP peer that speaks just enough ZMTP 3.0 (NULL mechanism) to send frames by hand."""
    c = socket.create_connection(("127.0.0.1", port), timeout=5)
    c.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0")
              + bytes(32))
    body = bytes([5]) + b"READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", 6) + b"DEALER"
    c.sendall(bytes([0x04, len(body)]) + body)
    got = b""
    while len(got) < 66:
        got += c.recv(4096)
    return c


def zmtp_read(c: socket.socket) -> list[bytes]:
    """The next message's frames from a raw ZMTP peer (commands such as PING skipped)."""
    def exact(n):
        out = b""
        while len(out) < n:
            chunk = c.recv(n - len(out))
            assert chunk, "the server closed the connection"
            out += chunk
        return out
    frames = []
    while True:
        flags = exact(1)[0]
        size = int.from_bytes(exact(8 if flags & 2 else 1), "big")
        body = exact(size)
        if flags & 4:
            continue
        frames.append(body)
        if not flags & 1:
            return frames


def zmtp_frame(payload: bytes, more: bool) -> bytes:
    if len(payload) < 256:
        return bytes([int(more), len(payload)]) + payload
    return bytes([int(more) | 2]) + struct.pack(">Q", len(payload)) + payload


# -- what libzmq does (the reasons for FrameServer) --------------------------------------------------

def test_zmq_maxmsgsize_is_per_frame():
    with Server("router", MiB) as server:
        # three frames just under the limit: one 3 MiB message goes through
        assert dealer_request(server.address, [b"x" * (MiB - 100)] * 3) == b"pong %d" % (
            3 * (MiB - 100))
        # one frame over it: that connection is dropped, nothing answered
        assert dealer_request(server.address, [b"y" * (MiB + 1)], timeout=1) is None
        assert dealer_request(server.address, [b"ping"]) == b"pong 4"


def test_zmq_buffers_a_multipart_message_whole_and_without_bound():
    """Frames with MORE are not readable until the last one came (the server answers only
    then), and each empty frame (2 bytes on the wire) costs the server about 64 bytes
    (a ``zmq_msg_t``), so a few MiB sent become tens of times more in the server."""
    with Server("router", S.MAX_FRAME) as server:
        c = zmtp_connect(server.port)
        c.sendall(zmtp_frame(b"first", True))
        c.settimeout(0.5)
        with pytest.raises(TimeoutError):
            zmtp_read(c)            # nothing was delivered to the application: no answer
        c.sendall(zmtp_frame(b"last", False))
        c.settimeout(10)
        assert zmtp_read(c) == [b"pong 9"]   # 'first' + 'last': the whole message at once
        c.close()

        before = router_rss(server.address)
        c = zmtp_connect(server.port)
        one = zmtp_frame(b"", True)
        frames = 3 * MiB // len(one)   # 3 MiB on the wire, never finished
        c.sendall(one * frames)
        grown, t = 0, time.monotonic()
        while time.monotonic() - t < 10:   # until the server has taken them all in
            time.sleep(0.3)
            now = router_rss(server.address) - before
            if now == grown:
                break
            grown = now
        c.close()
        print(f"\nROUTER: 3 MiB of empty frames ({frames} frames) grew the server by "
              f"{grown / MiB:.0f} MiB ({grown / frames:.0f} B per frame)")
        assert grown > 32 * frames     # > 16x the bytes sent


# -- the bounded framing server ----------------------------------------------------------------------

@given(st.lists(st.binary(max_size=40), max_size=8), st.lists(st.integers(1, 50), max_size=30))
def test_frame_decoder_any_split(payloads, cuts):
    stream = b"".join(S.encode_frame(p) for p in payloads)
    decoder, out, at = S.FrameDecoder(max_frame=64), [], 0
    for cut in cuts:
        out += decoder.feed(stream[at:at + cut])
        at += cut
    out += decoder.feed(stream[at:])
    assert out == payloads and decoder.buffered == 0


def test_frame_decoder_refuses_before_the_payload():
    decoder = S.FrameDecoder(max_frame=100)
    with pytest.raises(S.SideLimitError, match=r"frame of 101 bytes announced; the limit is 100 "
                                               r"\(max_frame\)"):
        decoder.feed(S.encode_frame(b"x" * 101)[:4])
    with pytest.raises(S.FkvError, match="'max_frame' must be a positive int"):
        S.FrameDecoder(max_frame=0)


def dropped(c: socket.socket) -> bool:
    """The server closed this connection (a FIN, or a reset since our bytes were unread)."""
    try:
        return c.recv(10) == b""
    except ConnectionResetError:
        return True


def test_frame_server_drops_an_oversized_frame_and_keeps_serving():
    with Server("frame", MiB) as server:
        c = socket.create_connection((server.host, server.port), timeout=5)
        c.sendall(S.encode_frame(b"z" * (MiB + 1))[:4 + 1000])   # the header says too much
        assert dropped(c)                                        # at once
        c.close()
        big = socket.create_connection((server.host, server.port), timeout=5)
        big.sendall((100 * MiB).to_bytes(4, "big"))               # 100 MiB announced
        assert dropped(big)
        big.close()
        assert S.frame_request(server.address, b"ping", timeout=5) == b"pong 4"
        with pytest.raises(S.SideLimitError, match="frame of 8 bytes announced; the limit is 4"):
            # a reply larger than the client's own cap is refused on the client side too
            S.frame_request(server.address, b"x" * 100, timeout=0.2, max_frame=4)


def test_frame_server_many_frames_and_connections_stay_bounded():
    """The attacks that grow a ROUTER by gigabytes: 30 x 100 MiB frames, 64 MiB of empty frames
    pipelined without reading a reply, 16 connections (8 allowed) each sending a frame header of
    max_frame and stalling. RSS grows less than 64 MiB and the server still answers."""
    max_frame = 8 * MiB
    with Server("frame", max_frame) as server:
        before = int(S.frame_request(server.address, b"rss", timeout=5))
        t0 = time.perf_counter()
        # 30 x 100 MiB frames: refused on the first header
        c = socket.create_connection((server.host, server.port), timeout=5)
        try:
            for _ in range(30):
                c.sendall(S.encode_frame(b"\0" * (100 * MiB)))
        except OSError:
            pass
        c.close()
        # many small frames, replies never read: one request is taken, the rest waits in TCP
        c = socket.create_connection((server.host, server.port), timeout=5)
        c.setblocking(False)
        burst = S.encode_frame(b"") * (MiB // 4)
        sent, t = 0, time.monotonic()
        while sent < 64 * MiB and time.monotonic() - t < 3:
            try:
                sent += c.send(burst)
            except BlockingIOError:
                time.sleep(0.01)
        # stalled frames on many connections
        stalled = []
        for _ in range(16):
            s = socket.create_connection((server.host, server.port), timeout=5)
            s.sendall(max_frame.to_bytes(4, "big") + b"\0" * 1000)
            stalled.append(s)
        time.sleep(0.3)
        for s in stalled:
            s.close()
        time.sleep(0.2)   # the server sees the stalled ones go
        after = int(S.frame_request(server.address, b"rss", timeout=5))
        assert S.frame_request(server.address, b"ping", timeout=5) == b"pong 4"
        c.close()
        took = time.perf_counter() - t0
        print(f"\nFrameServer: 30x100 MiB frames, {sent / MiB:.1f} MiB of empty frames pushed "
              f"(the rest refused by TCP backpressure), 16 stalled max-size frames: RSS "
              f"{before / MiB:.0f} -> {after / MiB:.0f} MiB in {took:.1f} s")
        assert after - before < 64 * MiB


def test_frame_server_limits_in_process():
    """Connection cap, budget of announced bytes, slow frames and idle connections (no
    subprocess: the counters are visible)."""
    with S.FrameServer(max_frame=1000, max_connections=2, max_buffered=1500, idle_timeout=0.3,
                       frame_timeout=0.3) as server:
        host, port = server.address[6:].rsplit(":", 1)
        conns = [socket.create_connection((host, int(port)), timeout=2) for _ in range(3)]
        server.poll(0.05)
        assert server.stats()["refused_connections"] == 1
        conns[0].sendall((900).to_bytes(4, "big") + b"a" * 10)
        conns[1].sendall((900).to_bytes(4, "big"))                # 1800 > 1500 announced
        for _ in range(5):
            server.poll(0.02)
        s = server.stats()
        assert s["closed_budget"] == 1 and s["reserved"] == 900
        time.sleep(0.35)
        server.poll(0.01)                                          # conns[0] is too slow
        assert server.stats()["closed_slow"] == 1 and server.stats()["reserved"] == 0
        idle = socket.create_connection((host, int(port)), timeout=2)
        server.poll(0.05)
        time.sleep(0.35)
        server.poll(0.01)
        assert server.stats()["closed_idle"] >= 1
        for c in (*conns, idle):
            c.close()


# -- CURVE ----------------------------------------------------------------------------------------------

def test_curve_only_the_right_keys_get_an_answer():
    server_public, server_secret = S.curve_keypair()
    client_public, client_secret = S.curve_keypair()
    other_public, other_secret = S.curve_keypair()
    good = S.CurveKeys(client_public, client_secret, server=server_public)
    with Server("router", MiB, server_public, server_secret) as server:   # any key-holder
        assert dealer_request(server.address, [b"ping"], curve=good) == b"pong 4"
        assert dealer_request(server.address, [b"ping"], timeout=1) is None          # no CURVE
        wrong = S.CurveKeys(client_public, client_secret, server=other_public)
        assert dealer_request(server.address, [b"ping"], timeout=1, curve=wrong) is None
    with Server("router", MiB, server_public, server_secret, client_public) as server:
        assert dealer_request(server.address, [b"ping"], curve=good) == b"pong 4"
        stranger = S.CurveKeys(other_public, other_secret, server=server_public)
        assert dealer_request(server.address, [b"ping"], timeout=1, curve=stranger) is None


def test_curve_keys_are_checked():
    with pytest.raises(S.FkvError, match=r"'curve.public' must be a Z85 key of 40 bytes"):
        S.CurveKeys(b"short", b"x" * 40)
    with pytest.raises(S.FkvError, match=r"'curve.server' must be the server's public key"):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            S.harden_client(sock, curve=S.CurveKeys(*S.curve_keypair()))
        finally:
            sock.close(0)


# -- holes found by mutation (2026-12-04) -----------------------------------------------------------

def _poll_until(server: S.FrameServer, done, rounds: int = 100) -> list:
    """Poll ``server`` until ``done(stats)`` holds (at most ``rounds`` polls); the requests."""
    out = []
    for _ in range(rounds):
        out += server.poll(0.01)
        if done(server.stats()):
            break
    return out


def test_frame_decoder_takes_a_frame_of_exactly_max_frame():
    decoder = S.FrameDecoder(max_frame=4)
    assert decoder.feed(S.encode_frame(b"abcd")) == [b"abcd"]
    assert decoder.buffered == 0 and decoder.announced is None


@pytest.mark.parametrize("value", [True, 0, -1, 1.5, "8"])
def test_frame_decoder_max_frame_must_be_a_positive_int(value):
    with pytest.raises(S.FkvError) as e:
        S.FrameDecoder(max_frame=value)
    assert str(e.value) == f"'max_frame' must be a positive int (bytes) (got {value!r})"


@pytest.mark.parametrize("name", ["max_frame", "max_connections", "max_buffered"])
@pytest.mark.parametrize("value", [0, True, 2.0])
def test_frame_server_int_limits_must_be_positive_ints(name, value):
    with pytest.raises(S.FkvError) as e:
        S.FrameServer(**{name: value})
    assert str(e.value) == f"{name!r} must be a positive int (got {value!r})"


@pytest.mark.parametrize("name", ["idle_timeout", "frame_timeout"])
@pytest.mark.parametrize("value", [0, 0.0, -1.0, True, "1"])
def test_frame_server_timeouts_must_be_positive_numbers(name, value):
    with pytest.raises(S.FkvError) as e:
        S.FrameServer(**{name: value})
    assert str(e.value) == f"{name!r} must be a positive number of seconds (got {value!r})"


def test_split_address_bounds_port_and_length():
    assert S._split_address("tcp://127.0.0.1:65535") == ("127.0.0.1", 65535)
    assert S._split_address("tcp://[::1]:0") == ("::1", 0)
    with pytest.raises(S.FkvError) as e:
        S._split_address("tcp://127.0.0.1:65536")
    assert str(e.value) == "'address' must be a port in [0, 65535] (got 'tcp://127.0.0.1:65536')"
    # names that match the pattern: 300 characters pass, 301 are refused (the value not shown)
    host = ".".join(["a" * 63] * 4) + "." + "b" * 36
    at_limit = f"tcp://{host}:1"
    assert len(at_limit) == S.MAX_ADDRESS_CHARS == 300
    assert S._split_address(at_limit) == (host, 1)
    over = f"tcp://{host}b:1"
    assert S._ADDRESS.match(over)
    with pytest.raises(S.FkvError) as e:
        S._split_address(over)
    assert str(e.value).startswith("'address' must be a 'tcp://host:port' str (host: a name or "
                                   "IPv4 address, or an IPv6 address in brackets) (got '<str>')")


def test_frame_server_budget_admits_exactly_max_buffered():
    """Two frames announcing 900 bytes each fit a budget of 1800 exactly; a third byte over
    would not."""
    with S.FrameServer(max_frame=1000, max_connections=4, max_buffered=1800) as server:
        host, port = server.address[6:].rsplit(":", 1)
        conns = [socket.create_connection((host, int(port)), timeout=2) for _ in range(3)]
        try:
            conns[0].sendall((900).to_bytes(4, "big") + b"a")
            _poll_until(server, lambda s: s["reserved"] == 900)
            conns[1].sendall((900).to_bytes(4, "big") + b"b")
            _poll_until(server, lambda s: s["reserved"] == 1800)
            conns[2].sendall((1).to_bytes(4, "big"))
            _poll_until(server, lambda s: s["closed_budget"] == 1)
            s = server.stats()
            assert (s["reserved"], s["closed_budget"], s["connections"]) == (1800, 1, 2)
        finally:
            for c in conns:
                c.close()


def test_frame_server_a_finished_frame_gives_its_budget_back():
    """The bytes a frame announced are reserved until it is complete, then released, so a
    connection that keeps sending full requests never uses up ``max_buffered``."""
    with S.FrameServer(max_frame=100, max_buffered=100) as server:
        host, port = server.address[6:].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2) as c:
            for i in range(3):
                c.sendall((10).to_bytes(4, "big") + b"x" * 5)
                _poll_until(server, lambda s: s["buffered"] == 5)
                assert server.stats()["reserved"] == 10
                c.sendall(b"y" * 5)
                got = _poll_until(server, lambda s: s["requests"] == i + 1)
                assert [p for _, p in got] == [b"xxxxxyyyyy"]
                assert server.stats()["reserved"] == 0
                assert server.reply(got[0][0], b"ok") is True
                assert S.FrameDecoder().feed(c.recv(100)) == [b"ok"]
            assert server.stats()["closed_budget"] == 0


def test_frame_server_pipelined_requests_are_taken_one_at_a_time():
    """Two requests in one TCP write: the second is not read (nor lost) until the first is
    answered."""
    with S.FrameServer(max_frame=100) as server:
        host, port = server.address[6:].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2) as c:
            c.sendall(S.encode_frame(b"one") + S.encode_frame(b"two"))
            first = _poll_until(server, lambda s: s["requests"] == 1)
            assert [p for _, p in first] == [b"one"]
            for _ in range(5):
                assert server.poll(0.01) == []
            assert server.stats()["buffered"] == 0 and server.stats()["requests"] == 1
            assert server.reply(first[0][0], b"1") is True
            second = _poll_until(server, lambda s: s["requests"] == 2)
            assert second == [(first[0][0], b"two")]


def test_frame_server_reply_of_exactly_max_frame_is_sent():
    with S.FrameServer(max_frame=8) as server:
        host, port = server.address[6:].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2) as c:
            c.sendall(S.encode_frame(b"a"))
            ((conn, _),) = _poll_until(server, lambda s: s["requests"] == 1)
            with pytest.raises(S.FkvError) as e:
                server.reply(conn, b"x" * 9)
            assert str(e.value) == "'payload' must be at most max_frame=8 bytes (got '<9 bytes>')"
            assert server.reply(conn, b"y" * 8) is True
            got, decoder = [], S.FrameDecoder(max_frame=8)
            while not got:
                got = decoder.feed(c.recv(100))
            assert got == [b"y" * 8] and server.stats()["replies"] == 1


class _Clock:
    """A monotonic clock the test moves by hand (for the server's deadlines)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@contextlib.contextmanager
def _clocked(monkeypatch, **limits):
    """A FrameServer on a clock the test moves by hand, and one connection to it: (clock,
    server, socket)."""
    clock = _Clock()
    monkeypatch.setattr(S, "time", clock)
    with S.FrameServer(max_frame=100, **limits) as server:
        host, port = server.address[6:].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2) as c:
            yield clock, server, c


def test_frame_server_never_expires_a_request_it_is_answering(monkeypatch):
    """A connection whose request is out (a parked status poll, say) is not idle: it is closed
    neither by ``idle_timeout`` nor by ``frame_timeout`` before its reply; after the reply the
    idle clock runs again."""
    with _clocked(monkeypatch, idle_timeout=1, frame_timeout=1) as (clock, server, c):
        c.sendall(S.encode_frame(b"wait"))
        ((conn, _),) = _poll_until(server, lambda s: s["requests"] == 1)
        clock.now += 10
        server.poll(0.01)
        s = server.stats()
        assert (s["connections"], s["closed_idle"], s["closed_slow"]) == (1, 0, 0)
        assert server.reply(conn, b"done") is True
        clock.now += 10
        server.poll(0.01)
        s = server.stats()
        assert (s["connections"], s["closed_idle"], s["closed_slow"]) == (0, 1, 0)


def test_frame_server_frame_timeout_counts_from_the_first_byte(monkeypatch):
    """A frame trickled in a byte at a time, each well within ``idle_timeout``, is closed as
    slow once ``frame_timeout`` passed since its first byte (progress does not restart it)."""
    with _clocked(monkeypatch, idle_timeout=100, frame_timeout=5) as (clock, server, c):
        c.sendall((50).to_bytes(4, "big") + b"a")
        _poll_until(server, lambda s: s["buffered"] == 1)
        for sent in (2, 3):
            clock.now += 3
            c.sendall(b"a")
            _poll_until(server, lambda s, n=sent: s["buffered"] == n or not s["connections"])
        s = server.stats()
        assert (s["connections"], s["closed_slow"], s["closed_idle"], s["reserved"]) == \
            (0, 1, 0, 0)


def test_frame_server_reply_to_a_gone_connection_is_false():
    with S.FrameServer(max_frame=100) as server:
        host, port = server.address[6:].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2) as c:
            c.sendall(S.encode_frame(b"q"))
            ((conn, _),) = _poll_until(server, lambda s: s["requests"] == 1)
        server.close_connection(conn)
        assert server.reply(conn, b"late") is False
        assert server.reply(12345, b"never") is False
        assert server.stats()["replies"] == 0


def test_frame_server_a_header_alone_starts_the_frame_clock(monkeypatch):
    """A peer that sends a frame header and then its payload a byte at a time: the frame is
    slow ``frame_timeout`` after the header, whatever came after it."""
    with _clocked(monkeypatch, idle_timeout=100, frame_timeout=5) as (clock, server, c):
        c.sendall((50).to_bytes(4, "big"))
        _poll_until(server, lambda s: s["reserved"] == 50)
        clock.now += 3
        c.sendall(b"a")
        _poll_until(server, lambda s: s["buffered"] == 1)
        assert server.stats()["connections"] == 1
        clock.now += 3
        server.poll(0.01)
        s = server.stats()
        assert (s["connections"], s["closed_slow"], s["closed_idle"], s["reserved"]) == \
            (0, 1, 0, 0)


def test_frame_server_a_header_with_no_payload_yet_is_slow_not_idle(monkeypatch):
    with _clocked(monkeypatch, idle_timeout=100, frame_timeout=5) as (clock, server, c):
        c.sendall((50).to_bytes(4, "big"))
        _poll_until(server, lambda s: s["reserved"] == 50)
        clock.now += 6
        server.poll(0.01)
        s = server.stats()
        assert (s["connections"], s["closed_slow"], s["closed_idle"], s["reserved"]) == \
            (0, 1, 0, 0)


def test_curve_key_errors_never_show_the_secret():
    public, secret = S.curve_keypair()
    with pytest.raises(S.FkvError) as e:
        S.CurveKeys(public, secret[:38] + b"!")
    assert "!" not in str(e.value)
    with pytest.raises(S.FkvError) as e:
        S.CurveKeys(public, secret + b"x")
    assert str(e.value) == ("'curve.secret' must be a Z85 key of 40 bytes (got '<hidden>'); "
                            "make keys with curve_keypair()")
    for bad in (None, public[:39], public.decode()):
        with pytest.raises(S.FkvError) as e:
            S.CurveKeys(bad, secret)
        assert str(e.value).startswith(f"'curve.public' must be a Z85 key of 40 bytes (got "
                                       f"{bad!r})")
    with pytest.raises(S.FkvError, match=r"'curve.server' must be a Z85 key of 40 bytes"):
        S.CurveKeys(public, secret, server=public + b"x")
    assert S.CurveKeys(public, secret).server is None


def test_frame_client_names_a_peer_that_closes_or_stays_silent():
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with S.FrameClient(address, timeout=2) as client:
            conn, _ = listener.accept()
            conn.shutdown(socket.SHUT_WR)   # an end of stream; our request is still taken
            with pytest.raises(S.SideLimitError) as e:
                client.request(b"hi", timeout=2)
            assert str(e.value) == (f"the side channel at {address} closed the connection "
                                    f"without answering")
            conn.close()
        with S.FrameClient(address, timeout=2) as client:
            conn, _ = listener.accept()
            with pytest.raises(S.SideLimitError) as e:
                client.request(b"hi", timeout=0.2)
            assert str(e.value) == f"no answer from the side channel at {address} within 0.2 s"
            conn.close()
    finally:
        listener.close()


def test_frame_server_a_sent_reply_restarts_the_idle_clock(monkeypatch):
    """Idle time counts from the last progress, a reply's bytes leaving included (not from the
    request's arrival)."""
    with _clocked(monkeypatch, idle_timeout=1, frame_timeout=1) as (clock, server, c):
        c.sendall(S.encode_frame(b"slow question"))
        ((conn, _),) = _poll_until(server, lambda s: s["requests"] == 1)
        clock.now += 0.8
        assert server.reply(conn, b"answer") is True
        clock.now += 0.5
        server.poll(0.01)
        assert (server.stats()["connections"], server.stats()["closed_idle"]) == (1, 0)
        clock.now += 0.6
        server.poll(0.01)
        assert (server.stats()["connections"], server.stats()["closed_idle"]) == (0, 1)


# -- holes found by mutation (second pass) ------------------------------------------------------------

class _Sized(bytes):
    """Empty bytes that report a length of ``n``: a 4 GiB payload without allocating it."""

    n: int

    def __new__(cls, n: int) -> _Sized:
        self = super().__new__(cls)
        self.n = n
        return self

    def __len__(self) -> int:
        return self.n


def test_encode_frame_takes_a_u32_length_and_refuses_4_gib():
    assert S.encode_frame(b"") == b"\0\0\0\0"
    assert S.encode_frame(_Sized((1 << 32) - 1)) == b"\xff\xff\xff\xff"
    with pytest.raises(S.FkvError) as e:
        S.encode_frame(_Sized(1 << 32))
    assert str(e.value) == "'payload' must be shorter than 4 GiB (got '<4294967296 bytes>')"


@pytest.mark.parametrize(("address", "shown"), [
    (None, "<NoneType>"), (5555, "<int>"), (b"tcp://127.0.0.1:1", "<bytes>"),
    ("tcp://" + "a" * 291 + "!:1", "tcp://" + "a" * 291 + "!:1"),     # 300 characters: shown
    ("tcp://" + "a" * 292 + "!:1", "<str>"),                           # 301: not shown
])
def test_split_address_shows_the_value_only_when_short(address, shown):
    with pytest.raises(S.FkvError) as e:
        S._split_address(address)
    assert str(e.value) == ("'address' must be a 'tcp://host:port' str (host: a name or IPv4 "
                            f"address, or an IPv6 address in brackets) (got {shown!r})")


def test_split_address_pattern_boundaries():
    """IPv6 in brackets: 2 to 45 characters; labels: no hyphen at either end; ports: 1 to 5
    digits (a 5-digit port over 65535 is refused by the range check, a 6-digit one by the
    pattern); nothing after the port, not even a newline."""
    v6 = "1" * 45
    assert S._split_address(f"tcp://[{v6}]:1") == (v6, 1)
    assert S._split_address("tcp://[::]:1") == ("::", 1)
    assert S._split_address("tcp://a-b.c-d:0") == ("a-b.c-d", 0)
    for bad in (f"tcp://[{v6}1]:1", "tcp://[:]:1", "tcp://a:123456", "tcp://a.b-:1",
                "tcp://a-.b:1", "tcp://a.-b:1", "tcp://a:1\n", "tcp://" + "a" * 64 + ":1"):
        with pytest.raises(S.FkvError, match="'address' must be a 'tcp://host:port' str"):
            S._split_address(bad)
    with pytest.raises(S.FkvError, match=r"'address' must be a port in \[0, 65535\]"):
        S._split_address("tcp://a-b.c-d:99999")


def test_frame_server_serves_an_ipv6_address():
    with S.FrameServer("tcp://[::1]:0", max_frame=100) as server:
        host, port = S._split_address(server.address)
        assert server.address == f"tcp://[::1]:{port}" and host == "::1"
        with socket.create_connection(("::1", port), timeout=2) as c:
            c.sendall(S.encode_frame(b"six"))
            ((conn, request),) = _poll_until(server, lambda s: s["requests"] == 1)
            assert request == b"six" and server.reply(conn, b"ok") is True
            assert S.FrameDecoder().feed(c.recv(100)) == [b"ok"]


def test_frame_server_names_an_address_it_cannot_bind():
    with S.FrameServer() as taken:
        fds = len(os.listdir("/proc/self/fd"))
        with pytest.raises(S.FkvError) as e:
            S.FrameServer(taken.address)
        assert len(os.listdir("/proc/self/fd")) == fds   # the socket that could not bind: closed
    assert str(e.value) == (f"'address' must be an address to bind ([Errno {errno.EADDRINUSE}] "
                            f"{os.strerror(errno.EADDRINUSE)}) (got {taken.address!r})")


def _reset(c: socket.socket) -> None:
    """Close ``c`` with a TCP reset (SO_LINGER 0) instead of a FIN."""
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()


def test_frame_server_counts_each_way_a_connection_ends():
    """A FIN and a reset are ``closed_by_peer`` (a reset is not an error out of ``poll``), a
    header over ``max_frame`` is ``closed_oversize``; every connection was ``accepted``."""
    with S.FrameServer(max_frame=10) as server:
        host, port = server.address[6:].rsplit(":", 1)
        fin, rst, big = (socket.create_connection((host, int(port)), timeout=2)
                         for _ in range(3))
        _poll_until(server, lambda s: s["accepted"] == 3)
        fin.close()
        _reset(rst)
        big.sendall((11).to_bytes(4, "big"))
        _poll_until(server, lambda s: not s["connections"])
        s = server.stats()
        assert (s["accepted"], s["closed_by_peer"], s["closed_oversize"], s["connections"]) == \
            (3, 2, 1, 0)
        big.close()


def test_frame_server_a_reply_to_a_reset_peer_closes_its_connection():
    with S.FrameServer(max_frame=100) as server:
        host, port = server.address[6:].rsplit(":", 1)
        c = socket.create_connection((host, int(port)), timeout=2)
        c.sendall(S.encode_frame(b"q"))
        ((conn, _),) = _poll_until(server, lambda s: s["requests"] == 1)
        _reset(c)
        assert server.reply(conn, b"a") is True   # it was there when asked; the send failed
        s = server.stats()
        assert (s["replies"], s["closed_by_peer"], s["connections"]) == (1, 1, 0)
        assert server.reply(conn, b"a") is False


def test_frame_server_a_reply_larger_than_the_socket_buffers_goes_out_whole():
    """A reply the socket cannot take at once stays pending, leaves as the peer reads (the
    server watches the connection for writing), and the connection is read again after."""
    payload = bytes(range(256)) * (32 << 10)   # 8 MiB
    with S.FrameServer(max_frame=len(payload)) as server:
        host, port = server.address[6:].rsplit(":", 1)
        with socket.socket() as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.connect((host, int(port)))
            c.sendall(S.encode_frame(b"big?"))
            ((conn, _),) = _poll_until(server, lambda s: s["requests"] == 1)
            assert server.reply(conn, payload) is True
            assert server._conns[conn].out                 # did not fit: pending
            c.setblocking(False)
            decoder, got = S.FrameDecoder(max_frame=len(payload)), []
            for _ in range(100_000):
                assert server.poll(0) == []
                with contextlib.suppress(BlockingIOError):
                    got += decoder.feed(c.recv(1 << 20))
                if got:
                    break
            assert got == [payload] and not server._conns[conn].out
            c.setblocking(True)
            c.sendall(S.encode_frame(b"next"))
            assert _poll_until(server, lambda s: s["requests"] == 2) == [(conn, b"next")]


def test_frame_server_watches_a_connection_only_when_it_may_act():
    """Not at all while its request is out (a parked request costs no wake-ups), for writing
    only while its reply is pending (a peer that never reads is not read either), for reading
    after."""
    with S.FrameServer(max_frame=8 << 20) as server:
        host, port = server.address[6:].rsplit(":", 1)
        with socket.socket() as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.connect((host, int(port)))
            _poll_until(server, lambda s: s["accepted"] == 1)
            (sock,) = (conn.sock for conn in server._conns.values())
            assert server._sel.get_key(sock).events == selectors.EVENT_READ
            c.sendall(S.encode_frame(b"q"))
            _poll_until(server, lambda s: s["requests"] == 1)
            with pytest.raises(KeyError):
                server._sel.get_key(sock)
            assert server.reply(1, b"\0" * (8 << 20)) is True
            assert server._sel.get_key(sock).events == selectors.EVENT_WRITE


def test_frame_server_reading_a_frame_is_progress_for_the_idle_clock(monkeypatch):
    """A frame arriving a byte every 0.75 s with ``idle_timeout=1``: not idle (each byte is
    progress), and not slow before ``frame_timeout``."""
    with _clocked(monkeypatch, idle_timeout=1, frame_timeout=100) as (clock, server, c):
        c.sendall((50).to_bytes(4, "big"))
        _poll_until(server, lambda s: s["reserved"] == 50)
        for sent in range(1, 5):
            clock.now += 0.75
            c.sendall(b"a")
            _poll_until(server, lambda s, n=sent: s["buffered"] == n or not s["connections"])
        s = server.stats()
        assert (s["connections"], s["buffered"], s["closed_idle"]) == (1, 4, 0)


@pytest.mark.parametrize(("in_frame", "limit", "counter"),
                         [(True, 2, "closed_slow"), (False, 4, "closed_idle")])
def test_frame_server_deadlines_are_exclusive(monkeypatch, in_frame, limit, counter):
    """A connection is closed once *more* than ``frame_timeout`` (a frame in progress) or
    ``idle_timeout`` (none) passed: at exactly the limit it stays."""
    with _clocked(monkeypatch, idle_timeout=4, frame_timeout=2) as (clock, server, c):
        if in_frame:
            c.sendall((50).to_bytes(4, "big"))
            _poll_until(server, lambda s: s["reserved"] == 50)
        else:
            _poll_until(server, lambda s: s["accepted"] == 1)
        clock.now += limit
        server.poll(0)
        assert server.stats()["connections"] == 1
        clock.now += 0.5
        server.poll(0)
        assert (server.stats()["connections"], server.stats()[counter]) == (0, 1)


def test_waker_drops_extra_wake_ups_and_drains():
    """Wake-ups past what the socket pair buffers (a few hundred) are dropped, not raised; a
    drain empties it; after close a wake-up is a no-op; ``poll`` drains its waker."""
    w = S.Waker()
    try:
        for _ in range(2000):
            w.wake()
        assert select.select([w.sock], [], [], 0)[0] == [w.sock]
        w.drain()
        assert select.select([w.sock], [], [], 0)[0] == []
        w.drain()                                    # nothing pending: returns
    finally:
        w.close()
    w.wake()
    with S.FrameServer() as server:
        server.wake()
        assert server.poll(10) == []
        assert select.select([server._waker.sock], [], [], 0)[0] == []


def test_frame_client_errors_name_the_address_and_close_the_socket():
    with socket.socket() as bound:                  # bound, not listening: refused
        bound.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(S.SideLimitError) as e:
            S.FrameClient(address, timeout=2)
    assert str(e.value) == f"could not reach the side channel at {address}: Connection refused"
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        client = S.FrameClient(address, timeout=2)
        _reset(listener.accept()[0])
        with pytest.raises(S.SideLimitError) as e:
            client.request(b"hi", timeout=2)
        assert str(e.value) == f"the side channel at {address} dropped the connection"
        assert client._sock.fileno() == -1
        for timeout, sent in ((0.1, b""), (2, S.encode_frame(b"x" * 5))):
            client = S.FrameClient(address, timeout=2, max_frame=4)
            conn = listener.accept()[0]
            conn.sendall(sent)                       # nothing, or a reply over max_frame
            with pytest.raises(S.SideLimitError):
                client.request(b"hi", timeout=timeout)
            assert client._sock.fileno() == -1
            conn.close()


class _Ticking:
    """A monotonic clock one second later at each reading."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        self.now += 1
        return self.now


def test_frame_request_bounds_the_whole_call(monkeypatch):
    """The time connecting took is taken from the request's; a deadline reached exactly is
    a timeout (the clock moves 1 s per reading: 1 s left after connecting, 0 at the first
    receive)."""
    monkeypatch.setattr(S, "time", _Ticking())
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(S.SideLimitError) as e:
            S.frame_request(address, b"hi", timeout=2)
        assert str(e.value) == f"no answer from the side channel at {address} within 1 s"


def test_frame_client_reads_no_further_than_its_reply():
    """A server that follows its reply with a header announcing 2 GiB: the reply is returned,
    the header never read (the client reads the frame in progress only)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        with S.FrameClient(address, timeout=2, max_frame=100) as client:
            conn = listener.accept()[0]
            conn.sendall(S.encode_frame(b"ok") + (1 << 31).to_bytes(4, "big"))
            assert client.request(b"hi", timeout=2) == b"ok"
            conn.close()


@pytest.mark.parametrize("address", ["tcp://[..]:1", "tcp://[1..2]:1", "tcp://[.:]:1"])
def test_frame_client_an_address_the_resolver_refuses_is_a_side_limit_error(address):
    """Dots and colons in brackets pass the address pattern (and the wire's) but the resolver's
    IDNA codec refuses them with a UnicodeError: a SideLimitError naming the address (before:
    AttributeError, a UnicodeError has no ``strerror``)."""
    host, port = S._split_address(address)
    with pytest.raises(UnicodeError) as codec:
        socket.getaddrinfo(host, port)
    with pytest.raises(S.SideLimitError) as e:
        S.FrameClient(address, timeout=1)
    assert str(e.value) == f"could not reach the side channel at {address}: {codec.value}"
    with pytest.raises(S.SideLimitError, match="could not reach the side channel"):
        S.frame_request(address, b"hi", timeout=1)


def test_frame_client_checks_max_frame_before_connecting():
    """A bad ``max_frame`` is refused before a connection is opened (before: the connection was
    made, then left open to the server until garbage collection)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        for bad in (0, True):
            with pytest.raises(S.FkvError) as e:
                S.FrameClient(address, timeout=2, max_frame=bad)
            assert str(e.value) == f"'max_frame' must be a positive int (bytes) (got {bad!r})"
            with pytest.raises(S.FkvError):
                S.frame_request(address, b"hi", timeout=2, max_frame=bad)
        with pytest.raises(BlockingIOError):
            listener.accept()                        # no connection was ever opened
