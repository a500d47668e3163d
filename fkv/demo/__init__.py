"""``fkv demo``: a request prefilled on one TP engine, its KV handed over NIXL to another, verified.

- :mod:`fkv.demo.model`: a small transformer (fixed-seed random weights), tensor parallel by heads;
- :mod:`fkv.demo.config`: the run's options, both engines' specs and the request's block tables;
- :mod:`fkv.demo.worker`: the child processes (reference, prefill ranks, decode ranks);
- :mod:`fkv.demo.run`: the parent (handshake first, then processes, progress, verdict);
- :mod:`fkv.demo.verify` and :mod:`fkv.demo.summary`: the comparison and the summary table/JSON.

Importing this package loads neither torch nor triton (the parent process never needs them).

>>> from fkv.demo.config import DemoConfig
>>> DemoConfig(decode_tp=2).spec("decode")
KVCacheSpec(backend='triton', layout='HND', num_blocks=13, block_size=16, num_kv_heads=4, head_size=64, dtype='float32', num_layers=4)
"""
