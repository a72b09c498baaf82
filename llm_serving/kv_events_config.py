"""``kv_events_config``: vLLM's ``--kv-events-config``, the stream of KV cache events (blocks
stored in and removed from the prefix cache, the cache cleared) a KV-aware router subscribes
to (engine/kv_events.py publishes them).

Its keys are vLLM's: ``enable_kv_cache_events``; ``publisher`` (``zmq``, or ``null``: none;
default zmq when enabled); ``endpoint`` (the ZeroMQ PUB socket: ``tcp://*:5557`` binds, a
host name connects); ``replay_endpoint`` (a ROUTER socket that resends missed batches;
default none); ``buffer_steps`` (batches kept for it); ``hwm`` (the PUB socket's high-water
mark); ``max_queue_size`` (batches waiting for the publisher thread); ``topic``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from llm_serving.errors import ConfigError, config_mapping

KEY = "kv_events_config"
PUBLISHERS = ("null", "zmq")
# the packages the zmq publisher needs (the kv_events extra)
PACKAGES = (("zmq", "pyzmq"), ("msgspec", "msgspec"))
_KINDS = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int,
          "max_queue_size": int}       # the other keys are strings
_WHAT = {bool: "true or false", int: "a positive integer", str: "a string"}


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def resolve(cls, value, enable_prefix_caching: bool) -> Optional["KVEventsConfig"]:
        """The config events are published with, None when they are off (no value, or
        publisher null); ConfigError naming ``kv_events_config.<key>`` for a value vLLM
        refuses, and for one that would publish nothing (vLLM warns and runs without)."""
        if value is None:
            return None
        data = dict(config_mapping(KEY, value))
        known = {f.name: f for f in fields(cls)}
        for k, v in data.items():
            if k not in known:
                raise ConfigError(f"{KEY}.{k}", "unknown key (vLLM's are "
                                  + ", ".join(known) + ")")
            kind = _KINDS.get(k, str)
            if v is None and k in ("publisher", "replay_endpoint"):
                continue
            if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 1)):
                raise ConfigError(f"{KEY}.{k}", f"expected {_WHAT[kind]}, got {v!r}")
        enabled = data.get("enable_kv_cache_events", False)
        publisher = data.get("publisher") or ("zmq" if enabled else "null")
        if publisher not in PUBLISHERS:
            raise ConfigError(f"{KEY}.publisher", f"expected zmq or null, got {publisher!r}")
        if publisher == "null":
            return None
        if not enabled:
            raise ConfigError(f"{KEY}.enable_kv_cache_events", f"the {publisher} publisher "
                              "publishes nothing unless it is true")
        if not enable_prefix_caching:
            raise ConfigError(f"{KEY}.enable_kv_cache_events", "needs enable_prefix_caching: "
                              "the events are the prefix cache's (blocks stored and removed)")
        for module, package in PACKAGES:
            try:
                __import__(module)
            except ImportError as e:
                raise ConfigError(KEY, f"the zmq publisher needs {package} ({e}): pip install "
                                  "'llm_serving[kv_events]'") from None
        return cls(**{**data, "publisher": publisher})
