"""What one demo run is: its options, the engines' specs and descriptions, the request's blocks.

Pure (no torch): the parent process uses it to run the handshake before starting anything, and
every child rebuilds the same values from the JSON it is given.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import attrs

from fkv.errors import FkvError
from fkv.layout import KVCacheSpec

__all__ = ["DemoConfig", "MODEL_NAME", "ModelConfig", "PLAIN_REQUEST_ID", "REQUEST_ID",
           "head_ranges"]

MODEL_NAME = "fkv-demo-transformer"
REQUEST_ID = "demo-request-0"
# --stream: the same KV held a second time, fully written, for the non-streamed comparison read.
PLAIN_REQUEST_ID = "demo-request-0-plain"


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Dimensions of the demo model (defaults sized for the Triton interpreter on 2 CPU cores)."""

    vocab: int = 256
    hidden: int = 128
    num_layers: int = 4
    num_q_heads: int = 16
    num_kv_heads: int = 8
    head_size: int = 64
    mlp: int = 256
    seed: int = 0
    rope_theta: float = 10000.0


def head_ranges(cfg: ModelConfig, tp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((q_lo, q_hi), (kv_lo, kv_hi))``: the query and KV heads rank ``rank`` of ``tp`` holds.

    >>> head_ranges(ModelConfig(), 2, 1)
    ((8, 16), (4, 8))
    >>> head_ranges(ModelConfig(num_kv_heads=2), 4, 3)   # replicated: one KV head per rank
    ((12, 16), (1, 2))
    """
    if cfg.num_q_heads % tp or (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads):
        raise FkvError(f"'tp' must divide num_q_heads={cfg.num_q_heads} and divide or be a multiple "
                       f"of num_kv_heads={cfg.num_kv_heads} (got {tp})")
    if not 0 <= rank < tp:
        raise FkvError(f"'rank' must be in [0, {tp}) (got {rank})")
    q = cfg.num_q_heads // tp
    group = cfg.num_q_heads // cfg.num_kv_heads
    kv_lo = (rank * q) // group
    kv_n = max(1, cfg.num_kv_heads // tp)
    return (rank * q, (rank + 1) * q), (kv_lo, kv_lo + kv_n)


@attrs.frozen(kw_only=True)
class DemoConfig:
    """Options of ``fkv demo`` (see ``fkv demo --help``); JSON-serializable for the children."""

    prefill_tp: int = 1
    decode_tp: int = 2
    prefill_layout: str = "HND"
    decode_layout: str = "HND"
    backend: str = "triton"
    prefill_block_size: int = 16
    decode_block_size: int = 16
    tokens: int = 64
    new_tokens: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    decode_head_size: int | None = None
    corrupt: bool = False
    seed: int = 0
    timeout: float = 600.0
    stream: bool = False
    same_host_copies: bool = False  # False: FKV_CMA=0 in the children (NIXL READs on CPU)
    model: ModelConfig = attrs.field(factory=ModelConfig)

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DemoConfig:
        d = json.loads(text)
        d["model"] = ModelConfig(**d["model"])
        return cls(**d)

    # -- engines ----------------------------------------------------------------------------
    def kv_heads(self, tp: int) -> int:
        """KV heads per rank (docs/handshake.md): ``max(1, total // tp)``."""
        return max(1, self.model.num_kv_heads // tp)

    def prefill_blocks(self) -> int:
        return math.ceil(self.tokens / self.prefill_block_size)

    def decode_prompt_blocks(self) -> int:
        """Decode blocks receiving the prompt: they hold at least every transferred slot."""
        capacity = self.prefill_blocks() * self.prefill_block_size
        return math.ceil(capacity / self.decode_block_size)

    def decode_blocks(self) -> int:
        """Decode blocks of the whole sequence (prompt, then every generated token)."""
        need = math.ceil((self.tokens + self.new_tokens) / self.decode_block_size)
        return max(need, self.decode_prompt_blocks())

    def spec(self, side: str) -> KVCacheSpec:
        """The cache spec of one rank of ``side`` ("prefill" or "decode")."""
        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        used = self.prefill_blocks() if side == "prefill" else self.decode_blocks()
        head_size = self.model.head_size
        if side == "decode" and self.decode_head_size is not None:
            head_size = self.decode_head_size
        return KVCacheSpec(
            backend=self.backend, layout=getattr(self, f"{side}_layout"),
            num_blocks=2 * used + 3, block_size=getattr(self, f"{side}_block_size"),
            num_kv_heads=self.kv_heads(tp), head_size=head_size, dtype=self.dtype,
            num_layers=self.model.num_layers)

    def engine(self, side: str, rank: int) -> Any:
        from fkv.connector.handshake import EngineDesc

        tp = self.prefill_tp if side == "prefill" else self.decode_tp
        return EngineDesc(engine_id=f"{side}-engine", tp_size=tp, tp_rank=rank,
                          total_num_kv_heads=self.model.num_kv_heads, model=MODEL_NAME,
                          model_dtype="float32")

    def plain_block_ids(self) -> list[int]:
        """--stream: decode blocks receiving the non-streamed comparison read (none of the
        request's own blocks, so the streamed KV that decoding uses is not overwritten)."""
        taken = set(self.block_ids("decode"))
        free = [b for b in range(self.spec("decode").num_blocks) if b not in taken]
        return free[: self.decode_prompt_blocks()]

    def block_ids(self, side: str) -> list[int]:
        """The request's block table on ``side``: distinct ids in shuffled order (fixed seed).

        Prefill: ``prefill_blocks()`` ids; decode: ``decode_blocks()`` ids, the first
        ``decode_prompt_blocks()`` of which receive the transfer.
        """
        spec = self.spec(side)
        n = self.prefill_blocks() if side == "prefill" else self.decode_blocks()
        rng = random.Random(f"{self.seed}-{side}")
        return rng.sample(range(spec.num_blocks), n)

    def prompt(self) -> list[int]:
        rng = random.Random(f"{self.seed}-prompt")
        return [rng.randrange(self.model.vocab) for _ in range(self.tokens)]
