"""The wire format: exact round trips, every limit pinned, and a fuzzer (>= 10^4 mutated,
truncated and random inputs) under which only FkvWireError may escape decode_untrusted."""

from __future__ import annotations

import pathlib
import re

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fkv import FkvError, FkvWireError, KVCacheSpec
from fkv.connector.handshake import EngineDesc
from fkv.connector.wire import (
    MAX_MESSAGE_BYTES, MAX_REGIONS, WIRE_VERSION, Peer, decode_untrusted, encode,
)

SPEC = KVCacheSpec(backend="flash_attn", layout="HND", num_blocks=4, block_size=16, num_kv_heads=2,
                   head_size=64, dtype="float8_e4m3fn", num_layers=3)
ENGINE = EngineDesc(engine_id="prefill-7", tp_size=4, tp_rank=2, total_num_kv_heads=8,
                    model="gemma-3-4b-it", model_dtype="torch.bfloat16")
REGIONS = [(0x7F00_0000_0000 + i * (1 << 20), SPEC.region_bytes) for i in range(3)]
VALID = encode(ENGINE, SPEC, REGIONS, device_id=3, agent_metadata=b"\x00nixl-agent\xff")


def _raw(**changes) -> bytes:
    """A message built field by field (bypassing encode's checks), as a hostile peer could."""
    msg = msgspec.msgpack.decode(VALID)
    for key, value in changes.items():
        node = msg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        if value is _DROP:
            del node[leaf]
        else:
            node[leaf] = value
    return msgspec.msgpack.encode(msg)


_DROP = object()


def test_round_trip_is_exact():
    peer = decode_untrusted(VALID)
    assert peer == Peer(engine=ENGINE, spec=SPEC, regions=tuple(REGIONS), device_id=3,
                        agent_metadata=b"\x00nixl-agent\xff")
    assert peer.engine.model_dtype == "bfloat16"
    cross = SPEC.evolve(cross_layer=True, backend="mla", num_kv_heads=1)
    mla = EngineDesc(engine_id="m", tp_size=1, tp_rank=0, total_num_kv_heads=1)
    assert decode_untrusted(encode(mla, cross, [(0, cross.region_bytes)])).spec == cross
    for data in (bytearray(VALID), memoryview(VALID)):
        assert decode_untrusted(data) == peer
    assert "agent_metadata=<12 bytes>" in repr(peer) and "0x7f0000000000" in repr(peer)


@pytest.mark.parametrize(("data", "match"), [
    (b"", "not valid msgpack"),
    ("text", "must be bytes"),
    (None, "must be bytes"),
    (b"\xc1", "not valid msgpack"),
    (msgspec.msgpack.encode([1, 2, 3]), "no valid version field"),
    (msgspec.msgpack.encode({"version": 2}), "peer speaks wire version 2; this fkv speaks 1"),
    (msgspec.msgpack.encode({"version": "1"}), "no valid version field"),
    (VALID[:-1], "not valid msgpack"),
    (VALID + b"\x00", "not valid msgpack"),
])
def test_undecodable(data, match):
    with pytest.raises(FkvWireError, match=match):
        decode_untrusted(data)


@pytest.mark.parametrize(("changes", "match"), [
    ({"extra": 1}, r"unknown field `extra`"),
    ({"engine.surprise": 1}, r"unknown field `surprise`"),
    ({"spec": _DROP}, r"missing required field `spec`"),
    ({"engine.tp_size": 0}, r"Expected `int` >= 1 - at `\$.engine.tp_size`"),
    ({"engine.engine_id": "x" * 257}, r"length <= 256 - at `\$.engine.engine_id`"),
    ({"spec.num_layers": 70000}, r"<= 65536 - at `\$.spec.num_layers`"),
    ({"spec.block_size": -1}, r">= 1 - at `\$.spec.block_size`"),
    ({"spec.cross_layer": 1}, r"Expected `bool`, got `int` - at `\$.spec.cross_layer`"),
    ({"regions": [[0, 1]] * (MAX_REGIONS + 1)}, r"length <= 4096 - at `\$.regions`"),
    ({"regions": [[0, 1, 2]]}, r"Expected `array` of length 2"),
    ({"agent_metadata": "str"}, r"Expected `bytes`, got `str` - at `\$.agent_metadata`"),
    ({"spec.layout": "NDH"}, r"'layout' must be in \('NHD', 'HND'\)"),
    ({"spec.layout": "BLHNC"}, r"'cross_layer' must be True with the layout alias 'BLHNC'"),
    ({"spec.backend": "xformers"}, r"'backend' must be in"),
    ({"spec.dtype": "int4"}, r"'dtype' must be in"),
    ({"engine.tp_rank": 4}, r"'tp_rank' must be in \[0, tp_size=4\)"),
    ({"regions": REGIONS[:2]}, r"spec.num_regions=3 entries .* \(got 2\)"),
    ({"regions": [(0, 1)] * 3}, r"'regions\[0\]' holds 1 bytes; the spec's region is "
                                r"spec.region_bytes=16384"),
    ({"regions": [(2**64 - 100, SPEC.region_bytes)] * 3}, r"leaves the 64-bit address space"),
    ({"regions": [(4096, SPEC.region_bytes)] * 3}, r"'regions' overlap"),
])
def test_refused_with_a_reason(changes, match):
    with pytest.raises(FkvWireError, match=match):
        decode_untrusted(_raw(**changes))


def test_size_limit_checked_before_decoding():
    with pytest.raises(FkvWireError, match=f"the limit is {MAX_MESSAGE_BYTES}"):
        decode_untrusted(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_encode_validates():
    with pytest.raises(FkvError, match="'engine' must be an EngineDesc"):
        encode("e", SPEC, REGIONS)
    with pytest.raises(FkvError, match="'spec' must be a KVCacheSpec"):
        encode(ENGINE, {}, REGIONS)
    with pytest.raises(FkvError, match=r"'regions\[1\]' must be a pair of ints"):
        encode(ENGINE, SPEC, [REGIONS[0], (1.5, 2), REGIONS[2]])
    with pytest.raises(FkvError, match="'regions' must be a list"):
        encode(ENGINE, SPEC, None)
    with pytest.raises(FkvError, match="would be refused by the peer: .*length <= 256"):
        encode(EngineDesc(engine_id="e" * 300, tp_size=1, tp_rank=0, total_num_kv_heads=1),
               SPEC, REGIONS)
    with pytest.raises(FkvError, match="'agent_metadata' must be bytes"):
        encode(ENGINE, SPEC, REGIONS, agent_metadata="x")


def test_encode_takes_numpy_integers_and_refuses_bools():
    """Addresses often come out of numpy (``ndarray.ctypes.data``, sums of int64 offsets): the
    same bytes as Python ints; a bool is no address."""
    import numpy as np

    numpy_regions = [(np.int64(base), np.uint64(n)) for base, n in REGIONS]
    assert encode(ENGINE, SPEC, numpy_regions) == encode(ENGINE, SPEC, REGIONS)
    assert decode_untrusted(encode(ENGINE, SPEC, numpy_regions)).regions == tuple(REGIONS)
    for bad in ((True, SPEC.region_bytes), (REGIONS[1][0], np.float64(1.0)), (np.bool_(1), 2)):
        with pytest.raises(FkvError) as e:
            encode(ENGINE, SPEC, [REGIONS[0], bad, REGIONS[2]])
        assert str(e.value) == (f"'regions[1]' must be a pair of ints (base_address, nbytes) "
                                f"(got {bad!r})")


def test_no_pickle_anywhere_in_fkv():
    root = pathlib.Path(__file__).resolve().parents[1] / "fkv"
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill|marshal|shelve)\b", re.M)
    offenders = [str(p) for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


# -- fuzzing ------------------------------------------------------------------------------------

def _only_wire_errors(data: bytes) -> None:
    try:
        peer = decode_untrusted(data)
    except FkvWireError:
        return
    assert isinstance(peer, Peer)  # a mutation may still be a valid message: then it is a Peer


def test_every_truncation_and_bit_flip():
    # Deterministic sweep: each prefix, and each single-bit flip at every byte (~ 9 x len inputs).
    for n in range(len(VALID)):
        _only_wire_errors(VALID[:n])
    for i in range(len(VALID)):
        for bit in range(8):
            mutated = bytearray(VALID)
            mutated[i] ^= 1 << bit
            _only_wire_errors(bytes(mutated))
    assert 9 * len(VALID) >= 2000


_MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["version", "engine", "spec", "regions", "device_id", "agent_metadata",
                         "engine_id", "tp_size", "num_blocks", "layout", "x"]), inner, max_size=6),
    max_leaves=12)


@st.composite
def _mutations(draw) -> list[bytes]:
    """Eight inputs per example: random bytes, random msgpack, and edits of a valid message."""
    out = [draw(st.binary(max_size=64)), msgspec.msgpack.encode(draw(_MSGPACK_VALUES))]
    data = bytearray(VALID)
    for _ in range(6):
        op = draw(st.integers(0, 3))
        i = draw(st.integers(0, len(data)))
        if op == 0 and data:      # overwrite a byte
            data[min(i, len(data) - 1)] = draw(st.integers(0, 255))
        elif op == 1:             # insert bytes
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == 2:             # delete a run
            del data[i:i + draw(st.integers(1, 8))]
        else:                     # truncate
            data = data[:i]
        out.append(bytes(data))
    return out


@settings(max_examples=1300)
@given(_mutations())
def test_fuzz_only_wire_errors(inputs):
    # 1300 examples x 8 inputs = 10400 inputs (plus the sweep above).
    for data in inputs:
        _only_wire_errors(data)


@settings(max_examples=200)
@given(st.builds(dict, version=st.just(WIRE_VERSION), engine=_MSGPACK_VALUES, spec=_MSGPACK_VALUES,
                 regions=_MSGPACK_VALUES, device_id=_MSGPACK_VALUES, agent_metadata=_MSGPACK_VALUES))
def test_fuzz_well_versioned_garbage(message):
    _only_wire_errors(msgspec.msgpack.encode(message))


# -- holes found by mutation (2026-12-04) ---------------------------------------------------------

def test_regions_keep_the_order_the_peer_sent():
    """Region i is layer i's buffer: regions at descending addresses come back in the order sent
    (the overlap check sorts a copy, never the regions themselves)."""
    regions = list(reversed(REGIONS))
    assert decode_untrusted(_raw(regions=regions)).regions == tuple(regions)
    assert decode_untrusted(encode(ENGINE, SPEC, regions)).regions == tuple(regions)


def test_regions_may_touch_each_other_and_the_top_of_the_address_space():
    rb = SPEC.region_bytes
    adjacent = [(0, rb), (rb, rb), (2 * rb, rb)]
    assert decode_untrusted(_raw(regions=adjacent)).regions == tuple(adjacent)
    top = [(2**64 - (3 - i) * rb, rb) for i in range(3)]  # the last byte is 2**64 - 1
    assert decode_untrusted(_raw(regions=top)).regions == tuple(top)
    with pytest.raises(FkvWireError) as e:
        decode_untrusted(_raw(regions=[top[0], top[1], (2**64 - rb + 1, rb)]))
    assert str(e.value) == ("peer message refused: 'regions[2]' = (0xffffffffffffc001, 16384) "
                            "leaves the 64-bit address space")
    with pytest.raises(FkvWireError) as e:
        decode_untrusted(_raw(regions=[(0, rb), (rb, rb), (2 * rb - 1, rb)]))
    assert str(e.value) == "peer message refused: 'regions' overlap: [0x4000, +16384) and [0x7fff, ...)"


@pytest.mark.parametrize(("changes", "message"), [
    ({"device_id": 65537}, "Expected `int` <= 65536 - at `$.device_id`"),
    ({"agent_metadata": b"\0" * (16 << 20 | 1)},
     "Expected `bytes` of length <= 16777216 - at `$.agent_metadata`"),
    ({"ipc": {"host": "h", "device_uuid": "u", "handles": [], "offsets": [], "surprise": 1}},
     "Object contains unknown field `surprise` - at `$.ipc`"),
])
def test_more_fields_bounded(changes, message):
    with pytest.raises(FkvWireError) as e:
        decode_untrusted(_raw(**changes))
    assert str(e.value) == f"peer message is malformed: {message}"


def test_a_deeply_nested_message_is_a_wire_error():
    """msgspec raises RecursionError on a msgpack map nested 1000 deep: the one error type."""
    with pytest.raises(FkvWireError) as e:
        decode_untrusted(b"\x81\xa1a" * 1000 + b"\xc0")
    assert str(e.value) == ("peer message refused: RecursionError: maximum recursion depth "
                            "exceeded while deserializing an object")


def test_a_message_of_exactly_the_size_limit_is_decoded():
    with pytest.raises(FkvWireError) as e:
        decode_untrusted(b"\x00" * MAX_MESSAGE_BYTES)
    assert str(e.value) == "peer message has no valid version field: Expected `object`, got `int`"


@pytest.mark.parametrize("version", [0, WIRE_VERSION + 1, -1])
def test_an_older_or_newer_wire_version_is_refused(version):
    with pytest.raises(FkvWireError) as e:
        decode_untrusted(_raw(version=version))
    assert str(e.value) == (f"peer speaks wire version {version}; this fkv speaks {WIRE_VERSION}: "
                            f"run the same fkv version on both engines")


def test_encode_names_a_negative_base_address():
    """encode refuses a negative address itself, naming the region (not through the decoder)."""
    with pytest.raises(FkvError) as e:
        encode(ENGINE, SPEC, [REGIONS[0], (-5, SPEC.region_bytes), REGIONS[2]])
    assert str(e.value) == "'regions[1]' = (-0x5, 16384) leaves the 64-bit address space"
