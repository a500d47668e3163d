"""``fkv bench report``: the README's and NOTES' measured tables are what the committed result
files say; rendering, ``--check``, and pictures drawn from the small sample files of tests/data."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fkv import FkvError
from fkv.bench import plots, report, results
from fkv.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = sorted((ROOT / "tests" / "data").glob("sample-*.json"))


def test_readme_and_notes_tables_are_what_the_committed_results_say() -> None:
    """The test that keeps the figures honest: re-render from bench/results/ and compare."""
    files = results.load_all(ROOT / "bench" / "results")
    for doc in (ROOT / "README.md", ROOT / "bench" / "NOTES.md"):
        text = doc.read_text()
        assert report.BEGIN.search(text), f"{doc.name} has no fkv-report section"
        assert report.render(doc, files, ROOT / "bench" / "results") == text, (
            f"{doc.name} differs from bench/results/: run `fkv bench report`")


@pytest.fixture
def sample_dir(tmp_path: Path) -> Path:
    """The sample files under the names fkv gives result files (bench-UTC.json)."""
    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    for p in SAMPLES:
        f = results.load(p)
        shutil.copy(p, folder / f"{f.bench}-{f.created.replace('-', '').replace(':', '')}.json")
    return folder


DOC = """# x
before
<!-- fkv-report:attention -->
stale
<!-- /fkv-report -->
middle
<!-- fkv-report:tests -->
<!-- /fkv-report -->
after
"""


def test_render_fills_sections_from_the_newest_files(sample_dir: Path) -> None:
    doc = sample_dir.parents[1] / "README.md"
    doc.write_text(DOC)
    out = report.render(doc, results.load_all(sample_dir), sample_dir)
    head, rest = out.split("<!-- fkv-report:attention -->\n")
    assert head == "# x\nbefore\n"
    assert "stale" not in out and out.endswith("<!-- /fkv-report -->\nafter\n")
    run = "[SAMPLE GPU (synthetic numbers, not a measurement), 2026-01-01]"
    assert ("| paged_attention | decode B=64 ctx 8192, NHD / HND | 4000 / 3900 GB/s | dense SDPA "
            "4200 / 4200 GB/s (0.952 / 0.929x) | 93 / 91% of read (4300 GB/s) | >= 0.85x dense "
            f"SDPA, met | {run}(bench/results/attention-20260101T000000Z.json) |") in out
    assert ("| paged_attention | decode B=256 ctx 2048, NHD / HND | no committed result yet | | | "
            ">= 0.85x dense SDPA | |") in out
    assert "| paged_attention | decode B=8 ctx 32768, NHD / HND (1 of 2 cases measured) | 3000 GB/s" in out
    assert ("| paged_attention | prefill B=4 x 4096 causal, NHD / HND | 1.400 / 1.600 ms | dense "
            "causal SDPA 1.000 / 1.000 ms | 1.40 / 1.60x SDPA's time | <= 1.5x SDPA's time, "
            "**missed** |") in out
    assert "![attention: newest committed run](docs/plots/attention.png)" in out
    assert ("| pytest -m gpu | SAMPLE GPU (synthetic numbers, not a measurement) | 380 | 0 | 2 | "
            "410 | 312 s | `000000000` |") in out


def test_every_row_says_no_result_when_there_is_none(tmp_path: Path) -> None:
    rendered = report.sections([])
    for name in ("write", "convert", "attention", "plan", "standing"):
        rows = rendered[name].splitlines()[2:]
        assert rows and all(report.NO_RESULT in r for r in rows), name
        assert "![" not in rendered[name]
    assert report.NO_RESULT in rendered["transfer"] and report.NO_RESULT in rendered["tests"]


def test_a_newer_run_replaces_a_case_and_smoke_runs_are_ignored(sample_dir: Path) -> None:
    f = results.load(sample_dir / "write-20260101T000000Z.json")
    newer = results.Run("write", env=dict(f.env), config={"mode": "cuda"})
    newer.created = "2026-02-01T00:00:00Z"
    newer.ceiling("copy_gbps", 4100)
    for layout, gbps in (("NHD", 3700.0), ("HND", 3650.0)):
        newer.add(f"prefill 65536 {layout} bfloat16",
                  metrics={"gbps": gbps, "baseline_gbps": 700, "speedup_x": gbps / 700,
                           "pct_of_copy": 100 * gbps / 4100})
    smoke = results.Run("write", env=dict(f.env), config={"mode": "cpu-smoke"})
    smoke.created = "2026-03-01T00:00:00Z"
    smoke.add("prefill 65536 NHD bfloat16", metrics={"gbps": 1.0})
    rows = report.sections([f, newer.to_file(), smoke.to_file()])["write"].splitlines()
    assert rows[2].startswith("| write_kv | prefill 65536 tokens, NHD / HND | 3700 / 3650 GB/s | "
                              "torch index_put_ 700 / 700 GB/s (5.3 / 5.2x) | 90 / 89% of copy "
                              "(4100 GB/s) | >= 3600 GB/s, met | ")
    assert "2026-02-01](bench/results/write-20260201T000000Z.json) |" in rows[2]
    assert "3000 / 2400 GB/s" in rows[3]          # 8192 tokens: still the older file's


def test_check_exits_1_when_a_document_is_stale_and_writing_fixes_it(
        sample_dir: Path, capsys: pytest.CaptureFixture) -> None:
    doc = sample_dir.parents[1] / "README.md"
    doc.write_text(DOC)
    args = ["bench", "report", "--results", str(sample_dir), "--docs", str(doc)]
    assert cli([*args, "--check"]) == 1
    assert "out of date" in capsys.readouterr().err and doc.read_text() == DOC
    assert cli(args) == 0
    assert cli([*args, "--check"]) == 0
    assert "no committed result" not in doc.read_text().split("fkv-report:tests")[1]


def test_update_refuses_unknown_or_unclosed_sections() -> None:
    with pytest.raises(FkvError, match=r"'<!-- fkv-report:nope -->' must name one of .*\(got 'nope'\)"):
        report.update("<!-- fkv-report:nope -->\n<!-- /fkv-report -->", report.sections([]), "README.md")
    with pytest.raises(FkvError, match=r"README.md: section 'tests' must end with '<!-- /fkv-report -->'"):
        report.update("<!-- fkv-report:tests -->\nx\n", report.sections([]), "README.md")


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_plots_from_the_sample_files(sample: Path, tmp_path: Path) -> None:
    f = results.load(sample)
    if f.bench not in plots.PLOTTERS:
        with pytest.raises(FkvError, match=rf"'bench' must be one of .* \(got '{f.bench}'\)"):
            plots.plot_file(f, tmp_path / "x.png")
        return
    out = plots.plot_file(sample, tmp_path / "sub" / f"{f.bench}.png")
    data = out.read_bytes()
    assert out == tmp_path / "sub" / f"{f.bench}.png"
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_report_draws_each_benchmarks_newest_run(sample_dir: Path, tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    doc.write_text("no sections\n")
    assert cli(["bench", "report", "--results", str(sample_dir), "--docs", str(doc),
                "--plots", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "attention.png", "convert.png", "plan.png", "transfer.png", "write.png"]


def test_transfer_plot_needs_request_sizes(tmp_path: Path) -> None:
    run = results.Run("transfer", env={})
    run.add("direct", params={"path": "direct"}, metrics={"gbps": 3.0})
    with pytest.raises(FkvError, match=r"case 'direct': 'params.request_bytes' must be set"):
        plots.plot_transfer(run.to_file(), tmp_path / "t.png")


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match=r"--plot needs matplotlib.*pip install 'fkv\[plot\]'"):
        plots.require()
    with pytest.raises(SystemExit, match=r"pip install 'fkv\[plot\]'"):
        plots.require(cli=True)
