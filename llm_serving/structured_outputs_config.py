"""``structured_outputs_config``: vLLM 0.32's engine-wide structured output settings.

Grammars run on llguidance here, which is vLLM's ``guidance`` backend: ``backend`` takes
``auto`` (this engine's defaults) or ``guidance`` (vLLM's guidance backend's JSON: any
whitespace between tokens unless ``disable_any_whitespace``); vLLM's other backends
(``xgrammar``, ``outlines``, ``lm-format-enforcer``) are refused by name. As vLLM checks:
``disable_any_whitespace`` needs backend ``guidance`` (or vLLM's xgrammar) and
``disable_additional_properties`` needs ``guidance``; an unknown key is refused.

- ``disable_any_whitespace``: JSON output is compact (``auto``'s default here already);
- ``disable_additional_properties``: an object schema with ``properties`` and no
  ``additionalProperties`` allows no other keys (JSON Schema's default allows any);
- ``reasoning_parser``: the chat routes' reasoning parser, as ``--reasoning-parser`` (which
  wins when both are given, as in vLLM);
- ``enable_in_reasoning``: the grammar holds from the first token, also while the model
  thinks (by default it holds from the end of the reasoning);
- ``reasoning_parser_plugin``: no plugins are loaded here; only empty is taken.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from llm_serving.errors import ConfigError, config_fields

KEY = "structured_outputs_config"
# vLLM's backends; only llguidance's runs here
VLLM_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
BACKENDS = ("auto", "guidance")
# JSON Schema keywords whose value is a map of names to subschemas, or one or more subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "additionalProperties", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties", "not", "if",
               "then", "else", "anyOf", "oneOf", "allOf")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False

    @classmethod
    def from_value(cls, value: Union[dict, str, None, "StructuredOutputsConfig"]
                   ) -> "StructuredOutputsConfig":
        """The defaults (None), a mapping of vLLM's keys, or that mapping as JSON."""
        if value is None or isinstance(value, cls):
            return value or cls()
        config = cls(**config_fields(KEY, value, cls))
        if config.backend not in BACKENDS:
            why = ("is vLLM's, not available here: grammars run on llguidance, vLLM's "
                   "guidance backend" if config.backend in VLLM_BACKENDS else "is not a backend")
            raise ConfigError(f"{KEY}.backend", f"{config.backend!r} {why} (use "
                              f"{' or '.join(BACKENDS)})")
        if config.disable_any_whitespace and config.backend != "guidance":
            raise ConfigError(f"{KEY}.disable_any_whitespace", "needs backend guidance, as "
                              "vLLM (JSON output is compact by default here)")
        if config.disable_additional_properties and config.backend != "guidance":
            raise ConfigError(f"{KEY}.disable_additional_properties", "needs backend "
                              "guidance, as vLLM")
        if config.reasoning_parser_plugin:
            raise ConfigError(f"{KEY}.reasoning_parser_plugin", "reasoning parser plugins "
                              "are not loaded here (reasoning_parser names a built-in one)")
        return config

    def json_defaults(self) -> dict:
        """llguidance's JSON options: compact JSON (one space allowed after ',' and ':') by
        default, as vLLM's disable_any_whitespace; with backend guidance, vLLM's guidance
        JSON, where any whitespace is allowed unless disable_any_whitespace."""
        return {"whitespace_flexible": self.backend == "guidance"
                and not self.disable_any_whitespace}

    def json_schema(self, schema: Any) -> Any:
        """A request's JSON schema as the grammar takes it: with disable_additional_properties,
        a copy where every object schema listing properties without an additionalProperties
        gets ``additionalProperties: false``."""
        if not self.disable_additional_properties:
            return schema
        return _closed_objects(schema)


def _closed_objects(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _closed_objects(s) for name, s in out[k].items()}
    for k in _SUBSCHEMAS:
        if isinstance(out.get(k), (dict, list)):
            out[k] = _closed_objects(out[k])
    if "additionalProperties" not in out and (isinstance(out.get("properties"), dict) or
                                              isinstance(out.get("patternProperties"), dict)):
        out["additionalProperties"] = False
    return out

