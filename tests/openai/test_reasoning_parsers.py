"""The reasoning parsers (openai_frontend/reasoning.py) on fixed model outputs, whole and streamed
split at every character position: the same reasoning and content."""

from __future__ import annotations

import pytest

from backend_lib import contract
from openai_frontend.reasoning import OPENING_REQUIRED, ReasoningStream, split
from tests.openai.tool_parser_helpers import split_at

# (parser, constrained, model output, reasoning, content)
CASES = [
    ("deepseek_r1", False, "<think>Hmm.</think>Ay.", "Hmm.", "Ay."),
    ("deepseek_r1", False, "Hmm, a rose.\n</think>\n\nAy.", "Hmm, a rose.\n", "\n\nAy."),
    ("deepseek_r1", False, "Still thinking", "Still thinking", None),
    ("deepseek_r1", False, "\n<think>\nHmm.</think>", "\nHmm.", None),
    ("deepseek_r1", False, "<think></think>Ay.", None, "Ay."),
    ("deepseek_r1", False, "a </thin b</think>c", "a </thin b", "c"),
    ("deepseek_r1", False, "", None, None),
    ("deepseek_r1", True, '{"who": "Romeo"}', None, '{"who": "Romeo"}'),
    ("deepseek_r1", True, "<think>Hmm.</think>Ay.", "Hmm.", "Ay."),
    ("qwen3", False, "<think>\nHmm.\n</think>\n\nAy.", "\nHmm.\n", "\n\nAy."),
    ("qwen3", False, "Ay, my lord.", None, "Ay, my lord."),
    ("qwen3", False, "  <think>cut short", "cut short", None),
    ("qwen3", False, "<thinking>", None, "<thinking>"),
    ("qwen3", False, "<thin", None, "<thin"),
    ("qwen3", False, "Ay.</think>No.", None, "Ay.</think>No."),
    ("qwen3", False, "<think>a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", False, "<tool_call>{}</tool_call>", None, "<tool_call>{}</tool_call>"),
]


def _id(case) -> str:
    return f"{case[0]}:{case[1]}:{case[2][:30]!r}"


def test_every_contract_name_has_a_parser():
    assert tuple(OPENING_REQUIRED) == contract.REASONING_PARSERS


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_whole_text(case):
    parser, constrained, text, reasoning, content = case
    assert split(text, parser, constrained) == (reasoning, content)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_streamed_split_anywhere_equals_the_whole(case):
    parser, constrained, text, reasoning, content = case
    for pieces in [*(split_at(text, cut) for cut in range(len(text) + 1)), list(text)]:
        stream = ReasoningStream(parser, constrained)
        parts = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        assert "".join(p.reasoning for p in parts) == (reasoning or "")
        assert "".join(p.content for p in parts) == (content or "")


def test_reasoning_streams_as_it_comes():
    stream = ReasoningStream("qwen3")
    assert stream.feed("<thi").reasoning == ""  # may still be <think>
    assert stream.feed("nk>Hmm, ").reasoning == "Hmm, "
    assert stream.feed("a rose</th").reasoning == "a rose"  # may still be </think>
    step = stream.feed("ink>Ay")
    assert (step.reasoning, step.content) == ("", "Ay")
    assert stream.feed(" me.").content == " me."
