"""fkv demo: the model's tensor parallelism, the verdict logic, refusals, and end-to-end runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from fkv.demo.config import DemoConfig
from fkv.demo.model import DemoModel, DenseKV, ModelConfig, _rms, head_ranges
from fkv.demo.verify import compare_kv, compare_run
from fkv.errors import FkvError

SMALL = ModelConfig(vocab=64, hidden=32, num_layers=2, num_q_heads=8, num_kv_heads=4, head_size=16,
                    mlp=64)


def _fkv(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fkv", *args], capture_output=True, text=True,
                          timeout=timeout)


# -- the model ----------------------------------------------------------------------------------

def test_head_ranges_follow_spec_section_4():
    cfg = ModelConfig()  # 16 query heads, 8 KV heads
    assert [head_ranges(cfg, 2, r) for r in range(2)] == [((0, 8), (0, 4)), ((8, 16), (4, 8))]
    assert [head_ranges(cfg, 16, r)[1] for r in (0, 1, 2, 15)] == [(0, 1), (0, 1), (1, 2), (7, 8)]
    with pytest.raises(FkvError, match=r"'tp' must divide num_q_heads=16 .* \(got 3\)"):
        head_ranges(cfg, 3, 0)


class _ThreadGroup:
    """The ranks of one TP engine as threads; ``all_gather`` joins their parts like gloo does."""

    def __init__(self, tp: int) -> None:
        self.barrier = threading.Barrier(tp)
        self.parts: list[torch.Tensor | None] = [None] * tp

    def all_gather(self, rank: int):
        def gather(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            out = torch.cat(self.parts, dim=1)
            self.barrier.wait()
            return out
        return gather


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_ranks_reproduce_the_whole_model(tp):
    # Each rank attends over its own heads; after the all-gather every rank has the whole model's
    # residual stream, so every rank's logits are the single-process logits.
    tokens = torch.randint(0, SMALL.vocab, (12,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12)
    want_kv = DenseKV(SMALL.num_layers, torch.float32)
    want = DemoModel(SMALL).forward(tokens, pos, want_kv)
    group = _ThreadGroup(tp)
    ranks = [DemoModel(SMALL, tp=tp, rank=r, all_gather=group.all_gather(r)) for r in range(tp)]
    kvs = [DenseKV(SMALL.num_layers, torch.float32) for _ in range(tp)]
    got: list[torch.Tensor | None] = [None] * tp

    def run(r: int) -> None:
        got[r] = ranks[r].forward(tokens, pos, kvs[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for r in range(tp):
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
        # Each rank's K/V cache is the matching head slice of the whole model's.
        lo, hi = head_ranges(SMALL, tp, r)[1]
        torch.testing.assert_close(kvs[r].k[1], want_kv.k[1][:, lo:hi], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kvs[r].v[1], want_kv.v[1][:, lo:hi], rtol=1e-5, atol=1e-5)


def _textbook(model: DemoModel, tokens: torch.Tensor):
    """The model's weights through a transformer written out step by step in float64: RMSNorm,
    rotate-half RoPE (angle ``p * theta ** (-2i / D)``), causal attention per query head and
    token over its group's KV head, SiLU-gated MLP. Returns the logits and each layer's K and V."""
    cfg = model.cfg
    D, H, Hk, T = cfg.head_size, cfg.num_q_heads, cfg.num_kv_heads, tokens.shape[0]
    w = {name: t.double() for name, t in (("embed", model.embed), ("norm_f", model.norm_f),
                                          ("lm_head", model.lm_head))}
    freqs = torch.tensor([cfg.rope_theta ** (-2 * i / D) for i in range(D // 2)],
                         dtype=torch.float64)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rope(t):
        a, b = t[..., : D // 2], t[..., D // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def rms(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * g

    x = w["embed"][tokens]
    ks, vs = [], []
    for layer in model.layers:
        lw = {name: t.double() for name, t in layer.items()}
        h = rms(x, lw["norm1"])
        q = rope((h @ lw["wq"]).view(T, H, D))
        k = rope((h @ lw["wk"]).view(T, Hk, D))
        v = (h @ lw["wv"]).view(T, Hk, D)
        ks.append(k)
        vs.append(v)
        out = torch.zeros(T, H, D, dtype=torch.float64)
        for head in range(H):
            kh = head // (H // Hk)
            for t in range(T):
                scores = torch.stack([q[t, head] @ k[j, kh] for j in range(t + 1)]) / math.sqrt(D)
                p = torch.softmax(scores, 0)
                out[t, head] = sum(p[j] * v[j, kh] for j in range(t + 1))
        x = x + out.reshape(T, H * D) @ lw["wo"]
        h = rms(x, lw["norm2"])
        gate = h @ lw["w_gate"]
        x = x + (gate * torch.sigmoid(gate) * (h @ lw["w_up"])) @ lw["w_down"]
    return rms(x, w["norm_f"]) @ w["lm_head"], ks, vs


_TOKENS = torch.tensor([3, 17, 0, 31, 8, 8, 21])


def test_model_is_the_transformer_its_docstring_describes():
    model = DemoModel(SMALL)
    kv = DenseKV(SMALL.num_layers, torch.float32)
    logits = model.forward(_TOKENS, torch.arange(7), kv)
    want, ks, vs = _textbook(model, _TOKENS)
    assert logits.dtype == torch.float32 and logits.shape == (7, SMALL.vocab)
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)
    for i in range(SMALL.num_layers):  # K and V too: RoPE on absolute positions
        torch.testing.assert_close(kv.k[i].double(), ks[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.v[i].double(), vs[i], rtol=1e-5, atol=1e-5)


def test_rms_norm_keeps_a_zero_row_finite():
    assert torch.equal(_rms(torch.zeros(2, 4), torch.ones(4)), torch.zeros(2, 4))
    torch.testing.assert_close(_rms(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0])),
                               torch.tensor([[3.0, 8.0]]) / math.sqrt(12.5 + 1e-6))


def test_layer_callback_comes_after_the_layers_kv_is_written():
    # --stream publishes a layer from this callback: its K/V must be in the cache by then.
    seen = []
    kv = DenseKV(SMALL.num_layers, torch.float32)
    DemoModel(SMALL).forward(_TOKENS[:3], torch.arange(3), kv,
                             on_layer=lambda i: seen.append((i, [k is not None for k in kv.k])))
    assert seen == [(0, [True, False]), (1, [True, True])]


def test_incremental_decode_matches_the_whole_sequence():
    model = DemoModel(SMALL)
    full_kv, kv = DenseKV(SMALL.num_layers, torch.float32), DenseKV(SMALL.num_layers, torch.float32)
    want = model.forward(_TOKENS, torch.arange(7), full_kv)
    got = [model.forward(_TOKENS[:4], torch.arange(4), kv)]
    for p in (4, 5, 6):
        got.append(model.forward(_TOKENS[p:p + 1], torch.tensor([p]), kv))
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)
    for layer in range(SMALL.num_layers):  # the cache keeps the tokens in position order
        torch.testing.assert_close(kv.k[layer], full_kv.k[layer], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kv.v[layer], full_kv.v[layer], rtol=1e-6, atol=1e-6)


def test_dense_attention_rounds_q_k_v_and_its_output_to_the_cache_dtype():
    # One KV head of 4 channels, two tokens. Query 1 is 1 + 2**-9 (1 in bfloat16) on key 0's
    # channel and 1 on key 1's; key 0 is 1024.125 (1024 in bfloat16). Rounded, both scores are
    # 1024 / sqrt(4) = 512 and the output is exactly half of each value; unrounded, key 0 would
    # weigh more.
    kv = DenseKV(1, torch.bfloat16)
    q = torch.tensor([[[1.0, 0, 0, 0]], [[1 + 2**-9, 1.0, 0, 0]]])
    k = torch.tensor([[[1024.0 + 2**-3, 0, 0, 0]], [[0, 1024.0, 0, 0]]])
    v = torch.tensor([[[1.0, 0, 0, 0]], [[0, 1.0, 0, 0]]])
    out = kv.attend(0, q, k, v, torch.arange(2))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.tensor([[[1.0, 0, 0, 0]], [[0.5, 0.5, 0, 0]]],
                                         dtype=torch.bfloat16))
    assert torch.equal(kv.k[0], k.to(torch.bfloat16)) and torch.equal(kv.v[0], v.to(torch.bfloat16))


def test_a_bfloat16_cache_gives_float32_logits_near_the_float32_ones():
    model = DemoModel(SMALL)
    want = model.forward(_TOKENS, torch.arange(7), DenseKV(SMALL.num_layers, torch.float32))
    got = model.forward(_TOKENS, torch.arange(7), DenseKV(SMALL.num_layers, torch.bfloat16))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)  # verify.tolerance("bfloat16")


# -- configuration --------------------------------------------------------------------------------

def test_config_round_trips_and_block_tables_are_consistent():
    cfg = DemoConfig(prefill_tp=2, decode_tp=1, prefill_block_size=16, decode_block_size=32,
                     tokens=40, new_tokens=30)
    assert DemoConfig.from_json(cfg.to_json()) == cfg
    p, d = cfg.block_ids("prefill"), cfg.block_ids("decode")
    assert len(p) == 3 and len(set(p)) == 3 and max(p) < cfg.spec("prefill").num_blocks
    # The decode prompt blocks hold exactly the prefill blocks' 48 slots; the rest fits 70 tokens.
    assert cfg.decode_prompt_blocks() == 2 and len(d) == cfg.decode_blocks() == 3
    assert (cfg.spec("prefill").num_kv_heads, cfg.spec("decode").num_kv_heads) == (4, 8)
    assert p != sorted(p) or d != sorted(d)  # shuffled block tables exercise the indirection


# -- the verdict -----------------------------------------------------------------------------------

def test_compare_run_passes_identical_runs_and_locates_divergence():
    rng = np.random.default_rng(0)
    logits = [rng.standard_normal(8).astype(np.float32) for _ in range(4)]
    kv_ok = [(0.0, None)]
    v = compare_run([1, 2, 3, 4], logits, [1, 2, 3, 4], [x + 1e-6 for x in logits], kv_ok,
                    "float32", 10)
    assert v["ok"] and v["tokens_identical"] and v["first_divergence"] is None
    bad = [x.copy() for x in logits]
    bad[2][5] += 0.5
    v = compare_run([1, 2, 3, 4], logits, [1, 2, 3, 4], bad, kv_ok, "float32", 10)
    assert not v["ok"] and v["tokens_identical"] and not v["logits_ok"]
    assert v["first_divergence"].startswith("step 2 (position 11, decode): logits differ by up to 0.5")
    v = compare_run([1, 2, 3, 4], logits, [1, 2, 9, 4], logits, kv_ok, "float32", 10)
    assert v["first_divergence"] == "step 2 (position 11, decode): generated token 9, reference 3"


def test_compare_kv_names_layer_token_head():
    ref = np.random.default_rng(1).standard_normal((2, 6, 2, 4, 8)).astype(np.float32)
    got = ref[:, :, :, 2:4].copy()
    assert compare_kv(ref, got, (2, 4), 1e-4, 1e-4) == (0.0, None)
    got[1, 4, 1, 0, 3] = np.nan  # never arrived
    worst, msg = compare_kv(ref, got, (2, 4), 1e-4, 1e-4)
    assert worst == float("inf")
    assert msg.startswith("KV after transfer differs first at layer 1, token 4, V, head 2, channel 3: "
                          "received nan")


# -- the command line ------------------------------------------------------------------------------

def test_refused_pairing_prints_every_reason_and_exits_3(tmp_path):
    out = tmp_path / "refused.json"
    r = _fkv("demo", "--decode-head-size", "32", "--prefill-tp", "3", "--json", str(out),
             timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "fkv refuses this pairing: 3 reasons" in lines
    assert [ln.split(" (")[0] for ln in lines if ln.startswith("  - ")] == [
        "  - remote.engine.tp_size", "  - remote.spec.head_size", "  - remote.engine.tp_size"]
    assert "  - remote.spec.head_size (head_size): head sizes differ (local 32, remote 64)" in lines
    assert sum(ln.startswith("    fix: ") for ln in lines) == 3
    assert lines[-1] == "Reject: no process was started, no byte moved (exit code 3)"
    summary = json.loads(out.read_text())
    assert summary["exit_code"] == 3 and summary["handshake"]["decision"] == "reject"
    assert [r["code"] for r in summary["handshake"]["reasons"]] == ["tp_heads", "head_size", "tp_ratio"]


def test_usage_errors_exit_2(capsys):
    from fkv.cli import main

    assert main(["demo", "--tokens", "0"]) == 2
    assert main(["demo", "--decode-layout", "NDH"]) == 2
    assert main(["demo", "--device", "tpu"]) == 2
    assert main(["demo", "--decode-head-size", "-3"]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # usage errors go to stderr, as argparse's own
    assert "argument --tokens: must be a positive integer (got 0)" in out.err
    assert "fkv demo: error: 'layout' must be in ('NHD', 'HND')" in " ".join(out.err.split())
    assert "invalid choice: 'tpu'" in out.err
    assert "argument --decode-head-size: must be a positive integer (got -3)" in out.err


def _run_demo(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "demo.json"
    r = _fkv("demo", "--json", str(out), *args)
    return r, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.transport
@pytest.mark.interpreter
def test_demo_default_run_matches_the_reference(tmp_path):
    r, s = _run_demo(tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert s["handshake"]["decision"] == "accept"
    assert s["transfer"]["ok"] and len(s["transfer"]["per_rank"]) == 2
    # P TP=1 -> D TP=2, HND both sides: each decode rank reads its 4 heads of 4 layers x 4 blocks.
    assert s["transfer"]["bytes"] == 4 * 4 * 2 * 16 * 8 * 64 * 4
    assert s["transfer"]["moved_by"] == "NIXL"  # the demo shows NIXL unless told otherwise
    assert "of which NIXL" in r.stdout
    assert s["tokens"]["generated"] == s["tokens"]["reference"]
    assert len(s["tokens"]["generated"]) == 16
    assert s["verification"]["ok"] and s["verification"]["first_divergence"] is None
    assert "PASS" in r.stdout
    # Not streamed: the summary's shape is today's (no streaming section, no stream option).
    assert "stream" not in s and "stream" not in s["config"]
    assert "last layer -> KV" not in r.stdout


@pytest.mark.slow
@pytest.mark.transport
@pytest.mark.interpreter
def test_demo_tp2_nhd_to_tp1_hnd_matches_the_reference(tmp_path):
    """With --same-host-copies: the decode rank copies both prefill processes' rows itself."""
    r, s = _run_demo(tmp_path, "--prefill-tp", "2", "--decode-tp", "1", "--prefill-layout", "NHD",
                     "--decode-layout", "HND", "--new-tokens", "8", "--same-host-copies")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert s["transfer"]["ok"] and len(s["transfer"]["per_rank"]) == 1
    assert s["transfer"]["moved_by"] == "process_vm_readv"
    assert "of which process_vm_readv" in r.stdout
    assert s["transfer"]["bytes"] == 4 * 4 * 2 * 16 * 8 * 64 * 4
    assert s["verification"]["ok"] and s["tokens"]["generated"] == s["tokens"]["reference"]


@pytest.mark.slow
@pytest.mark.transport
@pytest.mark.interpreter
@pytest.mark.parametrize("pairing", [
    ("--prefill-tp", "1", "--decode-tp", "2"),
    ("--prefill-tp", "2", "--decode-tp", "1", "--prefill-layout", "NHD",
     "--decode-block-size", "8"),
], ids=["1-2", "2-1-nhd"])
def test_demo_stream_matches_the_reference_and_times_both_reads(tmp_path, pairing):
    # The decode ranks read before the prefill's forward starts; each layer lands after it is
    # published; the same KV read again non-streamed is identical; tokens match the reference.
    r, s = _run_demo(tmp_path, "--stream", "--tokens", "24", "--new-tokens", "3", *pairing)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert s["config"]["stream"] is True
    assert s["transfer"]["ok"] and s["verification"]["ok"]
    assert s["tokens"]["generated"] == s["tokens"]["reference"]
    assert len(s["tokens"]["generated"]) == 3
    st = s["stream"]
    assert st["identical"] and st["non_streamed"]["ok"]
    assert st["non_streamed"]["bytes"] == s["transfer"]["bytes"]
    assert st["streamed"]["tail_seconds"] >= 0 and st["non_streamed"]["tail_seconds"] > 0
    # The streamed read spans the forward: it started before the first layer was published.
    assert st["streamed"]["read_seconds"] >= st["layers"][-1]["published_seconds"]
    layers = st["layers"]
    assert [x["layer"] for x in layers] == [0, 1, 2, 3]
    for x in layers:
        assert x["landed_seconds"] >= x["published_seconds"] >= 0
        assert x["after_publish_seconds"] >= 0
    for key in ("published_seconds", "landed_seconds"):
        assert [x[key] for x in layers] == sorted(x[key] for x in layers)
    assert "last layer -> KV" in r.stdout and "after its publish" in r.stdout


@pytest.mark.slow
@pytest.mark.transport
@pytest.mark.interpreter
def test_demo_catches_a_corrupted_transfer(tmp_path):
    r, s = _run_demo(tmp_path, "--corrupt", "--tokens", "24", "--new-tokens", "3",
                     "--decode-block-size", "8")
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    assert s["transfer"]["ok"] and not s["verification"]["ok"]
    assert s["verification"]["first_divergence"].startswith(
        "KV after transfer differs first at layer 1, token 5, K, head 0, channel 3")


@pytest.mark.interpreter  # on a CPU-only machine: a rank that cannot start fails the run fast
def test_a_failing_rank_stops_the_run_with_exit_1(tmp_path):
    r, s = _run_demo(tmp_path, "--device", "cuda", "--tokens", "8", "--new-tokens", "2")
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    assert s["exit_code"] == 1 and not s["verification"]["ok"]
    assert any("'--device' must be 'cpu' on a machine without a CUDA device" in e["error"]
               for e in s["errors"])
    assert all("exited with code -9" not in e["error"] for e in s["errors"])  # ours, not failures
