"""The ZMQ side channel: rank 0 of a prefill engine answers for every rank of it.

Requests and replies are msgspec (msgpack) tagged structs, never pickle. A prefill rank ``k > 0``
sends :class:`Publish` (its ``fkv.connector.wire`` bytes and memory type) to rank 0; a decode rank
sends :class:`Fetch` and gets :class:`Ranks` (every rank's wire bytes, in rank order) once all ranks
of the engine have published, or :class:`Error` saying who is missing. Anything rank 0 cannot
decode gets an :class:`Error` reply and the server keeps serving.

Rank 0 stores wire bytes only after ``decode_untrusted`` accepted them; the decode side decodes
them again itself (each side trusts only its own decoder).

>>> decode_reply(encode_message(Error(message="nope", retry=False)))
Error(message='nope', retry=False)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from fkv.errors import FkvError

__all__ = [
    "Error", "Fetch", "MAX_SIDE_MESSAGE_BYTES", "Ok", "Ping", "Publish", "RankEntry", "Ranks",
    "SideChannelError", "decode_reply", "decode_request", "encode_message", "request",
]

#: Largest side-channel message either side decodes (checked before decoding).
MAX_SIDE_MESSAGE_BYTES = 256 << 20

_Wire = Annotated[bytes, msgspec.Meta(max_length=64 << 20)]


class SideChannelError(FkvError):
    """The side channel failed: no answer in time, or an answer we refuse."""


class Publish(msgspec.Struct, tag="publish", forbid_unknown_fields=True, frozen=True):
    """Prefill rank ``rank`` publishes its wire bytes through rank 0."""

    rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    peer: _Wire
    mem_type: Literal["DRAM", "VRAM"]


class Fetch(msgspec.Struct, tag="fetch", forbid_unknown_fields=True, frozen=True):
    """A decode rank asks for every rank's metadata."""


class Ping(msgspec.Struct, tag="ping", forbid_unknown_fields=True, frozen=True):
    """Liveness check; answered with :class:`Ok`."""


class RankEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    peer: _Wire
    mem_type: Literal["DRAM", "VRAM"]


class Ok(msgspec.Struct, tag="ok", forbid_unknown_fields=True, frozen=True):
    engine_id: Annotated[str, msgspec.Meta(max_length=256)] = ""


class Ranks(msgspec.Struct, tag="ranks", forbid_unknown_fields=True, frozen=True):
    ranks: Annotated[list[RankEntry], msgspec.Meta(max_length=1 << 16)]


class Error(msgspec.Struct, tag="error", forbid_unknown_fields=True, frozen=True):
    message: Annotated[str, msgspec.Meta(max_length=1 << 16)]
    retry: bool = False  # True: ask again later (ranks still joining)


_REQUESTS = msgspec.msgpack.Decoder(Publish | Fetch | Ping)
_REPLIES = msgspec.msgpack.Decoder(Ok | Ranks | Error)
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


def decode_request(data: Any) -> Publish | Fetch | Ping:
    """A request as rank 0 receives it; raises only SideChannelError."""
    return _decode(_REQUESTS, data, "side-channel request")


def decode_reply(data: Any) -> Ok | Ranks | Error:
    """A reply as a requester receives it; raises only SideChannelError."""
    return _decode(_REPLIES, data, "side-channel reply")


def request(ctx: Any, address: str, msg: Any, timeout: float) -> Ok | Ranks | Error:
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
