"""Testing helpers for code that uses fkv: hypothesis strategies, cache comparison, snapshots.

Three tools for your own pytest suite (``pip install 'fkv[test]'`` brings hypothesis and
inline-snapshot):

- :func:`specs` and :func:`engine_pairs`: hypothesis strategies for :class:`~fkv.KVCacheSpec`
  values and for (prefill, decode) engine pairs of one model, each keyword a value, a collection
  or a strategy.
- :func:`assert_kv_equal`: compare what two caches *mean* (K/V values per layer, token, head),
  whatever their layouts, backends or block sizes; the AssertionError names the first difference.
- :func:`snapshot_value`: turn specs, patterns, plans, segments and handshake outcomes into plain,
  stably printed data for snapshot tests.

Snapshot recipe (inline-snapshot)
---------------------------------
Write the assertion with an empty ``snapshot()`` and let inline-snapshot fill it in::

    from inline_snapshot import snapshot
    import fkv
    from fkv.connector import handshake
    from fkv.testing import snapshot_value

    def test_my_engine_pairing():
        decode, prefill = my_decode_side(), my_prefill_side()   # (EngineDesc, KVCacheSpec) each
        assert snapshot_value(prefill[1]) == snapshot()
        assert snapshot_value(handshake(decode, prefill)) == snapshot()

Then ``pytest --inline-snapshot=create`` writes the current values into the test file (review the
diff and commit it); ``pytest --inline-snapshot=review`` (or ``=fix``) updates them after an
intended change; a plain ``pytest`` run fails on any difference. What the snapshot holds:

- a spec: its ``repr`` (``KVCacheSpec(backend='triton', layout='HND', ...)``), which lists every
  field that matters and normalizes aliases, so ``"LBHNC"`` and ``"HND"`` snapshot alike;
- a rearrange pattern: the string itself (``'L B two N H C -> L B two H N C'``);
- an ``Accept``: ``{"decision": "accept", "plan": plan.describe()}`` (strategy, bytes, descriptors);
- a ``Reject``: ``{"decision": "reject", "reasons": [...]}``, one ``"code path: local=… remote=…"``
  line per reason, in the handshake's order, so a new or vanished reason shows as a one-line diff;
- plan segments (a numpy array): a list of row tuples.

Snapshot values, not objects: ``snapshot_value`` returns only dicts, lists, tuples, strings and
ints, which inline-snapshot writes as readable Python literals.
"""

from __future__ import annotations

from fkv.testing._compare import assert_kv_equal, token_major
from fkv.testing._snapshot import snapshot_value
from fkv.testing._strategies import EnginePair, engine_pairs, heads_per_rank, specs

__all__ = ["EnginePair", "assert_kv_equal", "engine_pairs", "heads_per_rank", "snapshot_value",
           "specs", "token_major"]
