"""Packed reads, prefill side: the pack buffer, its slots, and gathering a request into it.

A packed read turns one request into one large descriptor per prefill rank instead of thousands
of small ones (NIXL/UCX pays tens of µs per descriptor on a GPU). The decode rank sends a
:class:`fkv.connector.transport._side.Pack` (block ids, the head range it needs, token count); the prefill
rank's server thread checks it, reserves a *slot* of its registered pack buffer, gathers the
layers asked (``Pack.layers``: a range, or every layer) into the slot and replies
:class:`~fkv.connector.transport._side.Packed`. A streaming request's pack may only ask layers
the rank has published (the server passes its published count to :meth:`Packer.pack`). With
Triton (CUDA, or the CPU interpreter) the gather is one launch of the move kernel for all those
layers (the cache layers' addresses from a table made once, the pack's layers a fixed stride
apart); plain CPU runs the torch reference per layer. On CUDA the gather is asynchronous:
:meth:`Packer.sync` waits for one slot's gather (a CUDA event recorded after it), so the server
replies to each pack as soon as its own bytes are ready while the gathers queued behind it keep
the device busy.
The decode rank READs the slot and attaches the notification :data:`FREE_PREFIX` ``+ slot`` to
that READ: NIXL delivers it once the bytes moved, and the slot is free again. Slot ids are random
63-bit numbers, not a count: any NIXL agent that can reach this rank can send a notification, and
one that could guess the next slot id could free a slot another reader is about to READ (and
have the next pack's bytes land there); the id travels only in the requester's
:class:`~fkv.connector.transport._side.Packed` reply. A slot whose READ
never comes (decode died, READ failed) is freed when its lease runs out: the pack request's
``timeout`` (capped by the server's lease) plus :data:`SLOT_GRACE` seconds. The reply states that
reservation (``Packed.expires_in``, without the grace) and the decode side stops waiting for the
READ by then, counted from when it sent the request: a slot is never reused under a READ the
decoder still waits for, even when the read's timeout is longer than the lease.

One pack of layers ``[a, b)`` (every layer: ``a = 0, b = num_layers``) is ``nbytes = (b - a) *
layer_bytes``: layer ``a + l`` at byte ``l * layer_bytes`` is a contiguous ``[n, 2, h, N, D]``
(MLA ``[n, N, D]``) tensor, ``n = ceil(num_tokens / N)`` staging blocks of the prefill block size
``N``, ``h`` the heads asked for (:func:`pack_layer_bytes`).

>>> from fkv import KVCacheSpec
>>> pack_layer_bytes(KVCacheSpec(num_blocks=8, block_size=16, num_kv_heads=8, head_size=128), 3, 4)
98304
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

import numpy as np

from fkv.connector.transport import _side
from fkv.connector.transport._base import kernels, on_device
from fkv.layout import KVCacheSpec

__all__ = ["ALIGN", "FREE_PREFIX", "Packer", "SLOT_GRACE", "align", "layer_table",
           "pack_layer_bytes", "table_from", "uses_triton"]

#: NIXL notification that frees a pack slot (the slot id follows). Not UTF-8, so never a request id.
FREE_PREFIX = b"\xfffkv-free:"
#: Byte alignment of slots and of the per-rank areas of the decode staging buffer.
ALIGN = 256
#: Seconds a slot outlives the pack request's own timeout before the server reclaims it.
SLOT_GRACE = 10.0


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack_layer_bytes(spec: KVCacheSpec, num_blocks: int, num_heads: int) -> int:
    """Bytes of one layer of a pack: ``num_blocks`` staging blocks of ``num_heads`` heads."""
    per_token = (1 if spec.is_mla else 2 * num_heads) * spec.head_size * spec.itemsize
    return num_blocks * spec.block_size * per_token


def uses_triton(device: Any) -> bool:
    """Whether ``device``'s moves run the Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``;
    as :func:`fkv.connector.transport._base.kernels` picks) rather than the torch reference."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def layer_table(views: list[Any], spec: KVCacheSpec, device: Any) -> Any:
    """The int64 element offsets of every layer view from layer 0 (on ``device``): the move
    kernel's ``"table"`` layer mode (``fkv.ops._move_kernel.launch_move``)."""
    import torch

    base, item = views[0].data_ptr(), spec.itemsize
    return torch.tensor([(v.data_ptr() - base) // item for v in views], dtype=torch.int64,
                        device=device)


def table_from(table: Any, start: int, cache: dict[int, Any]) -> Any:
    """``table[start:]`` (the move kernel's layer table of layers ``start, start + 1, ...``, still
    offsets from layer 0) as its own tensor, made once per ``start`` and kept in ``cache``: a
    fresh allocation keeps the table pointer aligned as the whole table's is, so a layer range
    launches the kernel variants a whole request already compiled."""
    if start == 0:
        return table
    out = cache.get(start)
    if out is None:
        out = cache[start] = table[start:].clone()
    return out


class _Slots:
    """First-fit reservations ``[offset, offset + size)`` of a buffer of ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[int, tuple[int, int, float]] = {}  # slot -> (offset, size, deadline)

    def allocate(self, nbytes: int, deadline: float) -> tuple[int, int] | None:
        size = align(nbytes)
        start = 0
        for lo, hi in sorted((o, o + s) for o, s, _ in self.held.values()):
            if lo - start >= size:
                break
            start = max(start, hi)
        if self.capacity - start < size:
            return None
        slot = secrets.randbits(63)  # unguessable: a free must name a slot it was given
        while slot in self.held:
            slot = secrets.randbits(63)
        self.held[slot] = (start, size, deadline)
        return slot, start

    def used(self) -> int:
        return sum(s for _, s, _ in self.held.values())

    def expire(self, now: float) -> int:
        gone = [slot for slot, (_, _, deadline) in self.held.items() if deadline <= now]
        for slot in gone:
            del self.held[slot]
        return len(gone)


class Packer:
    """One prefill rank's pack buffer (registered with the rank's NIXL agent at start-up) and
    the slots reserved in it. Called only from the server's thread."""

    def __init__(self, spec: KVCacheSpec, views: list[Any], device: Any, nbytes: int,
                 agent: Any, mem_type: str, device_id: int) -> None:
        import torch

        self.spec, self.views, self.device = spec, views, device
        self.capacity = align(nbytes)
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        agent.register([(self.buffer.data_ptr(), self.capacity)], mem_type, device_id)
        self.slots = _Slots(self.capacity)
        self._ops = kernels(device)
        self._triton = uses_triton(device)
        self._table = layer_table(views, spec, device) if self._triton else None
        self._tables: dict[int, Any] = {}  # first layer -> the layer table from it
        self._events: dict[int, Any] = {}  # slot -> CUDA event recorded after its gather

    @property
    def asynchronous(self) -> bool:
        """Whether a gather may still run after :meth:`pack` returned (CUDA)."""
        return self.device.type == "cuda"

    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    # -- requests ----------------------------------------------------------------------------------
    def pack(self, msg: _side.Pack, lease: float, sync: bool = True, *,
             published: int | None = None, held: bool = True) -> _side.Packed | _side.Error:
        """Check ``msg``, reserve a slot and gather its layers into it; ``sync``: wait for the
        device too (else the caller calls :meth:`sync` before it replies).

        ``published``: layers of ``msg``'s request readers may read now (None: no limit, the
        request is not streaming here); a pack reaching past it is refused. ``held``: whether
        this rank holds the request (a pack of a layer range reads only held requests: that is
        a streaming read, and its layers are only known to be written while held)."""
        problem = self._check(msg, published, held)
        if problem is not None:
            return _side.Error(message=f"pack refused: {problem}; nothing was packed",
                               token=msg.token)
        spec = self.spec
        n = len(msg.block_ids)
        heads = msg.heads[1] - msg.heads[0]
        first, end = msg.layers or (0, spec.num_layers)
        layer_bytes = pack_layer_bytes(spec, n, heads)
        nbytes = (end - first) * layer_bytes
        if nbytes > self.capacity:
            return _side.Error(
                message=f"pack refused: {n} blocks x {heads} heads x {end - first} layers is "
                        f"{nbytes} bytes but this rank's pack buffer holds {self.capacity} "
                        f"(serve(..., pack_bytes=)); ask for fewer blocks at a time; nothing "
                        f"was packed", token=msg.token)
        now = time.monotonic()
        self.slots.expire(now)
        keep = min(msg.timeout, lease)
        got = self.slots.allocate(nbytes, now + keep + SLOT_GRACE)
        if got is None:
            return _side.Error(message=f"pack buffer busy: {self.slots.used()} of "
                                       f"{self.capacity} bytes held by other reads; ask again",
                               retry=True, token=msg.token)
        slot, offset = got
        try:
            self._gather(msg, offset, layer_bytes, sync)
            if not sync and self.asynchronous:
                import torch

                with on_device(self.device, False):
                    event = torch.cuda.Event()
                    event.record()
                self._events[slot] = event
        except BaseException:
            del self.slots.held[slot]
            raise
        return _side.Packed(token=msg.token, slot=slot, offset=offset, nbytes=nbytes,
                            expires_in=keep)

    def _check(self, msg: _side.Pack, published: int | None = None, held: bool = True
               ) -> str | None:
        spec = self.spec
        ids = np.asarray(msg.block_ids, dtype=np.int64)
        bad = np.flatnonzero(ids >= spec.num_blocks)
        if bad.size:
            return (f"'block_ids'[{bad[0]}] = {ids[bad[0]]} is outside this rank's cache "
                    f"[0, num_blocks={spec.num_blocks})")
        a, b = msg.heads
        top = 1 if spec.is_mla else spec.num_kv_heads
        if not 0 <= a < b <= top:
            return (f"'heads' {tuple(msg.heads)} must be a range (a, b) with 0 <= a < b <= {top} "
                    f"(this rank's KV heads)")
        need = -(-msg.num_tokens // spec.block_size)
        if need != ids.size:
            return (f"'num_tokens' {msg.num_tokens} needs {need} blocks of {spec.block_size} "
                    f"tokens but 'block_ids' holds {ids.size}")
        top = spec.num_layers
        if msg.layers is not None:
            a, b = msg.layers
            if not 0 <= a < b <= top:
                return (f"'layers' {tuple(msg.layers)} must be a range (a, b) with 0 <= a < b <= "
                        f"{top} (this rank's layers)")
            if not held:
                return (f"'layers' {tuple(msg.layers)} asks a layer range of request "
                        f"{msg.request_id!r}, which this rank does not hold (a layer range is "
                        f"packed only for a held streaming request; it may have been released "
                        f"or its lease expired)")
        end = top if msg.layers is None else msg.layers[1]
        if published is not None and end > published:
            asked = "every layer" if msg.layers is None else f"layers {tuple(msg.layers)}"
            return (f"{asked} of streaming request {msg.request_id!r} asked but only "
                    f"{published} of {top} layers are published on this rank (layers "
                    f"[0, {published})); a reader packs only published layers")
        return None

    def sync(self, slot: int | None = None) -> None:
        """Wait until the gather into ``slot`` (None: every gather launched so far) has finished
        (a no-op on CPU, where gathers run before :meth:`pack` returns)."""
        if slot is not None:
            event = self._events.pop(slot, None)
            if event is not None:
                event.synchronize()
            return
        self._events.clear()
        with on_device(self.device):
            return

    def _gather(self, msg: _side.Pack, offset: int, layer_bytes: int, sync: bool) -> None:
        """Gather ``msg``'s layers (``a`` to ``b``) of its tokens and heads into the buffer at
        ``offset`` (layer ``a + l`` at ``offset + l * layer_bytes``): one move-kernel launch for
        all those layers with Triton, the torch reference per layer otherwise. The ids and the
        range were checked by :meth:`_check`."""
        import torch

        from fkv.ops.relayout import staging_spec
        from fkv.tensors import torch_dtype

        spec = self.spec
        a, b = msg.heads
        n = len(msg.block_ids)
        stage = staging_spec(spec, n, num_heads=b - a)
        shape = stage.physical_shape
        dtype = torch_dtype(spec.dtype)
        heads = None if spec.is_mla else (a, b)
        first, end = msg.layers or (0, len(self.views))
        with on_device(self.device, sync):
            ids = torch.as_tensor(msg.block_ids, dtype=torch.int64).to(self.device)
            if self._triton:
                from fkv.ops._move_kernel import launch_move

                out = self.buffer[offset:offset + layer_bytes].view(dtype)
                launch_move(self.views[0], spec, ids, a, out, stage, None, 0, b - a,
                            msg.num_tokens, layers=(end - first, "table",
                                                    layer_bytes // spec.itemsize),
                            tables=(table_from(self._table, first, self._tables), None))
                return
            for layer in range(first, end):
                view = self.views[layer]
                start = offset + (layer - first) * layer_bytes
                out = self.buffer[start:start + layer_bytes].view(dtype).view(shape)
                self._ops.gather(view, spec, ids, heads=heads, out=out, num_tokens=msg.num_tokens)

    # -- slots -------------------------------------------------------------------------------------
    def free(self, message: bytes) -> bool:
        """Handle a :data:`FREE_PREFIX` notification; False when it names no held slot."""
        try:
            slot = int(message[len(FREE_PREFIX):])
        except ValueError:
            return False
        self._events.pop(slot, None)
        return self.slots.held.pop(slot, None) is not None

    def expire(self) -> None:
        self.slots.expire(time.monotonic())
        for slot in [s for s in self._events if s not in self.slots.held]:
            del self._events[slot]
