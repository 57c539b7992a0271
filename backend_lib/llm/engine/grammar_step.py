"""The structured-output part of a step's update: advance each constrained sequence's grammar.

After the scheduler appends the sampled tokens, every constrained sequence's matcher accepts its
new tokens (one, or a speculative step's accepted run; a new n > 1 child starts from its parent's
state). A grammar that terminated finishes
its sequence with "stop"; a token the grammar refuses (sampled from a fully masked row) or a
grammar that allowed no token at all fails that request alone.
"""

from __future__ import annotations

from backend_lib.llm.core.outputs import RequestOutput
from backend_lib.llm.core.scheduler import Scheduler, SchedulerOutput
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.core.stats import StatsCollector
from backend_lib.llm.engine.output_processor import OutputProcessor
from backend_lib.llm.engine.parallel_sampling import Forks
from backend_lib.llm.execution.step_sampling import ModelOutput
from backend_lib.llm.structured.manager import StructuredOutputManager

DEAD_END_ERROR = "structured_outputs: the grammar allows no next token (dead end)"


def dead_ends(model_out: ModelOutput) -> list[int]:
    """seq_ids whose grammar allowed no token in this step's bitmask."""
    return [] if model_out.bitmask is None else list(model_out.bitmask.dead_seq_ids)


def advance_grammars(
    structured: StructuredOutputManager,
    scheduler: Scheduler,
    sched_out: SchedulerOutput,
    sampled: dict[int, list[int]],
    forks: Forks,
) -> dict[str, str]:
    """Advance the matchers by the new tokens; request_id -> error for refused tokens."""
    errors: dict[str, str] = {}
    if not len(structured):
        return errors
    for item in sched_out.scheduled:
        seq = item.seq
        if seq.seq_id not in sampled or seq.seq_id not in structured:
            continue
        for child in forks.get(seq.seq_id, ()):
            structured.fork(seq.seq_id, child.seq_id)
            _accept(structured, scheduler, child, errors)
        _accept(structured, scheduler, seq, errors)
    return errors


def _accept(
    structured: StructuredOutputManager, scheduler: Scheduler, seq: Sequence, errors: dict[str, str]
) -> None:
    """Accept the output tokens the grammar has not seen: this step's one, or its accepted run
    of drafts and the token after them (speculative decoding)."""
    new = seq.num_output_tokens - structured.num_accepted(seq.seq_id)
    terminated = False
    for token in seq.token_ids[seq.num_tokens - new :]:
        allowed, terminated = structured.accept(seq.seq_id, token)
        if not allowed:
            errors[seq.request_id] = (
                f"structured_outputs: the grammar allows no token here (token {token} was "
                "sampled from a fully masked row; e.g. min_tokens banned EOS where only EOS fits)"
            )
            return
    if terminated and not seq.is_finished:
        scheduler.finish(seq, "stop")


def fail_dead_ends(
    outputs: OutputProcessor,
    stats: StatsCollector,
    model_out: ModelOutput,
    samples_due: dict[int, int],
) -> list[RequestOutput]:
    """Fail the requests whose grammar allowed no token in this step's bitmask."""
    if model_out.bitmask is not None:
        stats.bitmask_filled(model_out.bitmask.fill_seconds)
    failed: list[RequestOutput] = []
    for seq_id in dead_ends(model_out):
        request_id = outputs.request_of(seq_id).prepared.request_id
        failed += fail_constrained(outputs, request_id, DEAD_END_ERROR, model_out, samples_due)
    return failed


def fail_constrained(
    outputs: OutputProcessor,
    request_id: str,
    error: str,
    model_out: ModelOutput,
    samples_due: dict[int, int],
) -> list[RequestOutput]:
    """Fail the request now; its sequences' tokens of this step are dropped."""
    request = outputs.requests.get(request_id)
    if request is None:
        return []  # already failed this step (a sibling)
    for state in request.seqs:
        model_out.sampled.pop(state.seq.seq_id, None)
        model_out.logprobs.pop(state.seq.seq_id, None)
        samples_due.pop(state.seq.seq_id, None)
    return [outputs.fail(request, error)]
