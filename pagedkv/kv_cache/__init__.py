"""The paged KV cache: specs and groups, the block pool, the per-request manager."""
