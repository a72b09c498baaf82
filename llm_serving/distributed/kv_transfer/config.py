"""KV transfer's configuration: which connector an instance runs, and in which role.

vLLM's shape, so a vLLM user's ``--kv-transfer-config`` reads the same here::

    --kv-transfer-config '{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}'

or the ``kv_transfer:`` YAML section with the same keys. Beside vLLM's keys it carries our
failure handling: ``kv_transfer_timeout`` (seconds a transfer may take, on both sides: the
consumer gives up reading, the producer frees the blocks it held for the reader) and
``kv_failure_policy`` (``recompute``: the consumer computes the prefill itself; ``fail``: the
request ends with a clear error; vLLM's name, ``kv_load_failure_policy``, is taken too).
vLLM's ``kv_buffer_device`` is taken as ``cpu`` or ``npu`` (the blocks are read where the
cache is). As vLLM's MooncakeStoreConnector, the pool's settings may come from the JSON file
that ``MOONCAKE_CONFIG_PATH`` names; ``kv_connector_extra_config`` wins over it.

Every key is checked on construction; an error names ``kv_transfer.<key>``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

from llm_serving.errors import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")
# What a user writes as kv_connector (vLLM's names), and what each is.
CONNECTORS = {
    "MooncakeConnector": "P2P: the consumer reads the producer's KV blocks over Mooncake's "
                         "TransferEngine",
    "MooncakeStoreConnector": "pool: full blocks put in / got from a MooncakeDistributedStore, "
                              "keyed by prefix hash",
    "InProcessConnector": "tests: blocks handed over in this process",
}
# The keys each connector understands in kv_connector_extra_config (anything else is refused).
EXTRA_KEYS = {
    "MooncakeConnector": {"local_hostname", "protocol", "device_name"},
    "MooncakeStoreConnector": {"master_server_address", "metadata_server", "local_hostname",
                               "protocol", "device_name", "global_segment_size",
                               "local_buffer_size"},
    "InProcessConnector": {"load_delay"},
}

# What vLLM's Mooncake store config file (MOONCAKE_CONFIG_PATH) may hold beyond those keys, and
# the one value of each that we run.
STORE_FILE_FIXED = {"mode": ("embedded",), "enable_offload": (False,),
                    "tenant_id": (None, "", "default")}
SIZE_KEYS = ("global_segment_size", "local_buffer_size")
_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}


def _key(name: str) -> str:
    return f"kv_transfer.{name}"


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_transfer_timeout: float = 30.0
    kv_failure_policy: str = "recompute"
    # vLLM's key for which of several instances this is; informative here (logged, metrics).
    engine_id: Optional[str] = None

    def __post_init__(self):
        if self.kv_connector not in CONNECTORS:
            raise ConfigError(_key("kv_connector"), f"expected one of "
                              f"{', '.join(CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ConfigError(_key("kv_role"), f"expected one of {', '.join(KV_ROLES)}, "
                              f"got {self.kv_role!r}")
        t = self.kv_transfer_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError(_key("kv_transfer_timeout"), f"expected seconds > 0, got {t!r}")
        if self.kv_failure_policy not in FAILURE_POLICIES:
            raise ConfigError(_key("kv_failure_policy"), f"expected one of "
                              f"{', '.join(FAILURE_POLICIES)}, got {self.kv_failure_policy!r}")
        if self.engine_id is not None and not isinstance(self.engine_id, str):
            raise ConfigError(_key("engine_id"), f"expected a string, got {self.engine_id!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, Mapping):
            raise ConfigError(_key("kv_connector_extra_config"),
                              f"expected a mapping, got {extra!r}")
        if self.kv_connector == "MooncakeStoreConnector" and os.environ.get(
                "MOONCAKE_CONFIG_PATH"):
            extra = {**_store_config_file(os.environ["MOONCAKE_CONFIG_PATH"]), **extra}
        allowed = EXTRA_KEYS[self.kv_connector]
        for k in extra:
            if k not in allowed:
                raise ConfigError(_key(f"kv_connector_extra_config.{k}"),
                                  f"unknown key for {self.kv_connector}; known ones are "
                                  + ", ".join(sorted(allowed)))
        if self.kv_connector == "MooncakeStoreConnector":
            addr = extra.get("master_server_address")
            if not isinstance(addr, str) or not _host_port(addr):
                raise ConfigError(_key("kv_connector_extra_config.master_server_address"),
                                  "MooncakeStoreConnector needs the store master's "
                                  "host:port (e.g. \"127.0.0.1:50051\"), got "
                                  f"{addr!r}")
        extra = {k: (_size(k, v) if k in SIZE_KEYS else v) for k, v in extra.items()}
        # Frozen and hashable: keep our own copy of the extra mapping.
        object.__setattr__(self, "kv_connector_extra_config", extra)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: Any = None) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> Optional["KVTransferConfig"]:
        """From the YAML section / ``--kv-transfer-config`` JSON; None when absent. Unknown
        keys are refused by name."""
        if data is None:
            return None
        if not isinstance(data, Mapping):
            raise ConfigError("kv_transfer", f"expected a mapping of keys, got {data!r}")
        data = cls._vllm_keys(data)
        known = {f.name for f in fields(cls)}
        for k in data:
            if k not in known:
                raise ConfigError(_key(k), "unknown key; known ones are "
                                  + ", ".join(sorted(known)))
        if "kv_connector" not in data:
            raise ConfigError(_key("kv_connector"), "missing: the connector to use, one of "
                              + ", ".join(CONNECTORS))
        return cls(**dict(data))

    @classmethod
    def _vllm_keys(cls, data: Mapping[str, Any]) -> dict:
        """vLLM's KVTransferConfig keys that mean something here, in our terms."""
        data = dict(data)
        if "kv_load_failure_policy" in data:
            policy = data.pop("kv_load_failure_policy")
            if policy not in FAILURE_POLICIES:
                raise ConfigError(_key("kv_load_failure_policy"), f"expected one of "
                                  f"{', '.join(FAILURE_POLICIES)}, got {policy!r}")
            if data.setdefault("kv_failure_policy", policy) != policy:
                raise ConfigError(_key("kv_load_failure_policy"), f"{policy!r} disagrees with "
                                  f"kv_failure_policy {data['kv_failure_policy']!r}")
        device = data.pop("kv_buffer_device", "cpu")
        if device not in ("cpu", "npu"):
            raise ConfigError(_key("kv_buffer_device"), f"expected cpu or npu (the blocks are "
                              f"read where the KV cache is), got {device!r}")
        return data

    def with_engine_id(self) -> "KVTransferConfig":
        """This config with ``engine_id`` decided (hostname, pid and a random part when not
        given), so that the master and its agents name the instance alike."""
        if self.engine_id is not None:
            return self
        import dataclasses
        import os
        import secrets
        return dataclasses.replace(
            self, engine_id=f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(3)}")

    def to_dict(self) -> dict:
        return {f.name: (dict(getattr(self, f.name)) if f.name == "kv_connector_extra_config"
                         else getattr(self, f.name)) for f in fields(self)}


def _size(key: str, value: Any) -> int:
    """A byte count: an integer, or a string with a unit as Mooncake's config files write it
    ("4GB", "512 MB", "1.5gb")."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?b)?\s*", value, re.I) \
        if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(_key(f"kv_connector_extra_config.{key}"), "expected a positive "
                          f"number of bytes, or a string such as \"4GB\", got {value!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _store_config_file(path: str) -> dict:
    """The store settings of vLLM's Mooncake config file, checked: a key we do not run with
    the value given is refused by name."""
    where = f"MOONCAKE_CONFIG_PATH ({path})"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(where, f"cannot read a JSON object: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(where, f"expected a JSON object, got {data!r}")
    out = {}
    for k, v in data.items():
        if k in STORE_FILE_FIXED:
            if v not in STORE_FILE_FIXED[k]:
                raise ConfigError(f"{where}.{k}", f"only {STORE_FILE_FIXED[k][0]!r} is "
                                  f"supported, got {v!r}")
        elif k in EXTRA_KEYS["MooncakeStoreConnector"]:
            out[k] = v
        else:
            raise ConfigError(f"{where}.{k}", "unknown key; known ones are " + ", ".join(
                sorted(EXTRA_KEYS["MooncakeStoreConnector"] | set(STORE_FILE_FIXED))))
    return out


def _host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
