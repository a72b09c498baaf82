"""The synchronous engine: add requests, then ``step()`` until they finish.

One step is schedule -> build input -> execute -> process output:
- the ``Scheduler`` picks the sequences and token counts, and the KV block moves (swap out,
  swap in, copy-on-write) that must happen first;
- ``build_step_input`` turns that plan into the model runner's ``StepInput``;
- the runner (in process, or WorkAgents through shared memory) moves the blocks, runs one
  ragged forward pass over all the tokens and samples one token for every sequence that
  reached the end of its known tokens;
- the ``OutputProcessor`` puts the tokens on their sequences, detokenizes, checks stops, frees
  finished sequences' blocks and makes the ``RequestOutput``s.

With async scheduling (on with WorkAgents) the step started here runs on the model while this
method processes the previous one, so the model never waits for the master. A step with grammar
rows is started with a placeholder token mask; the mask follows once the previous step's tokens
are processed, and the model waits for it only before sampling.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Optional, Union

import numpy as np

from llm_serving.config import EngineArgs, EngineConfig
from llm_serving.errors import ConfigError
from llm_serving.engine.block_manager import BlockManager
from llm_serving.engine.constraints import Constraints
from llm_serving.engine.input_builder import block_pairs, build_step_input, lora_paths_array
from llm_serving.engine.input_processor import InputProcessor, NewRequest, PromptType
from llm_serving.engine.logits_dump import WARM_UP_ID, LogitsDumper
from llm_serving.engine.kv_cache_residency import KVResidency
from llm_serving.engine.metrics import KV_RESIDENCY_HISTOGRAMS, EngineStats
from llm_serving.engine.mfu import MfuEstimator, ModelShape
from llm_serving.engine.output_processor import OutputProcessor, StepInFlight
from llm_serving.engine.processor_rows import ProcessorRows
from llm_serving.engine.remote_kv import build_remote_kv
from llm_serving.engine.scheduler import Scheduler
from llm_serving.model_executor.multistream.split import multi_stream_on_master, step_split
from llm_serving.engine.sequence import Sequence, SequenceStatus
from llm_serving.executor.protocol import StepInput
from llm_serving.outputs import RequestOutput
from llm_serving.pooling_params import PoolingParams
from llm_serving.sampling_params import RequestOutputKind, SamplingParams
from llm_serving.tokenizer import Tokenizer
from llm_serving.profiler import (NOT_ENABLED, ProfilerActiveError, TraceRecorder,
                                  check_iterations, check_prefix, master_name)
from llm_serving.tracing import RequestTracer

__all__ = ["LLMEngine", "NewRequest", "PromptType"]
logger = logging.getLogger(__name__)
_EMPTY = np.zeros(0, np.int32)
_KV_POLL_S = 0.002      # between polls of KV transfers when nothing else runs


def _lora_registry(config: EngineConfig):
    """The adapters the engine serves (enable_lora), ``lora_modules``' checked now, before
    the model loads; None without LoRA."""
    if config.lora is None:
        return None
    from llm_serving.lora.registry import LoRARegistry
    try:
        return LoRARegistry(config.lora, config.model.hf)
    except ValueError as e:
        raise ConfigError("lora_modules", str(e)) from None


def _adapter_names(seqs) -> tuple[str, ...]:
    """The LoRA adapters' names among ``seqs``, each once, in order."""
    return tuple(dict.fromkeys(s.lora_name for s in seqs if s.lora_name))


def create_executor(config: EngineConfig, cancel: Optional[threading.Event] = None):
    """The model runner in this process ("uni"), or WorkAgent processes ("mp"); both have
    ``submit``/``collect``, ``execute`` and ``move_blocks``. ``cancel``: once set, WorkAgents
    still loading or running a step are given up (the executor raises AgentDiedError)."""
    if config.parallel.backend == "mp":
        from llm_serving.executor.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor(config, cancel=cancel)
    from llm_serving.model_executor.model_runner import ModelRunner
    return ModelRunner(config)


def _proposer(config: EngineConfig):
    """The draft proposer when speculative decoding is on, else None."""
    if config.speculative is None:
        return None
    from llm_serving.spec_decode.ngram_proposer import NgramProposer
    return NgramProposer(config.speculative)


class LLMEngine:
    def __init__(self, config: Union[EngineArgs, EngineConfig]):
        if isinstance(config, EngineArgs):
            config = config.create_engine_config()
        self.config = config
        self.model_config = config.model.hf
        self.max_model_len = config.model.max_model_len
        self.tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
        self.loras = _lora_registry(config)     # None unless enable_lora
        # Set when stopping: a replacement WorkAgent still loading or warming up is given up.
        self.cancel_loading = threading.Event()
        self.runner = create_executor(config)
        # A collective_rpc callable, apply_model or reload_weights ran (the weights may not
        # be the checkpoint's any more: a restarted WorkAgent warns that it loads those)
        self._weights_touched = False
        stats = EngineStats.with_buckets(     # the one set of counters
            config.histogram_buckets, kv_residency=config.kv_cache_metrics_sample is not None)
        # --kv-events-config: the prefix cache's events, published once per step
        self.kv_events = event_log = None
        if config.kv_events is not None:
            from llm_serving.engine.kv_events import KVEventLog, ZmqEventPublisher
            event_log = KVEventLog(config.cache.block_size)
            self.kv_events = ZmqEventPublisher(config.kv_events)
        self.block_manager = BlockManager(config.cache, stats, residency=(
            KVResidency(config.kv_cache_metrics_sample, stats,
                        evictions=config.cache.enable_prefix_caching)
            if config.kv_cache_metrics_sample is not None else None),
            events=event_log)
        # --enable-logging-iteration-details: a line per step (the step's phase counts,
        # set while it is built, until logged)
        self.log_iterations = config.log_iterations
        self._phase_counts: Optional[tuple] = None
        self._iteration = 0
        # --enable-mfu-metrics: each step's FLOPs and bytes estimated (None: off)
        self.mfu = MfuEstimator(ModelShape.of(config), stats) if config.enable_mfu_metrics \
            else None
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   proposer=_proposer(config))
        self.constraints = Constraints(self.tokenizer, config.model.vocab_size,
                                       config.model.structured_outputs, config.model.reasoning)
        self.input_processor = InputProcessor(config, self.tokenizer, self.constraints,
                                              self.loras)
        # the rows' requests for the user's logits processors; None: none configured
        self.processor_rows = ProcessorRows() if config.model.logits_processors else None
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler,
                                                self.max_model_len, config.model.pooler)
        if config.speculative is not None and config.per_request_spec_decode_metrics != "none":
            self.output_processor.spec_metrics = (
                config.speculative.num_speculative_tokens,
                config.per_request_spec_decode_metrics == "detailed")
        self.dumper = LogitsDumper(config.dump) if config.dump else None
        self.async_scheduling = config.scheduler.async_scheduling
        # a pooling runner's pooling type (LAST, MEAN, CLS); None: a generate runner
        self.pooling = config.model.pooler.pooling_type if config.model.pooler else None
        self.multi_stream = multi_stream_on_master(config)    # None: steps run unsplit
        self._in_flight: Optional[StepInFlight] = None
        self._arrivals = itertools.count()
        self._init_remote_kv()
        # LoRA adapters registered at run time, for the model runner to read before the next
        # step: (LoRARequest, done(why: None once read)).
        self._lora_reads: collections.deque = collections.deque()
        self._read_served_loras()
        # --otlp-traces-endpoint: a span per request, ended by whoever reads its last output
        # (AsyncLLMEngine on the event loop, LLM after its step); None: tracing off
        # --profiler-config: this process's trace recorder (profile()); None: off
        self.trace = (TraceRecorder(config.profiler, master_name())
                      if config.profiler is not None else None)
        # a profile's (prefix, step to start at, step to stop at or None) while it waits for
        # its delay_iterations or has max_iterations; None otherwise
        self._profile_plan: Optional[tuple] = None
        self.tracer = (RequestTracer(config.otlp_traces_endpoint, config.model.path)
                       if config.otlp_traces_endpoint else None)

    def _init_remote_kv(self) -> None:
        """KV transfer (PD disaggregation), when configured: the scheduler-side connector,
        told where each rank's KV lives."""
        info = getattr(self.runner, "kv_connector_info", None)
        self.remote_kv = build_remote_kv(self.config, self.block_manager,
                                         info() if info is not None else [])
        self.scheduler.remote = self.remote_kv

    @property
    def requests(self):
        """The live requests, by id."""
        return self.output_processor.requests

    @property
    def stats(self) -> EngineStats:
        """The counters (shared by the scheduler, block manager and output processor)."""
        return self.block_manager.stats

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: PromptType,
                    params: Union[SamplingParams, PoolingParams, None] = None,
                    request_id: Optional[str] = None, priority: int = 0,
                    arrival_time: Optional[float] = None, lora_request=None) -> str:
        """Queue a request. Raises ValueError for bad input, QueueFullError when full."""
        return self.add_processed(self.process_request(prompt, params, request_id, priority,
                                                       arrival_time, lora_request))

    def process_request(self, prompt: PromptType,
                        params: Union[SamplingParams, PoolingParams, None] = None,
                        request_id: Optional[str] = None, priority: int = 0,
                        arrival_time: Optional[float] = None,
                        lora_request=None) -> NewRequest:
        """Check and tokenize a request without touching the engine's state (any thread).
        ``lora_request``: the ``LoRARequest`` of the adapter it runs with (enable_lora)."""
        return self.input_processor.process(prompt, params, request_id, priority,
                                            arrival_time, lora_request)

    def add_processed(self, new: NewRequest) -> str:
        """Queue a checked request (from ``process_request``)."""
        self.scheduler.check_room()
        if new.lora is not None:      # checked before its adapter was found unreadable
            self.loras.check_readable(new.lora)
        seq = self.output_processor.add(new, next(self._arrivals))
        self.scheduler.add(seq)
        return new.request_id

    def decline_kv_offer(self, params: Optional[dict]) -> None:
        """A request refused before it was queued will not read the producer's offer its
        ``kv_transfer_params`` carry: the producer frees the blocks at once, not when the
        offer expires. Nothing for other parameters, or without kv_transfer."""
        if self.remote_kv is not None and params:
            self.remote_kv.decline(params)

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """End the request now, whatever its state, and free its KV blocks and its slot.
        Returns its final output (finish_reason "abort"), or None for an unknown request."""
        out = self.output_processor.end_request(request_id, SequenceStatus.FINISHED_ABORTED)
        self.constraints.release()
        return out

    def has_unfinished_requests(self) -> bool:
        """Requests are unfinished, a step is still running on the model, or KV transfers
        are in flight (the workers are polled until they end)."""
        return (bool(self.requests) or self._in_flight is not None
                or (self.remote_kv is not None and self.remote_kv.busy))

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and start a step; return the outputs of the step that completed (this
        one, or with async scheduling the previous one: decodes of the new step take their
        input token from the running step's sample, which the model runner fills in). The
        step's KV cache events, if any, are published as one batch."""
        start = time.monotonic() if self.log_iterations else 0.0
        outputs = self._step()
        if self.kv_events is not None:
            self._publish_kv_events()
        if self._phase_counts is not None:
            self._log_iteration(time.monotonic() - start)
        return outputs

    def _log_iteration(self, elapsed: float) -> None:
        """--enable-logging-iteration-details: the step's line, in vLLM's words (a step that
        ran no tokens is not logged, as vLLM)."""
        counts, self._phase_counts = self._phase_counts, None
        logger.info("Iteration(%d): %d context requests, %d context tokens, %d generation "
                    "requests, %d generation tokens, iteration elapsed time: %.2f ms, CPU KV "
                    "cache usage: %.1f%%", self._iteration, *counts, elapsed * 1e3,
                    self.block_manager.usage * 100)
        self._iteration += 1

    def _publish_kv_events(self) -> None:
        events = self.block_manager.events.take()
        if events:
            self.kv_events.publish(events)

    def _step(self) -> list[RequestOutput]:
        outputs = self._profile_due() if self._profile_plan is not None else []
        batch = self.scheduler.schedule()
        outputs += [o for o in map(self._fail_timed_out, batch.timed_out) if o is not None]
        kv_meta = self.remote_kv.metadata_array(batch) if self.remote_kv is not None else None
        if not batch.seqs:
            if self._in_flight is not None:
                outputs += self._collect(self._take_in_flight())
            if batch.swap_out or (self.remote_kv is not None
                                  and (self.remote_kv.busy or len(kv_meta))):
                # a step that only preempted still moves the KV; one that only polls KV
                # transfers starts and checks them (or only declines an offer)
                outputs += self._move_and_poll(batch, kv_meta)
            self.constraints.release()
            return outputs
        built = build_step_input(batch, self.config.cache.block_size,
                                 self.output_processor.eos_token_ids, self.constraints,
                                 self.pooling, self.processor_rows)
        if kv_meta is not None:
            built.step.kv_meta = kv_meta
        if self.log_iterations:
            self._phase_counts = built.phase_counts()
        self.stats.num_prefill_tokens += built.num_prefill_tokens
        self.stats.iteration_tokens.observe(built.num_tokens)
        if self.mfu is not None:
            self.mfu.observe(built.step.query_start_loc, built.step.seq_lens, built.prompt_lens)
        if self.multi_stream is not None:      # decided here, once, for every rank
            built.step.ms_split, reason = step_split(built.step.query_start_loc,
                                                     self.multi_stream)
            self.stats.multistream_steps[reason] = self.stats.multistream_steps.get(reason, 0) + 1
        if built.sampled and self.constraints.mask_deferred:   # rows need the running step's tokens
            built.step.mask_after_forward = 1
        dumps = self.dumper.plan(built.sampled) if self.dumper else ()
        if dumps:
            built.step.dump_rows = LogitsDumper.rows(dumps)
        self.runner.submit(built.step)
        previous = self._in_flight
        self._in_flight = StepInFlight(built.sampled, built.prompt_logprobs, dumps,
                                       built.first_rows, built.pooled)
        for row, seq in enumerate(built.sampled):
            if seq.status is SequenceStatus.RUNNING:     # not a pending n > 1 child
                seq.expect_token(row)
        for seq, _, final in built.pooled:
            if final:           # its result is in flight: nothing more to schedule
                seq.expect_token(-1)
        if previous is not None:
            outputs += self._collect(previous)    # the samples the new step's decodes read
        if built.step.mask_after_forward:
            # The new step's forward is running: its mask, from the tokens just processed.
            self.runner.send_mask(self.constraints.deferred_bitmask())
        self.scheduler.after_step(batch)
        if not self.async_scheduling:
            outputs += self._collect(self._take_in_flight())
        self.constraints.release()      # the grammar state of sequences that ended
        return outputs

    def _move_and_poll(self, batch, kv_meta) -> list[RequestOutput]:
        """A step with no tokens: block moves and/or KV transfer work only."""
        step = StepInput(_EMPTY, _EMPTY, _EMPTY, np.zeros((0, 0), np.int32),
                         np.zeros(1, np.int32), _EMPTY, _EMPTY, None,
                         swap_out=block_pairs(batch.swap_out))
        if kv_meta is not None:
            step.kv_meta = kv_meta
        self.runner.execute(step)
        outputs = self._apply_kv_outputs()
        if not batch.swap_out and not self.requests_ready():
            time.sleep(_KV_POLL_S)        # only transfers in flight: poll, don't spin
        return outputs

    def requests_ready(self) -> bool:
        """Some request can be scheduled (it is waiting, running or swapped)."""
        return self.scheduler.has_unfinished()

    def _apply_kv_outputs(self) -> list[RequestOutput]:
        """What the workers reported about KV transfers: blocks to free, requests whose KV
        arrived, requests whose transfer failed under policy ``fail``."""
        if self.remote_kv is None:
            return []
        sch = self.scheduler
        failed = self.remote_kv.update(self.runner.take_kv_connector_output(), sch.waiting,
                                       sch._rank)
        outs = [self.output_processor.end_request(seq.request_id,
                                                  SequenceStatus.FINISHED_ABORTED, reason)
                for seq, reason in failed]
        return [o for o in outs if o is not None]

    def collect_in_flight(self) -> list[RequestOutput]:
        """Wait for the step running, if any, and process its samples: its outputs."""
        return self._collect(self._take_in_flight()) if self._in_flight is not None else []

    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        """vLLM's: ``method`` run on every model process between two steps, the results by
        rank (``executor/collective_rpc.py``). Call ``collect_in_flight`` first."""
        if self._in_flight is not None:
            raise RuntimeError("collective_rpc: a step is in flight; collect_in_flight first")
        if not isinstance(method, str) or method in ("apply_model", "reload_weights"):
            self._weights_touched = True
        return self.runner.collective_rpc(method, timeout, tuple(args), kwargs)

    def _take_in_flight(self) -> StepInFlight:
        fl, self._in_flight = self._in_flight, None
        return fl

    def _collect(self, fl: StepInFlight) -> list[RequestOutput]:
        """Wait for the oldest running step (``fl``) and process its samples."""
        result = self.runner.collect()
        if fl.dumps:
            self.dumper.save(fl.dumps, result.dump_logits)
        ended = self._end_unreadable_loras() if self.loras is not None else []
        return ended + self.output_processor.process(fl, result) + self._apply_kv_outputs()

    def read_lora(self, lora, done) -> None:
        """Have the model runner read a newly registered adapter before the next step (vLLM's
        workers load an adapter when it is added), so that its requests run even if its
        directory is gone by then. ``done(why)`` is called with None once it is read, else
        with the reason (the id is then not run again)."""
        self._lora_reads.append((lora, done))

    @property
    def lora_reads_pending(self) -> bool:
        return bool(self._lora_reads)

    def read_new_loras(self) -> list[RequestOutput]:
        """The reads ``read_lora`` asked for, each a step without tokens; the step running
        is collected first (its outputs are returned)."""
        outputs = self.collect_in_flight()
        while self._lora_reads:
            lora, done = self._lora_reads.popleft()
            why = "the model process failed while reading it"
            try:
                why = self._read_loras([lora]).get(lora.lora_int_id)
            finally:
                done(why)
        return outputs

    def _read_served_loras(self) -> None:
        """The adapters served by name read by the model runner: at start (--lora-modules)
        and by a new WorkAgent."""
        if self.loras is not None:
            self._read_loras(list(self.loras.served.values()))

    def _read_loras(self, loras: list) -> dict:
        """The model runner reads ``loras`` now (nothing may be in flight); {id: why} of those
        it could not read, whose ids are not run again (lora/registry.py)."""
        failed = {}
        for lora in loras:
            self.runner.execute(StepInput(
                _EMPTY, _EMPTY, _EMPTY, np.zeros((0, 0), np.int32), np.zeros(1, np.int32),
                _EMPTY, _EMPTY, None,
                lora_paths=lora_paths_array({lora.lora_int_id: lora.lora_path})))
            for lora_id, why in self.runner.take_lora_failures().items():
                logger.error("LoRA adapter %d could not be read: %s", lora_id, why)
                self.loras.unreadable(lora_id, why)
                failed[lora_id] = why
        return failed

    def _end_unreadable_loras(self) -> list[RequestOutput]:
        """End the requests of the LoRA adapters the model runner could not read (their rows
        ran without them; the other requests of the step go on), and never run those ids
        again (lora/registry.py)."""
        failed = self.runner.take_lora_failures()
        outs = []
        for lora_id, why in failed.items():
            self.loras.unreadable(lora_id, why)
            for rid, req in list(self.requests.items()):
                seq = req.seqs[0]
                if seq.lora_id == lora_id:
                    logger.error("request %s: LoRA adapter %r could not be read at %s: %s",
                                 rid, seq.lora_name, seq.lora_path, why)
                    outs.append(self.output_processor.end_request(
                        rid, SequenceStatus.FINISHED_ABORTED,
                        f"the model process could not read LoRA adapter {seq.lora_name!r} at "
                        f"{seq.lora_path}: {why}"))
        return [o for o in outs if o is not None]

    def _fail_timed_out(self, seq: Sequence) -> Optional[RequestOutput]:
        return self.output_processor.end_request(
            seq.request_id, SequenceStatus.FINISHED_TIMEOUT,
            f"request waited {time.time() - seq.arrival_time:.1f} s in the queue without "
            f"starting (queue_timeout={self.scheduler.queue_timeout} s)")

    def _drain(self) -> None:
        """Collect a step still running, ignoring its result (the requests are failing)."""
        if self._in_flight is not None:
            self._in_flight = None
            try:
                self.runner.collect()
            except Exception:   # noqa: BLE001 - the runner failed; its owner restarts it
                pass

    # ---- life cycle -----------------------------------------------------------------------
    def warm_up(self) -> None:
        """Run one small request through every path a first request takes (prefill, decode,
        sampling, kernel loading), so that the first real request is not slow. Leaves the
        stats (counters stay monotonic across a WorkAgent restart) and the prefix cache as
        they were."""
        stats, op = self.stats.saved(), self.output_processor
        kept = len(op.finished_metrics), len(op.finished_sequences)
        params = (PoolingParams() if self.pooling is not None else
                  SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                 output_kind=RequestOutputKind.FINAL_ONLY))
        self.add_request({"prompt_token_ids": [1] * min(16, self.max_model_len - 2)},
                         params, request_id=WARM_UP_ID)
        while self.has_unfinished_requests():     # a step still in flight included
            self._step()        # its KV cache events are not published: dropped below
        self.block_manager.reset()
        if self.kv_events is not None:
            self.block_manager.events.take()
        self.stats.restore(stats)
        for metrics, count in zip((op.finished_metrics, op.finished_sequences), kept):
            while len(metrics) > count:     # the warm-up's own timings
                metrics.pop()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): the next prompts are
        computed in full. False, and nothing done, while a request is unfinished."""
        if self.requests or any(self.block_manager.ref_counts):
            return False
        self._drain()        # a step of requests that have ended may still be running
        self.block_manager.reset()
        if self.kv_events is not None:
            self._publish_kv_events()
        return True

    def runner_alive(self) -> bool:
        is_alive = getattr(self.runner, "is_alive", None)
        return is_alive() if is_alive is not None else True

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with ``error`` (finish_reason "abort"), freeing all blocks."""
        self._drain()
        self._forget_processor_rows()
        outs = [self.output_processor.end_request(rid, SequenceStatus.FINISHED_ABORTED, error)
                for rid in list(self.requests)]
        return [o for o in outs if o is not None]

    def _forget_processor_rows(self) -> None:
        """After a failed step, whose rows the WorkAgent may not have taken in: the next
        step sends every row's parameters again (a row the agent holds keeps its state)."""
        if self.processor_rows is not None:
            self.processor_rows = ProcessorRows()

    def fail_running(self, error: str) -> list[RequestOutput]:
        """End the requests that have started (running or swapped out) with ``error``, as
        ``fail_all``; the ones still waiting to start stay queued."""
        self._drain()
        self._forget_processor_rows()
        sch = self.scheduler
        started = dict.fromkeys(s.request_id for s in sch.running + sch.swapped)
        outs = [self.output_processor.end_request(rid, SequenceStatus.FINISHED_ABORTED, error)
                for rid in started]
        return [o for o in outs if o is not None]

    def restart_runner(self) -> None:
        """Replace a dead model runner (a WorkAgent that died). Call after ``fail_all``: the
        KV cache is gone, so the block pools and the prefix cache start empty."""
        self._in_flight = None
        try:
            self.runner.shutdown()
        except Exception:   # noqa: BLE001 - it is dead already
            pass
        if self.remote_kv is not None:      # the transfers died with the workers
            self.remote_kv.drop_all()
        self.block_manager.reset()
        if self.kv_events is not None:      # a router learns that the cache is gone
            self._publish_kv_events()
        self.runner = create_executor(self.config, self.cancel_loading)
        if self._weights_touched:
            logger.warning("the new WorkAgent loaded the model's checkpoint: weights that "
                           "collective_rpc changed or reloaded since the start are not in it")
            self._weights_touched = False
        self._forget_processor_rows()           # the new agent's batch starts empty
        self._init_remote_kv()
        self.warm_up()
        self._read_served_loras()
        if self.trace is not None and self.trace.active:    # the new agents record too
            self.runner.profile(True, self.trace.prefix)

    # ---- profiling (--profiler-config) --------------------------------------------------------
    @property
    def profiling(self) -> bool:
        """A profile records, or waits for its delay_iterations."""
        return self.trace is not None and (self.trace.active or self._profile_plan is not None)

    def profile(self, start: bool, prefix: Optional[str] = None,
                delay_iterations: Optional[int] = None,
                max_iterations: Optional[int] = None) -> list[RequestOutput]:
        """vLLM's start_profile / stop_profile, between two steps: this thread's and every
        WorkAgent's trace recorder start, or stop and write their traces; the step running is
        collected first (its outputs are returned). vLLM's ``delay_iterations`` model steps
        pass before the recorders start, and they stop (writing) once they recorded
        ``max_iterations`` (0: at stop_profile); None takes profiler_config's. Stopping with no
        profile does nothing."""
        if self.trace is None:
            raise ValueError(NOT_ENABLED)
        if not start:
            self._profile_plan = None
            return self._record(False) if self.trace.active else []
        if self.profiling:
            raise ProfilerActiveError()
        check_prefix(prefix)
        config = self.trace.config
        delay, limit = check_iterations(
            config.delay_iterations if delay_iterations is None else delay_iterations,
            config.max_iterations if max_iterations is None else max_iterations)
        now = self.stats.num_steps
        self._profile_plan = (prefix, now + delay, now + delay + limit if limit else None)
        return self._profile_due()

    def _profile_due(self) -> list[RequestOutput]:
        """Start or stop the recorders when the profile's step counts say so (checked before
        each step while a profile waits or has max_iterations)."""
        prefix, start_at, stop_at = self._profile_plan
        if not self.trace.active:
            if self.stats.num_steps < start_at:
                return []
            if stop_at is None:
                self._profile_plan = None
            return self._record(True, prefix)
        if stop_at is not None and self.stats.num_steps >= stop_at:
            self._profile_plan = None
            return self._record(False)
        return []

    def _record(self, start: bool, prefix: Optional[str] = None) -> list[RequestOutput]:
        outputs = self.collect_in_flight()
        agents = getattr(self.runner, "profile", None)
        if start:
            self.trace.start(prefix)
            try:
                if agents is not None:
                    agents(True, prefix)
            except BaseException:
                self.trace.discard()
                self._profile_plan = None
                raise
            logger.info("profiler started")
        else:
            written = agents(False) if agents is not None and self.runner_alive() else []
            written.append(self.trace.stop())
            logger.info("profiler stopped: %d traces written: %s", len(written),
                        ", ".join(written))
        return outputs

    def kill_runner(self) -> None:
        """Kill the WorkAgent processes at once, if any (a step they hold then fails with
        AgentDiedError); ``shutdown`` still frees the rest."""
        if hasattr(self.runner, "kill"):
            self.runner.kill()

    def shutdown(self) -> None:
        """Stop WorkAgent processes, if any (the in-process runner needs nothing), export
        the spans not sent yet and send the KV events (for a bounded while), freeing the
        publisher's ports."""
        if self.trace is not None and self.trace.active:
            self._stop_profile_at_shutdown()
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def _stop_profile_at_shutdown(self) -> None:
        """A profile still recording at shutdown is stopped and every process's trace written,
        as vLLM's shutdown does; the WorkAgents' only if they still answer (not after they
        were killed for a step that hung)."""
        self._profile_plan = None
        if self.runner_alive():
            try:
                self._record(False)
                return
            except Exception as e:  # noqa: BLE001 - the master's trace is still written
                logger.warning("profiler: the WorkAgents' traces were not written at "
                               "shutdown: %s", e)
        else:
            logger.warning("profiler: stopped by the shutdown after the WorkAgents stopped: "
                           "only the master's trace is written")
        if self.trace.active:
            logger.info("profiler stopped: trace written: %s", self.trace.stop())

    # ---- stats ----------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters; per-request timings of requests
        finished since the previous call are handed over once."""
        sch, bm, st = self.scheduler, self.block_manager, self.stats
        snap = EngineStats(**{k: v for k, v in vars(st).items()
                              if k not in ("finished_requests", "finished_sequences")})
        snap.finished_by_reason = dict(st.finished_by_reason)
        snap.kv_transfers = dict(st.kv_transfers)
        if self.remote_kv is not None:
            snap.kv_blocks_held = self.remote_kv.num_blocks_held
            snap.kv_loads_in_flight = len(self.remote_kv.loading)
        snap.multistream_steps = dict(st.multistream_steps)
        snap.spec_decode_accepted_per_pos = list(st.spec_decode_accepted_per_pos)
        snap.iteration_tokens = st.iteration_tokens.copy()
        for name in KV_RESIDENCY_HISTOGRAMS:
            if getattr(st, name) is not None:
                setattr(snap, name, getattr(st, name).copy())
        snap.inter_token_latency = st.inter_token_latency.copy()
        snap.num_running = len(sch.running)
        snap.num_waiting = len(sch.waiting) + sum(len(s.pending_children) for s in sch.waiting)
        snap.num_swapped = len(sch.swapped)
        snap.running_lora_adapters = _adapter_names(sch.running)
        snap.waiting_lora_adapters = _adapter_names([*sch.waiting, *sch.swapped])
        snap.kv_cache_usage = bm.usage
        snap.cpu_cache_usage = bm.cpu_usage
        op = self.output_processor
        snap.finished_requests, snap.finished_sequences = (list(op.finished_metrics),
                                                           list(op.finished_sequences))
        op.finished_metrics.clear()
        op.finished_sequences.clear()
        return snap
