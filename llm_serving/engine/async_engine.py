"""The engine for asyncio callers (the HTTP server): the step loop runs on its own thread.

``add_request`` checks and tokenizes the request on the caller's thread, so bad input fails
at once, then hands it to the engine thread and returns an async iterator of outputs. The
engine thread owns the ``LLMEngine``: it takes new requests and aborts between steps, runs
steps while there is work, and sleeps otherwise. Outputs go back to the event loop in one
call per step, so a waiting HTTP handler never holds up a step and a step never holds up
the event loop. A stream whose consumer falls behind coalesces what piled up: for DELTA
outputs, the pending deltas are concatenated; otherwise only the latest output is kept.
``steps()`` reads the same stream without merging: each read is the list of step outputs
that piled up (llm-serving's stream sends a line per token, in one write per read). With
``stream_interval`` N > 1 (vLLM's: the server's, raised by a request's own), a read waits for
N new tokens, except the first one and the last: the consumer wakes, and the client gets a
chunk, every N tokens (a step with accepted drafts brings several).

Leaving an iteration early (a client disconnect cancels the handler) aborts the request,
which frees its KV blocks at the next step boundary.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Optional, Union

from llm_serving.config import EngineArgs, EngineConfig
from llm_serving.engine.engine_client import EngineLimits
from llm_serving.engine.input_processor import NewRequest
from llm_serving.engine.llm_engine import LLMEngine, PromptType
from llm_serving.engine.metrics import EngineStats
from llm_serving.errors import (EngineDeadError, LogitsProcessorError, QueueFullError,
                                RequestIdInUseError, ShuttingDownError)
from llm_serving.outputs import CompletionOutput, RequestOutput
from llm_serving.profiler import ProfilerActiveError, check_iterations, check_prefix
from llm_serving.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.01       # how long to sleep when work is queued but nothing could be scheduled
_HEALTH_POLL_S = 1.0      # how often an idle loop checks that the model runner is alive
_OWN = object()           # queue(): the request keeps its own kv_transfer_params
RESTART_ATTEMPTS = 3      # new WorkAgents tried, one after another, before the loop gives up


class RequestStream:
    """Async iterator of one request's outputs; lives on the caller's event loop."""

    def __init__(self, request_id: str, kind: RequestOutputKind, abort=None,
                 interval: int = 1, decline=None):
        self.request_id = request_id
        self.kind = kind
        self._abort = abort
        self._decline = decline
        self._left = False          # closed by its reader before the last output
        self.finished = False
        self._pending: list[RequestOutput] = []
        self._error: Optional[BaseException] = None
        self._ready = asyncio.Event()
        self._interval = interval
        self._due = 1               # new tokens that make a read: the first at once
        self._tokens = 0            # new tokens in _pending
        self._length = 0            # the longest sequence's tokens delivered so far
        self.slots = 1              # sequences (n) and prompt tokens before the first
        self.prefill_tokens = 0     # output: what the admission limits count
        self.traced = None          # tracing on: (NewRequest, trace context headers, the
                                    # span's request id)

    # Called on the event loop by the engine's deliveries.
    def put(self, out: RequestOutput) -> None:
        self.prefill_tokens = 0
        if self._left:
            self._decline_offer(out)
            return
        self._pending.append(out)
        # with the default interval of 1 any output makes a read: nothing to count
        self._tokens += self._new_tokens(out) if self._interval > 1 else 1
        if self._tokens >= self._due or out.finished:
            self._ready.set()

    def _new_tokens(self, out: RequestOutput) -> int:
        """The tokens ``out`` adds to its longest sequence; at least 1, so that an output
        without tokens is read as one with a token."""
        length = max((len(c.token_ids) for c in out.outputs), default=0)
        if self.kind is RequestOutputKind.DELTA:
            return max(length, 1)
        new, self._length = length - self._length, max(length, self._length)
        return max(new, 1)

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def aclose(self) -> None:
        """Stop reading: an unfinished request is aborted (its blocks freed before the next
        step). Safe to call more than once."""
        if not self.finished and self._abort is not None:
            self._abort(self.request_id)
            self._left = True
            for out in self._pending:
                self._decline_offer(out)
            self._pending = []
        self._abort = None

    def _decline_offer(self, out: RequestOutput) -> None:
        """A PD producer's request that finished with an offer (its KV held for a consumer)
        as its reader left: nobody will pass the offer on, so its blocks are freed now rather
        than when it expires."""
        offer = out.kv_transfer_params
        if (out.finished and self._decline is not None and isinstance(offer, dict)
                and offer.get("transfer_id")):
            self._decline([offer])

    def _readable(self) -> bool:
        """Enough piled up: ``_due`` new tokens, the last output, or what came before an
        error."""
        pending = self._pending
        return bool(pending) and (self._tokens >= self._due or pending[-1].finished
                                  or self._error is not None)

    async def _take(self) -> list[RequestOutput]:
        """Every output delivered since the last read, waiting for one."""
        while not self._readable():
            if self._error is not None and not self._pending:
                self.finished = True
                raise self._error
            if self.finished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        outs, self._pending, self._due = self._pending, [], self._interval
        self._tokens = 0
        if outs[-1].finished:
            self.finished = True
        return outs

    async def __anext__(self) -> RequestOutput:
        outs = await self._take()
        return _merge_deltas(outs) if self.kind is RequestOutputKind.DELTA else outs[-1]

    async def steps(self) -> AsyncIterator[list[RequestOutput]]:
        """The step outputs that piled up since the last read, one per step, not merged."""
        while True:
            try:
                outs = await self._take()
            except StopAsyncIteration:
                return
            yield outs


def _merge_deltas(outs: list[RequestOutput]) -> RequestOutput:
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    merged = []
    by_index: dict[int, list[CompletionOutput]] = {}     # (a finished sibling stops coming)
    for o in outs:
        for c in o.outputs:
            by_index.setdefault(c.index, []).append(c)
    for _, parts in sorted(by_index.items()):
        final = parts[-1]
        logprobs = None
        if final.logprobs is not None:
            logprobs = [lp for p in parts for lp in (p.logprobs or [])]
        merged.append(CompletionOutput(
            index=final.index, text="".join(p.text for p in parts),
            token_ids=[t for p in parts for t in p.token_ids],
            cumulative_logprob=final.cumulative_logprob, logprobs=logprobs,
            finish_reason=final.finish_reason, stop_reason=final.stop_reason,
            spec_decode_metrics=final.spec_decode_metrics))
    prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None),
                           None)          # delta outputs carry them once, in the first
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, merged,
                         last.finished, prompt_logprobs, last.metrics,
                         last.num_cached_tokens, last.error, last.kv_transfer_params)


class AsyncLLMEngine:
    """Implements ``EngineClient`` (``engine_client.py``), what the HTTP routes use."""

    def __init__(self, args: Union[EngineArgs, EngineConfig], warm_up: bool = True):
        self.engine = LLMEngine(args)
        if warm_up:
            self.engine.warm_up()
        self.tokenizer = self.engine.tokenizer
        self.loras = self.engine.loras      # lora.registry.LoRARegistry; None: LoRA off
        self.limits = EngineLimits.of(self.engine.config,
                                      getattr(self.engine.runner, "device", None))
        self.default_sampling_params = dict(self.engine.config.model.default_sampling_params)
        # vLLM's AsyncEngineArgs.enable_log_requests: each arrival and abort, at INFO
        self.log_requests = bool(getattr(args, "enable_log_requests", False))
        # requests refused by each admission limit (vLLM's admission_rejections metric)
        self.admission_rejections = {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # collective_rpc calls taken from the commands, run by the loop between two steps:
        # ((method, timeout, args, kwargs), the caller's future)
        self._rpcs: collections.deque = collections.deque()
        # Adds handed over but not yet taken, for the queue bound: each count has one writer.
        self._adds_sent = 0                 # event loop thread
        self._adds_taken = 0                # engine thread
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._dead: Optional[BaseException] = None
        self._restarting = False
        self.num_restarts = 0
        self._stopping = False
        self._held = False     # the loop did not take a shutdown's abort_all: held in a step
        self._closed: Optional[str] = None    # abort_all's reason: new requests are refused
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLMEngine":
        """vLLM's; ``args`` may be an AsyncEngineArgs (enable_log_requests)."""
        return cls(args)

    # ---- caller side (event loop) ---------------------------------------------------------
    def log_outputs(self, max_log_len: Optional[int]) -> None:
        """--enable-log-outputs: log each request's outputs as it ends (cut to max_log_len)."""
        processor = self.engine.output_processor
        processor.max_log_len = max_log_len
        processor.log_outputs = True

    @property
    def is_running(self) -> bool:
        """True when requests can be served (False while a dead WorkAgent is replaced)."""
        return self._thread.is_alive() and self._dead is None and not self._restarting

    @property
    def is_dead(self) -> bool:
        """True once the loop stopped for good (liveness fails)."""
        return self._dead is not None or not self._thread.is_alive()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._dead!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: Optional[SamplingParams] = None,
                          priority: int = 0, lora_request=None) -> RequestStream:
        """Queue a request and return its stream of outputs (in ``params.output_kind``:
        DELTA gives the new token ids and text of each step).

        Raises ValueError for bad input, QueueFullError when the waiting queue is full, and
        EngineDeadError when the engine loop has stopped.
        """
        return self.queue(await self.check_request(request_id, prompt, params, priority,
                                                   lora_request))

    async def check_request(self, request_id: str, prompt: PromptType,
                            params: Optional[SamplingParams] = None,
                            priority: int = 0, lora_request=None) -> NewRequest:
        """``add_request``'s first half: every check of the request, and its tokens; nothing
        is queued (``queue`` does it). A consumer asks the producer for a first-D request's
        prefill in between, so a request it refuses costs the producer nothing."""
        self.check_health()
        self._check_open()
        self._bind_loop()
        if request_id in self._streams:
            raise RequestIdInUseError(request_id)
        self.engine.scheduler.check_room(self._adds_sent - self._adds_taken)
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # Compiling a grammar can take a while (a large schema; llguidance's view of the
            # tokenizer, once): not on the event loop.
            new = await asyncio.to_thread(self.engine.process_request, prompt, params,
                                          request_id, priority, None, lora_request)
        else:
            new = self.engine.process_request(prompt, params, request_id, priority,
                                              lora_request=lora_request)
        self._check_admission(new)
        return new

    def queue(self, new: NewRequest, kv_transfer_params=_OWN,
              trace_headers: Optional[dict] = None,
              trace_id: Optional[str] = None) -> RequestStream:
        """``add_request``'s second half: queue a checked request. ``kv_transfer_params``,
        when given: the producer's offer that replaces the request's own (a first-D request's
        answer, None to compute the prompt here, or one prompt's share of a per-prompt
        answer), checked here. The request arrives now (an offer's ttl counts from it).
        Tracing on: ``trace_headers``, the W3C trace context its span is parented to;
        ``trace_id``, the request id the span names (default: the engine's)."""
        self.check_health()
        self._check_open()
        if new.request_id in self._streams:
            raise RequestIdInUseError(new.request_id)
        params = new.params
        if kv_transfer_params is not _OWN and kv_transfer_params is not params.kv_transfer_params:
            if kv_transfer_params is not None:
                self.engine.input_processor.check_kv_transfer(kv_transfer_params)
            params = copy.copy(params)      # the checked rest is shared (a compiled grammar)
            params.kv_transfer_params = kv_transfer_params
        self.engine.scheduler.check_room(self._adds_sent - self._adds_taken)
        self._check_admission(new)
        new = dataclasses.replace(new, params=params, arrival_time=time.time())
        interval = max(self.engine.config.scheduler.stream_interval,
                       params.stream_interval or 1)     # a request raises it, as vLLM's
        stream = RequestStream(new.request_id, params.output_kind, self.abort, interval,
                               self.decline_kv_offers)
        stream.slots, stream.prefill_tokens = params.n, len(new.prompt_token_ids)
        if self.engine.tracer is not None:
            stream.traced = (new, trace_headers, trace_id or new.request_id)
        self._streams[new.request_id] = stream
        self._adds_sent += 1
        self._commands.put(("add", new))
        if self.log_requests:
            logger.info("Added request %s.", new.request_id)
        self._wake.set()
        return stream

    def _check_admission(self, new: NewRequest) -> None:
        """vLLM's admission limits, refused with QueueFullError (503, for a load balancer to
        retry elsewhere): max_num_queued_reqs counts the sequences in flight (n answers count
        n), max_num_queued_tokens the prompt tokens of requests without a first output."""
        config = self.engine.config.scheduler
        if config.max_in_flight is not None and new.params.n > config.max_in_flight:
            raise ValueError(f"n: {new.params.n} answers are more than the server takes in "
                             f"flight at once (max_num_queued_reqs={config.max_in_flight})")
        if config.max_in_flight is not None:
            in_flight = sum(s.slots for s in self._streams.values())
            if in_flight + new.params.n > config.max_in_flight:
                self.admission_rejections["max_num_queued_reqs"] += 1
                raise QueueFullError(config.max_in_flight, (
                    f"the server has {in_flight} sequences in flight, at its bound "
                    f"(max_num_queued_reqs={config.max_in_flight}); try again later or on "
                    "another instance"))
        if config.max_prefill_backlog is not None:
            backlog = sum(s.prefill_tokens for s in self._streams.values())
            if backlog >= config.max_prefill_backlog:
                self.admission_rejections["max_num_queued_tokens"] += 1
                raise QueueFullError(config.max_prefill_backlog, (
                    f"{backlog} prompt tokens are waiting for their prefill, at the bound "
                    f"(max_num_queued_tokens={config.max_prefill_backlog}); try again later "
                    "or on another instance"))

    def _check_open(self) -> None:
        if self._closed is not None:
            raise ShuttingDownError(self._closed)

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an AsyncLLMEngine serves one event loop")

    async def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams],
                       request_id: str, priority: int = 0,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """vLLM's entry point: yields the request's outputs; leaving early aborts it."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority,
                                        lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step. Safe to repeat."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            self._commands.put(("abort", request_id))
            self._wake.set()
            if self.log_requests:
                logger.info("Aborted request %s.", request_id)

    def decline_kv_offers(self, offers: list) -> None:
        """PD consumer: requests refused before they were queued will not read these offers
        (each a producer's ``kv_transfer_params`` for one prompt); the producer is told at the
        next step, so it frees the blocks at once."""
        for params in offers:
            self._commands.put(("decline", params))
        self._wake.set()

    @property
    def num_requests(self) -> int:
        """Requests whose outputs are still coming (queued or running): what a shutdown
        waits for."""
        return len(self._streams)

    @property
    def num_steps(self) -> int:
        """Model steps completed so far: a shutdown's drain tells from it whether the loop is
        held in a step (a hung or stopped WorkAgent)."""
        return self.engine.stats.num_steps

    def abort_all(self, reason: str) -> None:
        """End every request, queued or running, with the error ``reason`` (at the next step
        boundary; each stream gets a final output carrying it, so that its route answers as
        for any failed request); requests added from now on are refused with it
        (ShuttingDownError). The server's shutdown calls it once its drain window is over."""
        self._closed = reason
        self._commands.put(("abort_all", reason))
        self._wake.set()

    def fail_open_streams(self, reason: str) -> None:
        """End every stream still open with ShuttingDownError(reason), from the event loop:
        for a shutdown whose abort_all the engine thread has not taken (held in a step: a
        hung WorkAgent, a failed step waiting for the one in flight). Its route answers as
        for any failed request; what the engine thread later sends for them is dropped.
        ``shutdown`` then does not wait for the loop."""
        self._closed = reason
        self._held = True
        self._fail_all(ShuttingDownError(reason))

    async def read_lora(self, lora) -> Optional[str]:
        """Have the model runner read a newly registered LoRA adapter (between two steps);
        None once read, else why it could not be (its id is then not run again)."""
        return await self._ask("read_lora", lambda fut: (lora, fut))

    async def _ask(self, cmd: str, arg=lambda fut: fut):
        """Command ``cmd`` run on the engine thread between two steps, and its answer: the
        command's argument is ``arg(fut)``, which holds the future the engine thread
        resolves."""
        self.check_health()
        self._bind_loop()
        fut = asyncio.get_running_loop().create_future()
        self._commands.put((cmd, arg(fut)))
        self._wake.set()
        return await fut

    async def get_stats(self) -> EngineStats:
        """The engine's stats, taken on the engine thread between steps."""
        return await self._ask("stats")

    async def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix, on the engine thread between steps; False (and
        nothing done) while a request is unfinished."""
        return await self._ask("reset_prefix_cache")

    async def start_profile(self, profile_prefix: Optional[str] = None, *,
                            delay_iterations: Optional[int] = None,
                            max_iterations: Optional[int] = None) -> None:
        """vLLM's: the master's and every WorkAgent's trace recorder start between two steps
        (``LLMEngine.profile``: vLLM's iteration bounds too); this event loop's thread is
        recorded too."""
        if self.engine.trace is not None:
            # Refused here, not by an exception on the recording engine thread: VizTracer
            # 1.1 stopped recording that thread after one (its ignore counter went to -1).
            if self.engine.profiling:
                raise ProfilerActiveError()
            check_prefix(profile_prefix)
            check_iterations(delay_iterations or 0, max_iterations or 0)
        await self._profile(True, profile_prefix, delay_iterations, max_iterations)
        self.engine.trace.follow_this_thread()

    async def stop_profile(self) -> None:
        """vLLM's: every process's trace is written (nothing happens without a profile)."""
        if self.engine.trace is not None:
            self.engine.trace.leave_this_thread()
        await self._profile(False)

    async def _profile(self, start: bool, *args) -> None:
        await self._ask("profile", lambda fut: (start, args, fut))

    async def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (),
                             kwargs: Optional[dict] = None) -> list:
        """vLLM's: ``method`` (a Worker method's name, or a callable taking the Worker) run on
        every model process between two steps, the engine thread waiting for it; the results
        by rank (``executor/collective_rpc.py``)."""
        from llm_serving.executor.collective_rpc import check_call
        check_call(method, timeout, args, kwargs)
        return await self._ask("collective_rpc",
                               lambda fut: ((method, timeout, tuple(args), kwargs), fut))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop, then the WorkAgents; unfinished requests end with finish_reason
        "abort". A loop still in a model step after ``timeout`` seconds (at once after
        ``fail_open_streams``: it is held in a step, a hung WorkAgent) is not waited for:
        the agents are killed, which ends the step."""
        self._stopping = True
        self.engine.cancel_loading.set()      # a replacement agent loading: given up
        self._wake.set()
        self._thread.join(0.0 if self._held else timeout)
        if self._thread.is_alive():
            logger.warning("shutting down: a model step is still running; killing the "
                           "WorkAgents")
            self.engine.kill_runner()
            self._thread.join(_HEALTH_POLL_S)
        self.engine.shutdown()

    # ---- engine thread --------------------------------------------------------------------
    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
                if stream.traced is not None:
                    self._trace(stream, out)

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(error)
            if stream.traced is not None:
                self._trace(stream, None, str(error))

    def _trace(self, stream: RequestStream, out: Optional[RequestOutput],
               error: Optional[str] = None) -> None:
        """The span of a request that ended (on the event loop, off the step loop)."""
        try:
            self.engine.tracer.record(*stream.traced, out, error)
        except Exception:   # noqa: BLE001 - a span must never fail a request
            logger.exception("tracing: the span of request %s was not recorded",
                             stream.request_id)

    def _post(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        from llm_serving.executor.multiproc_executor import AgentDiedError
        engine = self.engine
        try:
            while not self._stopping:
                outs = self._take_commands()
                try:
                    if self._rpcs:
                        outs.extend(self._run_rpcs())
                    if engine.lora_reads_pending:
                        outs.extend(engine.read_new_loras())
                    if engine.has_unfinished_requests():
                        steps = engine.stats.num_steps
                        outs.extend(engine.step())
                        if engine.stats.num_steps == steps and not outs:
                            self._wake.wait(_IDLE_POLL_S)   # nothing could run: don't spin
                            self._wake.clear()
                    else:
                        self._wake.wait(_HEALTH_POLL_S)
                        self._wake.clear()
                        if not engine.runner_alive():
                            raise AgentDiedError("the WorkAgent process exited")
                except AgentDiedError as e:
                    outs.extend(self._recover(str(e)))
                except LogitsProcessorError as e:     # the user's processor: not the engine
                    logger.error("%s; failing the requests that have started", e)
                    outs.extend(engine.fail_running(str(e)))
                except Exception as e:   # noqa: BLE001 - a bad step must not end the service
                    logger.exception("a model step failed; failing the requests in flight")
                    outs.extend(engine.fail_all(f"internal error in a model step: {e!r}"))
                if outs:
                    self._post(self._deliver, outs)
            outs = [engine.abort_request(rid) for rid in list(engine.requests)]
            self._post(self._deliver, [o for o in outs if o is not None])
        except BaseException as e:    # noqa: BLE001 - every stream must learn of it
            logger.exception("engine loop failed")
            self._dead = e
            self._post(self._fail_all, EngineDeadError(f"the engine loop stopped: {e!r}"))

    def _run_rpcs(self) -> list[RequestOutput]:
        """The collective_rpc calls waiting, once the step running is collected (its outputs
        returned). An agent that died in a call raises on (the loop restarts it)."""
        from llm_serving.executor.multiproc_executor import AgentDiedError
        outs = self.engine.collect_in_flight()
        if outs:
            self._post(self._deliver, outs)
        while self._rpcs:
            call, fut = self._rpcs.popleft()
            try:
                self._post(_resolve, fut, self.engine.collective_rpc(*call))
            except Exception as e:    # noqa: BLE001 - goes to its caller
                self._post(_reject, fut, e)
                if isinstance(e, AgentDiedError):
                    raise
        return []

    def _recover(self, reason: str) -> list[RequestOutput]:
        """A WorkAgent died or hung: fail the requests in flight (their KV is gone), start a
        new agent, and serve again. Not ready meanwhile. A new agent that dies too is tried
        again RESTART_ATTEMPTS times in all; then the loop stops for good (/live fails, so a
        supervisor restarts the server). Nothing is restarted once the server is stopping."""
        from llm_serving.executor.multiproc_executor import AgentDiedError
        if self._stopping:          # killed by shutdown(): nothing to restart
            return []
        logger.error("%s; failing the requests in flight and restarting it", reason)
        self._restarting = True
        outs = self.engine.fail_all(f"the model process failed ({reason}); "
                                    "the request was dropped, retry it")
        self._post(self._deliver, outs)
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            if self._stopping:
                return []
            try:
                self.engine.restart_runner()
                break
            except AgentDiedError as e:
                if self._stopping:
                    return []
                if attempt == RESTART_ATTEMPTS:
                    raise
                logger.error("the new WorkAgent failed too (%s); trying again (%d of %d)", e,
                             attempt + 1, RESTART_ATTEMPTS)
                time.sleep(attempt)
        self.num_restarts += 1
        self._restarting = False
        logger.info("the WorkAgent was restarted; serving again")
        return []

    def _take_commands(self) -> list[RequestOutput]:
        engine, outs = self.engine, []
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return outs
            if cmd == "add":
                try:
                    engine.add_processed(arg)
                except Exception as e:    # noqa: BLE001 - refused; goes to its caller
                    engine.decline_kv_offer(arg.params.kv_transfer_params)
                    self._post(self._fail, arg.request_id, e)
                finally:
                    # Counted only once it is in the waiting queue, so that the bound check
                    # in add_request never sees it in neither place.
                    self._adds_taken += 1
            elif cmd == "abort":
                out = engine.abort_request(arg)
                if out is not None:
                    outs.append(out)
            elif cmd == "decline":
                engine.decline_kv_offer(arg)
            elif cmd == "stats":
                self._post(_resolve, arg, engine.get_stats())
            elif cmd == "reset_prefix_cache":
                self._post(_resolve, arg, engine.reset_prefix_cache())
            elif cmd == "read_lora":
                lora, fut = arg
                engine.read_lora(lora, lambda why, fut=fut: self._post(_resolve, fut, why))
            elif cmd == "profile":
                start, args, fut = arg
                try:
                    outs.extend(engine.profile(start, *args))
                    self._post(_resolve, fut, None)
                except Exception as e:    # noqa: BLE001 - goes to its caller
                    self._post(_reject, fut, e)
            elif cmd == "collective_rpc":
                self._rpcs.append(arg)
            elif cmd == "abort_all":
                outs.extend(engine.fail_all(arg))

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._streams):
            self._fail(rid, error)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
