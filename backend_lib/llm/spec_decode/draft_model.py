"""DraftModel: the proposer of `speculative_config` method draft_model. A smaller checkpoint with
the target's tokenizer decodes each speculating sequence's drafts greedily, on the engine's
thread and device (rank 0's process), with a paged KV cache of its own.

Per proposal, batched over the speculating sequences: one forward catches each sequence's draft
cache up with its tokens (the whole prompt the first time; afterwards the tokens verified since,
usually the accepted drafts and the bonus token) and gives the first draft; then k - 1 one-token
forwards give the others. Drafts are the draft model's argmax: the verifier then treats each as
drawn with probability one (vLLM's draft proposer does the same), which keeps sampling exact.

The cache is kept per sequence between steps. Its positions that hold rejected drafts are found
by comparing with the sequence's tokens and simply rewritten; a sequence that leaves the running
set (finished, preempted) frees its blocks. The pool has as many blocks as the target's, so it
holds what the target holds; when it runs short a sequence just goes undrafted that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from backend_lib.checkpoint import load_tokenizer, resolve_model_path
from backend_lib.config import ConfigError
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.execution.flat_batch import flat_batch
from backend_lib.llm.execution.kv_pool import KVCacheSpec, KVPool
from backend_lib.llm.execution.loader import CheckpointInfo, load_model, read_checkpoint_info
from backend_lib.llm.execution.model_runner import DraftLoader, ModelSettings
from backend_lib.llm.speculative_config import SpeculativeConfig
from backend_lib.quantization import check_quantization, resolve_quantization

FIELD = "speculative_config.model"
QUANTIZATION_FIELD = "speculative_config.quantization"


def draft_checkpoint(
    config: SpeculativeConfig | None,
    target: CheckpointInfo,
    tokenizer: PreTrainedTokenizerBase,
    base_dir: str | Path | None,
) -> CheckpointInfo | None:
    """The draft checkpoint of a draft_model config (None for any other), found as the target's
    `model` is (relative to `base_dir`, default the working directory) and checked to speak the
    target's tokenizer: the same vocabulary size, token strings and EOS. ConfigError naming
    speculative_config.model otherwise."""
    if config is None or config.method != "draft_model":
        return None
    spec = str(config.model)
    try:
        info = read_checkpoint_info(resolve_model_path(spec, Path(base_dir or Path.cwd())))
    except ConfigError as error:
        raise ConfigError(FIELD, spec, error.reason) from None
    mismatch = _tokenizer_mismatch(info, target, load_tokenizer(info.model_dir), tokenizer)
    if mismatch is not None:
        raise ConfigError(
            FIELD, spec, f"the draft model must use the target's tokenizer: {mismatch}"
        )
    return info


def draft_model_loader(
    config: SpeculativeConfig | None,
    target: CheckpointInfo,
    tokenizer: PreTrainedTokenizerBase,
    base_dir: str | Path | None,
) -> DraftLoader | None:
    """What the runner calls to load the draft model of a draft_model config under its own
    settings (None for any other config); the checkpoint is found and checked now
    (`draft_checkpoint`)."""
    info = draft_checkpoint(config, target, tokenizer, base_dir)
    if info is None:
        return None
    assert config is not None
    return partial(DraftModel, info, quantization=config.quantization)


def _tokenizer_mismatch(
    draft: CheckpointInfo,
    target: CheckpointInfo,
    draft_tokenizer: PreTrainedTokenizerBase,
    tokenizer: PreTrainedTokenizerBase,
) -> str | None:
    draft_vocab, vocab = draft.hf_config.get("vocab_size"), target.hf_config.get("vocab_size")
    if draft_vocab != vocab:
        return f"its vocab_size is {draft_vocab}, the target's {vocab}"
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        return "its tokenizer maps tokens to other ids"
    if draft.eos_token_ids != target.eos_token_ids:
        return f"its EOS tokens are {list(draft.eos_token_ids)}, the target's {list(target.eos_token_ids)}"
    return None


def _draft_quantization(
    setting: str | None, checkpoint: CheckpointInfo, device: torch.device
) -> str:
    """The draft's at-load quantization mode for its `quantization` setting, checked as the
    target's is; errors name speculative_config.quantization."""
    prequantized = checkpoint.quantization
    try:
        mode = resolve_quantization(
            setting or "auto", None if prequantized is None else prequantized.describe()
        )
        check_quantization(mode, device)
    except ConfigError as error:
        raise ConfigError(QUANTIZATION_FIELD, setting, error.reason) from None
    return mode


@dataclass
class _DraftCache:
    """One sequence's entries in the draft cache."""

    block_table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    """The tokens whose K/V the cache holds, at positions 0 .. len - 1."""
    num_final: int = 0
    """How many of those were the sequence's own tokens when written (the rest were drafts)."""

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading cached entries match the sequence's `token_ids`."""
        n = self.num_final
        for cached, actual in zip(self.token_ids[n:], token_ids[n:], strict=False):
            if cached != actual:
                break
            n += 1
        return n


class DraftModel:
    """The draft checkpoint's model and KV pool; proposes greedy drafts for a batch."""

    def __init__(
        self,
        checkpoint: CheckpointInfo,
        settings: ModelSettings,
        quantization: str | None = None,
    ):
        """Load the weights under the target's `settings` (dtype, kernels, max_model_len, block
        size, its 4-bit layers' int8 activations); the KV pool comes later, `allocate`: the
        target sizes both pools together. ConfigError naming speculative_config.model when the
        draft's positions end before max_model_len. `quantization`:
        speculative_config.quantization (None: auto), ConfigError naming it where it cannot
        apply."""
        max_model_len, device = settings.max_model_len, settings.device
        if checkpoint.max_position_embeddings < max_model_len:
            raise ConfigError(
                FIELD,
                str(checkpoint.model_dir),
                f"the draft model's max_position_embeddings ({checkpoint.max_position_embeddings})"
                f" is below the target's max_model_len ({max_model_len})",
            )
        quantization = _draft_quantization(quantization, checkpoint, device)
        self.model = load_model(
            checkpoint,
            device,
            settings.dtype,
            settings.ops,
            max_model_len,
            quantization=quantization,
            dynamic_int8=settings.dynamic_int8,
        )
        self.device, self.ops, self.block_size = device, settings.ops, settings.block_size
        args = self.model.args
        self.vocab_size = args.vocab_size
        self.kv_spec = KVCacheSpec(
            args.num_layers, args.num_kv_heads, args.head_dim, self.block_size, settings.dtype
        )
        """One block of the draft's cache (in the model's dtype, whatever the target's is)."""
        self.kv_pool: KVPool | None = None
        self._free_blocks: list[int] = []
        self._caches: dict[int, _DraftCache] = {}

    def allocate(self, num_blocks: int) -> None:
        self.kv_pool = KVPool(self.kv_spec, num_blocks, 0, self.device)
        self._free_blocks = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def retain(self, seq_ids: set[int]) -> None:
        """Free the cache of every sequence not in `seq_ids` (the running ones)."""
        for seq_id in [s for s in self._caches if s not in seq_ids]:
            self._release(seq_id)

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Greedy drafts for each (sequence, k): up to k tokens after the sequence's last one
        (none where the pool had no room for it)."""
        drafts: list[list[int]] = [[] for _ in requests]
        live = [
            (i, seq, k) for i, (seq, k) in enumerate(requests) if k > 0 and self._reserve(seq, k)
        ]
        if not live:
            return drafts
        # Catch up (every token the cache lacks, the last one included) and draft the first.
        caches = [self._caches[seq.seq_id] for _, seq, _ in live]
        starts = [len(c.token_ids) for c in caches]
        chunks = [seq.token_ids[start:] for (_, seq, _), start in zip(live, starts, strict=True)]
        for (_, seq, _), cache, chunk in zip(live, caches, chunks, strict=True):
            cache.token_ids += chunk
            cache.num_final = seq.num_tokens
        tokens = self._forward(chunks, starts, caches)
        for (i, _, _), token in zip(live, tokens, strict=True):
            drafts[i].append(token)
        # Then one token at a time, for those that want more.
        for step in range(1, max(k for _, _, k in live)):
            going = [(j, x) for j, x in enumerate(live) if x[2] > step]
            chunk_caches = [caches[j] for j, _ in going]
            last = [[drafts[i][-1]] for _, (i, _, _) in going]
            for cache, (token,) in zip(chunk_caches, last, strict=True):
                cache.token_ids.append(token)
            starts = [len(c.token_ids) - 1 for c in chunk_caches]
            tokens = self._forward(last, starts, chunk_caches)
            for (_, (i, _, _)), token in zip(going, tokens, strict=True):
                drafts[i].append(token)
        return drafts

    def _reserve(self, seq: Sequence, k: int) -> bool:
        """Trim the sequence's cache to its valid prefix (at least one token left to feed) and
        give it blocks for the positions this proposal writes (its tokens and k - 1 drafts);
        False, with its cache freed, when the pool is short."""
        cache = self._caches.setdefault(seq.seq_id, _DraftCache())
        valid = min(cache.valid_prefix(seq.token_ids), seq.num_tokens - 1)
        del cache.token_ids[valid:]
        cache.num_final = valid
        needed = -(-(seq.num_tokens + k - 1) // self.block_size) - len(cache.block_table)
        if needed > len(self._free_blocks):
            self._release(seq.seq_id)
            return False
        for _ in range(needed):
            cache.block_table.append(self._free_blocks.pop())
        return True

    def _release(self, seq_id: int) -> None:
        cache = self._caches.pop(seq_id, None)
        if cache is not None:
            self._free_blocks += reversed(cache.block_table)

    def _forward(
        self, chunks: list[list[int]], starts: list[int], caches: list[_DraftCache]
    ) -> list[int]:
        """Run the chunks (chunk b at position starts[b]); the argmax after each chunk's last."""
        assert self.kv_pool is not None, "allocate() the draft's KV pool first"
        q_lens = np.array([len(c) for c in chunks], dtype=np.int64)
        tokens = np.fromiter(
            (t for c in chunks for t in c), dtype=np.int64, count=int(q_lens.sum())
        )
        batch = flat_batch(
            tokens,
            np.array(starts, dtype=np.int64),
            q_lens,
            [c.block_table for c in caches],
            (np.cumsum(q_lens) - 1).tolist(),
            self.block_size,
            self.device,
        )
        layer_caches = self.kv_pool.layer_caches
        if self.ops.plan_attention is not None:
            meta = batch.meta
            meta.plan = self.ops.plan_attention(
                meta.query_start_loc, meta.seq_lens, meta.block_tables, layer_caches[0][0]
            )
        with torch.inference_mode():
            hidden = self.model(
                batch.input_ids,
                batch.positions,
                batch.meta,
                layer_caches,
                None,
                output_rows=batch.sample_indices,
            )
            logits = self.model.compute_logits(hidden)
        return logits.argmax(dim=-1).tolist()
