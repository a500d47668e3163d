"""The transfer bench's pack-hop accounting (a pure function of the two sides' logs)."""

from __future__ import annotations

import pytest

from fkv.bench.transfer import _pack_hops


def test_pack_hops_match_both_sides_by_request_token_and_block():
    # two decode ranks use the same token numbers; the first block id tells their packs apart
    decode = [
        [["rep-0", 1, 7, 10.000, 10.010, "Packed"], ["rep-0", 2, 9, 10.000, 10.012, "Packed"]],
        [["rep-0", 1, 3, 10.001, 10.020, "Packed"], ["rep-0", 2, 5, 10.001, 10.030, "Error"],
         ["rep-0", 3, 5, 10.002, 10.040, "Packed"]],
    ]
    prefill = [  # request, token, block, taken up, handled, sent
        ["rep-0", 1, 7, 10.001, 10.002, 10.009],
        ["rep-0", 2, 9, 10.003, 10.004, 10.011],
        ["rep-0", 1, 3, 10.011, 10.012, 10.019],
        ["rep-0", 3, 5, 10.020, 10.021, 10.039],
    ]
    hops = _pack_hops(decode, prefill)
    assert hops["packs"] == 4 and hops["retries"] == 1
    # first packs of each rank: (sent 10.000 -> 10.001 -> 10.002 -> 10.009 -> 10.010) and
    # (10.001 -> 10.011 -> 10.012 -> 10.019 -> 10.020)
    assert hops["first"] == pytest.approx({"out": 5.5, "handle": 1.0, "gather": 7.0, "back": 1.0,
                                           "round_trip": 14.5})
    assert hops["all"]["out"] == pytest.approx(6.5)          # 1, 3, 10, 18 ms
    assert hops["all"]["round_trip"] == pytest.approx(15.5)  # 10, 12, 19, 38 ms


def test_pack_hops_empty_without_packs():
    assert _pack_hops([[["rep-0", 1, 7, 1.0, 2.0, "Error"]]], []) == {}
