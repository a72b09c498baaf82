"""vLLM's structural tags: the output is free text until one of the ``triggers`` appears; from
there it must be one of the ``structures``: its ``begin`` string, JSON matching its
``schema``, its ``end`` string; then free text again (tool calls such as
``<function=get_weather>{"city": "Paris"}</function>`` inside an answer).

vLLM 0.32's form, which its guidance backend runs (as a JSON text or a mapping)::

    {"type": "structural_tag", "triggers": ["<function="],
     "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}]}

Each ``begin`` starts with one of the triggers. It runs on llguidance's ``StructTag``: a
trigger written as a special token (``<tool_call>``) is matched as that token when the
tokenizer has it as one, else as text. vLLM's newer ``{"type": "structural_tag", "format":
{...}}`` form, xgrammar's language (vLLM's default backend; its guidance backend refuses
it), is written as llguidance's Lark where llguidance can express it
(structural_tag_format.py).
"""
from __future__ import annotations

import json
from typing import Callable, Union

from llm_serving import structural_tag_format

# vLLM's bound on a structural tag's nesting (its JSON schemas' 64 and 16 for the tag)
MAX_NESTING = 80
_KEYS = {"type", "structures", "triggers"}
_FORMAT_KEYS = {"type", "format"}
_STRUCTURE_KEYS = {"begin", "schema", "end"}


def parse(value: Union[str, dict]) -> dict:
    """The structural tag as ``{"structures": [...], "triggers": [...]}`` or ``{"format":
    {...}}`` (ValueError saying what is wrong, without the field's name, which the caller
    puts in front)."""
    too_deep = f"nested deeper than {MAX_NESTING} levels of objects and arrays (vLLM's bound)"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError(too_deep) from None
    if not isinstance(value, dict):
        raise ValueError("a structural tag is an object with structures and triggers")
    if _depth(value) > MAX_NESTING:
        raise ValueError(too_deep)
    keys = _FORMAT_KEYS if "format" in value else _KEYS
    unknown = sorted(set(value) - keys)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (a structural tag takes "
                         f"{', '.join(sorted(keys))})")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"type must be 'structural_tag', got {value['type']!r}")
    if "format" in value:
        structural_tag_format.to_lark(value["format"], dict, lambda text: False)
        return {"format": value["format"]}
    triggers, structures = value.get("triggers"), value.get("structures")
    if not isinstance(triggers, list) or not triggers or \
            not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers: a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures: a non-empty list of {begin, schema, end}")
    for i, s in enumerate(structures):
        where = f"structures[{i}]"
        if not isinstance(s, dict) or set(s) != _STRUCTURE_KEYS:
            raise ValueError(f"{where}: an object with exactly begin, schema and end")
        if not isinstance(s["begin"], str) or not isinstance(s["end"], str):
            raise ValueError(f"{where}: begin and end are strings")
        if not isinstance(s["schema"], dict):
            raise ValueError(f"{where}.schema: a JSON schema object")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}.begin {s['begin']!r} starts with none of the triggers "
                             f"{triggers}")
    return {"structures": structures, "triggers": triggers}


def _depth(value) -> int:
    """How deep objects and arrays nest in a JSON value (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is not None:
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in items)
    return deepest


def to_grammar(tag: dict, schema_of: Callable[[dict], dict],
               is_special: Callable[[str], bool]) -> str:
    """llguidance's grammar for a parsed structural tag: each structure's schema as
    ``schema_of`` gives it (with the request's JSON options), its trigger the first that its
    begin starts with (as vLLM). ``is_special(text)``: the tokenizer has that text as one
    special token; triggers written ``<...>`` are matched as special tokens only when all
    are."""
    import llguidance
    if "format" in tag:
        return structural_tag_format.to_lark(tag["format"], schema_of, is_special)
    tags = []
    for s in tag["structures"]:
        schema = schema_of(s["schema"])
        trigger = next(t for t in tag["triggers"] if s["begin"].startswith(t))
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema,
                                         end=s["end"]))
    special = [t.trigger for t in tags if t.trigger.startswith("<") and t.trigger.endswith(">")]
    return llguidance.StructTag.to_grammar(tags, assume_special=bool(special) and all(
        map(is_special, special)))
