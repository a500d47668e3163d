"""The layout algebra: the one module that knows axes, stride orders, shapes, strides and offsets.

Everything else in fkv (kernels, launchers, references, the handshake planner, tests) asks this
module for permutations, offsets and strides; nothing else branches on ``layout == "NHD"``.

Canonical axis names (outermost-first letters of the engine vocabulary):

====== =========================================
``L``  layers (only in a cross-layer buffer)
``B``  blocks
``two`` the K/V selector (absent for MLA)
``N``  tokens in a block
``H``  KV heads held by this rank (absent for MLA)
``C``  channels: head_size (MLA: latent + rope)
====== =========================================

A backend's *logical shape* is the order its kernels index by; a *stride order* ``p`` says physical
dim ``k`` is logical dim ``p[k]`` (docs/layouts.md).  A spec allocates its physical shape contiguously and
views it with the inverse permutation.

>>> spec = KVCacheSpec(layout="HND", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128)
>>> spec.logical_shape, spec.stride_order, spec.physical_shape
((4, 2, 16, 8, 128), (0, 1, 3, 2, 4), (4, 2, 8, 16, 128))
>>> spec.element_strides
(32768, 16384, 128, 2048, 1)
"""

from __future__ import annotations

import enum
import functools
import html
import itertools
import math
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import attrs

from fkv.errors import FkvError, field_error

__all__ = [
    "AXES",
    "BACKENDS",
    "DTYPES",
    "DTYPE_ALIASES",
    "KVCacheSpec",
    "Layout",
    "canonical_dtype",
    "rearrange_pattern",
]

AXES = ("L", "B", "two", "N", "H", "C")
BACKENDS = ("triton", "flashinfer", "flash_attn", "mla")
#: torch dtype name -> bytes per element
DTYPES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
#: engine kv-cache dtype names (vLLM's ``kv_cache_dtype``) -> torch dtype name
DTYPE_ALIASES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp8_inc": "float8_e4m3fn",  # the Intel Neural Compressor name of the same e4m3 format
}


class Layout(enum.StrEnum):
    """Where the heads sit relative to the tokens of a block: ``NHD`` (token-major) or ``HND``."""

    NHD = "NHD"
    HND = "HND"

    def __repr__(self) -> str:
        return f"Layout.{self.value}"

    @classmethod
    def parse(cls, value: Layout | str) -> Layout:
        """Normalize a layout name or an engine alias.

        >>> Layout.parse("hnd"), Layout.parse("LBNHC"), Layout.parse("BHLNC")
        (Layout.HND, Layout.NHD, Layout.HND)
        """
        if isinstance(value, Layout):
            return value
        if not isinstance(value, str):
            raise field_error("layout", value, f"a Layout or one of {_ALIAS_HELP}")
        key = value.strip().upper()
        if key in _ALIASES:
            return _ALIASES[key]
        raise field_error("layout", value, f"in ('NHD', 'HND') or an alias in {_ALIAS_HELP}")


# Engine vocabulary (docs/layouts.md).  Letters are outermost-first; the K/V selector is not named.
# A name maps to fkv's layout of that N/H order; the physical order a spec allocates is fkv's (the
# stride-order table), and a buffer laid out otherwise is refused at its strides (infer_spec,
# the kernels' and the transport's checks), never read by its name.
_ALIASES = {
    "NHD": Layout.NHD,
    "HND": Layout.HND,
    "LBNHC": Layout.NHD,  # per-layer NHD
    "LBHNC": Layout.HND,  # per-layer HND
    "LHBNC": Layout.HND,  # per-layer, heads outermost: fkv's per-layer HND (blocks outside heads)
    "BLNHC": Layout.NHD,  # cross-layer, blocks first, NHD: fkv's NHD + cross_layer
    "BLHNC": Layout.HND,  # cross-layer, blocks first, HND: fkv's HND + cross_layer (BHLNC order)
    "BHLNC": Layout.HND,  # cross-layer, blocks first, heads outside layers: fkv's HND + cross_layer
}
_ALIAS_HELP = "('NHD', 'HND', 'LBNHC', 'LBHNC', 'LHBNC', 'BLNHC', 'BLHNC', 'BHLNC')"
#: Aliases that name one buffer of all layers: a spec takes them only with ``cross_layer=True``
#: (the alias alone cannot say it to ``Layout``, which has no layers).
_CROSS_LAYER_ALIASES = {"BLNHC": "LBNHC", "BLHNC": "LBHNC", "BHLNC": "LBHNC"}


def names_cross_layer(value: Any) -> bool:
    """Whether ``value`` is an engine alias naming one buffer of all layers (``BLNHC``,
    ``BHLNC``): a :class:`KVCacheSpec` takes it only with ``cross_layer=True``.

    >>> names_cross_layer("BLNHC"), names_cross_layer("LBNHC"), names_cross_layer(Layout.NHD)
    (True, False, False)
    """
    return isinstance(value, str) and value.strip().upper() in _CROSS_LAYER_ALIASES

# Logical axes of one layer, per backend family (the docs/layouts.md table).
_LOGICAL_AXES = {
    "triton": ("B", "two", "N", "H", "C"),
    "flashinfer": ("B", "two", "N", "H", "C"),
    "flash_attn": ("two", "B", "N", "H", "C"),
    "mla": ("B", "N", "C"),
}
# (backend, layout, cross_layer) -> stride order, exactly the docs/layouts.md table.
_STRIDE_ORDERS = {
    ("blocks_first", Layout.NHD, False): (0, 1, 2, 3, 4),
    ("blocks_first", Layout.HND, False): (0, 1, 3, 2, 4),
    ("blocks_first", Layout.NHD, True): (1, 0, 2, 3, 4, 5),
    ("blocks_first", Layout.HND, True): (1, 2, 4, 0, 3, 5),
    ("flash_attn", Layout.NHD, False): (0, 1, 2, 3, 4),
    ("flash_attn", Layout.HND, False): (0, 1, 3, 2, 4),
    ("flash_attn", Layout.NHD, True): (2, 0, 1, 3, 4, 5),
    ("flash_attn", Layout.HND, True): (2, 4, 0, 1, 3, 5),
    ("mla", Layout.NHD, False): (0, 1, 2),
    ("mla", Layout.NHD, True): (1, 0, 2, 3),
}
_FAMILY = {"triton": "blocks_first", "flashinfer": "blocks_first", "flash_attn": "flash_attn", "mla": "mla"}


def _check_positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise field_error(attribute.name, value, "a positive int")


def _check_backend(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in BACKENDS:
        raise field_error("backend", value, f"in {BACKENDS}")


def _normalize_dtype(value: Any) -> Any:
    # Accept torch dtypes (``torch.bfloat16``) without importing torch: their str() is "torch.<name>".
    if not isinstance(value, str):
        value = str(value)
    value = value.removeprefix("torch.")
    return DTYPE_ALIASES.get(value, value)


def _check_dtype(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in DTYPES:
        raise _dtype_error(value)


def _dtype_error(value: Any) -> FkvError:
    if value == "auto":
        return field_error("dtype", value, f"in {tuple(DTYPES)} or an engine name in "
                           f"{tuple(DTYPE_ALIASES)}", "'auto' means the model's dtype, which a "
                           "cache spec cannot know: pass that dtype (e.g. 'bfloat16')")
    if value == "fp8_ds_mla":
        return field_error("dtype", value, f"in {tuple(DTYPES)} or an engine name in "
                           f"{tuple(DTYPE_ALIASES)}", "'fp8_ds_mla' is a packed DeepSeek MLA entry "
                           "(fp8 latent, its float32 tile scales and a bf16 rope part in 656 "
                           "bytes per token), not one element type; fkv does not lay it out: "
                           "use backend='mla' with dtype 'fp8' or 'bfloat16'")
    return field_error("dtype", value, f"in {tuple(DTYPES)} or an engine name in "
                       f"{tuple(DTYPE_ALIASES)}")


def canonical_dtype(value: Any) -> str:
    """The torch dtype name of a spec dtype: a name, an engine alias or a torch dtype.

    >>> canonical_dtype("fp8"), canonical_dtype("fp8_e5m2"), canonical_dtype("torch.bfloat16")
    ('float8_e4m3fn', 'float8_e5m2', 'bfloat16')
    """
    name = _normalize_dtype(value)
    if name not in DTYPES:
        raise _dtype_error(name)
    return name


def _normalize_layout(value: Any, self_: Any) -> Layout:
    layout = Layout.parse(value)
    # MLA has no head dim: the layout is meaningless and normalized so equal caches compare equal.
    return Layout.NHD if getattr(self_, "backend", None) == "mla" else layout


def _check_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise field_error(attribute.name, value, "a bool")


@attrs.frozen(kw_only=True, repr=False, cache_hash=True)
class KVCacheSpec:
    """The memory layout of one rank's paged KV cache, as an immutable, hashable value.

    Shapes per backend (one layer; ``cross_layer`` prepends ``L`` to the stride order):

    - triton, flashinfer: logical ``(NB, 2, N, H, D)``; NHD physical ``(NB, 2, N, H, D)``,
      HND physical ``(NB, 2, H, N, D)``.
    - flash_attn: logical ``(2, NB, N, H, D)``; HND physical ``(2, NB, H, N, D)``.
    - mla: logical ``(NB, N, D)`` (one latent vector per token; ``num_kv_heads`` must be 1).

    >>> KVCacheSpec(backend="flash_attn", layout="HND", num_blocks=2, block_size=16,
    ...             num_kv_heads=8, head_size=128, num_layers=4, cross_layer=True).physical_shape
    (2, 8, 4, 2, 16, 128)
    """

    backend: str = attrs.field(default="triton", validator=_check_backend)
    layout: Layout = attrs.field(
        default=Layout.NHD, converter=attrs.Converter(_normalize_layout, takes_self=True)
    )
    num_blocks: int = attrs.field(validator=_check_positive_int)
    block_size: int = attrs.field(validator=_check_positive_int)
    num_kv_heads: int = attrs.field(validator=_check_positive_int)
    head_size: int = attrs.field(validator=_check_positive_int)
    # torch dtype names; engine names ("fp8", "fp8_e4m3", "fp8_e5m2") normalize to them
    dtype: str = attrs.field(default="bfloat16", converter=_normalize_dtype, validator=_check_dtype)
    num_layers: int = attrs.field(default=1, validator=_check_positive_int)
    cross_layer: bool = attrs.field(default=False, validator=_check_bool)

    def __attrs_pre_init__(self, *, layout: Any, cross_layer: Any, **_: Any) -> None:
        # a cross-layer alias with per-layer buffers is two answers to one question: refuse it
        if cross_layer is not True and names_cross_layer(layout):
            per_layer = _CROSS_LAYER_ALIASES[layout.strip().upper()]
            raise field_error(
                "cross_layer", cross_layer, f"True with the layout alias {layout!r}, which names "
                f"one buffer of all layers",
                f"pass cross_layer=True, or layout={Layout.parse(layout).value!r} (alias "
                f"{per_layer!r}) for a buffer per layer")

    def __attrs_post_init__(self) -> None:
        if self.backend == "mla" and self.num_kv_heads != 1:
            raise field_error(
                "num_kv_heads", self.num_kv_heads, "1 for backend 'mla' (one latent vector per token)",
                "pass num_kv_heads=1 and the latent width (e.g. 576) as head_size",
            )

    def __repr__(self) -> str:
        extra = ""
        if self.num_layers != 1:
            extra += f", num_layers={self.num_layers}"
        if self.cross_layer:
            extra += ", cross_layer=True"
        return (
            f"KVCacheSpec(backend={self.backend!r}, layout={self.layout.value!r}, "
            f"num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, dtype={self.dtype!r}{extra})"
        )

    def _repr_html_(self) -> str:
        """Notebook display: the spec and its derived shapes as a small table."""
        rows = (("backend", self.backend), ("layout", self.layout.value),
                ("logical shape", self.logical_shape), ("stride order", self.stride_order),
                ("physical axes", " ".join(self.physical_axes)),
                ("physical shape", self.physical_shape), ("strides (elements)", self.element_strides),
                ("dtype", self.dtype), ("page bytes", f"{self.page_bytes:,}"),
                ("regions", f"{self.num_regions} x {self.region_bytes:,} B"))
        body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                       f"<td><code>{html.escape(str(v))}</code></td></tr>" for k, v in rows)
        return f"<table><caption><code>{html.escape(repr(self))}</code></caption>{body}</table>"

    def __rich_repr__(self) -> Any:
        yield "backend", self.backend
        yield "layout", self.layout.value
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_size", "dtype"):
            yield name, getattr(self, name)
        yield "num_layers", self.num_layers, 1
        yield "cross_layer", self.cross_layer, False

    # -- derived values (all pure, cached per spec) -------------------------------------------
    @property
    def family(self) -> str:
        """``"blocks_first"`` (triton, flashinfer), ``"flash_attn"`` (K/V first) or ``"mla"``."""
        return _FAMILY[self.backend]

    @property
    def is_mla(self) -> bool:
        return self.backend == "mla"

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def logical_axes(self) -> tuple[str, ...]:
        """Axis names of one layer's logical view, e.g. ``('B', 'two', 'N', 'H', 'C')``."""
        return _LOGICAL_AXES[self.backend]

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """One layer's logical shape, e.g. triton ``(NB, 2, N, H, D)``; mla ``(NB, N, D)``."""
        return tuple(self.axis_sizes[a] for a in self.logical_axes)

    @property
    def stride_order(self) -> tuple[int, ...]:
        """The stride order (docs/layouts.md); with ``cross_layer`` the one-longer tuple over ``(L, *logical)``."""
        return _STRIDE_ORDERS[(self.family, self.layout, self.cross_layer)]

    @property
    def physical_axes(self) -> tuple[str, ...]:
        """Axis names of the allocated buffer, outermost first (with ``L`` when cross_layer)."""
        return _physical_axes(self.backend, self.layout, self.cross_layer)

    @property
    def physical_shape(self) -> tuple[int, ...]:
        """Shape of the allocated buffer: one layer's, or all layers' when ``cross_layer``."""
        return _addressing(self).shape

    @property
    def axis_sizes(self) -> Mapping[str, int]:
        """Size of every axis this spec has (read-only), e.g. ``{'L': 1, 'B': 8, 'two': 2, ...}``."""
        return _addressing(self).sizes

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (K and V together)."""
        kv = 1 if self.is_mla else 2
        return kv * self.block_size * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def num_regions(self) -> int:
        """Registered regions: one per layer, or one buffer for all layers when ``cross_layer``."""
        return 1 if self.cross_layer else self.num_layers

    @property
    def region_bytes(self) -> int:
        """Bytes of one region (a layer's buffer, or the one cross-layer buffer)."""
        return math.prod(self.physical_shape) * self.itemsize

    @property
    def axis_strides(self) -> dict[str, int]:
        """Element stride of every axis in the buffer that holds it (``L`` present when cross_layer)."""
        return _addressing(self).strides

    @property
    def element_strides(self) -> tuple[int, ...]:
        """Strides (elements) of one layer's logical view, as ``fkv.allocate`` returns it."""
        st = self.axis_strides
        return tuple(st[a] for a in self.logical_axes)

    @property
    def layer_stride(self) -> int:
        """Elements between consecutive layers inside the cross-layer buffer (0 when per-layer)."""
        return self.axis_strides["L"] if self.cross_layer else 0

    def evolve(self, **changes: Any) -> KVCacheSpec:
        """A copy with ``changes`` applied (validated like the constructor)."""
        unknown = set(changes) - {f.name for f in attrs.fields(KVCacheSpec)}
        if unknown:
            raise FkvError(f"evolve: unknown field(s) {sorted(unknown)}; fields are "
                           f"{[f.name for f in attrs.fields(KVCacheSpec)]}")
        return attrs.evolve(self, **changes)

    # -- addressing -------------------------------------------------------------------------
    def region_and_offset(self, *, layer: Any = 0, block: Any = 0, kv: Any = 0, token: Any = 0,
                          head: Any = 0, channel: Any = 0) -> tuple[Any, Any]:
        """(region index, byte offset inside that region) of one element; numpy arrays broadcast.

        >>> s = KVCacheSpec(layout="HND", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128)
        >>> s.region_and_offset(block=1, kv=1, head=4)
        (0, 114688)
        """
        st = self.axis_strides
        off = block * st["B"] + token * st["N"] + channel * st["C"]
        if not self.is_mla:
            off = off + kv * st["two"] + head * st["H"]
        if self.cross_layer:
            return 0 * layer, (off + layer * st["L"]) * self.itemsize
        return layer, off * self.itemsize

    def span(self, **ranges: tuple[int, int] | int) -> tuple[int, int] | None:
        """Byte ``(offset, length)`` of a box of elements inside one region, or None if not contiguous.

        ``ranges`` maps axis names (``L B two N H C``) to an index or a ``(start, stop)`` range; an
        axis not named is taken whole (``L`` defaults to layer 0 of its region).

        >>> s = KVCacheSpec(layout="HND", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128)
        >>> s.span(B=0, two=0, H=(4, 8))   # heads 4..7 of block 0's K half
        (16384, 16384)
        >>> s.evolve(layout="NHD").span(B=0, two=0, H=(4, 8)) is None
        True
        """
        axes = _span_axes(self)
        for name in ranges:
            if name not in self.axis_sizes:
                raise FkvError(f"span: axes {sorted(set(ranges) - set(self.axis_sizes))} are not "
                               f"axes of {self.backend!r} (axes: {tuple(self.axis_sizes)})")
        offset, length, partial_seen, contiguous = 0, 1, False, True
        # Contiguous iff, innermost outward: full axes, then at most one partial axis, then extent 1.
        for axis, size, stride in axes:
            r = ranges.get(axis)
            if r is None:
                lo, hi = (0, 1) if axis == "L" else (0, size)
            elif isinstance(r, int):
                lo, hi = r, r + 1
            else:
                lo, hi = r
            if not 0 <= lo < hi <= size:
                raise FkvError(f"span: {axis}={r!r} outside [0, {size})")
            extent = hi - lo
            if partial_seen and extent != 1:
                contiguous = False
            if extent != size:
                partial_seen = True
            offset += lo * stride
            length *= extent
        return (offset * self.itemsize, length * self.itemsize) if contiguous else None

    def same_bytes(self, other: KVCacheSpec) -> bool:
        """True when both specs have the same logical view (axes in the same order, sizes,
        dtype) and put every element of it at the same byte (size-1 axes make NHD == HND). Two
        backends whose logical views order the axes differently are not the same bytes even
        where their buffers coincide (triton ``(B, two, ...)`` against flash_attn
        ``(two, B, ...)``, cross-layer): the same index names different elements."""
        return (self.logical_axes == other.logical_axes and self.axis_sizes == other.axis_sizes
                and self.dtype == other.dtype
                and _squeezed_order(self) == _squeezed_order(other))


class _Addressing(NamedTuple):
    """What a spec's addressing derives from its fields, computed once per spec."""

    sizes: Mapping[str, int]                  # every axis this spec has
    shape: tuple[int, ...]                    # the buffer's shape, outermost first
    strides: dict[str, int]                   # element stride of every physical axis
    span: tuple[tuple[str, int, int], ...]    # (axis, size, stride), innermost first


@functools.lru_cache(maxsize=4096)
def _addressing(spec: KVCacheSpec) -> _Addressing:
    sizes = {"L": spec.num_layers, "B": spec.num_blocks, "two": 2, "N": spec.block_size,
             "H": spec.num_kv_heads, "C": spec.head_size}
    if spec.is_mla:
        del sizes["two"], sizes["H"]
    axes = spec.physical_axes
    strides: dict[str, int] = {}
    step = 1
    for axis in reversed(axes):
        strides[axis] = step
        step *= sizes[axis]
    return _Addressing(types.MappingProxyType(sizes), tuple(sizes[a] for a in axes),
                     {a: strides[a] for a in axes},
                     tuple((a, sizes[a], strides[a]) for a in reversed(axes)))


def _span_axes(spec: KVCacheSpec) -> tuple[tuple[str, int, int], ...]:
    """(axis, size, element stride) of every physical axis, innermost first (for ``span``)."""
    return _addressing(spec).span


@functools.lru_cache(maxsize=8192)
def box_is_contiguous(spec: KVCacheSpec, extents: tuple[tuple[str, int], ...]) -> bool:
    """Whether the box ``[0, e)`` on each named axis is one contiguous run of ``spec``'s memory.

    Axes not named: ``B`` and ``L`` one index, every other axis whole; the same rule as
    :meth:`KVCacheSpec.span` (full axes innermost, then one partial axis, then extent 1), without
    the offsets, for the planner's search over atom shapes.

    >>> s = KVCacheSpec(layout="HND", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128)
    >>> box_is_contiguous(s, (("two", 1), ("H", 4))), box_is_contiguous(s.evolve(layout="NHD"), (("two", 1), ("H", 4)))
    (True, False)
    """
    return _box_order(_span_axes(spec), dict(extents)) is not None


def _box_order(span_axes: tuple[tuple[str, int, int], ...], ext: Mapping[str, int]
               ) -> tuple[str, ...] | None:
    """The box's element order (its axes of extent > 1, innermost first) when it is one
    contiguous run of memory (full axes innermost, then one partial axis, then extent 1), else
    None. Axes not in ``ext``: ``L`` and ``B`` one index, every other axis whole."""
    partial_seen = False
    order = []
    for axis, size, _stride in span_axes:
        extent = ext.get(axis, 1 if axis in ("L", "B") else size)
        if not 1 <= extent <= size:
            raise FkvError(f"box_is_contiguous: {axis} extent {extent} outside [1, {size}]")
        if extent != 1:
            if partial_seen:
                return None
            order.append(axis)
        if extent != size:
            partial_seen = True
    return tuple(order)


#: every subset of ``range(n)`` for n <= 6, by size then lexicographically
#: (``itertools.combinations``), built once: the search below walks them per call
_SUBSETS = tuple(tuple(c for k in range(n + 1) for c in itertools.combinations(range(n), k))
                 for n in range(7))


def fewest_contiguous_atoms(sides: tuple[KVCacheSpec, ...], full: tuple[tuple[str, int], ...]
                            ) -> tuple[tuple[str, ...], int]:
    """The axes to split (to extent 1) so that one atom, the box of ``full``'s other extents
    (every axis not named whole, ``L`` and ``B`` one index), is one contiguous run with the same
    element order on every side, with the fewest atoms: ``(split axes, atom count)``. Ties go to
    fewer split axes, then to the order of ``full``. Splitting every named axis always works
    when the head dimension is innermost on every side, as in every layout here.

    >>> s = KVCacheSpec(layout="HND", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128)
    >>> fewest_contiguous_atoms((s,), (("two", 2), ("N", 16), ("H", 4)))
    (('two',), 2)
    >>> n = s.evolve(layout="NHD")
    >>> fewest_contiguous_atoms((n, n), (("two", 2), ("N", 16), ("H", 4)))
    (('two', 'N'), 32)
    >>> fewest_contiguous_atoms((s, n), (("two", 2), ("N", 16), ("H", 4)))  # one row each
    (('two', 'N', 'H'), 128)
    """
    names = [a for a, _ in full]
    sizes = [e for _, e in full]
    if len(names) >= len(_SUBSETS):
        raise FkvError(f"fewest_contiguous_atoms: {len(names)} axes (at most {len(_SUBSETS) - 1})")
    first, *others = [_span_axes(s) for s in sides]
    ext = dict(full)

    def fits() -> bool:  # the atom ``ext`` is contiguous, in one element order, on every side
        order = _box_order(first, ext)
        return order is not None and all(_box_order(span, ext) == order for span in others)

    # Every split that works on a side splits at least the named axes of extent > 1 outside
    # the side's innermost axis that is not whole (splitting an axis further in only moves that
    # point inwards), so every answer holds their union: when it is empty, nothing split is the
    # only candidate worth a look first; when the union alone works, it is the answer (the
    # fewest atoms; a larger split of as many atoms has more axes).
    must: set[str] | None = set()
    for span in (first, *others):
        outside = False
        for axis, size, _stride in span:
            extent = ext.get(axis, 1 if axis in ("L", "B") else size)
            if outside and extent != 1:
                if axis not in ext:  # an axis no split can shrink: only the search decides
                    must = None
                    break
                must.add(axis)
            if extent != size:
                outside = True
        if must is None:
            break
    if not must and fits():  # nothing split: the usual answer, before any sorting
        return (), 1
    if must:
        for axis in must:
            ext[axis] = 1
        if fits():
            subset = [i for i, a in enumerate(names) if a in must]
            count = 1
            for i in subset:
                count *= sizes[i]
            return tuple(names[i] for i in subset), count
        ext.update(full)
    subsets = _SUBSETS[len(names)]
    candidates = []
    for k, subset in enumerate(subsets):
        count = 1
        for i in subset:
            count *= sizes[i]
        candidates.append((count, k))
    candidates.sort()  # fewest atoms; ties keep the subsets' order (fewer axes first)
    for count, k in candidates[1:]:  # the empty subset (count 1, first) failed above
        subset = subsets[k]
        for i in subset:
            ext[names[i]] = 1
        if fits():
            return tuple(names[i] for i in subset), count
        for i in subset:
            ext[names[i]] = sizes[i]
    raise AssertionError("single-row atoms are always contiguous")  # C is innermost everywhere


def strides_match(expected: tuple[int, ...], shape: tuple[int, ...],
                  strides: tuple[int, ...]) -> bool:
    """Whether ``strides`` of a tensor of ``shape`` are ``expected``, size-1 dims excepted: a
    size-1 dim's stride says nothing about the layout (one KV head per rank: NHD == HND), so
    nothing is ever decided by it."""
    return all(size == 1 or e == s for e, size, s in zip(expected, shape, strides))


def _squeezed_order(spec: KVCacheSpec) -> tuple[str, ...]:
    sizes = spec.axis_sizes
    return tuple(a for a in spec.physical_axes if sizes[a] != 1)


@functools.lru_cache(maxsize=None)
def _physical_axes(backend: str, layout: Layout, cross_layer: bool) -> tuple[str, ...]:
    logical = _LOGICAL_AXES[backend]
    if cross_layer:
        logical = ("L", *logical)
    order = _STRIDE_ORDERS[(_FAMILY[backend], layout, cross_layer)]
    return tuple(logical[i] for i in order)


def _side_axes(spec: KVCacheSpec) -> tuple[str, ...]:
    """Axes of one side of a rearrange pattern: the cross-layer buffer, or the stack of layers."""
    axes = spec.physical_axes
    return axes if spec.cross_layer else ("L", *axes)


def _geometry(spec: KVCacheSpec) -> dict[str, Any]:
    return {"num_blocks": spec.num_blocks, "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
            "dtype": spec.dtype, "num_layers": spec.num_layers, "mla": spec.is_mla}


def check_same_geometry(src: KVCacheSpec, dst: KVCacheSpec, what: str = "rearrange") -> None:
    """Raise FkvError naming every geometry field where ``src`` and ``dst`` differ."""
    a, b = _geometry(src), _geometry(dst)
    diffs = [f"{k}: src {a[k]!r}, dst {b[k]!r}" for k in a if a[k] != b[k]]
    if diffs:
        raise FkvError(f"{what}: src and dst must have the same geometry; they differ in "
                       + "; ".join(diffs))


@functools.lru_cache(maxsize=1024)
def rearrange_pattern(src: KVCacheSpec, dst: KVCacheSpec) -> str:
    """The einops pattern taking all of ``src``'s layers to all of ``dst``'s, in physical order.

    A per-layer side is the stack of its layer buffers (leading ``L``); a cross-layer side is its
    one buffer.

    >>> nhd = KVCacheSpec(layout="NHD", num_blocks=4, block_size=16, num_kv_heads=8, head_size=128)
    >>> rearrange_pattern(nhd, nhd.evolve(layout="HND"))
    'L B two N H C -> L B two H N C'
    """
    if not isinstance(src, KVCacheSpec) or not isinstance(dst, KVCacheSpec):
        raise FkvError(f"rearrange_pattern takes two KVCacheSpec (got {type(src).__name__}, "
                       f"{type(dst).__name__})")
    check_same_geometry(src, dst)
    return f"{' '.join(_side_axes(src))} -> {' '.join(_side_axes(dst))}"
