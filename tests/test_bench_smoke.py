"""The kernel benchmarks' ``--cpu-smoke`` paths in CI: every case's correctness check runs on the
CPU interpreter (the timings mean nothing), the result file is a valid one that says so, and a
kernel that writes one wrong element stops the bench with the case named.

On the GPU machine the benchmarks themselves run (``bench/``); these are the code's CPU twins."""

from __future__ import annotations

from pathlib import Path

import pytest

from fkv.bench import attention, convert, results, write

pytestmark = pytest.mark.interpreter

CASES = {
    write: ["prefill 200 NHD bfloat16", "prefill 200 HND bfloat16", "prefill 48 NHD bfloat16",
            "prefill 48 HND bfloat16", "decode 16 NHD bfloat16", "decode 16 HND bfloat16",
            "prefill 200 NHD float8_e4m3fn", "prefill 200 HND float8_e4m3fn",
            "prefill 48 NHD float8_e4m3fn", "prefill 48 HND float8_e4m3fn",
            "decode 16 NHD float8_e4m3fn", "decode 16 HND float8_e4m3fn"],
    attention: ["decode B=2 x 100 NHD", "decode B=2 x 100 HND", "decode B=1 x 300 NHD",
                "decode B=1 x 300 HND", "prefill B=2 x 40 NHD", "prefill B=2 x 40 HND"],
}


@pytest.mark.parametrize("bench", [write, attention], ids=["write", "attention"])
def test_cpu_smoke_checks_every_case_and_writes_a_result_file_marked_smoke(
        bench: object, tmp_path: Path) -> None:
    path = tmp_path / "smoke.json"
    assert bench.main(["--cpu-smoke", "--json", str(path)]) == 0  # type: ignore[attr-defined]
    run = results.load(path)
    assert run.config["mode"] == "cpu-smoke"
    assert run.env["device"] == "cpu"
    assert [c.case for c in run.cases] == CASES[bench]
    if bench is attention:  # the check passed: within bf16's tolerance of the reference
        for case in run.cases:
            assert 0.0 <= case.metrics["reference_max_err"] <= 3e-2, case.case


def test_convert_cpu_smoke_checks_every_pair_bit_for_bit(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "smoke.json"
    assert convert.main(["--cpu-smoke", "--json", str(path)]) == 0
    run = results.load(path)
    assert run.config["mode"] == "cpu-smoke (correctness only)"
    checked = [line[4:] for line in capsys.readouterr().out.splitlines() if line.startswith("ok  ")]
    assert checked == [c.case for c in run.cases]
    assert len(checked) == 20
    assert {"gather triton NHD", "gather triton HND", "scatter triton NHD",
            "scatter triton HND"} <= set(checked)


def test_without_a_result_flag_a_smoke_run_writes_no_file(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FKV_RESULTS_DIR", str(tmp_path / "results"))
    assert attention.main(["--cpu-smoke"]) == 0
    assert not (tmp_path / "results").exists()


def test_a_kernel_that_writes_one_wrong_element_stops_the_write_bench(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fkv.ops

    real = fkv.ops.write_kv

    def off_by_one_element(key, value, cache, slots, spec, **kw):  # type: ignore[no-untyped-def]
        real(key, value, cache, slots, spec, **kw)
        cache.view(-1)[0] = cache.view(-1)[0] + 1  # one element unlike the reference

    monkeypatch.setattr(fkv.ops, "write_kv", off_by_one_element)
    with pytest.raises(SystemExit, match=r"^MISMATCH: write_kv differs from "
                                         r"fkv\.ops\.reference\.write_kv in 1 elements \(prefill "
                                         r"200 tokens, KVCacheSpec\("):
        write.main(["--cpu-smoke", "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_an_attention_kernel_off_by_a_tenth_stops_the_attention_bench(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fkv.ops

    real = fkv.ops.paged_attention

    def shifted(*args, **kw):  # type: ignore[no-untyped-def]
        return real(*args, **kw) + 0.1

    monkeypatch.setattr(fkv.ops, "paged_attention", shifted)
    with pytest.raises(SystemExit, match=r"^MISMATCH in decode B=2 x 100 NHD: max \|kernel - "
                                         r"reference\| 0\.1"):
        attention.main(["--cpu-smoke", "--json", str(tmp_path / "x.json")])
