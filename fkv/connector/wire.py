"""The wire format of the side channel: one rank's engine, cache spec and registered regions.

``encode(engine, spec, regions)`` gives msgpack bytes (msgspec structs, versioned);
``decode_untrusted(data)`` is the only door for peer bytes: it checks the size, decodes into typed
structs with bounds on every number, string and list, rebuilds the validated fkv values and checks
the regions against the spec. Whatever the bytes, it returns a :class:`Peer` or raises
:class:`~fkv.errors.FkvWireError`; nothing else escapes. No pickle anywhere (docs/transport.md: NIXL's own
serialization is pickle; never hand it peer bytes before they passed through here).

>>> from fkv import KVCacheSpec
>>> from fkv.connector.handshake import EngineDesc
>>> spec = KVCacheSpec(layout="HND", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128)
>>> engine = EngineDesc(engine_id="prefill-0", tp_size=1, tp_rank=0, total_num_kv_heads=8)
>>> data = encode(engine, spec, [(0x7F0000000000, spec.region_bytes)])
>>> peer = decode_untrusted(data)
>>> peer.engine == engine, peer.spec == spec, peer.regions
(True, True, ((139637976727552, 262144),))
>>> decode_untrusted(data[:-3])
Traceback (most recent call last):
  ...
fkv.errors.FkvWireError: peer message is not valid msgpack: Input data was truncated
"""

from __future__ import annotations

import operator
from typing import Annotated, Any

import attrs
import msgspec

from fkv.connector.handshake import EngineDesc
from fkv.errors import FkvError, FkvWireError
from fkv.layout import KVCacheSpec

__all__ = [
    "IPC_HANDLE_BYTES", "MAX_AGENT_METADATA_BYTES", "MAX_MESSAGE_BYTES", "MAX_PUBLISH_EVENTS",
    "MAX_REGIONS",
    "WIRE_VERSION", "BoardInfo", "IpcInfo", "Peer", "decode_untrusted", "encode",
]

#: Version of the message layout below (bumped on any incompatible change).
WIRE_VERSION = 1
#: Largest message accepted (bytes), checked before decoding anything.
MAX_MESSAGE_BYTES = 32 << 20
#: Largest NIXL agent metadata blob carried (bytes).
MAX_AGENT_METADATA_BYTES = 16 << 20
#: Most registered regions (one per layer, or one cross-layer buffer).
MAX_REGIONS = 4096
#: Size of one CUDA IPC memory or event handle (``cudaIpcMemHandle_t``, ``cudaIpcEventHandle_t``).
IPC_HANDLE_BYTES = 64
#: Most interprocess publish events a rank announces (layers beyond share slots).
MAX_PUBLISH_EVENTS = 128

_U64 = (1 << 64) - 1
_Str = Annotated[str, msgspec.Meta(max_length=256)]
_Name = Annotated[str, msgspec.Meta(max_length=32)]


def _int(lo: int, hi: int) -> Any:
    return Annotated[int, msgspec.Meta(ge=lo, le=hi)]


class _Engine(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    engine_id: _Str
    tp_size: _int(1, 1 << 16)  # type: ignore[valid-type]
    tp_rank: _int(0, 1 << 16)  # type: ignore[valid-type]
    total_num_kv_heads: _int(1, 1 << 16)  # type: ignore[valid-type]
    model: _Str
    model_dtype: _Name
    protocol: _int(0, 1 << 31)  # type: ignore[valid-type]


class _Spec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    backend: _Name
    layout: _Name
    num_blocks: _int(1, 1 << 40)  # type: ignore[valid-type]
    block_size: _int(1, 1 << 20)  # type: ignore[valid-type]
    num_kv_heads: _int(1, 1 << 16)  # type: ignore[valid-type]
    head_size: _int(1, 1 << 16)  # type: ignore[valid-type]
    dtype: _Name
    num_layers: _int(1, 1 << 16)  # type: ignore[valid-type]
    cross_layer: bool


# msgpack integers stop at 2**64 - 1; msgspec bounds must fit int64, so the address's upper
# bound is checked in _check_regions.
_Region = tuple[Annotated[int, msgspec.Meta(ge=0)], _int(1, 1 << 62)]  # type: ignore[valid-type]


class _Ipc(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    device_uuid: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    handles: Annotated[list[Annotated[bytes, msgspec.Meta(min_length=IPC_HANDLE_BYTES,
                                                          max_length=IPC_HANDLE_BYTES)]],
                       msgspec.Meta(max_length=MAX_REGIONS)]
    offsets: Annotated[list[_int(0, 1 << 48)], msgspec.Meta(max_length=MAX_REGIONS)]  # type: ignore[valid-type]
    pid: _int(0, (1 << 31) - 1) = 0  # type: ignore[valid-type]  # a positive C int (os.kill)
    # the IPC handles of the rank's publish events (streaming), or none
    events: Annotated[list[Annotated[bytes, msgspec.Meta(min_length=IPC_HANDLE_BYTES,
                                                         max_length=IPC_HANDLE_BYTES)]],
                      msgspec.Meta(max_length=MAX_PUBLISH_EVENTS)] = []


class _Board(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    name: Annotated[str, msgspec.Meta(pattern=r"\Afkv-board-[0-9a-f]{32}\Z")]
    salt: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    pid: _int(0, (1 << 31) - 1) = 0  # type: ignore[valid-type]  # a positive C int, or 0


class _Message(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    version: int
    engine: _Engine
    spec: _Spec
    regions: Annotated[list[_Region], msgspec.Meta(max_length=MAX_REGIONS)]
    device_id: _int(0, 1 << 16)  # type: ignore[valid-type]
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)]
    ipc: _Ipc | None = None
    board: _Board | None = None


class _Envelope(msgspec.Struct, frozen=True):
    version: int


_DECODER = msgspec.msgpack.Decoder(_Message)
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_ENCODER = msgspec.msgpack.Encoder()


@attrs.frozen
class IpcInfo:
    """How a same-host CUDA process can map a rank's cache regions: the host identity (host name
    and boot id), the CUDA device's UUID, and per region the IPC handle of the allocation that
    holds it and the region's byte offset inside that allocation."""

    host: str
    device_uuid: str
    handles: tuple[bytes, ...]
    offsets: tuple[int, ...]
    pid: int = 0   # the exporting process, when the reader shares its PID namespace (else 0)
    #: the IPC handles (64 bytes each) of the interprocess events the rank records after each
    #: streaming publish, one per layer slot (publishing ``n`` layers records event
    #: ``(n - 1) % len(events)``, all on one stream), or none: a reader that waits for the
    #: slot's event may learn of published layers before their writes finished
    events: tuple[bytes, ...] = ()


@attrs.frozen
class BoardInfo:
    """Where a same-host reader finds the rank's publish board (``_board``): the host identity,
    the shared-memory file's name and the salt of its slot hash."""

    host: str
    name: str
    salt: bytes
    #: the rank's process id (0: not said): a same-host reader with CPU DRAM caches copies the
    #: rank's regions with ``process_vm_readv`` from it (``_cma``), after checking it can
    pid: int = 0


@attrs.frozen(repr=False)
class Peer:
    """One remote rank as its bytes said: engine, cache spec, registered regions
    ``((base_address, nbytes), ...)`` (one per ``spec.num_regions``), its device id and its NIXL
    agent metadata (opaque bytes for ``add_remote_agent``)."""

    engine: EngineDesc
    spec: KVCacheSpec
    regions: tuple[tuple[int, int], ...]
    device_id: int = 0
    agent_metadata: bytes = b""
    ipc: IpcInfo | None = None
    board: BoardInfo | None = None

    def __repr__(self) -> str:
        regions = ", ".join(f"(0x{b:x}, {n})" for b, n in self.regions[:4])
        more = f", ... {len(self.regions)} regions" if len(self.regions) > 4 else ""
        return (f"Peer(engine={self.engine!r}, spec={self.spec!r}, regions=({regions}{more}), "
                f"device_id={self.device_id}, agent_metadata=<{len(self.agent_metadata)} bytes>"
                f"{', ipc' if self.ipc is not None else ''})")


def _integer(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer (numpy's included, never a bool)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_regions(spec: KVCacheSpec, regions: Any) -> tuple[tuple[int, int], ...]:
    """Count, size and overlap checks (FkvError); returns normalized regions."""
    if not isinstance(regions, list | tuple):
        raise FkvError(f"'regions' must be a list of (base_address, nbytes) (got "
                       f"{type(regions).__name__})")
    if len(regions) != spec.num_regions:
        raise FkvError(f"'regions' must hold spec.num_regions={spec.num_regions} entries (one per "
                       f"layer, or one cross-layer buffer) (got {len(regions)})")
    out = []
    for i, region in enumerate(regions):
        pair = (tuple(_integer(v) for v in region)
                if isinstance(region, list | tuple) and len(region) == 2 else ())
        if len(pair) != 2 or None in pair:
            raise FkvError(f"'regions[{i}]' must be a pair of ints (base_address, nbytes) "
                           f"(got {region!r})")
        base, nbytes = pair
        if not 0 <= base <= _U64 or base + nbytes - 1 > _U64:
            raise FkvError(f"'regions[{i}]' = ({base:#x}, {nbytes}) leaves the 64-bit address "
                           f"space")
        if nbytes != spec.region_bytes:
            raise FkvError(f"'regions[{i}]' holds {nbytes} bytes; the spec's region is "
                           f"spec.region_bytes={spec.region_bytes}")
        out.append((base, nbytes))
    ordered = sorted(out)
    for (b0, n0), (b1, _) in zip(ordered, ordered[1:], strict=False):
        if b0 + n0 > b1:
            raise FkvError(f"'regions' overlap: [0x{b0:x}, +{n0}) and [0x{b1:x}, ...)")
    return tuple(out)


def encode(engine: EngineDesc, spec: KVCacheSpec, regions: Any, *, device_id: int = 0,
           agent_metadata: bytes = b"", ipc: IpcInfo | None = None,
           board: BoardInfo | None = None) -> bytes:
    """msgpack bytes describing one rank; ``regions = [(base_address, nbytes), ...]``.

    Raises FkvError on anything :func:`decode_untrusted` would refuse (so a message we send always
    decodes to an equal :class:`Peer`). ``ipc``: how a same-host CUDA process maps the regions
    (one handle and offset per region).

    >>> from fkv import KVCacheSpec
    >>> from fkv.connector.handshake import EngineDesc
    >>> s = KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8, num_layers=2)
    >>> e = EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=1)
    >>> decode_untrusted(encode(e, s, [(4096, s.region_bytes), (8192, s.region_bytes)])).regions
    ((4096, 256), (8192, 256))
    """
    if not isinstance(engine, EngineDesc):
        raise FkvError(f"'engine' must be an EngineDesc (got {type(engine).__name__})")
    if not isinstance(spec, KVCacheSpec):
        raise FkvError(f"'spec' must be a KVCacheSpec (got {type(spec).__name__})")
    if not isinstance(agent_metadata, bytes | bytearray | memoryview):
        raise FkvError(f"'agent_metadata' must be bytes (got {type(agent_metadata).__name__})")
    if ipc is not None and not isinstance(ipc, IpcInfo):
        raise FkvError(f"'ipc' must be an IpcInfo or None (got {type(ipc).__name__})")
    if board is not None and not isinstance(board, BoardInfo):
        raise FkvError(f"'board' must be a BoardInfo or None (got {type(board).__name__})")
    message = _Message(
        version=WIRE_VERSION,
        engine=_Engine(engine_id=engine.engine_id, tp_size=engine.tp_size, tp_rank=engine.tp_rank,
                       total_num_kv_heads=engine.total_num_kv_heads, model=engine.model,
                       model_dtype=engine.model_dtype, protocol=engine.protocol),
        spec=_Spec(backend=spec.backend, layout=spec.layout.value, num_blocks=spec.num_blocks,
                   block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                   head_size=spec.head_size, dtype=spec.dtype, num_layers=spec.num_layers,
                   cross_layer=spec.cross_layer),
        regions=[list(r) for r in _check_regions(spec, regions)],
        device_id=device_id, agent_metadata=bytes(agent_metadata),
        ipc=None if ipc is None else _Ipc(host=ipc.host, device_uuid=ipc.device_uuid,
                                          handles=list(ipc.handles), offsets=list(ipc.offsets),
                                          pid=ipc.pid, events=list(ipc.events)),
        board=None if board is None else _Board(host=board.host, name=board.name,
                                                salt=bytes(board.salt), pid=board.pid))
    data = _ENCODER.encode(message)
    try:  # the limits live in one place: the decoder's types
        decode_untrusted(data)
    except FkvWireError as e:
        raise FkvError(f"encode: the message would be refused by the peer: {e}") from None
    return data


def decode_untrusted(data: Any) -> Peer:
    """Decode peer bytes into a validated :class:`Peer`; raises only FkvWireError, whatever ``data``.

    Checks, in order: type and size (<= MAX_MESSAGE_BYTES), the message version, msgpack
    structure with bounded numbers/strings/lists (unknown fields refused), the engine and spec
    (validated like their constructors), then regions: one per ``spec.num_regions``, each exactly
    ``spec.region_bytes``, inside 64-bit addresses, not overlapping.
    """
    try:
        return _decode(data)
    except FkvWireError:
        raise
    except Exception as e:  # anything unforeseen still comes out as the one error type
        raise FkvWireError(f"peer message refused: {type(e).__name__}: {e}") from None


def _decode(data: Any) -> Peer:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise FkvWireError(f"peer message must be bytes (got {type(data).__name__})")
    if len(data) > MAX_MESSAGE_BYTES:
        raise FkvWireError(f"peer message is {len(data)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    try:
        version = _ENVELOPE.decode(data).version
    except msgspec.ValidationError as e:
        raise FkvWireError(f"peer message has no valid version field: {e}") from None
    except msgspec.DecodeError as e:
        raise FkvWireError(f"peer message is not valid msgpack: {e}") from None
    if version != WIRE_VERSION:
        raise FkvWireError(f"peer speaks wire version {version}; this fkv speaks {WIRE_VERSION}: "
                           f"run the same fkv version on both engines")
    try:
        msg = _DECODER.decode(data)
    except msgspec.ValidationError as e:
        raise FkvWireError(f"peer message is malformed: {e}") from None
    except msgspec.DecodeError as e:
        raise FkvWireError(f"peer message is not valid msgpack: {e}") from None
    try:
        e, s = msg.engine, msg.spec
        engine = EngineDesc(engine_id=e.engine_id, tp_size=e.tp_size, tp_rank=e.tp_rank,
                            total_num_kv_heads=e.total_num_kv_heads, model=e.model,
                            model_dtype=e.model_dtype, protocol=e.protocol)
        spec = KVCacheSpec(backend=s.backend, layout=s.layout, num_blocks=s.num_blocks,
                           block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                           head_size=s.head_size, dtype=s.dtype, num_layers=s.num_layers,
                           cross_layer=s.cross_layer)
        regions = _check_regions(spec, [tuple(r) for r in msg.regions])
        ipc = None if msg.ipc is None else _check_ipc(spec, msg.ipc)
        board = None
        if msg.board is not None:
            if not (msg.board.host.isascii() and msg.board.host.isprintable()):
                raise FkvError(f"'board.host' must be printable ASCII (got "
                               f"{msg.board.host[:64]!r})")
            board = BoardInfo(host=msg.board.host, name=msg.board.name, salt=msg.board.salt,
                              pid=msg.board.pid)
    except FkvError as err:
        raise FkvWireError(f"peer message refused: {err}") from None
    return Peer(engine=engine, spec=spec, regions=regions, device_id=msg.device_id,
                agent_metadata=msg.agent_metadata, ipc=ipc, board=board)


def _check_ipc(spec: KVCacheSpec, ipc: _Ipc) -> IpcInfo:
    """One IPC handle and offset per region; host and UUID printable ASCII."""
    for name in ("handles", "offsets"):
        got = len(getattr(ipc, name))
        if got != spec.num_regions:
            raise FkvError(f"'ipc.{name}' must hold spec.num_regions={spec.num_regions} entries "
                           f"(got {got})")
    for name in ("host", "device_uuid"):
        value = getattr(ipc, name)
        if not (value.isascii() and value.isprintable()):
            raise FkvError(f"'ipc.{name}' must be printable ASCII (got {value[:64]!r})")
    if len(ipc.events) > min(spec.num_layers, MAX_PUBLISH_EVENTS):
        raise FkvError(f"'ipc.events' must hold at most one event per layer (spec.num_layers="
                       f"{spec.num_layers}, at most {MAX_PUBLISH_EVENTS}) (got "
                       f"{len(ipc.events)})")
    return IpcInfo(host=ipc.host, device_uuid=ipc.device_uuid, handles=tuple(ipc.handles),
                   offsets=tuple(ipc.offsets), pid=ipc.pid, events=tuple(ipc.events))
