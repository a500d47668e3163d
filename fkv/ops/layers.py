"""Every layer of a request in one launch: a prepared move between two fixed sets of layer views.

``fkv.ops.move`` moves one layer per call; a transfer moves the same tokens of every layer, and at
32 layers the per-call host cost (validation, launch) is most of a small request's time.
:class:`LayerMove` validates the two sides once, keeps a device table of each side's layer
addresses, and then moves any request's tokens of all layers with one launch of the move kernel
(grid axis 1 runs over K/V halves × layers; each program reads its layer's base from the table).
The layers may live anywhere: separate allocations, one cross-layer buffer, a pack buffer, or a
peer's caches mapped into this process (CUDA IPC), as long as every view is on this device.

The table holds each layer's element offset from layer 0 (any sign), so the kernel only ever
adds offsets to a real tensor pointer. On CPU outside ``TRITON_INTERPRET=1`` it loops over
``fkv.ops.reference.move`` per layer.

>>> import torch, fkv
>>> a = fkv.KVCacheSpec(layout="NHD", num_blocks=4, block_size=4, num_kv_heads=2, head_size=8,
...                     num_layers=3)
>>> b = a.evolve(layout="HND")
>>> src, dst = fkv.allocate(a), fkv.allocate(b)
>>> for v in src: _ = v.copy_(torch.randn(v.shape))
>>> mover = LayerMove(src, a, dst, b)
>>> mover([3, 1], [0, 2])
>>> all(torch.equal(dst[l][2], src[l][1]) for l in range(3))
True
"""

from __future__ import annotations

import operator
import os
from typing import Any

from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec
from fkv.ops._spec import check_cache
from fkv.tensors import require_torch

__all__ = ["LayerMove", "PreparedMove"]


def _views(x: Any, spec: KVCacheSpec, name: str) -> list[Any]:
    torch = require_torch()
    if isinstance(x, torch.Tensor):
        x = [x]
    if not isinstance(x, (list, tuple)) or not x:
        raise field_error(name, type(x).__name__, "a non-empty list of layer views")
    for i, v in enumerate(x):
        if not isinstance(v, torch.Tensor):
            raise field_error(f"{name}[{i}]", type(v).__name__, "a tensor")
        check_cache(v, spec, f"{name}[{i}]")
        if v.device != x[0].device:
            raise FkvError(f"{name!r}: layer {i} is on {v.device} but layer 0 on {x[0].device}; "
                           f"all layers must be on one device")
    return list(x)


class LayerMove:
    """Move tokens of every layer from ``src`` (views per ``src_spec``) into ``dst`` in one launch.

    ``src``/``dst``: equally long lists of one-layer logical views (``fkv.allocate`` style; any
    addresses). ``src_heads``/``dst_heads``: contiguous head ranges of equal length (as for
    ``fkv.ops.move``). Call with ``(src_block_ids, dst_block_ids, num_tokens=None)``; ids are
    int tensors on the device (or sequences), ids outside a cache move nothing (masked).
    ``validate`` as in ``fkv.ops.move``: range-checks the ids and refuses a destination block
    listed twice, or (when a ``dst`` view is a ``src`` view itself) one that is also a source
    block.
    """

    def __init__(self, src: Any, src_spec: KVCacheSpec, dst: Any, dst_spec: KVCacheSpec, *,
                 src_heads: Any = None, dst_heads: Any = None) -> None:
        from fkv.ops.relayout import _heads, _same_view

        torch = require_torch()
        for name, spec in (("src_spec", src_spec), ("dst_spec", dst_spec)):
            if not isinstance(spec, KVCacheSpec):
                raise field_error(name, type(spec).__name__, "a KVCacheSpec")
        for what in ("is_mla", "head_size", "dtype"):
            a, b = getattr(src_spec, what), getattr(dst_spec, what)
            if a != b:
                raise FkvError(f"LayerMove: src and dst must agree on {what}: src_spec.{what} is "
                               f"{a!r}, dst_spec.{what} is {b!r}")
        self.src, self.dst = _views(src, src_spec, "src"), _views(dst, dst_spec, "dst")
        if len(self.src) != len(self.dst):
            raise FkvError(f"LayerMove: 'src' holds {len(self.src)} layers but 'dst' "
                           f"{len(self.dst)}; pass the same layers on both sides")
        self.device = self.dst[0].device
        if self.src[0].device != self.device:
            raise FkvError(f"'src' is on {self.src[0].device} but 'dst' on {self.device}; map or "
                           f"move the source to the destination's device first")
        self.src_spec, self.dst_spec = src_spec, dst_spec
        sa, sb = _heads(src_heads, src_spec, "src_heads")
        da, db = _heads(dst_heads, dst_spec, "dst_heads")
        if sb - sa != db - da:
            raise FkvError(f"'src_heads' {(sa, sb)} selects {sb - sa} heads but 'dst_heads' "
                           f"{(da, db)} selects {db - da}; both ranges must have the same length")
        self.src_heads, self.dst_heads = (sa, sb), (da, db)
        # A dst view that is a src view itself (heads overlapping): its destination blocks must
        # not be source blocks (checked per call with the ids' values).
        self._aliased = sa < db and da < sb and any(_same_view(a, b) for a in self.src
                                                    for b in self.dst)
        self.triton = self.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        self._tables = []
        for views, spec in ((self.src, src_spec), (self.dst, dst_spec)):
            deltas = [v.data_ptr() - views[0].data_ptr() for v in views]
            if any(d % spec.itemsize for d in deltas):
                raise FkvError("LayerMove: layer views must lie a whole number of elements apart")
            self._tables.append(torch.tensor([d // spec.itemsize for d in deltas],
                                             dtype=torch.int64, device=self.device))

    @property
    def num_layers(self) -> int:
        return len(self.src)

    def _layer_range(self, layers: Any) -> tuple[int, int]:
        """``(start, stop)`` of ``layers``: None (every layer) or a pair of ints (not bools) with
        ``0 <= start <= stop <= num_layers`` (an empty range moves nothing)."""
        if layers is None:
            return 0, self.num_layers
        expected = f"(start, stop) ints with 0 <= start <= stop <= {self.num_layers}"
        try:
            if (not isinstance(layers, (tuple, list)) or len(layers) != 2
                    or any(isinstance(v, bool) for v in layers)):
                raise TypeError
            start, stop = (operator.index(v) for v in layers)
        except TypeError:
            raise field_error("layers", layers, expected) from None
        if not 0 <= start <= stop <= self.num_layers:
            raise field_error("layers", layers, expected)
        return start, stop

    def __call__(self, src_block_ids: Any, dst_block_ids: Any, num_tokens: int | None = None,
                 *, validate: bool | None = None, layers: tuple[int, int] | None = None) -> None:
        """Move the tokens of layers ``layers = (start, stop)`` (default: every layer)."""
        self.prepare(src_block_ids, dst_block_ids, num_tokens, validate=validate,
                     layers=layers)(layers)

    def prepare(self, src_block_ids: Any, dst_block_ids: Any, num_tokens: int | None = None,
                *, validate: bool | None = None, layers: Any = None) -> PreparedMove:
        """Check one request's ids once (as a call does); the returned :class:`PreparedMove`
        then moves any range of its layers with little host work per call, as a streaming read
        does layer after layer. ``layers`` is checked here too when given (else per call)."""
        from fkv.ops.relayout import _block_ids, _check_dst_ids, _num_tokens

        s, d = self.src_spec, self.dst_spec
        sids = _block_ids(src_block_ids, s, "src_block_ids", self.device, validate)
        dids = _block_ids(dst_block_ids, d, "dst_block_ids", self.device, validate)
        cap_s, cap_d = sids.count * s.block_size, dids.count * d.block_size
        n = _num_tokens(num_tokens, cap_s, {f"the {sids.count} src_block_ids": cap_s,
                                            f"the {dids.count} dst_block_ids": cap_d})
        if layers is not None:
            self._layer_range(layers)
        _check_dst_ids(sids, s.block_size, dids, d.block_size, n,
                       ("src_block_ids", "dst_block_ids"), self._aliased)
        return PreparedMove(self, sids.tensor, dids.tensor, n)


class PreparedMove:
    """One request's move between a :class:`LayerMove`'s two sides, its ids checked: call with
    ``layers = (start, stop)`` (default every layer). Each layer range's launch (site, grid,
    addresses) is kept after its first call, so a repeated range costs a dict lookup and
    Triton's compiled launcher. Holds the id tensors: they must not change while it is used."""

    __slots__ = ("move", "src_ids", "dst_ids", "num_tokens", "_launches")

    def __init__(self, move: LayerMove, src_ids: Any, dst_ids: Any, num_tokens: int) -> None:
        self.move, self.src_ids, self.dst_ids, self.num_tokens = move, src_ids, dst_ids, num_tokens
        self._launches: dict[tuple[int, int] | None, tuple[Any, ...]] = {}

    def __call__(self, layers: tuple[int, int] | None = None) -> None:
        entry = None
        if layers is None or (type(layers) is tuple and len(layers) == 2 and type(layers[0]) is int
                              and type(layers[1]) is int):  # (True, 2) must not hit (1, 2)
            entry = self._launches.get(layers)
        if entry is None:
            span = self.move._layer_range(layers)
            entry = self._prepare(span)
            if entry is None:
                return
            self._launches[span] = entry
            if layers is None:
                self._launches[None] = entry  # type: ignore[index]
        site, grid, args, pointers = entry
        site(grid, args, pointers)

    def _prepare(self, span: tuple[int, int]) -> tuple[Any, ...] | None:
        """The launch of layers ``span`` (kept), or None after moving them another way."""
        move, n = self.move, self.num_tokens
        start, stop = span
        if n <= 0 or start == stop:
            return None
        s, d = move.src_spec, move.dst_spec
        if not move.triton:
            from fkv.ops.reference import move as reference_move

            for a, b in zip(move.src[start:stop], move.dst[start:stop], strict=True):
                reference_move(a, s, self.src_ids, b, d, self.dst_ids,
                               src_heads=move.src_heads, dst_heads=move.dst_heads, num_tokens=n)
            return None
        from fkv.ops._move_kernel import move_args, move_site

        sids, dids = self.src_ids, self.dst_ids
        site, grid = move_site(s, d, None if sids is None else sids.dtype,
                               None if dids is None else dids.dtype, move.src_heads[0],
                               move.dst_heads[0], move.src_heads[1] - move.src_heads[0], n,
                               layers=(stop - start, "table", "table"))
        args = move_args(move.src[0], sids, move.dst[0], dids,
                         tuple(t[start:stop] for t in move._tables), n)
        return site, grid, args, [a.data_ptr() for a in args[:6]]
