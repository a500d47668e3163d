"""The prefill/decode handshake as a pure, total function (docs/handshake.md).

``handshake(local, remote)`` takes the reading (decode) rank's ``(EngineDesc, KVCacheSpec)`` and the
prefill engine's rank-0 view, and returns either an :class:`Accept` carrying the exact
:class:`~fkv.connector.plan.TransferPlan`, or a :class:`Reject` listing *every* reason, each with a
field path, both values and a fix. It never raises, never mutates and never logs.

Heads per rank (both sides, the engine's rule): with ``H`` total KV heads and ``tp`` ranks, each
rank holds ``max(1, H // tp)`` heads; rank ``r``'s first head is ``r * H // tp``. When
``tp <= H`` this needs ``H % tp == 0``; when ``tp > H`` (replicated KV, docs/handshake.md) it needs
``tp % H == 0`` and each head is held whole by ``tp // H`` consecutive ranks. MLA caches hold one
latent per token shared by every head: ``total_num_kv_heads`` must be 1 and every rank holds it.

>>> from fkv import KVCacheSpec
>>> spec = KVCacheSpec(layout="HND", num_blocks=64, block_size=16, num_kv_heads=8, head_size=128)
>>> p = EngineDesc(engine_id="prefill", tp_size=1, tp_rank=0, total_num_kv_heads=8)
>>> d = EngineDesc(engine_id="decode", tp_size=2, tp_rank=1, total_num_kv_heads=8)
>>> result = handshake((d, spec.evolve(num_kv_heads=4)), (p, spec))
>>> result.ok, result.plan.remote_ranks, result.plan.strategy
(True, (0,), 'direct')
>>> print(handshake((d, spec), (p, spec.evolve(block_size=32, dtype="float16"))))
Reject: 2 reasons
  - local.spec.num_kv_heads: decode rank holds 8 KV heads, but 8 total heads over tp_size 2 give 4 per rank (local 8, remote None); fix: build the local cache spec with num_kv_heads=4
  - remote.spec.dtype: cache dtypes differ (local 'bfloat16', remote 'float16'); fix: use the same kv-cache dtype on both engines
"""

from __future__ import annotations

import html
from typing import Any

import attrs

from fkv.errors import FkvError, field_error
from fkv.connector.plan import build_plan, rank_heads
from fkv.layout import KVCacheSpec

__all__ = [
    "PROTOCOL_VERSION", "REASON_CODES", "Accept", "EngineDesc", "Reason", "Reject",
    "check_remote_ranks", "handshake", "rank_heads",
]

#: The fkv prefill/decode protocol this build speaks (wire format and plan semantics).
PROTOCOL_VERSION = 1

#: Every code a :class:`Reason` can carry.
REASON_CODES = (
    "type",            # an argument is not an (EngineDesc, KVCacheSpec) pair
    "protocol",        # a side speaks another fkv protocol version
    "engine_id",       # the remote engine is not the one the request named
    "model", "model_dtype", "cache_dtype", "head_size", "total_kv_heads", "num_layers",
    "backend_family",  # MLA (one latent per token) paired with a K/V backend
    "tp_rank",         # tp_rank outside [0, tp_size)
    "tp_heads",        # tp_size and total_num_kv_heads: neither divides the other
    "tp_ratio",        # the two TP sizes are not mutually divisible
    "kv_heads",        # spec.num_kv_heads disagrees with total heads over tp (or MLA total != 1)
    "strategy",        # an unknown forced strategy
    "remote_ranks",    # check_remote_ranks: the ranks of one engine disagree or are missing
    "internal",        # a bug in fkv (the handshake caught its own exception)
)
STRATEGIES = ("auto", "direct", "staging")


def _check_str(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str):
        raise field_error(attribute.name, value, "a str")


def _check_positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise field_error(attribute.name, value, "a positive int")


def _check_non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise field_error(attribute.name, value, "a non-negative int")


def _normalize_dtype_name(value: Any) -> Any:
    return value.removeprefix("torch.") if isinstance(value, str) else value


@attrs.frozen(kw_only=True)
class EngineDesc:
    """What one rank says about its engine (the non-layout half of the metadata in docs/handshake.md).

    ``total_num_kv_heads`` is the model's KV head count (1 for MLA); the heads this rank holds are
    in its :class:`~fkv.KVCacheSpec` (``num_kv_heads``) and must equal ``max(1, total // tp_size)``.

    >>> EngineDesc(engine_id="p0", tp_size=4, tp_rank=1, total_num_kv_heads=8, model="m")
    EngineDesc(engine_id='p0', tp_size=4, tp_rank=1, total_num_kv_heads=8, model='m', model_dtype='', protocol=1)
    """

    engine_id: str = attrs.field(validator=_check_str)
    tp_size: int = attrs.field(validator=_check_positive)
    tp_rank: int = attrs.field(validator=_check_non_negative)
    total_num_kv_heads: int = attrs.field(validator=_check_positive)
    model: str = attrs.field(default="", validator=_check_str)
    model_dtype: str = attrs.field(default="", converter=_normalize_dtype_name, validator=_check_str)
    protocol: int = attrs.field(default=PROTOCOL_VERSION, validator=_check_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise field_error("tp_rank", self.tp_rank, f"in [0, tp_size={self.tp_size})")

    @property
    def heads_per_rank(self) -> int:
        """``max(1, total_num_kv_heads // tp_size)``: KV heads each rank holds."""
        return max(1, self.total_num_kv_heads // self.tp_size)

    @property
    def replicated(self) -> bool:
        """True when ``tp_size > total_num_kv_heads``: every rank holds one whole, copied head."""
        return self.tp_size > self.total_num_kv_heads


@attrs.frozen
class Reason:
    """One named rejection: ``code``, the field ``path`` (e.g. ``remote.spec.block_size``), the
    local and remote values, what is wrong and how to fix it."""

    code: str
    path: str
    local: Any
    remote: Any
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message} (local {self.local!r}, remote {self.remote!r}); fix: {self.fix}"


@attrs.frozen
class Accept:
    """The pair can connect; ``plan`` says exactly which bytes move."""

    plan: Any  # fkv.connector.plan.TransferPlan

    ok = True

    def __bool__(self) -> bool:
        return True

    def __str__(self) -> str:
        return "Accept\n" + self.plan.describe()

    def _repr_html_(self) -> str:
        return "<b>Accept</b>" + self.plan._repr_html_()


@attrs.frozen
class Reject:
    """The pair cannot connect; ``reasons`` lists every reason, not only the first."""

    reasons: tuple[Reason, ...]

    ok = False

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        n = len(self.reasons)
        return f"Reject: {n} reason{'s' if n != 1 else ''}\n" + "\n".join(
            f"  - {r}" for r in self.reasons)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("path", "message", "local", "remote", "fix"))
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in
                             (r.path, r.message, repr(r.local), repr(r.remote), r.fix)) + "</tr>"
            for r in self.reasons)
        return f"<b>Reject</b><table><tr>{head}</tr>{rows}</table>"

    def as_error(self) -> FkvError:
        """An :class:`FkvError` whose message lists every reason (``.reasons`` carries them)."""
        err = FkvError(str(self))
        err.reasons = self.reasons  # type: ignore[attr-defined]
        return err


# -- the checks ---------------------------------------------------------------------------------

def _unpack(side: str, value: Any, reasons: list[Reason]) -> tuple[Any, Any]:
    if not isinstance(value, tuple | list) or len(value) != 2:
        reasons.append(Reason(
            "type", side, value if side == "local" else None, value if side == "remote" else None,
            f"{side} must be a pair (EngineDesc, KVCacheSpec), got {type(value).__name__}",
            f"pass {side}=(EngineDesc(...), KVCacheSpec(...))"))
        return None, None
    engine, spec = value
    ok = True
    for name, obj, cls in (("engine", engine, EngineDesc), ("spec", spec, KVCacheSpec)):
        if not isinstance(obj, cls):
            ok = False
            reasons.append(Reason(
                "type", f"{side}.{name}", type(obj).__name__ if side == "local" else None,
                type(obj).__name__ if side == "remote" else None,
                f"{side}[{0 if name == 'engine' else 1}] must be a {cls.__name__}, got "
                f"{type(obj).__name__}", f"build it with fkv.connector.{cls.__name__}(...)"
                if cls is EngineDesc else "build it with fkv.KVCacheSpec(...) or fkv.infer_spec"))
    return (engine, spec) if ok else (None, None)


def _side_reasons(side: str, engine: EngineDesc, spec: KVCacheSpec, reasons: list[Reason]) -> None:
    def add(code: str, path: str, value: Any, message: str, fix: str) -> None:
        loc, rem = (value, None) if side == "local" else (None, value)
        reasons.append(Reason(code, f"{side}.{path}", loc, rem, message, fix))

    who = "decode" if side == "local" else "prefill"
    tp, total = engine.tp_size, engine.total_num_kv_heads
    if not 0 <= engine.tp_rank < tp:
        add("tp_rank", "engine.tp_rank", engine.tp_rank, f"tp_rank must be in [0, {tp})",
            "pass the rank's index inside its own tensor-parallel group")
    if spec.is_mla:
        if total != 1:
            add("kv_heads", "engine.total_num_kv_heads", total,
                "an MLA cache holds one latent vector per token shared by all heads, so "
                "total_num_kv_heads must be 1", "pass total_num_kv_heads=1 for MLA models")
        return
    if total % tp and tp % total:
        add("tp_heads", "engine.tp_size", tp,
            f"{total} total KV heads cannot be split over tp_size {tp} (neither divides the other)",
            "use a tp_size that divides the KV head count, or a multiple of it (replicated KV)")
        return
    per_rank = max(1, total // tp)
    if spec.num_kv_heads != per_rank:
        add("kv_heads", "spec.num_kv_heads", spec.num_kv_heads,
            f"{who} rank holds {spec.num_kv_heads} KV heads, but {total} total heads over tp_size "
            f"{tp} give {per_rank} per rank", f"build the {side} cache spec with "
            f"num_kv_heads={per_rank}")


# (code, path, getter, message, fix) for the compatibility factors compared one by one.
_FACTORS = (
    ("model", "engine.model", lambda e, s: e.model, "models differ",
     "serve the same model (same name/revision) on both engines"),
    ("model_dtype", "engine.model_dtype", lambda e, s: e.model_dtype, "model dtypes differ",
     "load the model with the same dtype on both engines"),
    ("cache_dtype", "spec.dtype", lambda e, s: s.dtype, "cache dtypes differ",
     "use the same kv-cache dtype on both engines"),
    ("head_size", "spec.head_size", lambda e, s: s.head_size, "head sizes differ",
     "both engines must serve the same model (same head_size)"),
    ("total_kv_heads", "engine.total_num_kv_heads", lambda e, s: e.total_num_kv_heads,
     "total KV head counts differ", "both engines must serve the same model"),
    ("num_layers", "spec.num_layers", lambda e, s: s.num_layers, "layer counts differ",
     "both engines must serve the same model (same number of attention layers)"),
)


def _protocol_reasons(le: EngineDesc | None, re_: EngineDesc | None, reasons: list[Reason]) -> None:
    """One reason per side whose protocol this fkv does not speak, with both sides' versions."""
    lp = le.protocol if le is not None else None
    rp = re_.protocol if re_ is not None else None
    speaks = []
    if lp is not None:
        speaks.append(f"decode speaks fkv protocol {lp}")
    if rp is not None:
        speaks.append(f"prefill speaks {rp}")
    for side, value in (("local", lp), ("remote", rp)):
        if value is not None and value != PROTOCOL_VERSION:
            reasons.append(Reason(
                "protocol", f"{side}.engine.protocol", lp, rp,
                ", ".join(speaks) + f"; this fkv speaks protocol {PROTOCOL_VERSION}",
                "run the same fkv version on both engines"))


def _pair_reasons(le: EngineDesc, ls: KVCacheSpec, re_: EngineDesc, rs: KVCacheSpec,
                  expected_remote_engine: Any, reasons: list[Reason]) -> None:
    if expected_remote_engine is not None and re_.engine_id != expected_remote_engine:
        reasons.append(Reason(
            "engine_id", "remote.engine.engine_id", expected_remote_engine, re_.engine_id,
            f"the request named prefill engine {expected_remote_engine!r} but the remote is "
            f"{re_.engine_id!r}", "connect to the engine that prefilled the request"))
    for code, path, get, message, fix in _FACTORS:
        a, b = get(le, ls), get(re_, rs)
        if a != b:
            reasons.append(Reason(code, f"remote.{path}", a, b, message, fix))
    if ls.is_mla != rs.is_mla:
        reasons.append(Reason(
            "backend_family", "remote.spec.backend", ls.backend, rs.backend,
            "an MLA cache (one latent per token) cannot pair with a K/V cache",
            "use an MLA backend on both engines, or a K/V backend on both"))
    lt, rt = le.tp_size, re_.tp_size
    if max(lt, rt) % min(lt, rt):
        reasons.append(Reason(
            "tp_ratio", "remote.engine.tp_size", lt, rt,
            f"TP sizes {lt} (decode) and {rt} (prefill) are not mutually divisible",
            "choose TP sizes where one divides the other (e.g. 1/2/4/8)"))


def handshake(local: Any, remote: Any, *, expected_remote_engine: str | None = None,
              strategy: str = "auto") -> Accept | Reject:
    """Validate a decode rank (``local``) against a prefill engine (``remote``) and plan the reads.

    ``local``/``remote`` are ``(EngineDesc, KVCacheSpec)`` pairs; ``remote`` is the prefill
    engine's rank-0 view (every rank of an engine shares the spec). ``expected_remote_engine``
    checks the engine id a request named (docs/handshake.md, engine id rule). ``strategy`` forces ``"direct"``
    reads or ``"staging"`` instead of the cheaper one (``"auto"``).

    Pure and total: returns :class:`Accept` or :class:`Reject` for any input, never raises.

    >>> from fkv import KVCacheSpec
    >>> s = KVCacheSpec(layout="HND", num_blocks=8, block_size=16, num_kv_heads=8, head_size=128)
    >>> e = EngineDesc(engine_id="e", tp_size=1, tp_rank=0, total_num_kv_heads=8)
    >>> bool(handshake((e, s), (e, s))), handshake("oops", (e, s)).reasons[0].path
    (True, 'local')
    """
    try:
        return _handshake(local, remote, expected_remote_engine, strategy)
    except Exception as e:  # totality: a bug must come back as a reason, never as an exception
        return Reject((Reason("internal", "", None, None,
                              f"handshake failed unexpectedly: {type(e).__name__}: {e}",
                              "report this as an fkv bug with both engines' descriptions"),))


def _handshake(local: Any, remote: Any, expected_remote_engine: Any, strategy: Any) -> Accept | Reject:
    reasons: list[Reason] = []
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        reasons.append(Reason("strategy", "strategy", strategy, None,
                              f"strategy must be one of {STRATEGIES}", "pass strategy='auto'"))
    le, ls = _unpack("local", local, reasons)
    re_, rs = _unpack("remote", remote, reasons)
    _protocol_reasons(le, re_, reasons)
    if le is not None:
        _side_reasons("local", le, ls, reasons)
    if re_ is not None:
        _side_reasons("remote", re_, rs, reasons)
    if le is not None and re_ is not None:
        _pair_reasons(le, ls, re_, rs, expected_remote_engine, reasons)
    if reasons:
        return Reject(tuple(reasons))
    return Accept(build_plan(le, ls, re_, rs, strategy))


def check_remote_ranks(ranks: Any) -> tuple[Reason, ...]:
    """Reasons the ranks of one prefill engine cannot be served together (docs/handshake.md, rank agreement rule).

    ``ranks`` is every rank's ``(EngineDesc, KVCacheSpec)`` (e.g. the decoded side-channel
    peers), in any order. All must describe one engine: ranks ``0 .. tp_size - 1`` once each, and
    the same engine fields (but ``tp_rank``) and the same spec (so the same ``num_blocks`` and
    regions). Paths name the rank by position: ``remote[2].spec.num_blocks``. Empty when they
    agree. Pure and total, like :func:`handshake`.

    >>> from fkv import KVCacheSpec
    >>> s = KVCacheSpec(num_blocks=64, block_size=16, num_kv_heads=4, head_size=128)
    >>> e = lambda r: EngineDesc(engine_id="p", tp_size=2, tp_rank=r, total_num_kv_heads=8)
    >>> check_remote_ranks([(e(0), s), (e(1), s)])
    ()
    >>> (r,) = check_remote_ranks([(e(0), s), (e(1), s.evolve(num_blocks=60))])
    >>> r.path, r.message
    ('remote[1].spec.num_blocks', 'rank 1 reports num_blocks=60, rank 0 num_blocks=64')
    """
    try:
        return _check_remote_ranks(ranks)
    except Exception as e:  # totality
        return (Reason("internal", "remote", None, None,
                       f"check_remote_ranks failed unexpectedly: {type(e).__name__}: {e}",
                       "report this as an fkv bug"),)


def _check_remote_ranks(ranks: Any) -> tuple[Reason, ...]:
    reasons: list[Reason] = []
    if not isinstance(ranks, list | tuple) or not ranks:
        return (Reason("remote_ranks", "remote", None, type(ranks).__name__,
                       "expected a non-empty list of (EngineDesc, KVCacheSpec), one per rank",
                       "pass every rank's decoded peer"),)
    pairs = []
    for i, item in enumerate(ranks):
        sub: list[Reason] = []
        engine, spec = _unpack("remote", item, sub)
        for r in sub:
            reasons.append(attrs.evolve(r, path=r.path.replace("remote", f"remote[{i}]", 1)))
        if engine is not None:
            pairs.append((i, engine, spec))
    if reasons or not pairs:
        return tuple(reasons)
    _, e0, s0 = min(pairs, key=lambda p: p[1].tp_rank)
    fix = "configure every rank of the prefill engine alike"
    for i, engine, spec in pairs:
        for name in ("engine_id", "tp_size", "total_num_kv_heads", "model", "model_dtype", "protocol"):
            a, b = getattr(engine, name), getattr(e0, name)
            if a != b:
                reasons.append(Reason("remote_ranks", f"remote[{i}].engine.{name}", None, a,
                                      f"rank {engine.tp_rank} reports {name}={a!r}, rank "
                                      f"{e0.tp_rank} {name}={b!r}", fix))
        for f in attrs.fields(KVCacheSpec):
            a, b = getattr(spec, f.name), getattr(s0, f.name)
            if a != b:
                reasons.append(Reason("remote_ranks", f"remote[{i}].spec.{f.name}", None, a,
                                      f"rank {engine.tp_rank} reports {f.name}={a}, rank "
                                      f"{e0.tp_rank} {f.name}={b}", fix))
    seen = sorted(engine.tp_rank for _, engine, _ in pairs)
    if seen != list(range(e0.tp_size)):
        reasons.append(Reason("remote_ranks", "remote", None, seen,
                              f"an engine of tp_size {e0.tp_size} needs ranks 0..{e0.tp_size - 1} "
                              f"once each; got ranks {seen}",
                              "wait until every prefill rank has published its metadata"))
    return tuple(reasons)
