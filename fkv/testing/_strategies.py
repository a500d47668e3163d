"""Hypothesis strategies: KV-cache specs, and (prefill, decode) engine pairs of one model.

Every keyword takes a fixed value, a collection of allowed values, or a hypothesis strategy.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

from fkv.errors import FkvError, field_error
from fkv.layout import BACKENDS, DTYPES, KVCacheSpec, Layout, names_cross_layer

__all__ = ["EnginePair", "engine_pairs", "specs"]

_DEFAULTS = {
    "backend": BACKENDS,
    "layout": tuple(Layout),
    "num_blocks": range(1, 9),
    "block_size": (1, 2, 4, 8, 16),
    "num_kv_heads": (1, 2, 4, 8),
    "head_size": (1, 2, 8, 16, 64, 128),
    "dtype": tuple(DTYPES),
    "num_layers": range(1, 4),
    "cross_layer": (False, True),
}


def _hypothesis() -> Any:
    try:
        from hypothesis import strategies as st
    except ImportError as e:  # pragma: no cover - hypothesis is in the [test] extra
        raise FkvError("fkv.testing strategies need hypothesis: pip install 'fkv[test]'") from e
    return st


def _strategy(name: str, value: Any) -> Any:
    """A value, a collection of values, or a strategy -> a strategy."""
    st = _hypothesis()
    if isinstance(value, st.SearchStrategy):
        return value
    if isinstance(value, (str, bytes, Layout)) or not hasattr(value, "__iter__"):
        return st.just(value)
    values = tuple(value)
    if not values:
        raise FkvError(f"{name!r} must be a value, a non-empty collection of values or a hypothesis "
                       f"strategy (got an empty {type(value).__name__})")
    return st.sampled_from(values)


def _positive_int(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise field_error(name, value, "a positive int") from None
    if n < 1:
        raise field_error(name, value, "a positive int")
    return n


def _total_bytes(spec: KVCacheSpec) -> int:
    return spec.region_bytes * spec.num_regions


def specs(*, max_bytes: int | None = 1 << 20, **constraints: Any) -> Any:
    """A strategy of valid :class:`~fkv.KVCacheSpec` values.

    Keywords are the spec's fields (``backend``, ``layout``, ``num_blocks``, ``block_size``,
    ``num_kv_heads``, ``head_size``, ``dtype``, ``num_layers``, ``cross_layer``); each takes a fixed
    value, a collection of allowed values or a strategy. Unconstrained fields draw small values
    (see ``_DEFAULTS``). ``num_kv_heads`` is 1 whenever the backend drawn is ``"mla"``, and
    ``cross_layer`` is True whenever the layout drawn is an alias naming one buffer of all layers
    (``"BLNHC"``, ``"BHLNC"``).
    ``max_bytes`` (a positive int, default 1 MiB; ``None`` for no limit) bounds the whole cache,
    so tests that allocate and run kernels stay fast under the Triton interpreter.

    >>> from hypothesis import given
    >>> @given(specs(backend="triton", layout=("NHD", "HND"), dtype="bfloat16"))
    ... def test_round_trip(spec): ...
    """
    st = _hypothesis()
    if max_bytes is not None:
        _positive_int("max_bytes", max_bytes)
    unknown = set(constraints) - set(_DEFAULTS)
    if unknown:
        raise FkvError(f"specs: unknown constraint(s) {sorted(unknown)}; fields are "
                       f"{sorted(_DEFAULTS)} and max_bytes")
    fields = {k: _strategy(k, constraints.get(k, v)) for k, v in _DEFAULTS.items()}

    @st.composite
    def draw_spec(draw: Any) -> KVCacheSpec:
        values = {k: draw(s) for k, s in fields.items()}
        if values["backend"] == "mla":
            values["num_kv_heads"] = 1
        values["cross_layer"] = values["cross_layer"] or names_cross_layer(values["layout"])
        spec = KVCacheSpec(**values)
        if max_bytes is not None:
            from hypothesis import assume

            assume(_total_bytes(spec) <= max_bytes)
        return spec

    return draw_spec()


class EnginePair(NamedTuple):
    """``((prefill EngineDesc, prefill spec), (decode EngineDesc, decode spec))``.

    The handshake takes the reading side first: ``handshake(pair.decode, pair.prefill)``.
    """

    prefill: tuple[Any, KVCacheSpec]
    decode: tuple[Any, KVCacheSpec]


def heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds (docs/handshake.md): ``max(1, total // tp)`` (replicated when tp > total).

    >>> heads_per_rank(8, 2), heads_per_rank(8, 16), heads_per_rank(1, 4)
    (4, 1, 1)
    """
    total = _positive_int("total_num_kv_heads", total_num_kv_heads)
    return max(1, total // _positive_int("tp_size", tp_size))


def _divides(a: int, b: int) -> bool:
    return max(a, b) % min(a, b) == 0


def engine_pairs(*, total_num_kv_heads: Any = (1, 2, 4, 8), prefill_tp: Any = (1, 2, 4, 8),
                 decode_tp: Any = (1, 2, 4, 8), backend: Any = BACKENDS, layout: Any = tuple(Layout),
                 prefill_layout: Any = None, decode_layout: Any = None,
                 block_size: Any = (4, 8, 16), prefill_block_size: Any = None,
                 decode_block_size: Any = None, head_size: Any = (8, 64, 128),
                 dtype: Any = ("bfloat16", "float16", "float32"), num_layers: Any = range(1, 4),
                 cross_layer: Any = (False, True), num_blocks: Any = range(1, 65),
                 model: str = "fkv-test-model", divisible: bool = True) -> Any:
    """A strategy of :class:`EnginePair`: one model served by a prefill and a decode engine.

    Both sides share the model facts the handshake compares (model, model dtype, total KV heads, head
    size, layers, backend, cache dtype); each side has its own TP size, layout, block size,
    cross-layer choice and num_blocks. Heads per rank are ``max(1, total // tp)`` (MLA: 1 latent,
    total 1). The prefill side is its rank-0 view; the decode side is a drawn rank of its engine.
    With ``divisible=True`` (default) the TP sizes divide one another (a pairing the handshake
    can plan); other rules (block sizes, replication) are left to the handshake to judge.

    ``layout``/``block_size`` constrain both sides unless ``prefill_*``/``decode_*`` override them.
    Pairs are *consistent*, not necessarily *accepted*: filter with
    ``assume(isinstance(handshake(*reversed(pair)), Accept))`` when a test needs an accepted plan.

    >>> from hypothesis import given
    >>> @given(engine_pairs(backend="triton", prefill_tp=1, decode_tp=(2, 4)))
    ... def test_pairs(pair):
    ...     (p_engine, p_spec), (d_engine, d_spec) = pair
    """
    st = _hypothesis()
    from fkv.connector.handshake import EngineDesc

    s = {name: _strategy(name, value) for name, value in {
        "total_num_kv_heads": total_num_kv_heads, "prefill_tp": prefill_tp, "decode_tp": decode_tp,
        "backend": backend, "head_size": head_size, "dtype": dtype, "num_layers": num_layers,
        "prefill_layout": layout if prefill_layout is None else prefill_layout,
        "decode_layout": layout if decode_layout is None else decode_layout,
        "prefill_block_size": block_size if prefill_block_size is None else prefill_block_size,
        "decode_block_size": block_size if decode_block_size is None else decode_block_size,
        "prefill_cross_layer": cross_layer, "decode_cross_layer": cross_layer,
        "prefill_num_blocks": num_blocks, "decode_num_blocks": num_blocks,
    }.items()}

    @st.composite
    def draw_pair(draw: Any) -> EnginePair:
        v = {k: draw(strategy) for k, strategy in s.items()}
        for name in ("prefill_tp", "decode_tp"):
            _positive_int(name, v[name])
        if divisible:
            from hypothesis import assume

            assume(_divides(v["prefill_tp"], v["decode_tp"]))
        mla = v["backend"] == "mla"
        total = 1 if mla else v["total_num_kv_heads"]
        dtype_ = v["dtype"]
        model_dtype = "bfloat16" if dtype_ in ("float8_e4m3fn", "float8_e5m2") else dtype_
        sides = []
        for side in ("prefill", "decode"):
            tp = v[f"{side}_tp"]
            rank = 0 if side == "prefill" else draw(st.integers(0, tp - 1))
            engine = EngineDesc(engine_id=f"{side}-engine", tp_size=tp, tp_rank=rank,
                                total_num_kv_heads=total, model=model, model_dtype=model_dtype)
            spec = KVCacheSpec(backend=v["backend"], layout=v[f"{side}_layout"],
                               num_blocks=v[f"{side}_num_blocks"],
                               block_size=v[f"{side}_block_size"],
                               num_kv_heads=1 if mla else heads_per_rank(total, tp),
                               head_size=v["head_size"], dtype=dtype_, num_layers=v["num_layers"],
                               cross_layer=v[f"{side}_cross_layer"]
                               or names_cross_layer(v[f"{side}_layout"]))
            sides.append((engine, spec))
        return EnginePair(prefill=sides[0], decode=sides[1])

    return draw_pair()
