"""The transfer plan: which bytes a decode rank READs from which prefill ranks (docs/handshake.md, "Which bytes move").

A :class:`TransferPlan` comes out of :func:`fkv.connector.handshake`. It knows, for one decode
(D) rank, the prefill (P) ranks it reads (``remote_ranks``, one :class:`Read` each: which of that
rank's heads land in which of ours) and the ones it only notifies (``notify_only_ranks``), and it
chooses one of two strategies:

- ``direct``: every row of :meth:`TransferPlan.segments` lands final bytes in the local cache. A
  row is an *atom*: a box of elements contiguous on both sides with the same element order.
- ``staging``: rows read the remote pages (or the parts needed) into a local staging buffer laid
  out as one "staging mini-cache" per remote rank read (``remote_spec.evolve(num_blocks=n)``,
  ``local_region == -1``), then :meth:`TransferPlan.staging_steps` run ``fkv.ops.move``
  (docs/transport.md, staging). Needed for layout mismatches, NHD head slices, block-size mismatches.

The planner picks the strategy that moves the fewest bytes with the fewest descriptors, scored per
remote block as ``bytes read + STAGING_COST_FRACTION * bytes the move kernel copies +
DESCRIPTOR_COST_BYTES * descriptors`` (ties go to ``direct``; ``handshake(..., strategy=)`` forces
one); ``describe()`` reports both. All offsets come from the layout algebra (``KVCacheSpec.span``
for contiguity, ``region_and_offset`` for addresses).

Rows are ordered by read (``remote_ranks`` order), then in the remote's physical order (layers
outermost for a per-layer remote); consecutive rows contiguous on both sides are merged.

Tokens: token ``i`` of a request lives in remote block ``remote_ids[i // N_remote]`` slot
``i % N_remote`` and local block ``local_ids[i // N_local]`` slot ``i % N_local``. Direct rows move
chunks of ``gcd(N_local, N_remote)`` tokens, which always sit inside one block on each side.

>>> from fkv import KVCacheSpec
>>> from fkv.connector.handshake import EngineDesc, handshake
>>> s = KVCacheSpec(layout="HND", num_blocks=8, block_size=16, num_kv_heads=8, head_size=128)
>>> p = EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=8)
>>> d = EngineDesc(engine_id="d", tp_size=2, tp_rank=1, total_num_kv_heads=8)
>>> plan = handshake((d, s.evolve(num_kv_heads=4)), (p, s)).plan
>>> plan.segments([3], [5]).tolist()   # docs/handshake.md worked example A, D rank 1
[[0, 0, 344064, 0, 98304, 16384], [0, 0, 376832, 0, 114688, 16384]]
"""

from __future__ import annotations

import functools
import html
import math
from typing import Any

import attrs
import numpy as np

from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec, fewest_contiguous_atoms

__all__ = [
    "DESCRIPTOR_COST_BYTES", "STAGING_COST_FRACTION", "Cost", "Read", "StagingStep",
    "TransferPlan", "build_plan", "check_block_ids", "expected_notifications", "request_tokens",
]

#: Byte-equivalent cost of one more descriptor (per-READ overhead in NIXL/UCX) when choosing.
DESCRIPTOR_COST_BYTES = 4096
#: Cost per byte the staging move kernel copies, relative to a byte read (bytes moved twice).
STAGING_COST_FRACTION = 1.0

_ATOM_AXES = ("L", "two", "N", "H")  # the axes an atom may split (C, the head_size, is always whole)


def expected_notifications(prefill_tp: int, decode_tp: int) -> int:
    """Notifications each prefill rank waits for before freeing a request (docs/handshake.md, "Which bytes move").

    Every decode rank notifies each rank of its group (``remote_ranks + notify_only_ranks``) once:
    ``decode_tp // prefill_tp`` readers per prefill rank when D TP > P TP, else 1.

    >>> expected_notifications(1, 2), expected_notifications(4, 2)
    (2, 1)
    """
    return decode_tp // prefill_tp if decode_tp > prefill_tp else 1


@attrs.frozen
class Read:
    """One remote rank read: its heads ``remote_heads`` (indices inside that rank's heads,
    ``[start, stop)``) land in our heads ``local_heads``. MLA: ``(0, 1)`` both (the latent)."""

    remote_rank: int
    remote_heads: tuple[int, int]
    local_heads: tuple[int, int]


@attrs.frozen
class Cost:
    """Cost of a strategy per remote block (all layers, all remote ranks read), before rows of
    neighbouring blocks coalesce."""

    strategy: str
    descriptors: int
    nbytes: int
    staged_bytes: int

    @property
    def score(self) -> float:
        return (self.nbytes + DESCRIPTOR_COST_BYTES * self.descriptors
                + STAGING_COST_FRACTION * self.staged_bytes)

    def __str__(self) -> str:
        text = (f"{self.strategy}: {self.descriptors} descriptor{'s' if self.descriptors != 1 else ''}"
                f", {self.nbytes} B per remote block (all layers)")
        if self.strategy == "staging":
            text += f", then fkv.ops.move copies {self.staged_bytes} B"
        return text


@attrs.frozen
class _Move:
    """How one read moves: an atom (one row) covers the ``full`` extents except on the ``split``
    axes, which go one index per row; ``heads`` is the remote head range read (staging may read
    more than needed, to get fewer descriptors). ``descriptors``/``nbytes``: per remote block."""

    split: tuple[str, ...]
    heads: tuple[int, int]
    full: tuple[tuple[str, int], ...]
    descriptors: int
    nbytes: int


@attrs.frozen
class StagingStep:
    """One ``fkv.ops.move`` after the READs (docs/transport.md, staging): staging mini-cache
    ``remote_index`` (spec ``stage_spec``, at byte ``stage_offset`` of the staging buffer), layer
    ``layer``, heads ``src_heads`` of it -> heads ``dst_heads`` of the local cache, ``num_tokens``
    tokens. Heads are None for MLA."""

    remote_index: int
    stage_spec: KVCacheSpec
    stage_offset: int
    layer: int
    src_heads: tuple[int, int] | None
    dst_heads: tuple[int, int] | None
    num_tokens: int

    @property
    def stage_layer(self) -> int:
        """The mini-cache's layer that holds ``layer``: the same one, or ``layer % k`` when the
        staging buffer holds ``k`` layers at once (``staging_layers=k``)."""
        return self.layer % self.stage_spec.num_layers


# -- contiguity of atoms (the layout algebra decides; cached per spec and extents) -------------

@functools.lru_cache(maxsize=4096)
def _best_split(sides: tuple[KVCacheSpec, ...], full: tuple[tuple[str, int], ...]
                ) -> tuple[tuple[str, ...], int]:
    """Fewest atoms such that one atom is contiguous with the same element order on every side
    (the layout algebra's :func:`fkv.layout.fewest_contiguous_atoms`, cached per spec pair)."""
    return fewest_contiguous_atoms(sides, full)


def _full(sides: tuple[KVCacheSpec, ...], tokens: int, heads: int) -> tuple[tuple[str, int], ...]:
    """The axes an atom may cover, with their full extents: K/V, a chunk of tokens, the heads
    read, and the layers when every side keeps all layers in one buffer."""
    rs = sides[0]
    full = {"L": rs.num_layers, "two": 2, "N": tokens, "H": heads}
    cross = all(s.cross_layer for s in sides) and rs.num_layers > 1
    present = rs.axis_sizes
    return tuple((a, full[a]) for a in _ATOM_AXES if a in present and (a != "L" or cross))


def _atom_bytes(spec: KVCacheSpec, full: tuple[tuple[str, int], ...], split: tuple[str, ...]) -> int:
    return math.prod(e for a, e in full if a not in split) * spec.head_size * spec.itemsize


def _move(sides: tuple[KVCacheSpec, ...], heads: tuple[int, int], chunk: int) -> _Move:
    rs = sides[0]
    full = _full(sides, chunk, heads[1] - heads[0])
    split, count = _best_split(sides, full)
    layers_in_atom = bool(full) and full[0][0] == "L"  # _full lists L first when it has it
    per_block = count * (rs.block_size // chunk) * (1 if layers_in_atom else rs.num_layers)
    return _Move(split, heads, full, per_block, per_block * _atom_bytes(rs, full, split))


def _direct_move(ls: KVCacheSpec, rs: KVCacheSpec, read: Read, chunk: int) -> _Move:
    return _move((rs, ls), read.remote_heads, chunk)


def _staging_move(rs: KVCacheSpec, read: Read) -> _Move:
    """Read the heads needed, or all of the rank's heads when that takes fewer descriptors."""
    options = []
    for heads in dict.fromkeys([read.remote_heads, (0, rs.num_kv_heads)]):
        move = _move((rs,), heads, rs.block_size)
        options.append((Cost("staging", move.descriptors, move.nbytes, 0).score, len(options), move))
    return min(options)[2]


def rank_heads(total: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``(first, count)`` of the KV heads rank ``rank`` of ``tp_size`` holds out of ``total``.

    >>> rank_heads(8, 2, 1), rank_heads(2, 8, 5), rank_heads(1, 4, 3)
    ((4, 4), (1, 1), (0, 1))
    """
    return rank * total // tp_size, max(1, total // tp_size)


# -- reads: which remote ranks hold which of our heads ------------------------------------------

def _reads(local_tp: int, local_rank: int, remote_tp: int, total: int
           ) -> tuple[tuple[Read, ...], tuple[int, ...]]:
    if local_tp >= remote_tp:
        group = [local_rank // (local_tp // remote_tp)]
    else:
        r = remote_tp // local_tp
        group = list(range(local_rank * r, local_rank * r + r))
    need0, need_n = rank_heads(total, local_tp, local_rank)
    covered: set[int] = set()
    reads, notify = [], []
    for s in group:
        p0, pn = rank_heads(total, remote_tp, s)
        lo, hi = max(p0, need0), min(p0 + pn, need0 + need_n)
        if lo < hi and not covered.intersection(range(lo, hi)):
            covered.update(range(lo, hi))
            reads.append(Read(s, (lo - p0, hi - p0), (lo - need0, hi - need0)))
        else:  # a replica of heads already read (replicated KV, MLA): notify only
            notify.append(s)
    if covered != set(range(need0, need0 + need_n)):
        raise AssertionError(f"heads {sorted(covered)} read, {need0}..{need0 + need_n} needed")
    return tuple(reads), tuple(notify)


def build_plan(le: Any, ls: KVCacheSpec, re_: Any, rs: KVCacheSpec, strategy: str = "auto"
               ) -> TransferPlan:
    """The plan for a pair the handshake validated (use :func:`fkv.connector.handshake`)."""
    reads, notify = _reads(le.tp_size, le.tp_rank, re_.tp_size, le.total_num_kv_heads)
    chunk = math.gcd(ls.block_size, rs.block_size)
    direct = tuple(_direct_move(ls, rs, r, chunk) for r in reads)
    staging = tuple(_staging_move(rs, r) for r in reads)
    costs = {
        "direct": Cost("direct", sum(m.descriptors for m in direct), sum(m.nbytes for m in direct), 0),
        "staging": Cost("staging", sum(m.descriptors for m in staging),
                        sum(m.nbytes for m in staging), sum(m.nbytes for m in direct)),
    }
    if strategy == "auto":
        strategy = "staging" if costs["staging"].score < costs["direct"].score else "direct"
    other = "staging" if strategy == "direct" else "direct"
    return TransferPlan(
        local_engine=le, local_spec=ls, remote_engine=re_, remote_spec=rs, reads=reads,
        notify_only_ranks=notify, strategy=strategy,
        moves=direct if strategy == "direct" else staging,
        cost=costs[strategy], alternative=costs[other])


# -- the plan -----------------------------------------------------------------------------------

#: Request shapes (remote blocks, local blocks, tokens) whose rows a plan keeps (then it forgets
#: them all and starts again)
_TEMPLATES = 256


def check_block_ids(name: str, ids: Any, spec: KVCacheSpec, unique: bool) -> np.ndarray:
    """Block ids as int64 numpy, checked against ``spec`` (FkvError naming the first bad one).

    ``name`` is ``'local_block_ids'`` or ``'remote_block_ids'``; ``unique`` refuses a repeated
    block (two tokens would land in one slot). Tensors on any device are accepted.
    """
    side = name.split("_", 1)[0]
    try:
        a = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids)
    except Exception as e:
        raise FkvError(f"{name!r} must be a 1-D sequence of block ids (got {type(ids).__name__}: "
                       f"{e})") from None
    if a.ndim != 1:
        raise FkvError(f"{name!r} must be 1-D (got shape {a.shape})")
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise FkvError(f"{name!r} must hold integers (got dtype {a.dtype})")
    if a.dtype.kind == "u" and a.max() > np.iinfo(np.int64).max:
        raise FkvError(f"{name!r} holds ids beyond int64")
    a = a.astype(np.int64, copy=False)
    if a.min() < 0 or a.max() >= spec.num_blocks:
        bad = np.flatnonzero((a < 0) | (a >= spec.num_blocks))
        raise FkvError(f"{name!r}[{bad[0]}] = {a[bad[0]]} is outside the {side} cache's "
                       f"[0, num_blocks={spec.num_blocks})")
    if unique:
        counts = np.bincount(a, minlength=1) if spec.num_blocks <= 64 * a.size + 4096 else \
            np.unique(a, return_counts=True)[1]
        if counts.max() > 1:
            dup = np.unique(a, return_counts=True)
            raise FkvError(f"{name!r} repeats block {int(dup[0][dup[1] > 1][0])}: two tokens would "
                           f"land in one slot; pass each local block once")
    return a


def request_tokens(local: np.ndarray, remote: np.ndarray, nl_tok: int, nr_tok: int,
                   num_tokens: Any) -> int:
    """The request's token count: ``num_tokens``, or what both id lists hold (0 when both are
    empty); each list must hold exactly the blocks of those tokens (FkvError otherwise)."""
    nl, nr = local.size, remote.size
    if nl == 0 or nr == 0:
        if nl or nr:
            raise FkvError(f"block id lists must both be empty or both non-empty (local {nl}, "
                           f"remote {nr} blocks)")
        return 0
    cap = min(nl * nl_tok, nr * nr_tok)
    if num_tokens is None:
        tokens = cap
    elif isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer) \
            or not 1 <= num_tokens <= cap:
        raise FkvError(f"'num_tokens' must be an int in [1, {cap}] (the capacity of both id lists) "
                       f"(got {num_tokens!r})")
    else:
        tokens = int(num_tokens)
    want_l, want_r = -(-tokens // nl_tok), -(-tokens // nr_tok)
    if (nl, nr) != (want_l, want_r):
        raise FkvError(
            f"local_block_ids has {nl} blocks of {nl_tok} tokens and remote_block_ids {nr} blocks "
            f"of {nr_tok}; {tokens} tokens need {want_l} local and {want_r} remote blocks: pass "
            f"the blocks of the same tokens on both sides")
    return tokens


def _coalesce(cols: np.ndarray) -> np.ndarray:
    """Merge consecutive rows (columns of ``cols``, 6 x M) that continue each other on both sides
    (same remote rank and regions, offsets contiguous on both sides)."""
    if cols.shape[1] < 2:
        return cols
    prev, nxt = cols[:, :-1], cols[:, 1:]
    cont = nxt[2] == prev[2] + prev[5]
    if not cont.any():
        return cols
    cont &= nxt[4] == prev[4] + prev[5]
    cont &= (nxt[0] == prev[0]) & (nxt[1] == prev[1]) & (nxt[3] == prev[3])
    if not cont.any():
        return cols
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    merged = cols[:, starts]
    merged[5] = np.add.reduceat(cols[5], starts)
    return merged


@attrs.frozen(kw_only=True, repr=False, eq=True)
class TransferPlan:
    """Exactly which bytes one decode rank reads, and what runs after (docs/handshake.md, docs/transport.md).

    ``segments(local_block_ids, remote_block_ids)`` is an int64 array ``(M, 6)``: ``remote_rank,
    remote_region, remote_offset, local_region, local_offset, nbytes`` (byte offsets from the start
    of a region: one layer's buffer, or the one cross-layer buffer; ``local_region == -1`` is the
    staging buffer). ``staging_steps`` lists the ``fkv.ops.move`` calls that follow.
    """

    local_engine: Any
    local_spec: KVCacheSpec
    remote_engine: Any
    remote_spec: KVCacheSpec
    reads: tuple[Read, ...]
    notify_only_ranks: tuple[int, ...]
    strategy: str
    moves: tuple[_Move, ...]
    cost: Cost
    alternative: Cost
    #: (remote blocks, local blocks, tokens, staging layers) -> the rows of such a request with
    #: every block id 0 (:meth:`rows`); a cache, not part of the plan's value
    _templates: dict[tuple[int, int, int, int], Any] = attrs.field(
        factory=dict, init=False, eq=False, hash=False, repr=False)

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """P ranks this D rank reads from, in read (and staging mini-cache) order."""
        return tuple(r.remote_rank for r in self.reads)

    @property
    def notifications(self) -> int:
        """Notifications each remote rank expects per request (see :func:`expected_notifications`)."""
        return expected_notifications(self.remote_engine.tp_size, self.local_engine.tp_size)

    @property
    def chunk_tokens(self) -> int:
        """Tokens one direct row spans at most: ``gcd(N_local, N_remote)``; staging: ``N_remote``."""
        if self.strategy == "staging":
            return self.remote_spec.block_size
        return math.gcd(self.local_spec.block_size, self.remote_spec.block_size)

    # -- rows ---------------------------------------------------------------------------------
    def segments(self, local_block_ids: Any, remote_block_ids: Any, *,
                 num_tokens: int | None = None, staging_layers: int | None = None) -> np.ndarray:
        """The READ rows for one request: int64 ``(M, 6)``, coalesced (see the class docstring).

        ``num_tokens`` defaults to the capacity of the shorter id list; each list must hold exactly
        the blocks of those tokens. Direct rows move whole chunks of ``chunk_tokens`` tokens.
        ``staging_layers`` (staging): see :meth:`staging_bytes`.

        >>> from fkv import KVCacheSpec
        >>> from fkv.connector.handshake import EngineDesc, handshake
        >>> s = KVCacheSpec(layout="HND", num_blocks=8, block_size=16, num_kv_heads=2, head_size=128)
        >>> e = lambda tp, r: EngineDesc(engine_id="x", tp_size=tp, tp_rank=r, total_num_kv_heads=8)
        >>> plan = handshake((e(2, 0), s.evolve(num_kv_heads=4)), (e(4, 0), s)).plan  # example B
        >>> plan.segments([0], [0]).tolist()
        [[0, 0, 0, 0, 0, 8192], [0, 0, 8192, 0, 16384, 8192], [1, 0, 0, 0, 8192, 8192], [1, 0, 8192, 0, 24576, 8192]]
        """
        ls, rs = self.local_spec, self.remote_spec
        local = check_block_ids("local_block_ids", local_block_ids, ls, unique=True)
        remote = check_block_ids("remote_block_ids", remote_block_ids, rs, unique=False)
        tokens = request_tokens(local, remote, ls.block_size, rs.block_size, num_tokens)
        return self.rows(local, remote, tokens, staging_layers)

    def rows(self, local: np.ndarray, remote: np.ndarray, tokens: int,
             staging_layers: int | None = None) -> np.ndarray:
        """:meth:`segments` of ids already checked: int64 arrays from :func:`check_block_ids`
        and their :func:`request_tokens` (what a transport calls after its own checks).

        Every byte offset is affine in the block ids, so the rows of a request shape (remote
        blocks, local blocks, tokens) are computed once with every id 0 and kept; a request then
        adds ``id x block stride`` on each side and merges what became contiguous.
        """
        if tokens == 0:
            return np.empty((0, 6), dtype=np.int64)
        key = (remote.size, local.size, tokens, self._staging_layers(staging_layers))
        template = self._templates.get(key)
        if template is None:
            template = self._template(*key)
            if len(self._templates) >= _TEMPLATES:
                self._templates.clear()
            self._templates[key] = template
        cols, r_block, r_step, d_block, d_step = template
        out = cols.copy()
        out[2] += remote[r_block] * r_step
        if d_block is not None:
            out[4] += local[d_block] * d_step
        return _coalesce(out).T

    def _template(self, n: int, n_local: int, tokens: int, staging_layers: int) -> tuple[Any, ...]:
        """The rows of a request of ``n`` remote and ``n_local`` local blocks (``tokens``) whose
        ids are all 0 (columns, 6 x M), each row's remote and local block (an index into the id
        lists; None for staging rows, whose mini-caches do not depend on the ids) and the byte
        stride of one block on each side."""
        ls, rs = self.local_spec, self.remote_spec
        stage = self._stage(n, staging_layers) if self.strategy == "staging" else None
        mini = stage.region_bytes * stage.num_regions if stage else 0
        jobs = []
        for i, (read, move) in enumerate(zip(self.reads, self.moves, strict=True)):
            if stage is None:
                job = (ls, np.zeros(n_local, dtype=np.int64), read.local_heads[0],
                       self.chunk_tokens, None)
            else:
                job = (stage, np.arange(n), move.heads[0], rs.block_size, i * mini)
            jobs.append((read, move, job, _layout_rows(rs, n, move, job[3], tokens)[3]))
        out = np.empty((6, sum(j[3] for j in jobs)), dtype=np.int64)  # columns contiguous
        r_block = np.empty(out.shape[1], dtype=np.int64)
        d_block = np.empty(out.shape[1], dtype=np.int64)
        keep, start = [], 0
        for read, move, (dst, dst_ids, dst_h0, chunk, base), rows in jobs:
            mask = _fill_rows(out[:, start:start + rows], rs, n, move, read.remote_rank, dst,
                              dst_ids, dst_h0, chunk, tokens, base,
                              r_block[start:start + rows], d_block[start:start + rows])
            keep.append(np.ones(rows, dtype=bool) if mask is None else mask)
            start += rows
        if any(m is not None and not m.all() for m in keep):
            kept = np.concatenate(keep)
            out, r_block, d_block = out[:, kept], r_block[kept], d_block[kept]
        r_step = rs.region_and_offset(block=1)[1] - rs.region_and_offset(block=0)[1]
        if stage is not None:
            return out, r_block, r_step, None, 0
        d_step = ls.region_and_offset(block=1)[1] - ls.region_and_offset(block=0)[1]
        return out, r_block, r_step, d_block, d_step

    def staging_steps(self, local_block_ids: Any, remote_block_ids: Any, *,
                      num_tokens: int | None = None,
                      staging_layers: int | None = None) -> tuple[StagingStep, ...]:
        """The ``fkv.ops.move`` calls after the READs (empty for ``direct``): one per remote
        rank read and layer, run as docs/transport.md (staging) says with ``src_block_ids = arange(n)``
        from layer ``stage_layer`` of the step's mini-cache (``staging_layers``: see
        :meth:`staging_bytes`)."""
        ls, rs = self.local_spec, self.remote_spec
        window = self._staging_layers(staging_layers)
        local = check_block_ids("local_block_ids", local_block_ids, ls, unique=True)
        remote = check_block_ids("remote_block_ids", remote_block_ids, rs, unique=False)
        tokens = request_tokens(local, remote, ls.block_size, rs.block_size, num_tokens)
        if self.strategy != "staging" or tokens == 0:
            return ()
        stage = self._stage(remote.size, window)
        mini = stage.region_bytes * stage.num_regions
        mla = rs.is_mla
        return tuple(
            StagingStep(i, stage, i * mini, layer, None if mla else read.remote_heads,
                        None if mla else read.local_heads, tokens)
            for i, read in enumerate(self.reads) for layer in range(ls.num_layers))

    def staging_bytes(self, num_remote_blocks: int, staging_layers: int | None = None) -> int:
        """Bytes of staging buffer a read of ``num_remote_blocks`` remote blocks needs (0: direct).

        ``staging_layers=k`` (1 to ``num_layers``; default all): the buffer holds ``k`` layers of
        the request at once, layer ``L`` in the mini-caches' layer ``L % k``, for a read that
        moves at most ``k`` consecutive layers before their moves run (a read, whole or
        streamed, of a request whose every layer would not fit). :meth:`segments` and
        :meth:`staging_steps` given the same ``k`` address that buffer."""
        if isinstance(num_remote_blocks, bool) or not isinstance(num_remote_blocks, int | np.integer) \
                or num_remote_blocks < 0:
            raise FkvError(f"'num_remote_blocks' must be a non-negative int (got {num_remote_blocks!r})")
        window = self._staging_layers(staging_layers)
        if self.strategy != "staging" or num_remote_blocks == 0:
            return 0
        stage = self._stage(int(num_remote_blocks), window)
        return len(self.reads) * stage.region_bytes * stage.num_regions

    def _staging_layers(self, staging_layers: int | None) -> int:
        """``staging_layers`` checked (FkvError), None meaning every layer."""
        total = self.remote_spec.num_layers
        if staging_layers is None:
            return total
        if isinstance(staging_layers, bool) or not isinstance(staging_layers, int | np.integer) \
                or not 1 <= staging_layers <= total:
            raise field_error("staging_layers", staging_layers,
                              f"an int from 1 to the spec's num_layers={total}")
        if staging_layers < total and self.remote_spec.cross_layer:
            raise field_error("staging_layers", staging_layers, f"{total} (all layers)",
                              "a staging buffer of fewer layers needs per-layer prefill caches "
                              "(each row then lies in one layer's region)")
        return int(staging_layers)

    def _stage(self, n: int, staging_layers: int) -> KVCacheSpec:
        """The staging mini-cache of ``n`` remote blocks holding ``staging_layers`` layers."""
        return self.remote_spec.evolve(num_blocks=n, num_layers=staging_layers)

    # -- printing -----------------------------------------------------------------------------
    def describe(self) -> str:
        """Human summary: who reads what, the strategy chosen, its bytes and descriptors, and the
        alternative's."""
        le, re_, ls, rs = self.local_engine, self.remote_engine, self.local_spec, self.remote_spec
        if ls.is_mla:
            heads = "MLA: one latent vector per token, held whole by every rank"
        else:
            heads = (f"{le.total_num_kv_heads} KV heads total, {ls.num_kv_heads} per decode rank, "
                     f"{rs.num_kv_heads} per prefill rank")
        reads = "; ".join(
            f"P{r.remote_rank} (whole latent)" if ls.is_mla else
            f"P{r.remote_rank} heads [{r.remote_heads[0]}, {r.remote_heads[1]}) -> local heads "
            f"[{r.local_heads[0]}, {r.local_heads[1]})" + (
                f" (staging reads its heads [{m.heads[0]}, {m.heads[1]}))" if m.heads != r.remote_heads
                else "")
            for r, m in zip(self.reads, self.moves, strict=True))
        notify = ", ".join(f"P{r}" for r in self.notify_only_ranks) or "none"
        how = ("every row lands final bytes in the local cache" if self.strategy == "direct" else
               "rows read into staging mini-caches (local_region -1), then staging_steps run one "
               "move per read and layer")
        lines = [
            f"decode rank {le.tp_rank} of tp {le.tp_size} <- prefill tp {re_.tp_size}: {heads}",
            f"local:  {ls!r}",
            f"remote: {rs!r}",
            f"reads: {reads}",
            f"notify only: {notify}; each prefill rank frees a request after {self.notifications} "
            f"notification{'s' if self.notifications != 1 else ''}",
            f"strategy {self.cost}; {how}",
            f"alternative {self.alternative}",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"TransferPlan(strategy={self.strategy!r}, remote_ranks={self.remote_ranks}, "
                f"notify_only_ranks={self.notify_only_ranks}, reads={list(self.reads)!r}, "
                f"descriptors={self.cost.descriptors}, nbytes={self.cost.nbytes})")

    def __str__(self) -> str:
        return self.describe()

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.describe())}</pre>"


def _layout_rows(rs: KVCacheSpec, nblocks: int, move: _Move, chunk: int, tokens: int
                 ) -> tuple[tuple[str, ...], dict[str, int], dict[str, np.ndarray], int]:
    """The iteration grid of one read's rows, in the remote's physical order (layers outermost
    when per-layer): axes, their counts, one broadcastable index array per axis, rows kept."""
    axes = rs.physical_axes if rs.cross_layer else ("L", *rs.physical_axes)
    nh = move.heads[1] - move.heads[0]
    n_r = rs.block_size
    in_atom = {a for a, _ in move.full if a not in move.split}
    counts = {"L": 1 if "L" in in_atom else rs.num_layers, "B": nblocks,
              "N": n_r if "N" in move.split else n_r // chunk,
              "two": 2 if "two" in move.split else 1, "H": nh if "H" in move.split else 1, "C": 1}
    grid = {}
    for k, a in enumerate(axes):
        shape = [1] * len(axes)
        shape[k] = counts[a]
        grid[a] = np.arange(counts[a], dtype=np.int64).reshape(shape)
    return axes, counts, grid, math.prod(counts[a] for a in axes)


def _fill_rows(out: np.ndarray, rs: KVCacheSpec, n: int, move: _Move, rank: int,
               dst: KVCacheSpec, dst_ids: np.ndarray, dst_h0: int, chunk: int, tokens: int,
               base: int | None, r_index: np.ndarray, d_index: np.ndarray) -> np.ndarray:
    """Write the rows of one read of ``n`` remote blocks, every remote id 0, into ``out`` (6 x
    rows), and each row's remote block (``r_index``, an index into the request's remote ids) and
    block of ``dst_ids`` (``d_index``); returns the mask of rows to keep (or None).

    Offsets are affine in every index, so each side's offset is the sum of a per-block term, a
    per-token term and an in-page term, each from ``region_and_offset``: the full-size arrays are
    built with one or two broadcast adds instead of per-element index arithmetic. The remote
    per-block term is the request's to add (``TransferPlan.rows``).
    """
    axes, counts, grid, _ = _layout_rows(rs, n, move, chunk, tokens)
    shape = tuple(counts[a] for a in axes)
    layer, jb = grid["L"], grid["B"]
    pos = grid["N"] if "N" in move.split else grid["N"] * chunk
    kv, h = grid.get("two", 0), grid.get("H", 0)
    n_r, n_d = rs.block_size, dst.block_size
    tok = jb * n_r + pos  # token index in the request (B x N grid)

    def col(k: int) -> np.ndarray:  # a contiguous row of ``out`` viewed as the grid
        return out[k].reshape(shape)

    col(0)[...] = rank
    rreg, r_page = rs.region_and_offset(layer=layer, kv=kv, head=move.heads[0] + h)
    r_tok = rs.region_and_offset(token=np.arange(n_r))[1]      # per slot
    col(1)[...] = rreg
    np.add(r_tok[pos], r_page, out=col(2))
    # a staging mini-cache of fewer layers than the request holds layer L at L % its layers
    dreg, d_page = dst.region_and_offset(layer=layer if base is None else layer % dst.num_layers,
                                         kv=kv, head=dst_h0 + h)
    d_block = dst.region_and_offset(block=dst_ids)[1]
    d_tok = dst.region_and_offset(token=np.arange(n_d))[1]
    d_of = jb if n_d == n_r else np.minimum(tok // n_d, dst_ids.size - 1)  # each row's dst block
    d_bt = d_block[d_of] + (d_tok[pos] if n_d == n_r else d_tok[tok % n_d])
    r_index.reshape(shape)[...] = jb
    d_index.reshape(shape)[...] = d_of
    if base is not None:  # staging mini-cache: regions laid one after another from ``base``
        d_page = d_page + (base + dreg * dst.region_bytes)
        dreg = -1
    col(3)[...] = dreg
    np.add(d_bt, d_page, out=col(4))
    out[5] = _atom_bytes(rs, move.full, move.split)
    if tokens < n * n_r:
        return np.broadcast_to(tok < tokens, shape).reshape(-1)
    return None
