"""``assert_kv_equal``: compare the logical contents of two caches, whatever their layouts."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec

__all__ = ["assert_kv_equal", "token_major"]

# Canonical order of one layer's axes for comparison (MLA has no K/V selector and no heads).
_CANONICAL = ("B", "N", "two", "H", "C")
_INT_VIEW = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _layers(caches: Any, spec: KVCacheSpec, name: str) -> list[Any]:
    import torch

    if not isinstance(spec, KVCacheSpec):
        raise field_error(f"spec_{name}", spec, "a KVCacheSpec")
    if isinstance(caches, torch.Tensor):  # one layer's view
        caches = [caches]
    elif not isinstance(caches, (list, tuple)):
        raise field_error(name, type(caches).__name__, "a list of layer views (as fkv.allocate "
                          "returns) or one torch.Tensor when num_layers == 1")
    caches = list(caches)
    if len(caches) != spec.num_layers:
        raise FkvError(f"assert_kv_equal: {name!r} has {len(caches)} layer view(s) but spec_{name} "
                       f"has num_layers={spec.num_layers}; pass the list fkv.allocate(spec) returns")
    for i, t in enumerate(caches):
        if not isinstance(t, torch.Tensor):
            raise field_error(f"{name}[{i}]", type(t).__name__, "a torch.Tensor (one layer's view "
                              "from fkv.allocate)", "convert it with torch.as_tensor")
        if t.device.type == "meta":
            raise field_error(f"{name}[{i}]", "a tensor on meta", "a tensor with values (on cpu "
                              "or cuda)", "a meta tensor holds no contents to compare")
        if tuple(t.shape) != spec.logical_shape:
            raise FkvError(f"assert_kv_equal: {name}[{i}] has shape {tuple(t.shape)} but spec_{name} "
                           f"{spec!r} has logical shape {spec.logical_shape}")
        if str(t.dtype).removeprefix("torch.") != spec.dtype:
            raise FkvError(f"assert_kv_equal: {name}[{i}] has dtype {t.dtype} but spec_{name}.dtype "
                           f"is {spec.dtype!r}")
    return caches


def _ids(ids: Any, spec: KVCacheSpec, name: str) -> list[int]:
    if ids is None:
        return list(range(spec.num_blocks))
    field = f"block_ids_{name}"
    try:
        values = ids.tolist() if hasattr(ids, "tolist") else ids
        if isinstance(values, (str, bytes)):
            raise TypeError
        out = []
        for i in values:
            if isinstance(i, bool):
                raise TypeError
            out.append(operator.index(i))
    except TypeError:
        raise field_error(field, ids, "a 1-D sequence or tensor of int block ids") from None
    bad = [i for i in out if not 0 <= i < spec.num_blocks]
    if bad:
        raise field_error(field, bad[0], f"a block id in [0, {spec.num_blocks})")
    return out


def _heads(heads: Any, spec: KVCacheSpec, name: str) -> tuple[int, int]:
    """``(lo, hi)`` of a head range: None (all), a ``(lo, hi)`` pair or a step-1 ``slice``, as
    the ops take them (:func:`fkv.ops.relayout._heads`)."""
    from fkv.ops.relayout import _heads as ops_heads

    return ops_heads(heads, spec, f"heads_{name}")


def _num_tokens(num_tokens: Any) -> int | None:
    """None (every token the ids hold), or a token count checked as the ops check theirs."""
    from fkv.ops.relayout import _num_tokens as ops_num_tokens

    return None if num_tokens is None else ops_num_tokens(num_tokens, 0, {})


def _tolerance(value: Any, name: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0):
        raise field_error(name, value, "a finite number >= 0")
    return float(value)


def token_major(layer: Any, spec: KVCacheSpec, block_ids: Any = None,
                heads: tuple[int, int] | slice | None = None, num_tokens: int | None = None,
                _name: str = "a") -> Any:
    """One layer's cache as ``[tokens, 2, heads, head_size]`` (MLA: ``[tokens, 1, 1, D]``).

    Token ``i`` is block ``block_ids[i // N]`` slot ``i % N`` (all blocks in order by default).

    >>> import fkv
    >>> spec = fkv.KVCacheSpec(layout="HND", num_blocks=3, block_size=4, num_kv_heads=2, head_size=8)
    >>> tuple(token_major(fkv.allocate(spec)[0], spec, [2, 0], num_tokens=6).shape)
    (6, 2, 2, 8)
    """
    import torch

    if not isinstance(spec, KVCacheSpec):
        raise field_error("spec", spec, "a KVCacheSpec")
    if not isinstance(layer, torch.Tensor):
        raise field_error("layer", type(layer).__name__, "a torch.Tensor (one layer's view from "
                          "fkv.allocate)")
    if tuple(layer.shape) != spec.logical_shape:
        raise field_error("layer", f"shape {tuple(layer.shape)}", f"one layer's view of shape "
                          f"{spec.logical_shape} (the logical_shape of spec {spec!r})")
    axes = spec.logical_axes
    present = [a for a in _CANONICAL if a in axes]
    t = layer.permute(*[axes.index(a) for a in present])
    if spec.is_mla:
        t = t.unsqueeze(2).unsqueeze(3)  # B N 1 1 C
    ids = torch.as_tensor(_ids(block_ids, spec, _name), dtype=torch.long, device=t.device)
    lo, hi = _heads(heads, spec, _name)
    t = t[ids][:, :, :, lo:hi]  # blocks, N, two, heads, C
    t = t.reshape(-1, *t.shape[2:])
    n = _num_tokens(num_tokens)
    return t if n is None else t[:n]


def _comparable(t: Any, exact: bool) -> Any:
    import torch

    t = t.detach().to("cpu")
    if exact:
        return t.contiguous().view(getattr(torch, _INT_VIEW[t.element_size()]))
    return t.to(torch.float64)


def assert_kv_equal(a: Any, spec_a: KVCacheSpec, b: Any, spec_b: KVCacheSpec, *,
                    block_ids_a: Any = None, block_ids_b: Any = None, num_tokens: int | None = None,
                    heads_a: tuple[int, int] | slice | None = None,
                    heads_b: tuple[int, int] | slice | None = None,
                    atol: float = 0.0, rtol: float = 0.0) -> None:
    """Assert two caches hold the same K/V values, whatever their layouts and backends.

    ``a``/``b`` are lists of per-layer logical views (what ``fkv.allocate`` returns; one view is
    accepted when ``num_layers == 1``). By default every block is compared and the geometries must
    match; with ``block_ids_a``/``block_ids_b`` (and ``num_tokens``) one request's tokens are
    compared, so block sizes and counts may differ (token ``i`` lives in block
    ``block_ids[i // block_size]`` slot ``i % block_size``). ``heads_a``/``heads_b`` compare head
    ranges, ``(lo, hi)`` or ``slice(lo, hi)`` as the ops take them, e.g. a decode rank's heads
    against the matching slice of a prefill rank's.

    ``atol`` and ``rtol`` are finite numbers >= 0. With ``atol == rtol == 0`` (default) the
    comparison is bitwise (NaN poison equals itself; dtypes must match); otherwise values are
    compared as float64 with ``torch.isclose`` (NaNs equal).

    Raises FkvError naming the argument on bad input (caches that are not torch tensors or hold
    no values, block ids or ``num_tokens`` that are not ints, a bad head range or tolerance), and
    AssertionError naming the first difference (layer, block and slot on each side, K or V,
    token, head, channel) with both values, and how many elements differ.

    >>> import fkv, torch
    >>> nhd = fkv.KVCacheSpec(layout="NHD", num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    >>> hnd = nhd.evolve(layout="HND")
    >>> a, b = fkv.allocate(nhd), fkv.allocate(hnd)
    >>> _ = a[0].copy_(torch.randn(a[0].shape)); _ = b[0].copy_(a[0])  # logical copy
    >>> assert_kv_equal(a, nhd, b, hnd)
    >>> b[0][1, 0, 3, 1, 5] = 7.0
    >>> assert_kv_equal(a, nhd, b, hnd)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: KV caches differ first at layer 0, token 7 (a: block 1 slot 3; b: block 1 slot 3), K, head 1, channel 5: a=... b=7.0 (1 of 256 elements of layer 0 differ)
    """
    import torch

    la, lb = _layers(a, spec_a, "a"), _layers(b, spec_b, "b")
    ids_a, ids_b = _ids(block_ids_a, spec_a, "a"), _ids(block_ids_b, spec_b, "b")
    ha, hb = _heads(heads_a, spec_a, "a"), _heads(heads_b, spec_b, "b")
    num_tokens = _num_tokens(num_tokens)
    atol, rtol = _tolerance(atol, "atol"), _tolerance(rtol, "rtol")
    exact = atol == 0 and rtol == 0
    if spec_a.is_mla != spec_b.is_mla:
        raise FkvError(f"assert_kv_equal: cannot compare an MLA cache with a K/V cache "
                       f"(spec_a.backend {spec_a.backend!r}, spec_b.backend {spec_b.backend!r})")
    facts = {"head_size": (spec_a.head_size, spec_b.head_size),
             "heads": (ha[1] - ha[0], hb[1] - hb[0]),
             "num_layers": (spec_a.num_layers, spec_b.num_layers)}
    if exact:
        facts["dtype"] = (spec_a.dtype, spec_b.dtype)
    if block_ids_a is None and block_ids_b is None:
        facts["block_size"] = (spec_a.block_size, spec_b.block_size)
        facts["num_blocks"] = (spec_a.num_blocks, spec_b.num_blocks)
    diffs = [f"{k}: a {x!r}, b {y!r}" for k, (x, y) in facts.items() if x != y]
    if diffs:
        raise FkvError("assert_kv_equal: the caches differ in geometry, so their contents cannot be "
                       "compared: " + "; ".join(diffs)
                       + ("; pass atol/rtol to compare values of different dtypes"
                          if "dtype" in facts and facts["dtype"][0] != facts["dtype"][1] else ""))
    cap = min(len(ids_a) * spec_a.block_size, len(ids_b) * spec_b.block_size)
    n = cap if num_tokens is None else num_tokens
    if n > cap:
        raise field_error("num_tokens", num_tokens, f"at most {cap} (the tokens both block lists hold)")
    for layer, (ta, tb) in enumerate(zip(la, lb)):
        xa = _comparable(token_major(ta, spec_a, ids_a, ha, n), exact)
        xb = _comparable(token_major(tb, spec_b, ids_b, hb, n, "b"), exact)
        bad = xa != xb if exact else ~torch.isclose(xa, xb, rtol=rtol, atol=atol, equal_nan=True)
        if not bool(bad.any()):
            continue
        tok, kv, head, ch = (int(i) for i in bad.nonzero()[0])
        va, vb = token_major(ta, spec_a, ids_a, ha, n), token_major(tb, spec_b, ids_b, hb, n, "b")
        where = [f"layer {layer}", f"token {tok}"
                 f" (a: block {ids_a[tok // spec_a.block_size]} slot {tok % spec_a.block_size}; "
                 f"b: block {ids_b[tok // spec_b.block_size]} slot {tok % spec_b.block_size})"]
        if not spec_a.is_mla:
            where.append("KV"[kv])
            where.append(f"head {head}" if ha[0] == hb[0] == 0 else
                         f"head {head} (a head {ha[0] + head}, b head {hb[0] + head})")
        where.append(f"channel {ch}")
        x, y = va[tok, kv, head, ch].item(), vb[tok, kv, head, ch].item()
        count = int(bad.sum())
        detail = f"{count} of {bad.numel()} elements of layer {layer} differ"
        if not exact:
            fa, fb = va.double().cpu(), vb.double().cpu()
            finite = torch.isfinite(fa) & torch.isfinite(fb)
            if bool(finite.any()):
                detail += f"; max abs diff {float((fa - fb).abs()[finite].max()):.3g}"
        raise AssertionError(f"KV caches differ first at {', '.join(where)}: a={x!r} b={y!r} "
                             f"({detail})")
