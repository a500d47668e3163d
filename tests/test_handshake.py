"""The pure handshake: every check of docs/handshake.md as a named reason (all of them, with real field
paths), totality on any input, handshake(x, x) accepts, stable printing."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from inline_snapshot import snapshot

from fkv import FkvError, KVCacheSpec
from fkv.connector.handshake import (
    PROTOCOL_VERSION, REASON_CODES, Accept, EngineDesc, Reason, Reject, handshake, rank_heads,
)
from fkv.testing import EnginePair, engine_pairs


def rank(tp: int, r: int, *, heads: int = 8, engine: dict | None = None, **kw):
    base = dict(layout="HND", num_blocks=64, block_size=16, head_size=128)
    base.update(kw)
    mla = base.get("backend") == "mla"
    e = dict(engine_id=f"tp{tp}", tp_size=tp, tp_rank=r, total_num_kv_heads=1 if mla else heads,
             model="m", model_dtype="bfloat16")
    e.update(engine or {})
    return EngineDesc(**e), KVCacheSpec(num_kv_heads=1 if mla else max(1, heads // tp), **base)


def reasons(local, remote, **kw) -> list[str]:
    result = handshake(local, remote, **kw)
    assert isinstance(result, Reject)
    return [str(r) for r in result.reasons]


def resolve(path: str, local, remote) -> None:
    """Every reason path must name a real argument / field."""
    if path == "strategy":
        return
    head, *rest = path.split(".")
    obj = {"local": local, "remote": remote}[head]
    if not rest:
        return
    part = {"engine": 0, "spec": 1}[rest[0]]
    assert isinstance(obj, tuple | list) and len(obj) == 2
    if len(rest) > 1:
        cls = type(obj[part])
        assert rest[1] in {f.name for f in attrs.fields(cls)}, path
        assert len(rest) == 2


# -- every check is a named reason ------------------------------------------------------------

REJECTS = {
    "protocol: remote speaks 2": (rank(2, 0), rank(1, 0, engine={"protocol": 2})),
    "model, dtypes, head size differ": (
        rank(1, 0), rank(1, 0, head_size=64, dtype="float16",
                         engine={"model": "other", "model_dtype": "float16"})),
    "total heads and layers differ": (rank(1, 0), rank(1, 0, heads=4, num_layers=2)),
    "MLA with a K/V cache": (rank(1, 0, backend="mla", head_size=128), rank(1, 0)),
    "TP 3 vs 2": (rank(3, 0, heads=6), rank(2, 0, heads=6)),
    "8 heads over TP 3": (rank(3, 1), rank(1, 0)),
    "heads per rank wrong": (
        (rank(2, 0)[0], rank(2, 0)[1].evolve(num_kv_heads=8)),
        (rank(1, 0)[0], rank(1, 0)[1].evolve(num_kv_heads=2))),
    "MLA with total heads 8": (rank(1, 0, backend="mla", head_size=576, engine={"total_num_kv_heads": 8}),
                               rank(1, 0, backend="mla", head_size=576)),
}


def test_reject_reasons_snapshot():
    got = {name: reasons(*pair) for name, pair in REJECTS.items()}
    assert got == snapshot({
        'protocol: remote speaks 2': [
            'remote.engine.protocol: decode speaks fkv protocol 1, prefill speaks 2; this fkv speaks protocol 1 (local 1, remote 2); fix: run the same fkv version on both engines',
        ],
        'model, dtypes, head size differ': [
            "remote.engine.model: models differ (local 'm', remote 'other'); fix: serve the same model (same name/revision) on both engines",
            "remote.engine.model_dtype: model dtypes differ (local 'bfloat16', remote 'float16'); fix: load the model with the same dtype on both engines",
            "remote.spec.dtype: cache dtypes differ (local 'bfloat16', remote 'float16'); fix: use the same kv-cache dtype on both engines",
            'remote.spec.head_size: head sizes differ (local 128, remote 64); fix: both engines must serve the same model (same head_size)',
        ],
        'total heads and layers differ': [
            'remote.engine.total_num_kv_heads: total KV head counts differ (local 8, remote 4); fix: both engines must serve the same model',
            'remote.spec.num_layers: layer counts differ (local 1, remote 2); fix: both engines must serve the same model (same number of attention layers)',
        ],
        'MLA with a K/V cache': [
            'remote.engine.total_num_kv_heads: total KV head counts differ (local 1, remote 8); fix: both engines must serve the same model',
            "remote.spec.backend: an MLA cache (one latent per token) cannot pair with a K/V cache (local 'mla', remote 'triton'); fix: use an MLA backend on both engines, or a K/V backend on both",
        ],
        'TP 3 vs 2': [
            'remote.engine.tp_size: TP sizes 3 (decode) and 2 (prefill) are not mutually divisible (local 3, remote 2); fix: choose TP sizes where one divides the other (e.g. 1/2/4/8)',
        ],
        '8 heads over TP 3': [
            'local.engine.tp_size: 8 total KV heads cannot be split over tp_size 3 (neither divides the other) (local 3, remote None); fix: use a tp_size that divides the KV head count, or a multiple of it (replicated KV)',
        ],
        'heads per rank wrong': [
            'local.spec.num_kv_heads: decode rank holds 8 KV heads, but 8 total heads over tp_size 2 give 4 per rank (local 8, remote None); fix: build the local cache spec with num_kv_heads=4',
            'remote.spec.num_kv_heads: prefill rank holds 2 KV heads, but 8 total heads over tp_size 1 give 8 per rank (local None, remote 2); fix: build the remote cache spec with num_kv_heads=8',
        ],
        'MLA with total heads 8': [
            'local.engine.total_num_kv_heads: an MLA cache holds one latent vector per token shared by all heads, so total_num_kv_heads must be 1 (local 8, remote None); fix: pass total_num_kv_heads=1 for MLA models',
            'remote.engine.total_num_kv_heads: total KV head counts differ (local 8, remote 1); fix: both engines must serve the same model',
        ],
    })


def test_all_reasons_not_the_first():
    bad = rank(4, 1, heads=4, head_size=64, num_layers=3, dtype="float32",
               engine={"model": "x", "protocol": 9})
    result = handshake(bad, rank(3, 0, heads=6))
    assert [(r.code, r.path) for r in result.reasons] == snapshot([
        ('protocol', 'local.engine.protocol'),
        ('model', 'remote.engine.model'),
        ('cache_dtype', 'remote.spec.dtype'),
        ('head_size', 'remote.spec.head_size'),
        ('total_kv_heads', 'remote.engine.total_num_kv_heads'),
        ('num_layers', 'remote.spec.num_layers'),
        ('tp_ratio', 'remote.engine.tp_size'),
    ])
    assert all(r.code in REASON_CODES for r in result.reasons)


def test_reason_fields():
    (r,) = handshake(rank(1, 0), rank(1, 0, dtype="float16")).reasons
    assert r == Reason("cache_dtype", "remote.spec.dtype", "bfloat16", "float16",
                       "cache dtypes differ", "use the same kv-cache dtype on both engines")


def test_expected_remote_engine_and_strategy():
    assert reasons(rank(1, 0), rank(1, 0), expected_remote_engine="prefill-A") == [
        "remote.engine.engine_id: the request named prefill engine 'prefill-A' but the remote is "
        "'tp1' (local 'prefill-A', remote 'tp1'); fix: connect to the engine that prefilled the "
        "request"]
    assert handshake(rank(1, 0), rank(1, 0), expected_remote_engine="tp1").ok
    assert reasons(rank(1, 0), rank(1, 0), strategy="fastest") == [
        "strategy: strategy must be one of ('auto', 'direct', 'staging') (local 'fastest', "
        "remote None); fix: pass strategy='auto'"]


@pytest.mark.parametrize("bad", [None, 3, "x", (), (1,), (1, 2, 3), {"engine": 1},
                                 (None, None), [rank(1, 0)[1], rank(1, 0)[0]]])
def test_total_on_wrong_types(bad):
    for result in (handshake(bad, rank(1, 0)), handshake(rank(1, 0), bad), handshake(bad, bad)):
        assert isinstance(result, Reject) and result.reasons
        assert {r.code for r in result.reasons} == {"type"}
        for r in result.reasons:
            resolve(r.path, bad, bad)


def test_internal_errors_come_back_as_a_reason():
    engine, spec = rank(1, 0)
    broken = EngineDesc(engine_id="x", tp_size=1, tp_rank=0, total_num_kv_heads=8)
    object.__setattr__(broken, "tp_size", "two")  # a corrupted object the validators never saw
    (r,) = handshake((broken, spec), (engine, spec)).reasons
    assert r.code == "internal" and "TypeError" in r.message


# -- accepted pairs -----------------------------------------------------------------------------

# One model's facts for the acceptance properties (aliases included: the spec normalizes them).
ONE_MODEL = dict(total_num_kv_heads=(1, 2, 4, 8), layout=("NHD", "HND", "LBHNC", "BLNHC"),
                 block_size=(1, 16, 32), head_size=(64, 576), dtype=("bfloat16", "float8_e5m2"),
                 num_layers=range(1, 5), num_blocks=range(5, 65))
TPS = (1, 2, 4, 8, 16)
KV_BACKENDS = ("triton", "flashinfer", "flash_attn")


@st.composite
def mixed_backend_pairs(draw, pairs):
    """A pair from ``pairs`` (an ``fkv.testing.engine_pairs`` strategy, built once: building one
    per draw is slow), then each K/V side's own backend (engine_pairs draws one backend for both
    sides; fkv pairs any two K/V backends)."""
    pair = draw(pairs)

    def side(engine, spec):
        return (engine, spec if spec.is_mla else spec.evolve(backend=draw(st.sampled_from(KV_BACKENDS))))

    return EnginePair(prefill=side(*pair.prefill), decode=side(*pair.decode))


@settings(max_examples=300)
@given(engine_pairs(**ONE_MODEL, prefill_tp=1, decode_tp=TPS).map(lambda pair: pair.decode))
def test_handshake_with_itself_accepts(x):
    result = handshake(x, x)
    assert isinstance(result, Accept), str(result)
    plan = result.plan
    assert plan.remote_ranks == (x[0].tp_rank,) and plan.notify_only_ranks == ()
    assert plan.strategy == "direct" and plan.cost.nbytes == x[1].page_bytes * x[1].num_layers
    rows = plan.segments([3, 4], [3, 4])  # same bytes on both sides: rows copy in place
    assert (rows[:, 2] == rows[:, 4]).all() and (rows[:, 1] == rows[:, 3]).all()
    assert int(rows[:, 5].sum()) == 2 * x[1].page_bytes * x[1].num_layers


@settings(max_examples=300)
@given(mixed_backend_pairs(engine_pairs(**ONE_MODEL, prefill_tp=TPS, decode_tp=TPS)))
def test_every_consistent_pair_of_one_model_is_accepted(pair):
    # Same model and dtypes, any TP pair, layout, backend, cross_layer and block sizes: fkv serves it.
    result = handshake(pair.decode, pair.prefill)
    assert isinstance(result, Accept), str(result)
    plan = result.plan
    group = plan.remote_ranks + plan.notify_only_ranks
    assert sorted(group) == list(range(min(group), min(group) + len(group)))
    assert len(group) == max(1, pair.prefill[0].tp_size // pair.decode[0].tp_size)


# -- totality on arbitrary pairs ------------------------------------------------------------------

@st.composite
def anything_pairs(draw):
    """Independent fields, most combinations inconsistent; sometimes not even the right types."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.one_of(st.none(), st.integers(), st.text(max_size=3), st.tuples(st.integers()),
                              st.lists(st.none(), max_size=3)))
    backend = draw(st.sampled_from(["triton", "flashinfer", "flash_attn", "mla"]))
    tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
    engine = EngineDesc(engine_id=draw(st.sampled_from(["p", "d"])), tp_size=tp,
                        tp_rank=draw(st.integers(0, tp - 1)),
                        total_num_kv_heads=draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
                        model=draw(st.sampled_from(["", "m", "n"])),
                        model_dtype=draw(st.sampled_from(["", "bfloat16"])),
                        protocol=draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 7])))
    spec = KVCacheSpec(backend=backend, layout=draw(st.sampled_from(["NHD", "HND"])),
                       num_blocks=draw(st.integers(1, 8)), block_size=draw(st.sampled_from([1, 3, 16])),
                       num_kv_heads=1 if backend == "mla" else draw(st.sampled_from([1, 2, 3, 4, 8])),
                       head_size=draw(st.sampled_from([2, 64])),
                       dtype=draw(st.sampled_from(["bfloat16", "float32"])),
                       num_layers=draw(st.integers(1, 3)), cross_layer=draw(st.booleans()))
    return [engine, spec] if kind == 1 else (engine, spec)


@settings(max_examples=1500)
@given(anything_pairs(), anything_pairs(), st.sampled_from(["auto", "direct", "staging", "?", None]))
def test_never_raises_and_every_reason_names_a_real_field(local, remote, strategy):
    result = handshake(local, remote, strategy=strategy)
    assert isinstance(result, Accept | Reject)
    if isinstance(result, Reject):
        assert result.reasons and not result.ok and not result
        for r in result.reasons:
            assert r.code in REASON_CODES and r.code != "internal", str(r)
            assert r.message and r.fix
            resolve(r.path, local, remote)
    else:
        plan = result.plan
        n_l, n_r = plan.local_spec.block_size, plan.remote_spec.block_size
        tokens = min(plan.local_spec.num_blocks * n_l, plan.remote_spec.num_blocks * n_r)
        rows = plan.segments(range(-(-tokens // n_l)), range(-(-tokens // n_r)))
        assert (rows[:, 5] > 0).all()
        assert ((rows[:, 3] >= 0) == (plan.strategy == "direct")).all()


# -- values, printing, purity -------------------------------------------------------------------

def test_engine_desc_validates():
    with pytest.raises(FkvError, match=r"'tp_rank' must be in \[0, tp_size=2\) \(got 2\)"):
        EngineDesc(engine_id="x", tp_size=2, tp_rank=2, total_num_kv_heads=8)
    with pytest.raises(FkvError, match="'tp_size' must be a positive int"):
        EngineDesc(engine_id="x", tp_size=0, tp_rank=0, total_num_kv_heads=8)
    with pytest.raises(FkvError, match="'engine_id' must be a str"):
        EngineDesc(engine_id=1, tp_size=1, tp_rank=0, total_num_kv_heads=8)
    e = EngineDesc(engine_id="x", tp_size=16, tp_rank=5, total_num_kv_heads=4, model_dtype="torch.float16")
    assert (e.model_dtype, e.heads_per_rank, e.replicated) == ("float16", 1, True)
    assert [rank_heads(4, 16, r) for r in (0, 3, 4, 15)] == [(0, 1), (0, 1), (1, 1), (3, 1)]


def test_results_print_stably():
    reject = handshake(rank(1, 0), rank(1, 0, dtype="float16", head_size=64))
    assert str(reject) == snapshot("Reject: 2 reasons\n  - remote.spec.dtype: cache dtypes differ (local 'bfloat16', remote 'float16'); fix: use the same kv-cache dtype on both engines\n  - remote.spec.head_size: head sizes differ (local 128, remote 64); fix: both engines must serve the same model (same head_size)")
    assert "<table>" in reject._repr_html_() and "remote.spec.dtype" in reject._repr_html_()
    err = reject.as_error()
    assert isinstance(err, FkvError) and err.reasons == reject.reasons and "2 reasons" in str(err)
    accept = handshake(rank(2, 0), rank(1, 0))
    assert accept and accept.ok and str(accept).startswith("Accept\ndecode rank 0 of tp 2")
    assert accept._repr_html_().startswith("<b>Accept</b><pre>")


def test_pure_modules_import_no_heavy_dependency():
    code = ("import sys, fkv.connector.handshake, fkv.connector.plan, fkv.connector.wire; "
            "bad = [m for m in ('torch', 'triton', 'zmq', 'nixl', 'rich') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the ranks of one prefill engine (docs/handshake.md, remote_ranks) ---------------------------------------

def test_check_remote_ranks():
    from fkv.connector.handshake import check_remote_ranks

    ranks = [rank(4, r) for r in (2, 0, 3, 1)]
    assert check_remote_ranks(ranks) == ()
    odd = list(ranks)
    odd[2] = (odd[2][0], odd[2][1].evolve(num_blocks=60, layout="NHD"))
    odd[3] = (attrs.evolve(odd[3][0], model="other"), odd[3][1])
    assert [str(r) for r in check_remote_ranks(odd[:3] + [odd[3]])] == snapshot([
        'remote[2].spec.layout: rank 3 reports layout=NHD, rank 0 layout=HND (local None, remote Layout.NHD); fix: configure every rank of the prefill engine alike',
        'remote[2].spec.num_blocks: rank 3 reports num_blocks=60, rank 0 num_blocks=64 (local None, remote 60); fix: configure every rank of the prefill engine alike',
        "remote[3].engine.model: rank 1 reports model='other', rank 0 model='m' (local None, remote 'other'); fix: configure every rank of the prefill engine alike",
    ])
    assert [r.path for r in check_remote_ranks(ranks[:3])] == ["remote"]  # rank 1 missing
    assert [r.path for r in check_remote_ranks(ranks + [ranks[0]])] == ["remote"]  # rank 2 twice
    assert [(r.code, r.path) for r in check_remote_ranks([ranks[0], "x"])] == [("type", "remote[1]")]
    assert check_remote_ranks([])[0].code == "remote_ranks"
    assert check_remote_ranks(None)[0].code == "remote_ranks"
    for r in check_remote_ranks(odd):
        head, _, field = r.path.partition(".")
        i = int(head[len("remote["):-1]) if "[" in head else None
        if field:
            part, name = field.split(".")
            assert name in {f.name for f in attrs.fields(type(odd[i][part == "spec"]))}


# -- holes found by mutation (2026-12-04) ---------------------------------------------------------

def test_a_k_v_decode_refuses_an_mla_prefill():
    """The family check runs both ways: the MLA side may be the remote one."""
    assert reasons(rank(1, 0, heads=1), rank(1, 0, backend="mla", head_size=128)) == [
        "remote.spec.backend: an MLA cache (one latent per token) cannot pair with a K/V cache "
        "(local 'triton', remote 'mla'); fix: use an MLA backend on both engines, or a K/V "
        "backend on both"]


@pytest.mark.parametrize("side", ["local", "remote"])
def test_an_older_protocol_is_refused_too(side):
    old = rank(1, 0, engine={"protocol": 0})
    local, remote = (old, rank(1, 0)) if side == "local" else (rank(1, 0), old)
    lp, rp = (0, 1) if side == "local" else (1, 0)
    (r,) = handshake(local, remote).reasons
    assert r == Reason("protocol", f"{side}.engine.protocol", lp, rp,
                       f"decode speaks fkv protocol {lp}, prefill speaks {rp}; this fkv speaks "
                       "protocol 1", "run the same fkv version on both engines")


@pytest.mark.parametrize("strategy", ["direct", "staging"])
def test_a_forced_strategy_reaches_the_plan(strategy):
    result = handshake(rank(1, 0), rank(1, 0), strategy=strategy)
    assert result.ok and result.plan.strategy == strategy
    assert handshake(rank(1, 0), rank(1, 0)).plan.strategy == "direct"  # auto: the cheaper


def test_wrong_types_inside_a_pair_name_the_index_and_the_side():
    engine, spec = rank(1, 0)
    result = handshake(([engine], spec), (spec, engine))
    assert list(result.reasons) == [
        Reason("type", "local.engine", "list", None, "local[0] must be a EngineDesc, got list",
               "build it with fkv.connector.EngineDesc(...)"),
        Reason("type", "remote.engine", None, "KVCacheSpec",
               "remote[0] must be a EngineDesc, got KVCacheSpec",
               "build it with fkv.connector.EngineDesc(...)"),
        Reason("type", "remote.spec", None, "EngineDesc",
               "remote[1] must be a KVCacheSpec, got EngineDesc",
               "build it with fkv.KVCacheSpec(...) or fkv.infer_spec"),
    ]


def test_a_corrupted_tp_rank_is_a_named_reason():
    engine, spec = rank(2, 1)
    object.__setattr__(engine, "tp_rank", 2)  # past the validators, as a decoded peer could be
    (r,) = handshake((engine, spec), rank(2, 0)).reasons
    assert r == Reason("tp_rank", "local.engine.tp_rank", 2, None, "tp_rank must be in [0, 2)",
                       "pass the rank's index inside its own tensor-parallel group")


def test_one_reason_prints_in_the_singular():
    assert str(handshake(rank(1, 0), rank(1, 0, dtype="float16"))) == (
        "Reject: 1 reason\n  - remote.spec.dtype: cache dtypes differ (local 'bfloat16', remote "
        "'float16'); fix: use the same kv-cache dtype on both engines")


def test_replicated_only_past_one_rank_per_head():
    e = lambda tp: EngineDesc(engine_id="x", tp_size=tp, tp_rank=0, total_num_kv_heads=8)
    assert [(e(tp).heads_per_rank, e(tp).replicated) for tp in (4, 8, 16)] == [
        (2, False), (1, False), (1, True)]


def test_check_remote_ranks_compares_every_engine_field():
    from fkv.connector.handshake import check_remote_ranks

    (e0, s), (e1, _) = rank(2, 0), rank(2, 1)
    odd = attrs.evolve(e1, engine_id="other", tp_size=4, total_num_kv_heads=16,
                       model_dtype="float16", protocol=2)
    fix = "configure every rank of the prefill engine alike"
    assert [str(r) for r in check_remote_ranks([(e0, s), (odd, s)])] == [
        f"remote[1].engine.engine_id: rank 1 reports engine_id='other', rank 0 engine_id='tp2' "
        f"(local None, remote 'other'); fix: {fix}",
        f"remote[1].engine.tp_size: rank 1 reports tp_size=4, rank 0 tp_size=2 (local None, "
        f"remote 4); fix: {fix}",
        f"remote[1].engine.total_num_kv_heads: rank 1 reports total_num_kv_heads=16, rank 0 "
        f"total_num_kv_heads=8 (local None, remote 16); fix: {fix}",
        f"remote[1].engine.model_dtype: rank 1 reports model_dtype='float16', rank 0 "
        f"model_dtype='bfloat16' (local None, remote 'float16'); fix: {fix}",
        f"remote[1].engine.protocol: rank 1 reports protocol=2, rank 0 protocol=1 (local None, "
        f"remote 2); fix: {fix}",
    ]


def test_a_side_that_is_not_a_pair_carries_its_value_on_its_side():
    assert handshake("x", rank(1, 0)).reasons == (Reason(
        "type", "local", "x", None, "local must be a pair (EngineDesc, KVCacheSpec), got str",
        "pass local=(EngineDesc(...), KVCacheSpec(...))"),)
    assert handshake(rank(1, 0), 3).reasons == (Reason(
        "type", "remote", None, 3, "remote must be a pair (EngineDesc, KVCacheSpec), got int",
        "pass remote=(EngineDesc(...), KVCacheSpec(...))"),)


def test_check_remote_ranks_names_the_ranks_it_needs():
    from fkv.connector.handshake import check_remote_ranks

    (r,) = check_remote_ranks([rank(4, r) for r in (0, 1, 3)])
    assert str(r) == ("remote: an engine of tp_size 4 needs ranks 0..3 once each; got ranks "
                      "[0, 1, 3] (local None, remote [0, 1, 3]); fix: wait until every prefill "
                      "rank has published its metadata")


def test_heads_that_cannot_split_are_the_only_reason_of_their_side():
    """No per-rank head count is derived from an impossible split: one reason, not two."""
    engine, spec = rank(3, 1)
    assert reasons((engine, spec.evolve(num_kv_heads=8)), rank(1, 0)) == [
        "local.engine.tp_size: 8 total KV heads cannot be split over tp_size 3 (neither divides "
        "the other) (local 3, remote None); fix: use a tp_size that divides the KV head count, "
        "or a multiple of it (replicated KV)"]


def test_mla_needs_exactly_one_total_head():
    two = rank(1, 0, backend="mla", head_size=576, engine={"total_num_kv_heads": 2})
    message = ("an MLA cache holds one latent vector per token shared by all heads, so "
               "total_num_kv_heads must be 1")
    assert handshake(two, two).reasons == (
        Reason("kv_heads", "local.engine.total_num_kv_heads", 2, None, message,
               "pass total_num_kv_heads=1 for MLA models"),
        Reason("kv_heads", "remote.engine.total_num_kv_heads", None, 2, message,
               "pass total_num_kv_heads=1 for MLA models"))


def test_a_list_is_a_pair_too():
    result = handshake(list(rank(2, 1)), [*rank(1, 0)])
    assert result.ok and result.plan.remote_ranks == (0,)


def test_protocol_reason_names_only_the_versions_it_knows():
    (bad, proto) = handshake("x", rank(1, 0, engine={"protocol": 2})).reasons
    assert bad.path == "local"
    assert proto == Reason("protocol", "remote.engine.protocol", None, 2,
                           "prefill speaks 2; this fkv speaks protocol 1",
                           "run the same fkv version on both engines")
