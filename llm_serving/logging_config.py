"""How the process logs: ``--log-level`` and vLLM 0.32's ``--logging-config`` (JSON, its
LoggingConfig's keys):

- ``log_level``: CRITICAL, ERROR, WARNING, INFO, DEBUG or NOTSET (``--log-level`` wins);
- ``formatter``: ``text`` (the default: time, level, logger, message) or ``json`` (one JSON
  object a line, python-json-logger's, with vLLM's keys: ``asctime``, ``levelname``,
  ``name``, ``processName``, ``process``, ``message``, ``exc_info`` when given);
- ``configure_logging``: false leaves Python's logging unconfigured (vLLM's
  VLLM_CONFIGURE_LOGGING=0);
- ``pylogging_config_file``: a ``logging.config.dictConfig`` JSON file, which then decides
  the loggers, handlers and formats (``disable_existing_loggers`` is false unless it says).

vLLM's VLLM_LOGGING_LEVEL, VLLM_CONFIGURE_LOGGING, VLLM_LOGGING_CONFIG_PATH and
VLLM_LOGGING_PREFIX are the defaults of the level, configure_logging, pylogging_config_file and
a text line's prefix (``vllm_env.py``).
"""
from __future__ import annotations

import json
import logging
import logging.config
from typing import Optional

from pythonjsonlogger.json import JsonFormatter

from llm_serving import vllm_env
from llm_serving.errors import ConfigError

KEY = "--logging-config"
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
FORMATTERS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JSON_FORMAT = "%(asctime)s %(levelname)s %(name)s %(processName)s %(process)d %(message)s"  # vLLM's


def configure_logging(log_level: Optional[str], config: Optional[dict]) -> str:
    """Set up the process's logging; the level name (for the WorkAgents)."""
    config = dict(config or {})
    known = ("log_level", "formatter", "configure_logging", "pylogging_config_file")
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ConfigError(f"{KEY}.{unknown[0]}", f"unknown key (vLLM's are {', '.join(known)})")
    given = log_level or config.get("log_level")
    level = (given or vllm_env.log_level() or "info").upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"{KEY}.log_level" if given else "VLLM_LOGGING_LEVEL",
                          f"expected one of {', '.join(LOG_LEVELS)}, got "
                          f"{given or vllm_env.log_level()!r}")
    formatter = config.get("formatter", "text")
    if formatter not in FORMATTERS:
        raise ConfigError(f"{KEY}.formatter", f"expected text or json, got {formatter!r}")
    if config.get("configure_logging", vllm_env.configure_logging()) is False:
        return level
    path = config.get("pylogging_config_file") or vllm_env.logging_config_path()
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                schema = json.load(f)
            # this package's loggers exist by now: kept on unless the file says otherwise
            schema.setdefault("disable_existing_loggers", False)
            logging.config.dictConfig(schema)
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"{KEY}.pylogging_config_file" if config.get(
                "pylogging_config_file") else "VLLM_LOGGING_CONFIG_PATH", f"{path}: {e}") from None
        return level
    handler = logging.StreamHandler()
    prefix = vllm_env.logging_prefix()
    handler.setFormatter(JsonFormatter(JSON_FORMAT) if formatter == "json" else
                         logging.Formatter(prefix + TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, level), handlers=[handler])
    return level
