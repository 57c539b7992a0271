"""Development tooling around the runtime, never imported by the Triton models.

tritonserver.py starts a real tritonserver on free ports (tests, served benchmarks) through the
venv's `tritonserver` launcher; repository.py renders model directories (`config.pbtxt` and
`<version>/model.py`) from config_templates/, for scripts/render_repository.py and
scripts/add_model.py; checkpoints.py writes random-weight Hugging Face checkpoints for tests and
benchmarks; hf_reference.py runs transformers as the reference the engine's outputs are checked
against.
"""
