"""Pipeline parallelism of the Llama-family forward: the decoder layers split into stages, each
stage `tensor_parallel_size` ranks of one torch.distributed world (gloo on CPU, NCCL on CUDA).

Ranks are numbered tensor-parallel rank innermost, as vLLM does: global rank = stage *
tensor_parallel_size + tp_rank, so a stage is a node's GPUs when a node holds one stage.

Per step every stage runs the same batch (rank 0 broadcasts it to all ranks, execution/
workers.py). Stage 0 embeds the tokens and runs its layers, then sends the hidden states and the
residual stream to stage 1, and so on. The last stage applies the final norm to the rows that
are scored and sends them back to stage 0, which holds the lm_head beside the embedding (one home
for the vocabulary, tied or not) and so samples where the scheduler runs. Each tensor-parallel
rank exchanges with the same tp_rank of the next stage: after the row-parallel all-reduce every
rank of a stage holds the whole activations.

The shapes of every message follow from the step itself (its token count, its scored rows), so a
receiver allocates exactly and no shape is sent. Stages run one after the other (no micro-batch
overlap): correct first; on this project's CPUs a stage has nothing else to run meanwhile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend_lib.config import ConfigError

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The decoder layers of `stage`: num_layers // num_stages each, one more for each of the
    last num_layers % num_stages stages (stage 0 also holds the embedding and lm_head)."""
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    first = sum(sizes[:stage])
    return range(first, first + sizes[stage])


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage of the pipeline, and its peers in the neighbouring stages."""

    stage: int = 0
    size: int = 1
    """Stages in the pipeline (pipeline_parallel_size)."""
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> PipelineStage:
        return cls(rank // tp_size, pp_size, rank % tp_size, tp_size)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, num_layers: int) -> range:
        """This stage's decoder layers; ConfigError naming pipeline_parallel_size when there are
        fewer layers than stages."""
        if num_layers < self.size:
            raise ConfigError(
                "pipeline_parallel_size",
                self.size,
                f"more stages than the model's {num_layers} decoder layers",
            )
        return stage_layers(num_layers, self.stage, self.size)

    def holds(self, name: str, num_layers: int) -> bool:
        """Whether checkpoint tensor `name` (HF names) belongs on this stage: its own layers'
        tensors; the embedding and lm_head on stage 0; the final norm on the last stage."""
        if self.size == 1:
            return True
        match = _LAYER_NAME.match(name)
        if match is not None:
            return int(match.group(1)) in self.layers(num_layers)
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return self.first
        if name.startswith("model.norm."):
            return self.last
        return True

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    # --- activations --------------------------------------------------------------------------

    def send_forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """To the next stage: hidden and residual [T, hidden_size], as one [2, T, hidden_size]."""
        dist.send(torch.stack((hidden, residual)), self._peer(self.stage + 1))

    def recv_forward(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the previous stage: (hidden, residual) [T, hidden_size] each."""
        both = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        dist.recv(both, self._peer(self.stage - 1))
        return both[0], both[1]

    def send_output(self, hidden: torch.Tensor) -> None:
        """From the last stage to stage 0: the final-normed states of the scored rows [R, H]."""
        dist.send(hidden.contiguous(), self._peer(0))

    def recv_output(
        self, num_rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """On stage 0: the last stage's final-normed states [R, hidden_size]."""
        hidden = torch.empty((num_rows, hidden_size), dtype=dtype, device=device)
        dist.recv(hidden, self._peer(self.size - 1))
        return hidden


NO_PIPELINE = PipelineStage()
"""One stage: every layer, the embedding, the norm and the lm_head."""
