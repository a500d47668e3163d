"""The side channel with CURVE keys (``serve(curve=)`` / ``connect(curve=)``): a decode rank with
an allowed key reads; one without the server's key, or with a key the server does not allow, is
refused within its connect timeout and the server keeps serving. CPU, one process, real NIXL."""

from __future__ import annotations

import time

import pytest
import torch

import fkv
from fkv.connector import CurveKeys, EngineDesc, connect, curve_keypair, serve
from fkv.errors import FkvError

pytestmark = pytest.mark.transport

SPEC = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=4, num_kv_heads=2, head_size=8)


def engine(name: str) -> EngineDesc:
    return EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=2)


def test_curve_side_channel_admits_only_allowed_keys() -> None:
    server_pub, server_sec = curve_keypair()
    good_pub, good_sec = curve_keypair()
    bad_pub, bad_sec = curve_keypair()
    src = fkv.allocate(SPEC)
    src[0].copy_(torch.randn(src[0].shape))
    with serve(engine("p"), SPEC, src,
               curve=CurveKeys(server_pub, server_sec, allowed=frozenset({good_pub}))) as server:
        assert server.address.startswith("tcp://")
        for keys in (CurveKeys(bad_pub, bad_sec, server=server_pub),   # not allowed
                     CurveKeys(good_pub, good_sec, server=bad_pub)):   # wrong server key
            t0 = time.monotonic()
            with pytest.raises(FkvError, match="no answer from the prefill side channel"):
                connect(engine("d"), SPEC, fkv.allocate(SPEC), remote_address=server.address,
                        timeout=1.0, curve=keys)
            assert time.monotonic() - t0 < 5.0
        dst = fkv.allocate(SPEC)
        server.hold("r1", [3, 1])
        with connect(engine("d"), SPEC, dst, remote_address=server.address, timeout=10.0,
                     curve=CurveKeys(good_pub, good_sec, server=server_pub)) as client:
            result = client.read("r1", [0, 5], [3, 1])
        assert result.ok, result.error
        assert torch.equal(dst[0][0], src[0][3]) and torch.equal(dst[0][5], src[0][1])


def test_a_plain_client_does_not_reach_a_curve_server() -> None:
    server_pub, server_sec = curve_keypair()
    with serve(engine("p"), SPEC, fkv.allocate(SPEC),
               curve=CurveKeys(server_pub, server_sec)) as server:
        with pytest.raises(FkvError, match="side channel"):
            connect(engine("d"), SPEC, fkv.allocate(SPEC), remote_address=server.address,
                    timeout=1.0)
