"""What every route needs: the settings, the Triton client and the model registry (and the
Responses API's store of responses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from openai_frontend.config import FrontendConfig
from openai_frontend.discovery import ModelRegistry
from openai_frontend.responses.store import ResponseStore
from openai_frontend.triton import TritonClient


@dataclass
class FrontendState:
    config: FrontendConfig
    triton: TritonClient
    registry: ModelRegistry
    responses: ResponseStore = field(default_factory=ResponseStore)


def get_state(request: Request) -> FrontendState:
    return request.app.state.frontend


State = Annotated[FrontendState, Depends(get_state)]
"""A route parameter `state: State` receives the app's FrontendState."""
