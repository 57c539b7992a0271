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


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """The torch.distributed process group (None: the default group; unused when size is 1)."""

    @classmethod
    def from_process_group(cls, size: int) -> TensorParallel:
        """A group of `size` ranks: this process's rank in torch.distributed's default group,
        which must be initialized with exactly `size` ranks (ConfigError naming
        tensor_parallel_size otherwise). Size 1 needs no process group."""
        if size == 1:
            return cls()
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "tensor_parallel_size",
                size,
                "needs a torch.distributed process group of that many ranks (one process per rank)",
            )
        if dist.get_world_size() != size:
            raise ConfigError(
                "tensor_parallel_size",
                size,
                f"the process group has {dist.get_world_size()} ranks",
            )
        return cls(dist.get_rank(), size)

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
            if name.endswith(".bias"):  # added once, after the sum
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            cols = tensor.shape[1] // self.size
            return tensor.narrow(1, self.rank * cols, cols)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            first, count = self.vocab_rows(args.vocab_size)
            return tensor.narrow(0, first, count)
        return tensor

    # --- collectives --------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks each rank's memory allows)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

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


def reduced(projection, tp: TensorParallel):
    """A row-parallel projection: `projection` then the all-reduce of its partial outputs."""
    if tp.size == 1:
        return projection

    def call(x: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(projection(x))

    return call
