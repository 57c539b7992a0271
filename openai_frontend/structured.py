"""A request's output constraint -> the llm's `structured_outputs` (vLLM's names).

Sources, at most one per request (a second is a 400 naming it): `response_format` (`json_object`;
`json_schema`, its `strict`, `name` and `description` accepted, the schema always enforced), a
forced tool call (tools.py), vLLM's `structured_outputs` extra and its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`. As vLLM does, `structured_outputs` may carry
only options (`disable_any_whitespace`) for a constraint from another field.

`disable_any_whitespace` goes to the llm as the client set it, and unset when the client did not:
the llm's own default (bounded whitespace between JSON tokens) then applies, as for its Triton
clients. The llm model checks and compiles the constraint; its errors name
`structured_outputs.<kind>`, and `Constraint.param` names the request field it came from. Nothing
here parses or compiles a schema (no costly work on the event loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai_frontend.errors import APIError, invalid_request
from openai_frontend.protocol import SamplingFields

KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""The constraint kinds of the llm's `structured_outputs`."""
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older extras -> the kind each sets."""


@dataclass(frozen=True)
class Constraint:
    value: dict[str, Any]
    """The `structured_outputs` sent to the llm."""
    param: str
    """The request field it came from."""

    def name_param(self, error: APIError) -> APIError:
        """The llm's error about the constraint, naming the request field it came from."""
        if error.status == 400 and error.param is None and "structured_outputs" in error.message:
            error.param = self.param
        return error


def output_constraint(
    body: SamplingFields, tool_schema: dict[str, Any] | None = None
) -> Constraint | None:
    """The request's constraint (None: free text); `tool_schema`: the JSON schema a forced tool
    call puts on the output (tools.py)."""
    extra = dict(body.structured_outputs or {})
    sources: list[tuple[str, dict[str, Any]]] = []
    given = {k: extra.pop(k) for k in KINDS if extra.get(k) not in (None, False)}
    if given:
        sources.append(("structured_outputs", given))
    sources += _response_format(body)
    if tool_schema is not None:
        sources.append(("tool_choice", {"json": tool_schema}))
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            sources.append((name, {kind: value}))
    if not sources:
        if extra:
            raise invalid_request(
                "`structured_outputs` holds options but no constraint: set one of "
                f"{', '.join(KINDS)}, or give `response_format`",
                "structured_outputs",
            )
        return None
    if len(sources) > 1:
        names = " and ".join(f"`{name}`" for name, _ in sources)
        raise invalid_request(f"only one output constraint per request: got {names}", sources[1][0])
    param, kinds = sources[0]
    return Constraint({**kinds, **extra}, param)


def _response_format(body: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [("response_format", {"json_object": True})]
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise invalid_request(
            '`response_format` {"type": "json_schema"} needs `json_schema.schema`',
            "response_format.json_schema",
        )
    return [("response_format", {"json": fmt.json_schema.schema_})]
