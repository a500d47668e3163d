"""Experiment: compile every default attention configuration for sm_90a without a GPU.

``attention_config`` picks tiles from the shapes; a tile that the CUDA assembler cannot build is a
crash at the user's first call. Triton compiles for a named target without a device, so this
enumerates the default configurations of a grid of shapes (head sizes, GQA groups, query lengths,
batch and context sizes, bf16 / fp8 caches, NHD / HND, window and softcap), compiles each distinct
kernel specialization once with the Triton first on ``PYTHONPATH`` (its own ``ptxas``) and
records the ones that fail. Run it with the device image's Triton, e.g.

    T36=$(mktemp -d)
    pip download --no-deps triton==3.6.0 -d $T36/whl
    pip install --no-deps --target $T36/site $T36/whl/*.whl
    PYTHONPATH=$T36/site:. python bench/experiments/compile_defaults.py   # JSON to $OUT or /tmp
    ... compile_defaults.py --head=32 --head=64                              # those head sizes only

Ints are specialized as Triton does at a launch (divisible by 16 where the shapes make them so,
strides of 1 constant); pointers are taken 16-byte aligned.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import sys
import time

import triton
from triton.backends.compiler import GPUTarget

import fkv
from fkv.ops._attention_kernels import _paged_attention_kernel as KERNEL
from fkv.ops._spec import cache_constexprs
from fkv.ops.attention import _pow2, attention_config, cache_strides

SMS = 132  # H200


def _key(spec, q_heads, cfg, window, softcap, fp32_q):
    strides = cache_strides(spec)
    head_pad = _pow2(max(spec.head_size, 16))
    group = q_heads // spec.num_kv_heads
    heads = cfg.heads_per_program
    block_m = _pow2(max(16, cfg.block_q * heads))
    split = cfg.num_splits > 1
    cx = dict(cache_constexprs(spec))
    cx.update(STRIDE_TOKEN=strides["stride_token"], HEAD_PAD=head_pad, GROUP=group,
              HEADS_PER_PROG=heads, HEAD_CHUNKS=-(-group // heads), BLOCK_Q=cfg.block_q,
              BLOCK_M=block_m, TILE_N=cfg.tile_n, VARLEN=cfg.block_q > 1 or None,
              SPLIT=split, USE_WINDOW=window, USE_SOFTCAP=softcap, DOT_F32=False,
              PRECISION="ieee" if fp32_q else None, HEADS_FIRST=True, FMA_SCORES=True,
              FUSED_MERGE=False, RANGE_STAGES=cfg.range_stages, LAZY_RESCALE=cfg.lazy_rescale,
              PDL=False, ROW_HALVES=cfg.row_halves and not split and block_m >= 32)
    # strides of the queries/outputs [T, Hq, D] (contiguous) and of the cache
    ints = {"stride_qt": q_heads * spec.head_size, "stride_qh": spec.head_size, "stride_qd": 1,
            "stride_ot": q_heads * spec.head_size, "stride_oh": spec.head_size, "stride_od": 1,
            "stride_block": strides["stride_block"], "stride_kv": strides["stride_kv"],
            "stride_head": strides["stride_head"], "num_q_heads": q_heads}
    return cx, ints, (cfg.num_warps, cfg.num_stages)


def _compile(spec, cx, ints, launch, fp32_q):
    qty = "*fp32" if fp32_q else "*bf16"
    cty = {"float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5"}.get(spec.dtype, qty)
    ptr = {"q_ptr": qty, "cache_ptr": cty, "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
           "qsl_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "out_ptr": qty,
           "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "ctr_ptr": "*i32"}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(KERNEL.arg_names):
        if name in cx:
            sig[name], consts[name] = "constexpr", cx[name]
        elif name in ptr:
            sig[name] = ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "softcap"):
            sig[name] = "fp32"
        elif ints.get(name) == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if name in ints and ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=KERNEL, signature=sig, constexprs=consts, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": launch[0], "num_stages": launch[1]})


def shapes(heads=(32, 64, 80, 96, 128, 256)):
    for head, (hq, hkv), dtype, layout in itertools.product(
            heads, ((8, 8), (16, 8), (32, 8), (64, 8), (32, 1)),
            ("bfloat16", "float8_e4m3fn"), ("NHD", "HND")):
        for seqs, q_len, ctx in ((64, 1, 8192), (256, 1, 2048), (8, 1, 32768), (16, 1, 4096),
                                 (1, 1, 512), (4, 4096, 4096), (64, 32, 4096), (64, 16, 4096),
                                 (16, 64, 8192), (2, 512, 2048), (1, 128, 1024), (32, 4, 4096),
                                 (8, 256, 4096), (1, 2048, 2048)):
            for window, softcap in ((False, False), (True, False), (False, True)):
                yield head, hq, hkv, dtype, layout, seqs, q_len, ctx, window, softcap


def main() -> None:
    seen, rows = {}, []
    t0 = time.time()
    heads = [int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--head=")]
    for head, hq, hkv, dtype, layout, seqs, q_len, ctx, window, softcap in shapes(
            *([heads] if heads else [])):
        spec = fkv.KVCacheSpec(layout=layout, num_blocks=1024, block_size=16, num_kv_heads=hkv,
                               head_size=head, dtype=dtype)
        cfg = attention_config(num_seqs=seqs, num_q_tokens=seqs * q_len, num_q_heads=hq,
                               num_kv_heads=hkv, head_size=head, max_context=ctx + 16,
                               itemsize=2, num_sms=SMS, varlen=q_len > 1)
        cx, ints, launch = _key(spec, hq, cfg, window, softcap, False)
        cx["VARLEN"] = q_len > 1
        key = json.dumps([sorted((k, str(v)) for k, v in cx.items()),
                          sorted((k, v % 16 == 0, v == 1) for k, v in ints.items()), launch])
        shape = {"head_size": head, "q_heads": hq, "kv_heads": hkv, "cache": dtype,
                 "layout": layout, "seqs": seqs, "q_len": q_len, "context": ctx,
                 "window": window, "softcap": softcap}
        if key in seen:
            seen[key]["shapes"] += 1
            continue
        row = {"shape": shape, "config": {k: getattr(cfg, k) for k in (
            "block_q", "heads_per_program", "tile_n", "num_splits", "num_warps", "num_stages",
            "row_halves")}, "shapes": 1}
        try:
            _compile(spec, cx, ints, launch, False)
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - an experiment: record and go on
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"[:300]
            print("FAIL", shape, row["config"], row["error"], flush=True)
        seen[key] = row
        rows.append(row)
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} distinct kernels, {len(failed)} failed, {time.time() - t0:.0f} s")
    name = "compile-defaults-exp.json" if not heads else \
        f"compile-defaults-heads-{'-'.join(map(str, heads))}-exp.json"
    out = pathlib.Path(os.environ.get("OUT", "/tmp")) / name
    out.write_text(json.dumps({"experiment": "compile every default attention config for sm_90a",
                               "triton": triton.__version__, "python": sys.version.split()[0],
                               "kernels": len(rows), "failed": len(failed), "rows": rows},
                              indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
