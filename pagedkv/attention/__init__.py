"""The attention stack: the generic layer, its custom ops, the backend trio and the selector;
`pagedkv.attention.mla` holds the MLA layer, ops and backends."""

from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from pagedkv.attention.layer import Attention
from pagedkv.attention.mla import MLAAttention
from pagedkv.attention.ops import get_attention_context
from pagedkv.attention.selector import get_attn_backend, register_backend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionType",
    "CommonAttentionMetadata",
    "MLAAttention",
    "MultipleOf",
    "get_attention_context",
    "get_attn_backend",
    "register_backend",
]
