"""Cutting a step short at a layer boundary, for a request that outranks it.

A forward cannot be preempted, but it runs layer by layer: before each decoder layer the model
calls the step's `Interrupt`, and when that returns True it raises `StepInterrupted`. The step is
then dropped as if never run: nothing was sampled and no sequence advanced, so the K/V the layers
already wrote lie past every sequence's computed tokens and are overwritten when the positions are
computed again (the block moves of the step, applied before the forward, stand). When to ask is
the engine's policy (engine/step_interrupts.py); this module is the mechanism.

Only a single-rank runner cuts a step short: tensor-parallel ranks (and pipeline stages) run the
same collectives layer by layer, so every rank must complete every step.
"""

from __future__ import annotations

from collections.abc import Callable

Interrupt = Callable[[], bool]
"""Called before each decoder layer of a step's forward (on the engine's thread); True: drop the
step. It must be cheap: a step calls it once per layer."""


class StepInterrupted(Exception):
    """The forward stopped at a layer boundary because the step's `Interrupt` said so."""
