"""The result files of ``bench/results/``: writer, schema, and every committed file valid."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fkv import FkvError
from fkv.bench import results

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted((ROOT / "bench" / "results").glob("*.json"))
SAMPLE = ROOT / "tests" / "data"


def _run(**kw) -> results.Run:
    env = {"gpu": "NVIDIA H200", "torch": "2.11.0", "git_commit": "abc", "env_vars": {}}
    run = results.Run("write", config={"quick": False}, env=env, **kw)
    run.created = "2026-12-01T10:20:30Z"
    return run


def test_every_committed_result_file_is_valid() -> None:
    """Each file loads under the schema, is named after its bench and time, and names its commit
    (an empty folder passes: results arrive with GPU runs)."""
    for path in COMMITTED:
        f = results.load(path)
        stem = f"{f.bench}-{f.created.replace('-', '').replace(':', '')}"
        assert path.stem == stem or path.stem.startswith(stem + "-"), (path.name, f.created)
        assert f.env.get("git_commit"), f"{path.name}: no git commit in its env header"


@pytest.mark.parametrize("path", sorted(SAMPLE.glob("*.json")), ids=lambda p: p.name)
def test_sample_files_are_valid(path: Path) -> None:
    assert results.load(path).cases


def test_write_names_the_file_by_bench_and_utc_time_and_round_trips(tmp_path: Path) -> None:
    run = _run()
    run.ceiling("copy_gbps", 4228)
    run.add("prefill 65536 NHD bfloat16", params={"tokens": 65536, "layout": "NHD"},
            metrics={"gbps": 3647.5, "pct_of_copy": 86.25, "graph_us": None, "calls_count": 3})
    first = results.write(run, results_dir=tmp_path)
    second = results.write(run, results_dir=tmp_path)
    assert (first.name, second.name) == ("write-20261201T102030Z.json",
                                         "write-20261201T102030Z-2.json")
    doc = json.loads(first.read_text())
    assert doc["schema"] == "fkv.bench/1"
    assert doc["ceilings"] == {"copy_gbps": 4228.0}
    assert doc["cases"] == [{
        "case": "prefill 65536 NHD bfloat16",
        "params": {"tokens": 65536, "layout": "NHD"},
        "metrics": {"gbps": 3647.5, "pct_of_copy": 86.25, "graph_us": None, "calls_count": 3.0},
        "units": {"gbps": "GB/s", "pct_of_copy": "%", "graph_us": "us", "calls_count": "1"}}]
    assert results.load(first) == run.to_file()


def test_json_path_wins_over_the_folder(tmp_path: Path) -> None:
    path = results.write(_run(), json_path=tmp_path / "x.json", results_dir=tmp_path / "no")
    assert path == tmp_path / "x.json" and path.exists() and not (tmp_path / "no").exists()


def test_default_folder_follows_fkv_results_dir(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FKV_RESULTS_DIR", str(tmp_path / "r"))
    assert results.default_results_dir() == tmp_path / "r"
    assert results.write(_run()).parent == tmp_path / "r"
    monkeypatch.delenv("FKV_RESULTS_DIR")
    assert results.default_results_dir() == ROOT / "bench" / "results"


def test_save_follows_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    results.add_output_arguments(parser)
    run = _run()
    assert results.save(run, parser.parse_args(["--no-save", "--json", "x"])) is None
    smoke = parser.parse_args([])
    assert results.save(run, smoke, by_default=False) is None
    path = results.save(run, parser.parse_args(["--results-dir", str(tmp_path)]),
                        by_default=False)
    assert path == tmp_path / "write-20261201T102030Z.json"
    assert capsys.readouterr().out == f"results: {path}\n"
    assert parser.parse_args(["--plot", "p.png"]).plot == "p.png"


def test_output_options_are_checked_when_parsed_and_a_missing_results_dir_is_created(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--json and --plot write into an existing folder; --results-dir is created when missing
    (docs/benchmarks.md), a file there is refused; all before any benchmark runs."""
    parser = argparse.ArgumentParser(prog="b")
    results.add_output_arguments(parser)
    (tmp_path / "x.json").touch()
    for argv, message in (
            (["--json", str(tmp_path / "no" / "x.json")],
             f"argument --json: must be a file in an existing folder (got '{tmp_path}/no/x.json': "
             f"'{tmp_path}/no' does not exist)"),
            (["--plot", str(tmp_path / "no" / "p.png")],
             f"argument --plot: must be a file in an existing folder (got '{tmp_path}/no/p.png': "
             f"'{tmp_path}/no' does not exist)"),
            (["--results-dir", str(tmp_path / "x.json")],
             f"argument --results-dir: must be a folder (got '{tmp_path}/x.json': a file)")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"b: error: {message}"
    assert not (tmp_path / "no").exists()
    args = parser.parse_args(["--results-dir", str(tmp_path / "new" / "dir")])
    assert args.results_dir == str(tmp_path / "new" / "dir")
    assert not (tmp_path / "new").exists()  # created when the result is written, not before
    path = results.save(_run(), args)
    assert path == tmp_path / "new" / "dir" / "write-20261201T102030Z.json" and path.is_file()


def test_load_paths_refuses_a_folder_that_is_not_there(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FkvError, match=r"^'folder' must be an existing folder of result files "
                       rf"\(got '{tmp_path}/nope'\); no such folder$"):
        results.load_paths(tmp_path / "nope")
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(FkvError, match=r"\(got '.*f.json'\); a file$"):
        results.load_all(tmp_path / "f.json")
    monkeypatch.setenv("FKV_RESULTS_DIR", str(tmp_path / "nope"))
    assert results.load_paths() == []  # the default folder: no results yet


def test_unit_of_reads_the_suffix_and_refuses_names_without_one() -> None:
    assert [results.unit_of(m) for m in ("gbps", "sdpa_ms", "eager_us", "wall_s", "request_bytes",
                                         "ratio_to_link_x", "pct_of_copy", "tflops")] == [
        "GB/s", "ms", "us", "s", "B", "x", "%", "TFLOP/s"]
    with pytest.raises(FkvError, match=r"'metric' must be a name ending in a unit suffix .* "
                                       r"\(got 'speedup'\)"):
        results.unit_of("speedup")


def test_add_refuses_a_case_twice() -> None:
    run = _run()
    run.add("a", metrics={"gbps": 1})
    with pytest.raises(FkvError, match=r"'case' must be unique within a run \(got 'a'\)"):
        run.add("a")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(schema="fkv.bench/0"), r"'schema' must be 'fkv.bench/1' \(got 'fkv.bench/0'\)"),
    (lambda d: d.update(created="2026-12-01 10:20"), r"'created' must be UTC .* \(got '2026-12-01 10:20'\)"),
    (lambda d: d["cases"][0]["metrics"].update(gbps="fast"), r"Expected `float \| null`, got `str`"),
    (lambda d: d["cases"][0].update(speed=1), r"Object contains unknown field `speed`"),
    (lambda d: d["cases"].append(dict(d["cases"][0])), r"'cases\[1\].case' must be unique"),
    (lambda d: d["cases"][0]["units"].pop("gbps"), r"must name a unit for every metric \(missing \['gbps'\]"),
    (lambda d: d.pop("env"), r"Object missing required field `env`"),
])
def test_check_names_what_is_wrong(edit, message) -> None:
    run = _run()
    run.add("a", metrics={"gbps": 1.0})
    doc = json.loads(json.dumps(results.msgspec.to_builtins(run.to_file())))
    edit(doc)
    with pytest.raises(FkvError, match=message):
        results.check(doc, source="f.json")


def test_latest_case_comes_from_the_newest_file_unless_it_errored() -> None:
    old, new = _run(), _run()
    new.created = "2026-12-02T00:00:00Z"
    old.add("a", metrics={"gbps": 1})
    old.add("b", metrics={"gbps": 2})
    new.add("a", metrics={"gbps": 3})
    new.add("b", error="RuntimeError: boom")
    latest = results.latest_cases([new.to_file(), old.to_file()])
    assert {k: (c.metrics.get("gbps"), f.created) for k, (c, f) in latest.items()} == {
        ("write", "a"): (3.0, "2026-12-02T00:00:00Z"), ("write", "b"): (2.0, "2026-12-01T10:20:30Z")}


def test_environment_header_names_versions_git_and_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "cuda_ipc,tcp")
    monkeypatch.setenv("FKV_RESULTS_DIR", "somewhere")       # a local path: never recorded
    env = results.environment("cpu")
    assert "FKV_RESULTS_DIR" not in env["env_vars"]
    assert env["env_vars"] == {"UCX_TLS": "cuda_ipc,tcp"} | {
        k: v for k, v in env["env_vars"].items() if k != "UCX_TLS"}
    for key in ("torch", "triton", "nixl", "python", "git_commit", "git_dirty", "date", "host"):
        assert env[key] is not None, key
    assert env["device"] == "cpu" and env["gpu"] is None
    assert len(env["git_commit"]) == 40


def test_the_environment_says_whether_mps_runs(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """An MPS daemon changes how processes on one GPU overlap (a streamed ipc layer's tail fell
    from 0.35 to 0.09 ms under it): a result file records its variables, and whether its
    control pipe exists."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert results.mps_running() is False
    (tmp_path / "control").touch()
    assert results.mps_running() is True
    env = results.environment("cpu")
    assert env["env_vars"]["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path)
    assert "mps" not in env  # asked only for a CUDA run
    import torch  # a CUDA run's header, on this machine: the CUDA facts stand in

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(results, "_nvidia_smi", lambda field: "580.0")
    assert results.environment("cuda")["mps"] is True
    (tmp_path / "control").unlink()
    assert results.environment("cuda")["mps"] is False


def test_json_schema_is_exported() -> None:
    schema = results.json_schema()
    props = schema["$defs"]["ResultFile"]["properties"]
    assert set(props) == {"schema", "bench", "created", "env", "cases", "config", "ceilings",
                          "extra"}


def test_a_test_run_leaves_a_summary_in_fkv_results_dir(tmp_path: Path) -> None:
    """tests/conftest.py: with FKV_RESULTS_DIR set, pytest writes tests-<UTC>.json (bench
    "tests") with the run's counts, its marker expression and the machine."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FKV_RESULTS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "tests/test_results.py", "-k", "unit_of or refuses_a_case", "-m", "not gpu"],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    (path,) = tmp_path.glob("tests-*.json")
    f = results.load(path)
    (case,) = f.cases
    assert (f.bench, case.case, case.params["markers"]) == ("tests", "pytest -m not gpu", "not gpu")
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p",
                             "no:cacheprovider", "tests/test_results.py"], cwd=ROOT,
                            env={k: v for k, v in env.items() if k != "FKV_RESULTS_DIR"},
                            check=True, capture_output=True, text=True).stdout
    total = sum("::" in line for line in listed.splitlines())
    assert {k: v for k, v in case.metrics.items() if k != "duration_s"} == {
        "passed_count": 2, "failed_count": 0, "skipped_count": 0, "xfailed_count": 0,
        "xpassed_count": 0, "errors_count": 0, "deselected_count": case.metrics["deselected_count"]}
    assert case.metrics["deselected_count"] == total - 2 > 20
    assert 0 < case.metrics["duration_s"] < 600
    assert f.env["device"] in ("cpu", "cuda") and f.env["git_commit"]


def test_a_copy_of_a_tree_names_its_commit_through_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("FKV_GIT_COMMIT", commit)
    env = results.environment("cpu")
    assert (env["git_commit"], env["git_dirty"]) == (commit, None)
    assert "FKV_GIT_COMMIT" not in env["env_vars"]
    monkeypatch.setenv("FKV_GIT_COMMIT", "8e4c2b1")
    with pytest.raises(FkvError) as e:
        results.environment("cpu")
    assert str(e.value) == ("'FKV_GIT_COMMIT' must be a commit id of 40 lowercase hex digits "
                            "(got '8e4c2b1')")


# -- audited by mutation: each test below failed under a mutation of fkv/bench/results.py ----------

def test_every_unit_suffix_is_read() -> None:
    assert [results.unit_of(m) for m in ("loss_pct", "max_err", "blocks_count", "tflops",
                                         "copy_bytes", "x")] == ["%", "1", "1", "TFLOP/s", "B", "x"]


def test_a_ceiling_needs_a_unit_suffix() -> None:
    run = _run()
    with pytest.raises(FkvError) as e:
        run.ceiling("copy", 4000)
    assert str(e.value).startswith("'metric' must be a name ending in a unit suffix (_tflops, "
                                   "_gbps, _bytes, _count, _ms, _us, _s, _x, _pct, _err) or "
                                   "starting with 'pct_' (got 'copy')")
    assert run.ceilings == {}


def test_write_refuses_an_invalid_run_and_writes_nothing(tmp_path: Path) -> None:
    run = _run()
    run.created = "yesterday"
    with pytest.raises(FkvError) as e:
        results.write(run, results_dir=tmp_path)
    assert str(e.value) == ("the 'write' run being written: 'created' must be UTC "
                            "'YYYY-MM-DDTHH:MM:SSZ' (got 'yesterday')")
    assert list(tmp_path.iterdir()) == []


def test_write_never_overwrites_a_result_file(tmp_path: Path) -> None:
    names = [results.write(_run(), results_dir=tmp_path).name for _ in range(3)]
    assert names == ["write-20261201T102030Z.json", "write-20261201T102030Z-2.json",
                     "write-20261201T102030Z-3.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def _doc(run: results.Run) -> dict:
    return json.loads(json.dumps(results.msgspec.to_builtins(run.to_file())))


def test_check_reports_every_problem_at_once_with_its_index() -> None:
    run = _run()
    run.add("a", metrics={"gbps": 1.0})
    doc = _doc(run)
    doc["created"] = "2026-12-01T10:20:30"
    doc["cases"].append({"case": "a", "metrics": {"gbps": 2.0}})
    with pytest.raises(FkvError) as e:
        results.check(doc, source="f.json")
    assert str(e.value) == (
        "f.json: 'created' must be UTC 'YYYY-MM-DDTHH:MM:SSZ' (got '2026-12-01T10:20:30'); "
        "'cases[1].case' must be unique (got 'a' twice); 'cases[1].units' must name a unit for "
        "every metric (missing ['gbps'] in case 'a')")


@pytest.mark.parametrize(("doc", "got"), [([], "'list'"), ("x", "'str'"), ({"bench": "w"}, "None")])
def test_check_refuses_what_is_not_a_result_file(doc, got) -> None:
    with pytest.raises(FkvError) as e:
        results.check(doc, source="f.json")
    assert str(e.value) == (f"f.json: 'schema' must be 'fkv.bench/1' (got {got}); fkv reads "
                            "only its own result files, version 1")


@pytest.mark.parametrize("created", ["2026-12-01T10:20:30+0100", "2026-12-01T10:20:30+00:00",
                                     "2026-12-01T10:20Z", "2026-12-01"])
def test_check_refuses_a_created_time_that_is_not_utc_z(created: str) -> None:
    run = _run()
    doc = _doc(run)
    doc["created"] = created
    with pytest.raises(FkvError) as e:
        results.check(doc, source="f.json")
    assert str(e.value) == f"f.json: 'created' must be UTC 'YYYY-MM-DDTHH:MM:SSZ' (got {created!r})"


def test_load_paths_sorts_by_creation_time_then_name_and_filters_by_bench(tmp_path: Path) -> None:
    """Oldest first by ``created`` whatever the file names say (``fkv bench report --plots``
    draws the last of each bench)."""
    for name, bench, created in (("a.json", "write", "2026-12-03T00:00:00Z"),
                                 ("z.json", "write", "2026-12-01T00:00:00Z"),
                                 ("c.json", "plan", "2026-12-02T00:00:00Z"),
                                 ("b.json", "write", "2026-12-02T00:00:00Z")):
        run = results.Run(bench, env={})
        run.created = created
        results.write(run, json_path=tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a result")
    assert [p.name for p, _ in results.load_paths(tmp_path)] == ["z.json", "b.json", "c.json",
                                                                 "a.json"]
    assert [(p.name, f.created) for p, f in results.load_paths(tmp_path, bench="write")] == [
        ("z.json", "2026-12-01T00:00:00Z"), ("b.json", "2026-12-02T00:00:00Z"),
        ("a.json", "2026-12-03T00:00:00Z")]
    assert [f.bench for f in results.load_all(tmp_path, bench="plan")] == ["plan"]
    assert results.load_all(tmp_path, bench="convert") == []


def test_latest_cases_keeps_a_case_measured_only_with_an_error() -> None:
    old, new = _run(), _run()
    new.created = "2026-12-02T00:00:00Z"
    old.add("a", metrics={"gbps": 1})
    new.add("c", error="RuntimeError: boom")
    latest = results.latest_cases([new.to_file(), old.to_file()])
    assert {k: (c.error, f.created) for k, (c, f) in latest.items()} == {
        ("write", "a"): ("", "2026-12-01T10:20:30Z"),
        ("write", "c"): ("RuntimeError: boom", "2026-12-02T00:00:00Z")}


def test_iter_metrics_yields_bench_case_metric_value() -> None:
    run = _run()
    run.add("a", metrics={"gbps": 1, "ms": None})
    run.add("b", metrics={"speedup_x": 2})
    assert list(results.iter_metrics([run.to_file()])) == [
        ("write", "a", "gbps", 1.0), ("write", "a", "ms", None), ("write", "b", "speedup_x", 2.0)]


def test_the_environment_records_nixl_variables_and_refuses_an_uppercase_commit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIXL_LOG_LEVEL", "INFO")
    monkeypatch.setenv("FKV_AUDIT_FLAG", "1")
    monkeypatch.setenv("FKVX_NOT_OURS", "1")
    env_vars = results.environment("cpu")["env_vars"]
    assert (env_vars["NIXL_LOG_LEVEL"], env_vars["FKV_AUDIT_FLAG"]) == ("INFO", "1")
    assert "FKVX_NOT_OURS" not in env_vars
    monkeypatch.setenv("FKV_GIT_COMMIT", "0123456789ABCDEF0123456789abcdef01234567")
    with pytest.raises(FkvError) as e:
        results.environment("cpu")
    assert str(e.value) == ("'FKV_GIT_COMMIT' must be a commit id of 40 lowercase hex digits "
                            "(got '0123456789ABCDEF0123456789abcdef01234567')")


def test_git_stamp_is_the_checkouts_head_and_dirty_only_for_tracked_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c",
                               "user.email=t@t", *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("commit", "-q", "-m", "one")
    (tmp_path / "a.txt").write_text("2")
    git("commit", "-q", "-am", "two")
    head = git("rev-parse", "HEAD")
    monkeypatch.delenv("FKV_GIT_COMMIT", raising=False)
    monkeypatch.setattr(results, "_repo_root", lambda: tmp_path)
    assert results._git() == {"git_commit": head, "git_dirty": False}
    (tmp_path / "untracked.txt").write_text("x")
    assert results._git() == {"git_commit": head, "git_dirty": False}
    (tmp_path / "a.txt").write_text("3")
    assert results._git() == {"git_commit": head, "git_dirty": True}
    monkeypatch.setattr(results, "_repo_root", lambda: None)  # an installed wheel
    assert results._git() == {"git_commit": None, "git_dirty": None}


def test_a_cuda_device_by_index_records_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(results, "_nvidia_smi", lambda field: f"smi {field}")
    env = results.environment("cuda:1")
    assert {k: env[k] for k in ("device", "gpu", "gpu_count", "driver")} == {
        "device": "cuda:1", "gpu": "NVIDIA H200", "gpu_count": 2, "driver": "smi driver_version"}
    assert isinstance(env["mps"], bool)


def test_versions_name_the_first_distribution_found(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    installed = {"nixl": "0.9.0", "nixl-cu12": "1.0.0", "msgspec": "0.19"}

    def version(dist: str) -> str:
        if dist not in installed:
            raise metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(metadata, "version", version)
    assert results._versions() == {"fkv": None, "torch": None, "triton": None, "nixl": "0.9.0",
                                   "numpy": None, "pyzmq": None, "msgspec": "0.19"}


def test_nvidia_smi_gives_the_first_gpus_answer_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=" 580.65 \n 570.10\n", stderr="")

    monkeypatch.setattr(results.subprocess, "run", run)
    assert results._nvidia_smi("driver_version") == "580.65"
    assert calls == [["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]]
    monkeypatch.setattr(results.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(
        argv, 0, stdout="\n", stderr=""))
    assert results._nvidia_smi("driver_version") is None

    def missing(argv, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(results.subprocess, "run", missing)
    assert results._nvidia_smi("driver_version") is None


@pytest.mark.parametrize("created", ["2026-9-01T10:20:30Z", "2026-12-1T10:20:30Z",
                                     "2026-12-01T9:20:30Z", "2026-12-01T10:2:3Z"])
def test_check_refuses_a_created_time_that_is_not_zero_padded(created: str) -> None:
    """The newest run is found by comparing ``created`` strings: "2026-9-01..." would sort after
    "2026-10-01..." (strptime alone accepts single digits)."""
    doc = _doc(_run())
    doc["created"] = created
    with pytest.raises(FkvError) as e:
        results.check(doc, source="f.json")
    assert str(e.value) == f"f.json: 'created' must be UTC 'YYYY-MM-DDTHH:MM:SSZ' (got {created!r})"


def test_runs_written_in_the_same_second_load_in_the_order_written(tmp_path: Path) -> None:
    """write() names them X.json, X-2.json ... X-10.json: the last written is the newest (the one
    the report shows and plots), not whichever name sorts last."""
    paths = []
    for n in range(10):
        run = _run()
        run.add("a", metrics={"gbps": float(n)})
        paths.append(results.write(run, results_dir=tmp_path))
    assert [p for p, _ in results.load_paths(tmp_path)] == paths
    assert paths[-1].name == "write-20261201T102030Z-10.json"
    (case, f), = results.latest_cases(results.load_all(tmp_path)).values()
    assert case.metrics["gbps"] == 9.0
