"""The requests of PD disaggregation's HTTP contract, per route (docs/pd_disaggregation.md).

A client's body becomes:

- a prefill request to a producer (``prefill_request``): the same body with its max-tokens
  field(s) 1 (``max_output_tokens`` on ``/v1/responses``), ``stream`` false and
  ``kv_transfer_params: {"do_remote_decode": true}``. The producer's JSON answer carries the
  ``kv_transfer_params`` a consumer needs;
- a decode request to a consumer (``with_kv_params``): the client's body with
  ``kv_transfer_params`` set, either to the producer's answer (first P, then D) or to
  ``{"do_remote_prefill": true, "remote_prefill_url": P}`` (first D: the consumer's server
  asks P itself, ``entrypoints/remote_prefill.py``).

The OpenAI routes carry ``kv_transfer_params`` at the top level (vLLM's place); llm-serving's
generate routes inside ``parameters``. A completion request of several prompts gets one offer
per prompt (``per_prompt_offers`` / ``offer_of_prompt``), so no prompt is handed another's.
Shared by the proxy and the consumer-side hook, so both speak the same contract. Plain data:
no HTTP client, no engine.
"""
from __future__ import annotations

import copy
from typing import Optional

OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
KV_FIELD = "kv_transfer_params"
# A completion request of several prompts: the producer's answer holds one offer per prompt,
# in order, under this key; the consumer gives each prompt its own.
PROMPTS_KEY = "prompts"
# Keys a first-D request carries; anything else means the producer's parameters are there.
D_FIRST_KEYS = {"do_remote_prefill", "remote_prefill_url", "do_remote_decode"}


def generate_model(path: str) -> Optional[str]:
    """The model segment of an llm-serving generate route (``/models/{m}``,
    ``/models/{m}/generate``, ``/models/{m}/generate_stream``), else None."""
    parts = path.strip("/").split("/")
    if len(parts) in (2, 3) and parts[0] == "models" and parts[1] and (
            len(parts) == 2 or parts[2] in ("generate", "generate_stream")):
        return parts[1]
    return None


def is_generation_route(path: str) -> bool:
    return path in OPENAI_ROUTES or generate_model(path) is not None


def is_stream(path: str, body: dict) -> bool:
    """Whether the client asked for a stream (the route decides on llm-serving's
    ``generate`` / ``generate_stream``)."""
    if path.endswith("/generate_stream"):
        return True
    if path.endswith("/generate"):
        return False
    return bool(body.get("stream"))


def kv_params(path: str, body: dict):
    """The ``kv_transfer_params`` a body carries, or None."""
    if path in OPENAI_ROUTES:
        return body.get(KV_FIELD)
    params = body.get("parameters")
    return params.get(KV_FIELD) if isinstance(params, dict) else None


def with_kv_params(path: str, body: dict, params: Optional[dict]) -> dict:
    """A copy of ``body`` carrying ``params`` as its kv_transfer_params (None: removed)."""
    out = dict(body)
    if path in OPENAI_ROUTES:
        holder = out
    else:
        holder = out["parameters"] = dict(out.get("parameters") or {})
    if params is None:
        holder.pop(KV_FIELD, None)
    else:
        holder[KV_FIELD] = params
    return out


def prefill_request(path: str, body: dict) -> tuple[str, dict]:
    """(route, body) of the request asking a producer to prefill the client's prompt and
    keep its KV for a consumer."""
    out = copy.deepcopy(body)
    out["stream"] = False
    out.pop("stream_options", None)
    if path == "/v1/responses":
        out["max_output_tokens"] = 1
        out[KV_FIELD] = {"do_remote_decode": True}
        return path, out
    if path in OPENAI_ROUTES:
        out["max_tokens"] = 1
        out.pop("n", None)          # the prompt is computed once, whatever n D samples
        out.pop("min_tokens", None)
        if path == "/v1/chat/completions":
            out["max_completion_tokens"] = 1
        out[KV_FIELD] = {"do_remote_decode": True}
        return path, out
    params = out["parameters"] = dict(out.get("parameters") or {})
    params["max_new_tokens"] = 1
    params["return_full_text"] = False
    params[KV_FIELD] = {"do_remote_decode": True}
    return f"/models/{generate_model(path)}/generate", out


def is_d_first(params) -> bool:
    """A consumer's request that names the producer to ask (first D, then P), rather than
    carrying the producer's answer."""
    return (isinstance(params, dict) and bool(params.get("remote_prefill_url"))
            and set(params) <= D_FIRST_KEYS)


def per_prompt_offers(offers: list) -> dict:
    """A producer's ``kv_transfer_params`` for a request of several prompts: each prompt's
    offer (None: it offered nothing), in the order of the prompts."""
    return {"do_remote_prefill": True, "do_remote_decode": False, PROMPTS_KEY: offers}


def offer_of_prompt(params: Optional[dict], i: int, count: int) -> Optional[dict]:
    """The ``kv_transfer_params`` prompt ``i`` of ``count`` takes from a request's: its own
    offer when the producer answered per prompt, else the request's. ValueError when the
    per-prompt offers do not match the prompts."""
    if not isinstance(params, dict) or PROMPTS_KEY not in params:
        return params
    offers = params[PROMPTS_KEY]
    if not isinstance(offers, list) or len(offers) != count:
        raise ValueError(f"{KV_FIELD}.{PROMPTS_KEY}: expected one offer per prompt ({count}), "
                         f"got {len(offers) if isinstance(offers, list) else repr(offers)}")
    if offers[i] is not None and not isinstance(offers[i], dict):
        raise ValueError(f"{KV_FIELD}.{PROMPTS_KEY}[{i}]: expected an object or null")
    return offers[i]
