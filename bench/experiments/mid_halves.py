"""Experiment: row halves on mid tiles (32-128 rows: chunked prefill with short query chunks).

The default turns ``AttentionConfig.row_halves`` on only for full 256-row tiles (the prefill
tile). A forced 128-row tile with halves ran B=4 x 4096 causal in 1.376 ms against 1.584 ms
without (bench/NOTES.md, fifth session), so the default may want halves on mid tiles too. This
times the mid-tile cases chunked prefill produces (query chunks of 16 and 32 tokens per sequence,
Hq 32 / Hkv 8: 64- and 128-row tiles) with the default config and with ``row_halves=True``, and
records the largest difference between the two outputs (halves of 32 or 64 rows may take another
MMA shape on Hopper, so the bytes may differ within rounding).

    python bench/experiments/mid_halves.py          # GPU; CPU runs a tiny shape, no timing
The JSON goes to ``$OUT`` (or /tmp) as ``mid-halves-exp.json``.
"""

from __future__ import annotations


import attrs
import torch
import triton

import _record  # bench/experiments/_record.py (the script's own folder is on sys.path)


def main() -> None:
    from fkv.bench.attention import Problem, Shape
    from fkv.ops import paged_attention  # noqa: F401  (import check)
    from fkv.ops.attention import attention_config

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    cases = ([(64, 4096, 32), (64, 4096, 16), (16, 8192, 32), (256, 2048, 16), (4, 4096, 4096)]
             if cuda else [(2, 96, 32)])
    rows = []
    for layout in ("NHD", "HND"):
        for batch, seq_len, q_len in cases:
            p = Problem(Shape(), layout, batch, seq_len, q_len, dev, dense=False)
            base = attention_config(
                num_seqs=batch, num_q_tokens=batch * q_len, num_q_heads=32, num_kv_heads=8,
                head_size=128, max_context=p.block_table.shape[1] * 16, itemsize=2,
                num_sms=sms, varlen=True)
            variants = {"default": base,
                        "halves": attrs.evolve(base, row_halves=True, lazy_rescale=False,
                                               range_stages=0)}
            outs = {}
            for name, cfg in variants.items():
                row = {"layout": layout, "batch": batch, "seq_len": seq_len, "q_len": q_len,
                       "variant": name, "config": attrs.asdict(cfg)}
                try:
                    outs[name] = p.kernel(cfg).clone()
                    row["max_diff_vs_default"] = (outs[name].float()
                                                  - outs["default"].float()).abs().max().item()
                    if cuda:
                        row["ms"] = triton.testing.do_bench(lambda: p.kernel(cfg), rep=200,
                                                            return_mode="median")
                except Exception as e:  # noqa: BLE001 - an experiment: record and go on
                    row["error"] = _record.error(e)
                rows.append(row)
                print({k: v for k, v in row.items() if k != "config"}, "splits", cfg.num_splits,
                      "block_q", cfg.block_q, flush=True)
            del p
    _record.write("mid-halves-exp.json", "row halves on mid tiles", rows)

if __name__ == "__main__":
    main()
