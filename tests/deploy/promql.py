"""What a PromQL expression reads, from its parse tree (promql_parser, Prometheus' grammar)."""

from __future__ import annotations

import promql_parser


def nodes(expr: str, kind: type) -> list:
    """Every node of type `kind` in `expr`'s parse tree (ValueError on a syntax error)."""
    found = []

    def visit(node) -> None:
        if isinstance(node, kind):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects."""
    return {node.name for node in nodes(expr, promql_parser.VectorSelector) if node.name}


def functions(expr: str) -> set[str]:
    """The functions `expr` calls."""
    return {node.func.name for node in nodes(expr, promql_parser.Call)}
