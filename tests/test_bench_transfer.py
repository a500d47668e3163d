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


def test_the_streaming_prefill_writes_each_layer_of_the_request_with_write_kv(monkeypatch):
    """``--stream-write kv``: before each publish the prefill writes the layer's K and V of the
    request's blocks (their slots, in order) with write_kv; the bytes are those already there
    (what every read checks), so the cache is unchanged."""
    import torch

    import fkv
    from fkv.bench.transfer import _canon, _stream_writer
    from fkv.ops import reference

    spec = fkv.KVCacheSpec(layout="HND", num_blocks=6, block_size=4, num_kv_heads=2,
                           head_size=8, dtype="bfloat16", num_layers=2)
    caches = fkv.allocate(spec)
    for i, layer in enumerate(caches):
        layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(i)))
    before = [layer.clone() for layer in caches]
    calls = []
    real = reference.write_kv

    def spy(key, value, cache, slots, spec_):
        calls.append((cache.data_ptr(), slots.tolist(), key.clone(), value.clone()))
        real(key, value, cache, slots, spec_)

    monkeypatch.setattr(reference, "write_kv", spy)
    threads = torch.get_num_threads()
    try:
        write = _stream_writer(spec, caches, torch.device("cpu"), [4, 1])
        write(1)
    finally:
        torch.set_num_threads(threads)
    (ptr, slots, key, value), = calls
    assert ptr == caches[1].data_ptr() and slots == [16, 17, 18, 19, 4, 5, 6, 7]
    canon = _canon(before[1], spec)  # (block, token, K/V, head, dim)
    assert torch.equal(key, canon[[4, 1], :, 0].reshape(8, 2, 8))
    assert torch.equal(value, canon[[4, 1], :, 1].reshape(8, 2, 8))
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


@pytest.mark.transport
def test_the_transfer_bench_streams_a_request_on_the_cpu(tmp_path):
    """The streaming bench end to end, small: a prefill process that writes and publishes each
    layer, two decode ranks reading as it goes; the result file has the tail and its parts."""
    import json
    import subprocess
    import sys

    out = tmp_path / "t.json"
    run = subprocess.run([sys.executable, "-m", "fkv", "bench", "transfer", "--device", "cpu",
                          "--cases", "hnd-auto", "--blocks", "64", "--sizes", "2", "--layers",
                          "3", "--reps", "2", "--stream", "--compute-ms", "5", "--json",
                          str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    case, = json.loads(out.read_text())["cases"]
    assert case["params"]["stream_write"] == "kv" and case["params"]["layers"] == 3
    m = case["metrics"]
    assert m["stream_tail_ms"] > 0 and m["layer_ms"] > 0
    assert m["stream_landed_ms"] <= m["stream_tail_ms"]
    assert m["tail_over_layer_x"] == pytest.approx(m["stream_tail_ms"] / m["layer_ms"])
    assert m["stream_layer_ms"] > 0
    assert m["tail_over_streamed_layer_x"] == pytest.approx(m["stream_tail_ms"]
                                                            / m["stream_layer_ms"])


def test_a_streamed_layer_is_timed_from_its_publish_to_its_landing_on_every_rank():
    """``stream_layer_ms``: per request and middle layer, the slowest decode rank's landing
    minus the publish; the median of those, in ms. The first and the last layer are left out."""
    from fkv.bench.transfer import _streamed_layer_ms

    published = [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]]
    landed = [  # decode rank 0, rank 1: per request, per layer
        [[0.5, 1.001, 2.004, 9.0], [10.5, 11.002, 12.003, 19.0]],
        [[0.7, 1.003, 2.002, 9.0], [10.6, 11.001, 12.001, 19.0]],
    ]
    # the middle layers took 3 and 4 ms (request 0), 2 and 3 ms (request 1), on the slower rank
    assert _streamed_layer_ms(landed, published) == pytest.approx(3.0)
    assert _streamed_layer_ms([[[0.5, 1.0]]], [[0.0, 0.5]]) == 0.0  # two layers: no middle one


def test_a_transfer_run_cut_short_keeps_the_cases_it_measured(tmp_path, monkeypatch):
    """The result file is written after every case (one file, one timestamp): a run stopped
    by its time limit in the middle still leaves what it measured (nothing is spawned here: the
    cases and ceilings are stand-ins)."""
    import json

    from fkv.bench import transfer

    monkeypatch.setattr(transfer, "_copy_ceiling", lambda cfg: 90.0)
    monkeypatch.setattr(transfer, "_link_ceilings", lambda cfg, sizes, page: {})
    seen = []

    def measured(cfg, case):
        seen.append(case.name)
        if len(seen) == 3:
            raise KeyboardInterrupt  # as a timeout's signal would stop it
        rows = []
        for n in case.sizes:
            row = transfer.Case(**{**transfer.asdict(case), "request_blocks": n})
            row.gbps, row.ms, row.payload_per_request = 2.0 * len(seen), 1.5, n << 16
            rows.append(row)
        return rows

    monkeypatch.setattr(transfer, "_run_case", measured)
    out = tmp_path / "t.json"
    with pytest.raises(KeyboardInterrupt):
        transfer.main(["--device", "cpu", "--cases", "hnd-auto,hnd-direct,nhd-staging,hnd-auto",
                       "--blocks", "64", "--sizes", "2,4", "--json", str(out)])
    assert seen == ["hnd-auto", "hnd-direct", "nhd-staging"]  # in the order given, each once
    doc = json.loads(out.read_text())
    assert [(c["params"]["series"], c["params"]["request_blocks"], c["metrics"]["gbps"])
            for c in doc["cases"]] == [("hnd-auto", 2, 2.0), ("hnd-auto", 4, 2.0),
                                       ("hnd-direct", 2, 4.0), ("hnd-direct", 4, 4.0)]
    assert doc["config"]["sizes"] == [2, 4] and doc["ceilings"] == {"copy_gbps": 90.0}
    assert list(tmp_path.iterdir()) == [out]


@pytest.mark.parametrize(("device", "mps", "where"), [
    ("cuda", True, "cuda:0->cuda:0 under MPS"), ("cuda", False, "cuda:0->cuda:0"),
    ("cpu", True, "cpu")])
def test_a_gpu_run_under_mps_is_another_case(device, mps, where):
    """Under MPS the processes sharing a GPU overlap their kernels (a streamed ipc tail 0.09
    against 0.35 ms): such a run's rows are cases of their own, never the same rows as a run
    without it."""
    import argparse

    from fkv.bench import transfer

    case = transfer.Case(name="hnd-ipc", prefill_tp=1, decode_tp=2, prefill_layout="HND",
                         decode_layout="HND", request_blocks=256)
    case.gbps, case.ms, case.payload_per_request = 900.0, 0.5, 256 << 16
    cfg = {"p_gpu": 0, "d_gpu": 0, "d_gpus": [], "stream": False, "layers": 32}
    run = transfer._to_run([case], cfg, argparse.Namespace(device=device), 4000.0, {}, 16384,
                           {"mps": mps}, {}, {})
    assert [c.case for c in run.cases] == [f"hnd-ipc 256 blocks x32 layers of 16384 {where}"]


def test_cases_run_in_the_order_given_each_once():
    import argparse

    from fkv.bench import transfer

    def names(cases, ucx_tls=""):
        args = argparse.Namespace(cases=cases, ucx_tls=ucx_tls, sizes=[2], request_blocks=None,
                                  blocks=64, quick=False)
        return [(c.name, c.ucx_tls) for c in transfer._cases(args)]

    assert names(["nhd-staging", "link", "nhd-staging"]) == [("nhd-staging", ""), ("link", "")]
    assert names(["hnd-auto", "link"], "rc;tcp") == [("hnd-auto", "rc"), ("link", "rc"),
                                                      ("hnd-auto", "tcp"), ("link", "tcp")]
    assert [n for n, _ in names(None)] == list(transfer.CASE_NAMES)
