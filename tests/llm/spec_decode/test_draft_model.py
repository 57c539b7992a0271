"""The draft model of speculative decoding (`speculative_config` method draft_model): a draft
identical to the target accepts every greedy draft; its cache follows preemption and rejected
drafts; a draft that does not speak the target's tokenizer, or ends its positions before the
target's max_model_len, is refused at load naming speculative_config.model."""

from __future__ import annotations

import json
import shutil

import pytest

from backend_lib.config import ConfigError
from backend_lib.quantization import QuantizedLinear
from tests.llm.engine_helpers import assert_pool_released, engine_checkpoint, greedy
from tests.llm.shakespeare_helpers import SHAKESPEARE, SHAKESPEARE_DRAFT
from tests.llm.spec_decode.speculation_helpers import DRAFT, PROMPTS, completions, engine


def test_a_draft_identical_to_the_target_accepts_every_greedy_draft():
    spec = engine({**DRAFT, "model": str(SHAKESPEARE)})
    got = spec.generate(PROMPTS, greedy(40))
    assert completions(got) == completions(engine().generate(PROMPTS, greedy(40)))
    counters = spec.stats().counters
    assert counters.spec_decode_num_drafts > 0
    assert counters.spec_decode_num_accepted_tokens == counters.spec_decode_num_draft_tokens
    # Four drafts and the bonus token per drafted step, short only where max_tokens trims.
    assert counters.spec_decode_num_draft_tokens >= 3.5 * counters.spec_decode_num_drafts
    assert_pool_released(spec)


def test_the_shipped_draft_speaks_the_default_models_tokenizer_and_is_smaller():
    spec = engine(DRAFT)
    draft = spec.runner.draft
    assert draft is not None and draft.vocab_size == spec.vocab_size
    assert draft.model.args.num_layers < spec.runner.model.args.num_layers
    assert draft.kv_pool.num_blocks == spec.runner.num_blocks
    spec.generate(PROMPTS[:2], greedy(30))
    counters = spec.stats().counters
    assert 0 < counters.spec_decode_num_accepted_tokens < counters.spec_decode_num_draft_tokens
    assert_pool_released(spec)


def test_an_int8_draft_quantizes_its_layers_and_lm_head_and_leaves_greedy_text_unchanged():
    """speculative_config.quantization int8: the draft's projections and lm_head are int8 layers
    (the target's stay float), its drafts still mostly accepted, and every token as plain."""
    spec = engine({**DRAFT, "quantization": "int8"})
    draft, target = spec.runner.draft.model, spec.runner.model
    assert isinstance(draft.lm_head, QuantizedLinear)
    assert all(isinstance(m, QuantizedLinear) for m in draft.model.layers[0].mlp.children())
    assert not any(isinstance(m, QuantizedLinear) for m in target.modules())
    got = spec.generate(PROMPTS, greedy(40))
    assert completions(got) == completions(engine().generate(PROMPTS, greedy(40)))
    counters = spec.stats().counters
    assert counters.spec_decode_num_accepted_tokens > 0.25 * counters.spec_decode_num_draft_tokens
    assert_pool_released(spec)


def test_a_draft_quantization_that_cannot_run_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="fp8 runs only on CUDA") as error:
        engine({**DRAFT, "quantization": "fp8"})
    assert error.value.key == "speculative_config.quantization"


def _copy_with_config(tmp_path, **changes):
    out = tmp_path / "draft"
    shutil.copytree(SHAKESPEARE_DRAFT, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_draft_with_another_vocabulary_is_refused_naming_the_field():
    other, _ = engine_checkpoint("LlamaForCausalLM")  # a test checkpoint: its own tokenizer
    with pytest.raises(ConfigError, match="target's tokenizer: its vocab_size is") as error:
        engine({**DRAFT, "model": str(other)})
    assert error.value.key == "speculative_config.model"


def test_a_draft_whose_tokens_map_to_other_ids_is_refused(tmp_path):
    out = tmp_path / "draft"
    shutil.copytree(SHAKESPEARE_DRAFT, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # swap two ordinary tokens' ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="maps tokens to other ids") as error:
        engine({**DRAFT, "model": str(out)})
    assert error.value.key == "speculative_config.model"


def test_a_draft_shorter_than_max_model_len_or_missing_is_refused(tmp_path):
    short = _copy_with_config(tmp_path, max_position_embeddings=256)
    with pytest.raises(ConfigError, match="below the target's max_model_len") as error:
        engine({**DRAFT, "model": str(short)})
    assert error.value.key == "speculative_config.model"
    with pytest.raises(ConfigError) as error:
        engine({**DRAFT, "model": str(tmp_path / "nowhere")})
    assert error.value.key == "speculative_config.model"
