"""Triton Python-backend entry point of the rerank model: Triton requests in, engine calls, responses out.

Rendered from config_templates/encoder_model.py.j2 by tooling/repository.py
(scripts/render_repository.py, scripts/add_model.py): edit the template, not this file.
All logic lives in `backend_lib.encoder` (tested without the server); this file only translates.
Each request is queued on the service's micro-batch scheduler and answered through its response
sender when its items are computed (Triton's default mode allows this since 24.06), so `execute`
returns at once and a request arriving behind a flood waits for one micro-batch, not the flood.
"""

import functools

import triton_python_backend_utils as pb_utils

from backend_lib.encoder.service import RerankService
from backend_lib.errors import response_error
from backend_lib.model_context import ModelContext, before_stub_exit


class TritonPythonModel:
    def initialize(self, args):
        context = ModelContext.from_args(args)
        self.metrics = context.metrics(pb_utils)
        self.service = RerankService.from_context(context, self.metrics)
        self.service.start()

    def execute(self, requests):
        for request in requests:
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            send = functools.partial(self._send, request.get_response_sender())
            self.service.submit(inputs, send, timeout_us=request.timeout())
        return None

    def finalize(self):
        try:
            self.service.shutdown()
        finally:
            before_stub_exit(self.metrics)

    @staticmethod
    def _send(sender, result):
        if isinstance(result, Exception):
            code, message = response_error(result)
            error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
            response = pb_utils.InferenceResponse(error=error)
        else:
            response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, value) for name, value in result.items()]
            )
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
