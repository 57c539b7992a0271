"""Triton Python-backend entry point of the rerank model: Triton requests in, engine calls, responses out.

Rendered from config_templates/encoder_model.py.j2 by tooling/repository.py
(scripts/render_repository.py, scripts/add_model.py): edit the template, not this file.
All logic lives in `backend_lib.encoder` (tested without the server); this file only translates.
"""

import triton_python_backend_utils as pb_utils

from backend_lib.encoder.service import RerankService
from backend_lib.errors import response_error
from backend_lib.model_context import ModelContext


class TritonPythonModel:
    def initialize(self, args):
        context = ModelContext.from_args(args)
        self.service = RerankService.from_context(context, context.metrics(pb_utils))

    def execute(self, requests):
        inputs = [{tensor.name(): tensor.as_numpy() for tensor in r.inputs()} for r in requests]
        return [self._response(result) for result in self.service.execute(inputs)]

    @staticmethod
    def _response(result):
        if isinstance(result, Exception):
            code, message = response_error(result)
            error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
            return pb_utils.InferenceResponse(error=error)
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in result.items()]
        )
