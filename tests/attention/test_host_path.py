"""Host-side caches of the TRITON_ATTN launch path (issue 9, point 5): reused, never stale."""

from __future__ import annotations

import torch

from pagedkv.attention.backends.triton_attn import TritonAttentionImpl
from pagedkv.kernels import SplitKVWorkspace


def test_workspace_views_follow_the_requested_rows() -> None:
    workspace = SplitKVWorkspace(rows=12, num_q_heads=2, head_size=16, device="cpu")
    first = workspace.views(num_tokens=2, num_splits=3)
    assert workspace.views(num_tokens=2, num_splits=3)[0] is first[0]  # every layer of a step: no new view
    for num_tokens, num_splits in [(3, 4), (1, 5), (2, 3)]:
        out, lse = workspace.views(num_tokens, num_splits)
        assert out.shape == (num_tokens * num_splits, 2, 16) and lse.shape == (num_tokens * num_splits, 2)
        assert out.data_ptr() == workspace.partial_out.data_ptr()


def test_kv_views_follow_the_bound_cache() -> None:
    impl = TritonAttentionImpl(
        num_heads=4, head_size=16, scale=0.25, num_kv_heads=2, sliding_window=None, kv_cache_dtype=torch.float32
    )
    cache_a, cache_b = torch.randn(2, 3, 4, 2, 16), torch.randn(2, 3, 4, 2, 16)
    k, v = impl._kv_views(cache_a)
    assert torch.equal(k, cache_a[0]) and torch.equal(v, cache_a[1]) and k.data_ptr() == cache_a[0].data_ptr()
    assert impl._kv_views(cache_a)[0] is k  # the same cache: the same view objects
    k, v = impl._kv_views(cache_b)  # another cache (a new engine's): new views, not stale ones
    assert k.data_ptr() == cache_b[0].data_ptr() and v.data_ptr() == cache_b[1].data_ptr()
