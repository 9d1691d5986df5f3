"""Multi-head latent attention (DeepSeek-V2/V3): the layer, its ops and its backends."""

from pagedkv.attention.mla import ops  # registers torch.ops.pagedkv.unified_mla_*, which MLAAttention calls
from pagedkv.attention.mla.common import MLADims, split_decodes_and_prefills
from pagedkv.attention.mla.layer import MLAAttention

__all__ = ["MLAAttention", "MLADims", "ops", "split_decodes_and_prefills"]
