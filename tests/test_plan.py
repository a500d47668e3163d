"""The transfer plan: docs/handshake.md worked examples byte for byte, snapshots of a matrix of named
configurations, and a byte-level numpy simulation of every accepted pair (READ rows, then a
numpy reference of the staging move steps) that must give each decode rank exactly its heads."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from inline_snapshot import snapshot

from fkv import FkvError, KVCacheSpec
from fkv.connector.handshake import Accept, EngineDesc, handshake
from fkv.connector.plan import StagingStep, expected_notifications
from fkv.testing import engine_pairs

_ELEM = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_CANON = ("B", "two", "N", "H", "C")


# -- helpers ------------------------------------------------------------------------------------

def rank(tp: int, r: int, *, heads: int = 8, **kw) -> tuple[EngineDesc, KVCacheSpec]:
    """Rank ``r`` of a TP ``tp`` engine with ``heads`` total KV heads (num_kv_heads derived)."""
    base = dict(layout="HND", num_blocks=64, block_size=16, head_size=128)
    base.update(kw)
    mla = base.get("backend") == "mla"
    engine = EngineDesc(engine_id=f"tp{tp}", tp_size=tp, tp_rank=r,
                        total_num_kv_heads=1 if mla else heads, model="m")
    return engine, KVCacheSpec(num_kv_heads=1 if mla else max(1, heads // tp), **base)


def plan_of(local, remote, **kw):
    result = handshake(local, remote, **kw)
    assert isinstance(result, Accept), str(result)
    return result.plan


def layer_views(spec: KVCacheSpec, regions: list[np.ndarray]) -> list[np.ndarray]:
    """Per-layer views with canonical axes (B, two, N, H, C) (MLA: (B, N, C)) over region bytes,
    built from the docs/layouts.md table alone: reshape to the physical shape, transpose by the inverse order."""
    elem = _ELEM[spec.itemsize]
    inv = tuple(int(i) for i in np.argsort(spec.stride_order))
    if spec.cross_layer:
        full = regions[0].view(elem).reshape(spec.physical_shape).transpose(inv)
        layers = [full[layer] for layer in range(spec.num_layers)]
    else:
        layers = [r.view(elem).reshape(spec.physical_shape).transpose(inv) for r in regions]
    perm = [spec.logical_axes.index(a) for a in _CANON if a in spec.logical_axes]
    return [x.transpose(perm) for x in layers]


def heads_of(total: int, tp: int, r: int) -> range:
    """The engine's rule, restated independently: contiguous slices, or one replicated head."""
    if tp <= total:
        return range(r * (total // tp), (r + 1) * (total // tp))
    return range(r // (tp // total), r // (tp // total) + 1)


def poison(rng: np.random.Generator, spec: KVCacheSpec) -> list[np.ndarray]:
    return [rng.integers(0, 256, spec.region_bytes, dtype=np.uint8) for _ in range(spec.num_regions)]


def simulate(plan, local_ids, remote_ids, rng: np.random.Generator, num_tokens=None,
             staging_layers=None) -> None:
    """Run ``plan`` on numpy buffers and check the decode rank's bytes exactly. With
    ``staging_layers=k`` the rows and moves run ``k`` layers at a time through a staging buffer
    of ``k`` layers (as a streamed read does), the buffer's old bytes left between windows."""
    le, ls, re_, rs = plan.local_engine, plan.local_spec, plan.remote_engine, plan.remote_spec
    total, mla = le.total_num_kv_heads, ls.is_mla
    n_l, n_r = ls.block_size, rs.block_size
    tokens = num_tokens or min(len(local_ids) * n_l, len(remote_ids) * n_r)
    tok = np.arange(tokens)
    shape = (ls.num_layers, tokens, ls.head_size) if mla else \
        (ls.num_layers, tokens, 2, total, ls.head_size)
    elem = _ELEM[ls.itemsize]
    kv = rng.integers(0, np.iinfo(elem).max, size=shape, dtype=elem, endpoint=True)

    prefill = {}
    for s in range(re_.tp_size):
        regions = poison(rng, rs)
        hs = heads_of(total, re_.tp_size, s)
        for layer, view in enumerate(layer_views(rs, regions)):
            b, slot = np.asarray(remote_ids)[tok // n_r], tok % n_r
            if mla:
                view[b, slot] = kv[layer]
            else:
                view[b, :, slot] = kv[layer][:, :, hs.start:hs.stop]
        prefill[s] = regions

    decode = poison(rng, ls)
    expected = [r.copy() for r in decode]
    mine = heads_of(total, le.tp_size, le.tp_rank)
    lb, lslot = np.asarray(local_ids)[tok // n_l], tok % n_l
    for layer, view in enumerate(layer_views(ls, expected)):
        if mla:
            view[lb, lslot] = kv[layer]
        else:
            view[lb, :, lslot] = kv[layer][:, :, mine.start:mine.stop]

    window = staging_layers or ls.num_layers
    staging = rng.integers(0, 256, plan.staging_bytes(len(remote_ids), staging_layers),
                           dtype=np.uint8)
    rows = plan.segments(local_ids, remote_ids, num_tokens=num_tokens,
                         staging_layers=staging_layers)
    assert rows.dtype == np.int64 and rows.ndim == 2 and rows.shape[1] == 6
    steps = plan.staging_steps(local_ids, remote_ids, num_tokens=num_tokens,
                               staging_layers=staging_layers)
    for first in range(0, ls.num_layers, window):  # a window of layers: its rows, then its moves
        layers = range(first, min(ls.num_layers, first + window))
        for r_rank, r_reg, r_off, l_reg, l_off, nbytes in rows.tolist():
            if window < ls.num_layers and r_reg not in layers:  # per-layer regions: r_reg = layer
                continue
            assert r_rank in plan.remote_ranks and nbytes > 0
            src = prefill[r_rank][r_reg]
            dst = staging if l_reg == -1 else decode[l_reg]
            assert 0 <= r_off and r_off + nbytes <= src.size and 0 <= l_off and \
                l_off + nbytes <= dst.size
            dst[l_off:l_off + nbytes] = src[r_off:r_off + nbytes]
        for step in steps:
            if step.layer in layers:
                reference_move(step, staging, ls, decode, local_ids)
    for got, want in zip(decode, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def reference_move(step: StagingStep, staging: np.ndarray, ls: KVCacheSpec,
                   decode: list[np.ndarray], local_ids) -> None:
    """numpy reference of a staging step: move(stage view [layer], arange(n) -> local [layer])."""
    ss = step.stage_spec
    regions = [staging[step.stage_offset + k * ss.region_bytes:
                       step.stage_offset + (k + 1) * ss.region_bytes] for k in range(ss.num_regions)]
    src = layer_views(ss, regions)[step.stage_layer]
    dst = layer_views(ls, decode)[step.layer]
    t = np.arange(step.num_tokens)
    sb, sslot = t // ss.block_size, t % ss.block_size
    db, dslot = np.asarray(local_ids)[t // ls.block_size], t % ls.block_size
    if ls.is_mla:
        assert step.src_heads is None and step.dst_heads is None
        dst[db, dslot] = src[sb, sslot]
    else:
        (a, b), (c, d) = step.src_heads, step.dst_heads
        assert b - a == d - c
        dst[db, :, dslot, c:d] = src[sb, :, sslot, a:b]


# -- docs/handshake.md worked examples, byte for byte -------------------------------------------

def test_worked_example_a_bytes():
    # P TP=1 -> D TP=2, 8 heads, HND, N=16, D=128, bf16: P page 65536 B, D page 32768 B.
    lb, rb = 3, 5
    want = {0: [[0, 0, rb * 65536 + 0, 0, lb * 32768 + 0, 16384],
                [0, 0, rb * 65536 + 32768, 0, lb * 32768 + 16384, 16384]],
            1: [[0, 0, rb * 65536 + 16384, 0, lb * 32768 + 0, 16384],
                [0, 0, rb * 65536 + 49152, 0, lb * 32768 + 16384, 16384]]}
    for t in (0, 1):
        plan = plan_of(rank(2, t), rank(1, 0))
        assert plan.segments([lb], [rb]).tolist() == want[t]
        assert (plan.remote_ranks, plan.notify_only_ranks, plan.strategy) == ((0,), (), "direct")
        assert plan.notifications == 2 and plan.cost.descriptors == 2  # per block per layer
        assert plan.staging_steps([lb], [rb]) == () and plan.staging_bytes(7) == 0


def test_worked_example_b_bytes():
    # P TP=4 -> D TP=2: P page 16384 B (halves of 8192), D page 32768 B.
    lb, rb = 2, 9
    for t in (0, 1):
        plan = plan_of(rank(2, t), rank(4, 0))
        assert plan.remote_ranks == (2 * t, 2 * t + 1) and plan.notifications == 1
        p0, p1 = 2 * t, 2 * t + 1
        assert plan.segments([lb], [rb]).tolist() == [
            [p0, 0, rb * 16384, 0, lb * 32768 + 0, 8192],             # read 0: K -> [+0, 8192)
            [p0, 0, rb * 16384 + 8192, 0, lb * 32768 + 16384, 8192],  # V -> [+16384, +24576)
            [p1, 0, rb * 16384, 0, lb * 32768 + 8192, 8192],          # read 1: K -> [+8192, 16384)
            [p1, 0, rb * 16384 + 8192, 0, lb * 32768 + 24576, 8192],  # V -> [+24576, 32768)
        ]


def test_spec_edge_cases():
    # K=8 heads, P TP=8 -> D TP=4: each D rank reads 2 P ranks of one head each.
    for t in range(4):
        plan = plan_of(rank(4, t), rank(8, 0))
        assert plan.remote_ranks == (2 * t, 2 * t + 1) and plan.notify_only_ranks == ()
    # MLA, P TP=1 -> D TP=2: both D ranks read the full page from P0; P waits for 2 notifications.
    for t in range(2):
        plan = plan_of(rank(2, t, backend="mla", head_size=576), rank(1, 0, backend="mla", head_size=576))
        assert plan.segments([1], [4]).tolist() == [[0, 0, 4 * 18432, 0, 18432, 18432]]
        assert plan.notifications == 2


def test_group_and_notifications_cover_every_prefill_rank_exactly():
    # Every P rank gets exactly expected_notifications() notifications from the D engine.
    for (heads, tp_d, tp_p, backend) in [(8, 2, 1, "triton"), (8, 2, 4, "triton"), (2, 2, 8, "triton"),
                                         (2, 8, 2, "triton"), (1, 4, 8, "mla"), (1, 8, 2, "mla"),
                                         (4, 8, 8, "triton")]:
        hs = 576 if backend == "mla" else 128
        seen = np.zeros(tp_p, dtype=int)
        for t in range(tp_d):
            plan = plan_of(rank(tp_d, t, heads=heads, backend=backend, head_size=hs),
                           rank(tp_p, 0, heads=heads, backend=backend, head_size=hs))
            group = plan.remote_ranks + plan.notify_only_ranks
            assert len(set(group)) == len(group)
            seen[list(group)] += 1
        assert (seen == expected_notifications(tp_p, tp_d)).all(), (heads, tp_d, tp_p)


# -- a matrix of named configurations, snapshotted ---------------------------------------------

MATRIX = {
    "A: P1->D2 HND, D rank 1": (rank(2, 1), rank(1, 0)),
    "B: P4->D2 HND, D rank 1": (rank(2, 1), rank(4, 0)),
    "homogeneous TP2 HND": (rank(2, 1), rank(2, 0)),
    "P8->D4 one head each": (rank(4, 3), rank(8, 0)),
    "NHD P1->D2 (staging)": (rank(2, 1, layout="NHD"), rank(1, 0, layout="NHD")),
    "NHD P4->D2": (rank(2, 0, layout="NHD"), rank(4, 0, layout="NHD")),
    "layout HND->NHD": (rank(1, 0, layout="NHD"), rank(1, 0)),
    "flash_attn HND -> triton NHD, P2->D1": (rank(1, 0, layout="NHD"),
                                             rank(2, 0, backend="flash_attn")),
    "block 16 (P) -> 32 (D), HND": (rank(1, 0, block_size=32), rank(1, 0)),
    "block 32 (P) -> 16 (D), NHD": (rank(1, 0, layout="NHD"), rank(1, 0, layout="NHD", block_size=32)),
    "cross_layer D only, NHD, 2 layers": (rank(1, 0, layout="NHD", cross_layer=True, num_layers=2),
                                          rank(1, 0, layout="NHD", num_layers=2)),
    "cross_layer P only, HND P1->D2, 2 layers": (rank(2, 1, num_layers=2),
                                                 rank(1, 0, num_layers=2, cross_layer=True)),
    "replicated D: 2 heads, P1->D4": (rank(4, 3, heads=2), rank(1, 0, heads=2)),
    "replicated P: 2 heads, P8->D2": (rank(2, 1, heads=2), rank(8, 0, heads=2)),
    "MLA P4->D2": (rank(2, 1, backend="mla", head_size=576), rank(4, 0, backend="mla", head_size=576)),
}


def _snap(local, remote) -> dict:
    plan = plan_of(local, remote)
    ratio = plan.local_spec.block_size / plan.remote_spec.block_size
    remote_ids = [5, 6]
    local_ids = list(range(max(1, math.ceil(2 / ratio)))) if ratio >= 1 else [0, 1, 2, 3]
    out = {"describe": plan.describe().splitlines(),
           "rows": plan.segments(local_ids, remote_ids).tolist()}
    steps = plan.staging_steps(local_ids, remote_ids)
    if steps:
        out["steps"] = [(s.remote_index, s.stage_offset, s.layer, s.src_heads, s.dst_heads,
                         s.num_tokens) for s in steps]
        out["staging_bytes"] = plan.staging_bytes(2)
    return out


def test_matrix_snapshot():
    assert {name: _snap(*pair) for name, pair in MATRIX.items()} == snapshot({
        'A: P1->D2 HND, D rank 1': {
            'describe': [
                'decode rank 1 of tp 2 <- prefill tp 1: 8 KV heads total, 4 per decode rank, 8 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=4, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16')",
                'reads: P0 heads [4, 8) -> local heads [0, 4)',
                'notify only: none; each prefill rank frees a request after 2 notifications',
                'strategy direct: 2 descriptors, 32768 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 2 descriptors, 32768 B per remote block (all layers), then fkv.ops.move copies 32768 B',
            ],
            'rows': [
                [0, 0, 344064, 0, 0, 16384],
                [0, 0, 376832, 0, 16384, 16384],
                [0, 0, 409600, 0, 32768, 16384],
                [0, 0, 442368, 0, 49152, 16384],
            ],
        },
        'B: P4->D2 HND, D rank 1': {
            'describe': [
                'decode rank 1 of tp 2 <- prefill tp 4: 8 KV heads total, 4 per decode rank, 2 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=4, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=2, head_size=128, dtype='bfloat16')",
                'reads: P2 heads [0, 2) -> local heads [0, 2); P3 heads [0, 2) -> local heads [2, 4)',
                'notify only: none; each prefill rank frees a request after 1 notification',
                'strategy direct: 4 descriptors, 32768 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 2 descriptors, 32768 B per remote block (all layers), then fkv.ops.move copies 32768 B',
            ],
            'rows': [
                [2, 0, 81920, 0, 0, 8192],
                [2, 0, 90112, 0, 16384, 8192],
                [2, 0, 98304, 0, 32768, 8192],
                [2, 0, 106496, 0, 49152, 8192],
                [3, 0, 81920, 0, 8192, 8192],
                [3, 0, 90112, 0, 24576, 8192],
                [3, 0, 98304, 0, 40960, 8192],
                [3, 0, 106496, 0, 57344, 8192],
            ],
        },
        'homogeneous TP2 HND': {
            'describe': [
                'decode rank 1 of tp 2 <- prefill tp 2: 8 KV heads total, 4 per decode rank, 4 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=4, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=4, head_size=128, dtype='bfloat16')",
                'reads: P1 heads [0, 4) -> local heads [0, 4)',
                'notify only: none; each prefill rank frees a request after 1 notification',
                'strategy direct: 1 descriptor, 32768 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 1 descriptor, 32768 B per remote block (all layers), then fkv.ops.move copies 32768 B',
            ],
            'rows': [[1, 0, 163840, 0, 0, 65536]],
        },
        'P8->D4 one head each': {
            'describe': [
                'decode rank 3 of tp 4 <- prefill tp 8: 8 KV heads total, 2 per decode rank, 1 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=2, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=1, head_size=128, dtype='bfloat16')",
                'reads: P6 heads [0, 1) -> local heads [0, 1); P7 heads [0, 1) -> local heads [1, 2)',
                'notify only: none; each prefill rank frees a request after 1 notification',
                'strategy direct: 4 descriptors, 16384 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 2 descriptors, 16384 B per remote block (all layers), then fkv.ops.move copies 16384 B',
            ],
            'rows': [
                [6, 0, 40960, 0, 0, 4096],
                [6, 0, 45056, 0, 8192, 4096],
                [6, 0, 49152, 0, 16384, 4096],
                [6, 0, 53248, 0, 24576, 4096],
                [7, 0, 40960, 0, 4096, 4096],
                [7, 0, 45056, 0, 12288, 4096],
                [7, 0, 49152, 0, 20480, 4096],
                [7, 0, 53248, 0, 28672, 4096],
            ],
        },
        'NHD P1->D2 (staging)': {
            'describe': [
                'decode rank 1 of tp 2 <- prefill tp 1: 8 KV heads total, 4 per decode rank, 8 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=4, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16')",
                'reads: P0 heads [4, 8) -> local heads [0, 4) (staging reads its heads [0, 8))',
                'notify only: none; each prefill rank frees a request after 2 notifications',
                'strategy staging: 1 descriptor, 65536 B per remote block (all layers), then fkv.ops.move copies 32768 B; rows read into staging mini-caches (local_region -1), then staging_steps run one move per read and layer',
                'alternative direct: 32 descriptors, 32768 B per remote block (all layers)',
            ],
            'rows': [[0, 0, 327680, -1, 0, 131072]],
            'steps': [(0, 0, 0, (4, 8), (0, 4), 32)],
            'staging_bytes': 131072,
        },
        'NHD P4->D2': {
            'describe': [
                'decode rank 0 of tp 2 <- prefill tp 4: 8 KV heads total, 4 per decode rank, 2 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=4, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=2, head_size=128, dtype='bfloat16')",
                'reads: P0 heads [0, 2) -> local heads [0, 2); P1 heads [0, 2) -> local heads [2, 4)',
                'notify only: none; each prefill rank frees a request after 1 notification',
                'strategy staging: 2 descriptors, 32768 B per remote block (all layers), then fkv.ops.move copies 32768 B; rows read into staging mini-caches (local_region -1), then staging_steps run one move per read and layer',
                'alternative direct: 64 descriptors, 32768 B per remote block (all layers)',
            ],
            'rows': [[0, 0, 81920, -1, 0, 32768], [1, 0, 81920, -1, 32768, 32768]],
            'steps': [(0, 0, 0, (0, 2), (0, 2), 32), (1, 32768, 0, (0, 2), (2, 4), 32)],
            'staging_bytes': 65536,
        },
        'layout HND->NHD': {
            'describe': [
                'decode rank 0 of tp 1 <- prefill tp 1: 8 KV heads total, 8 per decode rank, 8 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16')",
                'reads: P0 heads [0, 8) -> local heads [0, 8)',
                'notify only: none; each prefill rank frees a request after 1 notification',
                'strategy staging: 1 descriptor, 65536 B per remote block (all layers), then fkv.ops.move copies 65536 B; rows read into staging mini-caches (local_region -1), then staging_steps run one move per read and layer',
                'alternative direct: 256 descriptors, 65536 B per remote block (all layers)',
            ],
            'rows': [[0, 0, 327680, -1, 0, 131072]],
            'steps': [(0, 0, 0, (0, 8), (0, 8), 32)],
            'staging_bytes': 131072,
        },
        'flash_attn HND -> triton NHD, P2->D1': {
            'describe': [
                'decode rank 0 of tp 1 <- prefill tp 2: 8 KV heads total, 8 per decode rank, 4 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='flash_attn', layout='HND', num_blocks=64, block_size=16, num_kv_heads=4, head_size=128, dtype='bfloat16')",
                'reads: P0 heads [0, 4) -> local heads [0, 4); P1 heads [0, 4) -> local heads [4, 8)',
                'notify only: none; each prefill rank frees a request after 1 notification',
                'strategy staging: 4 descriptors, 65536 B per remote block (all layers), then fkv.ops.move copies 65536 B; rows read into staging mini-caches (local_region -1), then staging_steps run one move per read and layer',
                'alternative direct: 256 descriptors, 65536 B per remote block (all layers)',
            ],
            'rows': [
                [0, 0, 81920, -1, 0, 32768],
                [0, 0, 1130496, -1, 32768, 32768],
                [1, 0, 81920, -1, 65536, 32768],
                [1, 0, 1130496, -1, 98304, 32768],
            ],
            'steps': [(0, 0, 0, (0, 4), (0, 4), 32), (1, 65536, 0, (0, 4), (4, 8), 32)],
            'staging_bytes': 131072,
        },
        'block 16 (P) -> 32 (D), HND': {
            'describe': [
                'decode rank 0 of tp 1 <- prefill tp 1: 8 KV heads total, 8 per decode rank, 8 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=32, num_kv_heads=8, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16')",
                'reads: P0 heads [0, 8) -> local heads [0, 8)',
                'notify only: none; each prefill rank frees a request after 1 notification',
                'strategy direct: 16 descriptors, 65536 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 1 descriptor, 65536 B per remote block (all layers), then fkv.ops.move copies 65536 B',
            ],
            'rows': [
                [0, 0, 327680, 0, 0, 4096],
                [0, 0, 331776, 0, 8192, 4096],
                [0, 0, 335872, 0, 16384, 4096],
                [0, 0, 339968, 0, 24576, 4096],
                [0, 0, 344064, 0, 32768, 4096],
                [0, 0, 348160, 0, 40960, 4096],
                [0, 0, 352256, 0, 49152, 4096],
                [0, 0, 356352, 0, 57344, 4096],
                [0, 0, 360448, 0, 65536, 4096],
                [0, 0, 364544, 0, 73728, 4096],
                [0, 0, 368640, 0, 81920, 4096],
                [0, 0, 372736, 0, 90112, 4096],
                [0, 0, 376832, 0, 98304, 4096],
                [0, 0, 380928, 0, 106496, 4096],
                [0, 0, 385024, 0, 114688, 4096],
                [0, 0, 389120, 0, 122880, 4096],
                [0, 0, 393216, 0, 4096, 4096],
                [0, 0, 397312, 0, 12288, 4096],
                [0, 0, 401408, 0, 20480, 4096],
                [0, 0, 405504, 0, 28672, 4096],
                [0, 0, 409600, 0, 36864, 4096],
                [0, 0, 413696, 0, 45056, 4096],
                [0, 0, 417792, 0, 53248, 4096],
                [0, 0, 421888, 0, 61440, 4096],
                [0, 0, 425984, 0, 69632, 4096],
                [0, 0, 430080, 0, 77824, 4096],
                [0, 0, 434176, 0, 86016, 4096],
                [0, 0, 438272, 0, 94208, 4096],
                [0, 0, 442368, 0, 102400, 4096],
                [0, 0, 446464, 0, 110592, 4096],
                [0, 0, 450560, 0, 118784, 4096],
                [0, 0, 454656, 0, 126976, 4096],
            ],
        },
        'block 32 (P) -> 16 (D), NHD': {
            'describe': [
                'decode rank 0 of tp 1 <- prefill tp 1: 8 KV heads total, 8 per decode rank, 8 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=32, num_kv_heads=8, head_size=128, dtype='bfloat16')",
                'reads: P0 heads [0, 8) -> local heads [0, 8)',
                'notify only: none; each prefill rank frees a request after 1 notification',
                'strategy direct: 4 descriptors, 131072 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 1 descriptor, 131072 B per remote block (all layers), then fkv.ops.move copies 131072 B',
            ],
            'rows': [
                [0, 0, 655360, 0, 0, 32768],
                [0, 0, 688128, 0, 65536, 32768],
                [0, 0, 720896, 0, 32768, 32768],
                [0, 0, 753664, 0, 98304, 65536],
                [0, 0, 819200, 0, 196608, 32768],
                [0, 0, 851968, 0, 163840, 32768],
                [0, 0, 884736, 0, 229376, 32768],
            ],
        },
        'cross_layer D only, NHD, 2 layers': {
            'describe': [
                'decode rank 0 of tp 1 <- prefill tp 1: 8 KV heads total, 8 per decode rank, 8 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16', num_layers=2, cross_layer=True)",
                "remote: KVCacheSpec(backend='triton', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16', num_layers=2)",
                'reads: P0 heads [0, 8) -> local heads [0, 8)',
                'notify only: none; each prefill rank frees a request after 1 notification',
                'strategy direct: 2 descriptors, 131072 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 2 descriptors, 131072 B per remote block (all layers), then fkv.ops.move copies 131072 B',
            ],
            'rows': [
                [0, 0, 327680, 0, 0, 65536],
                [0, 0, 393216, 0, 131072, 65536],
                [0, 1, 327680, 0, 65536, 65536],
                [0, 1, 393216, 0, 196608, 65536],
            ],
        },
        'cross_layer P only, HND P1->D2, 2 layers': {
            'describe': [
                'decode rank 1 of tp 2 <- prefill tp 1: 8 KV heads total, 4 per decode rank, 8 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=4, head_size=128, dtype='bfloat16', num_layers=2)",
                "remote: KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, dtype='bfloat16', num_layers=2, cross_layer=True)",
                'reads: P0 heads [4, 8) -> local heads [0, 4)',
                'notify only: none; each prefill rank frees a request after 2 notifications',
                'strategy direct: 16 descriptors, 65536 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 2 descriptors, 65536 B per remote block (all layers), then fkv.ops.move copies 65536 B',
            ],
            'rows': [
                [0, 0, 688128, 0, 0, 4096],
                [0, 0, 692224, 1, 0, 4096],
                [0, 0, 696320, 0, 4096, 4096],
                [0, 0, 700416, 1, 4096, 4096],
                [0, 0, 704512, 0, 8192, 4096],
                [0, 0, 708608, 1, 8192, 4096],
                [0, 0, 712704, 0, 12288, 4096],
                [0, 0, 716800, 1, 12288, 4096],
                [0, 0, 753664, 0, 16384, 4096],
                [0, 0, 757760, 1, 16384, 4096],
                [0, 0, 761856, 0, 20480, 4096],
                [0, 0, 765952, 1, 20480, 4096],
                [0, 0, 770048, 0, 24576, 4096],
                [0, 0, 774144, 1, 24576, 4096],
                [0, 0, 778240, 0, 28672, 4096],
                [0, 0, 782336, 1, 28672, 4096],
                [0, 0, 819200, 0, 32768, 4096],
                [0, 0, 823296, 1, 32768, 4096],
                [0, 0, 827392, 0, 36864, 4096],
                [0, 0, 831488, 1, 36864, 4096],
                [0, 0, 835584, 0, 40960, 4096],
                [0, 0, 839680, 1, 40960, 4096],
                [0, 0, 843776, 0, 45056, 4096],
                [0, 0, 847872, 1, 45056, 4096],
                [0, 0, 884736, 0, 49152, 4096],
                [0, 0, 888832, 1, 49152, 4096],
                [0, 0, 892928, 0, 53248, 4096],
                [0, 0, 897024, 1, 53248, 4096],
                [0, 0, 901120, 0, 57344, 4096],
                [0, 0, 905216, 1, 57344, 4096],
                [0, 0, 909312, 0, 61440, 4096],
                [0, 0, 913408, 1, 61440, 4096],
            ],
        },
        'replicated D: 2 heads, P1->D4': {
            'describe': [
                'decode rank 3 of tp 4 <- prefill tp 1: 2 KV heads total, 1 per decode rank, 2 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=1, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=2, head_size=128, dtype='bfloat16')",
                'reads: P0 heads [1, 2) -> local heads [0, 1)',
                'notify only: none; each prefill rank frees a request after 4 notifications',
                'strategy direct: 2 descriptors, 8192 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 2 descriptors, 8192 B per remote block (all layers), then fkv.ops.move copies 8192 B',
            ],
            'rows': [
                [0, 0, 86016, 0, 0, 4096],
                [0, 0, 94208, 0, 4096, 4096],
                [0, 0, 102400, 0, 8192, 4096],
                [0, 0, 110592, 0, 12288, 4096],
            ],
        },
        'replicated P: 2 heads, P8->D2': {
            'describe': [
                'decode rank 1 of tp 2 <- prefill tp 8: 2 KV heads total, 1 per decode rank, 1 per prefill rank',
                "local:  KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=1, head_size=128, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='triton', layout='HND', num_blocks=64, block_size=16, num_kv_heads=1, head_size=128, dtype='bfloat16')",
                'reads: P4 heads [0, 1) -> local heads [0, 1)',
                'notify only: P5, P6, P7; each prefill rank frees a request after 1 notification',
                'strategy direct: 1 descriptor, 8192 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 1 descriptor, 8192 B per remote block (all layers), then fkv.ops.move copies 8192 B',
            ],
            'rows': [[4, 0, 40960, 0, 0, 16384]],
        },
        'MLA P4->D2': {
            'describe': [
                'decode rank 1 of tp 2 <- prefill tp 4: MLA: one latent vector per token, held whole by every rank',
                "local:  KVCacheSpec(backend='mla', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=1, head_size=576, dtype='bfloat16')",
                "remote: KVCacheSpec(backend='mla', layout='NHD', num_blocks=64, block_size=16, num_kv_heads=1, head_size=576, dtype='bfloat16')",
                'reads: P2 (whole latent)',
                'notify only: P3; each prefill rank frees a request after 1 notification',
                'strategy direct: 1 descriptor, 18432 B per remote block (all layers); every row lands final bytes in the local cache',
                'alternative staging: 1 descriptor, 18432 B per remote block (all layers), then fkv.ops.move copies 18432 B',
            ],
            'rows': [[2, 0, 92160, 0, 0, 36864]],
        },
    })


def test_matrix_simulates_exactly():
    rng = np.random.default_rng(0)
    for name, (local, remote) in MATRIX.items():
        # small shapes with the same structure: 4 blocks per side, ids scattered and contiguous
        small = dict(num_blocks=12, head_size=4)
        loc = (local[0], local[1].evolve(**small, block_size=local[1].block_size // 4))
        rem = (remote[0], remote[1].evolve(**small, block_size=remote[1].block_size // 4))
        for strategy in ("auto", "direct", "staging"):
            plan = plan_of(loc, rem, strategy=strategy)
            ratio = loc[1].block_size / rem[1].block_size
            n_r = 4
            n_l = max(1, math.ceil(n_r / ratio))
            for local_ids, remote_ids in [(rng.permutation(12)[:n_l], rng.permutation(12)[:n_r]),
                                          (np.arange(2, 2 + n_l), np.arange(7, 7 + n_r))]:
                simulate(plan, local_ids, remote_ids, rng)


# -- properties: every accepted pair moves exactly the right bytes --------------------------------

KV_BACKENDS = ("triton", "flashinfer", "flash_attn")
ENGINE_PAIRS = engine_pairs(
    backend=st.integers(0, 5).map(lambda i: "mla" if i == 0 else "triton"),  # K/V: redrawn below
    head_size=(1, 2, 3, 4), block_size=(1, 2, 3, 4, 6, 8),
    dtype=("bfloat16", "float32", "float8_e4m3fn"), num_blocks=1)


@st.composite
def accepted_pairs(draw):
    """``fkv.testing.engine_pairs`` (MLA, replicated KV, both TP directions, layout, block-size and
    cross_layer mismatch), then each K/V side's own backend (engine_pairs shares one) and num_blocks
    fitted to a request of 1..20 tokens."""
    pair = draw(ENGINE_PAIRS)
    local, remote = pair.decode, pair.prefill
    want = draw(st.integers(1, 20))
    n_l, n_r = -(-want // local[1].block_size), -(-want // remote[1].block_size)
    nb_l, nb_r = n_l + draw(st.integers(0, 3)), n_r + draw(st.integers(0, 3))

    def fit(side, num_blocks):
        engine, spec = side
        backend = spec.backend if spec.is_mla else draw(st.sampled_from(KV_BACKENDS))
        return engine, spec.evolve(backend=backend, num_blocks=num_blocks)

    local, remote = fit(local, nb_l), fit(remote, nb_r)
    if draw(st.booleans()):
        local_ids, remote_ids = np.arange(nb_l - n_l, nb_l), np.arange(n_r)
    else:
        local_ids = draw(st.permutations(range(nb_l)))[:n_l]
        remote_ids = draw(st.permutations(range(nb_r)))[:n_r]
    strategy = draw(st.sampled_from(["auto", "direct", "staging"]))
    return local, remote, local_ids, remote_ids, strategy, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=1000)
@given(accepted_pairs())
def test_every_accepted_pair_moves_exactly_its_heads(case):
    local, remote, local_ids, remote_ids, strategy, seed = case
    plan = plan_of(local, remote, strategy=strategy)
    simulate(plan, local_ids, remote_ids, np.random.default_rng(seed))


@settings(max_examples=300)
@given(accepted_pairs(), st.integers(2, 5), st.data())
def test_a_staging_buffer_of_fewer_layers_moves_exactly_the_same_bytes(case, layers, data):
    """``staging_layers=k``: the rows and moves of k layers at a time through a buffer of k
    layers (what a streamed read of a request too large for the whole buffer does) land every
    byte as the whole buffer does; the rows differ only in their staging offsets, and the buffer
    is k / layers of the whole one."""
    local, remote, local_ids, remote_ids, _, seed = case
    local = (local[0], local[1].evolve(num_layers=layers))
    remote = (remote[0], remote[1].evolve(num_layers=layers, cross_layer=False))
    plan = plan_of(local, remote, strategy="staging")
    k = data.draw(st.integers(1, layers))
    simulate(plan, local_ids, remote_ids, np.random.default_rng(seed), staging_layers=k)
    whole = plan.segments(local_ids, remote_ids)
    windowed = plan.segments(local_ids, remote_ids, staging_layers=k)
    if whole.shape == windowed.shape:  # coalescing can merge other rows in the whole buffer
        assert np.array_equal(np.delete(whole, 4, axis=1), np.delete(windowed, 4, axis=1))
    assert plan.staging_bytes(len(remote_ids), k) * layers == \
        plan.staging_bytes(len(remote_ids)) * k
    steps = plan.staging_steps(local_ids, remote_ids, staging_layers=k)
    assert [(s.layer, s.stage_layer, s.stage_spec.num_layers) for s in steps] == \
        [(s.layer, s.layer % k, k) for s in plan.staging_steps(local_ids, remote_ids)]


def test_staging_layers_are_checked():
    kw = dict(heads=4, layout="NHD", num_blocks=8, block_size=4, head_size=8, num_layers=3)
    plan = plan_of(rank(2, 1, **kw), rank(1, 0, **kw), strategy="staging")
    for bad in (0, 4, True, 1.0, "2"):
        with pytest.raises(FkvError, match=r"^'staging_layers' must be an int from 1 to the "
                                           r"spec's num_layers=3 \(got "):
            plan.staging_bytes(2, bad)
    cross = plan_of(rank(2, 1, **kw), rank(1, 0, **kw, cross_layer=True), strategy="staging")
    with pytest.raises(FkvError, match=r"^'staging_layers' must be 3 \(all layers\) \(got 2\); a "
                                       r"staging buffer of fewer layers needs per-layer prefill "
                                       r"caches"):
        cross.segments([0], [1], staging_layers=2)
    assert cross.staging_bytes(1, 3) == cross.staging_bytes(1)
    assert plan.staging_bytes(2, 1) == 2 * 4 * 2 * 4 * 8 * 2  # 2 blocks, K and V, 4 slots, 4 heads
    assert [(st.layer, st.stage_layer, st.stage_offset) for st in
            plan.staging_steps([0, 1], [3, 5], staging_layers=2)] == [(0, 0, 0), (1, 1, 0),
                                                                      (2, 0, 0)]


@settings(max_examples=100)
@given(accepted_pairs())
def test_staging_with_explicit_num_tokens(case):
    local, remote, local_ids, remote_ids, _, seed = case
    plan = plan_of(local, remote, strategy="staging")
    rng = np.random.default_rng(seed)
    cap = min(len(local_ids) * local[1].block_size, len(remote_ids) * remote[1].block_size)
    low = max((len(local_ids) - 1) * local[1].block_size, (len(remote_ids) - 1) * remote[1].block_size)
    simulate(plan, local_ids, remote_ids, rng, num_tokens=int(rng.integers(low + 1, cap + 1)))


@settings(max_examples=200)
@given(accepted_pairs())
def test_a_plan_reused_for_requests_of_one_shape_moves_each_exactly(case):
    """The rows of a request shape are computed once with ids 0 and kept; each request adds its
    ids: every later request of the shape moves exactly its bytes, and its rows equal those of a
    plan that never saw a request."""
    local, remote, local_ids, remote_ids, strategy, seed = case
    plan = plan_of(local, remote, strategy=strategy)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        lids = rng.permutation(local[1].num_blocks)[:len(local_ids)].tolist()
        rids = rng.permutation(remote[1].num_blocks)[:len(remote_ids)].tolist()
        simulate(plan, lids, rids, rng)
        fresh = plan_of(local, remote, strategy=strategy)
        assert plan.segments(lids, rids).tolist() == fresh.segments(lids, rids).tolist()
    assert len(plan._templates) == 1
    assert plan == fresh and hash(plan) == hash(fresh)  # the cache is not part of the value


def test_a_plan_keeps_a_bounded_number_of_request_shapes():
    from fkv.connector import plan as plan_mod

    plan = plan_of(rank(1, 0), rank(2, 1))
    spec = plan.local_spec
    for n in range(1, plan_mod._TEMPLATES + 40):
        ids = list(range(n % spec.num_blocks + 1))
        plan.segments(ids, ids)
        tokens = len(ids) * spec.block_size - n % spec.block_size
        plan.segments(ids, ids, num_tokens=tokens)
        assert len(plan._templates) <= plan_mod._TEMPLATES
    assert plan.segments([5, 2], [1, 0]).tolist() == plan_of(rank(1, 0), rank(2, 1)).segments(
        [5, 2], [1, 0]).tolist()


# -- rows: coalescing, validation, staging layout --------------------------------------------------

def test_rows_coalesce_across_contiguous_blocks():
    plan = plan_of(rank(1, 0), rank(1, 0))  # same layout and TP: whole pages
    assert plan.segments([4, 5, 6, 9], [0, 1, 2, 3]).tolist() == [
        [0, 0, 0, 0, 4 * 65536, 3 * 65536], [0, 0, 3 * 65536, 0, 9 * 65536, 65536]]
    plan = plan_of(rank(1, 0, layout="NHD", cross_layer=True, num_layers=4),
                   rank(1, 0, layout="NHD", cross_layer=True, num_layers=4))
    assert plan.segments([2, 3], [7, 8]).tolist() == [[0, 0, 7 * 4 * 65536, 0, 2 * 4 * 65536, 8 * 65536]]


def test_staging_layout_matches_staging_md():
    plan = plan_of(rank(2, 1, layout="NHD", num_layers=3), rank(4, 0, layout="HND", num_layers=3))
    assert plan.strategy == "staging" and plan.remote_ranks == (2, 3)
    stage = plan.remote_spec.evolve(num_blocks=5)
    mini = stage.region_bytes * stage.num_regions
    assert plan.staging_bytes(5) == 2 * mini
    steps = plan.staging_steps(range(5), [9, 8, 7, 6, 5])
    assert steps == tuple(StagingStep(i, stage, i * mini, layer, (0, 2), (2 * i, 2 * i + 2), 80)
                          for i in range(2) for layer in range(3))
    rows = plan.segments(range(5), [9, 8, 7, 6, 5])
    assert (rows[:, 3] == -1).all() and rows[:, 5].sum() == 2 * 3 * 5 * stage.page_bytes


def test_segments_validation():
    plan = plan_of(rank(2, 0), rank(1, 0))
    with pytest.raises(FkvError, match=r"'local_block_ids'\[1\] = 64 is outside the local cache's \[0, num_blocks=64\)"):
        plan.segments([0, 64], [0, 1])
    with pytest.raises(FkvError, match=r"'remote_block_ids'\[0\] = -1 is outside the remote cache's"):
        plan.segments([0], [-1])
    with pytest.raises(FkvError, match="'local_block_ids' must hold integers"):
        plan.segments([0.5], [1])
    with pytest.raises(FkvError, match="must be 1-D"):
        plan.segments([[0]], [1])
    with pytest.raises(FkvError, match="repeats block 3"):
        plan.segments([3, 3], [0, 1])
    with pytest.raises(FkvError, match="3 tokens need 1 local and 1 remote blocks|local_block_ids has 2 blocks"):
        plan.segments([0, 1], [0])
    with pytest.raises(FkvError, match="both be empty or both non-empty"):
        plan.segments([], [0])
    with pytest.raises(FkvError, match=r"'num_tokens' must be an int in \[1, 16\]"):
        plan.segments([0], [0], num_tokens=17)
    with pytest.raises(FkvError, match="'num_remote_blocks' must be a non-negative int"):
        plan.staging_bytes(-1)
    assert plan.segments([], []).shape == (0, 6) and plan.staging_steps([], []) == ()


def test_segments_100k_blocks_is_vectorized():
    # 100k blocks of example A in well under a second even on a loaded 2-core CI machine.
    import time
    plan = plan_of(rank(2, 1, num_blocks=200_000), rank(1, 0, num_blocks=200_000))
    rng = np.random.default_rng(1)
    local, remote = rng.permutation(200_000)[:100_000], rng.permutation(200_000)[:100_000]
    t0 = time.perf_counter()
    rows = plan.segments(local, remote)
    assert time.perf_counter() - t0 < 1.0
    assert rows.shape == (200_000, 6)
    assert (rows[1::2, 2] - rows[0::2, 2] == 32768).all() and (rows[:, 5] == 16384).all()


def test_plan_prints_stably():
    plan = plan_of(rank(2, 1), rank(1, 0))
    assert repr(plan) == snapshot("TransferPlan(strategy='direct', remote_ranks=(0,), notify_only_ranks=(), reads=[Read(remote_rank=0, remote_heads=(4, 8), local_heads=(0, 4))], descriptors=2, nbytes=32768)")
    assert str(plan) == plan.describe() and "<pre>" in plan._repr_html_()
    assert str(handshake(rank(2, 1), rank(1, 0))).startswith("Accept\n")


# -- the command line -----------------------------------------------------------------------------

def test_cli_plan_accepts_and_prints_rows(capsys):
    from fkv.cli import main

    assert main(["plan", "--local", "tp=2,rank=1", "--remote", "tp=1,layout=LBHNC"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Accept\ndecode rank 1 of tp 2 <- prefill tp 1")
    assert "strategy direct: 2 descriptors, 32768 B per remote block" in out
    assert "example request: 64 tokens" in out and "49152" in out  # V half of remote block 0
    assert main(["plan", "--local", "tp=2, rank=1, layout=NHD, layers=2", "--remote", "tp=1,layout=NHD,layers=2",
                 "--blocks", "1", "--rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "strategy staging" in out and "move: staging[0] (+0 B) layer 1 heads (4, 8) -> local " \
                                         "heads (0, 4), 16 tokens" in out


def test_cli_plan_rejects_with_every_reason(capsys):
    from fkv.cli import main

    assert main(["plan", "--local", "tp=2,dtype=float16,cross_layer=yes,layers=2",
                 "--remote", "tp=3,head_size=64,layers=2,model=llama"]) == 3
    out = capsys.readouterr().out
    assert out.startswith("Reject: 5 reasons")
    for path in ("remote.engine.tp_size (tp_heads)", "remote.engine.model (model)",
                 "remote.spec.dtype (cache_dtype)", "remote.spec.head_size (head_size)",
                 "remote.engine.tp_size (tp_ratio)"):
        assert path in out


@pytest.mark.parametrize(("argv", "match"), [
    (["--local", "tp=2,bogus=1", "--remote", "tp=1"], "--local: unknown key 'bogus'"),
    (["--local", "tp=two", "--remote", "tp=1"], "--local: tp='two' must be an integer"),
    (["--local", "tp", "--remote", "tp=1"], "--local: 'tp' must be KEY=VALUE"),
    (["--local", "tp=1", "--remote", "cross_layer=maybe"], "--remote: cross_layer='maybe' must be true"),
    (["--local", "backend=mla,kv_heads=2", "--remote", "tp=1"], "--local: 'num_kv_heads' must be 1"),
    (["--local", "tp=2,rank=2", "--remote", "tp=1"], r"--local: rank=2 must be below tp=2 \(ranks 0\.\.1\)"),
    (["--local", "tp=1", "--remote", "tp=1", "--blocks", "0"], "--blocks must be >= 1"),
    (["--local", "tp=1"], "required: --remote"),
])
def test_cli_plan_usage_errors(capsys, argv, match):
    from fkv.cli import main

    assert main(["plan", *argv]) == 2
    assert re.search(match, " ".join(capsys.readouterr().err.split()))


def test_bench_plan_runs(tmp_path):
    # The benchmark's own correctness gate (vectorized rows == the per-row reference) on a
    # small request; the timing verdict (exit 0 or 1) depends on the machine's load.
    import json

    from fkv.bench.plan import main

    assert main(["--quick", "--blocks", "48", "--json", str(tmp_path / "plan.json")]) in (0, 1)
    result = json.loads((tmp_path / "plan.json").read_text())
    cases = {c["case"]: c for c in result["cases"]}
    assert {"handshake A: P1->D2 HND", "handshake B: P4->D2 HND"} <= set(cases)
    assert all(c["metrics"]["rows_count"] > 0 for k, c in cases.items() if k.startswith("segments"))


# -- holes found by mutation (2026-12-04) ---------------------------------------------------------

@pytest.mark.parametrize(("local_ids", "remote_ids", "kw", "message"), [
    ([3, 7, 3, 7], [0, 1, 2, 3], {}, "'local_block_ids' repeats block 3: two tokens would land "
                                     "in one slot; pass each local block once"),
    ([0], np.array([2**63], dtype=np.uint64), {}, "'remote_block_ids' holds ids beyond int64"),
    (3, [0], {}, "'local_block_ids' must be 1-D (got shape ())"),
    ([0], [0], {"num_tokens": 0}, "'num_tokens' must be an int in [1, 16] (the capacity of both "
                                  "id lists) (got 0)"),
    ([0], [0], {"num_tokens": True}, "'num_tokens' must be an int in [1, 16] (the capacity of "
                                     "both id lists) (got True)"),
])
def test_segments_refusals_exactly(local_ids, remote_ids, kw, message):
    plan = plan_of(rank(2, 0), rank(1, 0))
    with pytest.raises(FkvError) as e:
        plan.segments(local_ids, remote_ids, **kw)
    assert str(e.value) == message


def test_staging_bytes_of_no_blocks_is_zero_and_a_bool_is_no_count():
    kw = dict(heads=4, layout="NHD", num_blocks=8, block_size=4, head_size=8, num_layers=3)
    plan = plan_of(rank(2, 1, **kw), rank(1, 0, **kw), strategy="staging")
    assert plan.staging_bytes(0) == 0 and plan.staging_bytes(np.int64(0), 2) == 0
    for p in (plan, plan_of(rank(2, 1), rank(1, 0))):
        with pytest.raises(FkvError) as e:
            p.staging_bytes(True)
        assert str(e.value) == "'num_remote_blocks' must be a non-negative int (got True)"


def test_staging_steps_check_staging_layers():
    kw = dict(heads=4, layout="NHD", num_blocks=8, block_size=4, head_size=8, num_layers=3)
    plan = plan_of(rank(2, 1, **kw), rank(1, 0, **kw), strategy="staging")
    for bad in (0, 4):
        with pytest.raises(FkvError) as e:
            plan.staging_steps([0], [1], staging_layers=bad)
        assert str(e.value) == (f"'staging_layers' must be an int from 1 to the spec's "
                                f"num_layers=3 (got {bad})")
    cross = plan_of(rank(2, 1, **kw), rank(1, 0, **kw, cross_layer=True), strategy="staging")
    with pytest.raises(FkvError, match=r"^'staging_layers' must be 3 \(all layers\) \(got 2\)"):
        cross.staging_steps([0], [1], staging_layers=2)


def test_chunk_tokens_per_strategy():
    local, remote = rank(1, 0, layout="NHD"), rank(1, 0, layout="NHD", block_size=32)
    assert plan_of(local, remote, strategy="staging").chunk_tokens == 32  # N_remote
    assert plan_of(local, remote, strategy="direct").chunk_tokens == 16   # gcd(16, 32)


def test_a_cost_tie_goes_to_direct():
    # direct: 2 descriptors + 4096 B; staging: 1 descriptor + 4096 B read + 4096 B moved
    t = dict(heads=1, layout="NHD", block_size=1, head_size=512, num_layers=2)
    plan = plan_of(rank(1, 0, **t), rank(1, 0, **t, cross_layer=True))
    assert plan.cost.score == plan.alternative.score == 3 * 4096
    assert (plan.strategy, plan.alternative.strategy) == ("direct", "staging")


def test_the_template_cache_starts_again_past_its_bound():
    from fkv.connector import plan as plan_mod

    plan = plan_of(rank(1, 0), rank(1, 0))
    shapes = [(n, t) for n in range(1, 20) for t in range((n - 1) * 16 + 1, n * 16 + 1)]
    for k, (n, tokens) in enumerate(shapes[:plan_mod._TEMPLATES + 1]):
        plan.segments(range(n), range(n), num_tokens=tokens)
        assert len(plan._templates) == (k + 1 if k < plan_mod._TEMPLATES else 1)


def test_block_lists_of_other_tokens_and_non_integer_ids_are_refused_exactly():
    plan = plan_of(rank(1, 0, block_size=32), rank(1, 0))  # local blocks of 32, remote of 16
    with pytest.raises(FkvError) as e:
        plan.segments([0, 1], [0, 1])
    assert str(e.value) == ("local_block_ids has 2 blocks of 32 tokens and remote_block_ids 2 "
                            "blocks of 16; 32 tokens need 1 local and 2 remote blocks: pass the "
                            "blocks of the same tokens on both sides")
    for local_ids, remote_ids, name in [([True], [0], "local"), ([0], [False], "remote")]:
        with pytest.raises(FkvError) as e:
            plan.segments(local_ids, remote_ids)
        assert str(e.value) == f"'{name}_block_ids' must hold integers (got dtype bool)"
    with pytest.raises(FkvError) as e:
        plan.segments([[0], [1, 2]], [0])
    assert str(e.value).startswith("'local_block_ids' must be a 1-D sequence of block ids (got "
                                   "list: ")
