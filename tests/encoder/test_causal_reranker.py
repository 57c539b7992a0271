"""Causal-LM rerankers (Qwen3-Reranker's original form): the pair rendered with the model's chat
template, scored from two token logits at the last position, against sentence-transformers 6.x
`CrossEncoder` (Transformer -> LogitScore), the reference for this form; vLLM's
`classifier_from_token` and `--chat-template` spelled as rerank-model parameters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from backend_lib.config import ConfigError, from_parameters
from backend_lib.contract import SCORE
from backend_lib.encoder.config import RerankConfig
from backend_lib.encoder.reranker import CrossEncoderReranker, load_reranker
from backend_lib.encoder.service import RerankService
from backend_lib.errors import InputError
from tooling.checkpoints import RERANK_CHAT_TEMPLATE, RERANK_TOKENS, build_causal_reranker

CPU = torch.device("cpu")
QUERIES = ["what smells sweet?"] * 3 + ["who is the king", "x", "long query " * 200]
DOCUMENTS = ["the rose smells sweet", "a long document " * 200, "", "the king is Lear", "y", "z"]
CHAT_ONLY = (
    "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}"
    "<|bos|>{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
)
"""A chat model's template: roles other than system, user and assistant render nothing."""
INSTRUCTION = {"plays": "Find the line of the play that answers the question"}


def _ours(path: Path, **parameters: str) -> CrossEncoderReranker:
    config = from_parameters(RerankConfig, {"model": str(path), "dtype": "float32", **parameters})
    reranker = load_reranker(config, CPU, path)
    assert isinstance(reranker, CrossEncoderReranker)
    return reranker


def _reference(path: Path, true_token: str, false_token: str | None, template: str | None = None):
    """sentence-transformers' CrossEncoder on a bare causal-LM save, with its LogitScore built
    from the given tokens (and `template` as the chat template, its documented remedy)."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules import LogitScore

    transformer = Transformer(str(path), transformer_task="text-generation")
    if template is not None:
        transformer.processor.chat_template = template
    ids = transformer.tokenizer.convert_tokens_to_ids
    score = LogitScore(ids(true_token), None if false_token is None else ids(false_token))
    return CrossEncoder(modules=[transformer, score], device="cpu")


def _pairs() -> list[tuple[str, str]]:
    return list(zip(QUERIES, DOCUMENTS, strict=True))


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("Qwen3ForCausalLM", {}), ("LlamaForCausalLM", {"tie_word_embeddings": True})],
)
def test_saved_cross_encoder_scores_equal_sentence_transformers(tmp_path, arch, overrides):
    """A CrossEncoder saved by sentence-transformers (LogitScore module, a default prompt as the
    instruction): same scores, long pairs cut with the template's tail kept."""
    from sentence_transformers import CrossEncoder

    path = build_causal_reranker(
        tmp_path / "ce",
        arch,
        prompts=INSTRUCTION,
        default_prompt_name="plays",
        max_position_embeddings=256,
        **overrides,
    )
    reference = CrossEncoder(str(path), device="cpu", local_files_only=True)
    expected = reference.predict(_pairs(), batch_size=4)
    ours = _ours(path)
    assert ours.max_seq_length == 256
    np.testing.assert_allclose(ours.predict(QUERIES, DOCUMENTS), expected, atol=1e-4)
    # The tokens too: the instruction rendered, the cut rows ending in the template's tail.
    features = reference.preprocess(_pairs(), prompt=INSTRUCTION["plays"])
    for row, (ids, _) in enumerate(ours.tokenize(QUERIES, DOCUMENTS)):
        assert ids == features["input_ids"][row][features["attention_mask"][row].bool()].tolist()
    raw = ours.score(ours.tokenize(QUERIES, DOCUMENTS), apply_sigmoid=False)[0]
    np.testing.assert_allclose(
        raw, reference.predict(_pairs(), activation_fn=torch.nn.Identity()), atol=1e-4
    )


def test_classifier_from_token_on_a_bare_causal_lm(tmp_path):
    """vLLM's `classifier_from_token`: two tokens (false, true) score their logit difference, one
    token its logit; the checkpoint is a plain transformers save."""
    path = build_causal_reranker(tmp_path / "bare", logit_score=False)
    false, true = RERANK_TOKENS
    two = _ours(path, mode="cross_encoder", classifier_from_token=json.dumps([false, true]))
    expected = _reference(path, true, false).predict(_pairs())
    np.testing.assert_allclose(two.predict(QUERIES, DOCUMENTS), expected, atol=1e-4)
    one = _ours(path, mode="cross_encoder", classifier_from_token=json.dumps([true]))
    expected = _reference(path, true, None).predict(_pairs())
    np.testing.assert_allclose(one.predict(QUERIES, DOCUMENTS), expected, atol=1e-4)


def test_chat_template_file_for_a_checkpoint_without_pair_roles(tmp_path):
    """A causal LM whose own chat template knows only system/user/assistant (the original
    Qwen3-Reranker's case) is refused; a `chat_template` file carrying the roles serves it."""
    path = build_causal_reranker(tmp_path / "chat", logit_score=False, chat_template=CHAT_ONLY)
    tokens = json.dumps(list(RERANK_TOKENS))
    with pytest.raises(ConfigError, match="chat_template.*drops the query and document"):
        _ours(path, mode="cross_encoder", classifier_from_token=tokens)
    (tmp_path / "rerank.jinja").write_text(RERANK_CHAT_TEMPLATE)
    # The file is found relative to the model's directory (here its parent, as in a repository).
    config = from_parameters(
        RerankConfig,
        {
            "model": str(path),
            "dtype": "float32",
            "mode": "cross_encoder",
            "classifier_from_token": tokens,
            "chat_template": "rerank.jinja",
        },
    )
    ours = load_reranker(config, CPU, tmp_path)
    expected = _reference(path, RERANK_TOKENS[1], RERANK_TOKENS[0], RERANK_CHAT_TEMPLATE)
    np.testing.assert_allclose(
        ours.predict(QUERIES, DOCUMENTS), expected.predict(_pairs()), atol=1e-4
    )


def test_bad_settings_name_their_field(tmp_path):
    path = build_causal_reranker(tmp_path / "bad", logit_score=False)
    # The Shakespeare vocabulary has no "yes": sentence-transformers' default tokens are absent.
    with pytest.raises(ConfigError, match="classifier_from_token.*no token 'yes'"):
        _ours(path, mode="cross_encoder")
    with pytest.raises(ConfigError, match="classifier_from_token.*JSON list"):
        _ours(path, classifier_from_token="no,yes")
    with pytest.raises(ConfigError, match="chat_template.*no such file"):
        _ours(path, mode="cross_encoder", classifier_from_token='["No"]', chat_template="x.jinja")


def test_auto_mode_and_bad_requests_through_the_service(tmp_path):
    """Auto mode reads a LogitScore checkpoint as a cross-encoder; in one batch an over-long pair
    with truncation off fails alone and the others score as they do alone."""
    from sentence_transformers import CrossEncoder

    path = build_causal_reranker(tmp_path / "svc")
    service = RerankService(_ours(path))

    def request(queries, documents, **extra):
        return {
            "query": np.array([[q.encode()] for q in queries], dtype=object),
            "document": np.array([[d.encode()] for d in documents], dtype=object),
            **extra,
        }

    good = request(QUERIES[:3], DOCUMENTS[:3])
    too_long = request(["q"], ["word " * 600], truncate=np.array([[False]]))
    results = service.execute([too_long, good])
    assert isinstance(results[0], InputError) and "truncation is off" in str(results[0])
    expected = CrossEncoder(str(path), device="cpu").predict(_pairs()[:3])
    np.testing.assert_allclose(results[1][SCORE][:, 0], expected, atol=1e-4)
