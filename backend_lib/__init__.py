"""The runtime behind the Triton Python-backend models (llm, embedding, rerank).

Each `model_repository/<model>/1/model.py` only converts between `pb_utils` and numpy and calls
into this package, which is tested without a server. Shared modules: model_context.py (what
Triton passes at `initialize`), contract.py (what the backend and the OpenAI frontend share:
model kinds, tensor names, boolean spelling, error codes, published facts; no torch), config.py (config.pbtxt parameters -> a validated dataclass),
device.py (device and dtype), checkpoint.py (resolving and checking a local checkpoint
directory), triton_io.py (reading request tensors), errors.py (errors a client sees), metrics.py
(metrics through `pb_utils.MetricFamily` or prometheus_client) and linear.py (oneDNN-packed
linear layers). The models: encoder/ (embedding and rerank) and llm/ (the LLM engine:
serving/, engine/, core/, execution/, lora/, structured/).
"""
