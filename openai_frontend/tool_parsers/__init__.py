"""Tool-call parsers for `tool_choice` "auto": a model's text -> content and `tool_calls`, whole
(`ToolCallFormat.extract`) or as it streams (`CallStream`). `base.py` holds the scanner and the
rules every format shares; each format is one module, named by `registry.py`."""
