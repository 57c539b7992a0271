"""What every route needs: the settings, the Triton client and the model registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from openai_frontend.config import FrontendConfig
from openai_frontend.discovery import ModelInfo, ModelRegistry
from openai_frontend.errors import APIError
from openai_frontend.tokenization import ModelTokenizer
from openai_frontend.triton import TritonClient


@dataclass
class FrontendState:
    config: FrontendConfig
    triton: TritonClient
    registry: ModelRegistry

    def tokenizer_or_none(self, info: ModelInfo) -> ModelTokenizer | None:
        """The model's tokenizer, or None when the frontend cannot read its checkpoint."""
        try:
            return self.registry.tokenizer(info)
        except APIError:
            return None


def get_state(request: Request) -> FrontendState:
    return request.app.state.frontend


State = Annotated[FrontendState, Depends(get_state)]
"""A route parameter `state: State` receives the app's FrontendState."""
