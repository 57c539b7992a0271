"""Triton Python-backend entry point of the llm model (decoupled): requests in, engine loop, streamed
responses out.

Rendered from config_templates/llm_model.py.j2 by tooling/repository.py
(scripts/render_repository.py, scripts/add_model.py): edit the template, not this file.
All logic lives in `backend_lib.llm` (tested without the server); this file only translates to
and from `pb_utils`.
"""

import functools

import triton_python_backend_utils as pb_utils

from backend_lib.errors import response_error
from backend_lib.llm.serving.service import LLMService
from backend_lib.model_context import ModelContext, before_stub_exit, server_model_control_mode

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        context = ModelContext.from_args(args)
        # A sharded model whose worker died asks to be unloaded, as the vLLM backend does; only
        # under explicit model control: in the other modes the refused call crashes the server.
        unload = None
        if server_model_control_mode() == "explicit":
            unload = functools.partial(pb_utils.unload_model, context.name)
        self.metrics = context.metrics(pb_utils)
        self.service = LLMService.from_context(context, self.metrics, unload)

    def execute(self, requests):
        # Here, on the stub's execute thread: the model-loader API is unsafe from other threads.
        self.service.unload_if_unavailable()
        for request in requests:
            sender = request.get_response_sender()
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            try:
                # One responder thread of the service sends every request's responses; the
                # request's timeout (microseconds, 0: none) is its deadline.
                self.service.start(
                    inputs,
                    functools.partial(_send, sender),
                    request.is_cancelled,
                    request.timeout(),
                )
            except Exception as exc:  # this request fails alone
                sender.send(_error(exc), flags=FINAL)
        return None

    def finalize(self):
        try:
            self.service.shutdown()
        finally:
            before_stub_exit(self.metrics)


def _send(sender, result, final):
    if isinstance(result, Exception):
        response = _error(result)
    else:
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in result.items()]
        )
    sender.send(response, flags=FINAL if final else 0)


def _error(exc):
    # The message carries the error's code (backend_lib/contract.py): a stream delivers only it.
    code, message = response_error(exc)
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    )
