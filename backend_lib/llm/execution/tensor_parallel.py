"""Tensor parallelism (Megatron-style) of the Llama-family forward across the ranks of a
torch.distributed process group: gloo on CPU, NCCL on CUDA.

Each rank holds a slice of every projection and runs the one forward on it:

- q/k/v and gate/up are column-parallel: a rank keeps its heads' rows (its share of the
  intermediate rows), so attention runs on its own heads over its own KV cache. With fewer KV
  heads than ranks each KV head is replicated on `size // num_kv_heads` ranks.
- o_proj and down_proj are row-parallel: a rank keeps the matching input columns and the partial
  outputs are summed by one all-reduce each; their biases load on rank 0 only.
- The embedding is vocabulary-parallel (a rank looks up the ids in its rows, zeros elsewhere,
  then all-reduce); the lm_head keeps the same rows, and its logits are gathered for sampling, so
  every rank samples from the same full-vocabulary logits.

Checkpoint tensors are sliced as they load (`shard`), never held whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from backend_lib.config import ConfigError


class Sharded(Protocol):
    """The shape fields tensor parallelism splits (LlamaArgs has them)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int
    vocab_size: int


_LORA_PARENT = {p: "self_attn" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
_LORA_PARENT |= {p: "mlp" for p in ("gate_proj", "up_proj", "down_proj")}
"""The projections an adapter shards with, and their module in the checkpoint's names."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """The torch.distributed process group (None: the default group; unused when size is 1)."""

    @classmethod
    def from_process_group(cls, size: int, pipeline_stages: int = 1) -> TensorParallel:
        """This process's tensor-parallel group of `size` ranks in torch.distributed's default
        group, which must be initialized with exactly size x `pipeline_stages` ranks (ConfigError
        naming tensor_parallel_size otherwise). With several stages each stage's ranks form their
        own group (ranks stage * size .. stage * size + size - 1, pipeline_parallel.py's order);
        every rank creates every group, in the same order, as torch.distributed requires. One rank
        in all needs no process group."""
        world = size * pipeline_stages
        if world == 1:
            return cls()
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "tensor_parallel_size",
                size,
                "needs a torch.distributed process group of tensor_parallel_size x "
                "pipeline_parallel_size ranks (one process per rank)",
            )
        if dist.get_world_size() != world:
            raise ConfigError(
                "tensor_parallel_size",
                size,
                f"the process group has {dist.get_world_size()} ranks, not tensor_parallel_size "
                f"x pipeline_parallel_size = {world}",
            )
        rank = dist.get_rank()
        if size == 1:
            return cls()
        if pipeline_stages == 1:
            return cls(rank, size)
        groups = [
            dist.new_group(list(range(stage * size, (stage + 1) * size)))
            for stage in range(pipeline_stages)
        ]
        return cls(rank % size, size, groups[rank // size])

    # --- shapes -------------------------------------------------------------------------------

    def check(self, args: Sharded) -> None:
        """ConfigError naming tensor_parallel_size for a shape the ranks cannot split evenly."""
        kv = args.num_kv_heads
        problems = [
            (args.num_heads % self.size, f"{args.num_heads} attention heads"),
            (kv % self.size if kv >= self.size else self.size % kv, f"{kv} KV heads"),
            (args.intermediate_size % self.size, f"MLP width {args.intermediate_size}"),
            (args.vocab_size % self.size, f"vocabulary of {args.vocab_size}"),
        ]
        for remainder, what in problems:
            if remainder:
                raise ConfigError(
                    "tensor_parallel_size", self.size, f"does not divide the model's {what}"
                )

    def local_args(self, args):
        """`args` with this rank's head counts and MLP width (the vocabulary stays whole: the
        engine checks token ids against it)."""
        if self.size == 1:
            return args
        self.check(args)
        return replace(
            args,
            num_heads=args.num_heads // self.size,
            num_kv_heads=max(1, args.num_kv_heads // self.size),
            intermediate_size=args.intermediate_size // self.size,
        )

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first, count) of this rank's vocabulary rows."""
        count = vocab_size // self.size
        return self.rank * count, count

    def _kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's KV heads; one replicated head with fewer heads than ranks."""
        if num_kv_heads >= self.size:
            count = num_kv_heads // self.size
            return self.rank * count, count
        return self.rank // (self.size // num_kv_heads), 1

    # --- checkpoint tensors -------------------------------------------------------------------

    def shard(self, name: str, tensor: torch.Tensor, args: Sharded) -> torch.Tensor:
        """This rank's slice of Llama-family checkpoint tensor `name` (HF names; `args` the whole
        model's shape). Norms and anything unnamed here are replicated."""
        if self.size == 1:
            return tensor
        d = args.head_dim
        if ".self_attn.q_proj." in name:
            heads = args.num_heads // self.size
            return tensor.narrow(0, self.rank * heads * d, heads * d)
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            first, count = self._kv_heads(args.num_kv_heads)
            return tensor.narrow(0, first * d, count * d)
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            rows = args.intermediate_size // self.size
            return tensor.narrow(0, self.rank * rows, rows)
        if ".self_attn.o_proj." in name or ".mlp.down_proj." in name:
            return self._row_parallel_shard(name, tensor)
        if name == "model.embed_tokens.weight" or name.startswith("lm_head."):
            # The head's rows are the vocabulary's, its staging tensors' too when it is
            # pre-quantized (a GGUF's Q6_K head: packed words, scales, minimums [vocab, ...]).
            first, count = self.vocab_rows(args.vocab_size)
            return tensor.narrow(0, first, count)
        return tensor

    def shard_lora(
        self,
        layer: int,
        projection: str,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        args: Sharded,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a LoRA module (A [r, in], B [out, r]) on `projection` (PEFT's
        name, e.g. q_proj) of layer `layer`: of a column-parallel projection B's rows, as its
        weight's rows; of a row-parallel one (o_proj, down_proj) A's columns, as its weight's
        columns, so each rank adds the delta of its own input columns before the all-reduce. The
        other factor stays whole."""
        if self.size == 1:
            return lora_a, lora_b
        if projection not in _LORA_PARENT:
            raise ValueError(f"a LoRA module on {projection} cannot be sharded")
        name = f"model.layers.{layer}.{_LORA_PARENT[projection]}.{projection}.weight"
        if projection in ("o_proj", "down_proj"):
            return self.shard(name, lora_a, args), lora_b
        return lora_a, self.shard(name, lora_b, args)

    def _row_parallel_shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's input columns of a row-parallel projection's tensor: a float weight, or
        a pre-quantized layer's staging tensors (checkpoint_quantization/scheme.py: packed int
        words, per-group scales and zero points, all [out, ...] along the inputs)."""
        if name.endswith(".bias"):  # added once, after the sum
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if name.endswith((".scales", ".zeros")) and tensor.shape[1] == 1:
            return tensor  # one scale per output row (channel or tensor strategy): all ranks'
        if tensor.shape[1] % self.size:
            raise ConfigError(
                "tensor_parallel_size",
                self.size,
                f"cannot split the inputs of {name} {list(tensor.shape)}: a quantized layer's "
                "ranks must each hold whole groups (its group size must divide in_features / "
                "tensor_parallel_size)",
            )
        cols = tensor.shape[1] // self.size
        return tensor.narrow(1, self.rank * cols, cols)

    # --- collectives --------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[R, C] on each rank -> [R, size * C], ranks' columns in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows of `weight` [vocab / size, hidden] for the
        ids it holds, zeros for the others, summed over the ranks."""
        first, count = self.vocab_rows(vocab_size)
        local = input_ids - first
        outside = (local < 0) | (local >= count)
        hidden = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(hidden)


NO_TENSOR_PARALLEL = TensorParallel()
"""One rank: every method is the identity."""
