"""Speculative decoding as the engine drives it: before each step is scheduled, every running
decode that may speculate gets its draft tokens (`Sequence.spec_token_ids`), on the engine
thread, from n-gram prompt lookup or the draft model (spec_decode/ngram_proposer.py,
draft_model.py); the scheduler fits them in the step, the runner computes their rows' logits and
`Drafter.verify` accepts or rejects them (spec_decode/verifier.py).

Who speculates: a running sequence whose next step is a decode (not a prefill chunk, nor a
prompt recomputed after preemption), in a step with at most `speculative_disable_by_batch_size`
running sequences. Drafts never reach past the tokens a sequence may still emit: the step emits
up to d + 1 tokens, within max_tokens and max_model_len. Under a structured-output constraint
only the drafts its grammar allows are kept (as vLLM validates them), and verification masks
each draft position (structured/manager.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from backend_lib.config import ConfigError
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.execution.sampler import Sampler
from backend_lib.llm.execution.step_sampling import ModelOutput
from backend_lib.llm.spec_decode.draft_model import DraftModel
from backend_lib.llm.spec_decode.ngram_proposer import NgramProposer
from backend_lib.llm.spec_decode.verifier import verify_drafts
from backend_lib.llm.speculative_config import SpeculativeConfig
from backend_lib.llm.structured.manager import StructuredOutputManager


class Drafter:
    """Proposes each step's drafts for the sequences that speculate: n-gram prompt lookup, or the
    draft model (`draft`, the runner's; method draft_model)."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None
    ):
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.ngram: NgramProposer | None = None
        if config.method == "ngram":
            # SpeculativeConfig resolves both for ngram (vLLM's defaults).
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            self.ngram = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        elif draft is None:
            raise ConfigError("speculative_config.model", config.model, "no draft model loaded")

    def propose(self, running: list[Sequence], grammars: StructuredOutputManager) -> None:
        """Set `spec_token_ids` of each running sequence (empty where it does not speculate).
        A sequence under a grammar (in `grammars`) keeps only the drafts its grammar allows."""
        _clear(running)
        if not self.config.enabled_for(len(running)):
            return
        requests = []
        for seq in running:
            if seq.num_uncomputed_tokens != 1:
                continue
            room = min(self._room(seq), self.config.num_speculative_tokens)
            if room > 0:
                requests.append((seq, room))
        if self.ngram is not None:
            proposals = [self.ngram.propose(seq.token_ids, room) for seq, room in requests]
        else:
            assert self.draft is not None
            proposals = self.draft.propose(requests) if requests else []
        for (seq, _), drafts in zip(requests, proposals, strict=True):
            if drafts and seq.seq_id in grammars:
                drafts = drafts[: grammars.num_valid_drafts(seq.seq_id, drafts)]
            seq.spec_token_ids = drafts

    @staticmethod
    def verify(output: ModelOutput, sampler: Sampler) -> None:
        """Accept or reject the step's drafts: `output.sampled` then holds each drafted
        sequence's accepted drafts plus one token (spec_decode/verifier.py)."""
        verify_drafts(output, sampler)

    def retain(self, running: list[Sequence]) -> None:
        """Free the draft model's cache of every sequence no longer running (finished, aborted
        or preempted); the engine calls it at the end of each step."""
        if self.draft is not None:
            self.draft.retain({seq.seq_id for seq in running})

    def _room(self, seq: Sequence) -> int:
        """Drafts the sequence may verify: its step emits up to drafts + 1 tokens."""
        room = self.max_model_len - seq.num_tokens - 1
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return room


def _clear(seqs: Iterable[Sequence]) -> None:
    for seq in seqs:
        seq.spec_token_ids = []
