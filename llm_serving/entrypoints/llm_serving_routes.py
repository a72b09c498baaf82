"""llm-serving's own routes, with its request fields, response shapes and stream framing
(``LLM_SERVING_COMPAT.md``), so its clients (performance_serving among them) work unchanged.

- ``POST /models/{model}/generate``: one JSON line.
- ``POST /models/{model}/generate_stream``: one JSON line per generated token, however far
  the client lags (its clients count lines and read each line's token). With
  return_protocol "sse" (the default) each line is
  ``{"event":"message","retry":30000,"data":[{...}]}``; with any other protocol it is
  ``data:{...}``. With return_full_text (llm-serving's default: true), a last line carries
  the whole text.
- ``POST /models/{model}``: either, by the body's ``stream``.
- ``GET /serving/get_bs``, ``/serving/get_request_numbers``, ``/serving/get_serverd_model_info``.

``{model}`` is the served model name; ``llama2`` and ``internlm`` (llm-serving's two route
names, whatever model it served) are always accepted. Unlike llm-serving, the
seed, stop strings, repetition penalty and per-request temperature are honoured, the last
token's text is never lost, and a field the routes do not know is refused with a 400 naming
it (llm-serving dropped it silently). A null field takes its default, as in llm-serving. As
in llm-serving, a model served as ``baichuan2pa`` or ``internlm_7b`` gets its inputs in that
model's prompt format (``llm_serving_prompts.py``), and max_model_len (its
max_generate_length) caps prompt + output: a request for more new tokens than the prompt
leaves ends at the cap with "length".
"""
from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llm_serving.entrypoints import remote_prefill, unread_offers
from llm_serving.entrypoints.llm_serving_prompts import llm_serving_prompt
from llm_serving.entrypoints.http_common import (HTTPError, ServerState,
                                                llm_serving_finish_reason, log_request,
                                                log_arrival, new_request_id, output_error,
                                                refuse_unsupported, renamed, request_trace, sse,
                                                stream_or_disconnect, translate_error)
from llm_serving.sampling_params import (RequestOutputKind, SamplingParams,
                                         StructuredOutputsParams)

router = APIRouter()
DEFAULT_MAX_NEW_TOKENS = 300      # llm-serving's default
# llm-serving's route names (/models/llama2..., /models/internlm...), served whatever the model
LLM_SERVING_MODELS = ("llama2", "internlm")


class Grammar(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json", "json_schema", "regex"]
    value: Union[str, dict[str, Any]]

    def structured(self) -> StructuredOutputsParams:
        if self.type == "regex":
            if not isinstance(self.value, str):
                raise ValueError("grammar: a regex value is a string")
            return StructuredOutputsParams(regex=self.value)
        value = self.value
        if self.type == "json_schema" and isinstance(value, dict) and "schema" in value:
            value = value["schema"]      # TGI's {"name": ..., "schema": {...}}
        return StructuredOutputsParams(json=value)


class _LlmServingBody(BaseModel):
    """A field we do not know is refused by name. A null field takes its default:
    llm-serving's own client sends every field of its model, the unset ones as null, and
    llm-serving filled them in."""
    # A NaN or an infinity is refused as such (not as "should be >= 0").
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


LLM_SERVING_TOP_K = 3       # llm-serving's top_k when a sampling request gives none


class Parameters(_LlmServingBody):
    do_sample: bool = False
    repetition_penalty: float = Field(1.0, gt=0)
    temperature: float = Field(1.0, ge=0)
    # Unset, llm-serving sampled among the 3 likeliest tokens (server_app.send_request);
    # 0 is the whole vocabulary.
    top_k: Optional[int] = Field(None, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1)
    # llm-serving's default (client_utils.Parameters): a stream ends with the whole text
    return_full_text: bool = True
    return_protocol: str = "sse"
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    details: bool = False
    top_n_tokens: int = Field(0, ge=0, le=20)
    ignore_eos: bool = False        # vLLM's, for benchmarks: generate max_new_tokens tokens
    # TGI's structured output: {"type": "json" | "json_schema" | "regex", "value": ...}.
    grammar: Optional[Grammar] = None
    # PD disaggregation (vLLM's kv_transfer_params; refused without a kv_transfer config).
    kv_transfer_params: Optional[dict[str, Any]] = None
    # Not supported. llm-serving's client sends them on every request, switched off (and
    # llm-serving ignored them): switched off they are accepted, asked for they are a 400.
    decoder_input_details: bool = False
    truncate: Optional[Union[bool, int]] = None
    typical_p: Optional[float] = None
    watermark: Optional[bool] = None

    REFUSED: ClassVar[dict] = {"decoder_input_details": (False,), "truncate": (False, 0),
                               "typical_p": (0, 1), "watermark": (False,)}


class GenerateRequest(_LlmServingBody):
    inputs: str = Field(min_length=1)
    parameters: Parameters = Field(default_factory=Parameters)
    stream: bool = False


def _params(p: Parameters) -> SamplingParams:
    sample = p.do_sample and p.temperature > 0
    want_lp = p.details or p.top_n_tokens > 0
    return SamplingParams(
        temperature=p.temperature if sample else 0.0,
        top_k=(LLM_SERVING_TOP_K if p.top_k is None else p.top_k) if sample else 0,
        top_p=p.top_p if sample else 1.0, repetition_penalty=p.repetition_penalty,
        seed=p.seed, stop=p.stop, max_tokens=p.max_new_tokens, ignore_eos=p.ignore_eos,
        kv_transfer_params=p.kv_transfer_params,
        logprobs=p.top_n_tokens if want_lp else None, output_kind=RequestOutputKind.DELTA,
        structured_outputs=p.grammar.structured() if p.grammar is not None else None)


def _token(tid: int, text: str, logprob, special: set) -> dict:
    return {"id": tid, "logprob": logprob, "special": tid in special, "text": text}


def _line(obj: dict, protocol: str) -> bytes:
    if protocol == "sse":
        return (json.dumps({"event": "message", "retry": 30000, "data": [obj]},
                           ensure_ascii=False) + "\n").encode()
    return f"data:{json.dumps(obj, ensure_ascii=False)}\n".encode()


async def _start(request: Request, model: str, req: GenerateRequest):
    unread_offers.hold(request, req.parameters.kv_transfer_params)
    state: ServerState = request.app.state.server
    lora = None
    if model not in LLM_SERVING_MODELS and model != state.served_model_name:
        try:
            lora = state.check_model(model)         # an adapter served by name
        except HTTPError:
            raise HTTPError(404, f"model {model!r} does not exist; this server serves "
                            f"{state.served_model_name!r} (also reachable as 'llama2' or "
                            "'internlm')",
                            param="model", kind="not_found_error") from None
    engine = state.require_engine()
    refuse_unsupported(req.parameters, req.parameters.REFUSED, "parameters.")
    try:
        params = _params(req.parameters)
        rid = new_request_id("gen")
        # max_new_tokens beyond what the prompt leaves is lowered: llm-serving stopped at
        # max_generate_length, its cap on prompt + output ("length")
        prompt = llm_serving_prompt(state.served_model_name, req.inputs)
        log_arrival(state, rid, [prompt], params)
        new = await engine.check_request(rid, prompt, params, lora_request=lora)
    except Exception as e:
        raise _own_names(translate_error(e)) from None
    # first D, then P: ask P now that every check here has passed
    kv = await remote_prefill.resolve(request, params.kv_transfer_params)
    try:
        stream = engine.queue(new, kv, request_trace(request))
    except Exception as e:
        raise _own_names(translate_error(e)) from None
    unread_offers.handed_over(request)
    return state, engine, req, stream


def _own_names(err: HTTPError) -> HTTPError:
    """The error in this route's field names (the engine's name of a field -> ours)."""
    return renamed(err, _FIELDS.get(err.param) or (
        f"parameters.{err.param}" if err.param in Parameters.model_fields else None))


# The engine's names of a request's fields -> this route's.
_FIELDS = {"structured_outputs": "parameters.grammar", "prompt": "inputs",
           "max_tokens": "parameters.max_new_tokens"}


def _summary(tokens: list, text: str, finish: Optional[str], seed,
             details_first: bool = False) -> dict:
    """The whole answer, in llm-serving's key order: its SSE stream's full-text line has
    "details" first, its other answers last. It sent "seed": 0 whatever the request's."""
    first = tokens[0] if tokens else None
    body = {"generated_text": text, "finish_reason": finish, "generated_tokens": len(tokens),
            "prefill": [first] if first else [], "seed": 0 if seed is None else seed,
            "tokens": tokens, "top_tokens": [[first]] if first else []}
    return {"details": None, **body} if details_first else {**body, "details": None}


def _chosen_logprobs(c) -> list:
    """The logprob of each new token of a completion delta (None when not asked)."""
    if not c.logprobs:
        return [None] * len(c.token_ids)
    return [c.logprobs[j][tid].logprob for j, tid in enumerate(c.token_ids)]


class _Generated:
    """What a request has generated so far, gathered from its delta outputs. A token's text
    is the piece the engine's incremental detokenizer gave with it (empty while a character
    or a possible stop string is incomplete), so the tokens' texts add up to the answer's,
    as in llm-serving, where both came from the same pieces."""

    def __init__(self):
        self.texts, self.ids, self.lps = [], [], []
        self.finish, self.error, self.n_prompt, self.kv = None, None, 0, None

    def add(self, out):
        """Take one output; returns its completion delta and the delta's logprobs, or None
        when it failed or carries nothing new."""
        self.n_prompt = len(out.prompt_token_ids)
        self.kv = out.kv_transfer_params or self.kv
        c = out.outputs[0]
        self.error = out.error
        self.finish = llm_serving_finish_reason(c.finish_reason, c.stop_reason, out.error)
        if out.error or (not c.token_ids and not c.text):
            return None
        new_lps = _chosen_logprobs(c)
        if c.token_ids:      # the text goes with the last token (one a step per request)
            self.texts.extend([""] * (len(c.token_ids) - 1) + [c.text])
            self.ids.extend(c.token_ids)
            self.lps.extend(new_lps)
        elif self.texts:     # text held back earlier (a possible stop string), let go
            self.texts[-1] += c.text
        else:
            self.texts.append(c.text)
            self.ids.append(-1)
            self.lps.append(None)
        return c, new_lps

    def summary(self, special: set, seed, details_first: bool = False) -> dict:
        tokens = [_token(tid, text, lp, special)
                  for tid, text, lp in zip(self.ids, self.texts, self.lps)]
        return _summary(tokens, "".join(self.texts), self.finish, seed, details_first)


async def _full(request: Request, model: str, req: GenerateRequest):
    state, engine, req, stream = await _start(request, model, req)
    t0 = time.perf_counter()
    g = _Generated()
    try:     # step by step (not merged), so that each token keeps its own text
        async for outs in stream_or_disconnect(request, stream.steps()):
            for out in outs:
                g.add(out)
    finally:
        await stream.aclose()       # the client gone: the request is aborted
    if g.error:     # the request's fault (a grammar the parser cannot follow): a 400
        raise _own_names(output_error(g.error))
    body = g.summary(engine.tokenizer.special_ids, req.parameters.seed)
    if g.kv is not None:
        body["kv_transfer_params"] = g.kv
    log_request(stream.request_id, g.n_prompt, len(g.ids), t0)
    return Response((json.dumps(body, ensure_ascii=False) + "\n").encode(),
                    media_type="application/json")


async def _stream(request: Request, model: str, req: GenerateRequest):
    state, engine, req, stream = await _start(request, model, req)
    t0 = time.perf_counter()    # as _full and the OpenAI routes: from the request's admission
    tok = engine.tokenizer
    special = tok.special_ids
    protocol = req.parameters.return_protocol

    def token_line(token: dict, text: str) -> bytes:
        # exactly llm-serving's keys (the finish reason is on the return_full_text line)
        return _line({"details": None, "generated_text": text, "tokens": token,
                      "top_tokens": [token]}, protocol)

    def step_line(g: _Generated, out) -> bytes:
        """A step's lines: one a token, the step's incremental text (decoded once, by the
        engine) with its last token, or the error that ended the request. (A step gives
        several tokens under speculative decoding; the others' lines carry no text, as
        their tokens in the final details.)"""
        new = g.add(out)
        if g.error:
            return _line({"details": None, "generated_text": "", "finish_reason": g.finish,
                          "error": g.error}, protocol)
        if new is None:
            return b""
        c, new_lps = new
        if not c.token_ids:
            return token_line(_token(-1, c.text, None, special), c.text)
        ids = c.token_ids
        lines = [token_line(_token(tid, "", lp, special), "")
                 for tid, lp in zip(ids[:-1], new_lps[:-1])] if len(ids) > 1 else []
        lines.append(token_line(_token(ids[-1], c.text, new_lps[-1], special), c.text))
        return b"".join(lines)

    async def gen():
        # A line per token whatever piled up while this handler waited, sent in
        # one write.
        g = _Generated()
        try:
            async for outs in stream.steps():
                chunk = b"".join(step_line(g, out) for out in outs)
                if chunk:
                    yield chunk
                if g.error:
                    return
            if req.parameters.return_full_text:
                yield _line(g.summary(special, req.parameters.seed,
                                      details_first=protocol == "sse"), protocol)
        finally:
            await stream.aclose()
            log_request(stream.request_id, g.n_prompt, len(g.ids), t0)
    # llm-serving's SSE responses (sse-starlette's) told caches and proxies such as nginx
    # not to hold the stream back
    headers = _SSE_HEADERS if protocol == "sse" else None
    return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post("/models/{model}/generate")
async def generate(req: GenerateRequest, request: Request, model: str):
    return await _full(request, model, req)


@router.post("/models/{model}/generate_stream")
async def generate_stream(req: GenerateRequest, request: Request, model: str):
    return await _stream(request, model, req)


@router.post("/models/{model}")
async def generate_either(req: GenerateRequest, request: Request, model: str):
    return await (_stream if req.stream else _full)(request, model, req)


def _event(obj) -> Response:
    return Response(sse(obj, end="\r\n\r\n"), media_type="text/event-stream")


@router.get("/serving/get_bs")
async def get_bs(request: Request):
    state: ServerState = request.app.state.server
    stats = await state.stats()
    return _event({"event": "message", "retry": 30000, "data": stats.num_running})


@router.get("/serving/get_request_numbers")
async def get_request_numbers(request: Request):
    state: ServerState = request.app.state.server
    stats = await state.stats()
    # llm-serving's: its waiting queue's length (requests not in the running batch; a
    # preempted one goes back to it), not the requests in flight
    return _event({"event": "message", "retry": 30000,
                   "data": stats.num_waiting + stats.num_swapped})


@router.get("/serving/get_serverd_model_info")
async def get_served_model_info(request: Request):
    state: ServerState = request.app.state.server
    limits = state.require_engine().limits
    return _event({
        "docker_label": "",           # llm-serving: the docker container id, "" outside one
        "max_batch_total_tokens": limits.max_num_batched_tokens,
        "max_concurrent_requests": limits.max_num_seqs,
        "max_input_length": limits.max_model_len - 1,
        "max_total_tokens": limits.max_model_len,
        "model_device_type": "CANN" if limits.device == "ascend" else "CPU",
        "model_dtype": limits.dtype,
        "model_id": state.served_model_name,
        "model_pipeline_tag": "text-generation",
        "version": "2.3",
    })

