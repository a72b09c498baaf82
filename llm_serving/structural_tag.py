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
{...}}`` form is xgrammar's language (vLLM's default backend): llguidance does not read it,
so it is refused by name, as vLLM's guidance backend refuses it.
"""
from __future__ import annotations

import json
from typing import Callable, Union

_KEYS = {"type", "structures", "triggers"}
_STRUCTURE_KEYS = {"begin", "schema", "end"}


def parse(value: Union[str, dict]) -> dict:
    """The structural tag as ``{"structures": [...], "triggers": [...]}`` (ValueError saying
    what is wrong, without the field's name, which the caller puts in front)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("a structural tag is an object with structures and triggers")
    if "format" in value:
        raise ValueError("the 'format' form is xgrammar's (vLLM's default backend), which "
                         "does not run here: grammars run on llguidance (vLLM's guidance "
                         "backend, which refuses it too); give structures and triggers")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (a structural tag takes "
                         f"{', '.join(sorted(_KEYS))})")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"type must be 'structural_tag', got {value['type']!r}")
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


def to_grammar(tag: dict, schema_of: Callable[[dict], dict],
               is_special: Callable[[str], bool]) -> str:
    """llguidance's grammar for a parsed structural tag: each structure's schema as
    ``schema_of`` gives it (with the request's JSON options), its trigger the first that its
    begin starts with (as vLLM). ``is_special(text)``: the tokenizer has that text as one
    special token; triggers written ``<...>`` are matched as special tokens only when all
    are."""
    import llguidance
    tags = []
    for s in tag["structures"]:
        schema = schema_of(s["schema"])
        trigger = next(t for t in tag["triggers"] if s["begin"].startswith(t))
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema,
                                         end=s["end"]))
    special = [t.trigger for t in tags if t.trigger.startswith("<") and t.trigger.endswith(">")]
    return llguidance.StructTag.to_grammar(tags, assume_special=bool(special) and all(
        map(is_special, special)))
