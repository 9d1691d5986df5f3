"""The two MLA custom ops: `unified_mla_kv_cache_update` and `unified_mla_attention_with_output`.

They do what the MHA ops do (pagedkv/attention/ops.py), with MLA's inputs: the new tokens'
latents and rope keys instead of K and V. Both resolve the layer, its cache, metadata and
slot mapping by name in the forward context, so torch.compile sees one opaque node each and
can split the graph there.
"""

from __future__ import annotations

from pagedkv.attention.ops import register_attention_ops

# The MHA ops' functions serve as they are: the latents and rope keys take K's and V's places, and the
# layer's impl knows what they are. MLA gets ops of its own names (as vLLM's unified_mla_* ops), so that
# a compiled graph says which kind of layer it splits at.
register_attention_ops("unified_mla_kv_cache_update", "unified_mla_attention_with_output")
