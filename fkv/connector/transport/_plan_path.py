"""The plan's own NIXL paths: ``direct`` (rows land final bytes) and ``staging`` (rows read whole
pages into the staging buffer, then ``fkv.ops.move`` rearranges them).

A request becomes the plan's rows (``TransferPlan.segments``), the rows granule index runs (NIXL
merges runs contiguous on both sides into one descriptor), one READ per prefill rank, polled to
DONE before the deadline, then the plan's staging moves. A staging read larger than the staging
buffer goes a window of layers at a time (:meth:`PlanPath.window`), or in chunks of blocks when
not even one layer of it fits. The READs carry no notification: the client notifies once every
READ of the request landed.

With a :class:`~fkv.connector.transport._cma.SameHostCopy` (CPU DRAM on both sides of one host)
the rows are copied from the prefill processes with ``process_vm_readv`` instead of NIXL READs:
the same rows, the same staging moves and notifications.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import attrs
import numpy as np

from fkv.connector.transport._base import Tally, TransferFailed, kernels, on_device, split_chunks
from fkv.connector.transport._link import Link, wait_reads
from fkv.errors import FkvError

__all__ = ["LayerReads", "PlanPath", "staging_blocks", "staging_window_wanted"]


def staging_window_wanted() -> bool:
    """Whether a staging read larger than the staging buffer may go a window of layers at a time
    (``FKV_STAGING_WINDOW``: 1, the default, or 0: chunks of blocks); FkvError naming the
    variable for any other value."""
    raw = os.environ.get("FKV_STAGING_WINDOW", "1")
    if raw not in ("0", "1"):
        raise FkvError(f"FKV_STAGING_WINDOW={raw!r}: expected 1 (a staging read of a request "
                       f"larger than the staging buffer moves a few layers of all its blocks at "
                       f"a time) or 0 (chunks of blocks)")
    return raw == "1"


def staging_blocks(plan: Any, local_spec: Any, remote_spec: Any, staging_bytes_max: int) -> int:
    """Remote blocks one staging-path chunk holds (0 when the plan is direct). The staging cap is
    hard: geometry whose smallest chunk does not fit is refused (FkvError) before allocating."""
    if plan.strategy != "staging":
        return 0
    step = math.lcm(local_spec.block_size, remote_spec.block_size)
    per_block = plan.staging_bytes(1)
    smallest = step // remote_spec.block_size * per_block
    if smallest > staging_bytes_max:
        raise FkvError(f"the smallest staging chunk of this pair is {step} tokens (the least "
                       f"common multiple of block sizes {local_spec.block_size} and "
                       f"{remote_spec.block_size}): {smallest} bytes, over the staging cap "
                       f"staging_bytes={staging_bytes_max}; nothing was allocated: raise "
                       f"connect(staging_bytes=) or use block sizes that divide each other")
    blocks = max(staging_bytes_max // per_block, step // remote_spec.block_size)
    return min(blocks, max(remote_spec.num_blocks, step // remote_spec.block_size))


@attrs.define
class LayerReads:
    """The READs of a request's remote ``layers`` (a range; None: every layer), ready to create:
    per prefill rank ``(rank, local descriptor indices, remote descriptor indices, bytes)``, for
    the descriptor ``granule`` they were computed with (0: same-host copies, whose entries hold
    the local and remote iovec arrays instead of indices; -1: none, computed by the read itself);
    ``rows``: plan rows (descriptors before
    NIXL merges them). ``created``: NIXL handles of ``reads`` already created, not posted (one
    per read; :meth:`PlanPath.layer_reads`), owned by this value until a read posts them or
    :meth:`PlanPath.discard_unposted` releases them."""

    layers: tuple[int, int] | None
    granule: int
    rows: int
    reads: tuple[tuple[int, np.ndarray, np.ndarray, int], ...]
    created: list[Any] | None = None

    def take(self) -> list[Any] | None:
        """The created handles, now the caller's to post or release (None: none were made)."""
        created, self.created = self.created, None
        return created


@attrs.define
class _StagingMemo:
    """What a request's staging moves reuse from one layer range to the next (a streamed read
    comes once per range): its steps, which depend on the plan, the staging buffer and the
    request's sizes only, and each staging mini-cache's layer views, built as the steps need."""

    plan: Any
    staging: Any
    sizes: tuple[int, int, int, int]  # local blocks, remote blocks, tokens, staging window
    steps: tuple[Any, ...]
    views: dict[tuple[Any, int], Any] = attrs.Factory(dict)  # (mini-cache spec, offset) -> views

    def fits(self, plan: Any, staging: Any, sizes: tuple[int, int, int, int]) -> bool:
        return self.plan is plan and self.staging is staging and self.sizes == sizes


class PlanPath:
    """The plan's direct or staging reads over a :class:`Link` (``name`` is the plan's
    strategy).

    ``plan``: another plan of the same pair than the link's, whose rows only ``copier`` moves
    (the direct sibling of a staging link on one host; see ``_connection``): the path then
    borrows the copier, which the link's own path closes."""

    notifies_with_read = False  # the client notifies once every READ of the request landed

    def __init__(self, link: Link, blocks: int, copier: Any = None, plan: Any = None) -> None:
        self.link = link
        #: the same-host copier (``_cma.SameHostCopy``) that replaces NIXL READs, or None
        self.copier = copier
        self._owns_copier = plan is None
        if plan is not None and (copier is None or plan.strategy != "direct"):
            raise FkvError("PlanPath: a plan other than the link's is a direct plan whose rows "
                           "a same-host copier moves")
        #: the plan whose rows this path moves
        self.plan = link.plan if plan is None else plan
        self.name = self.plan.strategy
        self.staging_blocks = blocks   # remote blocks one staging-path chunk holds
        self._windowed = staging_window_wanted()  # a bad value fails the connect
        #: READs that outlived their read's deadline: NIXL may still land their bytes (in the
        #: staging buffer or the local blocks), so no read of this path starts before they end
        self.quarantine: list[Any] = []
        #: READs that ended (DONE or ERR), released when the next chunk starts or at close: not
        #: between a read's last byte and its return (a NIXL call per READ, on cold caches)
        self.ended: list[Any] = []
        #: layer ranges read from READs computed ahead (layer_reads), since the connection began
        self.prepared_reads = 0
        #: READs created ahead and released unposted (discard_unposted), since the connection
        #: began; and the LayerReads values that may still hold created READs
        self.discarded_reads = 0
        #: layer ranges reads moved through a staging window (:meth:`window`), since the
        #: connection began
        self.windowed_ranges = 0
        self._ahead: list[LayerReads] = []
        self._staging_memo: _StagingMemo | None = None  # the last request's staging moves

    def describe(self) -> str:
        if self.copier is not None:
            whose = "the plan's" if self._owns_copier else f"the {self.name} plan's"
            return f"{self.name}: {whose} rows {self.copier.describe()}"
        return f"{self.name}: the plan's rows, one READ per prefill rank"

    def chunks(self, local: np.ndarray, remote: np.ndarray, tokens: int
               ) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Split a staging read so each piece's staging mini-caches fit the staging buffer."""
        if self.name != "staging" or remote.size <= self.staging_blocks:
            return [(local, remote, tokens)]
        nl, nr = self.link.local.spec.block_size, self.link.remote_spec.block_size
        step = math.lcm(nl, nr)
        per = (self.staging_blocks * nr) // step * step  # tokens per chunk
        return split_chunks(local, remote, tokens, per, nl, nr)

    def window(self, remote_blocks: int) -> int:
        """Layers a staging read of ``remote_blocks`` blocks moves through the staging buffer at
        once (``TransferPlan.staging_bytes(n, staging_layers=)``) when the request's every layer
        does not fit the buffer but one layer of all its blocks does: a whole read goes a window
        of layers at a time, and a streamed one each published range, as one copy and one move
        per layer, not as a copy and a move per chunk of blocks per layer. 0 when the request
        fits whole (one chunk), when not even one layer of it fits (chunks of blocks), for a
        direct plan, or with ``FKV_STAGING_WINDOW=0``."""
        if self.name != "staging" or remote_blocks <= self.staging_blocks or \
                not self._windowed or not self.layered():
            return 0
        per_layer = self.plan.staging_bytes(int(remote_blocks), 1)
        return min(self.link.remote_spec.num_layers, self.link.staging_path_bytes // per_layer)

    def stream_rows(self, local: np.ndarray, remote: np.ndarray, tokens: int
                    ) -> np.ndarray | None:
        """The plan's rows of a streamed request, computed once for all its layer ranges: the
        whole request's when it goes as one chunk, the staging window's (:meth:`window`) when it
        goes a few layers at a time, else None (chunks of blocks: each computes its own)."""
        window = self.window(remote.size)
        if window:
            return self.plan.rows(local, remote, tokens, window)
        if len(self.chunks(local, remote, tokens)) == 1:
            return self.plan.rows(local, remote, tokens)
        return None

    def layered(self) -> bool:
        """Whether a request can move a few layers at a time (streaming): each of the plan's
        rows lies in one remote layer when the prefill caches are per-layer buffers."""
        return not self.link.remote_spec.cross_layer

    def read(self, request_id: str, local: np.ndarray, remote: np.ndarray, tokens: int,
             deadline: float, tally: Tally, rows: np.ndarray | None = None,
             layers: tuple[int, int] | None = None, prepared: LayerReads | None = None) -> None:
        """Read the request (``layers=(a, b)``: only those remote layers). ``prepared``: the
        READs of exactly ``layers``, from :meth:`layer_reads` (a one-chunk or windowed request);
        the read posts its created READs, or leaves them to :meth:`discard_unposted` when it
        cannot use them (another range, a new granule)."""
        if layers is not None and not self.layered():
            raise FkvError("PlanPath.read: a layer range needs per-layer prefill caches")
        window = self.window(remote.size)  # 0 for a request that fits whole (one chunk)
        if window:  # every block of the request, ``window`` layers at a time
            if layers is None:  # a whole read: every layer (rows given were not the window's)
                layers = (0, self.link.remote_spec.num_layers)
                rows = self.plan.rows(local, remote, tokens, window)
            for first in range(layers[0], layers[1], window):
                part = (first, min(layers[1], first + window))
                self.windowed_ranges += 1
                self._chunk(local, remote, tokens, deadline, tally, rows, part,
                            prepared if part == layers else None, window)
            return
        chunks = self.chunks(local, remote, tokens)
        for lc, rc, n_tok in chunks:
            self._chunk(lc, rc, n_tok, deadline, tally,
                        rows if len(chunks) == 1 else None, layers,
                        prepared if len(chunks) == 1 else None)

    def layer_reads(self, rows: np.ndarray, layer: int) -> LayerReads:
        """The READs of one remote layer of a one-chunk request, from its plan ``rows``, created
        in NIXL but not posted: what a streaming read does while it waits for that layer, so
        that once the layer is published the READs are only posted. Valid until the next read
        of another request (the descriptor granule may change then); what no read posts is
        released by :meth:`discard_unposted`. (Creating a READ resolves descriptors on this side
        only: nothing moves and the prefill rank sees nothing until the post.)"""
        if self.copier is not None:  # the copy's vectors: a post is then one system call
            return self._copies(rows, (layer, layer + 1))
        reads = self._reads(rows, (layer, layer + 1), ahead=True)
        if reads.granule != self.link.granule:  # the read itself prepares the lists again
            return reads
        link = self.link
        agent = link.local.agent
        created: list[Any] = []
        try:
            for rank, local_idx, remote_idx, _ in reads.reads:
                created.append(agent.create_read(link.local_dlist, local_idx,
                                                 link.remote_dlists[rank], remote_idx,
                                                 link.names[rank]))
        except TransferFailed:  # the post will create them again and say what failed
            for handle in created:
                agent.discard(handle)
            return reads
        reads.created = created
        self._ahead.append(reads)
        return reads

    def prime(self, reads: LayerReads, budget: float) -> None:
        """Get ready for the copies of ``reads`` (:meth:`layer_reads`) within about ``budget``
        seconds: with same-host copies, touch their pages (``SameHostCopy.prime``); nothing for
        NIXL READs, which are created ahead already."""
        if self.copier is None or reads.granule != 0:
            return
        end = time.perf_counter() + budget
        for rank, local_iov, remote_iov, nbytes in reads.reads:
            self.copier.prime(rank, local_iov, remote_iov, nbytes, end - time.perf_counter())

    def discard_unposted(self) -> None:
        """Release every READ :meth:`layer_reads` created that no read posted (a streaming read
        calls it when it ends, landed or failed)."""
        ahead, self._ahead = self._ahead, []
        for reads in ahead:
            for handle in reads.take() or ():
                self.link.local.agent.discard(handle)
                self.discarded_reads += 1

    def _copies(self, rows: np.ndarray, layers: tuple[int, int] | None) -> LayerReads:
        if layers is not None:
            rows = rows[(rows[:, 1] >= layers[0]) & (rows[:, 1] < layers[1])]
        ranks = self.plan.remote_ranks
        reads = tuple((rank, *self.copier.vectors(rank, rows if len(ranks) == 1
                                                  else rows[rows[:, 0] == rank]))
                      for rank in ranks)
        return LayerReads(layers, 0, int(rows.shape[0]), reads)

    def _copy_chunk(self, local: np.ndarray, remote: np.ndarray, tokens: int, deadline: float,
                    tally: Tally, rows: np.ndarray | None, layers: tuple[int, int] | None,
                    prepared: LayerReads | None, window: int = 0) -> None:
        if prepared is None or prepared.granule != 0 or prepared.layers != layers:
            if rows is None:
                rows = self.plan.rows(local, remote, tokens, window or None)
            prepared = self._copies(rows, layers)
        else:
            self.prepared_reads += 1
        tally.descriptors += prepared.rows
        t0 = time.perf_counter()
        try:
            for rank, local_iov, remote_iov, nbytes in prepared.reads:
                if nbytes:
                    self.copier.copy(rank, local_iov, remote_iov, nbytes, deadline)
                    tally.bytes += nbytes
        finally:
            tally.transfer_seconds += time.perf_counter() - t0

    def _reads(self, rows: np.ndarray, layers: tuple[int, int] | None, ahead: bool = False
               ) -> LayerReads:
        """The READs of ``rows`` (of ``layers``) on the link's granule, preparing the descriptor
        lists again on a finer one when a row needs it. ``ahead`` (:meth:`layer_reads`, no
        deadline to wait by): while READs of a timed-out read are still running over the lists,
        none are prepared again; the answer then has granule -1 and no reads, which no read uses
        (the read drains those READs first, then prepares)."""
        link = self.link
        if layers is not None:
            rows = rows[(rows[:, 1] >= layers[0]) & (rows[:, 1] < layers[1])]
        self._release_ended()  # before the descriptor lists may be prepared again
        if ahead and self.quarantine and not link.fits_granule(rows):
            self._release_quarantined()
            if self.quarantine:
                return LayerReads(layers, -1, int(rows.shape[0]), ())
        link.ensure_granule(rows)
        reads = []
        ranks = link.plan.remote_ranks
        for rank in ranks:
            mine = rows if len(ranks) == 1 else rows[rows[:, 0] == rank]
            reads.append((rank, *link.indices(mine), int(mine[:, 5].sum())))
        return LayerReads(layers, link.granule, int(rows.shape[0]), tuple(reads))

    def _chunk(self, local: np.ndarray, remote: np.ndarray, tokens: int,
               deadline: float, tally: Tally, rows: np.ndarray | None,
               layers: tuple[int, int] | None = None,
               prepared: LayerReads | None = None, window: int = 0) -> None:
        """One chunk's rows, then (staging) its moves. ``window``: the staging buffer holds
        that many layers of the whole request (:meth:`window`; 0: every layer of the chunk)."""
        if self.copier is not None:
            self._copy_chunk(local, remote, tokens, deadline, tally, rows, layers, prepared,
                             window)
            if self.name == "staging":
                self._run_staging(local, remote, tokens, layers, window)
            return
        link = self.link
        agent, plan = link.local.agent, link.plan
        if prepared is not None and (prepared.layers != layers
                                     or prepared.granule != link.granule):
            prepared = None  # another range, or the descriptors were prepared again since
        self._drain_quarantine(deadline)
        self._release_ended()
        created = None
        if prepared is None:
            if rows is None:
                rows = plan.rows(local, remote, tokens, window or None)
            reads = self._reads(rows, layers)
        else:
            reads = prepared
            self.prepared_reads += 1
            created = reads.take()
        tally.descriptors += reads.rows
        xfers: list[Any] = []
        ranks: list[int] = []
        t0 = time.perf_counter()
        try:
            for i, (rank, local_idx, remote_idx, nbytes) in enumerate(reads.reads):
                try:
                    if created is not None:
                        handle, created[i] = created[i], None
                        xfers.append(agent.post(handle, link.names[rank], nbytes))
                    else:
                        xfers.append(agent.read(link.local_dlist, local_idx,
                                                link.remote_dlists[rank], remote_idx,
                                                link.names[rank], nbytes))
                except TransferFailed as e:
                    raise TransferFailed(f"prefill rank {rank} of engine {link.engine_id!r}: {e}; "
                                         f"the prefill process may have died: reconnect once it "
                                         f"is back (client.reconnect())") from e
                ranks.append(rank)
            wait_reads(agent, xfers, ranks, link.engine_id, deadline, link.spin)
        finally:
            for handle in created or ():  # created ahead, not posted: a post before them failed
                if handle is not None:
                    agent.discard(handle)
            tally.bytes += sum(x.nbytes for x in xfers if x.state == "DONE")
            tally.transfer_seconds += time.perf_counter() - t0
            for x in xfers:
                if x.state == "PROC":  # may still land bytes: keep it until NIXL says it ended
                    self.quarantine.append(x)
                else:
                    self.ended.append(x)
        if self.name == "staging":
            self._run_staging(local, remote, tokens, layers, window)

    def _release_ended(self) -> None:
        ended, self.ended = self.ended, []
        for x in ended:
            self.link.local.agent.release(x)

    def _release_quarantined(self) -> None:
        """Release the quarantined READs NIXL has finished."""
        agent = self.link.local.agent
        for x in list(self.quarantine):
            if agent.poll(x) != "PROC":
                agent.release(x)
                self.quarantine.remove(x)

    def _drain_quarantine(self, deadline: float) -> None:
        """Release quarantined READs NIXL has finished; wait for the others until ``deadline``
        (then TransferFailed: the staging buffer cannot be trusted yet)."""
        while self.quarantine:
            self._release_quarantined()
            if not self.quarantine:
                return
            if time.monotonic() > deadline:
                names = sorted({x.remote for x in self.quarantine})
                raise TransferFailed(f"{len(self.quarantine)} READ(s) of an earlier read that "
                                     f"timed out (from {names}) have not finished: their bytes "
                                     f"could still land in the staging buffer, so this read did "
                                     f"not start; reconnect (client.reconnect()) if the prefill "
                                     f"rank is gone")
            time.sleep(0.0005)

    def _run_staging(self, local: np.ndarray, remote: np.ndarray, tokens: int,
                     layers: tuple[int, int] | None = None, window: int = 0) -> None:
        import torch

        from fkv.tensors import wrap

        link = self.link
        dev = link.local.device
        move = kernels(dev).move
        views, ls = link.local.views, link.local.spec
        # the ids were checked when the read began
        sizes = (local.size, remote.size, tokens, window)
        memo = self._staging_memo
        if memo is None or not memo.fits(link.plan, link.staging, sizes):
            memo = _StagingMemo(link.plan, link.staging, sizes,
                                link.plan.staging_steps(local, remote, num_tokens=tokens,
                                                        staging_layers=window or None))
            self._staging_memo = memo
        with on_device(dev):
            src_ids = torch.arange(remote.size, device=dev)
            dst_ids = torch.as_tensor(local, device=dev)
            for step in memo.steps:
                if layers is not None and not layers[0] <= step.layer < layers[1]:
                    continue
                where = (step.stage_spec, step.stage_offset)
                if where not in memo.views:
                    memo.views[where] = wrap(link.staging, step.stage_spec, step.stage_offset)
                src = memo.views[where][step.stage_layer]
                move(src, step.stage_spec, src_ids, views[step.layer], ls, dst_ids,
                     src_heads=step.src_heads, dst_heads=step.dst_heads,
                     num_tokens=step.num_tokens)

    def close(self) -> None:
        if self.copier is not None and self._owns_copier:
            self.copier.close()
        self.copier = None
        self.discard_unposted()
        self._release_ended()
        for x in self.quarantine:  # the agent keeps handles NIXL cannot release yet
            self.link.local.agent.release(x)
        self.quarantine.clear()
