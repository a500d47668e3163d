"""``snapshot_value``: fkv values as plain, stably printed data for snapshot tests."""

from __future__ import annotations

from typing import Any

from fkv.errors import FkvError
from fkv.layout import KVCacheSpec, Layout

__all__ = ["reason_line", "snapshot_value"]


def reason_line(reason: Any) -> str:
    """One handshake reason as ``"code path: local=<v> remote=<v>"``."""
    return f"{reason.code} {reason.path}: local={reason.local!r} remote={reason.remote!r}"


def snapshot_value(value: Any) -> Any:
    """Plain data (str, int, float, bool, None, tuples, lists, dicts) for a snapshot assertion.

    - ``KVCacheSpec`` -> its repr; ``Layout`` -> its name; strings and numbers unchanged;
    - ``Accept`` -> ``{"decision": "accept", "plan": plan.describe()}``;
    - ``Reject`` -> ``{"decision": "reject", "reasons": [reason_line(r), ...]}``;
    - a handshake ``Reason`` -> :func:`reason_line`; a ``TransferPlan`` -> ``plan.describe()``;
    - numpy arrays -> lists (rows of a 2-D array as tuples); ``EngineDesc`` and other attrs classes
      -> ``{field: value}``; lists, tuples and dicts recursively.

    >>> import fkv
    >>> snapshot_value(fkv.KVCacheSpec(layout="LBHNC", num_blocks=4, block_size=16,
    ...                                num_kv_heads=8, head_size=128))
    "KVCacheSpec(backend='triton', layout='HND', num_blocks=4, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16')"
    """
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, Layout):
        return value.value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, KVCacheSpec):
        return repr(value)
    kind = type(value).__name__
    if kind == "Accept" and hasattr(value, "plan"):
        return {"decision": "accept", "plan": value.plan.describe()}
    if kind == "Reject" and hasattr(value, "reasons"):
        return {"decision": "reject", "reasons": [reason_line(r) for r in value.reasons]}
    if kind == "Reason" and hasattr(value, "code"):
        return reason_line(value)
    if hasattr(value, "describe") and hasattr(value, "segments"):
        return value.describe()
    if type(value).__module__ == "numpy" or hasattr(value, "tolist") and hasattr(value, "ndim"):
        data = value.tolist()
        return [tuple(row) for row in data] if value.ndim == 2 else data
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = snapshot_value(k)
            try:
                hash(key)
            except TypeError:  # an attrs key becomes a dict, an array key a list
                raise FkvError(f"snapshot_value: the dict key {k!r} has no hashable plain form "
                               f"({key!r}); key the dict by specs, layouts, strings or "
                               f"numbers") from None
            out[key] = snapshot_value(v)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot_value(v) for v in value) if type(value) in (list, tuple) \
            else tuple(snapshot_value(v) for v in value)
    import attrs

    if attrs.has(type(value)):
        return {f.name: snapshot_value(getattr(value, f.name)) for f in attrs.fields(type(value))}
    raise FkvError(f"snapshot_value: no plain form for a {kind!r} ({value!r}); pass a spec, layout, "
                   "handshake result, plan, numpy array, attrs value or a container of them")
