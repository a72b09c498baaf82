"""How a message's content reaches the chat template (vLLM's ``--chat-template-content-format``):

- ``string``: one string, the text parts joined with newlines (most templates print
  ``message['content']``);
- ``openai``: OpenAI's list of parts, ``[{"type": "text", "text": ...}]``, a string content
  as one part (templates that loop over ``message['content']`` to pick the text parts);
- ``auto`` (the default): ``openai`` when the template loops over a message's content, else
  ``string``, as vLLM 0.32 detects it from the template's syntax tree.
"""
from __future__ import annotations

import functools
from typing import Any, Iterator, Optional

CONTENT_FORMATS = ("auto", "string", "openai")


@functools.lru_cache(maxsize=32)
def detect_content_format(template: Optional[str], parse=None) -> str:
    """``openai`` if the template has a ``for`` loop over a message's content, else
    ``string``. As vLLM reads a template: a message is the target of a loop over ``messages``
    (or a variable set from it); its content is ``message.content`` / ``message['content']``,
    a variable named ``content`` (outside macros), or a macro's parameter that a call passes a
    message's content to. ``parse``: the Jinja parser of the environment that renders the
    template (its extensions, {% generation %}; the tokenizer's); None: plain Jinja's."""
    import jinja2
    from jinja2 import nodes
    if not template:
        return "string"
    try:
        root = (parse or jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse)(
            template)
    except jinja2.TemplateError:
        return "string"
    lists = _names_from(root, {"messages"})
    items = {loop.target.name for loop in root.find_all(nodes.For)
             if isinstance(loop.target, nodes.Name) and _refers_to(loop.iter, lists, None)}
    in_macros = set()
    for macro in root.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        bound = set()
        for call in root.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                given = [*zip(params, call.args), *((k.key, k.value) for k in call.kwargs)]
                bound |= {name for name, arg in given if _refers_to(arg, items, "content")}
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if _refers_to(loop.iter, bound, None):
                return "openai"
    for loop in root.find_all(nodes.For):
        if _refers_to(loop.iter, items, "content") or (
                id(loop) not in in_macros and isinstance(loop.iter, nodes.Name)
                and loop.iter.name == "content"):
            return "openai"
    return "string"


def _names_from(root, names: set) -> set:
    """``names`` and every variable set (``{% set x = ... %}``) from one of them,
    transitively."""
    from jinja2 import nodes
    names = set(names)
    while True:
        more = {a.target.name for a in root.find_all(nodes.Assign)
                if isinstance(a.target, nodes.Name) and a.target.name not in names
                and _refers_to(a.node, names, None)}
        if not more:
            return names
        names |= more


def _refers_to(node, names: set, key: Optional[str]) -> bool:
    """Whether ``node`` is one of ``names`` (with ``key``: its ``.key`` or ``['key']``),
    possibly sliced, filtered (``| reverse``) or tested."""
    from jinja2 import nodes
    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
        if node is None:
            return False
    if key is not None:
        if isinstance(node, nodes.Getattr) and node.attr == key:
            node = node.node
        elif (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
              and node.arg.value == key):
            node = node.node
        else:
            return False
    return isinstance(node, nodes.Name) and node.name in names


def format_contents(messages: list, content_format: str, template: str, parse=None) -> list:
    """``messages`` (contents as strings or lists of text parts) with each content in the form
    ``content_format`` (``auto`` resolved against ``template``, read with ``parse``) gives
    it."""
    if content_format == "auto":
        content_format = detect_content_format(template, parse)
    return [{**m, "content": _formatted(m.get("content"), content_format)} if "content" in m
            else m for m in messages]


def _formatted(content: Any, content_format: str) -> Any:
    if content_format == "openai":
        if content is None:
            return []
        return [{"type": "text", "text": content}] if isinstance(content, str) else content
    if isinstance(content, list):
        return "\n".join(_texts(content))
    return "" if content is None else content


def _texts(parts: list) -> Iterator[str]:
    return (p["text"] for p in parts if isinstance(p, dict) and "text" in p)
