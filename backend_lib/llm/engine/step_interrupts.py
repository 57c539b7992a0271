"""When a step in flight yields to a request that arrived during it.

On a CPU a step of a full batch takes tens of milliseconds, so under `scheduling_policy: priority`
or `fair_share` a request that outranks the step's work would wait for the step in flight and
then its own. With `interruptible_steps` (the default) the forward asks between layers whether
such a request arrived (execution/step_interrupt.py) and, when one has, the step is dropped: the
request is added and scheduled next, in a step the policy builds for it.

The policy, per step:
1. only under priority or fair share, on a single-rank runner, with a driver that reports its
   arrivals (`arrivals`: the engine loop's requests submitted and not added yet);
2. never with speculative decoding (the drafter proposed for the step and expects it verified);
3. never in the step right after an interrupted one, so every second step at worst completes and
   the work it drops is bounded: a stream of arrivals slows the batch, it cannot stop it;
4. the step yields when an arrival outranks it (`Order.outranks_step`, against the step's work
   summarised once; each arrival is weighed once).

What a dropped step did stands: its block moves, admissions and preemptions (the scheduler's state
is that of a step scheduled and not yet computed, which the next `schedule()` takes up as it is).
Greedy output is unchanged: every token is computed once in a step that completes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.request_queue import Order
from backend_lib.llm.core.scheduler import SchedulerOutput
from backend_lib.llm.execution.step_interrupt import Interrupt

if TYPE_CHECKING:
    from backend_lib.llm.engine.drafter import Drafter
    from backend_lib.llm.execution.model_runner import ModelRunner

Arrivals = Callable[[], Sequence[EngineRequest]]
"""The requests submitted to the engine's driver since its step began, in submission order, each
with its `arrival_time` (called before each layer of an interruptible step, on the engine's
thread; during one step the list only grows)."""


class StepInterrupts:
    """The policy above for one engine; `interrupt_for` gives each step its `Interrupt`."""

    def __init__(self, order: Order, enabled: bool) -> None:
        self.order = order
        self.enabled = enabled
        self.arrivals: Arrivals | None = None
        """Set by the driver (serving/engine_loop.py); None: steps always complete."""
        self.count = 0
        """Steps interrupted so far."""
        self._previous_interrupted = False

    @classmethod
    def of(
        cls, config: LLMConfig, order: Order, runner: ModelRunner, drafter: Drafter | None
    ) -> StepInterrupts:
        """`interruptible_steps` where the runner allows it (one rank) and nothing drafts."""
        return cls(order, config.interruptible_steps and runner.interruptible and drafter is None)

    def interrupt_for(self, step: SchedulerOutput, free_slots: int) -> Interrupt | None:
        """The `Interrupt` of this step (None: it completes); `free_slots`: running slots left
        after it was scheduled."""
        arrivals = self.arrivals
        if (
            arrivals is None
            or not self.enabled
            or self._previous_interrupted
            or not (self.order.by_priority or self.order.tenants.fair_share)
        ):
            return None
        order, work = self.order, None
        checked = 0  # arrivals only grow during a step: each is weighed once

        def interrupt() -> bool:
            nonlocal checked, work
            pending = arrivals()
            if len(pending) == checked:
                return False  # the common case: nothing new, and the step is never summarised
            fresh, checked = pending[checked:], len(pending)
            if work is None:
                work = order.step_work(step.scheduled, free_slots)
            now = time.monotonic()  # for an arrival without its time (none from the loop)
            return any(
                order.outranks_step(r.priority, r.tenant_key, r.arrival_time or now, work)
                for r in fresh
            )

        return interrupt

    def completed(self, interrupted: bool) -> None:
        """Record how the step given `interrupt_for` ended."""
        self._previous_interrupted = interrupted
        self.count += interrupted
