"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, plus vLLM's
/tokenize and /detokenize. Streaming is SSE (``data: {...}`` lines, then ``data: [DONE]``)."""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import logging
import time
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import Response

from llm_serving.entrypoints.beam_search import BeamSearch
from llm_serving.inputs import salt_of, with_cache_salt
from llm_serving.prompt_embeds import FIELD as EMBEDS
from llm_serving.entrypoints.frontend_args import CHAT_OWN_FIELDS
from llm_serving.entrypoints.http_common import (SSE_DONE, HTTPError, ServerState,
                                                event_stream, log_arrival, log_request,
                                                openai_finish_reason, output_error,
                                                refuse_unsupported, renamed, request_ids,
                                                request_trace, server_state, sse,
                                                stream_or_disconnect, translate_error)
from llm_serving.entrypoints.per_request_metrics import per_request_metrics
from llm_serving.entrypoints.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                                     DetokenizeRequest, TokenizeRequest)
from llm_serving.entrypoints import (chat_embeds, reasoning, remote_prefill, tool_calls,
                                     unread_offers)
from llm_serving.engine.detokenizer import IncrementalDetokenizer
from llm_serving.engine.input_processor import NO_TOKENIZER, encode_prompt
from llm_serving.engine.output_processor import log_generated
from llm_serving.outputs import RequestOutput
from llm_serving.sampling_params import BeamSearchParams
from llm_serving.proxy import pd_request as pd

router = APIRouter()
logger = logging.getLogger("llm_serving.server")


# Log-probabilities one request may ask for (about 70 bytes each in the answer): beyond it, a
# single request's answer would be hundreds of megabytes.
MAX_LOGPROB_ENTRIES = 1 << 20

# A chat answer's message fields this server never fills, sent as null as vLLM sends them
# (OpenAI's own answers carry refusal too): a client reading message["refusal"] gets None.
MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None,
                 "reasoning": None}


def check_fields(req) -> None:
    """A field we cannot honour, or fields that do not go together, are a 400 naming it;
    unknown fields are logged once (vLLM)."""
    refuse_unsupported(req, req.REFUSED)
    try:
        req.check_combinations()
    except ValueError as e:
        raise translate_error(e) from None
    unknown = req.unknown_fields()
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s",
                       ", ".join(unknown))


async def start_requests(request: Request, rid: str, resp_id: str, prompts: list, params,
                         priority: int, grammar_field: Optional[str] = None, lora=None,
                         one_answer: bool = False):
    """Queue one engine request per prompt (``rid``-i); all or none. ``resp_id``: the
    response's id, which the request log names at arrival as at the end (vLLM's logs name
    the id the client sent in X-Request-Id). ``grammar_field``: the request field
    a grammar error (the engine says "structured_outputs: ...") is about. As vLLM, a
    max_tokens above max_model_len is refused, and one that fits the model but not after the
    prompt is lowered to what is left. Every prompt is checked before any is queued, and a
    first-D request's producer is asked in between (remote_prefill). Each prompt takes its
    own KV offer when a producer answered per prompt (pd_request.offer_of_prompt); the
    offers of prompts never queued are declined (unread_offers). Traced, a prompt's span
    names the response's id as vLLM's does: ``resp_id``-i, or ``resp_id`` itself for a
    ``one_answer`` route (chat, responses)."""
    engine = server_state(request).require_engine()
    bound = engine.limits.max_waiting
    if len(prompts) > bound:
        raise HTTPError(400, f"prompt: {len(prompts)} prompts in one request exceed the "
                        f"waiting-queue bound (max_waiting_requests={bound})", param="prompt")
    if len(prompts) * params.n > bound:
        raise HTTPError(400, f"n: {len(prompts)} prompts x n={params.n} is "
                        f"{len(prompts) * params.n} sequences, more than the waiting-queue "
                        f"bound (max_waiting_requests={bound})", param="n")
    longest = engine.limits.max_model_len
    if params.max_tokens is not None and params.max_tokens > longest:
        raise HTTPError(400, f"max_tokens: {params.max_tokens} is more than the maximum model "
                        f"length ({longest})", param="max_tokens")
    entries = len(prompts) * (
        (params.n * (params.max_tokens or longest) * (params.logprobs + 1)
         if params.logprobs is not None else 0)
        + (longest * (params.prompt_logprobs + 1) if params.prompt_logprobs is not None else 0))
    if entries > MAX_LOGPROB_ENTRIES:
        raise HTTPError(400, f"logprobs: up to {entries} log-probabilities asked for (prompts x "
                        f"n x max_tokens x the top ones + 1, and the echoed prompts'): the "
                        f"bound is {MAX_LOGPROB_ENTRIES}; ask for fewer", param="logprobs")
    log_arrival(server_state(request), resp_id, prompts, params)
    try:
        news = [await engine.check_request(f"{rid}-{i}", prompt, params, priority, lora)
                for i, prompt in enumerate(prompts)]
    except Exception as e:
        raise grammar_named(translate_error(e), grammar_field) from None
    # first D, then P: ask P now that every check here has passed
    kv = await remote_prefill.resolve(request, params.kv_transfer_params)
    try:
        offers = [pd.offer_of_prompt(kv, i, len(prompts)) for i in range(len(prompts))]
    except ValueError as e:
        raise HTTPError(400, str(e), param=pd.KV_FIELD) from None
    streams = []
    try:
        trace = request_trace(request)
        for i, (new, offer) in enumerate(zip(news, offers)):
            streams.append(engine.queue(new, offer, trace,
                                        resp_id if one_answer else f"{resp_id}-{i}"))
    except Exception as e:
        unread_offers.handed_over(request, offers[len(streams):])
        for s in streams:
            await s.aclose()
        raise grammar_named(translate_error(e), grammar_field) from None
    unread_offers.handed_over(request)
    return streams


def grammar_named(err: HTTPError, grammar_field: Optional[str]) -> HTTPError:
    """A grammar error (the engine says "structured_outputs: ...") named by the request field
    the grammar came from (``guided_regex``, ``response_format``, ``tools`` ...); an
    ``extra_args`` error by the request's ``vllm_xargs``; a whitespace pattern not given in
    ``structured_outputs`` came from ``guided_whitespace_pattern``."""
    if err.param == "extra_args":
        return renamed(err, "vllm_xargs")
    if err.param == "structured_outputs.whitespace_pattern":
        return renamed(err, None if grammar_field == "structured_outputs"
                       else "guided_whitespace_pattern")
    return renamed(err, grammar_field if err.param == "structured_outputs" else None)


async def merge_streams(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all the streams as they come; closing it aborts them."""
    if len(streams) == 1:   # one prompt: read it directly, no pump task and queue hop per output
        try:
            async for out in streams[0]:
                yield 0, out
        except Exception as e:   # noqa: BLE001 - as the pump hands it over
            raise translate_error(e) from None
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out, None))
        except Exception as e:   # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))
        await queue.put((i, None, None))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(streams)
    try:
        while open_streams:
            i, out, err = await queue.get()
            if err is not None:
                raise translate_error(err)
            if out is None:
                open_streams -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def collect_choices(request: Request, streams, n: int, echo: Optional["_Echo"] = None,
                          extra: Optional[dict] = None, grammar_field: Optional[str] = None,
                          cached: Optional[dict] = None, watch=None,
                          timings: Optional[list] = None) -> tuple[dict, int]:
    """The whole of every completion, for non-streaming answers: choice index (prompt * n +
    completion) -> {"text", "ids" (count), "token_ids", "lp" (logprob entries), "finish"}, and
    the prompt
    tokens; ``cached`` gets each prompt's prefix-cached tokens; ``echo`` sees every output;
    ``extra`` gets the top-level fields the engine returned (a producer's
    ``kv_transfer_params``); ``watch`` is called with each completion output as it comes;
    ``timings`` gets each request's ``_final_metrics`` as it ends. A choice's "prompt_lp" is
    its prompt's prompt logprobs (None unless asked for).
    A client that leaves first aborts the requests (HTTPError 499)."""
    choices: dict[int, dict] = {}
    prompt_tokens: dict[int, int] = {}
    offers: dict[int, dict] = {}
    scored: dict[int, list] = {}        # prompt index -> its prompt logprobs (in one output)
    async for i, out in stream_or_disconnect(request, merge_streams(streams)):
        if out.error:
            raise grammar_named(output_error(out.error), grammar_field)
        prompt_tokens[i] = len(out.prompt_token_ids)
        if cached is not None and out.num_cached_tokens is not None:
            cached[i] = out.num_cached_tokens
        if echo is not None:
            echo.see(i, out)
        if out.kv_transfer_params is not None:
            offers[i] = out.kv_transfer_params
        if out.prompt_logprobs is not None:
            scored[i] = out.prompt_logprobs
        if timings is not None and out.metrics is not None:
            timings.append(_final_metrics(out))
        for c in out.outputs:
            if watch is not None:
                watch(c)
            ch = choices.setdefault(i * n + c.index, {"text": [], "ids": 0, "lp": [],
                                                      "finish": None, "stop_reason": None,
                                                      "token_ids": [],
                                                      "prompt_ids": out.prompt_token_ids})
            ch["text"].append(c.text)
            ch["ids"] += len(c.token_ids)
            ch["token_ids"].extend(c.token_ids)
            if c.logprobs:
                ch["lp"].extend(c.logprobs)
            ch["finish"], ch["stop_reason"] = c.finish_reason, c.stop_reason
    if len(choices) < len(streams) * n:
        raise HTTPError(499, "the client closed the connection")
    if extra is not None and offers:
        extra[pd.KV_FIELD] = (offers[0] if len(streams) == 1 else
                              pd.per_prompt_offers([offers.get(i)
                                                    for i in range(len(streams))]))
    for idx, ch in choices.items():
        ch["text"] = "".join(ch["text"])
        ch["prompt_lp"] = scored.get(idx // n)
    return dict(sorted(choices.items())), sum(prompt_tokens.values())


async def beam_search_choices(request: Request, rid: str, resp_id: str, prompts: list,
                              params: BeamSearchParams, priority: int,
                              lora=None) -> tuple[dict, int]:
    """use_beam_search: collect_choices' answer (choice prompt * n + beam, best first) from
    a beam search of each prompt, run one token a step for every live beam of every prompt
    (entrypoints/beam_search.py). A client that leaves aborts the step's requests (499)."""
    engine = server_state(request).require_engine()
    n = params.beam_width
    bound = engine.limits.max_waiting
    if len(prompts) * n > bound:
        raise HTTPError(400, f"n: {len(prompts)} prompts x {n} beams is more than the "
                        f"waiting-queue bound (max_waiting_requests={bound})", param="n")
    log_arrival(server_state(request), resp_id, prompts, params)
    step = params.step_params()
    searches = []
    try:
        for i, prompt in enumerate(prompts):     # the prompts' tokens, checked as any prompt's
            ids = (await engine.check_request(f"{rid}-{i}", prompt, step, priority,
                                              lora)).prompt_token_ids
            searches.append(BeamSearch(ids, params, engine.tokenizer.eos_token_id,
                                       engine.limits.max_model_len, salt_of(prompt)))
    except ValueError as e:
        if str(e).startswith("logprobs"):
            raise HTTPError(400, f"n: beam search with {n} beams asks for the top {2 * n} "
                            f"log-probabilities a step, more than the server allows "
                            f"(--max-logprobs)", param="n") from None
        raise translate_error(e) from None
    except Exception as e:
        raise translate_error(e) from None
    for k in itertools.count():
        live = [s for s in searches if not s.done]
        if not live:
            break
        streams = []
        try:
            for s in live:
                for beam in s.beams:
                    new = await engine.check_request(f"{rid}-{k}-{len(streams)}",
                                                     s.step_prompt(beam), step, priority,
                                                     lora)
                    streams.append(engine.queue(new, trace_headers=request_trace(request)))
        except Exception as e:
            for stream in streams:
                await stream.aclose()
            raise translate_error(e) from None
        outs, _ = await collect_choices(request, streams, 1)
        lps = iter([outs[i]["lp"][0] if outs[i]["lp"] else None for i in range(len(streams))])
        for s in live:
            s.advance([next(lps) for _ in s.beams])
    choices = {}
    tok = engine.tokenizer
    front = server_state(request).frontend
    for i, s in enumerate(searches):
        for j, beam in enumerate(s.best()):
            ids = s.generated(beam)
            choice = choices[i * n + j] = {
                "text": tok.decode(s.text_tokens(beam),
                                   skip_special_tokens=params.skip_special_tokens),
                "ids": len(ids), "token_ids": ids, "lp": [], "finish": beam.finish_reason,
                "stop_reason": beam.stop_reason, "prompt_ids": beam.tokens[:s.prompt_len]}
            if front.enable_log_outputs:      # the steps' requests are not logged
                log_generated(f"{rid}-{i}" + (f" (n={j})" if n > 1 else ""), choice["text"],
                              ids, beam.finish_reason, front.max_log_len)
    return choices, sum(s.prompt_len for s in searches)


def _sse_error(e: HTTPError) -> bytes:
    """An error inside an OpenAI stream (the headers went out with a 200): an error event."""
    return sse({"error": {"message": e.message, "type": e.kind, "param": e.param,
                          "code": e.status}})


def _delta_logger(state: ServerState, n: int):
    """--enable-log-deltas (on by default, with --enable-log-outputs): a function logging a
    streamed answer's deltas as they are sent, named as the whole answer's line is (vLLM's
    "(streaming delta)" lines); None when off."""
    front = state.frontend
    if not (front.enable_log_outputs and front.enable_log_deltas):
        return None

    def log(out: RequestOutput, c) -> None:
        if c.text or c.token_ids:
            log_generated(out.request_id + (f" (n={c.index})" if n > 1 else ""), c.text,
                          c.token_ids, c.finish_reason, front.max_log_len, " (streaming delta)")
    return log


def _usage(prompt_tokens: int, completion_tokens: int, cached: Optional[int] = None,
           reasoning_tokens: Optional[int] = None) -> dict:
    """OpenAI's usage; ``cached`` (--enable-prompt-tokens-details): the prompt tokens the
    prefix cache served, as prompt_tokens_details.cached_tokens; ``reasoning_tokens`` (chat
    with --reasoning-parser, as vLLM): completion_tokens_details.reasoning_tokens."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _stream_usage(state: ServerState, req) -> tuple[bool, bool]:
    """(a final chunk with usage, usage in every chunk): the request's stream_options, or
    both with --enable-force-include-usage (vLLM's)."""
    if state.frontend.enable_force_include_usage:
        return True, True
    return req.stream_usage()


def _without_nulls(d: dict) -> dict:
    return {k: _without_nulls(v) if isinstance(v, dict) else v for k, v in d.items()
            if v is not None}


def _final_metrics(out: RequestOutput) -> tuple:
    """A finished n = 1 request's timings and its sequence's draft acceptance (or None)."""
    return out.metrics, out.outputs[0].spec_decode_metrics if out.outputs else None


def _metrics(state: ServerState, timings: list, num_tokens: int, stream: bool = False) -> dict:
    """vLLM's ``metrics`` field of an answer: the timings (--enable-per-request-metrics) and
    the draft acceptance (--per-request-spec-decode-metrics) of one prompt's one sequence
    (``timings`` holds its ``_final_metrics`` once it ended), else null, as vLLM: the
    timings of n > 1 or of several prompts are no one stream's. A stream's final usage chunk
    leaves out what is null."""
    timed = state.frontend.enable_per_request_metrics
    if not timed and state.engine_args.per_request_spec_decode_metrics == "none":
        return {}
    metrics = None
    if len(timings) == 1:
        (timing, spec), = timings
        if timed or spec is not None:
            metrics = per_request_metrics(timing if timed else None, num_tokens)
            metrics["speculative_decoding"] = spec.to_dict() if spec is not None else None
    if stream:
        return {} if metrics is None else {"metrics": _without_nulls(metrics)}
    return {"metrics": metrics}


def _cached(state: ServerState, cached: dict) -> Optional[int]:
    """The prompt tokens served from the prefix cache, over the prompts seen (prompt index
    -> count), when --enable-prompt-tokens-details asks for them."""
    if not state.frontend.enable_prompt_tokens_details or not cached:
        return None
    return sum(cached.values())




# ---- completions -------------------------------------------------------------------------

def _as_ids(state: ServerState, req) -> bool:
    """Whether logprobs name tokens 'token_id:<id>': the request's return_tokens_as_token_ids,
    else --return-tokens-as-token-ids (vLLM's)."""
    asked = req.return_tokens_as_token_ids
    return state.frontend.return_tokens_as_token_ids if asked is None else bool(asked)


def _name(token_id: int, lp, as_ids: bool) -> str:
    """A token in a logprobs answer: its text, or 'token_id:<id>' (vLLM's form, for tokens
    whose text is not valid UTF-8 alone)."""
    return f"token_id:{token_id}" if as_ids else lp.decoded_token or ""


def _completion_logprobs(entries, text_offset: int, k: int, prompt: Optional[dict] = None,
                         as_ids: bool = False) -> dict:
    """OpenAI's logprobs object of generated tokens, after the echoed prompt's if given."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if prompt is not None:
        out = {key: list(v) for key, v in prompt.items()}
    for entry in entries:
        tid, lp = next(iter(entry.items()))      # the chosen token comes first
        out["tokens"].append(_name(tid, lp, as_ids))
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append(_with_chosen(entry, k, as_ids))
        out["text_offset"].append(text_offset)
        text_offset += len(lp.decoded_token or "")
    return out


def prompt_logprobs_json(scored: Optional[list]) -> dict:
    """vLLM's ``prompt_logprobs`` field of an answer (nothing when not asked for): per prompt
    token null (the first) or token id -> {logprob, rank, decoded_token}, the prompt's token
    first; -inf as -9999.0, as vLLM (JSON has no infinity)."""
    if scored is None:
        return {}
    return {"prompt_logprobs": [
        None if entry is None else
        {str(t): {"logprob": -9999.0 if v.logprob == -math.inf else v.logprob,
                  "rank": v.rank, "decoded_token": v.decoded_token} for t, v in entry.items()}
        for entry in scored]}


def _with_chosen(entry: dict, k: int, as_ids: bool = False) -> dict:
    """Legacy completions' top_logprobs at a position (OpenAI's and vLLM's): the chosen token
    and the k most likely, text -> logprob (so logprobs=0 gives the chosen token alone)."""
    return {_name(t, v, as_ids): v.logprob for t, v in list(entry.items())[:k + 1]}


class _Echo:
    """``echo``: each prompt's text, and with ``logprobs`` its tokens' logprobs object (the
    first token's logprob null), built once per prompt and shared by its n choices. A
    token-id prompt is decoded with its special tokens, as vLLM echoes it."""

    def __init__(self, tokenizer, k: Optional[int], as_ids: bool = False):
        self.tok, self.k, self.as_ids = tokenizer, k, as_ids
        self._outs: dict[int, RequestOutput] = {}   # prompt index -> its first output
        self._scored: dict[int, list] = {}          # prompt index -> its prompt logprobs
        self._done: dict[int, tuple[str, Optional[dict]]] = {}

    def see(self, i: int, out: RequestOutput) -> None:
        """Every output of prompt i (the prompt logprobs come once, in the first)."""
        self._outs.setdefault(i, out)
        if out.prompt_logprobs is not None:
            self._scored.setdefault(i, out.prompt_logprobs)

    def prompt(self, i: int) -> tuple[str, Optional[dict]]:
        """Prompt i's text (a token-id prompt decoded) and logprobs object (None without
        logprobs), once an output of it was seen. Text offsets index that text."""
        if i not in self._done:
            out = self._outs[i]
            ids = out.prompt_token_ids
            # A text prompt is echoed as sent (its BOS not written), token ids decoded whole.
            as_sent = out.prompt is not None
            text = out.prompt if as_sent else self.tok.decode(ids, skip_special_tokens=False)
            lp = None
            if self.k is not None:
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                      "text_offset": _text_offsets(self.tok, ids, as_sent, len(text))}
                scored = self._scored.get(i) or [None] * len(ids)
                for tid, entry in zip(ids, scored):
                    chosen = entry.get(tid) if entry is not None else None
                    lp["tokens"].append(
                        f"token_id:{tid}" if self.as_ids else chosen.decoded_token
                        if chosen is not None
                        else self.tok.decode([tid], skip_special_tokens=False))
                    lp["token_logprobs"].append(None if chosen is None else chosen.logprob)
                    lp["top_logprobs"].append(None if entry is None
                                              else _with_chosen(entry, self.k, self.as_ids))
            self._done[i] = (text, lp)
        return self._done[i]


def _text_offsets(tok, ids: list[int], skip_special_tokens: bool, limit: int) -> list[int]:
    """Where each token's text starts in the decoded text of ``ids`` (capped at ``limit``):
    a skipped special token takes no room, a character split over byte tokens starts where
    its first token does."""
    detok = IncrementalDetokenizer(tok, (), skip_special_tokens=skip_special_tokens)
    offsets, pos = [], 0
    for tid in ids:
        offsets.append(min(pos, limit))
        pos += len(detok.step([tid]))
    return offsets


async def _embeds_prompts(state, req: CompletionRequest) -> list[dict]:
    """vLLM's prompt_embeds as EmbedsPrompts (each string one prompt; none: []), decoded off
    the event loop as chat's prompt_embeds parts are, their rows cut as a prompt's tokens by
    truncate_prompt_tokens. A 400 naming the field otherwise."""
    data = req.prompt_embeds
    if data is None:
        return []
    engine = state.require_engine()
    items = [data] if isinstance(data, str) else data
    if not items and engine.limits.prompt_embeds_size:
        raise HTTPError(400, f"{EMBEDS}: must not be empty", param=EMBEDS)
    arrays = await chat_embeds.decode_parts(engine, items)
    if req.truncate_prompt_tokens is not None:
        kept = [prompt_ids(engine, range(len(a)), EMBEDS, True, req.truncate_prompt_tokens,
                           req.truncation_side or "left") for a in arrays]
        arrays = [a[k[0]:k[-1] + 1] if k else a[:0] for a, k in zip(arrays, kept)]
    return [{EMBEDS: a} for a in arrays]


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    unread_offers.hold(request, req.kv_transfer_params)
    state = server_state(request)
    lora = state.check_model(req.model)
    check_fields(req)
    if req.suffix:
        raise HTTPError(400, "suffix is not supported", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise HTTPError(400, "max_tokens: Input should be greater than or equal to 1 "
                        "(0 only with echo, to score the prompt)", param="max_tokens")
    embedded = await _embeds_prompts(state, req)
    p = req.prompt
    if p is None and not embedded:
        raise HTTPError(400, "prompt: Field required (or prompt_embeds, with "
                        "--enable-prompt-embeds)", param="prompt")
    if p == "":     # vLLM refuses this one, though [""] is the BOS alone, as offline
        raise HTTPError(400, "prompt: must not be empty", param="prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    if p is None:
        p = []
    elif not p:
        raise HTTPError(400, "prompt: must not be empty", param="prompt")
    if req.truncate_prompt_tokens is not None or not req.add_special_tokens:
        # tokenized here; a text prompt is still echoed as sent, as vLLM's
        engine = state.require_engine()
        prompts = [{"prompt": x if isinstance(x, str) else None,
                    "prompt_token_ids": prompt_ids(
                        engine, x, "prompt", req.add_special_tokens,
                        req.truncate_prompt_tokens, req.truncation_side or "left")}
                   for x in p]
    else:
        prompts = [{"prompt_token_ids": x} if isinstance(x, list) else x for x in p]
    prompts = with_cache_salt(embedded + prompts, req.cache_salt)
    # echo with max_tokens=0 returns only the prompt; as vLLM, one token is generated and
    # dropped. With logprobs, echo scores the prompt too (prompt_logprobs).
    echo_only = req.echo and req.max_tokens == 0
    for field in ("echo", "logprobs", "use_beam_search"):    # they decode tokens (vLLM too)
        if getattr(req, field):
            check_tokenizer(state.require_engine(), field)
    as_ids = _as_ids(state, req)
    # -1: the whole vocabulary (vLLM's); the engine checks it against max_logprobs
    logprobs = state.require_engine().limits.vocab_size if req.logprobs == -1 else req.logprobs
    echo = _Echo(state.require_engine().tokenizer, logprobs, as_ids) if req.echo else None
    # vLLM's: echo scores the prompt with logprobs' top ones unless prompt_logprobs says; a
    # stream shows no prompt logprobs but echo's
    prompt_logprobs = req.logprobs if req.echo else None
    if req.prompt_logprobs is not None and not req.stream:
        prompt_logprobs = req.prompt_logprobs
    try:
        defaults = state.require_engine().default_sampling_params
        beam = (req.beam_search_params(req.max_tokens, defaults) if req.use_beam_search
                else None)
        params = beam or req.sampling_params(
            1 if echo_only else req.max_tokens, None if echo_only else req.logprobs,
            prompt_logprobs=prompt_logprobs, defaults=defaults)
    except ValueError as e:
        raise translate_error(e) from None
    rid, resp_id = request_ids(request, "cmpl", req.request_id)
    # the alternatives top_logprobs shows: logprob_token_ids all (vLLM's), else logprobs
    shown = len(req.logprob_token_ids) if req.logprob_token_ids else logprobs
    grammar_field = req.structured_field()
    streams = None if beam else await start_requests(request, rid, resp_id, prompts, params,
                                                     req.priority, grammar_field, lora)
    created, model = int(time.time()), state.model_name(lora)
    n = req.n
    t0 = time.perf_counter()

    if req.stream:
        include_usage, continuous = _stream_usage(state, req)
        log_delta = _delta_logger(state, n)

        async def gen():
            prompt_tokens, offsets, choice_tokens, cached = {}, {}, {}, {}
            timings = []
            try:
                async for i, out in merge_streams(streams):
                    prompt_tokens[i] = len(out.prompt_token_ids)
                    if out.metrics is not None and n == 1:
                        timings.append(_final_metrics(out))
                    if out.num_cached_tokens is not None:
                        cached[i] = out.num_cached_tokens
                    if out.error:
                        yield _sse_error(grammar_named(output_error(out.error),
                                                       grammar_field))
                        continue
                    if echo is not None:
                        echo.see(i, out)
                    for c in out.outputs:
                        if log_delta is not None:
                            log_delta(out, c)
                        idx = i * n + c.index
                        text, entries, ntok = (("", [], 0) if echo_only else
                                               (c.text, c.logprobs or [], len(c.token_ids)))
                        start = offsets.get(idx, 0)        # where this chunk's text begins
                        gen_start, prompt_lp = start, None
                        if echo is not None and idx not in offsets:    # the choice's first chunk
                            prompt_text, prompt_lp = echo.prompt(i)
                            text = prompt_text + text
                            gen_start = len(prompt_text)
                        elif not text and not ntok and c.finish_reason is None:
                            continue
                        choice_tokens[idx] = choice_tokens.get(idx, 0) + ntok
                        lp = None
                        if req.logprobs is not None:
                            lp = _completion_logprobs(entries, gen_start, shown,
                                                      prompt_lp, as_ids)
                        choice = {"index": idx, "text": text, "logprobs": lp,
                                  "finish_reason": openai_finish_reason(c.finish_reason),
                                  "stop_reason": c.stop_reason}
                        if req.return_token_ids:    # the prompt's ids with the first chunk
                            choice.update(token_ids=[] if echo_only else list(c.token_ids),
                                          prompt_token_ids=None if idx in offsets else
                                          list(out.prompt_token_ids))
                        offsets[idx] = start + len(text)
                        chunk = {"id": resp_id, "object": "text_completion", "created": created,
                                 "model": model, "choices": [choice]}
                        if include_usage:
                            chunk["usage"] = (_usage(prompt_tokens[i], choice_tokens[idx])
                                              if continuous else None)
                        yield sse(chunk)
                if include_usage:
                    yield sse({"id": resp_id, "object": "text_completion", "created": created,
                                "model": model, "choices": [],
                                "usage": _usage(sum(prompt_tokens.values()),
                                                sum(choice_tokens.values()),
                                                _cached(state, cached)),
                                **_metrics(state, timings, sum(choice_tokens.values()),
                                           stream=True)})
                yield SSE_DONE
            except HTTPError as e:
                yield _sse_error(e)
                yield SSE_DONE
            finally:
                log_request(resp_id, sum(prompt_tokens.values()), sum(choice_tokens.values()), t0)
        return event_stream(request, gen())

    extra: dict = {}
    cached: dict = {}
    timings: list = []
    if beam:
        choices, prompt_tokens = await beam_search_choices(request, rid, resp_id, prompts, beam,
                                                           req.priority, lora)
    else:
        choices, prompt_tokens = await collect_choices(request, streams, n, echo, extra,
                                                       grammar_field, cached,
                                                       timings=timings if n == 1 else None)

    def build() -> dict:
        for idx, ch in choices.items():
            prompt_text, prompt_lp = "", None
            if echo_only:
                ch.update(text="", ids=0, lp=[])
            if echo is not None:
                prompt_text, prompt_lp = echo.prompt(idx // n)
            ch["logprobs"] = (None if req.logprobs is None else
                              _completion_logprobs(ch["lp"], len(prompt_text), shown,
                                                   prompt_lp, as_ids))
            ch["text"] = prompt_text + ch["text"]
        body = {"id": resp_id, "object": "text_completion", "created": created,
                "model": model,
                "choices": [{"index": idx, "text": ch["text"], "logprobs": ch["logprobs"],
                             "finish_reason": openai_finish_reason(ch["finish"]),
                             "stop_reason": ch["stop_reason"],
                             **({"token_ids": [] if echo_only else ch["token_ids"],
                                 "prompt_token_ids": list(ch["prompt_ids"])}
                                if req.return_token_ids else {}),
                             **prompt_logprobs_json(ch.get("prompt_lp"))}
                            for idx, ch in choices.items()],
                "usage": _usage(prompt_tokens, sum(ch["ids"] for ch in choices.values()),
                                _cached(state, cached)),
                **_metrics(state, timings, sum(ch["ids"] for ch in choices.values())),
                **extra}
        log_request(resp_id, body["usage"]["prompt_tokens"],
                    body["usage"]["completion_tokens"], t0)
        return body
    return await json_answer(build)


# ---- chat --------------------------------------------------------------------------------

def _top(entry: dict, k: int, as_ids: bool = False) -> list:
    """The k most likely of a token's (text, logprob): the chosen token plus the top-k; k -1:
    every entry as it comes (the chosen token, then logprob_token_ids, as vLLM)."""
    ranked = (list(entry.items()) if k < 0 else
              sorted(entry.items(), key=lambda item: -item[1].logprob)[:k])
    return [(_name(t, v, as_ids), v.logprob) for t, v in ranked]


def chat_logprobs(entries, top: int, as_ids: bool = False) -> dict:
    content = []
    for entry in entries:
        tid, lp = next(iter(entry.items()))      # the chosen token comes first
        text = _name(tid, lp, as_ids)
        content.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                         for t, v in _top(entry, top, as_ids)]})
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    unread_offers.hold(request, req.kv_transfer_params)
    state = server_state(request)
    lora = state.check_model(req.model)
    check_fields(req)
    engine = state.require_engine()
    args = state.engine_args
    auto_ok = bool(args.enable_auto_tool_choice and args.tool_call_parser)
    choice = "auto" if req.tools and req.tool_choice is None else req.tool_choice
    try:
        tools, forced = tool_calls.resolve(req.tools, choice, auto_ok, req.parallel_tool_calls)
        structured = req.structured()
        if forced is not None and structured is not None:
            raise ValueError("tool_choice: a forced tool call cannot be combined with "
                             "response_format or guided decoding")
    except ValueError as e:
        raise translate_error(e) from None
    # vLLM's prompt_embeds content parts: their tensors, spliced into the rendered prompt
    embeds = chat_embeds.embeds_parts(req.messages)
    if embeds:
        refused = chat_embeds.refused_with_embeds(req)
        if refused is not None:
            raise HTTPError(400, f"{refused}: not supported with prompt_embeds content parts",
                            param=refused)
        embeds = await chat_embeds.decode_parts(engine, embeds)
    # Off the event loop: a body of many messages takes seconds to template, which would
    # hold every other client's stream meanwhile.
    text, ids, embeds_fields = await asyncio.to_thread(
        chat_prompt_ids, state, engine, req, tool_calls.prompt_tools(
            req.tools, choice, state.frontend.exclude_tools_when_tool_choice_none), embeds)
    max_tokens = req.max_completion_tokens or req.max_tokens
    top = -1 if req.logprob_token_ids else req.top_logprobs or 0
    as_ids = _as_ids(state, req)
    try:
        beam = (req.beam_search_params(max_tokens, engine.default_sampling_params)
                if req.use_beam_search else None)
        # vLLM's: echo scores the prompt with top_logprobs' top ones unless
        # prompt_logprobs says; a stream shows none
        prompt_logprobs = (None if req.stream else req.prompt_logprobs
                           if req.prompt_logprobs is not None else
                           (req.top_logprobs or 0) if req.echo else None)
        params = beam or req.sampling_params(max_tokens, top if req.logprobs else None,
                                             prompt_logprobs=prompt_logprobs,
                                             structured=forced or structured,
                                             defaults=engine.default_sampling_params)
    except ValueError as e:
        raise translate_error(e) from None
    # How the text becomes tool calls: forced (named / required), parsed (auto), or not.
    tool_mode = None if not tools else ("forced" if forced is not None else "auto")
    # --reasoning-parser: the thinking split off first (a grammar holds after it).
    thinking = reasoning.thinking_enabled(template_kwargs(state, req.template_vars()))
    show_reasoning = req.include_reasoning
    think_parser = args.reasoning_parser if beam else reasoning.gate_grammar(
        params, args, thinking, show_reasoning, text, ids, engine.tokenizer)

    # vLLM's: --response-role answers a generation prompt; else the last message's role
    role = state.frontend.response_role if req.add_generation_prompt else req.messages[-1].role

    def message_of(text: str, token_ids: list[int]) -> tuple[dict, Optional[str]]:
        """The message of a finished choice and its finish reason override."""
        if think_parser is None:
            return content_message_of(text)
        thought, text = reasoning.split(text, think_parser, thinking, token_ids,
                                        engine.tokenizer)
        msg, override = content_message_of(text or "")
        if not msg["content"]:
            msg["content"] = None
        msg["reasoning"] = thought if show_reasoning else None
        return msg, override

    def content_message_of(text: str) -> tuple[dict, Optional[str]]:
        if tool_mode is not None:
            content, calls, is_call = tool_calls.message_calls(text, choice,
                                                               args.tool_call_parser)
            if calls or tool_mode == "forced":
                return ({"role": role, "content": content, "tool_calls": calls},
                        "tool_calls" if is_call else None)
        return {"role": role, "content": text}, None
    rid, resp_id = request_ids(request, "chatcmpl", req.request_id)
    # vLLM's echo: a last assistant message (begun by the caller) comes before the reply.
    last = req.messages[-1]
    echoed = last.text() if req.echo and last.role == "assistant" else ""
    grammar_field = "tools" if forced else req.structured_field()
    prompt, = with_cache_salt([{"prompt": text if req.truncate_prompt_tokens is None else None,
                                "prompt_token_ids": ids, **embeds_fields}], req.cache_salt)
    streams = None if beam else await start_requests(request, rid, resp_id, [prompt], params,
                                                     req.priority, grammar_field, lora,
                                                     one_answer=True)
    created, model = int(time.time()), state.model_name(lora)
    t0 = time.perf_counter()

    if req.stream:
        include_usage, continuous = _stream_usage(state, req)
        choice_tokens: dict[int, int] = {}
        thoughts: dict[int, "reasoning.Thoughts"] = {}
        cached: dict = {}

        def chunk(idx, delta, finish=None, lp=None, stop_reason=None, first=False,
                  token_ids=None):
            c = {"id": resp_id, "object": "chat.completion.chunk", "created": created,
                 "model": model, "choices": [{"index": idx, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish,
                                              "stop_reason": stop_reason}]}
            if first and req.return_prompt_text:
                c["prompt_text"] = text
            if req.return_token_ids:           # vLLM's: the prompt's ids with the first
                if first:
                    c["prompt_token_ids"] = ids
                elif token_ids is not None:
                    c["choices"][0]["token_ids"] = token_ids
            if include_usage:
                c["usage"] = (_usage(len(ids), choice_tokens.get(idx, 0),
                                     reasoning_tokens=reasoning_count([idx]))
                              if continuous else None)
            return sse(c)

        def reasoning_count(indices) -> Optional[int]:
            if args.reasoning_parser is None:
                return None
            return sum(thoughts[i].tokens for i in indices if i in thoughts)

        log_delta = _delta_logger(state, req.n)

        async def gen():
            prompt_tokens = len(ids)
            started, calls, timings = set(), {}, []
            try:
                async for _, out in merge_streams(streams):
                    if out.metrics is not None and req.n == 1:
                        timings.append(_final_metrics(out))
                    if out.num_cached_tokens is not None:
                        cached[0] = out.num_cached_tokens
                    if out.error:
                        yield _sse_error(grammar_named(output_error(out.error),
                                                       grammar_field))
                        continue
                    for c in out.outputs:
                        if log_delta is not None:
                            log_delta(out, c)
                        if c.index not in started:
                            started.add(c.index)
                            yield chunk(c.index, {"role": role, "content": ""}, first=True)
                            if echoed:
                                yield chunk(c.index, {"content": echoed})
                            if tool_mode is not None:
                                calls[c.index] = tool_calls.ChoiceStream(
                                    choice, args.tool_call_parser)
                                for delta in calls[c.index].start():
                                    yield chunk(c.index, delta)
                            if think_parser is not None:
                                thoughts[c.index] = reasoning.Thoughts(
                                    think_parser, thinking, engine.tokenizer)
                        choice_tokens[c.index] = choice_tokens.get(c.index, 0) + len(c.token_ids)
                        lp = chat_logprobs(c.logprobs, top, as_ids) if c.logprobs else None
                        text = c.text
                        if think_parser is not None:
                            if not show_reasoning:
                                lp = None       # its tokens would show the reasoning (vLLM)
                            thought, text = thoughts[c.index].feed(
                                text, c.token_ids, c.finish_reason is not None)
                            if thought and show_reasoning:
                                yield chunk(c.index, {"reasoning": thought}, None, lp)
                                lp = None
                        if tool_mode is None:
                            # vLLM's: the last text comes in the finish chunk, whose delta
                            # always has its content ("" when the last token added none)
                            finish = openai_finish_reason(c.finish_reason)
                            if text or lp or finish is not None or (req.return_token_ids
                                                                    and c.token_ids):
                                yield chunk(c.index, {"content": text}, finish, lp,
                                            c.stop_reason, token_ids=list(c.token_ids))
                            continue
                        finish = openai_finish_reason(c.finish_reason)
                        # content before the calls, then each call, as they come
                        deltas = calls[c.index].feed(text)
                        if finish is not None:
                            more, is_call = calls.pop(c.index).finish()
                            deltas += more
                            finish = "tool_calls" if is_call else finish
                        if (lp or finish is not None or (req.return_token_ids and c.token_ids)
                                ) and not deltas:
                            deltas = [{}]
                        # as vLLM's: the step's last delta is the finish chunk (and has the
                        # step's token ids)
                        for k, delta in enumerate(deltas):
                            last = k == len(deltas) - 1
                            end = finish if last else None
                            yield chunk(c.index, delta, end, lp if k == 0 else None,
                                        c.stop_reason if end else None,
                                        token_ids=list(c.token_ids) if last else None)
                if include_usage:
                    yield sse({"id": resp_id, "object": "chat.completion.chunk",
                                "created": created, "model": model, "choices": [],
                                "usage": _usage(prompt_tokens, sum(choice_tokens.values()),
                                                _cached(state, cached),
                                                reasoning_count(thoughts)),
                                **_metrics(state, timings, sum(choice_tokens.values()),
                                           stream=True)})
                yield SSE_DONE
            except HTTPError as e:
                yield _sse_error(e)
                yield SSE_DONE
            finally:
                log_request(resp_id, prompt_tokens, sum(choice_tokens.values()), t0)
        return event_stream(request, gen())

    extra: dict = {"prompt_text": text} if req.return_prompt_text else {}
    if req.return_token_ids:
        extra["prompt_token_ids"] = ids
    cached, timings = {}, []
    if beam:
        choices, _ = await beam_search_choices(request, rid, resp_id, [prompt], beam,
                                               req.priority, lora)
    else:
        choices, _ = await collect_choices(request, streams, req.n, extra=extra,
                                           grammar_field=grammar_field, cached=cached,
                                           timings=timings if req.n == 1 else None)
    completion_tokens = sum(ch["ids"] for ch in choices.values())
    log_request(resp_id, len(ids), completion_tokens, t0)
    thought_count = None
    if args.reasoning_parser is not None:
        thought_count = 0
        for ch in choices.values() if think_parser is not None else ():
            counter = reasoning.ReasoningTokens(think_parser, thinking, engine.tokenizer)
            counter.feed(ch["token_ids"])
            thought_count += counter.count

    def build() -> dict:
        out = []
        for idx, ch in choices.items():
            msg, override = message_of(ch["text"], ch["token_ids"])
            if echoed:
                msg["content"] = echoed + (msg["content"] or "")
            out.append({"index": idx, "message": {**MESSAGE_NULLS, **msg},
                        "logprobs": (chat_logprobs(ch["lp"], top, as_ids)
                                     if req.logprobs and (show_reasoning or not think_parser)
                                     else None),
                        "finish_reason": override or openai_finish_reason(ch["finish"]),
                        "stop_reason": ch["stop_reason"],
                        **({"token_ids": ch["token_ids"]} if req.return_token_ids else {})})
        return {"id": resp_id, "object": "chat.completion", "created": created,
                "model": model, "choices": out,
                "usage": _usage(len(ids), completion_tokens, _cached(state, cached),
                                thought_count),
                **prompt_logprobs_json(next(iter(choices.values())).get("prompt_lp")),
                **_metrics(state, timings, completion_tokens),
                **extra}
    return await json_answer(build)


async def json_answer(build) -> Response:
    """A non-streamed answer, built and serialized on a worker thread: with logprobs it can
    be tens of megabytes, seconds of work that on the event loop would hold every other
    client (as FastAPI's own JSON: UTF-8, compact, no NaN)."""
    def render() -> bytes:
        return json.dumps(build(), ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode()
    return Response(await asyncio.to_thread(render), media_type="application/json")


def encode_text(engine, text: str, field: str, add_special_tokens: bool) -> list[int]:
    check_tokenizer(engine, field)
    try:
        return encode_prompt(engine.tokenizer, text, engine.limits.max_model_len, field,
                             add_special_tokens)
    except ValueError as e:
        raise translate_error(e) from None


def prompt_ids(engine, prompt, field: str, add_special_tokens: bool = True,
               truncate: Optional[int] = None, side: str = "left",
               whole: Optional[int] = None) -> list[int]:
    """A prompt's token ids (of a text, or given), cut to ``truncate`` tokens as vLLM's
    truncate_prompt_tokens: -1 is ``whole`` (by default the model's length less one, a token
    left for the output); ``side`` "left" keeps the last tokens, "right" the first. A text
    is first cut, on the side kept, to the characters the model's length can hold, so that a
    long body is not tokenized whole (as vLLM's)."""
    limit = engine.limits.max_model_len
    if truncate is not None:
        truncate = (limit - 1 if whole is None else whole) if truncate == -1 else truncate
        if truncate > limit:
            raise HTTPError(400, f"truncate_prompt_tokens: {truncate} is more than the maximum "
                            f"model length ({limit})", param="truncate_prompt_tokens")
    if isinstance(prompt, str):
        if truncate is not None:
            most = limit * engine.tokenizer.max_chars_per_token
            prompt = prompt[-most:] if side == "left" else prompt[:most]
        ids = encode_text(engine, prompt, field, add_special_tokens)
        if truncate is not None and len(ids) > truncate and add_special_tokens:
            return _truncate_keeping_specials(engine.tokenizer, prompt, ids, truncate, side)
    else:
        ids = list(prompt)
    if truncate is not None and len(ids) > truncate:
        ids = _cut(ids, truncate, side)
    return ids


def _cut(ids: list[int], keep: int, side: str) -> list[int]:
    return ids[len(ids) - keep:] if side == "left" else ids[:keep]


def _truncate_keeping_specials(tok, text: str, ids: list[int], keep: int,
                               side: str) -> list[int]:
    """``keep`` tokens of a text tokenized with its special tokens (``ids``): the specials
    stay and the text's own tokens are cut, as transformers' truncation (and vLLM's) does,
    so a prompt cut on the left still starts with its BOS."""
    plain = tok.encode(text, add_special_tokens=False)
    extra = len(ids) - len(plain)
    start = next((p for p in range(extra + 1) if ids[p:p + len(plain)] == plain), None)
    if start is None or extra >= keep:
        return _cut(ids, keep, side)
    return ids[:start] + _cut(plain, keep - extra, side) + ids[start + len(plain):]


def check_tokenizer(engine, field: str) -> None:
    """A 400 naming ``field`` when the server runs with --skip-tokenizer-init (as vLLM's)."""
    if engine.limits.skip_tokenizer_init:
        raise HTTPError(400, f"{field}: {NO_TOKENIZER}", param=field)


def chat_prompt_ids(state: ServerState, engine, req, tools, embeds=()
                    ) -> tuple[str, list[int], dict]:
    """The chat prompt's text, token ids (cut as truncate_prompt_tokens asks) and, for the
    arrays of its prompt_embeds parts (``embeds``), the prompt's embeddings fields (else
    {})."""
    if embeds:
        text = _chat_prompt(state, engine.tokenizer, req, tools, chat_embeds.MARKER)
        return (text, *chat_embeds.splice(text, embeds, lambda t, special: encode_text(
            engine, t, "messages", special), req.add_special_tokens))
    text = _chat_prompt(state, engine.tokenizer, req, tools)
    return text, prompt_ids(engine, text, "messages", req.add_special_tokens,
                            req.truncate_prompt_tokens, req.truncation_side or "left"), {}


def _chat_prompt(state: ServerState, tok, req, tools, embeds_marker=None) -> str:
    """The prompt text the chat template makes of a request's messages (the chat route's
    and /tokenize's, so that /tokenize counts what chat will)."""
    variables = (req.template_vars() if isinstance(req, ChatCompletionRequest)
                 else req.chat_template_kwargs)
    return render_chat(state, tok, req.messages, req.add_generation_prompt,
                       req.continue_final_message, req.chat_template, variables, tools,
                       embeds_marker)


def template_kwargs(state: ServerState, given: Optional[dict]) -> dict:
    """The chat template's variables: --default-chat-template-kwargs, then the request's own
    (they win, as on vLLM)."""
    return {**state.frontend.default_chat_template_kwargs, **(given or {})}


def render_chat(state: ServerState, tok, messages: list, add_generation_prompt: bool,
                continue_final_message: bool, chat_template: Optional[str],
                chat_template_kwargs: Optional[dict], tools=None,
                embeds_marker: Optional[str] = None) -> str:
    """The prompt text the chat template makes of ``messages`` (ChatMessage), the same for
    every route that renders a conversation (chat, /tokenize, /v1/responses, the pooling
    routes' chat forms); ``embeds_marker``: what a prompt_embeds part renders as (None:
    refused)."""
    if continue_final_message and add_generation_prompt:
        raise HTTPError(400, "continue_final_message: it continues the last message, so "
                        "add_generation_prompt must be false", param="continue_final_message")
    own = chat_template is not None or "chat_template" in (chat_template_kwargs or {})
    if own and not state.engine_args.trust_request_chat_template:
        raise HTTPError(400, "chat_template: a request's own chat template is refused unless "
                        "the server runs with --trust-request-chat-template",
                        param="chat_template")
    kwargs = template_kwargs(state, chat_template_kwargs)
    template = chat_template or kwargs.pop("chat_template", None) or state.chat_template
    taken = sorted(set(CHAT_OWN_FIELDS) & kwargs.keys())
    if taken:
        raise HTTPError(400, f"chat_template_kwargs: {taken[0]!r} is the request's own field, "
                        "not a template variable to set here", param="chat_template_kwargs")
    try:
        return tok.render_chat_template(
            [m.for_template(embeds_marker) for m in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=template,
            content_format=state.frontend.chat_template_content_format,
            tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
            **kwargs)
    except ValueError as e:
        raise translate_error(e) from None
    except Exception as e:   # noqa: BLE001 - a template error is the request's fault
        raise HTTPError(400, f"messages: the chat template failed: {e}", param="messages")


# ---- models, tokenizer -------------------------------------------------------------------

@router.get("/v1/models")
async def models(request: Request):
    state = server_state(request)
    engine = state.require_engine()                           # 503 while loading
    max_len = engine.limits.max_model_len
    card = {"object": "model", "created": int(state.started), "owned_by": "llm_serving",
            "max_model_len": max_len}
    # as vLLM: the base model, then each adapter served by name, its parent the base model
    data = [{"id": state.served_model_name, **card, "root": state.engine_args.model,
             "parent": None}]
    if engine.loras is not None:
        data += [{"id": name, **card, "root": lora.lora_path,
                  "parent": lora.base_model_name or state.served_model_name}
                 for name, lora in sorted(engine.loras.served.items())]
    return {"object": "list", "data": data}


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    state = server_state(request)
    state.check_model(req.model)
    engine = state.require_engine()
    tok = engine.tokenizer
    if req.messages is not None and req.prompt is not None:
        raise HTTPError(400, "messages: give a prompt or messages, not both", param="messages")
    if req.messages is not None:
        ids = encode_text(engine, _chat_prompt(state, tok, req, req.tools), "messages",
                          bool(req.add_special_tokens))
    elif req.prompt is not None:
        ids = encode_text(engine, req.prompt, "prompt", req.add_special_tokens is not False)
    else:
        raise HTTPError(400, "prompt: give a prompt or messages", param="prompt")
    body = {"tokens": ids, "count": len(ids), "max_model_len": engine.limits.max_model_len}
    if req.return_token_strs:
        body["token_strs"] = tok.convert_ids_to_tokens(ids)
    return body


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    state = server_state(request)
    if not state.frontend.enable_tokenizer_info_endpoint:
        raise HTTPError(404, "/tokenizer_info is off; start the server with "
                        "--enable-tokenizer-info-endpoint", kind="not_found_error")
    return state.require_engine().tokenizer.info(state.chat_template)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    state = server_state(request)
    state.check_model(req.model)
    engine = state.require_engine()
    check_tokenizer(engine, "tokens")
    vocab = engine.limits.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise HTTPError(400, f"tokens: ids must be in [0, {vocab}), got {bad[0]}",
                        param="tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}   # vLLM
