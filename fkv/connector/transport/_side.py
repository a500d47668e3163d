"""The ZMQ side channel: rank 0 of a prefill engine answers for every rank of it.

Requests and replies are msgspec (msgpack) tagged structs, never pickle. A prefill rank ``k > 0``
sends :class:`Publish` (its ``fkv.connector.wire`` bytes and memory type) to rank 0; a decode rank
sends :class:`Fetch` and gets :class:`Ranks` (every rank's wire bytes, in rank order) once all ranks
of the engine have published, or :class:`Error` saying who is missing. Anything rank 0 cannot
decode gets an :class:`Error` reply and the server keeps serving.

Rank 0 stores wire bytes only after ``decode_untrusted`` accepted them; the decode side decodes
them again itself (each side trusts only its own decoder).

Packed reads: every prefill rank with a pack buffer also answers on its own address (listed in
its :class:`RankEntry`). A decode rank sends :class:`Pack` there through a persistent
:class:`Dealer` socket (one per prefill rank); the rank gathers the request's blocks into its pack
buffer and replies :class:`Packed` (where the bytes lie, under which slot) or :class:`Error`
(``retry=True``: the buffer is busy, ask again). Replies carry the request's ``token``, so a late
reply to an earlier, abandoned request is recognised and dropped.

>>> decode_reply(encode_message(Error(message="nope", retry=False)))
Error(message='nope', retry=False, token=0)
"""

from __future__ import annotations

import collections
import time
from typing import Annotated, Any, Literal

import msgspec

from fkv.connector.transport._base import SideChannelError
from fkv.connector.transport._sidelimits import ADDRESS_PATTERN, MAX_ADDRESS_CHARS
from fkv.errors import FkvError

__all__ = [
    "Dealer", "Error", "MAX_STATUS_WAIT", "Fetch", "Hello", "OutboxInfo", "Layers", "MAX_SIDE_MESSAGE_BYTES", "Ok", "Pack", "Packed", "Ping",
    "Publish", "RankEntry", "Ranks", "Status", "SideChannelError", "decode_reply", "decode_request", "encode_message",
    "request",
]

#: Largest side-channel message either side takes (a frame's size is checked on its header,
#: before any of it is buffered): a ``Publish`` carrying a wire message of up to 32 MiB.
MAX_SIDE_MESSAGE_BYTES = 33 << 20

_Wire = Annotated[bytes, msgspec.Meta(max_length=32 << 20)]
#: "" (no such endpoint) or a side-channel address (``_sidelimits.ADDRESS_PATTERN``)
_Address = Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS,
                                       pattern=rf"\A(?:{ADDRESS_PATTERN})?\Z")]
_Size = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Token = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
#: Largest per-rank secret a :class:`Publish` may carry.
MAX_PUBLISH_SECRET_BYTES = 64
#: Most blocks one pack request may name.
MAX_PACK_BLOCKS = 1 << 21


class Publish(msgspec.Struct, tag="publish", forbid_unknown_fields=True, frozen=True):
    """Prefill rank ``rank`` publishes its wire bytes through rank 0."""

    rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    peer: _Wire
    mem_type: Literal["DRAM", "VRAM"]
    address: _Address = ""  # where this rank answers pack requests ("" : no pack buffer)
    pack_base: _Size = 0     # address and size of its registered pack buffer
    pack_bytes: _Size = 0
    #: the rank's random secret (drawn at start): rank 0 keeps only its hash and refuses a later
    #: Publish for the same rank with another secret ("a rank's entry is replaced only by that
    #: rank"); never handed out in :class:`Ranks`
    secret: Annotated[bytes, msgspec.Meta(max_length=MAX_PUBLISH_SECRET_BYTES)] = b""


class Fetch(msgspec.Struct, tag="fetch", forbid_unknown_fields=True, frozen=True):
    """A decode rank asks for every rank's metadata."""


class Ping(msgspec.Struct, tag="ping", forbid_unknown_fields=True, frozen=True):
    """Liveness check; answered with :class:`Ok`."""


class RankEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One prefill rank as rank 0 lists it: wire bytes, memory type, pack address and buffer."""

    peer: _Wire
    mem_type: Literal["DRAM", "VRAM"]
    address: _Address = ""
    pack_base: _Size = 0
    pack_bytes: _Size = 0


class Pack(msgspec.Struct, tag="pack", forbid_unknown_fields=True, frozen=True,
           omit_defaults=True):
    """A decode rank asks one prefill rank to gather ``num_tokens`` tokens of ``block_ids`` (heads
    ``[heads[0], heads[1])`` of that rank; layers ``[layers[0], layers[1])``, or every layer when
    ``layers`` is None) into its pack buffer, and to keep them there for at most ``timeout``
    seconds (until the READ's free notification).

    ``layers`` is how a streaming read packs the layers published so far; it is left out of the
    encoded message when None, so a whole-request Pack is the same bytes as before the field
    existed (and a prefill rank that predates it still takes it)."""

    token: _Token
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    block_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]],
                         msgspec.Meta(min_length=1, max_length=MAX_PACK_BLOCKS)]
    heads: tuple[Annotated[int, msgspec.Meta(ge=0, le=1 << 16)],
                 Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]]
    num_tokens: Annotated[int, msgspec.Meta(ge=1, lt=1 << 40)]
    timeout: Annotated[float, msgspec.Meta(gt=0, le=86400)]
    layers: tuple[Annotated[int, msgspec.Meta(ge=0, le=1 << 16)],
                  Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]] | None = None


class OutboxInfo(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where a same-host decode rank writes its notifications for the prefill rank it says
    Hello to (``_outbox``): its host identity, the file's name and the token at its start."""

    host: Annotated[str, msgspec.Meta(max_length=1024)]
    name: Annotated[str, msgspec.Meta(pattern=r"\Afkv-outbox-[0-9a-f]{32}\Z")]
    token: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True, frozen=True):
    """A decode rank tells a prefill rank which NIXL agent speaks for it: notifications from
    ``agent`` count as reader ``(engine_id, rank)`` of an engine of ``tp_size`` ranks.
    ``secret``: random bytes the decode process draws once (at least 16); only a Hello with the
    same secret can later move that reader to another agent (the process reconnecting)."""

    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    secret: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    #: the decode rank's outbox to this prefill rank (same host), or None: NIXL notifications
    outbox: OutboxInfo | None = None


#: The longest a prefill rank keeps a :class:`Status` request waiting for news (seconds).
MAX_STATUS_WAIT = 1.0


class Status(msgspec.Struct, tag="status", forbid_unknown_fields=True, frozen=True):
    """A decode rank asks how many layers of a streaming request this prefill rank published.

    ``wait > 0`` makes it a long poll: the prefill rank answers as soon as it holds the request
    with more than ``after`` layers published, or after ``wait`` seconds (at most
    :data:`MAX_STATUS_WAIT`) with what it has; ``wait=0`` answers at once."""

    token: _Token
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    after: Annotated[int, msgspec.Meta(ge=-1, le=1 << 16)] = -1
    wait: Annotated[float, msgspec.Meta(ge=0, le=MAX_STATUS_WAIT)] = 0.0
    #: count the layers *published* (their writes enqueued before the rank's IPC publish event
    #: was recorded) rather than those whose writes finished: only for a reader that makes its
    #: stream wait for that event before reading (the ipc path)
    recorded: bool = False


class Layers(msgspec.Struct, tag="layers", forbid_unknown_fields=True, frozen=True):
    """Layers ``[0, layers_ready)`` of :class:`Status` ``token``'s request are written (and, on
    CUDA, their writes finished); ``held``: whether this rank holds the request at all."""

    token: _Token
    layers_ready: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    held: bool


class Packed(msgspec.Struct, tag="packed", forbid_unknown_fields=True, frozen=True):
    """The bytes of :class:`Pack` ``token`` lie at ``offset`` of the pack buffer, ``nbytes`` long
    (layer after layer, each ``[n, 2, h, N, D]``, MLA ``[n, N, D]``), held under ``slot``."""

    token: _Token
    slot: _Token
    offset: _Size
    nbytes: _Size
    #: seconds the slot stays reserved from the pack request's arrival (the request's timeout,
    #: capped by the server's lease; 0: not stated): a READ still running after that may find
    #: the slot given to another pack, so the reader stops waiting for it by then
    expires_in: Annotated[float, msgspec.Meta(ge=0, le=1e9)] = 0.0


class Ok(msgspec.Struct, tag="ok", forbid_unknown_fields=True, frozen=True):
    engine_id: Annotated[str, msgspec.Meta(max_length=256)] = ""
    #: answering a Hello: whether this prefill rank reads the outbox it announced
    outbox: bool = False


class Ranks(msgspec.Struct, tag="ranks", forbid_unknown_fields=True, frozen=True):
    ranks: Annotated[list[RankEntry], msgspec.Meta(max_length=1 << 16)]


class Error(msgspec.Struct, tag="error", forbid_unknown_fields=True, frozen=True):
    message: Annotated[str, msgspec.Meta(max_length=1 << 16)]
    retry: bool = False  # True: ask again later (ranks still joining, pack buffer busy)
    token: _Token = 0    # the Pack request answered (0 for other requests)


_REQUESTS = msgspec.msgpack.Decoder(Publish | Fetch | Ping | Pack | Status | Hello)
_REPLIES = msgspec.msgpack.Decoder(Ok | Ranks | Error | Packed | Layers)
_ENCODER = msgspec.msgpack.Encoder()


def encode_message(msg: Any) -> bytes:
    return _ENCODER.encode(msg)


def _decode(decoder: Any, data: Any, what: str) -> Any:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SideChannelError(f"{what} must be bytes (got {type(data).__name__})")
    if len(data) > MAX_SIDE_MESSAGE_BYTES:
        raise SideChannelError(f"{what} is {len(data)} bytes; the limit is {MAX_SIDE_MESSAGE_BYTES}")
    try:
        return decoder.decode(data)
    except Exception as e:  # noqa: BLE001 - DecodeError, ValidationError, and RecursionError
        # (msgpack nested a thousand deep): whatever the bytes do, the caller gets this error
        raise SideChannelError(f"{what} refused: {type(e).__name__}: {str(e)[:400]}") from None


def decode_request(data: Any) -> Publish | Fetch | Ping | Pack | Status | Hello:
    """A request as rank 0 receives it; raises only SideChannelError."""
    return _decode(_REQUESTS, data, "side-channel request")


def decode_reply(data: Any) -> Ok | Ranks | Error | Packed | Layers:
    """A reply as a requester receives it; raises only SideChannelError."""
    return _decode(_REPLIES, data, "side-channel reply")


def request(ctx: Any, address: str, msg: Any, timeout: float, curve: Any = None
            ) -> Ok | Ranks | Error | Packed | Layers:
    """Send one request to ``address`` and wait at most ``timeout`` seconds for the reply, on a
    fresh connection (a lost reply never wedges the next one): plain-TCP frames, or with
    ``curve`` (:class:`~fkv.connector.transport._sidelimits.CurveKeys`) a CURVE ZMQ REQ."""
    if curve is None:
        from fkv.connector.transport._sidelimits import SideLimitError, frame_request

        try:
            return decode_reply(frame_request(address, encode_message(msg), timeout=timeout,
                                              max_frame=MAX_SIDE_MESSAGE_BYTES))
        except SideLimitError as e:
            raise SideChannelError(f"prefill side channel at {address}: {e} (is the prefill "
                                   f"engine serving there?)") from None
    import zmq

    from fkv.connector.transport._sidelimits import harden_client

    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        harden_client(sock, max_frame=MAX_SIDE_MESSAGE_BYTES, curve=curve)
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            raise SideChannelError(f"'remote_address' {address!r} is not an address like "
                                   f"'tcp://127.0.0.1:5555': {e}") from None
        sock.send(encode_message(msg))
        if not sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN):
            raise SideChannelError(f"no answer from the prefill side channel at {address} within "
                                   f"{timeout:g} s (is it serving there, with the CURVE keys "
                                   f"this side expects?)")
        return decode_reply(sock.recv())
    finally:
        sock.close(0)


class Dealer:
    """A persistent connection to one prefill rank's side channel for requests matched by
    ``token`` (pack requests, layer status).

    ``send`` queues a request; ``wait`` returns the reply carrying ``token``, dropping replies
    to other tokens, or None at the deadline. Plain-TCP frames (the prefill rank answers one
    request of a connection at a time, in order), or with ``curve`` a CURVE ZMQ DEALER.
    """

    def __init__(self, ctx: Any, address: str, curve: Any = None) -> None:
        self.address = address
        self._curve = curve
        self._sock: Any = None
        self._plain: Any = None
        self._decoder: Any = None
        self._frames: collections.deque[bytes] = collections.deque()  # decoded, not yet taken
        self._replies: list[Any] = []
        if curve is None:
            self._connect_plain()
            return
        import zmq

        from fkv.connector.transport._sidelimits import harden_client

        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        harden_client(self._sock, max_frame=MAX_SIDE_MESSAGE_BYTES, curve=curve)
        try:
            self._sock.connect(address)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise SideChannelError(f"prefill address {address!r} is not a ZMQ address: "
                                   f"{e}") from None

    def _connect_plain(self) -> None:
        import socket

        from fkv.connector.transport._sidelimits import FrameDecoder, _split_address

        try:
            host, port = _split_address(self.address)
            self._plain = socket.create_connection((host, port), timeout=5.0)
        except (OSError, ValueError, FkvError) as e:  # ValueError: UnicodeError (resolver)
            raise SideChannelError(f"prefill side channel at {self.address} is not reachable: "
                                   f"{e}") from None
        self._plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._decoder = FrameDecoder(max_frame=MAX_SIDE_MESSAGE_BYTES)

    def send(self, msg: Any) -> None:
        if self._plain is not None:
            from fkv.connector.transport._sidelimits import encode_frame

            try:
                self._plain.settimeout(5.0)
                self._plain.sendall(encode_frame(encode_message(msg)))
            except OSError as e:
                raise SideChannelError(f"the request to {self.address} could not be sent ({e}): "
                                       f"the prefill rank is not reachable") from None
            return
        import zmq

        try:
            self._sock.send_multipart([b"", encode_message(msg)], zmq.NOBLOCK)
        except zmq.Again:
            raise SideChannelError(f"the request to {self.address} could not be queued "
                                   f"(the prefill rank is not reachable)") from None

    def wait(self, token: int, deadline: float, spin: float = 0.0
             ) -> Error | Packed | Layers | None:
        """The reply to ``token`` (None at the deadline); busy-polls the first ``spin`` s."""
        busy_until = time.monotonic() + spin
        while True:
            for i, reply in enumerate(self._replies):
                if reply.token == token:
                    return self._replies.pop(i)
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return None
            data = self._recv(0.0 if now < busy_until else left)
            if data is None:
                if now < busy_until:
                    continue
                return None
            reply = self._take(data, token)
            if reply is not None:
                return reply

    def ready(self, token: int) -> Error | Packed | Layers | None:
        """The reply to ``token`` if it has arrived, without waiting (None: not yet)."""
        for i, reply in enumerate(self._replies):
            if reply.token == token:
                return self._replies.pop(i)
        for _ in range(64):  # a peer that never stops sending cannot keep us here
            data = self._recv(0.0)
            if data is None:
                return None
            reply = self._take(data, token)
            if reply is not None:
                return reply
        return None

    def _take(self, data: bytes, token: int) -> Error | Packed | Layers | None:
        """A reply frame: returned when it answers ``token``, kept when it answers another
        pending token (at most 64 kept), dropped when it answers nothing we asked."""
        try:
            reply = decode_reply(data)
        except SideChannelError:
            return None  # not ours to answer; keep waiting for the real reply
        if isinstance(reply, Error | Packed | Layers):
            if reply.token == token:
                return reply
            if len(self._replies) < 64:  # a reply to another pending token (bounded)
                self._replies.append(reply)
        return None

    def _recv(self, timeout: float) -> bytes | None:
        """The next reply frame within ``timeout`` seconds (None: nothing arrived)."""
        if self._plain is not None:
            import select

            from fkv.connector.transport._sidelimits import SideLimitError

            if self._frames:
                return self._frames.popleft()
            if not select.select([self._plain], [], [], max(0.0, timeout))[0]:
                return None
            try:
                data = self._plain.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                raise SideChannelError(f"the prefill side channel at {self.address} closed the "
                                       f"connection")
            try:
                self._frames.extend(self._decoder.feed(data))
            except SideLimitError as e:
                raise SideChannelError(f"the prefill side channel at {self.address}: {e}") \
                    from None
            return self._frames.popleft() if self._frames else None
        import zmq

        if not self._sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN):
            return None
        return self._sock.recv_multipart()[-1]

    def close(self) -> None:
        if self._plain is not None:
            self._plain.close()
            self._plain = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None


class SideServer:
    """The listening end of a prefill rank's side channel: plain-TCP frames, bounded by
    construction (``_sidelimits.FrameServer``: frame size checked on its header, one request of
    a connection at a time, a budget for unfinished frames, deadlines), or with ``curve`` a
    CURVE-authenticated ZMQ ROUTER (only holders of an allowed key reach it)."""

    def __init__(self, ctx: Any, host: str, port: int, *, curve: Any = None) -> None:
        self._auth = None
        self._router = self._frames = None
        self._waker: Any = None  # the ZMQ loop's wake-up (FrameServer has its own)
        if curve is None:
            from fkv.connector.transport._sidelimits import FrameServer

            self._frames = FrameServer(f"tcp://{host}:{port}", max_frame=MAX_SIDE_MESSAGE_BYTES,
                                       max_buffered=2 * MAX_SIDE_MESSAGE_BYTES)
            self.address = self._frames.address
            return
        import zmq

        from fkv.connector.transport._sidelimits import harden_server

        from fkv.connector.transport._sidelimits import Waker

        self._waker = Waker()
        self._router = ctx.socket(zmq.ROUTER)
        try:  # whatever fails here, the socket is closed (an open one blocks ctx.term())
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self._auth = harden_server(self._router, max_frame=MAX_SIDE_MESSAGE_BYTES,
                                       curve=curve)
            try:
                self._router.bind(f"tcp://{host}:{port or '*'}")
            except zmq.ZMQError as e:
                raise FkvError(f"'host/port' must be an address to bind (got {host}:{port}): "
                               f"{e}") from None
        except BaseException:
            self.close()
            raise
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._waker.sock.fileno(), zmq.POLLIN)

    def wake(self) -> None:
        """End the current (or next) :meth:`poll` at once; safe from any thread."""
        if self._frames is not None:
            self._frames.wake()
        elif self._waker is not None:
            self._waker.wake()

    def poll(self, timeout: float) -> list[tuple[Any, bytes | None]]:
        """Requests that arrived within ``timeout`` s: ``(envelope, payload)``; a ZMQ message
        of more than one frame comes back with payload None (refuse it). :meth:`wake` ends the
        wait early."""
        if self._frames is not None:
            return self._frames.poll(timeout)
        import zmq

        out: list[tuple[Any, bytes | None]] = []
        ready = dict(self._poller.poll(max(0, int(timeout * 1000))))
        if self._waker.sock.fileno() in ready:
            self._waker.drain()
        if self._router not in ready:
            return out
        for _ in range(64):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) >= 3 and frames[1] == b"":
                envelope, body = frames[:2], frames[2:]
            else:
                envelope, body = frames[:1], frames[1:]
            out.append((envelope, body[0] if len(body) == 1 else None))
        return out

    def reply(self, envelope: Any, payload: bytes) -> bool:
        if self._frames is not None:
            return self._frames.reply(envelope, payload)
        import zmq

        try:
            self._router.send_multipart([*envelope, payload], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def close_connection(self, envelope: Any) -> None:
        """Drop the plain-TCP connection a request came on (its requester then learns at once;
        left open, a connection waiting for its answer holds its slot for good). A ZMQ peer's
        connection is not ours to close: a no-op."""
        if self._frames is not None:
            self._frames.close_connection(envelope)

    def stats(self) -> dict[str, int]:
        return self._frames.stats() if self._frames is not None else {}

    def close(self) -> None:
        if self._frames is not None:
            self._frames.close()
            self._frames = None
        if self._router is not None:
            self._router.close(0)
            self._router = None
        if self._waker is not None:
            self._waker.close()
            self._waker = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
