"""vLLM 0.32's newer structural tag form, ``{"type": "structural_tag", "format": {...}}``: a
format of xgrammar's structural tag language, written here as an llguidance Lark grammar.

The formats taken, with xgrammar's meaning (a key left out takes xgrammar's default):

- ``const_string`` (``value``), ``regex`` (``pattern``), ``json_schema`` (``json_schema``;
  JSON style only, with the request's JSON whitespace), ``sequence`` / ``or`` (``elements``),
  ``optional`` / ``star`` / ``plus`` (``content``);
- ``tag`` (``begin`` string, ``content``, ``end`` string or list of them): ``any_text`` as its
  content is any text up to the first end string;
- ``triggered_tags`` (``triggers``, ``tags``, ``at_least_one``, ``stop_after_first``): free
  text until a trigger, then the tag whose begin starts with it (the first such), and so on
  (at_least_one: a tag first; stop_after_first: nothing after one tag); a trigger the
  tokenizer has as one special token is matched as that token;
- ``tags_with_separator`` (``tags``, ``separator``, ``at_least_one``, ``stop_after_first``):
  tags one after another with the separator between them, nothing else;
- ``any_text`` as the whole format or a tag's content.

The others (token and dispatch formats, ``grammar``'s EBNF, ``repeat``, ``qwen_xml_parameter``,
JSON styles other than ``json``, ``any_order``, ``excludes``, ``max_tokens``,
``max_chars``, ``max_whitespace_cnt``) are xgrammar's own: a ValueError names the format's
path and what is not taken.
"""
from __future__ import annotations

import json
from typing import Any, Callable

_TEXT = "TAG_TEXT"
# per type: its keys, and for xgrammar's options not taken here the only value taken
_TYPES: dict[str, dict[str, Any]] = {
    "const_string": {"value": None},
    "regex": {"pattern": None, "excludes": []},
    "json_schema": {"json_schema": None, "style": "json", "any_order": False,
                    "max_whitespace_cnt": None, "excludes": []},
    "any_text": {"excludes": [], "max_tokens": None, "max_chars": None},
    "sequence": {"elements": None}, "or": {"elements": None},
    "optional": {"content": None}, "star": {"content": None}, "plus": {"content": None},
    "tag": {"begin": None, "content": None, "end": None},
    "triggered_tags": {"triggers": None, "tags": None, "at_least_one": None,
                       "stop_after_first": None, "excludes": []},
    "tags_with_separator": {"tags": None, "separator": None, "at_least_one": None,
                            "stop_after_first": None},
}
_REQUIRED = {"value", "pattern", "json_schema", "elements", "content", "begin", "end",
             "triggers", "tags", "separator"}


def to_lark(fmt: Any, schema_of: Callable[[dict], dict],
            is_special: Callable[[str], bool]) -> str:
    """The Lark grammar of a format (ValueError naming the path of what is wrong).
    ``schema_of`` gives a JSON schema as the grammar takes it, ``is_special(text)`` whether
    the tokenizer has that text as one special token."""
    lark = _Lark(schema_of, is_special)
    start = lark.format("format", fmt, top=True)
    return "\n".join(["%llguidance {}", f"start: {start}", *lark.rules,
                      f"{_TEXT}: /(.|\\n)*/"])


class _Lark:
    def __init__(self, schema_of, is_special):
        self.schema_of, self.is_special = schema_of, is_special
        self.rules: list[str] = []

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def format(self, path: str, f: Any, top: bool = False) -> str:
        kind = f.get("type") if isinstance(f, dict) else None
        if kind not in _TYPES:
            raise ValueError(f"{path}.type: {kind!r} is not taken here (xgrammar's formats "
                             f"that run on llguidance: {', '.join(_TYPES)})" if kind else
                             f"{path}: a format is an object with a type")
        keys = _TYPES[kind]
        for k in sorted(set(f) - {"type"}):
            if k not in keys:
                raise ValueError(f"{path}.{k}: not a key of format {kind!r}")
            if keys[k] is not None and f[k] != keys[k]:
                raise ValueError(f"{path}.{k}: xgrammar's, not taken here (only "
                                 f"{json.dumps(keys[k])})")
        missing = sorted(k for k in keys if k in _REQUIRED and k not in f)
        if missing:
            raise ValueError(f"{path}.{missing[0]}: missing")
        return getattr(self, "_" + kind)(path, f, top)

    def _const_string(self, path, f, top):
        return _literal(_string(f"{path}.value", f["value"]))

    def _regex(self, path, f, top):
        return "/" + _string(f"{path}.pattern", f["pattern"]).replace("/", "\\/") + "/"

    def _json_schema(self, path, f, top):
        schema = f["json_schema"]
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError(f"{path}.json_schema: a JSON schema object")
        return "%json " + json.dumps(self.schema_of(schema))

    def _any_text(self, path, f, top):
        if not top:
            raise ValueError(f"{path}: any_text is taken as the whole format or a tag's "
                             "content only")
        return _TEXT

    def _sequence(self, path, f, top):
        return "(" + " ".join(self._all(path, f["elements"])) + ")"

    def _or(self, path, f, top):
        return "(" + " | ".join(self._all(path, f["elements"])) + ")"

    def _optional(self, path, f, top):
        return f"({self.format(path + '.content', f['content'])})?"

    def _star(self, path, f, top):
        return f"({self.format(path + '.content', f['content'])})*"

    def _plus(self, path, f, top):
        return f"({self.format(path + '.content', f['content'])})+"

    def _tag(self, path, f, top, trigger: str = ""):
        """begin content end; with a trigger, the begin less the trigger (already matched)."""
        begin = _string(f"{path}.begin", f["begin"])
        ends = f["end"] if isinstance(f["end"], list) else [f["end"]]
        if not ends or not all(isinstance(e, str) for e in ends):
            raise ValueError(f"{path}.end: a string or a non-empty list of strings")
        end = "(" + " | ".join(_literal(e) for e in ends) + ")"
        content = f["content"]
        if isinstance(content, dict) and content.get("type") == "any_text":
            self.format(path + ".content", content, top=True)    # its keys checked
            if not all(ends):
                raise ValueError(f"{path}.end: any_text content needs a non-empty end")
            body = self.rule(f"{_TEXT} {end}", lazy=True)
        else:
            body = f"{self.format(path + '.content', content)} {end}"
        return f"{_literal(begin[len(trigger):])} {body}"

    def _tags(self, path: str, f: dict) -> list:
        tags = f["tags"]
        if not isinstance(tags, list) or not tags:
            raise ValueError(f"{path}.tags: a non-empty list of tag formats")
        for i, t in enumerate(tags):
            if not isinstance(t, dict) or t.get("type", "tag") != "tag":
                raise ValueError(f"{path}.tags[{i}]: a tag format")
        return tags

    def _triggered_tags(self, path, f, top):
        """Free text until a trigger, then its tag, and so on; with at_least_one the output
        starts with a tag (xgrammar's: what tool_choice "required" asks), with
        stop_after_first it ends after one."""
        at_least_one, stop = _flags(path, f)
        triggers = f["triggers"]
        if not isinstance(triggers, list) or not triggers or \
                not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{path}.triggers: a non-empty list of non-empty strings")
        alts, first = [], []
        for i, t in enumerate(self._tags(path, f)):
            where, t = f"{path}.tags[{i}]", {"type": "tag", **t}
            begin = _string(f"{where}.begin", t.get("begin"))
            trigger = next((g for g in triggers if begin.startswith(g)), None)
            if trigger is None:
                raise ValueError(f"{where}.begin {begin!r} starts with none of the triggers "
                                 f"{triggers}")
            body = self._tag(where, t, False, trigger)
            if self.is_special(trigger):
                alts.append(self.rule(f"{_TEXT} {trigger} {body}"))
            else:
                alts.append(self.rule(f"{self.rule(f'{_TEXT} {_literal(trigger)}', True)} "
                                      f"{body}"))
            first.append(self._tag(where, t, False))
        tag, first = "(" + " | ".join(alts) + ")", "(" + " | ".join(first) + ")"
        if at_least_one:
            return first if stop else f"({first} {tag}* {_TEXT})"
        return f"({tag} | {_TEXT})" if stop else f"({tag}* {_TEXT})"

    def _tags_with_separator(self, path, f, top):
        """Tags with the separator between them and nothing else: none or more, at least
        one with at_least_one, at most one with stop_after_first."""
        at_least_one, stop = _flags(path, f)
        alts = [self._tag(f"{path}.tags[{i}]", {"type": "tag", **t}, False)
                for i, t in enumerate(self._tags(path, f))]
        tag = "(" + " | ".join(alts) + ")"
        sep = _literal(_string(f"{path}.separator", f["separator"]))
        some = tag if stop else f"({tag} ({sep} {tag})*)"
        return some if at_least_one else f"({some})?"

    def _all(self, path: str, elements: Any) -> list[str]:
        if not isinstance(elements, list) or not elements:
            raise ValueError(f"{path}.elements: a non-empty list of formats")
        return [self.format(f"{path}.elements[{i}]", e) for i, e in enumerate(elements)]


def _flags(path: str, f: dict) -> tuple[bool, bool]:
    """A tags format's at_least_one and stop_after_first (false when left out)."""
    for k in ("at_least_one", "stop_after_first"):
        if not isinstance(f.get(k, False), bool):
            raise ValueError(f"{path}.{k}: true or false")
    return f.get("at_least_one", False), f.get("stop_after_first", False)


def _string(path: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{path}: a string")
    return value


def _literal(text: str) -> str:
    return json.dumps(text) if text else '""'
