"""Peer NIXL agent metadata never reaches our agent unchecked.

NIXL's ``add_remote_agent(blob)`` hands the peer's bytes to NIXL's deserializer and then to UCX,
which trusts them: setting the first byte of the UCX worker address to 0xff aborts the process
(``Assertion `*addr_version == UCP_OBJECT_VERSION_V2'``), random byte flips give SIGSEGV, and a
non-UTF-8 agent name raises ``UnicodeDecodeError`` *after* the agent was added. NIXL offers no
validating call (``check_remote_metadata`` only asks whether an agent is already loaded), so fkv
checks a blob in two steps before its own agent sees it:

1. :func:`parse_agent_metadata`, a structural parse of NIXL's serialization (``nixlSerDes``,
   below) with a bound on every length and count: truncations, insertions and most flips give
   :class:`~fkv.errors.FkvError` here, in microseconds; the agent name must be UTF-8. It walks the
   two UCX fields inside as UCX itself parses them (:func:`check_ucx_address`,
   :func:`check_ucx_rkey`): UCX follows their internal lengths without checking the end of the
   buffer and indexes its tables with some of their bytes unchecked, so such a blob would make
   UCX read past it into the heap of the process that loads it; what it finds there differs
   between processes, and a probe child (step 2) surviving it says nothing about ours. Seen: a
   remote key whose memory-type byte was corrupted passed the probe and then killed the decode
   process (SIGSEGV in ``add_remote_agent``).
2. :func:`probe_agent_metadata`, ``add_remote_agent`` of the blob in a short-lived child process
   (``sys.executable -c``, the blob on stdin, a fresh NIXL agent with the UCX backend, killed at
   the timeout): a child that dies, fails or hangs means refuse. The *values* inside the UCX
   fields (transport addresses, keys) can only be judged this way. The child *connects* to the
   peer and prepares descriptors on it, as our agent would.

:func:`check_agent_metadata` runs both and caches verdicts by the blob's SHA-256 (a reconnect to
the same peer re-checks nothing); :func:`add_remote_checked` checks, adds, verifies the name NIXL
returns and removes the agent again if anything after the add fails, so nothing is left added.

The format (nixl 1.5; every field ``<tag><u64 little-endian length><value>|``)::

    nixlSerDes|
    Agent <name> | Conns <u64 count> |  then per backend:  t <backend name> | c <conn info> |
    "" MemSection | nixlSecElms <u64 count> |  then per section:
        bknd <backend> | nixlDList nixlSDList | t <u32 mem type> | n <u64 count> |
        then per descriptor:  "" <u64 addr, u64 len, u64 dev, backend bytes (remote key)> |

>>> parse_agent_metadata(b"nixlSerDes|Agent\\x02" + bytes(7) + b"p0|")
Traceback (most recent call last):
  ...
fkv.errors.FkvError: peer NIXL agent metadata refused (nothing was added): the blob ends at byte 27, where field 'Conns' was expected; it is not NIXL agent metadata of the format this fkv knows (nixl 1.5): check that the peer runs the same fkv and NIXL versions
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import math
import os
import re
import selectors
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import attrs

from fkv.errors import FkvError

__all__ = [
    "MAX_NAME_BYTES", "AgentMetadata", "MetadataProbeTimeout", "Section", "add_remote_checked",
    "check_agent_metadata", "check_agent_metadata_many", "check_each", "decode_peer_str",
    "parse_agent_metadata", "probe_agent_metadata",
]

_HEADER = b"nixlSerDes|"
#: Longest agent name accepted (UTF-8 bytes).
MAX_NAME_BYTES = 1024
_MAX_BACKENDS = 16
_MAX_BACKEND_NAME = 64
_MAX_CONN_INFO = 1 << 16
_MAX_SECTIONS = 64
_MAX_DESCS = 1 << 20
_MAX_DESC_BYTES = 24 + (1 << 16)
_NAME = re.compile(rb"[A-Za-z0-9_]+")
_MEM_TYPES = {0: "DRAM", 1: "VRAM", 2: "BLK", 3: "OBJ", 4: "FILE"}
_FIX = ("it is not NIXL agent metadata of the format this fkv knows (nixl 1.5): check that the "
        "peer runs the same fkv and NIXL versions")


@attrs.frozen
class Section:
    """Registered memory of one backend and memory type: ``descs`` are ``(addr, len, dev)``."""

    backend: str
    mem_type: str
    descs: tuple[tuple[int, int, int], ...]


@attrs.frozen
class AgentMetadata:
    """What a blob announces: the agent's name, its backends (with the size of each one's
    connection info) and its registered memory."""

    name: str
    backends: tuple[tuple[str, int], ...]
    sections: tuple[Section, ...]
    #: ``(offset, length)`` of each backend's connection info inside the blob (for UCX: the
    #: packed UCP worker address, whose first byte carries its version)
    conn_spans: tuple[tuple[int, int], ...] = ()

    def covers(self, base: int, nbytes: int, mem_type: str) -> bool:
        """Whether ``[base, base + nbytes)`` lies inside one registered descriptor."""
        return any(s.mem_type == mem_type and a <= base and base + nbytes <= a + n
                   for s in self.sections for a, n, _ in s.descs)


def _refuse(what: str, fix: str = _FIX) -> FkvError:
    return FkvError(f"peer NIXL agent metadata refused (nothing was added): {what}; {fix}")


def decode_peer_str(field: str, raw: Any, *, max_bytes: int = MAX_NAME_BYTES) -> str:
    """A string a peer sent (bytes or str), as str: UTF-8, at most ``max_bytes``, no control
    characters; FkvError naming ``field`` otherwise (never ``UnicodeDecodeError``).

    >>> decode_peer_str("agent name", b"fkv-decode-1")
    'fkv-decode-1'
    >>> decode_peer_str("agent name", b"\\xff")
    Traceback (most recent call last):
      ...
    fkv.errors.FkvError: 'agent name' must be UTF-8 text from the peer (got b'\\xff'): the peer sent it; nothing was added
    """
    if isinstance(raw, bytes | bytearray | memoryview):
        raw = bytes(raw)
        if len(raw) > max_bytes:
            raise FkvError(f"{field!r} must be at most {max_bytes} bytes (got {len(raw)}): the "
                           f"peer sent it; nothing was added")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FkvError(f"{field!r} must be UTF-8 text from the peer (got {raw[:64]!r}): the "
                           f"peer sent it; nothing was added") from None
    elif isinstance(raw, str):
        text = raw
        if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
            raise FkvError(f"{field!r} must be at most {max_bytes} bytes (got {len(text)} "
                           f"characters): the peer sent it; nothing was added")
    else:
        raise FkvError(f"{field!r} must be text from the peer (got {type(raw).__name__}); "
                       f"nothing was added")
    if not text or any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise FkvError(f"{field!r} must be non-empty printable text (got {text[:64]!r}): the peer "
                       f"sent it; nothing was added")
    return text


# -- 1. the structural parse --------------------------------------------------------------------

class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.blob, self.pos = blob, 0

    def field(self, tag: bytes, lo: int, hi: int) -> bytes:
        """The value of the next field, which must carry ``tag`` and be ``lo..hi`` bytes long."""
        blob, at = self.blob, self.pos
        if blob[at:at + len(tag)] != tag:
            if at + len(tag) > len(blob):
                raise _refuse(f"the blob ends at byte {len(blob)}, where field "
                              f"{tag.decode()!r} was expected")
            raise _refuse(f"byte {at} starts {blob[at:at + 12]!r}, expected field "
                          f"{tag.decode()!r}")
        at += len(tag)
        if at + 8 > len(blob):
            raise _refuse(f"the blob ends at byte {len(blob)} inside the length of "
                          f"{tag.decode()!r}")
        n = int.from_bytes(blob[at:at + 8], "little")
        at += 8
        if not lo <= n <= hi:
            raise _refuse(f"field {tag.decode()!r} at byte {self.pos} says {n} bytes; it must "
                          f"be {lo}..{hi}")
        if at + n + 1 > len(blob):
            raise _refuse(f"field {tag.decode()!r} at byte {self.pos} says {n} bytes but only "
                          f"{max(0, len(blob) - at - 1)} follow")
        if blob[at + n:at + n + 1] != b"|":
            raise _refuse(f"field {tag.decode()!r} at byte {self.pos} is not closed by '|' "
                          f"(found {blob[at + n:at + n + 1]!r})")
        self.pos = at + n + 1
        return blob[at:at + n]

    def count(self, tag: bytes, hi: int, width: int = 8) -> int:
        n = int.from_bytes(self.field(tag, width, width), "little")
        if n > hi:
            raise _refuse(f"field {tag.decode()!r} counts {n}; at most {hi} are accepted")
        return n

    def text(self, tag: bytes, hi: int, what: str) -> str:
        raw = self.field(tag, 1, hi)
        if not _NAME.fullmatch(raw):
            raise _refuse(f"{what} {raw[:32]!r} is not a name of ASCII letters, digits and '_'")
        return raw.decode()


def parse_agent_metadata(blob: Any) -> AgentMetadata:
    """Parse a peer's NIXL agent metadata without handing it to NIXL; FkvError if it is not
    exactly one well-formed blob (see the module docstring for the format).

    >>> import nixl  # doctest: +SKIP
    >>> parse_agent_metadata(my_agent.get_agent_metadata()).name  # doctest: +SKIP
    'fkv-prefill-1234-ab12cd34'
    """
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise _refuse(f"it is a {type(blob).__name__}, not bytes", "this is a bug in the caller")
    blob = bytes(blob)
    if not blob.startswith(_HEADER):
        raise _refuse(f"it starts {blob[:16]!r}, not {_HEADER!r}")
    r = _Reader(blob)
    r.pos = len(_HEADER)
    raw_name = r.field(b"Agent", 1, MAX_NAME_BYTES)
    name = decode_peer_str("agent name", raw_name)
    backends, spans = [], []
    for _ in range(r.count(b"Conns", _MAX_BACKENDS)):
        backend = r.text(b"t", _MAX_BACKEND_NAME, "backend name")
        conn = r.field(b"c", 1, _MAX_CONN_INFO)
        n = len(conn)
        if backend == "UCX":
            check_ucx_address(conn)
        backends.append((backend, n))
        spans.append((r.pos - 1 - n, n))
    if r.field(b"", 10, 10) != b"MemSection":
        raise _refuse(f"no 'MemSection' marker at byte {r.pos}")
    sections = []
    known = {b for b, _ in backends}
    for _ in range(r.count(b"nixlSecElms", _MAX_SECTIONS)):
        backend = r.text(b"bknd", _MAX_BACKEND_NAME, "section backend")
        if backend not in known:
            raise _refuse(f"a memory section names backend {backend!r}, which has no "
                          f"connection info (backends: {sorted(known)})")
        if r.field(b"nixlDList", 10, 10) != b"nixlSDList":
            raise _refuse(f"a memory section of {backend!r} is not a nixlSDList")
        code = r.count(b"t", len(_MEM_TYPES) - 1, width=4)
        descs = []
        for _ in range(r.count(b"n", _MAX_DESCS)):
            raw = r.field(b"", 24, _MAX_DESC_BYTES)
            addr, length, dev = (int.from_bytes(raw[i:i + 8], "little") for i in (0, 8, 16))
            if length == 0 or addr + length > (1 << 64):
                raise _refuse(f"a descriptor of {backend!r} is [{addr:#x}, +{length}), not a "
                              f"non-empty range of the address space")
            if backend == "UCX":
                check_ucx_rkey(raw[24:], _MEM_TYPES[code])
            descs.append((addr, length, dev))
        sections.append(Section(backend, _MEM_TYPES[code], tuple(descs)))
    if r.pos != len(blob):
        raise _refuse(f"{len(blob) - r.pos} unexpected bytes follow the metadata at byte {r.pos}")
    return AgentMetadata(name, tuple(backends), tuple(sections), tuple(spans))


# -- 1b. the UCX fields: bounded walks of what UCX parses without a length --------------------
#
# UCX parses the connection info (a packed UCP worker address: ``ucp_ep_create`` ->
# ``ucp_address_unpack``) and each descriptor's remote key (``ucp_ep_rkey_unpack``, which NIXL
# calls with no length) by following the length bytes and flags inside them, never checking
# the end of the buffer. A corrupted length or flag sends UCX past the bytes NIXL holds, into
# whatever the heap of *that* process holds next; and UCX indexes tables with some bytes
# unchecked: the remote key's memory type picks ``worker->mem_type_ep[]`` when it prices a
# protocol for the key, during ``add_remote_agent``; a corrupted one reads a word past that array,
# NULL in one process and a wild pointer in another. The verdict of the probe child (another
# process) then says nothing about the decode process: such a blob passed it and killed the
# decode worker (SIGSEGV in libucp). So fkv walks both fields exactly as UCX does, and refuses
# any that does not end exactly at its last byte or that carries an index UCX uses unchecked
# (memory type, MD index). Formats: UCX 1.2x
# ``src/ucp/wireup/address.c`` (address v1, UCX's default ``UCX_ADDRESS_VERSION=v1``, and v2;
# not unified mode) and ``src/ucp/core/ucp_rkey.c`` (``ucp_rkey_pack_memh``).

_UCX_MAX_MDS = 64          # UCP_MAX_MDS: an md_map is a u64
_UCX_MAX_RESOURCES = 128   # UCP_MAX_RESOURCES: most transport addresses in a worker address
_UCX_MAX_LANES = 64        # UCP_MAX_LANES: most endpoint addresses of one transport
_UCX_MEMORY_TYPES = 10     # UCS_MEMORY_TYPE_LAST (host, cuda, cuda_managed, rocm, ...)
_UCX_SYS_UNKNOWN = 0xFF    # UCS_SYS_DEVICE_ID_UNKNOWN, also the end of a distance list


class _Walk:
    """A cursor over one UCX field that refuses to step past its end."""

    def __init__(self, raw: bytes, what: str) -> None:
        self.raw, self.pos, self.what = raw, 0, what

    def refuse(self, why: str) -> FkvError:
        return _refuse(f"the peer's {self.what} ({len(self.raw)} bytes) {why}")

    def take(self, n: int, field: str) -> bytes:
        if self.pos + n > len(self.raw):
            raise self.refuse(f"ends inside its {field} (byte {self.pos}, {n} bytes needed)")
        self.pos += n
        return self.raw[self.pos - n:self.pos]

    def byte(self, field: str) -> int:
        return self.take(1, field)[0]

    def extended(self, first: int, mask: int, v2: bool, field: str) -> int:
        """A value packed in ``first & mask``; in address v2 ``mask`` itself means "the next
        byte holds it" (``ucp_address_unpack_byte_extended``)."""
        value = first & mask
        return self.byte(field) if v2 and value == mask else value

    def end(self) -> None:
        if self.pos != len(self.raw):
            raise self.refuse(f"ends at byte {self.pos} by its own lengths; "
                              f"{len(self.raw) - self.pos} bytes are left over")


def check_ucx_address(raw: bytes) -> None:
    """FkvError unless ``raw`` is a UCP worker address (v1 or v2) that UCX parses exactly to its
    last byte, with every MD index inside UCX's tables. Not walked when this process
    runs UCX in unified mode (``UCX_UNIFIED_MODE=y``: addresses without lengths).

    >>> check_ucx_address(bytes([0x20]) + bytes(8) + bytes([0xFF]))  # v1, uuid, no transport
    >>> check_ucx_address(bytes([0xFF]))
    Traceback (most recent call last):
      ...
    fkv.errors.FkvError: peer NIXL agent metadata refused (nothing was added): the peer's UCX worker address (1 bytes) has version 15 in its first byte (UCX knows 0 and 1); it is not NIXL agent metadata of the format this fkv knows (nixl 1.5): check that the peer runs the same fkv and NIXL versions
    """
    if os.environ.get("UCX_UNIFIED_MODE", "n").lower() in ("y", "yes", "on", "1", "true"):
        return  # unified mode packs no lengths (both sides' resources alike): the probe judges it
    w = _Walk(raw, "UCX worker address")
    head = w.byte("header")
    version = head & 0x0F
    if version not in (0, 1):
        raise w.refuse(f"has version {version} in its first byte (UCX knows 0 and 1)")
    v2 = version == 1
    flags = w.byte("flags") if v2 else head >> 4
    if flags & ~0x0F:
        raise w.refuse(f"has unknown header flags {flags:#x}")
    if not v2 or flags & 0x02:           # the worker's uuid (always there in v1)
        w.take(8, "worker uuid")
    if flags & 0x04:                     # client id
        w.take(8, "client id")
    if flags & 0x01:                     # debug info: the worker's name
        w.take(w.byte("worker name length"), "worker name")
    if w.raw[w.pos:w.pos + 1] == b"\xff":  # no transport at all
        w.pos += 1
        return w.end()
    addresses = devices = 0
    last_device = False
    while not last_device:
        devices += 1
        if devices > _UCX_MAX_RESOURCES:
            raise w.refuse(f"lists more than {_UCX_MAX_RESOURCES} devices")
        md = w.byte("MD index")
        empty = bool(md & 0x80)
        md_index = w.extended(md, 0x7F, v2, "MD index")
        dev = w.byte("device address length")
        last_device = bool(dev & 0x80)
        length = w.extended(dev, 0x1F, v2, "device address length")
        if dev & 0x40 and w.byte("device path count") == 0:
            raise w.refuse("gives a device 0 paths")
        if dev & 0x20:
            w.byte("system device")
        if not empty and md_index >= _UCX_MAX_MDS:
            raise w.refuse(f"names MD {md_index} (UCX has at most {_UCX_MAX_MDS})")
        w.take(length, "device address")
        last_iface = empty
        while not last_iface:
            addresses += 1
            if addresses > _UCX_MAX_RESOURCES:
                raise w.refuse(f"lists more than {_UCX_MAX_RESOURCES} transport addresses")
            w.take(2, "transport name checksum")
            if v2:
                w.take(8, "interface attributes")
            else:  # overhead, bandwidth, latency overhead (float32), priority and flags
                attrs = struct.unpack("<3f", w.take(12, "interface attributes"))
                w.take(4, "interface flags")
                if not all(math.isfinite(x) for x in attrs) or attrs[1] == 0:
                    raise w.refuse(f"announces interface attributes {attrs} (finite numbers "
                                   f"and a bandwidth other than 0 expected)")
            iface = w.byte("interface address length")
            last_iface = bool(iface & 0x80)
            more_eps = bool(iface & 0x40)
            w.take(w.extended(iface, 0x3F, v2, "interface address length"),
                   "interface address")
            eps = 0
            while more_eps:
                eps += 1
                if eps > _UCX_MAX_LANES:
                    raise w.refuse(f"lists more than {_UCX_MAX_LANES} endpoint addresses")
                w.take(w.byte("endpoint address length"), "endpoint address")
                more_eps = not w.byte("lane index") & 0x80
    w.end()


def check_ucx_rkey(raw: bytes, mem_type: str) -> None:
    """FkvError unless ``raw`` is a packed UCP remote key that UCX parses exactly to its last
    byte, of a memory type UCX knows and that matches the section's (host memory for DRAM).

    >>> check_ucx_rkey(bytes.fromhex("0100000000000000" "00" "00" "ff"), "DRAM")  # md 0, host
    >>> check_ucx_rkey(bytes.fromhex("0100000000000000" "00" "04" "ff"), "DRAM")
    Traceback (most recent call last):
      ...
    fkv.errors.FkvError: peer NIXL agent metadata refused (nothing was added): the peer's UCX remote key of a DRAM descriptor (11 bytes) ends inside its remote key of MD 0 (byte 10, 4 bytes needed); it is not NIXL agent metadata of the format this fkv knows (nixl 1.5): check that the peer runs the same fkv and NIXL versions
    """
    w = _Walk(raw, f"UCX remote key of a {mem_type} descriptor")
    md_map = int.from_bytes(w.take(8, "MD map"), "little")
    kind = w.byte("memory type")
    if kind >= _UCX_MEMORY_TYPES or (kind == 0) != (mem_type == "DRAM"):
        raise w.refuse(f"says UCX memory type {kind} (a {mem_type} descriptor: "
                       f"{'0, host' if mem_type == 'DRAM' else f'1..{_UCX_MEMORY_TYPES - 1}'})")
    for md in range(_UCX_MAX_MDS):
        if md_map >> md & 1:
            w.take(w.byte(f"key size of MD {md}"), f"remote key of MD {md}")
    if md_map:
        # the memory's system device; a known one is followed by distances (system device,
        # latency, bandwidth), which UCX reads up to an 0xff terminator, whatever the length
        if w.byte("system device") != _UCX_SYS_UNKNOWN:
            while w.byte("distance list (no 0xff terminator)") != _UCX_SYS_UNKNOWN:
                w.take(2, "distance")
    w.end()


# -- 2. the probe ------------------------------------------------------------------------------

class MetadataProbeTimeout(FkvError):
    """The probe child did not finish in time: nothing is known about the blob (not cached).
    ``verdicts`` holds those of the blobs probed before the time ran out."""

    verdicts: tuple[str | None, ...] = ()


# The child: its own NIXL agent (UCX backend, a progress thread sleeping on UCX events, as a GPU
# decode agent runs); per blob, on stdin: u64 length, the blob, u64 length, the agent name our
# parse read from it, u64 length, the peer's registered descriptors (it loads the blob, prepares
# descriptor lists on them as a decode rank would, then removes it). One line per blob on a private
# copy of stdout ("T" before, "A" or "E msg" after); anything NIXL or UCX print goes to stderr.
# After a refusal it removes what NIXL kept of the agent (NIXL keeps the connection info of a blob
# whose memory section failed) and stops: the next blob gets a fresh child, so no verdict depends
# on what an earlier blob left behind.
_CHILD = r"""
import contextlib, os, sys, importlib, uuid, time
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
B = importlib.import_module(sys.argv[1] + "._bindings")
cfg = B.nixlAgentConfig()
cfg.useProgThread = True   # as a GPU decode agent runs: its progress thread touches the peer too
cfg.pthrDelay = 1000       # ... sleeping on UCX's events (fkv's agents; 0 would busy-poll a core)
cfg.useListenThread = False
agent = B.nixlAgent("fkv-probe-" + uuid.uuid4().hex, cfg)
agent.createBackend("UCX", {})
SEGS = {0: B.DRAM_SEG, 1: B.VRAM_SEG}
out.write("R\n")
inp = sys.stdin.buffer
def take():
    head = inp.read(8)
    return inp.read(int.from_bytes(head, "little")) if len(head) == 8 else None
def sections(raw):
    # per section: u8 memory type, u32 count, count x (u64 addr, u64 len, u64 dev)
    i, out_ = 0, []
    while i < len(raw):
        mem, n = raw[i], int.from_bytes(raw[i + 1:i + 5], "little")
        i += 5
        descs = [tuple(int.from_bytes(raw[i + 24 * k + 8 * j:i + 24 * k + 8 * j + 8], "little")
                       for j in range(3)) for k in range(n)]
        i += 24 * n
        out_.append((mem, descs))
    return out_
while True:
    blob, name, secs = take(), take(), take()
    if blob is None or name is None or secs is None:
        break
    out.write("T\n")
    try:
        got = agent.loadRemoteMD(blob)
        time.sleep(0.002)
        # what a decode rank does next: prepare descriptor lists on the peer's memory
        for mem, descs in sections(secs):
            if mem in SEGS and descs:
                agent.releasedDlistH(agent.prepXferDlist(got, B.nixlXferDList(SEGS[mem], descs),
                                                         []))
        time.sleep(0.002)
    except Exception as e:
        # best effort: the failure itself is what this probe reports
        with contextlib.suppress(Exception):
            agent.invalidateRemoteMD(name)
        time.sleep(0.002)
        out.write(f"E {type(e).__name__}: {str(e)[:200]!r}\n")
        break
    # best effort: the probe accepted the metadata whether or not NIXL forgets it cleanly
    with contextlib.suppress(Exception):
        agent.invalidateRemoteMD(got)
    time.sleep(0.002)
    out.write("A\n")
# the parent is done (stdin closed): stay a moment for the peers' UCX connections back to this
# agent, started by the loads above, then leave without tearing anything down
time.sleep(float(sys.argv[2]))
os._exit(0)
"""

#: Seconds a probe child that loaded metadata stays after the parent is done with it: the peer's
#: UCX worker answers the load by connecting back to the child's agent, and a child killed before
#: that connection is accepted made the PEER print ``UCX ERROR connect(...) failed: Connection
#: refused`` to its stdout (a prefill process, once per decode connect: 7 of 16 connects on this
#: host); the parent does not wait for it.
_LINGER = 0.5
#: A lingering child still there this long after its linger ended is killed by the next probe.
_GRACE = 5.0
#: Probe children past their verdicts, with when their linger ends: reaped by later probes.
_LINGERING: list[tuple[Any, float]] = []
_LINGER_LOCK = threading.Lock()


#: Most descriptors of one section the probe prepares (a decode rank prepares its own subset).
_PROBE_DESCS = 4096
_MEM_CODES = {"DRAM": 0, "VRAM": 1}


def _encode_sections(meta: Any) -> bytes:
    """The peer's registered descriptors for the probe child to prepare (see ``_CHILD``)."""
    out = bytearray()
    for section in meta.sections:
        if section.mem_type not in _MEM_CODES:
            continue
        descs = section.descs[:_PROBE_DESCS]
        out += bytes([_MEM_CODES[section.mem_type]]) + len(descs).to_bytes(4, "little")
        for desc in descs:
            for value in desc:
                out += int(value).to_bytes(8, "little")
    return bytes(out)


def _encode_prep(mem_type: str, table: Any) -> bytes:
    """One section of descriptors (an ``Nx3`` table's first :data:`_PROBE_DESCS` rows) for the
    probe child, in the format of :func:`_encode_sections`."""
    import numpy as np

    rows = np.asarray(table, dtype=np.uint64).reshape(-1, 3)[:_PROBE_DESCS]
    if mem_type not in _MEM_CODES:
        return b""
    return (bytes([_MEM_CODES[mem_type]]) + len(rows).to_bytes(4, "little")
            + rows.astype("<u8").tobytes())


def _backend_package() -> str:
    """The NIXL wheel package the parent uses (``nixl_cu12``, ``nixl_cu13``...), so the child
    imports its bindings directly: no torch import, the same build."""
    mod = sys.modules.get("nixl._api")
    if mod is not None and getattr(mod, "__name__", "").endswith("._api"):
        return mod.__name__.rsplit(".", 1)[0]
    from fkv.connector.transport._base import load_nixl

    return load_nixl()._api.__name__.rsplit(".", 1)[0]


def probe_agent_metadata(blobs: list[bytes], *, timeout: float,
                         preps: list[bytes | None] | None = None) -> list[str | None]:
    """Add each blob to a NIXL agent in a child process, in order; one entry per blob: None
    (added and removed again), or why it was refused (the child died or NIXL refused it). A
    child serves blobs until one is refused or kills it; the rest go to a fresh child (started
    ahead while more than one blob is left, so a refusal costs little). Blobs must parse
    (:func:`parse_agent_metadata`). Raises :class:`MetadataProbeTimeout` when ``timeout``
    seconds (the whole call) run out; when it returns or raises every child is gone, except those
    that accepted a blob: they leave by themselves :data:`_LINGER` seconds later.

    >>> probe_agent_metadata([b"garbage"], timeout=30)  # doctest: +SKIP
    ["NIXL refused it: nixlBackendError: 'NIXL_ERR_...'"]
    """
    deadline = time.monotonic() + timeout
    package = _backend_package()
    verdicts: list[str | None] = []
    child = spare = None
    try:
        while len(verdicts) < len(blobs):
            i = len(verdicts)
            if child is None:
                child, spare = spare or _Child(package), None
            if spare is None and len(blobs) - i > 1:
                spare = _Child(package)
            try:
                why, alive = child.probe(i, blobs[i], deadline, len(blobs),
                                         None if preps is None else preps[i])
            except MetadataProbeTimeout as e:
                e.verdicts = tuple(verdicts)
                raise
            verdicts.append(why)
            if not alive:
                child.close()
                child = None
        return verdicts
    finally:
        for c in (child, spare):
            if c is not None:
                c.close()


class _Child:
    """One probe process (see ``_CHILD``): started at once, used in lockstep, killed at close."""

    def __init__(self, package: str) -> None:
        self.err = tempfile.TemporaryFile()
        _reap()
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, package, str(_LINGER)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, close_fds=True)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.buf = b""
        self.ready = False
        self.loaded = False  # it accepted a blob, and waits: peers may be connecting back to it

    def line(self, deadline: float, what: str) -> str | None:
        """The child's next line (None: it exited); MetadataProbeTimeout at the deadline."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                raise MetadataProbeTimeout(
                    f"peer NIXL agent metadata not checked: the probe process did not finish "
                    f"within the timeout ({what}); nothing was added: retry with a longer "
                    f"timeout")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        text, self.buf = self.buf.split(b"\n", 1)
        return text.decode("utf-8", "replace")

    def probe(self, i: int, blob: bytes, deadline: float, n: int, prep: bytes | None = None
              ) -> tuple[str | None, bool]:
        """``(verdict, child still usable)`` for blob ``i`` of ``n``."""
        what = f"blob {i + 1} of {n}"
        if not self.ready:
            if self.line(deadline, f"starting a NIXL agent for {what}") != "R":
                raise FkvError(f"the NIXL metadata probe could not start a NIXL agent with the "
                               f"UCX backend: {self.tail()}")
            self.ready = True
        meta = parse_agent_metadata(blob)
        name = meta.name.encode()
        secs = _encode_sections(meta) if prep is None else prep
        self.loaded = False  # busy with this blob until it answers: killed if closed now
        with contextlib.suppress(BrokenPipeError):  # it died; reading says so
            self.proc.stdin.write(len(blob).to_bytes(8, "little") + blob
                                  + len(name).to_bytes(8, "little") + name
                                  + len(secs).to_bytes(8, "little") + secs)
            self.proc.stdin.flush()
        got = self.line(deadline, what)
        if got == "T":
            got = self.line(deadline, what)
        if got is None:
            return f"it kills the process that adds it ({self.tail()})", False
        if got == "A":
            self.loaded = True
            return None, True
        if got.startswith("E "):
            return f"NIXL refused it: {got[2:][:240]}", False
        raise FkvError(f"the NIXL metadata probe answered {got[:80]!r}")

    def tail(self) -> str:
        """How the child ended and the last line it wrote to stderr."""
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        code = self.proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        self.err.seek(0, os.SEEK_END)
        self.err.seek(max(0, self.err.tell() - 4096))
        lines = [x for x in self.err.read().decode("utf-8", "replace").splitlines() if x.strip()]
        return how + (f": {lines[-1].strip()[:200]}" if lines else "")

    def close(self) -> None:
        """Kill the child, or, when it loaded metadata and is still alive, close its input and let
        it leave by itself after :data:`_LINGER` seconds (reaped by a later probe)."""
        self.sel.close()
        lingers = self.loaded and self.proc.poll() is None
        for f in (self.proc.stdin, self.proc.stdout, self.err):
            try:
                f.close()
            except OSError:
                continue
        if lingers:
            with _LINGER_LOCK:
                _LINGERING.append((self.proc, time.monotonic() + _LINGER))
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@atexit.register
def _reap_at_exit() -> None:
    """Wait for the lingering probe children (at most their linger) rather than leave them
    running unreaped: a script that exits right after connecting waits up to :data:`_LINGER`."""
    with _LINGER_LOCK:
        for proc, until in _LINGERING:
            try:
                proc.wait(timeout=max(0.0, until - time.monotonic()) + 0.5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _LINGERING.clear()


def _reap() -> None:
    """Collect the lingering probe children that left; kill those still there :data:`_GRACE`
    seconds after their linger ended."""
    now = time.monotonic()
    with _LINGER_LOCK:
        for entry in list(_LINGERING):
            proc, until = entry
            if proc.poll() is None and now < until + _GRACE:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            _LINGERING.remove(entry)


# -- both, cached ---------------------------------------------------------------------------------

_CACHE: collections.OrderedDict[bytes, AgentMetadata | str] = collections.OrderedDict()
_CACHE_SIZE = 1024
_LOCK = threading.Lock()


def check_agent_metadata(blob: Any, *, timeout: float) -> AgentMetadata:
    """Parse ``blob`` and probe it in a child process (verdicts cached by SHA-256); FkvError
    saying what was wrong, that the peer sent it and that nothing was added.

    >>> check_agent_metadata(peer_blob, timeout=10).name  # doctest: +SKIP
    'fkv-prefill-1234-ab12cd34'
    """
    return check_agent_metadata_many([blob], timeout=timeout)[0]


def check_agent_metadata_many(blobs: list[Any], *, timeout: float) -> list[AgentMetadata]:
    """:func:`check_agent_metadata` of several blobs (e.g. every prefill rank's) in one probe
    process: the cost of starting one is paid once. FkvError at the first refused blob."""
    verdicts = check_each(blobs, timeout=timeout)
    for i, v in enumerate(verdicts):
        if isinstance(v, FkvError):
            raise FkvError(f"blob {i} of {len(blobs)}: {v}") if len(blobs) > 1 else v
    return verdicts  # type: ignore[return-value]


def check_each(blobs: list[Any], *, timeout: float,
               preps: list[Any] | None = None) -> list[AgentMetadata | FkvError]:
    """One verdict per blob: its :class:`AgentMetadata`, or the FkvError refusing it (a
    :class:`MetadataProbeTimeout` for blobs the probe could not finish in time: not cached).

    ``preps[i]``: ``(mem_type, Nx3 table)`` of the descriptors the caller will prepare on blob
    ``i``'s peer (the probe prepares the same ones, at most :data:`_PROBE_DESCS`); default: the
    descriptors the blob itself registers."""
    out: list[AgentMetadata | FkvError | None] = [None] * len(blobs)
    todo: dict[bytes, list[int]] = {}
    parsed: dict[bytes, AgentMetadata] = {}
    extras: dict[bytes, bytes] = {}
    for i, blob in enumerate(blobs):
        try:
            meta = parse_agent_metadata(blob)
        except FkvError as e:
            out[i] = e
            continue
        extra = b"" if preps is None or preps[i] is None else _encode_prep(*preps[i])
        key = hashlib.sha256(bytes(blob) + b"|" + extra).digest()
        extras[key] = extra
        with _LOCK:
            known = _CACHE.get(key)
            if known is not None:
                _CACHE.move_to_end(key)
        if known is not None:
            out[i] = known if isinstance(known, AgentMetadata) else _refuse(known, _PROBE_FIX)
        else:
            todo.setdefault(key, []).append(i)
            parsed[key] = meta
    if todo:
        keys = list(todo)
        try:
            verdicts = probe_agent_metadata([bytes(blobs[todo[k][0]]) for k in keys],
                                            timeout=timeout,
                                            preps=[extras[k] or None for k in keys])
        except MetadataProbeTimeout as e:  # keep what was probed; the rest is not known
            verdicts = [*e.verdicts, *[e] * (len(keys) - len(e.verdicts))]
        with _LOCK:
            for key, why in zip(keys, verdicts, strict=True):
                if not isinstance(why, FkvError):
                    _CACHE[key] = parsed[key] if why is None else why
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        for key, why in zip(keys, verdicts, strict=True):
            for i in todo[key]:
                out[i] = (why if isinstance(why, FkvError) else parsed[key] if why is None
                          else _refuse(why, _PROBE_FIX))
    return out  # type: ignore[return-value]


_PROBE_FIX = ("the peer sent it; NIXL would have been handed bytes it cannot take: check the "
              "peer's fkv and NIXL versions and that it is the engine you meant to reach")


def add_remote_checked(agent: Any, blob: Any, *, timeout: float, prep: Any = None) -> str:
    """Check ``blob`` (:func:`check_agent_metadata`), add it to ``agent`` (a ``nixl_agent``) and
    return the remote agent's name; if NIXL refuses it or names it otherwise than the blob did,
    the agent is removed again and FkvError raised: nothing is left added. ``prep``: the
    ``(mem_type, Nx3 table)`` the caller will prepare on the peer, as given to
    :func:`check_each` (the same verdict, from the cache when that checked it already).

    >>> add_remote_checked(my_nixl_agent, peer_blob, timeout=10)  # doctest: +SKIP
    'fkv-prefill-1234-ab12cd34'
    """
    (meta,) = check_each([blob], timeout=timeout, preps=None if prep is None else [prep])
    if isinstance(meta, FkvError):
        raise meta
    if agent.check_remote_metadata(meta.name):
        raise FkvError(f"the peer's agent {meta.name!r} is already added to this agent; nothing "
                       f"was added: remove it first (a reconnect removes the old connection's "
                       f"peers before adding)")
    try:
        raw = agent.add_remote_agent(bytes(blob))
    except Exception as e:  # NIXL may keep the connection info of a blob it refused: drop it
        _remove(agent, meta.name)
        raise FkvError(f"NIXL refused the peer's agent metadata ({type(e).__name__}: {e}); "
                       f"nothing was added: is the peer {meta.name!r} still running?") from None
    try:
        name = decode_peer_str("agent name", raw)
        if name != meta.name:
            raise FkvError(f"NIXL added the peer as {name!r} but its metadata says {meta.name!r}; "
                           f"nothing was added")
    except FkvError:
        _remove(agent, raw if isinstance(raw, bytes | str) else meta.name)
        _remove(agent, meta.name)
        raise
    return name


def _remove(agent: Any, name: Any) -> None:
    try:
        agent.remove_remote_agent(name)
    except Exception:  # not added (refused before), or already gone
        return


def _clear_cache() -> None:
    """Forget every verdict (tests)."""
    with _LOCK:
        _CACHE.clear()
