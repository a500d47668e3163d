"""``fkv.ops.graph_primer``: the start-up recipe for CUDA graphs. Without CUDA it refuses with
an FkvError; on a GPU the graphs captured inside it replay the same bytes as the reference, and
the primer itself has run exactly once when the block ends (its effect on replay speed is a
benchmark's business: bench/experiments/graph_state.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fkv import FkvError
from fkv.ops import graphs
from fkv.ops.write import write_kv

# the write tests' helpers (pytest runs with --import-mode=importlib)
sys.path.insert(0, str(Path(__file__).parent))
from test_write import assert_replay_reads_new_inputs, decode_write_inputs  # noqa: E402


def test_graph_primer_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FkvError) as e, graphs.graph_primer():
        pass
    assert str(e.value) == ("graph_primer: needs a CUDA device "
                            "(torch.cuda.is_available() is False)")


def test_graph_primer_refuses_a_device_that_is_not_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(FkvError) as e, graphs.graph_primer("cpu"):
        pass
    assert str(e.value) == "graph_primer: device must be a CUDA device (got 'cpu')"


def test_graph_primer_names_a_failing_driver_call() -> None:
    with pytest.raises(FkvError) as e:
        graphs._Primer._check("cuGraphLaunch", 201)
    assert str(e.value) == "graph_primer: cuGraphLaunch returned CUDA error 201, expected 0 (CUDA_SUCCESS)"
    graphs._Primer._check("cuGraphLaunch", 0)  # success passes


def test_the_public_name() -> None:
    import fkv.ops

    assert fkv.ops.graph_primer is graphs.graph_primer


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_graphs_captured_under_the_primer_replay_the_reference_bytes(layout: str) -> None:
    spec, key, value, slots, cache = decode_write_inputs(layout)  # compiled outside the capture
    kept = len(graphs._PRIMERS)
    with graphs.graph_primer():
        primer = graphs._PRIMERS[-1]
        assert len(graphs._PRIMERS) == kept + 1 and float(primer.x) == 0.0  # not launched yet
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            write_kv(key, value, cache, slots, spec, validate=False)
    assert float(primer.x) == 1.0  # launched once, on exit
    assert_replay_reads_new_inputs(graph, spec, key, value, cache, slots)
    assert float(primer.x) == 1.0  # replaying the captured graphs does not run the primer


@pytest.mark.gpu
def test_graph_primer_does_not_launch_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), graphs.graph_primer():
        primer = graphs._PRIMERS[-1]
        raise RuntimeError("boom")
    torch.cuda.synchronize()
    assert float(primer.x) == 0.0


def test_the_primer_is_instantiated_for_device_launch() -> None:
    """``cuGraphInstantiateWithFlags`` gets CUDA's CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH (4 in
    cuda.h; 1 is auto-free, 2 upload, 8 node priority): the flag the measured recipe needs, which
    no replay's bytes reveal."""
    assert graphs._DEVICE_LAUNCH == 4
