"""Peer systems (OpenVINO GenAI, CTranslate2, OpenVINO, ONNX Runtime) for the engine and embedding
benchmarks. They live in their own environment (`env`, `.venv-peers`), convert the benchmarks'
checkpoints once into a cache (`convert`, run there), and run in a worker process there (`worker`),
driven over a pipe by `client` from the benchmark's process with the same threads and inputs.
"""
