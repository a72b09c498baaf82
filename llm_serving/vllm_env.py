"""vLLM's environment variables a vLLM-CPU user sets, read here with vLLM's meaning. Each is a
default: a flag, a config file key or an ``LLM(...)`` argument given explicitly wins. A value
that cannot mean anything is a ConfigError naming the variable.

- ``VLLM_CPU_KVCACHE_SPACE``: GiB of KV cache per WorkAgent (``kv_cache_space``, else 2);
- ``VLLM_CPU_OMP_THREADS_BIND``: the cores of each WorkAgent, ranks separated by '|'
  (``0-31|32-63``, as ``cpu_affinity``); ``auto`` (vLLM's default) and ``nobind`` leave them
  unpinned;
- ``VLLM_LOGGING_LEVEL``: the log level (``--log-level``);
- ``VLLM_CONFIGURE_LOGGING``: 0 leaves Python's logging as it is;
- ``VLLM_LOGGING_CONFIG_PATH``: a ``logging.config.dictConfig`` JSON file;
- ``VLLM_LOGGING_PREFIX``: text put before every log line;
- ``VLLM_LOG_STATS_INTERVAL``: seconds between the stats lines (``--log-stats-interval``;
  vLLM takes 10 for a value <= 0);
- ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: seconds an idle HTTP connection is kept open (5);
- ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: 0 publishes KV events' block hashes as their 32
  bytes, else (vLLM's default) as their low 64 bits, an integer (``--kv-events-config``).
- ``VLLM_SERVER_DEV_MODE``: 1 adds vLLM's development routes (``/reset_prefix_cache``,
  ``/server_info``, ...: entrypoints/dev_routes.py).

Read where their feature lives: ``VLLM_API_KEY`` (``--api-key``),
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``,
``VLLM_ENABLE_RESPONSES_API_STORE``.
"""
from __future__ import annotations

import os
from typing import Optional

from llm_serving.errors import ConfigError

DEFAULT_KV_CACHE_SPACE = 2.0        # GiB
DEFAULT_LOG_STATS_INTERVAL = 10.0   # seconds
DEFAULT_HTTP_KEEP_ALIVE = 5         # seconds (uvicorn's and vLLM's)


def _get(name: str) -> Optional[str]:
    value = os.environ.get(name, "").strip()
    return value or None


def _number(name: str, kind=float) -> Optional[float]:
    text = _get(name)
    if text is None:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(name, f"expected {'an integer' if kind is int else 'a number'}, "
                          f"got {text!r}") from None


def kv_cache_space() -> float:
    space = _number("VLLM_CPU_KVCACHE_SPACE")
    if space is None:
        return DEFAULT_KV_CACHE_SPACE
    if space <= 0:
        raise ConfigError("VLLM_CPU_KVCACHE_SPACE", f"expected GiB > 0, got {space:g}")
    return space


def cpu_affinity() -> Optional[str]:
    bind = _get("VLLM_CPU_OMP_THREADS_BIND")
    return None if bind in (None, "auto", "nobind") else bind


def log_level() -> Optional[str]:
    return _get("VLLM_LOGGING_LEVEL")


def configure_logging() -> bool:
    return _get("VLLM_CONFIGURE_LOGGING") != "0"


def logging_config_path() -> Optional[str]:
    return _get("VLLM_LOGGING_CONFIG_PATH")


def logging_prefix() -> str:
    """VLLM_LOGGING_PREFIX as the literal start of a logging format."""
    return os.environ.get("VLLM_LOGGING_PREFIX", "").replace("%", "%%")


def log_stats_interval() -> float:
    interval = _number("VLLM_LOG_STATS_INTERVAL")
    return interval if interval is not None and interval > 0 else DEFAULT_LOG_STATS_INTERVAL


def http_keep_alive() -> int:
    seconds = _number("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", int)
    if seconds is None:
        return DEFAULT_HTTP_KEEP_ALIVE
    if seconds < 0:
        raise ConfigError("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", f"expected seconds >= 0, got {seconds}")
    return seconds


def kv_events_int_hashes() -> bool:
    value = _number("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int)
    return value is None or bool(value)


def server_dev_mode() -> bool:
    value = _number("VLLM_SERVER_DEV_MODE", int)
    return bool(value)
