"""What every route needs: the settings, the Triton client and the model registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from openai_frontend.config import FrontendConfig
from openai_frontend.discovery import ModelRegistry
from openai_frontend.triton import TritonClient


@dataclass
class FrontendState:
    config: FrontendConfig
    triton: TritonClient
    registry: ModelRegistry


def get_state(request: Request) -> FrontendState:
    return request.app.state.frontend


State = Annotated[FrontendState, Depends(get_state)]
"""A route parameter `state: State` receives the app's FrontendState."""
