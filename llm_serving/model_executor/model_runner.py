"""Runs one step of the model: builds the forward context, runs the forward pass, samples.

Its input is a plain description of the step (``StepInput``: arrays and small ints), so the
same runner serves an in-process engine and a WorkAgent fed through shared memory.

Under tensor parallelism each WorkAgent runs one of these on its shard of the model (the
process's group, ``parallel_state.get_tp_group()``): every rank runs every step and block move,
and only rank 0 samples.
"""
from __future__ import annotations

import collections
import ctypes
import gc
from typing import Callable, Optional

import numpy as np
from mindspore import Tensor, ops

from llm_serving.config import EngineConfig, check_tensor_parallel, kv_heads_per_rank
from llm_serving.executor.protocol import SamplerOutput, StepInput
from llm_serving.model_executor.attention.alibi import rank_slopes
from llm_serving.model_executor.attention.backend import AttentionMetadata
from llm_serving.model_executor.attention.selector import get_attention_backend
from llm_serving.model_executor.device import init_device
from llm_serving.model_executor.forward_context import ForwardContext, set_forward_context
from llm_serving.model_executor.layers.linear import VocabEmbedding
from llm_serving.model_executor.layers.pooler import pool_rows
from llm_serving.model_executor.loader import ModelConfig, iter_weights
from llm_serving.model_executor.parallel_state import get_tp_group
from llm_serving.sample.sampler import Sampler


# Prompt logprobs take the logits of this many bytes of rows at a time (bounded memory).
_PROMPT_LOGITS_BYTES = 64 << 20


def build_model(config: ModelConfig, backend, tp_rank: int = 0, tp_size: int = 1,
                multistream_config=None, pooling: bool = False):
    # ModelConfig has already rejected architectures outside loader.SUPPORTED_ARCHITECTURES;
    # all but GPTBigCode are Llama-shaped (InternLM2 and Baichuan under other weight names).
    # A pooling runner's (config.POOLING_ARCHITECTURES) is the Llama decoder without its head.
    if pooling:
        from llm_serving.model_executor.models.llama import LlamaEmbeddingModel as cls
    elif config.architecture == "GPTBigCodeForCausalLM":
        from llm_serving.model_executor.models.gpt_bigcode import GPTBigCodeForCausalLM as cls
    elif config.architecture == "InternLM2ForCausalLM":
        from llm_serving.model_executor.models.internlm2 import InternLM2ForCausalLM as cls
    elif config.architecture in ("BaichuanForCausalLM", "BaiChuanForCausalLM"):
        from llm_serving.model_executor.models.baichuan import BaichuanForCausalLM as cls
    else:
        from llm_serving.model_executor.models.llama import LlamaForCausalLM as cls
    return cls(config, backend, tp_rank, tp_size, multistream_config=multistream_config)


def _return_freed_memory() -> None:
    """Give the loader's freed buffers (the float32 staging copies, the float32 Parameters a
    bf16 model replaced) back to the OS: glibc keeps freed heap memory otherwise, and the
    process would look as big as at its loading peak (97 M model: RSS 1184 -> 805 MB in fp32,
    1347 -> 644 MB with bf16 weights)."""
    gc.collect()                            # the replaced Parameters sit in reference cycles
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):       # not glibc: nothing to do
        pass


def _as_arrays(weights):
    """(name, array) pairs with NumPy arrays (CPU torch tensors converted, bf16 widened)."""
    for name, w in weights:
        if hasattr(w, "detach"):            # a torch tensor: NumPy has no bfloat16
            w = w.detach().cpu()            # (int8 weights of a W8A8 model stay int8)
            w = w.numpy() if str(w.dtype) == "torch.int8" else w.float().numpy()
        yield name, w


class ModelRunner:
    def __init__(self, config: EngineConfig):
        """Load the model and allocate the KV cache of this process's tensor-parallel rank
        (its group is set up by ``parallel_state.init_tensor_parallel`` first)."""
        m, cache = config.model, config.cache
        self.engine_config = config
        self.tp = tp = get_tp_group()
        self.device = init_device(config.device.device, config.device.start_device_id + tp.rank)
        self.config = c = m.hf
        check_tensor_parallel(c, tp.size)
        self.backend = get_attention_backend(
            self.device, c.num_heads // tp.size, kv_heads_per_rank(c.num_kv_heads, tp.size),
            c.head_dim, m.kv_cache_dtype,
            rank_slopes(c.num_heads, tp.rank, tp.size) if c.alibi else None)
        ms = config.multi_stream
        ms_mode = (ms.mode(tp.size, self.device, config.parallel.cpu_allreduce)[0]
                   if ms is not None else "off")
        if ms_mode != "off":            # multistream/overlap.py: how micro-batches overlap
            from llm_serving.model_executor.multistream.overlap import set_overlap
            set_overlap(ms_mode, self.device)
        self.pooler = m.pooler           # a pooling runner's (layers/pooler.py); None: generate
        self.model = build_model(c, self.backend, tp.rank, tp.size,
                                 ms if ms_mode != "off" else None, m.pooler is not None)
        if c.quantization is not None:      # a W8A8 checkpoint: int8 weights, before loading
            from llm_serving.model_executor.models.weights import use_int8_weights
            use_int8_weights(self.model, c.quantization, self.model.stacked_params)
        if m.dtype == "bfloat16" and self.device == "CPU":
            from llm_serving.model_executor.layers.linear import use_bf16_weights
            use_bf16_weights(self.model)    # linear weights stored bf16, activations fp32
        from llm_serving.model_executor.kv_scales import set_kv_layer_dtypes
        set_kv_layer_dtypes(self.model, m.kv_layer_dtypes)  # FP8 layers: the KV scales fold
        self.model.load_weights(iter_weights(m.path, checkpoint=m.checkpoint))
        _return_freed_memory()
        self._worker = None       # collective_rpc's Worker, in process (made on first use)
        self.loras = None           # LoRA adapters (model_executor/lora.py), enable_lora
        if config.lora is not None:
            from llm_serving.model_executor.lora import LoRAModels
            self.loras = LoRAModels(self.model, config.lora, c)
        self.block_size = block_size = cache.block_size
        self.num_blocks = num_blocks = cache.num_blocks
        num_cpu_blocks = cache.num_cpu_blocks
        # One cache per layer, each of its layer's dtype (kv_cache_dtype_skip_layers' layers:
        # auto's); the attention layers find theirs by index in the forward context.
        self.kv_caches = [self.backend.allocate_kv_cache(num_blocks, block_size, dtype)
                          for dtype in m.kv_layer_dtypes]
        # Host block pool for swapped-out sequences (only with preemption_mode="swap").
        self.host_caches = [self.backend.allocate_host_cache(num_cpu_blocks, block_size, dtype)
                            for dtype in m.kv_layer_dtypes] if num_cpu_blocks else []
        self.kv_connector = None        # KV transfer (PD disaggregation), worker side
        self._kv_outputs: list = []
        if config.kv_transfer is not None:
            from llm_serving.distributed.kv_transfer.base import KVConnectorRole
            from llm_serving.distributed.kv_transfer.factory import (create_connector,
                                                                      kv_model_tag)
            self.kv_connector = create_connector(config.kv_transfer, KVConnectorRole.WORKER,
                                                 block_size, tp.rank, tp.size,
                                                 kv_model_tag(config))
            self.kv_connector.register_kv_caches(self.kv_caches)
        # Decode steps replayed from a capture (cpu_graph.py): CPU kernels on one rank, no
        # KV connector (its hooks read the hidden states), unless --enforce-eager.
        self.graphs = None
        from llm_serving.model_executor.layers.custom_op import use_cpu_kernels
        ex = config.execution
        if (self.device == "CPU" and use_cpu_kernels() and tp.size == 1
                and self.kv_connector is None and not ex.enforce_eager and self.pooler is None
                and ex.max_capture_batch > 0):
            from llm_serving.model_executor.cpu_graph import CpuGraphs
            self.graphs = CpuGraphs(self._forward_logits, ex.max_capture_batch,
                                    -(-m.max_model_len // block_size),
                                    config.scheduler.max_num_seqs)
        self.sampler = Sampler(seed=m.seed, always_chosen_logprob=False)
        if m.logits_processors and tp.is_driver:     # the user's (only the driver samples)
            from llm_serving.sample.custom_logits_processors import CustomLogitsProcessors
            self.sampler.custom = CustomLogitsProcessors(config)
        self._last_tokens = np.zeros(0, np.int32)    # the previous step's samples
        self._results: collections.deque = collections.deque()   # submitted, not collected
        # A step whose token mask follows (mask_after_forward): in process it runs once the
        # mask is sent; in a WorkAgent, the agent sets this to wait for the master's mask.
        self._awaiting_mask: Optional[StepInput] = None
        self.wait_for_mask: Optional[Callable[[], None]] = None

    # ---- collective_rpc (executor/collective_rpc.py) -----------------------------------------
    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        """vLLM's, in process ("uni"): ``method`` run here, on the caller's thread, its
        result in a list of one (no timeout, as vLLM's in-process executor)."""
        from llm_serving.executor.collective_rpc import (CollectiveRPCError, Worker, check_call,
                                                         method_name, run_call)
        check_call(method, timeout, args, kwargs)
        if self._worker is None:
            self._worker = Worker(self, self.tp.rank, self.tp.size)
        try:
            return [run_call(self._worker, method, tuple(args), kwargs)]
        except Exception as e:
            raise CollectiveRPCError(f"collective_rpc({method_name(method)}) failed in "
                                     f"process: {type(e).__name__}: {e}") from e

    def weights_changed(self) -> None:
        """The weights may have changed in place or been replaced: drop what was derived
        from them (the CPU graphs, which replay recorded addresses, and the LM head's packed
        copy); the next steps make them again."""
        if self.graphs is not None:
            self.graphs.forget()
        for _, cell in self.model.cells_and_names():
            if isinstance(cell, VocabEmbedding):
                cell.forget_packed_head()

    def reload_weights(self, weights=None, path: Optional[str] = None) -> None:
        """Load new weights, as at start: from (HF name, array) pairs, the parameters they
        name (each whole: all the parts of a fused one), or from the checkpoint at ``path``
        (default: the model's own), all of them. Nothing is stored unless all fit."""
        from llm_serving.model_executor.models.weights import reloading
        m = self.engine_config.model
        with reloading(partial=weights is not None):
            self.model.load_weights(_as_arrays(weights) if weights is not None else
                                    iter_weights(path, None) if path
                                    else iter_weights(m.path, m.checkpoint))
        self.weights_changed()
        _return_freed_memory()

    def move_blocks(self, swap_out: np.ndarray, swap_in: np.ndarray,
                    copies: np.ndarray) -> None:
        """Swap out, then swap in, then copy-on-write: a block freed by a swap-out may be
        reused by a swap-in or a copy of the same step."""
        b = self.backend
        if len(swap_out):
            for dev, host in zip(self.kv_caches, self.host_caches):
                b.swap_out(dev, host, swap_out)
        if len(swap_in):
            for dev, host in zip(self.kv_caches, self.host_caches):
                b.swap_in(host, dev, swap_in)
        if len(copies):
            for dev in self.kv_caches:
                b.copy_blocks(dev, copies)

    def forward(self, step: StepInput, rows: np.ndarray) -> Optional[np.ndarray]:
        """Run the model on the step and return float32 logits for the given token rows
        (None on tensor-parallel ranks other than 0)."""
        return self._logits(self._run(step), rows)

    def _run(self, step: StepInput):
        """The model's final hidden states for every token row of the step."""
        md = AttentionMetadata(step.slot_mapping, step.block_tables, step.query_start_loc,
                               step.seq_lens, self.block_size)
        split = int(np.ravel(step.ms_split)[0])     # an int in process, an array from shm
        lora = (self.loras.for_step(step.lora_ids, step.lora_paths, step.query_start_loc)
                if self.loras is not None else None)
        embeds = (step.embed_rows, step.embeds) if len(step.embed_rows) else None
        return self._hidden(Tensor(step.input_ids), Tensor(step.positions), md, split, lora,
                            embeds)

    def _hidden(self, input_ids: Tensor, positions: Tensor, md: AttentionMetadata,
                split: int = 0, lora=None, embeds=None):
        md = self.backend.prepare(md)
        with set_forward_context(ForwardContext(md, self.kv_caches, input_ids.shape[0],
                                                split, self.backend, lora, embeds)):
            return self.model(input_ids, positions)

    def _forward_logits(self, input_ids, positions, slot_mapping, block_tables,
                        query_start_loc, seq_lens) -> np.ndarray:
        """The logits of every row, the model reading these arrays' own memory (the CPU
        graphs' inputs: a replay reads them where the capture did)."""
        md = AttentionMetadata(slot_mapping, block_tables, query_start_loc, seq_lens,
                               self.block_size)
        hidden = self._hidden(Tensor.from_numpy(input_ids), Tensor.from_numpy(positions), md)
        return self.model.compute_logits(hidden)

    def _graph_logits(self, step: StepInput, rows: np.ndarray) -> Optional[np.ndarray]:
        """The step's logits from a replayed capture, or None: run it eagerly (also a step
        with a LoRA row or rows given as embeddings: a capture holds the base model's kernel
        calls, the embedding's gather among them)."""
        if (self.graphs is None or len(step.prompt_lp_rows) or int(np.ravel(step.ms_split)[0])
                or len(step.lora_ids) or len(step.embed_rows)
                or not self.graphs.replayable(step)):
            return None
        return self.graphs.logits(step, rows)

    def _logits(self, hidden, rows: np.ndarray) -> np.ndarray:
        if len(rows) == 0:
            return np.empty((0, self.config.vocab_size), np.float32)
        if len(rows) != hidden.shape[0] or np.any(rows != np.arange(len(rows))):
            hidden = ops.gather(hidden, Tensor(rows.astype(np.int32)), 0)
        return self.model.compute_logits(hidden)

    # ---- KV transfer: seed 001's calls around the forward ---------------------------------
    def kv_connector_info(self) -> list:
        """This rank's connector handshake, as a list over ranks (the executor interface)."""
        return [self.kv_connector.handshake_info()] if self.kv_connector is not None else []

    def kv_connector_info_bytes(self) -> bytes:
        import json
        return (json.dumps(self.kv_connector.handshake_info()).encode()
                if self.kv_connector is not None else b"")

    def take_kv_connector_output(self) -> list:
        out, self._kv_outputs = self._kv_outputs, []
        return out

    def kv_output_bytes(self) -> bytes:
        """The outputs of the steps run since the last call, for the master (one per step;
        a WorkAgent sends it with each DONE)."""
        outs = self.take_kv_connector_output()
        if not outs:
            return b""
        merged = outs[0]
        for o in outs[1:]:
            merged.sent += o.sent
            merged.recved += o.recved
            merged.failed.update(o.failed)
            merged.bytes += o.bytes
        return merged.to_bytes()

    def take_lora_failures(self) -> dict:
        """{adapter id: why} of the LoRA adapters this runner could not read since the last
        call (the executor interface; model_executor/lora.py)."""
        return self.loras.take_failures() if self.loras is not None else {}

    def execute(self, step: StepInput) -> Optional[SamplerOutput]:
        self.move_blocks(step.swap_out, step.swap_in, step.copies)
        conn = self.kv_connector
        if conn is None:
            return self._execute(step)
        from llm_serving.distributed.kv_transfer.base import KVConnectorMetadata
        conn.bind_connector_metadata(KVConnectorMetadata.from_array(step.kv_meta)
                                     or KVConnectorMetadata())
        try:
            # Before the forward: start this step's loads (they fill blocks of requests
            # waiting for them, not of this batch, so nothing waits on them here).
            conn.recv_kv_caches_and_hidden_states(self.model, step, self.kv_caches)
            result, hidden = self._execute(step, with_hidden=True)
            # After it: offers/saves of this step, then what finished.
            conn.send_kv_caches_and_hidden_states(self.model, step, self.kv_caches, hidden)
            conn.wait_for_save()
            out = conn.build_connector_output()
            if out:
                self._kv_outputs.append(out)
        finally:
            conn.clear_connector_metadata()
        return result

    def _execute(self, step: StepInput, with_hidden: bool = False):
        if not len(step.input_ids):   # a step that only moves KV blocks or reads adapters
            if self.loras is not None and len(step.lora_paths):
                self.loras.read(step.lora_paths)
            return (None, None) if with_hidden else None
        if self.pooler is not None:
            return self._pool(step)
        rows = step.query_start_loc[1:][step.sample_seqs] - 1
        if len(step.sample_offsets):        # speculative decoding: drafts' rows too
            rows = rows - step.sample_offsets
        if len(step.pending_pos):
            self._fill_pending(step, rows)
        hidden = None
        logits = None if with_hidden else self._graph_logits(step, rows)
        if logits is None:
            hidden = self._run(step)
            logits = self._logits(hidden, rows)
        if self.tp.timers is not None:          # bench/bench_multistream.py only
            self.tp.timers.step_done()
        # Every rank takes part in the vocab-parallel gathers of the prompt rows' logits.
        prompt = self._prompt_logprobs(hidden, step) if len(step.prompt_lp_rows) else None
        if not self.tp.is_driver:
            return (None, hidden) if with_hidden else None
        if len(rows):
            if int(step.mask_after_forward) and self.wait_for_mask is not None:
                self.wait_for_mask()      # the master computed the mask during the forward
            dump = logits[step.dump_rows] if len(step.dump_rows) else None  # before the sampler
            out = self.sampler(logits, step.sampling)
            out.dump_logits = dump
            self._last_tokens = out.token_ids.astype(np.int32)
        else:
            self._last_tokens = np.zeros(0, np.int32)
            if prompt is None:
                return (None, hidden) if with_hidden else None
            # a prefill chunk that samples nothing still scores its prompt
            out = SamplerOutput(np.zeros(0, np.int64), np.zeros(0, np.float32))
        if prompt is not None:
            for name, value in prompt.items():
                setattr(out, name, value)
        return (out, hidden) if with_hidden else out

    def _pool(self, step: StepInput) -> Optional[SamplerOutput]:
        """A pooling runner's step: prompt chunks only, whose pooled row ranges are summed
        (rank 0 returns them; the hidden states are the same on every rank); a classifier's
        score head turns each into its logits (an empty range stays zeros: the head has no
        bias)."""
        hidden = self._run(step)
        if not self.tp.is_driver or not len(step.pool_starts):
            return None
        pooled = pool_rows(hidden.asnumpy(), step.pool_starts, step.pool_ends)
        if self.pooler.task == "classify":
            pooled = self.model.score(Tensor(pooled)).asnumpy()
        return SamplerOutput(np.zeros(0, np.int64), np.zeros(0, np.float32), pooled=pooled)

    def _fill_pending(self, step: StepInput, rows: np.ndarray) -> None:
        """Async scheduling: put the previous step's samples where the master had
        placeholders, in the input ids and at the end of penalized rows' output tokens."""
        tokens = (self._last_tokens[step.pending_src] if self.tp.is_driver
                  else np.zeros(len(step.pending_src), np.int32))
        step.input_ids[step.pending_pos] = self.tp.broadcast_from_driver(tokens)
        s = step.sampling
        if self.tp.is_driver and s is not None and s.output_token_ids is not None:
            for r in np.flatnonzero(s.penalized_rows):
                out = s.output_token_ids[r]
                if len(out) and out[-1] < 0:
                    out[-1] = step.input_ids[rows[r]]

    # The executor interface: in process, a step runs when it is submitted, or, when its
    # token mask follows, when the mask is sent.
    def submit(self, step: StepInput) -> None:
        if self._awaiting_mask is not None:
            raise RuntimeError("the previous step's token mask was never sent")
        if int(step.mask_after_forward):
            self._awaiting_mask = step
        else:
            self._results.append(self.execute(step))

    def send_mask(self, bitmask: Optional[np.ndarray]) -> None:
        step, self._awaiting_mask = self._awaiting_mask, None
        if step is None:
            raise RuntimeError("no submitted step waits for a token mask")
        if bitmask is not None:
            step.sampling.token_bitmask = bitmask
        self._results.append(self.execute(step))

    def collect(self) -> Optional[SamplerOutput]:
        if not self._results and self._awaiting_mask is not None:
            self.send_mask(None)         # collected unmasked (an engine failing its requests)
        return self._results.popleft()

    def _prompt_logprobs(self, hidden, step: StepInput) -> Optional[dict]:
        """Score the step's prompt rows (raw log_softmax, as the sampler's logprobs), a few
        hundred rows' logits at a time: the SamplerOutput's ``prompt_*`` fields (None on
        tensor-parallel ranks other than 0, which only join the logits' gathers)."""
        rows, ids = step.prompt_lp_rows, step.prompt_lp_token_ids.astype(np.int64)
        k = int(step.prompt_lp_k.max())
        chunk = max(1, _PROMPT_LOGITS_BYTES // (4 * self.config.vocab_size))
        parts = []
        for s in range(0, len(rows), chunk):
            logits = self._logits(hidden, rows[s:s + chunk])
            if logits is not None:
                parts.append(self.sampler.compute_logprobs(
                    logits, ids[s:s + chunk], np.full(len(logits), k, np.int32)))
        if not parts:
            return None
        return {"prompt_" + name: np.concatenate([getattr(p, name) for p in parts])
                for name in ("logprobs", "ranks", "top_token_ids", "top_logprobs")}
