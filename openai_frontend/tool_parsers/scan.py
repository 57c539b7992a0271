"""Text scanning the output parsers share: where a possible tag begins at the end of a text, and
where a JSON object or array ends (fed piece by piece)."""

from __future__ import annotations

from collections.abc import Iterable

_WHITESPACE = " \t\r\n"


def held_from(text: str, tags: Iterable[str]) -> int:
    """Where the part of `text` that may still begin one of `tags` starts: the start of its
    longest suffix that is a proper prefix of a tag (len(text): no such suffix, all of it is
    text). A complete tag inside `text` is the caller's to find first."""
    longest = max((len(tag) for tag in tags), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(tag.startswith(tail) for tag in tags):
            return start
    return len(text)


class JsonEnd:
    """Finds where the JSON object or array a text begins with ends, scanning each character
    once however the text is fed: brackets counted outside strings (escapes honoured), without
    checking the JSON itself (whoever parses the text does)."""

    def __init__(self, openers: str):
        self._openers = openers
        """The characters the value may begin with, after whitespace ("{", "[" or both)."""
        self._pos = 0
        self._depth = 0
        self._in_string = self._escaped = False

    def end(self, text: str) -> int | None:
        """With `text` the whole text so far (each call extending the last one's): the index just
        past the value's closing bracket; the index of the first character that is neither
        whitespace nor an opener when the value cannot begin (the value is then empty); None while
        the value is not closed yet."""
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif self._depth == 0:
                if c in self._openers:
                    self._depth = 1
                elif c not in _WHITESPACE:
                    self._pos = i
                    return i
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i + 1
                    return i + 1
        self._pos = len(text)
        return None
