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

import time
from typing import Annotated, Any, Literal

import msgspec

from fkv.connector.transport._base import SideChannelError
from fkv.errors import FkvError

__all__ = [
    "Dealer", "Error", "Fetch", "Hello", "Layers", "MAX_SIDE_MESSAGE_BYTES", "Ok", "Pack", "Packed", "Ping",
    "Publish", "RankEntry", "Ranks", "Status", "SideChannelError", "decode_reply", "decode_request", "encode_message",
    "request",
]

#: Largest side-channel message either side decodes (checked before decoding).
MAX_SIDE_MESSAGE_BYTES = 256 << 20

_Wire = Annotated[bytes, msgspec.Meta(max_length=64 << 20)]
_Address = Annotated[str, msgspec.Meta(max_length=1024)]
_Size = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Token = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
#: Most blocks one pack request may name.
MAX_PACK_BLOCKS = 1 << 22


class Publish(msgspec.Struct, tag="publish", forbid_unknown_fields=True, frozen=True):
    """Prefill rank ``rank`` publishes its wire bytes through rank 0."""

    rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    peer: _Wire
    mem_type: Literal["DRAM", "VRAM"]
    address: _Address = ""  # where this rank answers pack requests ("" : no pack buffer)
    pack_base: _Size = 0     # address and size of its registered pack buffer
    pack_bytes: _Size = 0


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


class Pack(msgspec.Struct, tag="pack", forbid_unknown_fields=True, frozen=True):
    """A decode rank asks one prefill rank to gather ``num_tokens`` tokens of ``block_ids`` (heads
    ``[heads[0], heads[1])`` of that rank, all layers) into its pack buffer, and to keep them
    there for at most ``timeout`` seconds (until the READ's free notification)."""

    token: _Token
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    block_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]],
                         msgspec.Meta(min_length=1, max_length=MAX_PACK_BLOCKS)]
    heads: tuple[Annotated[int, msgspec.Meta(ge=0, le=1 << 16)],
                 Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]]
    num_tokens: Annotated[int, msgspec.Meta(ge=1, lt=1 << 40)]
    timeout: Annotated[float, msgspec.Meta(gt=0, le=86400)]


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True, frozen=True):
    """A decode rank tells a prefill rank which NIXL agent speaks for it: notifications from
    ``agent`` count as reader ``(engine_id, rank)`` of an engine of ``tp_size`` ranks."""

    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]


class Status(msgspec.Struct, tag="status", forbid_unknown_fields=True, frozen=True):
    """A decode rank asks how many layers of a streaming request this prefill rank published."""

    token: _Token
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


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


class Ok(msgspec.Struct, tag="ok", forbid_unknown_fields=True, frozen=True):
    engine_id: Annotated[str, msgspec.Meta(max_length=256)] = ""


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
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SideChannelError(f"{what} refused: {e}") from None


def decode_request(data: Any) -> Publish | Fetch | Ping | Pack | Status | Hello:
    """A request as rank 0 receives it; raises only SideChannelError."""
    return _decode(_REQUESTS, data, "side-channel request")


def decode_reply(data: Any) -> Ok | Ranks | Error | Packed | Layers:
    """A reply as a requester receives it; raises only SideChannelError."""
    return _decode(_REPLIES, data, "side-channel reply")


def request(ctx: Any, address: str, msg: Any, timeout: float) -> Ok | Ranks | Error | Packed:
    """Send one request to ``address`` and wait at most ``timeout`` seconds for the reply.

    A fresh REQ socket per request: a lost reply never wedges the next one.
    """
    import zmq

    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_SIDE_MESSAGE_BYTES)
    try:
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            raise SideChannelError(f"'remote_address' {address!r} is not a ZMQ address like "
                                   f"'tcp://127.0.0.1:5555': {e}") from None
        sock.send(encode_message(msg))
        if not sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN):
            raise SideChannelError(f"no answer from the prefill side channel at {address} within "
                                   f"{timeout:g} s (is rank 0 of the prefill engine serving there?)")
        return decode_reply(sock.recv())
    finally:
        sock.close(0)


class Dealer:
    """A persistent DEALER socket to one prefill rank's address, for token-matched requests
    (:class:`Pack`). Not thread-safe: its owner serializes calls (the client's lock).

    ``send`` queues a request (ZMQ connects and reconnects in the background); ``wait`` returns
    the reply carrying ``token``, dropping replies to other tokens, or None at the deadline.
    """

    def __init__(self, ctx: Any, address: str) -> None:
        import zmq

        self.address = address
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_SIDE_MESSAGE_BYTES)
        try:
            self._sock.connect(address)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise SideChannelError(f"prefill pack address {address!r} is not a ZMQ address: "
                                   f"{e}") from None

    def send(self, msg: Any) -> None:
        import zmq

        try:
            self._sock.send_multipart([b"", encode_message(msg)], zmq.NOBLOCK)
        except zmq.Again:
            raise SideChannelError(f"the pack request to {self.address} could not be queued "
                                   f"(the prefill rank is not reachable)") from None

    def wait(self, token: int, deadline: float, spin: float = 0.0
             ) -> Error | Packed | Layers | None:
        """The reply to ``token`` (None at the deadline); busy-polls the first ``spin`` s."""
        import zmq

        busy_until = time.monotonic() + spin
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return None
            if now < busy_until:
                if not self._sock.poll(0, zmq.POLLIN):
                    continue
            elif not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return None
            frames = self._sock.recv_multipart()
            try:
                reply = decode_reply(frames[-1])
            except SideChannelError:
                continue  # not ours to answer; keep waiting for the real reply
            if isinstance(reply, Error | Packed | Layers) and reply.token == token:
                return reply

    def close(self) -> None:
        self._sock.close(0)
