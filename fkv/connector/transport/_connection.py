"""A decode rank's connection to one prefill engine, and the one place that picks a request's path.

:class:`Connection` builds, from the accepted plan and the prefill ranks' metadata, the NIXL
:class:`~fkv.connector.transport._link.Link` (remote agents, descriptor lists, staging buffer) and
every path this connection can take:

========== ================================================================================
``ipc``     same host, CUDA on both sides, peer access: kernels read the mapped prefill caches
``packed``  NIXL: each prefill rank gathers the request into its pack buffer, one READ per rank
``direct``  NIXL: the plan's rows land final bytes (one descriptor per coalesced row)
``staging`` NIXL: the plan's rows fill a staging buffer, then a kernel rearranges
========== ================================================================================

``direct`` and ``staging`` copy their rows with ``process_vm_readv`` instead of NIXL READs when
every prefill rank read is a process of this host with CPU DRAM caches, as the decode rank's
(``_cma``; ``strategy="nixl"`` and ``FKV_CMA=0`` keep NIXL READs). Such a copy costs about a
microsecond per row whatever its size, so where the plan is ``staging`` (a head slice that is
not contiguous, a layout change) a small request copies the *direct* plan's rows instead: no
whole pages, no staging move, whose fixed cost per layer (about half a millisecond on a 16-core
host) is what a small request's staging read spends most on (bench/NOTES.md, twenty-first
session).

:meth:`Connection.choose` decides per request: a forced strategy is taken as is; ``"auto"``
takes ``ipc`` whenever the connection could map the prefill caches, else ``packed`` for a request
whose plan needs more descriptors than the client's ``pack_threshold`` (CUDA on both sides), else,
with same-host copies and a staging plan, ``direct`` for a request of at most
:data:`DIRECT_ROWS_PER_LAYER` (``FKV_CMA_DIRECT_ROWS``) direct rows per layer, else the plan's own
strategy; ``"nixl"`` is ``"auto"`` without ``ipc`` (NIXL paths only). ``describe()`` says which paths exist and why the others do not.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from fkv.connector.plan import TransferPlan
from fkv.connector.transport._link import Link, Local
from fkv.connector.transport._packed_path import PackedPath, packed_sizing
from fkv.connector.transport._plan_path import PlanPath, staging_blocks
from fkv.connector.wire import Peer
from fkv.errors import FkvError

__all__ = ["DIRECT_ROWS_PER_LAYER", "Connection"]

#: Under ``"auto"``, with same-host copies and a staging plan: the most rows per layer of the
#: direct plan for which a request copies those rows instead of staging whole pages. From the
#: CPU transfer bench on a 16-core host (P TP=1 -> D TP=2, 8 layers, 16 and 256 blocks): a direct
#: row costs 1.0-1.2 us (1 KiB) or 0.7-0.9 us (256 B), an NHD staging read about 0.6 ms per layer
#: plus 0.02 ms per block; the two cross at about 1200 rows per layer for NHD heads split in two
#: (32 rows of 1 KiB a block) and 700 for HND -> NHD (128 rows of 256 B a block).
#: bench/results/raw/transfer-cpu-direct-vs-staging-20261203T221541Z.json (read_ms over 8
#: layers); bench/NOTES.md, twenty-first session.
#: ``FKV_CMA_DIRECT_ROWS`` changes it for the connections made after (0: always the plan's).
DIRECT_ROWS_PER_LAYER = 1024


def direct_rows_per_layer() -> int:
    """``FKV_CMA_DIRECT_ROWS`` (an integer >= 0), else :data:`DIRECT_ROWS_PER_LAYER`."""
    raw = os.environ.get("FKV_CMA_DIRECT_ROWS")
    if raw is None:
        return DIRECT_ROWS_PER_LAYER
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise FkvError(f"FKV_CMA_DIRECT_ROWS={raw!r}: expected an integer >= 0 (the most direct "
                       f"rows per layer a same-host request copies instead of staging; 0: never)")
    return value


class Connection:
    """Plan, peers, the NIXL link and the paths of one decode rank's connection."""

    def __init__(self, local: Local, plan: TransferPlan, peers: list[Peer], entries: list[Any],
                 deadline: float) -> None:
        self.local, self.plan, self.peers = local, plan, tuple(peers)
        self.engine_id = peers[0].engine.engine_id
        self.remote_spec = peers[0].spec
        self.ipc: Any = None
        self.packed: PackedPath | None = None
        self.link: Link | None = None
        #: small requests' path when the plan is staging and the rows are copied on this host
        self.direct: PlanPath | None = None
        self._direct_rows_per_block = 0.0
        self._direct_rows_max = direct_rows_per_layer()  # a bad value fails the connect
        self._watch: Any = None
        self._entries = entries
        strategy = local.strategy
        self.ipc_reason = self._ipc_reason(strategy)
        if strategy == "ipc" and self.ipc_reason:
            raise FkvError(f"strategy='ipc' is not possible with prefill engine "
                           f"{self.engine_id!r}: {self.ipc_reason}; use strategy='auto' (NIXL)")
        blocks = staging_blocks(plan, local.spec, self.remote_spec, local.staging_bytes_max)
        staging_path_bytes = plan.staging_bytes(blocks) if blocks else 0
        sizing, self.packed_reason = None, ""
        cuda = local.device.type == "cuda" and all(
            entries[r].mem_type == "VRAM" for r in plan.remote_ranks)
        if strategy == "packed" or (strategy in ("auto", "nixl") and cuda):
            sizing, self.packed_reason = packed_sizing(local, plan, entries, self.remote_spec)
            if strategy == "packed" and sizing is None:
                raise FkvError(f"strategy='packed' is not possible with prefill engine "
                               f"{self.engine_id!r}: {self.packed_reason}")
        elif strategy in ("auto", "nixl"):
            self.packed_reason = ("'auto' packs only when the caches of both sides are on CUDA "
                                  "(strategy='packed' forces packed reads)")
        else:
            self.packed_reason = f"strategy {strategy!r} forced"
        try:
            self.link = Link(local, plan, peers, entries, staging_path_bytes=staging_path_bytes,
                             staging_bytes=max(staging_path_bytes,
                                               sizing.buffer_bytes if sizing else 0),
                             deadline=deadline)
            self._hello(entries, deadline)
            copier = self._copier(strategy, deadline)
            try:
                self.plan_path = PlanPath(self.link, blocks, copier)
            except BaseException:  # the copier is the plan path's to close once it has one
                if copier is not None:
                    copier.close()
                raise
            self._direct_sibling(strategy)
            if sizing is not None:
                self.packed = PackedPath(self.link, sizing)
            if not self.ipc_reason:
                self._open_ipc(strategy)
        except BaseException:
            self.close()
            raise

    def _hello(self, entries: list[Any], deadline: float) -> None:
        """Tell every prefill rank this rank notifies which NIXL agent speaks for it (their
        request tables count notifications by reader identity)."""
        import time

        from fkv.connector.transport import _side
        from fkv.connector.transport._base import SideChannelError

        engine = self.local.engine
        for rank in (*self.plan.remote_ranks, *self.plan.notify_only_ranks):
            outbox = self._outbox_for(rank)
            hello = _side.Hello(engine_id=engine.engine_id, rank=engine.tp_rank,
                                tp_size=engine.tp_size, agent=self.local.agent.name,
                                secret=self.local.secret,
                                outbox=None if outbox is None else _side.OutboxInfo(
                                    host=self.peers[rank].board.host, name=outbox.name,
                                    token=outbox.token))
            try:
                reply = _side.request(self.local.zctx, entries[rank].address, hello,
                                      max(0.05, deadline - time.monotonic()),
                                      curve=self.local.curve)
            except BaseException:
                if outbox is not None:
                    outbox.close()
                raise
            if outbox is not None:
                outbox.unlink()  # opened by now, or never: no name left for anyone to open
                if isinstance(reply, _side.Ok) and reply.outbox:
                    self.link.outboxes[rank] = outbox
                else:  # another host after all, or the rank refused it: NIXL notifications
                    outbox.close()
            if not isinstance(reply, _side.Ok):
                raise SideChannelError(f"prefill rank {rank} of engine {self.engine_id!r} refused "
                                       f"this decode rank's hello: "
                                       f"{getattr(reply, 'message', reply)}")

    def _outbox_for(self, rank: int) -> Any:
        """A new outbox (``_outbox``) for prefill rank ``rank`` when it runs on this host (its
        publish board says so) and this process offers outboxes; else None."""
        from fkv.connector.transport._ipc import host_identity
        from fkv.connector.transport._outbox import Outbox, outbox_wanted

        board = self.peers[rank].board
        if board is None or board.host != host_identity() or not outbox_wanted():
            return None
        try:
            return Outbox()
        except OSError:  # no /dev/shm here: NIXL notifications
            return None

    def _copier(self, strategy: str, deadline: float) -> Any:
        """The same-host copier of the plan paths (``_cma``), or None with ``copy_reason``."""
        from fkv.connector.transport._cma import SameHostCopy, cma_refusal, copy_threads

        self.copy_reason = f"strategy {strategy!r} keeps NIXL READs" if strategy == "nixl" else ""
        for rank in self.plan.remote_ranks:
            self.copy_reason = self.copy_reason or cma_refusal(
                self.peers[rank], rank, self.local.mem_type, self.link.mem_types[rank])
        if self.copy_reason:
            return None
        link = self.link
        staging = ((link.staging.data_ptr(), link.staging_path_bytes)
                   if link.staging_path_bytes else None)
        threads = copy_threads()  # a bad FKV_CMA_THREADS fails the connect, naming it
        try:
            copier = SameHostCopy(list(self.local.regions), staging,
                                  {r: self.peers[r] for r in self.plan.remote_ranks},
                                  self.engine_id, threads)
        except FkvError as e:
            self.copy_reason = str(e)
            return None
        try:  # no READ will finish connecting NIXL to these ranks: notifications may need it
            if self.local.agent.progress == "off":
                link.wire_up(self.plan.remote_ranks, deadline)
        except BaseException:
            copier.close()
            raise
        return copier

    def _direct_sibling(self, strategy: str) -> None:
        """With same-host copies and a staging plan chosen by ``"auto"``: the direct plan of the
        same pair, for the requests :meth:`choose` gives it."""
        copier = self.plan_path.copier
        if strategy != "auto" or copier is None or self.plan.strategy != "staging" or \
                self._direct_rows_max == 0:
            return
        from fkv.connector.handshake import handshake

        outcome = handshake((self.local.engine, self.local.spec),
                            (self.peers[0].engine, self.remote_spec), strategy="direct")
        if not outcome.ok:  # the pair was accepted once already: a direct plan always exists
            return
        plan = outcome.plan
        self.direct = PlanPath(self.link, 0, copier, plan=plan)
        per_layer = 1 if any(s.cross_layer for s in (self.local.spec, self.remote_spec)) \
            else self.remote_spec.num_layers
        self._direct_rows_per_block = plan.cost.descriptors / per_layer

    def _ipc_reason(self, strategy: str) -> str:
        if strategy not in ("auto", "ipc"):
            return f"strategy {strategy!r} forced"
        if self.local.device.type != "cuda":
            return "the decode caches are not on CUDA (ipc maps GPU memory)"
        from fkv.connector.transport._ipc import ipc_refusal

        for rank in self.plan.remote_ranks:
            reason = ipc_refusal(self.peers[rank], self.local.device)
            if reason:
                return reason
        return ""

    def _open_ipc(self, strategy: str) -> None:
        from fkv.connector.transport._ipc_path import IpcPath

        try:
            self.ipc = IpcPath(self.local, self.plan, list(self.peers), self.engine_id)
        except FkvError as e:
            if strategy == "ipc":
                raise FkvError(f"strategy='ipc' with prefill engine {self.engine_id!r}: {e}; use "
                               f"strategy='auto' (NIXL)") from None
            self.ipc_reason = f"mapping the prefill caches failed: {e}"

    # -- which path: the one place -----------------------------------------------------------------
    def choose(self, local: np.ndarray, remote: np.ndarray, tokens: int
               ) -> tuple[Any, np.ndarray | None]:
        """The path for one request, and the plan rows when they were computed to decide."""
        strategy = self.local.strategy
        if self.ipc is not None:
            return self.ipc, None
        if strategy == "packed":
            return self.packed, None
        if self.direct is not None and \
                self._direct_rows_per_block * remote.size <= self._direct_rows_max:
            return self.direct, None
        if strategy not in ("auto", "nixl") or self.packed is None:
            return self.plan_path, None
        threshold = self.local.pack_threshold
        if self.plan.cost.descriptors * remote.size <= threshold:
            return self.plan_path, None
        rows = self.plan.rows(local, remote, tokens)
        if rows.shape[0] > threshold:
            return self.packed, None
        return self.plan_path, rows

    def describe(self) -> str:
        strategy = self.local.strategy
        lines = [self.plan.describe()]
        if self.ipc is not None:
            lines.append(f"every request: {self.ipc.describe()}")
            return "\n".join(lines)
        if self.plan_path.copier is not None:
            lines.append(f"same host: {self.plan_path.describe()}")
            if self.direct is not None:
                lines.append(f"same host, a request of at most {self._direct_rows_max} direct rows "
                             f"per layer ({self._direct_rows_per_block:g} per remote block): "
                             f"{self.direct.describe()}")
        elif self.local.mem_type == "DRAM":
            lines.append(f"same-host copies off ({self.copy_reason}): NIXL READs")
        if strategy in ("auto", "ipc"):
            lines.append(f"ipc: off ({self.ipc_reason})")
        if strategy == "packed":
            lines.append(self.packed.describe())
        elif strategy not in ("auto", "nixl"):
            lines.append(f"strategy {strategy!r} forced: every request follows the plan")
        elif self.packed is None:
            lines.append(f"packed reads off ({self.packed_reason}): every request follows the "
                         f"plan")
        else:
            lines.append(f"auto: a request whose plan needs more than {self.local.pack_threshold} "
                         f"descriptors reads packed; {self.packed.describe()}")
        return "\n".join(lines)

    def notify_after(self, path: Any) -> tuple[int, ...]:
        """Prefill ranks the client notifies once ``path`` has landed a request."""
        if path.notifies_with_read:
            return self.plan.notify_only_ranks
        return (*self.plan.remote_ranks, *self.plan.notify_only_ranks)

    def watch(self) -> Any:
        """The layer-status watch of streaming reads (made on first use)."""
        if self._watch is None:
            from fkv.connector.transport._board import open_board
            from fkv.connector.transport._stream import Watch

            boards = {}
            if os.environ.get("FKV_PUBLISH_BOARD", "1") != "0":
                for rank in self.plan.remote_ranks:
                    board = open_board(self.peers[rank].board)
                    if board is not None:
                        boards[rank] = board
            self._watch = Watch(self.local.zctx, self._entries, self.plan.remote_ranks,
                                self.engine_id, curve=self.local.curve, boards=boards)
        return self._watch

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        for path in (self.ipc, self.packed, self.direct, getattr(self, "plan_path", None)):
            if path is not None:  # the direct sibling first: it borrows plan_path's copier
                path.close()
        self.ipc = self.packed = self.direct = None
        if self.link is not None:
            self.link.close()
            self.link = None
