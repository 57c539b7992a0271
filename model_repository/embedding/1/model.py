"""Triton Python-backend entry point of the embedding model: Triton requests in, engine calls, responses out.

Rendered from config_templates/encoder_model.py.j2 by tooling/repository.py
(scripts/render_repository.py, scripts/add_model.py): edit the template, not this file.
All logic lives in `backend_lib.encoder` (tested without the server); this file only translates.
"""

import triton_python_backend_utils as pb_utils

from backend_lib.encoder.service import EmbeddingService
from backend_lib.errors import InputError
from backend_lib.model_context import ModelContext

OUTPUT_NAME = "embedding"


class TritonPythonModel:
    def initialize(self, args):
        context = ModelContext.from_args(args)
        self.service = EmbeddingService.from_context(context, context.metrics(pb_utils))

    def execute(self, requests):
        inputs = [{tensor.name(): tensor.as_numpy() for tensor in r.inputs()} for r in requests]
        return [self._response(result) for result in self.service.execute(inputs)]

    @staticmethod
    def _response(result):
        if isinstance(result, Exception):
            code = (
                pb_utils.TritonError.INVALID_ARG
                if isinstance(result, InputError)
                else pb_utils.TritonError.INTERNAL
            )
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(result), code))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(OUTPUT_NAME, result)])
