"""Linear layers and embeddings sharded over the tensor-parallel ranks (Megatron's layout, vLLM's names).

A decoder layer needs two all-reduces and nothing else:

    x (full, every rank)
      -> QKVParallelLinear     column-parallel: this rank's q / k / v heads  (no communication)
      -> attention on those heads
      -> RowParallelLinear     row-parallel: this rank's share of o_proj's inputs -> partial sums
      -> all-reduce                                                            (1)
      -> MergedColumnParallelLinear gate/up: this rank's columns of the MLP   (no communication)
      -> RowParallelLinear down_proj -> all-reduce                             (2)

Each layer keeps the full checkpoint name of its parameter (`weight`, `bias`) and gives it a
`weight_loader(param, checkpoint_tensor, shard_id)` that copies this rank's slice out of the
full Hugging Face tensor; `load_hf_weights` routes each checkpoint tensor to its loader. With one
rank every layer is the plain layer it replaces (`ReplicatedLinear` is whole on every rank anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv import batch_invariant
from pagedkv.config import get_current_engine_config
from pagedkv.distributed import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedkv.models.layers import head_layout, rank_heads

logger = logging.getLogger("pagedkv")

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
"""The Hugging Face names of the two tables `tie_word_embeddings` shares (Llama's and DeepSeek's)."""

ShardId = int | str | tuple[int, str] | None
"""Which piece of a fused parameter a checkpoint tensor fills: q/k/v or gate/up index, or for
stacked experts (expert id, "w1" | "w3" | "w2"); None for a parameter loaded whole."""

WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]
"""(parameter, whole checkpoint tensor, shard id) -> None: copies this rank's slice into the parameter."""


def _divide(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({tp_size}).")
    return total // tp_size


def check_checkpoint_shape(loaded: torch.Tensor, expected: Sequence[int], what: str) -> None:
    """The whole checkpoint tensor's shape, checked before a rank cuts its slice out of it (a
    slice of a larger tensor would fit the parameter and load wrong weights without a word)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"Shape mismatch loading {what}: checkpoint {tuple(loaded.shape)}, expected {tuple(expected)} "
            "from config.json's sizes. Does config.json belong to these weights?"
        )


def copy_checked(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if target.shape != source.shape:
        raise ValueError(
            f"Shape mismatch loading {what}: this rank's slice {tuple(source.shape)}, parameter {tuple(target.shape)}."
        )
    target.copy_(source)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """The loader of parameters every rank holds whole (the norms): copy, shapes checked."""
    copy_checked(param.data, loaded, "a whole parameter")


def set_weight_attrs(param: nn.Parameter, attrs: Mapping[str, Any]) -> None:
    """Attach attributes to a parameter (its `weight_loader`), as vllm/model_executor/utils.py does:
    `nn.Parameter` declares no such fields, so they are set, and read back, by name."""
    for key, value in attrs.items():
        setattr(param, key, value)


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The loader a layer attached to `param` (`set_weight_attrs`); a plain copy for a parameter without one."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Mapping[str, tuple[str, ShardId]],
    tied_embeddings: bool = False,
) -> None:
    """Copy Hugging Face-named tensors into `model`'s (fused, sharded) parameters: each parameter's
    `weight_loader` takes this rank's slice. Every parameter must be set, and every tensor used.

    `stacked` maps a part of a Hugging Face name to the fused parameter that holds it and its
    shard index there (".k_proj." -> (".qkv_proj.", 1)): a fused parameter is complete once every
    shard that `stacked` can send it has arrived. With `tied_embeddings` (the model's
    `config.tie_word_embeddings`) the embedding and the lm_head are loaded by `_load_tied`.
    """
    params = dict(model.named_parameters())  # a tied lm_head is listed once, as the embedding
    held: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        if tied_embeddings and hf_name in (EMBEDDING, LM_HEAD):
            held[hf_name] = tensor
            continue
        name, shard = hf_name, None
        for part, (fused, index) in stacked.items():
            if part in hf_name:
                name, shard = hf_name.replace(part, fused), index
                break
        if "rotary_emb.inv_freq" in name:  # old checkpoints save RoPE's buffer
            continue
        if name not in params:
            raise ValueError(f"Checkpoint tensor {hf_name!r} has no matching parameter in {type(model).__name__}.")
        param = params[name]
        try:
            weight_loader_of(param)(param, tensor, shard)
        except ValueError as error:
            raise ValueError(f"Checkpoint tensor {hf_name!r}: {error}") from error
        loaded.add(name if shard is None else f"{name}#{shard}")
    if held:
        _load_tied(model, held)
        loaded.add(EMBEDDING)
    expected = set()
    for n in params:
        shards = {index for fused, index in stacked.values() if fused in n}
        expected |= {f"{n}#{i}" for i in shards} if shards else {n}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"Checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}.")


def _load_tied(model: nn.Module, held: dict[str, torch.Tensor]) -> None:
    """The embedding and lm_head of a model built tied, read as transformers reads them: either
    tensor alone fills the shared table; both, equal, too. Both and different means the file
    does not hold a tied model whatever its config says: transformers then unties them (with a
    warning), and so does this, setting `model.config.tie_word_embeddings` to False."""
    embedding = model.get_parameter(EMBEDDING)
    embed, head = held.get(EMBEDDING), held.get(LM_HEAD)
    if embed is not None and head is not None and not torch.equal(embed, head):
        logger.warning(
            "tie_word_embeddings is set but the checkpoint's %s and %s differ: loading them untied, as "
            "transformers does (set tie_word_embeddings to false in config.json to silence this).",
            EMBEDDING,
            LM_HEAD,
        )
        lm_head = model.get_submodule(LM_HEAD.rsplit(".", 1)[0])
        assert isinstance(lm_head, ParallelLMHead), f"{LM_HEAD} of a tied model is a {type(lm_head).__name__}"
        lm_head.weight = nn.Parameter(torch.empty_like(embedding), requires_grad=False)
        set_weight_attrs(lm_head.weight, {"weight_loader": lm_head.weight_loader})
        lm_head.weight_loader(lm_head.weight, head)
        # Any: a plain attribute (the model's config dataclass), which mypy reads through
        # nn.Module.__getattr__ as a Tensor | Module.
        config: Any = model.config
        config.tie_word_embeddings = False
    table = embed if embed is not None else head
    assert table is not None, "load_hf_weights calls this only once it holds one of the two"
    weight_loader_of(embedding)(embedding, table, None)


def linear_op() -> Callable[..., torch.Tensor]:
    """F.linear, or its batch-invariant twin when the engine being built asks for that mode."""
    return batch_invariant.linear if get_current_engine_config().model_config.batch_invariant else F.linear


class _ParallelLinear(nn.Module):
    """A weight [out_rows, in_cols] of this rank, an optional bias, and the loader they share."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # For the repr: the rank is the active group's only while the engine builds or runs.
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        self.linear = linear_op()
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp_rank={self.tp_rank}/{self.tp_size}"
        )


class ReplicatedLinear(_ParallelLinear):
    """y = x W^T with the whole W on every rank: a small projection whose whole output every rank
    needs (MLA's down-projections q_a_proj and kv_a_proj_with_mqa)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        copy_checked(param.data, loaded, "ReplicatedLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T with W's output rows split over the ranks: each rank computes its slice of y.

    Row block `rank` of each output piece lives on rank `rank`; a layer with several pieces
    (`output_sizes`, fused gate/up or q/k/v) splits every piece separately, so each rank's
    weight is [piece 0 slice; piece 1 slice; ...] and its output splits the same way.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        tp = get_tp_size()
        self.output_sizes = [_divide(size, tp, "output size") for size in output_sizes]
        super().__init__(input_size, sum(self.output_sizes), bias)

    def _rows(self, shard_id: int | str) -> tuple[int, int, int, int]:
        """(offset in this rank's weight, rows, first row in the full checkpoint piece, the full
        piece's rows)."""
        shard_id = int(shard_id)
        size = self.output_sizes[shard_id]
        return sum(self.output_sizes[:shard_id]), size, get_tp_rank() * size, size * get_tp_size()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None and len(self.output_sizes) > 1:
            raise ValueError(f"{type(self).__name__} loads its {len(self.output_sizes)} pieces one at a time.")
        if isinstance(shard_id, tuple):  # (expert id, "w1" | "w3" | "w2") is FusedMoE's
            raise TypeError(f"{type(self).__name__} takes a piece index as shard id, not {shard_id!r}.")
        offset, rows, start, full_rows = self._rows(0 if shard_id is None else shard_id)
        check_checkpoint_shape(loaded, (full_rows, *param.shape[1:]), type(self).__name__)
        copy_checked(param.data.narrow(0, offset, rows), loaded.narrow(0, start, rows), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused in one matmul (the MLP's gate and up: shard 0, 1)."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections fused, with this rank's query heads and KV heads (`head_layout`), as
    vllm/model_executor/layers/linear.py's QKVParallelLinear splits them.

    Query heads split evenly. KV heads split too when there are at least as many as ranks;
    otherwise each rank holds one KV head, the one its query heads attend to, so a KV head is
    replicated on tp / num_kv_heads ranks:

        8 q / 2 kv heads, tp 4:   rank 0: q 0-1, kv 0 | rank 1: q 2-3, kv 0 | rank 2: q 4-5, kv 1 | ...
    """

    def __init__(
        self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ) -> None:
        layout = head_layout(total_num_heads, total_num_kv_heads, get_tp_size())
        self.head_size, self.layout = head_size, layout
        self.total_sizes = [total_num_heads * head_size] + [total_num_kv_heads * head_size] * 2  # in the checkpoint
        self.output_sizes = [layout.num_heads * head_size] + [layout.num_kv_heads * head_size] * 2
        # The sizes are per rank already: skip ColumnParallelLinear's even split.
        _ParallelLinear.__init__(self, hidden_size, sum(self.output_sizes), bias)

    def _rows(self, shard_id: int | str) -> tuple[int, int, int, int]:
        index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id
        heads = rank_heads(self.layout, get_tp_rank())[min(index, 1)]  # k and v: the same KV heads
        return (
            sum(self.output_sizes[:index]),
            self.output_sizes[index],
            heads.start * self.head_size,
            self.total_sizes[index],
        )


class RowParallelLinear(_ParallelLinear):
    """y = x W^T with W's input columns split: each rank multiplies its slice of x (the output of a
    column-parallel layer, already split) and the partial sums are all-reduced. The bias is added
    once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(_divide(input_size, get_tp_size(), "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if param.dim() == 1:  # the bias: whole on every rank
            copy_checked(param.data, loaded, "RowParallelLinear bias")
            return
        cols = self.in_features
        check_checkpoint_shape(loaded, (self.out_features, cols * get_tp_size()), "RowParallelLinear")
        copy_checked(param.data, loaded.narrow(1, get_tp_rank() * cols, cols), "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tensor_model_parallel_all_reduce(self.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows: rank r holds ids [r * per_rank, (r + 1) * per_rank).

    A rank looks up the ids it holds, writes zeros for the others, and the all-reduce assembles
    each row from the one rank that had it. The vocabulary is padded up to a multiple of the rank
    count; padding rows are never looked up (and their logits are cut off by `ParallelLMHead`).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # Kept, not asked again in forward: the layer is built for one rank count, and forward
        # reading the engine config would also make torch.compile trace that lookup.
        self.tp_size = get_tp_size()
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.start = get_tp_rank() * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        rows = max(0, min(self.per_rank, self.num_embeddings - self.start))
        if loaded.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"Shape mismatch loading the vocabulary: checkpoint {tuple(loaded.shape)}, expected "
                f"{(self.num_embeddings, self.embedding_dim)}."
            )
        param.data[:rows].copy_(loaded[self.start : self.start + rows])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows {self.start}-{self.start + self.per_rank - 1} here"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding (so the two can be
    tied): each rank computes the logits of its ids; an all-gather puts them side by side."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.linear = linear_op()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = tensor_model_parallel_all_gather(self.linear(hidden_states, self.weight))
        return logits[..., : self.num_embeddings]
