"""Tool calls on /v1/chat/completions: the grammar that forces a call, and reading calls
back from the model's text.

- ``tool_choice`` naming a function: the output is that function's arguments, forced by its
  ``parameters`` JSON schema; ``"required"``: a JSON list of one or more
  ``{"name", "parameters"}`` objects, one of the tools each (vLLM's way);
- ``"auto"``: the model writes what it likes and a named parser reads the calls out of its
  text (``--tool-call-parser``, with ``--enable-auto-tool-choice``, as vLLM): ``hermes``
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) or ``llama3_json``
  (``{"name": ..., "parameters": {...}}``, several separated by ``;``).
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from llm_serving.sampling_params import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _params_schema(fn) -> dict:
    return fn.parameters if fn.parameters is not None else {"type": "object"}


def forced_grammar(tools, choice, parallel: bool) -> Optional[StructuredOutputsParams]:
    """The grammar of a named or "required" tool_choice (None for "auto"/"none")."""
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": _params_schema(t.function)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    if choice is not None and not isinstance(choice, str):
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=_params_schema(fn))
    return None


def check_tools(tools, choice, auto_enabled: bool) -> Optional[str]:
    """An error message (naming the field) for a tools request we cannot serve, or None."""
    if choice is not None and not tools and choice != "none":
        return "tool_choice: given without tools"
    if tools:
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            return "tools: function names must be unique"
    if choice is not None and not isinstance(choice, str) \
            and choice.function.name not in [t.function.name for t in tools]:
        return f"tool_choice: no tool is named {choice.function.name!r}"
    if choice == "auto" and not auto_enabled:
        return ('tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser")
    return None


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def forced_calls(text: str, choice) -> list[dict]:
    """The calls of a forced tool_choice's output (grammar-valid, unless cut by max_tokens:
    then the text is returned as the arguments, as vLLM does)."""
    if choice == "required":
        try:
            return [new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                    for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return []
    return [new_call(choice.function.name, text)]


def parse_auto(text: str, parser: str) -> tuple[Optional[str], list[dict]]:
    """(content, calls) read out of a model's text by ``parser``; the text is all content
    when no call parses."""
    calls, content = [], text
    if parser == "hermes":
        if "<tool_call>" not in text:
            return text, []
        content = text[:text.index("<tool_call>")].strip() or None
        blobs = _HERMES.findall(text)
        key = "arguments"
    else:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        if not body.startswith("{"):
            return text, []
        content, blobs, key = None, [b for b in body.split(";") if b.strip()], "parameters"
    for blob in blobs:
        try:
            obj = json.loads(blob)
            args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
            calls.append(new_call(str(obj["name"]), json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return text, []
    return content, calls
