"""IncrementalDetokenizer against full `Tokenizer.decode` of the same ids, with two real tokenizers
trained here: byte-level BPE (GPT-2 style) and BPE with byte fallback (Llama/SentencePiece style)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.detokenizer import IncrementalDetokenizer

ALPHABET = "ab cdé漢字😀\n"
CORPUS = [
    "héllo wörld café naïve 漢字 漢字テスト emoji 😀🎉 the quick brown fox",
    "hello there, a cab, a bad cab é漢 ab ab cd",
    "日本語のテキスト 中文 ünïcödé",
] * 20
FFFD = "\ufffd"


def _byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A small vocab so that multi-byte characters are split over several tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _byte_fallback_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=120,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyz▁"),
        limit_alphabet=27,
    )
    tok.train_from_iterator(
        ["hello world the quick brown fox jumps over the lazy cab"] * 10, trainer
    )
    # Non-ASCII characters are not in the vocab: they must fall back to <0xNN> byte tokens.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


BYTE_LEVEL = _byte_level_bpe()
BYTE_FALLBACK = _byte_fallback_bpe()


def stream(tokenizer, prompt_ids, output_ids, params=None):
    """Feed ids one by one; returns (deltas, per-token stop flags, flushed tail, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params or SamplingParams())
    deltas, stops = [], []
    for token in output_ids:
        delta, stopped = detok.add(token)
        deltas.append(delta)
        stops.append(stopped)
        if stopped:
            break
    return deltas, stops, detok.flush(), detok


def test_fixture_tokenizers_split_characters():
    # Guard for the tests below: they are only meaningful if characters span several tokens.
    ids = BYTE_FALLBACK.encode("漢字😀").ids
    assert [BYTE_FALLBACK.id_to_token(i) for i in ids][-4:] == [
        "<0xF0>",
        "<0x9F>",
        "<0x98>",
        "<0x80>",
    ]
    assert any(FFFD in BYTE_LEVEL.decode([i]) for i in BYTE_LEVEL.encode("😀").ids)


@settings(max_examples=80, deadline=None)
@given(
    ids=st.lists(st.integers(0, BYTE_LEVEL.get_vocab_size() - 1), max_size=30), skip=st.booleans()
)
def test_byte_level_random_ids_match_full_decode(ids, skip):
    deltas, _, tail, _ = stream(BYTE_LEVEL, [], ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) + tail == BYTE_LEVEL.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("tokenizer", [BYTE_LEVEL, BYTE_FALLBACK], ids=["byte_level", "fallback"])
@settings(max_examples=60, deadline=None)
@given(prompt=st.text(ALPHABET, max_size=12), output=st.text(ALPHABET, min_size=1, max_size=25))
def test_valid_text_streams_without_replacement_chars(tokenizer, prompt, output):
    prompt_ids = tokenizer.encode(prompt).ids
    output_ids = tokenizer.encode(output).ids
    deltas, _, tail, _ = stream(tokenizer, prompt_ids, output_ids)
    assert all(FFFD not in d for d in deltas + [tail])
    # With the prompt as context, the output is what it adds to the full decoded text.
    full = tokenizer.decode(prompt_ids + output_ids)
    prompt_text = tokenizer.decode(prompt_ids)
    assert full.startswith(prompt_text)
    assert "".join(deltas) + tail == full[len(prompt_text) :]
    if not prompt_ids:
        assert "".join(deltas) + tail == tokenizer.decode(output_ids)


def test_output_completing_a_character_split_at_the_prompt_end():
    ids = BYTE_FALLBACK.encode("ab 漢cd").ids
    cut = next(i for i, t in enumerate(ids) if BYTE_FALLBACK.id_to_token(t) == "<0xBC>")
    prompt, output = ids[:cut], ids[cut:]
    deltas, _, tail, _ = stream(BYTE_FALLBACK, prompt, output)
    assert "".join(deltas) + tail == "漢cd"


def test_transformers_fast_tokenizer_is_accepted():
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=BYTE_LEVEL)
    ids = BYTE_LEVEL.encode("héllo 漢字 😀 cab").ids
    deltas, _, tail, _ = stream(hf, [], ids)
    assert "".join(deltas) + tail == hf.decode(ids)


def reference_stop(
    full: str, stops: list[str], include: bool, boundary: int
) -> tuple[str, str | None]:
    """Cut `full` at the stop match with the earliest end after `boundary` (then the longest)."""
    matches = []
    for stop in stops:
        start = full.find(stop)
        while start >= 0:
            if start + len(stop) > boundary:
                matches.append((start + len(stop), -start, stop))
            start = full.find(stop, start + 1)
    if not matches:
        return full, None
    end, neg_start, stop = min(matches)
    return full[:end] if include else full[:-neg_start], stop


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(ALPHABET, min_size=1, max_size=30),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    min_tokens=st.integers(0, 8),
)
def test_stop_strings_truncate_and_never_leak(text, stops, include, min_tokens):
    ids = BYTE_LEVEL.encode(text).ids
    params = SamplingParams(
        stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens, max_tokens=None
    )
    holdback = 0 if include else max(map(len, stops)) - 1
    detok = IncrementalDetokenizer(BYTE_LEVEL, [], params)
    sent = ""
    for token in ids:
        delta, stopped = detok.add(token)
        sent += delta
        if stopped:
            break
        # Everything but the held-back tail has been sent, and nothing more.
        assert sent == detok.text[: max(0, len(detok.text) - holdback)]
    sent += detok.flush()
    # Stops count from the text the min_tokens-th token completes.
    boundary = len(BYTE_LEVEL.decode(ids[: max(min_tokens - 1, 0)]).rstrip(FFFD))
    expected, stop = reference_stop(BYTE_LEVEL.decode(ids), stops, include, boundary)
    assert sent == detok.text == expected
    assert detok.stop_string == stop


def test_stop_string_across_tokens_is_held_back_then_dropped():
    ids = BYTE_LEVEL.encode("hello cab bad").ids
    params = SamplingParams(stop=["ab b"], max_tokens=None)
    deltas, stops, tail, detok = stream(BYTE_LEVEL, [], ids, params)
    assert stops[-1] and not any(stops[:-1])
    assert "".join(deltas) + tail == "hello c"
    assert detok.stop_string == "ab b"
    assert detok.add(ids[0]) == ("", True)
