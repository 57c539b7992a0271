"""Request limits have one source, LLMConfig: `n` up to `max_n` and `logprobs` up to `max_logprobs`
pass both the engine and the service (a config above the engine's former own caps of n 64 and
logprobs 20 included), and one over the limit is refused by either, naming the field and limit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from backend_lib.config import ConfigError
from backend_lib.errors import InputError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from backend_lib.llm.serving.service import LLMService
from backend_lib.model_context import ModelContext
from tooling.checkpoints import build_checkpoint

CPU = torch.device("cpu")
VOCAB = 256  # tooling.checkpoints' tiny models
PROMPT = "t5 t6 t7 t8"
# Above the engine's former caps (n 64, logprobs 20) and the config defaults (16, 20).
SETTINGS: dict[str, Any] = dict(
    dtype="float32",
    kernel_backend="torch",
    block_size=8,
    num_blocks=256,  # room for 80 forked sequences
    max_model_len=64,
    max_n=100,
    max_logprobs=30,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a word-level tokenizer: token i is the word `t{i}`."""
    out = tmp_path_factory.mktemp("limits_llama")
    build_checkpoint("LlamaForCausalLM", out)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"})
    )
    return out


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread; on a shared machine it only waits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    config = LLMConfig(model=str(model_dir), **{**SETTINGS, **overrides})
    config.validate()
    return LLMEngine(config, model_dir, CPU)


def sampled(**params: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=3, max_tokens=2, ignore_eos=True, **params)


# --- engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return make_engine(model_dir)


def test_engine_serves_n_up_to_config_max_n(engine):
    (out,) = engine.generate([PROMPT], sampled(n=80))
    assert out.finished and out.error is None
    assert sorted(c.index for c in out.outputs) == list(range(80))
    assert all(len(c.token_ids) == 2 and c.finish_reason == "length" for c in out.outputs)


def test_engine_refuses_n_over_config_max_n(engine, model_dir):
    with pytest.raises(InputError, match=r"n must be <= 100, got 101"):
        engine.add_request("too-many", PROMPT, sampled(n=101))
    assert not engine.has_unfinished_requests()
    # Below its former own cap of 64, but over this config's max_n.
    with pytest.raises(InputError, match=r"n must be <= 4, got 5"):
        make_engine(model_dir, max_n=4).add_request("r", PROMPT, sampled(n=5))


def test_engine_serves_logprobs_up_to_config_max_logprobs(engine):
    (out,) = engine.generate([PROMPT], sampled(logprobs=30))
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == 2
    assert all(30 <= len(position) <= 31 for position in logprobs)  # top 30 plus the sampled one
    with pytest.raises(InputError, match=r"logprobs must be <= 30, got 31"):
        engine.add_request("too-many", PROMPT, sampled(logprobs=31))


def test_max_logprobs_beyond_the_vocabulary_is_a_config_error(model_dir):
    with pytest.raises(ConfigError, match=r"'max_logprobs'=257.*vocabulary \(256 tokens\)"):
        make_engine(model_dir, max_logprobs=VOCAB + 1)


# --- service -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(model_dir) -> Iterator[LLMService]:
    """Built from config.pbtxt-style string parameters, as model.py builds it."""
    parameters = {key: str(value) for key, value in SETTINGS.items()} | {"model": str(model_dir)}
    context = ModelContext("llm", "1", model_dir, CPU, parameters, {})
    service = LLMService.from_context(context, None)
    yield service
    service.shutdown()


def request(**params: Any) -> dict[str, np.ndarray]:
    fields = {"temperature": 1.0, "seed": 3, "max_tokens": 2, "ignore_eos": True, **params}
    return {
        "text_input": np.array([PROMPT.encode()], dtype=object),
        "exclude_input_in_output": np.array([True]),
        "sampling_parameters": np.array([json.dumps(fields).encode()], dtype=object),
        "return_logprobs": np.array(["logprobs" in params]),
    }


def final_response(service: LLMService, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    responses = list(service.responses(service.submit(inputs)))
    tensors, final = responses[-1]
    assert final and not isinstance(tensors, Exception), tensors
    return tensors


def test_service_serves_n_up_to_config_max_n(service):
    tensors = final_response(service, request(n=80))
    assert tensors["text_output"].shape == (80,)
    assert all(len(text.split()) == 2 for text in tensors["text_output"])  # two word tokens


def test_service_refuses_n_over_config_max_n(service):
    with pytest.raises(InputError, match=r"n must be <= 100, got 101"):
        service.submit(request(n=101))


def test_service_serves_logprobs_up_to_config_max_logprobs(service):
    tensors = final_response(service, request(logprobs=30))
    (positions,) = [json.loads(entry) for entry in tensors["logprobs"]]
    assert len(positions) == 2 and all(30 <= len(position) <= 31 for position in positions)
    with pytest.raises(InputError, match=r"logprobs must be <= 30, got 31"):
        service.submit(request(logprobs=31))
