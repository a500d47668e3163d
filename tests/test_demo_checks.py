"""fkv demo's checking code on hand-built inputs: the verdict, the exit status, the summary's figures.

In process and fast (no child is started): each test pins exact values a mutation audit of
fkv/demo/{verify,summary,config,run}.py found unpinned (a wrong transfer passing, a wrong figure).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from rich.console import Console

import fkv.demo.run as demo_run
from fkv.demo.channel import Collector, Reporter, pack_array
from fkv.demo.config import DemoConfig, ModelConfig
from fkv.demo.run import _verdict, precheck, run_demo
from fkv.demo.summary import print_summary, summary_dict
from fkv.demo.verify import compare_kv, compare_run, tolerance

# -- verify: tolerance and compare_kv ---------------------------------------------------------------


def test_tolerance_is_tight_for_float32_and_loose_for_16_bit_caches():
    assert tolerance("float32") == (1e-4, 1e-4)
    assert tolerance("bfloat16") == tolerance("float16") == (5e-2, 5e-2)


def _ref_kv() -> np.ndarray:
    """``[L=2, T=3, 2, H=4, D=2]`` with distinct, exactly representable values."""
    return (np.arange(2 * 3 * 2 * 4 * 2, dtype=np.float32) / 4).reshape(2, 3, 2, 4, 2)


def test_compare_kv_refuses_received_kv_of_another_shape():
    ref = _ref_kv()
    got = ref[:, :, :, 2:3].copy()  # one head where (2, 4) means two
    assert compare_kv(ref, got, (2, 4), 1e-4, 1e-4) == (
        float("inf"), "received KV has shape (2, 3, 2, 1, 2), expected (2, 3, 2, 2, 2)")


def test_compare_kv_reports_the_worst_difference_and_the_first_mismatch():
    ref = _ref_kv()
    got = ref[:, :, :, 2:4].copy()
    got[0, 1, 1, 1, 0] += 0.5    # first in C order: layer 0, token 1, V, head 3, channel 0
    got[1, 2, 0, 0, 1] -= 2.0    # later, and the larger difference
    want0, want1 = float(ref[0, 1, 1, 3, 0]), float(ref[1, 2, 0, 2, 1])
    assert (want0, want1) == (7.5, 21.25)
    assert compare_kv(ref, got, (2, 4), 1e-4, 1e-4) == (
        2.0, "KV after transfer differs first at layer 0, token 1, V, head 3, channel 0: "
             "received 8.0, reference 7.5 (2 of 48 values differ)")


def test_compare_kv_within_tolerance_reports_its_difference_and_no_mismatch():
    ref = _ref_kv()
    got = ref[:, :, :, 0:2].copy()
    got[1, 0, 0, 1, 1] += 0.0625   # within atol 0.1
    assert compare_kv(ref, got, (0, 2), 0.0, 0.1) == (0.0625, None)


# -- verify: compare_run ---------------------------------------------------------------------------

_LOGITS = [np.array([0.0, 1.0, 0.5], np.float32), np.array([2.0, -1.0, 1.0], np.float32),
           np.array([1.0, 1.0, 3.0], np.float32)]
_KV_OK = [(0.0, None), (0.0, None)]


def _bumped(step: int, index: int, by: float) -> list[np.ndarray]:
    out = [x.copy() for x in _LOGITS]
    out[step][index] += by
    return out


def test_compare_run_applies_the_dtypes_logits_tolerance():
    # |diff| 5e-4 on a logit of 1.0: outside float32's 1e-4 + 1e-4 * 1, inside bfloat16's bound.
    got = _bumped(1, 2, 5e-4)
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], got, _KV_OK, "float32", 8)
    assert (v["ok"], v["logits_ok"], v["tokens_identical"]) == (False, False, True)
    assert v["first_divergence"] == (
        "step 1 (position 8, decode): logits differ by up to 0.0005 (token 2: 1.0005 vs reference "
        "1; tolerance rtol=0.0001, atol=0.0001)")
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], got, _KV_OK, "bfloat16", 8)
    assert (v["ok"], v["first_divergence"], v["rtol"], v["atol"]) == (True, None, 5e-2, 5e-2)


def test_compare_run_reports_the_largest_difference_of_every_step():
    got = _bumped(0, 1, 0.25)
    got[2][0] += 0.125  # the last step's difference is smaller than the first's
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], got, [(0.5, None), (0.0, None)], "float32", 8)
    assert dict(v) == {"ok": False, "tokens_identical": True, "logits_max_abs_diff": 0.25,
                       "logits_ok": False, "kv_max_abs_diff": 0.5, "kv_ok": True,
                       "first_divergence": "step 0 (position 7, prefill): logits differ by up to "
                       "0.25 (token 1: 1.25 vs reference 1; tolerance rtol=0.0001, atol=0.0001)",
                       "rtol": 1e-4, "atol": 1e-4}


def test_compare_run_counts_non_finite_logits_as_an_infinite_difference():
    got = _bumped(1, 0, 0.0)
    got[1][1] = np.nan
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], got, _KV_OK, "float32", 8)
    assert v["logits_max_abs_diff"] == float("inf") and not v["logits_ok"] and not v["ok"]


def test_compare_run_fails_a_missing_logits_step():
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], _LOGITS[:2], _KV_OK, "float32", 8)
    assert (v["ok"], v["logits_ok"], v["tokens_identical"]) == (False, False, True)


def test_compare_run_names_a_short_generation():
    v = compare_run([1, 0, 2], _LOGITS, [1, 0], _LOGITS[:2], _KV_OK, "float32", 8)
    assert (v["ok"], v["tokens_identical"]) == (False, False)
    assert v["first_divergence"] == "generated 2 tokens, reference 3"
    # Logits for a step without its token: the step is named, with no token generated.
    v = compare_run([1, 0, 2], _LOGITS, [1, 0], _LOGITS, _KV_OK, "float32", 8)
    assert v["first_divergence"] == "step 2 (position 9, decode): generated token None, reference 2"


def test_compare_run_without_any_token_is_not_a_pass():
    v = compare_run([], [], [], [], _KV_OK, "float32", 8)
    assert (v["ok"], v["tokens_identical"]) == (False, False)
    assert v["first_divergence"] == "generated 0 tokens, reference 0"


def test_compare_run_fails_on_the_kv_alone_and_names_the_first_rank_that_differs():
    kv = [(0.0, None), (3.0, "rank 1's KV differs"), (0.5, "rank 2's KV differs")]
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], _LOGITS, kv, "float32", 8)
    assert (v["ok"], v["tokens_identical"], v["logits_ok"], v["kv_ok"]) == (False, True, True, False)
    assert (v["kv_max_abs_diff"], v["first_divergence"]) == (3.0, "rank 1's KV differs")
    # With a later divergence as well: the KV comes first, the step follows.
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 7], _LOGITS, kv, "float32", 8)
    assert v["first_divergence"] == ("rank 1's KV differs; then step 2 (position 9, decode): "
                                     "generated token 7, reference 2")


def test_compare_run_without_any_kv_check_is_not_a_pass():
    v = compare_run([1, 0, 2], _LOGITS, [1, 0, 2], _LOGITS, [], "float32", 8)
    assert (v["ok"], v["kv_ok"], v["kv_max_abs_diff"], v["first_divergence"]) == (
        False, False, 0.0, None)


# -- run: the verdict from the collected events, and the exit status -------------------------------

def _state(cfg: DemoConfig, *, tokens=(5, 7, 1), ref_tokens=(5, 7, 1)) -> dict:
    """What the collector gathers from a run whose decode matches the reference exactly."""
    ref = _ref_kv()
    h = ref.shape[3] // cfg.decode_tp
    steps = {s: {"token": t, "logits": pack_array(_LOGITS[s])} for s, t in enumerate(tokens)}
    ref_steps = {s: {"token": t, "logits": pack_array(_LOGITS[s])} for s, t in enumerate(ref_tokens)}
    return {"transfers": {}, "errors": [], "exited_ok": set(),
            "prefill": steps.pop(0), "steps": steps,
            "ref_prefill": ref_steps.pop(0), "ref_steps": ref_steps, "ref_kv": ref,
            "kv": {r: ((r * h, (r + 1) * h), ref[:, :, :, r * h:(r + 1) * h].copy())
                   for r in range(cfg.decode_tp)}}


def test_verdict_passes_a_matching_run_and_records_both_token_lists():
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg, tokens=(5, 7, 1), ref_tokens=(5, 7, 2))
    v = _verdict(cfg, state)
    assert (state["tokens"], state["ref_tokens"]) == ([5, 7, 1], [5, 7, 2])
    assert not v["ok"] and v["first_divergence"] == (
        "step 2 (position 4, decode): generated token 1, reference 2")
    v = _verdict(cfg, _state(cfg))
    assert (v["ok"], v["first_divergence"], v["kv_max_abs_diff"]) == (True, None, 0.0)


def test_verdict_fails_when_a_decode_rank_sent_no_kv():
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg)
    del state["kv"][1]
    v = _verdict(cfg, state)
    assert (v["ok"], v["kv_ok"], v["tokens_identical"]) == (False, False, True)
    assert v["first_divergence"] == "received KV from 1 of 2 decode ranks"


def test_verdict_checks_float32_kv_at_float32_tolerance():
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg)
    state["kv"][1][1][0, 0, 0, 0, 0] += 1e-3  # 1.0 + 1e-3: outside 1e-4 + 1e-4 * 1.0
    v = _verdict(cfg, state)
    assert not v["ok"] and v["first_divergence"] == (
        "KV after transfer differs first at layer 0, token 0, K, head 2, channel 0: received "
        "1.0010000467300415, reference 1.0 (1 of 48 values differ)")


class _NoCollector:
    address = "inproc://unused"

    def close(self) -> None:
        pass


def _fake_run(monkeypatch, cfg: DemoConfig, state: dict, failed: list) -> tuple[int, str]:
    """run_demo with the processes replaced: ``state`` is what the run gathered, ``failed`` the
    children that exited non-zero. Returns the exit code and the printout."""
    class Children:
        def __init__(self, *args) -> None:
            pass

        def wait(self, timeout_s: float) -> None:
            pass

        def failed(self) -> list:
            return failed

        def stop(self) -> None:
            pass

        def log_tail(self, role: str, rank: int) -> str:
            return f"{role}{rank} log"

    def drive(cfg, children, collector, console, into) -> None:
        into.update(state)

    monkeypatch.setattr(demo_run, "Collector", _NoCollector)
    monkeypatch.setattr(demo_run, "_Children", Children)
    monkeypatch.setattr(demo_run, "_drive", drive)
    buf = io.StringIO()
    return run_demo(cfg, console=Console(file=buf, width=300, color_system=None),
                    json_path=None), buf.getvalue()


def test_run_demo_exits_0_on_a_matching_run_and_1_when_a_rank_reported_an_error(monkeypatch):
    cfg = DemoConfig(tokens=3, new_tokens=3)
    code, out = _fake_run(monkeypatch, cfg, _state(cfg), [])
    assert code == 0 and "│ verification │ PASS: tokens identical" in out
    state = _state(cfg)
    state["errors"] = [{"role": "prefill", "rank": 0, "error": "boom", "log": None}]
    code, out = _fake_run(monkeypatch, cfg, state, [])
    assert code == 1
    assert "│ verification │ FAIL: the run did not complete (see the errors below)" in out


def test_run_demo_counts_a_child_that_exited_non_zero_unless_it_reported_success(monkeypatch):
    cfg = DemoConfig(tokens=3, new_tokens=3)
    state = _state(cfg)
    code, out = _fake_run(monkeypatch, cfg, state, [("decode", 1, 7)])
    assert code == 1 and "│ error        │ decode rank 1: exited with code 7" in out
    state = _state(cfg)
    state["exited_ok"] = {("decode", 1)}  # reported exit 0, then was slow to tear down
    code, out = _fake_run(monkeypatch, cfg, state, [("decode", 1, -9)])
    assert code == 0 and "error" not in out


# -- summary: the JSON figures and the printed table ------------------------------------------------

def _transfer(rank: int, *, ok: bool = True, nbytes: int, descriptors: int, seconds: float,
              nixl: float) -> dict:
    return {"rank": rank, "ok": ok, "bytes": nbytes, "descriptors": descriptors, "seconds": seconds,
            "nixl_seconds": nixl, "path": "direct", "moved_by": "NIXL", "stats": {}, "error": None}


_PASS = {"ok": True, "tokens_identical": True, "logits_max_abs_diff": 1.5e-5, "logits_ok": True,
         "kv_max_abs_diff": 0.0, "kv_ok": True, "first_divergence": None, "rtol": 1e-4,
         "atol": 1e-4}


def _summary(cfg: DemoConfig, transfers: list[dict], verdict: dict = _PASS, errors=(),
             code: int = 0, **state) -> dict:
    results, _ = precheck(cfg)
    st = {"transfers": {t["rank"]: t for t in transfers}, "tokens": [5, 7], "ref_tokens": [5, 7],
          "wall_seconds": 2.5, **state}
    return summary_dict(cfg, results, st, verdict, list(errors), exit_code=code)


def _rows(s: dict) -> dict[str, str]:
    buf = io.StringIO()
    print_summary(Console(file=buf, width=400, color_system=None), s)
    rows = {}
    for line in buf.getvalue().splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) == 4 and cells[1]:
            rows[cells[1]] = cells[2]
    return rows


def test_summary_adds_up_every_ranks_transfer():
    cfg = DemoConfig()  # decode TP=2
    s = _summary(cfg, [_transfer(1, nbytes=200, descriptors=8, seconds=0.75, nixl=0.125),
                       _transfer(0, nbytes=100, descriptors=4, seconds=0.5, nixl=0.25)])
    t = s["transfer"]
    assert {k: t[k] for k in ("ok", "bytes", "descriptors", "seconds", "nixl_seconds",
                              "moved_by")} == {"ok": True, "bytes": 300, "descriptors": 12,
                                               "seconds": 0.75, "nixl_seconds": 0.25,
                                               "moved_by": "NIXL"}
    assert [r["rank"] for r in t["per_rank"]] == [0, 1]
    assert _rows(s)["transfer"] == ("ok: 300 bytes in 12 descriptors over 2 read(s); read 750.0 ms, "
                                    "of which NIXL 250.0 ms (slowest rank)")


def test_summary_transfer_fails_when_a_rank_failed_or_is_missing():
    cfg = DemoConfig()
    one = _transfer(0, nbytes=100, descriptors=4, seconds=0.5, nixl=0.25)
    assert _summary(cfg, [one])["transfer"]["ok"] is False
    s = _summary(cfg, [one, _transfer(1, ok=False, nbytes=0, descriptors=0, seconds=0.5, nixl=0.0)])
    assert s["transfer"]["ok"] is False
    assert _rows(s)["transfer"].startswith("FAILED: 100 bytes in 4 descriptors over 2 read(s)")


def test_summary_keeps_each_max_difference_in_its_place_and_infinity_as_null():
    cfg = DemoConfig()
    xfer = [_transfer(r, nbytes=1, descriptors=1, seconds=0.5, nixl=0.25) for r in range(2)]
    verdict = {**_PASS, "ok": False, "logits_max_abs_diff": 0.25, "kv_max_abs_diff": float("inf"),
               "kv_ok": False, "first_divergence": "KV differs"}
    s = _summary(cfg, xfer, verdict, code=1)
    assert (s["verification"]["logits_max_abs_diff"], s["verification"]["kv_max_abs_diff"]) == (
        0.25, None)
    json.dumps(s, allow_nan=False)  # valid JSON: no Infinity
    rows = _rows(s)
    assert rows["verification"] == ("FAIL: tokens identical; logits max |diff| 0.25; KV after "
                                    "transfer max |diff| n/a (rtol 0.0001, atol 0.0001)")
    assert (rows["diverged at"], rows["exit code"]) == ("KV differs", "1")


def test_summary_prints_pass_only_for_a_passing_verdict_and_says_which_part_differs():
    cfg = DemoConfig()
    xfer = [_transfer(r, nbytes=1, descriptors=1, seconds=0.5, nixl=0.25) for r in range(2)]
    rows = _rows(_summary(cfg, xfer))
    assert rows["verification"] == ("PASS: tokens identical; logits max |diff| 1.5e-05; KV after "
                                    "transfer max |diff| 0 (rtol 0.0001, atol 0.0001)")
    assert rows["exit code"] == "0" and "diverged at" not in rows
    # Tokens identical, KV wrong: FAIL, yet the tokens are reported identical.
    bad_kv = {**_PASS, "ok": False, "kv_ok": False, "kv_max_abs_diff": 1.0, "first_divergence": "x"}
    rows = _rows(_summary(cfg, xfer, bad_kv, code=1))
    assert rows["verification"].startswith("FAIL: tokens identical; ")
    assert rows["exit code"] == "1"
    bad_tokens = {**_PASS, "ok": False, "tokens_identical": False, "first_divergence": "y"}
    assert _rows(_summary(cfg, xfer, bad_tokens, code=1))["verification"].startswith(
        "FAIL: tokens DIFFER; ")


def test_summary_rejects_when_any_decode_rank_is_refused():
    ok = precheck(DemoConfig())[0][0]
    refused = precheck(DemoConfig(decode_head_size=32))[0][0]
    assert ok.ok and not refused.ok
    s = summary_dict(DemoConfig(), [ok, refused], None, None, None, exit_code=3)
    assert s["handshake"]["decision"] == "reject"
    assert [r["code"] for r in s["handshake"]["reasons"]] == ["head_size"]


# -- summary: --stream --------------------------------------------------------------------------------

_STREAM_CFG = DemoConfig(stream=True, model=ModelConfig(num_layers=2))


def _stream_state() -> dict:
    """Two decode ranks, one prefill rank, two layers; binary fractions so sums are exact."""
    def xfer(rank, landed, completed, seconds, plain_seconds, plain_bytes):
        return {**_transfer(rank, nbytes=plain_bytes, descriptors=2, seconds=seconds, nixl=0.25),
                "stream": True, "landed": landed, "completed": completed,
                "plain": {"ok": True, "seconds": plain_seconds, "bytes": plain_bytes, "error": None},
                "plain_equal": True}
    return {"prefill_ranks": {0: {"forward_start": 10.0, "published": [10.5, 11.0],
                                  "seconds": 1.25}},
            "transfers": [xfer(0, [10.75, 11.25], 11.5, 2.0, 0.5, 100),
                          xfer(1, [10.625, 11.5], 11.75, 2.5, 0.75, 200)]}


def _stream_summary(st: dict) -> dict:
    return _summary(_STREAM_CFG, st.pop("transfers"), **st)


def test_stream_summary_times_the_slowest_rank_from_the_last_layer():
    s = _stream_summary(_stream_state())
    assert s["stream"] == {
        "prefill_forward_seconds": 1.25,
        "streamed": {"tail_seconds": 0.75, "read_seconds": 2.5},
        "non_streamed": {"ok": True, "tail_seconds": 0.75, "bytes": 300, "errors": []},
        "identical": True,
        "layers": [{"layer": 0, "published_seconds": 0.5, "landed_seconds": 0.75,
                    "after_publish_seconds": 0.25},
                   {"layer": 1, "published_seconds": 1.0, "landed_seconds": 1.5,
                    "after_publish_seconds": 0.5}]}
    assert _rows(s)["same KV"] == ("streamed and non-streamed reads identical; prefill forward "
                                     "1250.0 ms")


def test_stream_summary_identical_only_when_every_rank_compared_equal():
    st = _stream_state()
    st["transfers"][1]["plain_equal"] = None  # not compared
    s = _stream_summary(st)
    assert s["stream"]["identical"] is False
    assert _rows(s)["same KV"].startswith("streamed and non-streamed reads DIFFER;")


def test_stream_summary_a_failed_non_streamed_read_has_no_time():
    st = _stream_state()
    st["transfers"][0]["plain"] = {"ok": False, "seconds": 0.25, "bytes": 0, "error": "timeout"}
    ns = _stream_summary(st)["stream"]["non_streamed"]
    assert ns == {"ok": False, "tail_seconds": None, "bytes": 200, "errors": ["timeout"]}


def test_stream_summary_is_incomplete_when_a_streamed_read_failed():
    st = _stream_state()
    st["transfers"][1]["ok"] = False  # every layer's time came back, the read failed
    s = _stream_summary(st)
    assert s["stream"] is None
    assert _rows(s)["streaming"] == "incomplete (a streamed or non-streamed read failed)"


# -- config: the blocks the request uses --------------------------------------------------------------

def test_replicated_kv_heads_are_one_per_rank():
    assert DemoConfig(decode_tp=16).spec("decode").num_kv_heads == 1


def test_decode_blocks_hold_every_transferred_slot_even_for_a_short_generation():
    cfg = DemoConfig(tokens=17, new_tokens=1, prefill_block_size=16, decode_block_size=8)
    # 2 prefill blocks = 32 slots -> 4 decode blocks, though 18 tokens would fit in 3.
    assert (cfg.prefill_blocks(), cfg.decode_prompt_blocks(), cfg.decode_blocks()) == (2, 4, 4)
    assert len(cfg.block_ids("decode")) == 4


@pytest.mark.parametrize("cfg", [DemoConfig(stream=True),
                                 DemoConfig(stream=True, tokens=24, decode_block_size=8)],
                         ids=["default", "small-blocks"])
def test_plain_blocks_are_free_blocks_enough_for_the_prompt(cfg):
    plain, request = cfg.plain_block_ids(), cfg.block_ids("decode")
    assert len(plain) == cfg.decode_prompt_blocks() == len(set(plain))
    assert not set(plain) & set(request)
    assert max(plain) < cfg.spec("decode").num_blocks


# -- bugs the audit found ---------------------------------------------------------------------------

def test_compare_run_names_a_step_the_reference_has_no_token_for():
    # Logits for every step, one reference token short: a divergence, not an IndexError.
    v = compare_run([1, 0], _LOGITS, [1, 0, 2], _LOGITS, _KV_OK, "float32", 8)
    assert (v["ok"], v["tokens_identical"]) == (False, False)
    assert v["first_divergence"] == "step 2 (position 9, decode): generated token 2, reference None"


def test_stream_run_fails_when_the_non_streamed_read_differs_from_the_streamed_one(monkeypatch):
    # The streamed KV matches the reference, but the same KV read again non-streamed came back
    # different: one of the two reads delivered wrong bytes, so the run does not pass.
    cfg = DemoConfig(tokens=3, new_tokens=3, stream=True)
    state = _state(cfg)
    state["transfers"] = {r: {"ok": True, "plain": {"ok": True}, "plain_equal": r != 1}
                          for r in range(2)}
    v = _verdict(cfg, state)
    assert (v["ok"], v["kv_ok"], v["tokens_identical"], v["logits_ok"]) == (False, False, True, True)
    assert v["first_divergence"] == ("decode rank 1: the non-streamed read of the same KV differs "
                                     "from the streamed read")
    assert v["kv_max_abs_diff"] == 0.0  # the figure stays the streamed KV against the reference
    state["transfers"][1]["plain_equal"] = True
    assert _verdict(cfg, state)["ok"] is True


def test_drive_stops_as_soon_as_a_rank_reports_a_failed_exit():
    # A decode rank whose read failed reports its transfer and exits 1 (worker.run_decode). The
    # prefill rank, never notified, holds the request until its lease runs out (120 s): the run
    # stops at once, naming the rank, instead of waiting for that (or for --timeout).
    class Children:  # the ranks' processes: their events come from the reporters below
        def start(self, role: str, rank: int) -> None:
            pass

        def tell(self, role: str, rank: int, message: dict) -> None:
            pass

        def failed(self) -> list:
            return []

        def running(self) -> bool:
            return True

    cfg = DemoConfig(decode_tp=1, tokens=3, new_tokens=3, timeout=5.0)
    collector = Collector()
    try:
        reporters = {role: Reporter(collector.address, role, 0)
                     for role in ("reference", "prefill", "decode")}
        reporters["reference"].send("exit", code=0)
        reporters["prefill"].send("prefilled", token=5, logits=pack_array(_LOGITS[0]))
        reporters["prefill"].send("serving", address="tcp://127.0.0.1:1")
        reporters["decode"].send("transferred", ok=False, bytes=0)
        reporters["decode"].send("exit", code=1)
        for r in reporters.values():
            r.close()
        state = {"transfers": {}, "kv": {}, "steps": {}, "ref_steps": {}, "errors": [],
                 "exited_ok": set()}
        demo_run._drive(cfg, Children(), collector, Console(file=io.StringIO()), state)
    finally:
        collector.close()
    assert state["errors"] == [{"role": "decode", "rank": 0, "error": "exited with code 1",
                                "log": None}]
    assert state["exited_ok"] == {("reference", 0)} and not state["transfers"][0]["ok"]
