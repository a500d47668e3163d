"""Packed reads, decode side: ask prefill ranks to pack, READ the packs, scatter them, pipelined.

A request is cut into *chunks* (each pack inside its share of the prefill rank's pack buffer,
each chunk inside one *area* of the local staging buffer; requests larger than
``FKV_PACK_CHUNK_BYTES``, 32 MiB on CUDA, go in chunks of about that size so that they
pipeline). For each chunk the decode rank

1. sends a ``Pack`` to every prefill rank it reads (block ids, that rank's head range it needs,
   token count; see ``_packer``) through one persistent side-channel connection per rank
   (``_side.Dealer``); the rank gathers the chunk into a slot of its pack buffer and replies
   where it lies (a busy buffer answers ``retry``: ask again until the deadline);
2. posts one READ per rank (one descriptor, or ``FKV_PACK_DESCRIPTORS`` equal pieces) of the
   packed bytes into its part of the chunk's staging area; the READ carries the slot's free
   notification, so NIXL frees the slot once the bytes moved;
3. once the chunk's READs are DONE, moves every layer of it into the local cache (one launch of
   the move kernel for all layers with Triton; the torch reference per layer on plain CPU).

A streaming read (``read(..., layers=(a, b))``, once per range of layers the prefill ranks
published) does the same with only those layers: the Packs carry the range, the prefill ranks
gather, and the READs and scatters move, ``(b - a) / num_layers`` of the bytes; a prefill rank
refuses a Pack reaching past what it published. The chunks are cut by tokens as for the whole
request (``FKV_PACK_CHUNK_BYTES`` counts the range's bytes), so they fit the same slots and
staging areas.

Up to ``depth`` chunks (``FKV_PACK_DEPTH``, default 2) are in flight at once: the Packs of the
next chunks go out before the current READ is waited for, the staging buffer holds ``depth``
areas, and each prefill rank's share of its pack buffer holds ``depth`` chunks of this decode
rank. So the prefill gather of chunk i+1, the READ of chunk i and the scatter of chunk i-1
overlap, and a request pays one exposed side-channel round trip (its first chunk's), not one per
chunk. A chunk's Pack goes out once a slot is free (the READ of the chunk ``depth`` before it is
DONE) and its READ once its area is free (that chunk scattered; on CUDA its event completed).

NIXL offers what this builds on, and nothing that replaces it: notifications attached to a READ
(they free the slots), a progress thread (the agent's default: READs move while this thread
scatters), per-post notifications on prepped handles (``transfer(handle, notif)``) and
``make_prepped_xfer`` (index runs over lists prepared once: a pack lands at a different remote
offset each time and is one descriptor, and ``initialize_xfer`` costs a few µs for one, so packed
READs build their one- or few-descriptor lists per READ), and per-transfer telemetry
(``Client(telemetry=True)``). It has no request pipelining of its own.

The request notification (``"<request id>:<decode tp>"``) goes to every prefill rank of the group
after the last chunk (the client sends it). Failures (no pack reply, a refusal, a READ that errs or
outlives the deadline) raise ``TransferFailed`` and nothing is reported done. What can be freed is:
slots packed whose READ was never posted are freed with a notification; a pack still unanswered
is freed when its reply arrives (at the next read or at close), or by its lease on the prefill
side; a READ that did not finish keeps its staging area *quarantined* (NIXL's handle is kept, not
released) until NIXL says it finished, so nothing can land in an area that packed reads use
again (the plan's staging path shares the front of the same buffer and does not consult the
quarantine yet).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from typing import Any

import attrs
import numpy as np

from fkv.connector.transport import _side
from fkv.connector.transport._agent import Xfer
from fkv.connector.transport._base import Tally, TransferFailed, kernels, on_device
from fkv.connector.transport._link import Link, Local, wait_reads
from fkv.connector.transport._packer import (
    ALIGN,
    FREE_PREFIX,
    align,
    layer_table,
    pack_layer_bytes,
    table_from,
    uses_triton,
)
from fkv.errors import FkvError

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_DEPTH", "MAX_DEPTH", "PackedPath", "PackedSizing",
           "packed_sizing"]

_tokens = itertools.count(1)

#: Chunks in flight per request (``FKV_PACK_DEPTH``): 2 lets the gather of chunk i+1, the READ of
#: chunk i and the scatter of chunk i-1 run at once.
DEFAULT_DEPTH = 2
#: Most chunks in flight ``FKV_PACK_DEPTH`` may ask for.
MAX_DEPTH = 4
#: On CUDA, a request larger than this (packed bytes per decode rank, all prefill ranks read
#: together) goes in chunks of about this size, so that it pipelines (``FKV_PACK_CHUNK_BYTES``; 0:
#: chunks as large as the buffers allow, the default on CPU). A chunk pays a pack round trip, a
#: READ post and a launch on the host (two GPUs, 16 and 256 blocks: round trip 1.0-1.2 ms, post
#: 0.11 ms; bench/results/transfer-20261201T101116Z.json's profile); its READ must outlast the next
#: chunk's pack round trip for the link to stay busy at depth 2, and requests up to this size
#: keep one chunk (one round trip, nothing to overlap). On CPU the torch reference's per-call
#: cost and the cores the gather, READ and scatter share make smaller chunks slower (a 256-block
#: request in 4 chunks took longer than in one in a by-hand run on 2 cores, no committed file).
DEFAULT_CHUNK_BYTES = 32 << 20
#: Frames one :meth:`_Dealer.drain` takes at most (replies of the packs in flight are far fewer).
MAX_DRAIN = 4096
#: Replies to abandoned pack requests remembered per prefill rank (their slots are freed when the
#: reply comes).
_MAX_ABANDONED = 4096


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    try:
        value = int(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return min(hi, max(lo, value))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _pieces() -> int:
    """Descriptors per pack READ (``FKV_PACK_DESCRIPTORS``, default 1)."""
    return _env_int("FKV_PACK_DESCRIPTORS", 1, 1, 1 << 16)


def pipeline_depth() -> int:
    """``FKV_PACK_DEPTH``: chunks a packed read keeps in flight (1 to :data:`MAX_DEPTH`)."""
    return _env_int("FKV_PACK_DEPTH", DEFAULT_DEPTH, 1, MAX_DEPTH)


@attrs.frozen
class PackedSizing:
    """How packed reads of one connection are cut: pack bytes per remote block per read (all
    layers), the most tokens one chunk moves, the chunks in flight (``depth``: staging areas here
    and pack slots per prefill rank), the bytes of one staging area and of all of them."""

    per_block: tuple[int, ...]
    chunk_tokens: int
    buffer_bytes: int
    depth: int = 1
    area_bytes: int = 0


def packed_sizing(local: Local, plan: Any, entries: list[Any], rs: Any, depth: int | None = None
                  ) -> tuple[PackedSizing | None, str]:
    """The packed sizing of a connection, or None and the reason packed reads are not possible.

    Every decode rank of the group may hold slots at once, so one rank's share of a prefill
    rank's pack buffer is ``pack_bytes / notifications``; a chunk gets ``1 / depth`` of that share
    and ``1 / depth`` of the staging buffer. When not even one step of tokens fits at ``depth``
    (``FKV_PACK_DEPTH``), the pipeline gets shallower (down to one chunk at a time).
    """
    ls = local.spec
    per_block, shares = [], []
    for read in plan.reads:
        entry = entries[read.remote_rank]
        if not entry.address or not entry.pack_bytes:
            return None, (f"prefill rank {read.remote_rank} serves no pack buffer "
                          f"(serve(..., pack_bytes=0))")
        heads = read.remote_heads[1] - read.remote_heads[0]
        per_block.append(rs.num_layers * pack_layer_bytes(rs, 1, heads))
        shares.append(entry.pack_bytes // plan.notifications)
    step = math.lcm(ls.block_size, rs.block_size)
    want = pipeline_depth() if depth is None else depth
    for d in range(want, 0, -1):
        blocks = min(share // d // ALIGN * ALIGN // b
                     for share, b in zip(shares, per_block, strict=True))
        room = local.staging_bytes_max // d - ALIGN * len(per_block)
        blocks = min(blocks, max(0, room) // sum(per_block))
        tokens = blocks * rs.block_size // step * step
        if tokens:
            break
    else:
        return None, (f"one chunk of {step} tokens needs {step // rs.block_size} remote blocks "
                      f"of {sum(per_block)} packed bytes, more than the prefill ranks' pack "
                      f"buffers ({[e.pack_bytes for e in entries]} bytes, shared by "
                      f"{plan.notifications} decode ranks) or staging_bytes="
                      f"{local.staging_bytes_max} hold")
    # a chunk never needs more than the whole remote cache (rounded to whole steps)
    tokens = min(tokens, -(-rs.num_blocks * rs.block_size // step) * step)
    n = -(-tokens // rs.block_size)
    area = sum(align(n * b) for b in per_block)
    return PackedSizing(tuple(per_block), tokens, d * area, d, area), ""


class _Dealer(_side.Dealer):
    """A pack Dealer for pipelined reads. Several packs of one rank are outstanding at once; the
    base class keeps a reply that comes before the awaited one for its own wait. This one also
    remembers packs a failed read abandoned: their Packed replies (slots nobody will READ) are
    handed back as *orphans* to be freed, and replies to nothing outstanding are dropped (so the
    kept replies never crowd out the ones a read waits for)."""

    def __init__(self, ctx: Any, address: str, curve: Any = None) -> None:
        super().__init__(ctx, address, curve)
        self.outstanding: set[int] = set()
        self.abandoned: dict[int, None] = {}
        self.orphans: list[_side.Packed] = []

    def send(self, msg: Any) -> None:
        super().send(msg)
        self.outstanding.add(msg.token)

    def take(self, token: int, deadline: float, spin: float = 0.0
             ) -> _side.Error | _side.Packed | None:
        """The reply to ``token`` (None at the deadline; the token stays outstanding)."""
        reply = self.wait(token, deadline, spin)
        if reply is not None:
            self.outstanding.discard(token)
        self._sort()
        return reply

    def abandon(self, token: int) -> None:
        """Nobody waits for ``token`` any more: free its slot when its reply comes."""
        self.outstanding.discard(token)
        self.abandoned[token] = None
        while len(self.abandoned) > _MAX_ABANDONED:
            del self.abandoned[next(iter(self.abandoned))]
        self._sort()

    def drain(self) -> None:
        """Take the replies already here without waiting: at most :data:`MAX_DRAIN` frames, so a
        peer that never stops sending cannot keep the caller here (the rest wait for the next
        drain or wait)."""
        for _ in range(MAX_DRAIN):
            if (data := self._recv(0.0)) is None:
                break
            try:
                reply = _side.decode_reply(data)
            except _side.SideChannelError:
                continue  # not ours to answer
            if isinstance(reply, _side.Error | _side.Packed):
                self._replies.append(reply)
        self._sort()

    def _sort(self) -> None:
        kept = []
        for reply in self._replies:
            if reply.token in self.outstanding:
                kept.append(reply)
            elif reply.token in self.abandoned:
                del self.abandoned[reply.token]
                if isinstance(reply, _side.Packed):
                    self.orphans.append(reply)
        self._replies[:] = kept


class _Chunk:
    """One chunk of a request: its ids and tokens, the layers it moves (None: all), the pack
    request per prefill rank read, the replies, the READs posted, and the staging area it lands
    in."""

    __slots__ = ("local", "remote", "tokens", "layers", "sent", "sent_at", "packs", "offsets",
                 "xfers", "area", "expires")

    def __init__(self, local: tuple[int, int], remote: np.ndarray, tokens: int, reads: int,
                 layers: tuple[int, int] | None = None) -> None:
        self.local, self.remote, self.tokens, self.layers = local, remote, tokens, layers
        self.sent: list[int] = [0] * reads         # pack token per read (0: none outstanding)
        self.sent_at: list[float] = [0.0] * reads  # when each pack request went out
        self.expires = math.inf  # the earliest end of its packs' slot reservations
        self.packs: list[_side.Packed | None] = [None] * reads
        self.offsets: list[int] = []
        self.xfers: list[Xfer] = []                # READs posted (read order), until released
        self.area = -1


class PackedPath:
    """Packed reads of one connection: the prefill ranks' pack addresses and buffers, the chunk
    size and pipeline depth, the staging areas (and the quarantined ones), and one side-channel
    connection (``_Dealer``) per prefill rank read."""

    name = "packed"
    notifies_with_read = False  # the request notification goes after the last chunk

    def __init__(self, link: Link, sizing: PackedSizing) -> None:
        self.conn = link
        self.per_block = list(sizing.per_block)
        self.chunk_tokens = sizing.chunk_tokens
        self.buffer_bytes = sizing.buffer_bytes
        self.depth = sizing.depth
        self.area_bytes = sizing.area_bytes or sizing.buffer_bytes
        ls, rs = link.local.spec, link.remote_spec
        self.step = math.lcm(ls.block_size, rs.block_size)
        self.block_bytes = sum(self.per_block)  # packed bytes per remote block, all ranks read
        self.chunk_bytes = _env_int("FKV_PACK_CHUNK_BYTES", DEFAULT_CHUNK_BYTES
                                    if link.local.device.type == "cuda" else 0, 0, 1 << 62)
        self.dealers: dict[int, _Dealer] = {}
        self.spin = link.spin
        self.quarantine: dict[int, list[Xfer]] = {}  # area -> READs NIXL has not finished
        self._events: dict[int, Any] = {}            # area -> CUDA event after its scatter
        self.triton = uses_triton(link.local.device)
        self._ops = kernels(link.local.device)
        self._table = None
        self._tables: dict[int, Any] = {}  # first layer -> the local layer table from it
        #: What the last read did: chunks, depth (chunks in flight allowed), most chunks that were
        #: in flight at once, pack requests asked again (busy buffer), areas quarantined.
        self.last: dict[str, int] = {}
        try:
            if self.triton:
                self._table = layer_table(link.local.views, ls, link.local.device)
            for read in link.plan.reads:
                rank = read.remote_rank
                self.dealers[rank] = _Dealer(link.local.zctx, link.entries[rank].address,
                                             link.local.curve)
        except BaseException:
            self.close()
            raise

    def layered(self) -> bool:
        """Whether a request can move a few layers at a time (streaming): a Pack names the layer
        range it gathers."""
        return True

    def describe(self) -> str:
        conn = self.conn
        ranks = ", ".join(f"P{r.remote_rank} ({b} B per block)"
                          for r, b in zip(conn.plan.reads, self.per_block, strict=True))
        split = (f"; requests over {self.chunk_bytes} bytes go in chunks of about that size"
                 if self.chunk_bytes else "")
        return (f"packed: each prefill rank read gathers the request into its pack buffer, then "
                f"one READ per rank per chunk of up to {self.chunk_tokens} tokens "
                f"({self.chunk_tokens // conn.remote_spec.block_size * self.block_bytes} bytes), "
                f"pipelined {self.depth} chunk(s) deep (pack of the next chunk, READ of this one "
                f"and scatter of the previous one overlap; {self.depth} staging areas of "
                f"{self.area_bytes} bytes){split}: {ranks}")

    # -- one request -------------------------------------------------------------------------------
    def _chunks(self, local: np.ndarray, remote: np.ndarray, tokens: int,
                layers: tuple[int, int] | None = None) -> list[_Chunk]:
        """The request's chunks: at most ``chunk_tokens`` each (whole steps of both block sizes),
        about ``chunk_bytes`` each (of the ``layers`` moved) when the request is larger, all
        about equal."""
        ls, rs = self.conn.local.spec, self.conn.remote_spec
        per = self.chunk_tokens
        if self.chunk_bytes:
            block_bytes = self.block_bytes
            if layers is not None:
                block_bytes = block_bytes * (layers[1] - layers[0]) // rs.num_layers
            want = max(1, self.chunk_bytes * rs.block_size // block_bytes)
            per = min(per, max(self.step, _ceil(want, self.step) * self.step))
        per = _ceil(_ceil(tokens, _ceil(tokens, per)), self.step) * self.step  # equal chunks
        nl, nr, reads = ls.block_size, rs.block_size, len(self.conn.plan.reads)
        out = []
        for start in range(0, tokens, per):
            n = min(per, tokens - start)
            out.append(_Chunk((start // nl, -(-(start + n) // nl)),
                              remote[start // nr: -(-(start + n) // nr)], n, reads, layers))
        return out

    def read(self, request_id: str, local: np.ndarray, remote: np.ndarray, tokens: int,
             deadline: float, tally: Tally, layers: tuple[int, int] | None = None) -> None:
        """Read the request (``layers=(a, b)``: only those layers, a streaming read's published
        range; the caller notifies the prefill ranks once every layer landed)."""
        total = self.conn.remote_spec.num_layers
        if layers is not None:
            a, b = layers
            if not 0 <= a < b <= total:
                raise FkvError(f"PackedPath.read: 'layers' {tuple(layers)} must be a range "
                               f"(a, b) with 0 <= a < b <= {total}")
            if (a, b) == (0, total):
                layers = None  # the whole request: the very Pack a plain read sends
            else:
                layers = (int(a), int(b))
        self.last = {}
        self._reclaim()
        areas = self._areas(deadline)
        chunks = self._chunks(local, remote, tokens, layers)
        depth = min(len(areas), len(chunks))
        stats = {"chunks": len(chunks), "depth": depth, "in_flight": 0, "retries": 0,
                 "quarantined": len(self.quarantine)}
        self.last = stats
        ids = None  # the local ids on the device, made while the first packs are out
        sent = posted = landed = 0
        n = len(chunks)
        try:
            while landed < n:
                while sent < n and sent - landed < depth:  # a slot per chunk in flight
                    self._send(request_id, chunks[sent], deadline)
                    sent += 1
                stats["in_flight"] = max(stats["in_flight"], sent - landed)
                if posted < sent and posted - landed < depth:  # its area is free
                    chunk = chunks[posted]
                    t0 = time.perf_counter()
                    stats["retries"] += self._ask(request_id, chunk, deadline)
                    t1 = time.perf_counter()
                    tally.pack_seconds += t1 - t0
                    chunk.area = areas[posted % depth]
                    self._post(chunk, tally)
                    tally.transfer_seconds += time.perf_counter() - t1
                    posted += 1
                    continue
                chunk = chunks[landed]
                t1 = time.perf_counter()
                self._land(chunk, deadline, tally)
                tally.transfer_seconds += time.perf_counter() - t1
                landed += 1
                while sent < n and sent - landed < depth:  # its slot is free: ask for the next
                    self._send(request_id, chunks[sent], deadline)
                    sent += 1
                if ids is None:
                    ids = self._local_ids(local)
                self._scatter(chunk, ids)
            self._finish()
            self._drain()  # replies to packs abandoned by an earlier read that came meanwhile
        except BaseException as e:
            self._abort(chunks, tally)
            stats["quarantined"] = len(self.quarantine)
            if isinstance(e, _side.SideChannelError):
                raise TransferFailed(str(e)) from e
            raise

    # -- the stages --------------------------------------------------------------------------------
    def _send(self, request_id: str, chunk: _Chunk, deadline: float) -> None:
        """Send the chunk's Pack to every prefill rank read (replies are collected by _ask)."""
        for i, read in enumerate(self.conn.plan.reads):
            chunk.sent_at[i] = time.monotonic()
            chunk.sent[i] = self._send_one(request_id, read, chunk, deadline)

    def _who(self, rank: int) -> str:
        conn = self.conn
        return f"prefill rank {rank} of engine {conn.engine_id!r} ({conn.entries[rank].address})"

    def _lost(self, rank: int, e: Exception) -> TransferFailed:
        return TransferFailed(f"{self._who(rank)}: {e}: the prefill process is dead or "
                              f"unreachable: reconnect once it is back (client.reconnect())")

    def _send_one(self, request_id: str, read: Any, chunk: _Chunk, deadline: float) -> int:
        conn = self.conn
        token = next(_tokens)
        heads = read.remote_heads if not conn.remote_spec.is_mla else (0, 1)
        try:
            self.dealers[read.remote_rank].send(_side.Pack(
                token=token, request_id=request_id, block_ids=chunk.remote.tolist(),
                heads=tuple(heads), num_tokens=chunk.tokens,
                timeout=max(1e-3, deadline - time.monotonic()), layers=chunk.layers))
        except _side.SideChannelError as e:
            raise self._lost(read.remote_rank, e) from None
        return token

    def _ask(self, request_id: str, chunk: _Chunk, deadline: float) -> int:
        """Collect every rank's reply to the chunk's Pack (asking again while a buffer is busy);
        returns how many packs were asked again."""
        conn = self.conn
        retries = 0
        share = self._share(chunk.layers)
        for i, read in enumerate(conn.plan.reads):
            rank = read.remote_rank
            who = self._who(rank)
            nbytes = chunk.remote.size * self.per_block[i] * share[0] // share[1]
            pause = 0.0002
            while True:
                try:
                    reply = self.dealers[rank].take(chunk.sent[i], deadline, self.spin)
                except _side.SideChannelError as e:
                    raise self._lost(rank, e) from None
                if reply is None:
                    raise TransferFailed(f"{who} did not answer the pack request before the "
                                         f"read's timeout: the prefill process is hung, dead or "
                                         f"unreachable: reconnect once it is back "
                                         f"(client.reconnect())")
                chunk.sent[i] = 0
                if isinstance(reply, _side.Packed):
                    chunk.packs[i] = reply  # held: freed by the abort if refused below
                    if reply.expires_in > 0:  # the slot is ours until then, at the least
                        chunk.expires = min(chunk.expires, chunk.sent_at[i] + reply.expires_in)
                    cap = conn.entries[rank].pack_bytes
                    if reply.nbytes != nbytes or reply.offset + reply.nbytes > cap:
                        raise TransferFailed(f"{who} packed {reply.nbytes} bytes at offset "
                                             f"{reply.offset} of its {cap}-byte buffer; expected "
                                             f"{nbytes} bytes inside it")
                    break
                if not isinstance(reply, _side.Error):  # a Layers carrying the pack's token
                    raise TransferFailed(f"{who} answered pack request {reply.token} with a "
                                         f"{type(reply).__name__.lower()!r} reply; expected "
                                         f"'packed' or 'error'")
                if not reply.retry:
                    raise TransferFailed(f"{who}: {reply.message}")
                if time.monotonic() + pause >= deadline:
                    raise TransferFailed(f"{who}: the pack buffer stayed busy until the read's "
                                         f"timeout ({reply.message})")
                time.sleep(pause)
                pause = min(0.005, pause * 2)
                retries += 1
                chunk.sent_at[i] = time.monotonic()
                chunk.sent[i] = self._send_one(request_id, read, chunk, deadline)
        return retries

    def _post(self, chunk: _Chunk, tally: Tally) -> None:
        """Post one READ per rank of the chunk's packs into its staging area (once the area's
        previous scatter finished)."""
        conn = self.conn
        agent, client = conn.local.agent, conn.local
        event = self._events.pop(chunk.area, None)
        if event is not None:
            event.synchronize()
        sizes = [p.nbytes for p in chunk.packs]
        chunk.offsets = np.concatenate(([0], np.cumsum([align(s) for s in sizes])[:-1])).tolist()
        base = conn.staging.data_ptr() + chunk.area * self.area_bytes
        pieces = _pieces()
        for read, pack, off in zip(conn.plan.reads, chunk.packs, chunk.offsets, strict=True):
            rank = read.remote_rank
            entry = conn.entries[rank]
            local_tab, remote_tab = _tables(base + off, entry.pack_base + pack.offset,
                                            pack.nbytes, pieces, client.device_id,
                                            conn.peers[rank].device_id)
            chunk.xfers.append(agent.read_descs(local_tab, client.mem_type, remote_tab,
                                                entry.mem_type, conn.names[rank], pack.nbytes,
                                                FREE_PREFIX + str(pack.slot).encode()))
            tally.descriptors += len(local_tab)

    def _land(self, chunk: _Chunk, deadline: float, tally: Tally) -> None:
        """Wait until the chunk's READs are DONE, then release them (their slots are free)."""
        conn = self.conn
        ranks = [r.remote_rank for r in conn.plan.reads]
        until = min(deadline, chunk.expires)
        try:
            wait_reads(conn.local.agent, chunk.xfers, ranks, conn.engine_id, until, self.spin)
        except TransferFailed as e:
            if until < deadline:  # the slots' reservation ends before the read's timeout
                raise TransferFailed(f"{e} (stopped at the end of the pack slots' reservation, "
                                     f"before the read's timeout: a later READ could find the "
                                     f"slot given to another pack)") from None
            raise
        chunk.expires = math.inf
        tally.bytes += sum(x.nbytes for x in chunk.xfers)
        for x in chunk.xfers:
            conn.local.agent.release(x)
        chunk.xfers = []
        chunk.packs = [None] * len(chunk.packs)  # their READs' notifications freed the slots

    def _share(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        """The fraction of a pack's bytes ``layers`` move: (layers moved, layers in all)."""
        total = self.conn.remote_spec.num_layers
        return (total, total) if layers is None else (layers[1] - layers[0], total)

    def _local_ids(self, local: np.ndarray) -> Any:
        import torch

        device = self.conn.local.device
        with on_device(device, False):
            return torch.as_tensor(local, device=device)

    def _scatter(self, chunk: _Chunk, ids: Any) -> None:
        """Move a landed chunk from its staging area into the local cache: every layer it holds
        (``chunk.layers``, or all) of each rank's part in one launch (Triton), or per layer (the
        torch reference)."""
        import torch

        from fkv.ops.relayout import staging_spec
        from fkv.tensors import torch_dtype

        conn, client = self.conn, self.conn.local
        ls, rs = client.spec, conn.remote_spec
        dtype = torch_dtype(ls.dtype)
        nblocks = chunk.remote.size
        chunk_ids = ids[chunk.local[0]:chunk.local[1]]
        area = chunk.area * self.area_bytes
        first, end = chunk.layers or (0, ls.num_layers)
        with on_device(client.device, False):
            for read, off, per_block in zip(conn.plan.reads, chunk.offsets, self.per_block,
                                            strict=True):
                h = read.local_heads[1] - read.local_heads[0]
                stage = staging_spec(ls, nblocks, num_heads=h, block_size=rs.block_size)
                layer_bytes = nblocks * per_block // ls.num_layers
                start = area + off
                if self.triton:
                    from fkv.ops._move_kernel import launch_move

                    src = conn.staging[start:start + layer_bytes].view(dtype)
                    launch_move(src, stage, None, 0, client.views[0], ls, chunk_ids,
                                0 if ls.is_mla else read.local_heads[0], h, chunk.tokens,
                                layers=(end - first, layer_bytes // ls.itemsize, "table"),
                                tables=(None, table_from(self._table, first, self._tables)))
                    continue
                scatter = self._ops.scatter
                heads = None if ls.is_mla else read.local_heads
                shape = stage.physical_shape
                for layer in range(first, end):
                    view = client.views[layer]
                    at = start + (layer - first) * layer_bytes
                    src = conn.staging[at:at + layer_bytes].view(dtype).view(shape)
                    scatter(src, view, ls, chunk_ids, heads=heads, num_tokens=chunk.tokens,
                            block_size=rs.block_size)
            if client.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                self._events[chunk.area] = event

    def _finish(self) -> None:
        """Wait for the request's scatters (the caller reads the cache next)."""
        device = self.conn.local.device
        if device.type == "cuda":
            self._events.clear()
            with on_device(device):
                return

    # -- failures ----------------------------------------------------------------------------------
    def _abort(self, chunks: list[_Chunk], tally: Tally) -> None:
        """After a failure: free the slots whose READ will never come, abandon unanswered packs
        (freed when their reply arrives), release finished READs and quarantine the areas of
        unfinished ones."""
        conn = self.conn
        agent = conn.local.agent
        for chunk in chunks:
            for i, read in enumerate(conn.plan.reads):
                rank = read.remote_rank
                if chunk.sent[i]:
                    self.dealers[rank].abandon(chunk.sent[i])
                    chunk.sent[i] = 0
                if chunk.packs[i] is not None and i >= len(chunk.xfers):  # no READ posted
                    self._free(rank, chunk.packs[i])
            if chunk.xfers:
                busy = [x for x in chunk.xfers if agent.poll(x) == "PROC"]
                for x in chunk.xfers:
                    if x.state != "PROC":
                        tally.bytes += x.nbytes if x.state == "DONE" else 0
                        agent.release(x)
                if busy:
                    self.quarantine[chunk.area] = self.quarantine.get(chunk.area, []) + busy
                chunk.xfers = []
        self._drain()
        # no scatter of this read writes the cache after it returned; a device error here
        # fails the read anyway
        with contextlib.suppress(Exception):
            self._finish()

    def _free(self, rank: int, pack: _side.Packed) -> None:
        """Free a slot whose READ will never come (best effort: the rank may be gone)."""
        try:
            self.conn.local.agent.notify(self.conn.names[rank],
                                         FREE_PREFIX + str(pack.slot).encode())
        except TransferFailed:
            return

    def _drain(self) -> None:
        """Free the slots of abandoned packs whose replies came meanwhile."""
        for rank, dealer in self.dealers.items():
            try:
                dealer.drain()
            except Exception:  # a broken socket: the lease frees whatever it held
                continue
            while dealer.orphans:
                self._free(rank, dealer.orphans.pop())

    def _reclaim(self) -> None:
        """Before a read: free orphaned slots and give back the areas whose READs finished."""
        self._drain()
        agent = self.conn.local.agent
        for area, xfers in list(self.quarantine.items()):
            if all(agent.poll(x) != "PROC" for x in xfers):
                for x in xfers:
                    agent.release(x)
                del self.quarantine[area]

    def _areas(self, deadline: float) -> list[int]:
        """The staging areas free of unfinished READs; waits (until the deadline) while every
        area is quarantined."""
        pause = 0.0005
        while True:
            free = [a for a in range(self.depth) if a not in self.quarantine]
            if free:
                return free
            if time.monotonic() + pause >= deadline:
                names = {x.remote for xs in self.quarantine.values() for x in xs}
                ranks = sorted(r for r, name in self.conn.names.items() if name in names)
                raise TransferFailed(f"every staging area of packed reads still has a READ in "
                                     f"flight from an earlier failed read (from prefill rank(s) "
                                     f"{ranks} of engine {self.conn.engine_id!r}); nothing was "
                                     f"transferred: wait, or reconnect once the prefill process "
                                     f"is back (client.reconnect())")
            time.sleep(pause)
            pause = min(0.005, pause * 2)
            self._reclaim()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing anyway: leases free what is left
            self._drain()
        agent = self.conn.local.agent
        for xfers in self.quarantine.values():
            for x in xfers:  # NIXL cancels or keeps it (and the staging memory) until close
                agent.release(x)
        self.quarantine.clear()
        for dealer in self.dealers.values():
            dealer.close()
        self.dealers.clear()


def _tables(local: int, remote: int, nbytes: int, pieces: int, local_dev: int, remote_dev: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """``Nx3`` uint64 descriptor tables moving ``nbytes`` from ``remote`` to ``local`` in
    ``pieces`` nearly equal parts (ALIGN-multiples but the last)."""
    part = max(ALIGN, align(-(-nbytes // pieces)))
    starts = np.arange(0, nbytes, part, dtype=np.uint64)
    lengths = np.minimum(np.uint64(part), np.uint64(nbytes) - starts)
    tabs = []
    for base, dev in ((local, local_dev), (remote, remote_dev)):
        t = np.empty((starts.size, 3), dtype=np.uint64)
        t[:, 0] = np.uint64(base) + starts
        t[:, 1] = lengths
        t[:, 2] = dev
        tabs.append(t)
    return tabs[0], tabs[1]
