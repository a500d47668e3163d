"""``fkv.ops._spec``: the exact constexprs and strides each layout hands the kernels, and the exact
refusals of its host-side checks (mutation audit: values a kernel test cannot tell apart, such as
MLA's unused strides or a one-head NHD layout, are pinned here)."""

from __future__ import annotations

import pytest
import torch

import fkv
from fkv.errors import FkvError
from fkv.ops._spec import (cache_constexprs, cache_strides, check_cache, check_scale_values,
                           join_kv_views)

ONE_HEAD = fkv.KVCacheSpec(layout="NHD", num_blocks=6, block_size=4, num_kv_heads=1, head_size=8,
                           num_layers=2)
CASES = {
    # one head: NHD's head and token strides are equal (8), and NHD is still not heads-outer
    "nhd-1": (ONE_HEAD, (False, False, False, 1),
              dict(stride_block=64, stride_kv=32, stride_token=8, stride_head=8, stride_dim=1)),
    "hnd-1": (ONE_HEAD.evolve(layout="HND"), (True, False, False, 1),
              dict(stride_block=64, stride_kv=32, stride_token=8, stride_head=32, stride_dim=1)),
    "hnd-3": (ONE_HEAD.evolve(layout="HND", num_kv_heads=3), (True, False, False, 3),
              dict(stride_block=192, stride_kv=96, stride_token=8, stride_head=32, stride_dim=1)),
    # MLA: one latent per token, no K/V or head axis: both strides 0
    "mla": (ONE_HEAD.evolve(backend="mla"), (False, True, False, 1),
            dict(stride_block=32, stride_kv=0, stride_token=8, stride_head=0, stride_dim=1)),
    "flash-fp8": (ONE_HEAD.evolve(backend="flash_attn", num_kv_heads=3, dtype="float8_e4m3fn"),
                  (False, False, True, 3),
                  dict(stride_block=96, stride_kv=576, stride_token=24, stride_head=8, stride_dim=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_constexprs_and_strides_of_each_layout_are_exact(case: str) -> None:
    spec, (heads_outer, is_mla, fp8, heads), strides = CASES[case]
    assert cache_constexprs(spec) == {"HEADS_OUTER": heads_outer, "IS_MLA": is_mla,
                                      "CACHE_FP8": fp8, "BLOCK_SIZE": 4, "NUM_HEADS": heads,
                                      "HEAD_SIZE": 8}
    assert dict(cache_strides(spec)) == strides


def test_check_cache_names_the_shape_and_the_spec() -> None:
    with pytest.raises(FkvError) as e:
        check_cache(torch.zeros(2, 3), ONE_HEAD, "src[1]")
    assert str(e.value) == (f"'src[1]' has shape (2, 3) but spec {ONE_HEAD!r} has logical shape "
                            f"(6, 2, 4, 1, 8); pass one layer's view from fkv.allocate(spec)")


def test_scale_check_names_the_first_bad_scale_and_skips_none() -> None:
    with pytest.raises(FkvError) as e:
        check_scale_values(k_scale=torch.tensor(0.0), v_scale=torch.tensor(float("nan")))
    assert str(e.value) == "'k_scale' must be a finite scale > 0 (got 0.0)"
    with pytest.raises(FkvError) as e:
        check_scale_values(k_scale=None, v_scale=torch.tensor([-2.0]))
    assert str(e.value) == "'v_scale' must be a finite scale > 0 (got -2.0)"
    assert check_scale_values() is None
    assert check_scale_values(k_scale=None, v_scale=None) is None


def test_join_kv_views_refuses_a_spec_that_is_not_one() -> None:
    cache = fkv.allocate(ONE_HEAD)[0]
    with pytest.raises(FkvError) as e:
        join_kv_views((cache[:, 0], cache[:, 1]), "NHD")
    assert str(e.value) == "'spec' must be a KVCacheSpec (got str)"


def test_join_kv_views_ignores_the_stride_of_a_size_one_axis() -> None:
    """Halves whose one-head axis has another stride (as a reshape may leave it) are still the
    spec's halves: the joined view is the layer view with the spec's strides."""
    cache = fkv.allocate(ONE_HEAD)[0]
    k, v = cache[:, 0], cache[:, 1]
    odd = [t.as_strided(t.shape, (64, 8, 999, 1), t.storage_offset()) for t in (k, v)]
    joined = join_kv_views(tuple(odd), ONE_HEAD)
    assert joined.shape == cache.shape and joined.stride() == cache.stride()
    assert joined.data_ptr() == cache.data_ptr()
