"""The engine's proposer step of speculative decoding: before each step is scheduled, every
running decode that may speculate gets its draft tokens (`Sequence.spec_token_ids`), on the
engine thread; the scheduler fits them in the step and the runner verifies them (verifier.py).

Who speculates: a running sequence whose next step is a decode (not a prefill chunk, nor a
prompt recomputed after preemption), not under a structured-output constraint (its drafts would
need a bitmask per draft position), in a step with at most `speculative_disable_by_batch_size`
running sequences. Drafts never reach past the tokens a sequence may still emit: the step emits
up to d + 1 tokens, within max_tokens and max_model_len.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from backend_lib.config import ConfigError
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.spec_decode.config import SpeculativeConfig
from backend_lib.llm.spec_decode.ngram_proposer import NgramProposer


class Drafter:
    """Proposes each step's drafts (n-gram prompt lookup) for the sequences that speculate."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        if config.method != "ngram":
            raise ConfigError(
                "speculative_config.method",
                config.method,
                "only ngram is served so far (draft_model is not yet)",
            )
        # SpeculativeConfig resolves both for ngram (vLLM's defaults).
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose(self, running: list[Sequence], constrained: Callable[[int], bool]) -> None:
        """Set `spec_token_ids` of each running sequence (empty where it does not speculate).
        `constrained(seq_id)`: whether a sequence decodes under a grammar."""
        if not self.config.enabled_for(len(running)):
            _clear(running)
            return
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_uncomputed_tokens != 1 or constrained(seq.seq_id):
                continue
            room = self._room(seq)
            if room > 0:
                seq.spec_token_ids = self.proposer.propose(seq.token_ids, room)

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
