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


def resolve(tools, choice, auto_enabled: bool, parallel: bool):
    """(the tools the template and the answer use, None for none; the grammar forcing a
    call, None for "auto"): ValueError naming the field for a request we cannot serve."""
    if tools and choice is None:
        choice = "auto"                      # OpenAI's default with tools (vLLM's too)
    error = check_tools(tools, choice, auto_enabled)
    if error:
        raise ValueError(error)
    used = tools if tools and choice != "none" else None
    return used, forced_grammar(used, choice, parallel) if used else None


def prompt_tools(tools, choice, exclude_when_none: bool):
    """The tools the chat template receives: all of them, also with tool_choice "none" (as
    vLLM: the model sees them and is not let call one) unless --exclude-tools-when-tool-
    choice-none; None without tools."""
    if not tools or (choice == "none" and exclude_when_none):
        return None
    return tools


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


def message_calls(text: str, choice, parser: Optional[str]
                  ) -> tuple[Optional[str], list[dict], bool]:
    """A whole answer under tools: (content, calls, whether the finish reason becomes
    "tool_calls"). ``choice``: "required", a named function, or "auto" (read by ``parser``);
    an "auto" text without a call is all content."""
    if choice == "auto":
        content, calls = parse_auto(text, parser)
        return (content, calls, True) if calls else (text, [], False)
    calls = forced_calls(text, choice)
    return None, calls, choice == "required" and bool(calls)


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


# ---- streaming -----------------------------------------------------------------------------

_TAG = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_WS = " \t\r\n"


class CallStream:
    """The deltas of one streamed choice under ``"required"`` or ``"auto"``, as vLLM streams
    them: content before the first call as it comes (a piece that may start a call marker is
    held until it is known), then, for each call, one delta with its index, id, type and name
    once the name is complete, then its arguments' text as it grows (their concatenation is
    the arguments' JSON). ``kind``: "required", or the ``--tool-call-parser`` of "auto"."""

    def __init__(self, kind: str):
        self.kind = kind
        self.text = ""
        self.sent = 0                 # characters of text streamed as content
        self.calls_from: Optional[int] = 0 if kind == "required" else None
        self.next_pos = 0             # where the next call's object is looked for
        self.open: Optional[dict] = None  # the call being streamed
        self.named = 0                # calls whose name went out
        self.stopped = False          # the calls' region stopped parsing
        self.content_only = False     # llama3_json: the text is not calls

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        return self._advance(final=False)

    def finish(self, calls: list[dict]) -> list[dict]:
        """The last deltas, given the calls parsed from the whole text (``forced_calls`` or
        ``parse_auto``): a call the stream did not catch is sent whole; text that turned out
        not to be a call is sent as content."""
        deltas = self._advance(final=True)
        if not calls and not self.named and self.kind != "required":
            rest = self.text[self.sent:]
            if rest:
                deltas.append({"content": rest})
            self.sent = len(self.text)
        for j, call in enumerate(calls[self.named:], start=self.named):
            deltas.append({"tool_calls": [{"index": j, **call}]})
        return deltas

    def _advance(self, final: bool) -> list[dict]:
        deltas = []
        limit = self._content_limit(final)
        if limit > self.sent:
            deltas.append({"content": self.text[self.sent:limit]})
            self.sent = limit
        if self.calls_from is not None:
            self.next_pos = max(self.next_pos, self.calls_from)
            deltas += self._calls()
        return deltas

    def _content_limit(self, final: bool) -> int:
        """How far the text is content; decides where the calls start (``calls_from``)."""
        text = self.text
        if self.kind == "required":
            return 0
        if self.content_only:
            return len(text)
        if self.calls_from is not None:      # content ends where the calls start
            return self.calls_from if self.kind == "hermes" else 0
        if self.kind == "hermes":
            i = text.find(_TAG)
            if i >= 0:
                self.calls_from = i
                return i
            return len(text) if final else len(text) - _held_prefix(text, _TAG)
        # llama3_json: calls only when the text starts with an object or the python tag.
        body = text.lstrip(_WS)
        if body.startswith("{"):
            self.calls_from = len(text) - len(body)
        elif body.startswith(_PYTHON_TAG):
            self.calls_from = len(text) - len(body) + len(_PYTHON_TAG)
        elif not final and (not body or _PYTHON_TAG.startswith(body)):
            return 0                   # undecided yet
        else:
            self.content_only = True
            return len(text)
        return 0

    def _calls(self) -> list[dict]:
        deltas = []
        while not self.stopped:
            if self.open is None:
                start = self._next_object()
                if start is None:
                    break
                self.open = {"start": start, "index": None, "args": 0}
            c = self.open
            fields, end = _scan_object(self.text, c["start"])
            if c["index"] is None and "name" in fields and fields["name"][1] is not None:
                try:
                    name = json.loads(self.text[slice(*fields["name"])])
                except ValueError:
                    name = None
                if isinstance(name, str):
                    c["index"] = self.named
                    self.named += 1
                    deltas.append({"tool_calls": [{"index": c["index"],
                                                   **new_call(name, "")}]})
            key = "arguments" if "arguments" in fields else "parameters"
            if c["index"] is not None and key in fields:
                a, b = fields[key]
                b = len(self.text) if b is None else b
                if b > a + c["args"]:
                    deltas.append({"tool_calls": [{"index": c["index"], "function": {
                        "arguments": self.text[a + c["args"]:b]}}]})
                    c["args"] = b - a
            if end is None:
                break
            self.next_pos, self.open = end, None
        return deltas

    def _next_object(self) -> Optional[int]:
        """Where the next call's object starts (None: not yet, or no more)."""
        text, i = self.text, self.next_pos
        if self.kind == "hermes":
            j = text.find(_TAG, i)
            if j < 0:
                return None
            i = j + len(_TAG)
            skip = _WS
        else:
            skip = _WS + ";,["
        while i < len(text) and text[i] in skip:
            i += 1
        if i == len(text):
            return None
        if text[i] != "{":
            self.stopped = True
            return None
        return i


class ChoiceStream:
    """One streamed answer's deltas under tools (chat's and /v1/responses'): a named
    function's call at once (``start``) and then its arguments as they come; "required" and
    "auto" read by ``CallStream``."""

    def __init__(self, choice, parser: Optional[str]):
        self.choice, self.parser = choice, parser
        self.named = choice not in ("required", "auto")
        self.calls = None if self.named else \
            CallStream("required" if choice == "required" else parser)

    def start(self) -> list[dict]:
        if not self.named:
            return []
        return [{"tool_calls": [{"index": 0, **new_call(self.choice.function.name, "")}]}]

    def feed(self, text: str) -> list[dict]:
        if self.named:
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] \
                if text else []
        return self.calls.feed(text)

    def finish(self) -> tuple[list[dict], bool]:
        """The last deltas, and whether the finish reason becomes "tool_calls"."""
        if self.named:
            return [], False
        _, calls, is_call = message_calls(self.calls.text, self.choice, self.parser)
        return self.calls.finish(calls), is_call


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (it may become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _scan_string(text: str, i: int) -> Optional[int]:
    """The end (past the closing quote) of the JSON string opening at text[i], or None."""
    i += 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"':
            return i + 1
        i += 1
    return None


def _scan_value(text: str, i: int) -> Optional[int]:
    """The end of the JSON value starting at text[i], or None when it is not complete."""
    if text[i] == '"':
        return _scan_string(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            ch = text[i]
            if ch == '"':
                end = _scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None     # a number or literal may still grow


def _scan_object(text: str, start: int) -> tuple[dict, Optional[int]]:
    """The top-level fields of the (possibly unfinished) JSON object at text[start]: key ->
    (value start, value end or None), and the object's end (None while unfinished)."""
    fields, i, n = {}, start + 1, len(text)

    def ws(i):
        while i < n and text[i] in _WS:
            i += 1
        return i
    while True:
        i = ws(i)
        if i >= n:
            return fields, None
        if text[i] == "}":
            return fields, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return fields, None          # not JSON: the end is never found
        k_end = _scan_string(text, i)
        if k_end is None:
            return fields, None
        try:
            key = json.loads(text[i:k_end])
        except ValueError:
            return fields, None
        i = ws(k_end)
        if i >= n or text[i] != ":":
            return fields, None
        i = ws(i + 1)
        if i >= n:
            return fields, None
        end = _scan_value(text, i)
        fields[key] = (i, end)
        if end is None:
            return fields, None
        i = end
