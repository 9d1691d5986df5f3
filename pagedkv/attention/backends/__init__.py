"""Attention backends: TORCH_REF (the oracle), TRITON_ATTN and FLASH_ATTN."""
