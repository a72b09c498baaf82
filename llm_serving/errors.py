"""Errors a user can act on. Each names what was wrong and what was expected."""


class LLMServingError(Exception):
    """Base class for errors raised by llm_serving."""


class ConfigError(LLMServingError, ValueError):
    """A configuration value is missing or invalid. The message starts with the key's path."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


def config_mapping(key: str, value) -> dict:
    """A section of vLLM's keys given as a mapping or as that mapping's JSON text (a
    ``--*-config`` flag's); ConfigError naming ``key`` otherwise."""
    if isinstance(value, str):
        import json
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(key, f"expected a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a mapping of vLLM's keys, got {value!r}")
    return value


def config_fields(key: str, value, cls) -> dict:
    """``config_mapping``'s mapping, its keys the fields of dataclass ``cls``, each value of
    its field's default's type; ConfigError naming ``key.<field>`` otherwise."""
    value = config_mapping(key, value)
    known = cls.__dataclass_fields__
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", "unknown key (vLLM's are "
                          + ", ".join(known) + ")")
    for k, v in value.items():
        kind = type(known[k].default)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ConfigError(f"{key}.{k}", f"expected a {kind.__name__}, got {v!r}")
    return value


class LogitsProcessorError(LLMServingError):
    """A custom logits processor (``logits_processors``) raised while a step ran; the
    message names its class and method. The step's requests fail, the engine goes on."""


class ModelLoadError(LLMServingError):
    """A model directory or checkpoint cannot be used (missing files, unsupported architecture)."""


class QueueFullError(LLMServingError):
    """The waiting queue (or an admission limit: max_num_queued_reqs, max_num_queued_tokens)
    is at its bound; the request was refused without being queued."""

    def __init__(self, max_waiting: int, message: str = ""):
        self.max_waiting = max_waiting
        super().__init__(message or f"the waiting queue is full ({max_waiting} requests, "
                         "max_waiting_requests); try again later")


class RequestIdInUseError(LLMServingError, ValueError):
    """A request id that a live request already has."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        super().__init__(f"request id {request_id!r} is already in use")


class EngineDeadError(LLMServingError):
    """The engine loop stopped on an error; no request can be served until it is restarted."""


class ShuttingDownError(LLMServingError):
    """The server is stopping: no new request is taken (the message says why)."""
