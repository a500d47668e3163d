"""Side-channel limits: what one peer can make a side-channel server hold, bounded by construction.

What libzmq does (pyzmq 27.3, libzmq 4.3.5, measured here; ``tests/test_sidelimits.py``):

- ``MAXMSGSIZE`` is a limit **per frame**: three frames of 1 MiB - 100 B each pass a 1 MiB limit
  as one 3 MiB message; one frame of 1 MiB + 1 B drops the connection.
- A multipart message is delivered **whole or not at all**: after its first frame (flag MORE)
  nothing is readable, however long the application polls, until its last frame arrived. Reading
  frame by frame cannot bound it; no socket option counts frames (``RCVHWM`` counts whole
  messages).
- So a peer grows the server without bound: 30 frames of 100 MiB never finished: RSS 16 MiB ->
  3016 MiB (freed when it disconnects); 64 MiB of empty frames on the wire (2 bytes each): RSS
  16 MiB -> 2068 MiB, 64 bytes of ``msg_t`` per frame, a 32x amplification, and the memory stays
  with the process after the attacker left.

Two ways to bound it, both here:

1. **Plain TCP with fkv's own framing** (:class:`FrameServer`, :func:`frame_request`,
   :class:`FrameClient`; the default, no keys): each frame is ``u32 length`` + payload, the
   length checked against ``max_frame`` before a byte of payload is read, one request in flight
   per connection (a connection is not read again until its reply left, so a peer that never
   reads its replies stalls in TCP backpressure, not in the server's memory), at most
   ``max_connections`` connections and ``max_buffered`` bytes of unfinished frames in all, and a
   connection that makes no progress for ``idle_timeout`` seconds is closed. What a peer can make
   the server hold is at most ``max_buffered`` plus one reply per connection. The trade-off: no
   ZMQ features (reconnection is a new connection per request; no CURVE: ``ZMQ_STREAM``, the raw
   ZMQ socket, cannot use CURVE either, and closing one of its connections by an empty message
   did not close it here).
2. **ZMQ with CURVE** (:func:`harden_server`, :func:`harden_client`, :func:`curve_keypair`;
   opt-in): a ROUTER with ``MAXMSGSIZE`` per frame and CURVE, and a ZAP allow-list of client
   public keys. A peer without an allowed key never completes the handshake, so it cannot put a
   single frame in the server's pipe; a peer *with* an allowed key is trusted not to send
   unbounded multipart messages (libzmq still cannot count its frames).

>>> decoder = FrameDecoder(max_frame=16)
>>> decoder.feed(encode_frame(b"ping") + encode_frame(b"pong")[:3])
[b'ping']
>>> decoder.feed(encode_frame(b"pong")[3:])
[b'pong']
"""

from __future__ import annotations

import contextlib
import errno
import re
import selectors
import socket
import time
from typing import Any

import attrs

from fkv.errors import FkvError, field_error

__all__ = [
    "CurveKeys", "FrameClient", "FrameDecoder", "FrameServer", "MAX_FRAME", "SideLimitError",
    "curve_keypair", "encode_frame", "frame_request", "harden_client", "harden_server",
]

#: Largest side-channel request: a ``Publish`` carries one ``fkv.connector.wire`` message (at most
#: ``wire.MAX_MESSAGE_BYTES`` = 32 MiB) plus a few small fields; the frame limit leaves room.
MAX_FRAME = (64 << 20) + (1 << 20)
_HEADER = 4


class SideLimitError(FkvError):
    """A peer broke a side-channel limit, or did not answer in time."""


def encode_frame(payload: bytes) -> bytes:
    """``u32`` big-endian length, then ``payload``.

    >>> encode_frame(b"hi")
    b'\\x00\\x00\\x00\\x02hi'
    """
    if len(payload) >= 1 << 32:
        raise field_error("payload", f"<{len(payload)} bytes>", "shorter than 4 GiB")
    return len(payload).to_bytes(_HEADER, "big") + payload


class FrameDecoder:
    """Incremental, bounded decoder of :func:`encode_frame` frames from a byte stream (pure).

    ``feed`` returns the frames completed so far; a length over ``max_frame`` raises
    :class:`SideLimitError` before any of that frame's payload is kept. ``want`` says how many
    bytes finish the current header or frame (read no more than that to keep one frame in flight).
    """

    def __init__(self, *, max_frame: int = MAX_FRAME) -> None:
        if isinstance(max_frame, bool) or not isinstance(max_frame, int) or max_frame < 1:
            raise field_error("max_frame", max_frame, "a positive int (bytes)")
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need: int | None = None  # payload length once the header is in

    @property
    def buffered(self) -> int:
        """Bytes held for the frame in progress."""
        return len(self._buf)

    @property
    def announced(self) -> int | None:
        """The length of the frame in progress once its header is in (else None)."""
        return self._need

    @property
    def want(self) -> int:
        """Bytes that complete the header (no length yet) or the current frame."""
        if self._need is None:
            return _HEADER - len(self._buf)
        return self._need - len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        out = []
        view = memoryview(data)
        while view:
            take = min(self.want, len(view))
            self._buf += view[:take]
            view = view[take:]
            if self._need is None and len(self._buf) == _HEADER:
                n = int.from_bytes(self._buf, "big")
                if n > self.max_frame:
                    raise SideLimitError(f"side-channel frame of {n} bytes announced; the limit "
                                         f"is {self.max_frame} (max_frame): the connection is "
                                         f"dropped")
                self._need = n
                self._buf = bytearray()
            if self._need is not None and len(self._buf) == self._need:
                out.append(bytes(self._buf))
                self._buf, self._need = bytearray(), None
        return out


# -- the bounded server ---------------------------------------------------------------------------

#: A side-channel address: ``tcp://`` then a host name or IPv4 address (labels of 1-63 letters,
#: digits and inner hyphens), or an IPv6 address in brackets, then ``:`` and a decimal port. An
#: address comes from peers (a rank's published entry), so nothing else reaches the resolver
#: (a 64-character label, say, raised UnicodeError from the IDNA codec there; brackets of dots and
#: colons, ``[..]``, still reach it and get that UnicodeError, which :class:`FrameClient` reports
#: as a :class:`SideLimitError`). Unanchored: the wire's ``_side._Address`` embeds it too.
ADDRESS_PATTERN = (r"tcp://(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}"
                   r"[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*)"
                   r":[0-9]{1,5}")
#: Longest side-channel address accepted.
MAX_ADDRESS_CHARS = 300
_ADDRESS = re.compile(rf"\A{ADDRESS_PATTERN}\Z")


def _split_address(address: str) -> tuple[str, int]:
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS \
            or not _ADDRESS.match(address):
        shown = address if isinstance(address, str) and len(address) <= MAX_ADDRESS_CHARS \
            else f"<{type(address).__name__}>"
        raise field_error("address", shown, "a 'tcp://host:port' str (host: a name or IPv4 "
                          "address, or an IPv6 address in brackets)")
    host, _, port = address[6:].rpartition(":")
    if int(port) > 65535:
        raise field_error("address", address, "a port in [0, 65535]")
    return host.strip("[]"), int(port)


@attrs.define
class _Conn:
    sock: socket.socket
    decoder: FrameDecoder
    last: float             # last progress (bytes in or out)
    since: float = 0.0      # when the frame in progress started
    reserved: int = 0       # bytes of max_buffered its frame in progress holds
    out: bytearray = attrs.Factory(bytearray)  # the reply not sent yet (no reading meanwhile)
    busy: bool = False      # a request was handed out and not answered yet


_WAKE = object()  # the selector key data of the wake-up socket


class Waker:
    """A socket pair that ends a serving loop's wait from another thread: :meth:`wake` writes a
    byte (safe from any thread; a wake-up already pending is enough), the loop watches
    :attr:`fd` for reading and calls :meth:`drain` when it fires."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    @property
    def sock(self) -> socket.socket:
        return self._r

    def wake(self) -> None:
        try:
            self._w.send(b"w")
        except OSError:  # a wake-up is pending already (or the pair is closed)
            return

    def drain(self) -> None:
        try:
            while self._r.recv(4096):
                continue
        except OSError:  # nothing more to read
            return

    def close(self) -> None:
        self._r.close()
        self._w.close()


class FrameServer:
    """A bounded request/reply server on plain TCP (see the module docstring); no threads.

    Call :meth:`poll` from the serving loop: it accepts, reads, writes and expires, and returns
    the complete requests as ``(connection id, payload)``; answer each with :meth:`reply` (until
    then that connection is not read). Limits: ``max_frame`` bytes per frame (checked on its
    header), ``max_connections`` (more are closed at once), ``max_buffered`` bytes announced by
    all unfinished frames together (a header that would pass it closes its connection), a frame
    must arrive within ``frame_timeout`` s of its first byte and an idle connection is closed
    after ``idle_timeout`` s. :meth:`stats` counts what was refused.

    >>> with FrameServer("tcp://127.0.0.1:0") as server:  # doctest: +SKIP
    ...     for conn, request in server.poll(0.01):
    ...         server.reply(conn, b"answer")
    """

    def __init__(self, address: str = "tcp://127.0.0.1:0", *, max_frame: int = MAX_FRAME,
                 max_connections: int = 64, max_buffered: int = 2 * MAX_FRAME,
                 idle_timeout: float = 30.0, frame_timeout: float = 30.0) -> None:
        for name, value in (("max_frame", max_frame), ("max_connections", max_connections),
                            ("max_buffered", max_buffered)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise field_error(name, value, "a positive int")
        for name, value in (("idle_timeout", idle_timeout), ("frame_timeout", frame_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise field_error(name, value, "a positive number of seconds")
        host, port = _split_address(address)
        self.max_frame, self.max_connections = max_frame, max_connections
        self.max_buffered = max_buffered
        self.idle_timeout, self.frame_timeout = float(idle_timeout), float(frame_timeout)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listen = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listen.bind((host, port))
            self._listen.listen(128)
        except OSError as e:
            self._listen.close()
            raise field_error("address", address, f"an address to bind ({e})") from None
        self._listen.setblocking(False)
        bound = self._listen.getsockname()
        self.address = f"tcp://{'[' + host + ']' if family == socket.AF_INET6 else host}:{bound[1]}"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._waker = Waker()  # wake(): another thread ends a poll at once
        self._sel.register(self._waker.sock, selectors.EVENT_READ, _WAKE)
        self._conns: dict[int, _Conn] = {}
        self._next = 1
        self._reserved = 0
        self._counts = dict.fromkeys(
            ("accepted", "requests", "replies", "refused_connections", "closed_oversize",
             "closed_budget", "closed_idle", "closed_slow", "closed_by_peer"), 0)

    # -- the loop -------------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[tuple[int, bytes]]:
        """Wait up to ``timeout`` seconds for activity; return the requests completed."""
        out: list[tuple[int, bytes]] = []
        for key, events in self._sel.select(max(0.0, timeout)):
            if key.data is None:
                self._accept()
                continue
            if key.data is _WAKE:
                self._waker.drain()
                continue
            cid = key.data
            if events & selectors.EVENT_WRITE:
                self._flush(cid)
            if events & selectors.EVENT_READ and cid in self._conns:
                out.extend(self._read(cid))
        self._expire()
        return out

    def wake(self) -> None:
        """End the current (or next) :meth:`poll` at once; safe from any thread."""
        self._waker.wake()

    def reply(self, conn: int, payload: bytes) -> bool:
        """Send ``payload`` as the answer to ``conn``'s request (False: it is gone)."""
        c = self._conns.get(conn)
        if c is None:
            return False
        if len(payload) > self.max_frame:
            raise field_error("payload", f"<{len(payload)} bytes>",
                              f"at most max_frame={self.max_frame} bytes")
        c.out += encode_frame(payload)
        c.busy = False
        self._counts["replies"] += 1
        self._flush(conn)
        return True

    def close_connection(self, conn: int) -> None:
        """Drop a connection (and what it holds)."""
        c = self._conns.pop(conn, None)
        if c is not None:
            self._reserved -= c.reserved
            with contextlib.suppress(KeyError, ValueError):  # not registered (any more)
                self._sel.unregister(c.sock)
            c.sock.close()

    def stats(self) -> dict[str, int]:
        """Counters, plus ``connections``, ``reserved`` (bytes announced by unfinished frames) and
        ``buffered`` (bytes of them received)."""
        return {**self._counts, "connections": len(self._conns), "reserved": self._reserved,
                "buffered": sum(c.decoder.buffered for c in self._conns.values())}

    def close(self) -> None:
        for cid in list(self._conns):
            self.close_connection(cid)
        with contextlib.suppress(KeyError, ValueError):  # not registered (any more)
            self._sel.unregister(self._listen)
        self._listen.close()
        self._waker.close()
        self._sel.close()

    def __enter__(self) -> FrameServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- inside --------------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: the next poll tries again
                return
            if len(self._conns) >= self.max_connections:
                self._counts["refused_connections"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            cid, self._next = self._next, self._next + 1
            self._conns[cid] = _Conn(sock, FrameDecoder(max_frame=self.max_frame),
                                     time.monotonic())
            self._sel.register(sock, selectors.EVENT_READ, cid)
            self._counts["accepted"] += 1

    def _events(self, cid: int) -> None:
        """Watch ``cid`` for reading unless a request of it is out or its reply has not left
        yet (so a peer that never reads its replies cannot queue them), for writing while a
        reply is pending."""
        c = self._conns[cid]
        reading = not c.busy and not c.out
        events = (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if c.out else 0)
        try:
            self._sel.get_key(c.sock)
            registered = True
        except KeyError:
            registered = False
        if events and registered:
            self._sel.modify(c.sock, events, cid)
        elif events:
            self._sel.register(c.sock, events, cid)
        elif registered:
            self._sel.unregister(c.sock)

    def _read(self, cid: int) -> list[tuple[int, bytes]]:
        c = self._conns[cid]
        if c.busy or c.out:
            return []
        try:  # never past the current header or frame: one request in flight
            data = c.sock.recv(min(c.decoder.want, 1 << 16))
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self._counts["closed_by_peer"] += 1
            self.close_connection(cid)
            return []
        now = time.monotonic()
        if not c.decoder.buffered and c.decoder.announced is None:
            c.since = now
        c.last = now
        try:
            frames = c.decoder.feed(data)
        except SideLimitError:
            self._counts["closed_oversize"] += 1
            self.close_connection(cid)
            return []
        n = c.decoder.announced
        if n is not None and not c.reserved and n:
            if self._reserved + n > self.max_buffered:
                self._counts["closed_budget"] += 1
                self.close_connection(cid)
                return []
            c.reserved = n
            self._reserved += n
        if not frames:
            return []
        self._reserved -= c.reserved
        c.reserved = 0
        c.busy = True
        self._counts["requests"] += 1
        self._events(cid)
        return [(cid, frames[0])]

    def _flush(self, cid: int) -> None:
        c = self._conns.get(cid)
        if c is None:
            return
        while c.out:
            try:
                n = c.sock.send(c.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._counts["closed_by_peer"] += 1
                self.close_connection(cid)
                return
            del c.out[:n]
            c.last = time.monotonic()
        self._events(cid)

    def _expire(self) -> None:
        now = time.monotonic()
        for cid, c in list(self._conns.items()):
            if c.busy:
                continue
            partial = c.decoder.buffered or c.decoder.announced is not None
            if partial and now - c.since > self.frame_timeout:
                self._counts["closed_slow"] += 1
                self.close_connection(cid)
            elif now - c.last > self.idle_timeout:
                self._counts["closed_idle"] += 1
                self.close_connection(cid)


# -- clients ----------------------------------------------------------------------------------------

class FrameClient:
    """A connection to a :class:`FrameServer`: :meth:`request` sends one frame and waits for
    the answer (at most ``max_frame`` bytes) until ``timeout``; not thread-safe.

    >>> with FrameClient("tcp://127.0.0.1:5555", timeout=2) as c:  # doctest: +SKIP
    ...     answer = c.request(b"ping", timeout=2)
    """

    def __init__(self, address: str, *, timeout: float, max_frame: int = MAX_FRAME) -> None:
        host, port = _split_address(address)
        self.address, self.max_frame = address, max_frame
        self._decoder = FrameDecoder(max_frame=max_frame)  # checks max_frame before connecting
        try:
            self._sock = socket.create_connection((host, port), timeout=max(0.001, timeout))
        except (OSError, ValueError) as e:  # ValueError: UnicodeError from the resolver too
            reason = getattr(e, "strerror", None) or e  # a ValueError has no strerror
            raise SideLimitError(f"could not reach the side channel at {address}: "
                                 f"{reason}") from None

    def request(self, payload: bytes, *, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        try:
            self._sock.settimeout(max(0.001, timeout))
            self._sock.sendall(encode_frame(payload))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
                data = self._sock.recv(max(1, min(self._decoder.want, 1 << 20)))
                if not data:
                    raise SideLimitError(f"the side channel at {self.address} closed the "
                                         f"connection without answering")
                frames = self._decoder.feed(data)
                if frames:
                    return frames[0]
        except SideLimitError:
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise SideLimitError(f"no answer from the side channel at {self.address} within "
                                 f"{timeout:g} s") from None
        except OSError as e:
            self.close()
            if e.errno in (errno.ECONNRESET, errno.EPIPE):
                raise SideLimitError(f"the side channel at {self.address} dropped the "
                                     f"connection") from None
            raise SideLimitError(f"side channel at {self.address}: {e}") from None

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> FrameClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def frame_request(address: str, payload: bytes, *, timeout: float,
                  max_frame: int = MAX_FRAME) -> bytes:
    """One request on a fresh connection (a lost answer never wedges the next request); the
    whole call, connecting included, is bounded by ``timeout``.

    >>> frame_request("tcp://127.0.0.1:5555", b"ping", timeout=2)  # doctest: +SKIP
    b'pong'
    """
    deadline = time.monotonic() + timeout
    with FrameClient(address, timeout=timeout, max_frame=max_frame) as client:
        return client.request(payload, timeout=max(0.001, deadline - time.monotonic()))


# -- ZMQ sockets: per-frame cap and CURVE --------------------------------------------------------

@attrs.frozen
class CurveKeys:
    """CURVE keys of one side (Z85 bytes, 40 characters each). A server needs its own pair and
    may list ``allowed`` client public keys (None: any client that knows the server's public
    key); a client needs its own pair and the ``server`` public key."""

    public: bytes
    secret: bytes = attrs.field(repr=False)
    server: bytes | None = None
    allowed: frozenset[bytes] | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("public", "secret", "server"):
            value = getattr(self, name)
            if value is None and name == "server":
                continue
            if not isinstance(value, bytes) or len(value) != 40:
                raise field_error(f"curve.{name}", value if name != "secret" else "<hidden>",
                                  "a Z85 key of 40 bytes", "make keys with curve_keypair()")


def curve_keypair() -> tuple[bytes, bytes]:
    """A new ``(public, secret)`` CURVE key pair (Z85), from pyzmq.

    >>> public, secret = curve_keypair()
    >>> len(public), len(secret)
    (40, 40)
    """
    import zmq

    if not zmq.has("curve"):
        raise FkvError("this pyzmq/libzmq build has no CURVE support: install pyzmq wheels "
                       "(they bundle libzmq with libsodium)")
    return zmq.curve_keypair()


def _common(sock: Any, max_frame: int) -> None:
    import zmq

    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)   # per frame (see the module docstring)
    sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)     # a peer that never finishes its handshake
    sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)     # dead peers are dropped
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)


def harden_server(sock: Any, *, max_frame: int = MAX_FRAME, curve: CurveKeys | None = None
                  ) -> Any:
    """Set limits (and CURVE) on a server (ROUTER) socket before it binds. Returns the ZAP
    authenticator to stop at close when ``curve.allowed`` lists client keys, else None.

    Without ``curve`` the frame count of a message stays unbounded (libzmq cannot count it):
    use :class:`FrameServer` where peers are not trusted.

    >>> server = ctx.socket(zmq.ROUTER)  # doctest: +SKIP
    >>> auth = harden_server(server, curve=CurveKeys(public, secret, allowed={client_public}))  # doctest: +SKIP
    """
    import zmq

    _common(sock, max_frame)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.SNDHWM, 1000)
    if curve is None:
        return None
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
    if curve.allowed is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    class _Allowed:
        def __init__(self, keys: frozenset[bytes]) -> None:
            self.keys = keys

        def callback(self, domain: str, key: bytes) -> bool:
            return key in self.keys

    sock.setsockopt(zmq.ZAP_DOMAIN, b"fkv")
    auth = ThreadAuthenticator(sock.context)
    auth.start()
    auth.configure_curve_callback("fkv", credentials_provider=_Allowed(frozenset(curve.allowed)))
    return auth


def harden_client(sock: Any, *, max_frame: int = MAX_FRAME, curve: CurveKeys | None = None
                  ) -> None:
    """Set limits (and CURVE) on a client (REQ, DEALER) socket before it connects; with
    ``curve``, ``curve.server`` must be the server's public key.

    >>> harden_client(req, curve=CurveKeys(public, secret, server=server_public))  # doctest: +SKIP
    """
    import zmq

    _common(sock, max_frame)
    if curve is None:
        return
    if curve.server is None:
        raise field_error("curve.server", None, "the server's public key (Z85, 40 bytes)",
                          "pass CurveKeys(public, secret, server=<server public key>)")
    sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
