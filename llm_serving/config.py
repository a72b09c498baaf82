"""Engine arguments and the engine's configuration.

``EngineArgs`` is the one set of knobs for LLM(...), the YAML config and the CLI: names follow
vLLM where vLLM has one (``num_blocks`` comes from llm-serving's pa_config), and every value
is checked on construction, with an error naming the key.

``EngineArgs.create_engine_config()`` resolves them once (the model's config.json read, the
KV pool sized, defaults that depend on other knobs decided) into a frozen ``EngineConfig`` of
small parts: model, cache, scheduler, parallel, device, and room for multi-stream and KV
transfer. Each component takes the part it needs; the WorkAgent gets the whole config as JSON.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Optional, Union

from llm_serving.device_target import auto_device_target
from llm_serving.distributed.kv_transfer.config import KVTransferConfig
from llm_serving.errors import ConfigError, config_mapping
from llm_serving.executor.shm_channel import check_result_channel
from llm_serving.model_executor.cpu_graph import STEADY_STEPS
from llm_serving.model_executor.layers.pooler import PoolerSettings, resolve_pooler
from llm_serving.model_executor.multistream.config import MultiStreamConfig
from llm_serving.model_executor.quantization import QUANT_METHOD
from llm_serving.profiler import ProfilerConfig
from llm_serving.sampling_params import MAX_LOGPROBS
from llm_serving.histogram_buckets import check_histogram_buckets
from llm_serving.kv_events_config import KVEventsConfig
from llm_serving.reasoning_config import PARSER_MARKERS, ReasoningConfig
from llm_serving.structured_outputs_config import StructuredOutputsConfig
from llm_serving import vllm_env
from llm_serving.tracing import check_tracing
from llm_serving.spec_decode.config import SpeculativeConfig, max_sample_rows
from llm_serving.spec_decode.request_metrics import LEVELS as SPEC_METRICS_LEVELS

if TYPE_CHECKING:
    from llm_serving.model_executor.loader import ModelConfig

logger = logging.getLogger(__name__)

# The allowed values of the choice knobs (their one home).
EXECUTOR_BACKENDS = ("uni", "mp")
PREEMPTION_MODES = ("recompute", "swap")
CPU_ALLREDUCE = ("shm", "mccl")
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM's (and torch's) other names for them
DTYPE_ALIASES = {"float": "float32", "half": "float16"}
# KV cache storage (vLLM's --kv-cache-dtype): auto is the backend's own (float32 on CPU,
# float16 on Ascend); float16 and bfloat16 halve a CPU block's bytes, FP8 (vLLM's names; fp8
# is fp8_e4m3) quarters them.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
@dataclass(frozen=True)
class NoEffect:
    """A vLLM engine argument that means nothing on this engine: why, its value's type on the
    command line (None: a switch), and the values taken when another would mean something this
    engine does not do (empty: any)."""
    why: str
    type: Optional[type] = None
    allowed: tuple = ()
    nargs: Optional[str] = None      # several values after the flag (vLLM's)
    alias: Optional[str] = None      # vLLM's short flag (-O)


# What a pooling runner serves: the decoders models/llama.py runs (their LM head left out)
POOLING_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                         "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "InternLMForCausalLM")
# --reasoning-parser's names (entrypoints/reasoning.py splits the answers)
REASONING_PARSERS = tuple(PARSER_MARKERS)
LOCAL_ONLY = "the model and tokenizer load from local directories; nothing is downloaded"
CPU_GRAPHS = ("decode steps are replayed from CPU graph captures up to max_capture_batch "
              "(off with enforce_eager)")
# vLLM's engine arguments that mean nothing here: LLM(...), the YAML and the command line take
# them with one warning (drop_no_effect_args), so that a vLLM script or command line runs; any
# other unknown argument is refused by name.
VLLM_NO_EFFECT_ARGS = {
    "gpu_memory_utilization": NoEffect(
        "the KV pool is kv_cache_space GiB or num_blocks, as vLLM-CPU sizes it from "
        "VLLM_CPU_KVCACHE_SPACE, not from this fraction", float),
    "trust_remote_code": NoEffect("models run on this package's own model code; none is "
                                  "loaded from the model directory"),
    "disable_custom_all_reduce": NoEffect("there is no CUDA all-reduce to turn off"),
    "load_format": NoEffect("the model directory's weights load with this engine's loader",
                            str, ("auto", "safetensors")),
    "tokenizer_mode": NoEffect("the tokenizer is the model's Hugging Face tokenizer", str,
                               ("auto", "hf")),
    "pipeline_parallel_size": NoEffect(
        "one pipeline stage (tensor_parallel_size splits a model)", int, (1,)),
    "data_parallel_size": NoEffect(
        "one engine per server (run more servers behind a load balancer)", int, (1,)),
    "disable_sliding_window": NoEffect("the models served here have no sliding window"),
    "max_parallel_loading_workers": NoEffect(
        "each WorkAgent loads its own share of the weights", int),
    # the Hugging Face Hub's: as vLLM with a local model directory, they change nothing
    "revision": NoEffect(LOCAL_ONLY, str),
    "tokenizer_revision": NoEffect(LOCAL_ONLY, str),
    "code_revision": NoEffect(LOCAL_ONLY, str),
    "download_dir": NoEffect(LOCAL_ONLY, str),
    "hf_token": NoEffect(LOCAL_ONLY, str),
    "logprobs_mode": NoEffect("logprobs are always vLLM's default, raw_logprobs (the model's "
                              "log-softmax before temperature, penalties or top-k/p)", str,
                              ("raw_logprobs",)),
    "disable_cascade_attn": NoEffect("there is no cascade attention kernel to turn off"),
    "cpu_offload_gb": NoEffect("the weights are in host memory already", float, (0, 0.0)),
    # LoRA (docs/lora.md): vLLM's dtypes are taken, the adapters compute in float32 here
    "lora_dtype": NoEffect("LoRA adapters compute in float32, added to the layer's output",
                           str, ("auto", "float16", "bfloat16")),
    "fully_sharded_loras": NoEffect("LoRA adapters run on one WorkAgent (tensor_parallel_size "
                                    "1): there is nothing to shard"),
    # torch.compile and CUDA graphs (vLLM-CPU clears the capture sizes and compiles with
    # torch's inductor); decode steps here are replayed from CPU graph captures instead
    "compilation_config": NoEffect(f"nothing is compiled with torch here; {CPU_GRAPHS}", dict,
                                   alias="-cc"),
    "optimization_level": NoEffect(f"nothing is compiled with torch here; {CPU_GRAPHS}", int,
                                   (0, 1, 2, 3), alias="-O"),
    "cudagraph_capture_sizes": NoEffect(f"there are no CUDA graphs (vLLM-CPU drops these "
                                        f"sizes too); {CPU_GRAPHS}", int, nargs="+"),
    "max_cudagraph_capture_size": NoEffect(f"there are no CUDA graphs (vLLM-CPU captures none "
                                           f"either); {CPU_GRAPHS}", int),
    # how the model is found and read
    "config_format": NoEffect("the model's configuration is its Hugging Face config.json",
                              str, ("auto", "hf")),
    "model_impl": NoEffect("models run on this package's own model code", str,
                           ("auto", "vllm")),
    "ignore_patterns": NoEffect(LOCAL_ONLY, str, nargs="+"),
    "use_tqdm_on_load": NoEffect("no progress bar is drawn while the weights load"),
    "safetensors_load_strategy": NoEffect(
        "safetensors files are memory-mapped and each tensor read as its layer takes it", str,
        ("eager", "lazy", "prefetch")),
    "language_model_only": NoEffect("the models served here are language models only"),
    "prefix_caching_hash_algo": NoEffect(
        "prefix-cache blocks are keyed in the engine's memory by Python's hash of their "
        "tokens, and with kv_events_config by vLLM's default sha256 chain, which the events "
        "publish", str, ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")),
    "show_hidden_metrics_for_version": NoEffect("no metric is hidden here", str),
    "enable_sleep_mode": NoEffect("there is no sleep mode here (nor in vLLM-CPU)", None,
                                  (False,)),
    "additional_config": NoEffect(
        "a platform plugin's settings (vllm-ascend's); vLLM-CPU reads none either, and this "
        "engine's kernels and scheduling follow its own arguments", dict),
    "attention_backend": NoEffect("the attention backend follows the device: the CPU kernel "
                                  "or MindSpore's fused Ascend ops", str, ("CPU_ATTN",)),
    "disable_hybrid_kv_cache_manager": NoEffect(
        "the models served here have one kind of attention layer; the KV cache manager is "
        "not hybrid"),
    "kv_sharing_fast_prefill": NoEffect("the models served here share no KV cache across "
                                        "layers"),
    "model_loader_extra_config": NoEffect(
        "the weights load with this engine's loader (memory-mapped safetensors)", dict),
}
DEVICES = ("auto", "cpu", "ascend", "npu")
# Largest decode batch replayed from a capture (cpu_graph.py), by default: measured on W1 and
# `vllm bench serve` (docs/benchmarks.md).
MAX_CAPTURE_BATCH = 32
# How long a model step may run before its WorkAgent is taken for hung, unless
# execute_model_timeout or vLLM's variable says otherwise (vLLM's default too).
EXECUTE_MODEL_TIMEOUT_ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
DEFAULT_EXECUTE_MODEL_TIMEOUT = 300.0


def _arg(default, help: str):
    return field(default=default, metadata={"help": help})


def drop_no_effect_args(kwargs: dict, where: str, table: dict = VLLM_NO_EFFECT_ARGS) -> dict:
    """``kwargs`` without the arguments of ``table`` (name -> NoEffect), with one warning
    naming those given; a value other than the ones its NoEffect allows is a ConfigError
    naming the argument."""
    given = [k for k in kwargs if k in table]
    for k in given:
        allowed = table[k].allowed
        if allowed and kwargs[k] not in allowed:
            raise ConfigError(k, f"{kwargs[k]!r} is not supported here (only "
                              f"{' or '.join(map(str, allowed))}: {table[k].why})")
    if given:
        logger.warning("%s: these vLLM arguments have no effect here: %s", where,
                       "; ".join(f"{k} ({table[k].why})" for k in given))
    return {k: v for k, v in kwargs.items() if k not in table}


@dataclass
class EngineArgs:
    model: str = field(metadata={"help": "model directory (HF layout) or builtin:tiny-llama"})
    tokenizer: Optional[str] = _arg(None,
        "tokenizer directory (default: the model's)")
    checkpoint: Optional[str] = _arg(None,
        "a MindSpore .ckpt with mindformers' parameter names to load")
    skip_tokenizer_init: bool = _arg(False,
        "token ids in, token ids out, as vLLM: text prompts, chat, /tokenize, echo, "
        "logprobs on /v1/completions and structured outputs are refused, outputs carry no "
        "text and stop strings never match (the model directory still needs its tokenizer "
        "files here, for the end-of-sequence ids)")
    enable_prompt_embeds: bool = _arg(False,
        "vLLM's --enable-prompt-embeds: a prompt may be given as its input embeddings "
        "(prompt_embeds, a (tokens, hidden_size) float tensor) instead of token ids; "
        "see docs/openai.md")
    max_num_seqs: int = _arg(128,
        "most sequences per step (llm-serving's decode_batch_size)")
    max_num_batched_tokens: Optional[int] = _arg(None,
        "token budget per step (default 2048 with chunked prefill)")
    max_num_scheduled_tokens: Optional[int] = field(default=None, metadata={
        "help": "the most tokens the scheduler issues in a step, below max_num_batched_tokens "
                "(vLLM's flag; default: max_num_batched_tokens; '1k' is 1000)",
        "cli_type": "human_readable_int"})
    max_num_active_seqs: Optional[int] = _arg(None,
        "the most sequences admitted to run at once, below max_num_seqs, which still sizes "
        "the step buffers and the CPU graph captures (vLLM's flag; default: max_num_seqs)")
    max_model_len: Optional[int] = _arg(None,
        "longest prompt + output (default: the model's, capped by the KV pool)")
    block_size: int = _arg(16,
        "tokens per KV block")
    num_blocks: Optional[int] = _arg(None,
        "KV blocks (llm-serving's pa_config.num_blocks; default from kv_cache_space)")
    num_gpu_blocks_override: Optional[int] = _arg(None,
        "KV blocks, vLLM's name: wins over num_blocks")
    kv_cache_space: Optional[float] = _arg(None,
        "GiB for the KV cache when num_blocks is unset (per WorkAgent rank; default: vLLM-CPU's "
        "$VLLM_CPU_KVCACHE_SPACE, else 2)")
    kv_cache_memory_bytes: Optional[int] = field(default=None, metadata={
        "help": "bytes for the KV cache per WorkAgent rank, instead of kv_cache_space "
                "(vLLM's flag; '4G' is 4 GiB, '4g' 4e9)", "cli_type": "human_readable_int"})
    enable_chunked_prefill: bool = _arg(True,
        "chunk long prefills into the step budget (Dynamic SplitFuse)")
    enable_prefix_caching: bool = _arg(True,
        "reuse the KV blocks of shared prompt prefixes")
    preemption_mode: str = _arg("recompute",
        "recompute or swap (to a host pool of swap_space GiB)")
    swap_space: float = _arg(4.0,
        "GiB of host memory for swapped-out KV blocks (per WorkAgent rank)")
    scheduling_policy: str = _arg("fcfs",
        "fcfs, or priority: lower request priority runs first and may preempt")
    max_waiting_requests: int = _arg(1024,
        "new requests beyond this many waiting are refused at once")
    queue_timeout: Optional[float] = _arg(None,
        "seconds a request may wait before it starts; then it fails")
    max_num_queued_reqs: Optional[int] = _arg(None,
        "requests in flight (waiting or running; n answers count n) beyond which a new one "
        "is refused with 503 at once, for a load balancer to retry elsewhere (vLLM's flag; "
        "default: only max_waiting_requests bounds)")
    max_num_queued_tokens: Optional[int] = field(default=None, metadata={
        "help": "prompt tokens of the requests not past their prefill yet beyond which a new "
                "request is refused with 503 (vLLM's flag: set it to target TTFT x prefill "
                "tok/s; '32k' is 32000)", "cli_type": "human_readable_int"})
    long_prefill_token_threshold: int = _arg(0,
        "the most prompt tokens one request prefills per step while others are in the step, "
        "so a long prompt shares the budget with the prefills queued behind it (vLLM's flag;"
        " 0: no cap)")
    long_prefill_token_threshold_adaptive: bool = _arg(False,
        "raise long_prefill_token_threshold to the budget's fair share, "
        "max_num_batched_tokens / the requests waiting and running, when that is more "
        "(vLLM 0.32's flag)")
    scheduler_reserve_full_isl: bool = _arg(True,
        "admit a waiting prompt only when the KV pool can hold all of it, not just its "
        "first chunk, so chunked prefills are not over-admitted into preemptions (vLLM "
        "0.32's default; --no-scheduler-reserve-full-isl: the first chunk)")
    watermark: float = _arg(0.01,
        "fraction of KV blocks admission keeps free")
    distributed_executor_backend: Optional[str] = _arg(None,
        "uni: run the model in this process; mp: in WorkAgent processes (default: mp with "
        "tensor_parallel_size > 1 or cpu_affinity, else uni; the server always uses mp)")
    tensor_parallel_size: int = _arg(1,
        "WorkAgents (one per device) the model's heads, FFN and vocabulary are split over "
        "(default: the number of serving_config.agent_ports)")
    cpu_affinity: Optional[Union[str, list]] = _arg(None,
        "pin each WorkAgent to cores, ranks separated by '|': '0|1' puts rank 0 on core 0 "
        "and rank 1 on core 1; '0-3|4-7', '0,2|1,3'; in YAML also a list, one entry per rank")
    cpu_allreduce: str = _arg("shm",
        "how CPU tensor-parallel ranks all-reduce: shm (host shared memory, one machine) or "
        "mccl (MindSpore's collectives); Ascend always uses HCCL")
    start_device_id: int = _arg(0,
        "device of WorkAgent rank 0; rank r uses start_device_id + r (Ascend)")
    async_scheduling: Optional[bool] = _arg(None,
        "schedule step N+1 while the model computes step N (default: on with mp, off with "
        "uni, where nothing runs in parallel)")
    stream_interval: int = _arg(1,
        "a stream sends a request's tokens every this many tokens (its first token and its "
        "end at once): fewer, larger chunks, less work in the server process (vLLM's flag)")
    dump_logits: Optional[str] = _arg(None,
        "directory: save the raw logits of every request at dump_logits_every positions")
    dump_logits_every: int = _arg(100,
        "output positions between logits dumps (0, N, 2N, ...)")
    dtype: str = _arg("auto",
        "weights: auto or float32 (float32), or bfloat16 (CPU: linear-layer weights stored "
        "bf16; activations float32, or bf16 where the CPU has amx_bf16 or avx512_bf16 and "
        "that measures faster; "
        "docs/benchmarks.md has its accuracy cost)")
    quantization: Optional[str] = field(default=None, metadata={"cli_alias": "-q", "help": (
        "None (read from the model's config.json) or compressed-tensors: W8A8 int8 "
        "checkpoints made by llm-compressor or python -m llm_serving.quantize (CPU; README's "
        "models section)")})
    kv_cache_dtype: str = _arg("auto",
        "KV cache storage: auto (float32 on CPU, float16 on Ascend), float32, float16 or "
        "bfloat16 (CPU: half the bytes per block, so kv_cache_space holds twice the tokens, "
        "and decode attention reads half; float16 keeps 3 more bits than bfloat16, and stores "
        "values beyond +-65504 as +-65504), or fp8 (= fp8_e4m3) or fp8_e5m2 (CPU: a quarter "
        "of the bytes; unscaled, as vLLM without checkpoint scales: E4M3 keeps 3 mantissa "
        "bits up to +-448, E5M2 2 bits up to +-57344); docs/benchmarks.md has their "
        "accuracy cost")
    kv_cache_dtype_skip_layers: Optional[list] = field(default=None, metadata={
        "help": "layers whose KV cache stays at auto's dtype (float32 on CPU) whatever "
                "kv_cache_dtype says (vLLM's flag): layer indices (0 11), several after one "
                "flag, or sliding_window (the models served here have none, so it keeps no "
                "layer, as on vLLM); each such layer's blocks take its own bytes, so the same "
                "kv_cache_space holds fewer; docs/benchmarks.md has what it buys",
        "cli_nargs": "+"})
    device: str = _arg("auto",
        "auto, cpu or ascend")
    enforce_eager: bool = _arg(False,
        "run every step op by op (CPU: decode steps are otherwise replayed from a capture "
        "of their kernel calls, one per batch size; vLLM's flag for its CUDA graphs)")
    max_capture_batch: int = _arg(MAX_CAPTURE_BATCH,
        "largest decode batch replayed from a capture as soon as it is seen; a larger one "
        f"(up to max_num_seqs) only once it has kept its size for {STEADY_STEPS} steps in a row "
        "(each new size costs an extra step to capture and check, which a draining batch "
        "would pay for every size)")
    execute_model_timeout: Optional[float] = _arg(None,
        "seconds a model step may take before its WorkAgent is taken for hung: the requests "
        f"in flight fail and the agent is replaced (default: vLLM's {EXECUTE_MODEL_TIMEOUT_ENV} "
        f"from the environment, else {DEFAULT_EXECUTE_MODEL_TIMEOUT:.0f})")
    seed: int = _arg(0,
        "seed of the sampler for requests without their own")
    max_logprobs: int = _arg(MAX_LOGPROBS,
        "the most logprobs, top_logprobs or prompt_logprobs a request may ask for (vLLM's "
        "flag; -1: the vocabulary size). The WorkAgents' result channel is sized for it: one "
        "whose channel would exceed 1 GiB is refused (lower max_num_batched_tokens then)")
    chat_template: Optional[str] = _arg(None,
        "a Jinja chat template overriding the tokenizer's: the path of a template file, or the "
        "template itself (as vLLM's --chat-template)")
    generation_config: str = _arg("auto",
        "the sampling defaults of OpenAI requests that leave them out (temperature, top_p, "
        "top_k, min_p, repetition/presence/frequency penalties, and max_new_tokens for "
        "max_tokens): auto, from the model's generation_config.json (vLLM's default); vllm, "
        "OpenAI's neutral ones; or a directory holding a generation_config.json")
    override_generation_config: Optional[dict] = _arg(None,
        "sampling defaults over generation_config's (on the CLI as JSON), e.g. "
        "'{\"temperature\": 0.5}'")
    hf_overrides: Optional[dict] = _arg(None,
        "keys set over the model's config.json before it is read (on the CLI as JSON), as "
        "vLLM's --hf-overrides: a key's value replaces the file's, e.g. "
        "'{\"max_position_embeddings\": 8192}' or a new rope_scaling")
    trust_request_chat_template: bool = _arg(False,
        "let a request bring its own chat_template (vLLM's flag; off, such a request is "
        "refused: a template is a program the server runs)")
    enable_multi_stream: bool = _arg(False,
        "split large steps into two micro-batches and overlap one's tensor-parallel "
        "communication with the other's compute (docs/multistream.md)")
    multi_stream: Optional[dict] = _arg(None,
        "multi-stream knobs (the YAML multi_stream: section; on the CLI as JSON): "
        "min_total_tokens, min_prefill_tokens, max_imbalance, apply_to, overlap")
    kv_transfer_config: Optional[dict] = _arg(None,
        "PD disaggregation (the YAML kv_transfer: section; on the CLI as JSON, vLLM's shape): "
        "kv_connector (MooncakeConnector, MooncakeStoreConnector), kv_role (kv_producer, "
        "kv_consumer, kv_both), kv_connector_extra_config, kv_transfer_timeout, "
        "kv_failure_policy (recompute, fail; vLLM's kv_load_failure_policy too), "
        "kv_buffer_device (cpu, npu); the pool also reads MOONCAKE_CONFIG_PATH's file")
    speculative_config: Optional[dict] = _arg(None,
        "speculative decoding, vLLM's keys (the YAML llm_serving: key; on the CLI as JSON): "
        "method (only ngram: prompt lookup drafts), num_speculative_tokens, "
        "prompt_lookup_max, prompt_lookup_min (docs/speculative.md); turns async scheduling "
        "off, as vLLM")
    spec_method: Optional[str] = _arg(None,
        "vLLM's short form of speculative_config's method (only ngram here)")
    spec_model: Optional[str] = _arg(None,
        "vLLM's short form of speculative_config's model: a draft model, refused (only ngram "
        "drafts here)")
    spec_tokens: Optional[int] = _arg(None,
        "vLLM's short form of speculative_config's num_speculative_tokens")
    tool_call_parser: Optional[str] = _arg(None,
        "how tool calls are read from the model's text with tool_choice 'auto': hermes or "
        "llama3_json (needs enable_auto_tool_choice)")
    enable_auto_tool_choice: bool = _arg(False,
        "let the model decide whether to call a tool (tool_choice 'auto', vLLM's flag)")
    reasoning_parser: Optional[str] = _arg(None,
        "split a chat answer's <think>...</think> off its content into the message's "
        "reasoning field, as vLLM: qwen3 or deepseek_r1 (docs/openai.md)")
    structured_outputs_config: Optional[dict] = _arg(None,
        "structured outputs for every request, vLLM's keys (on the CLI as JSON): backend "
        "(auto or guidance: grammars run on llguidance, vLLM's guidance backend), "
        "disable_any_whitespace, disable_additional_properties (both need backend guidance), "
        "reasoning_parser (as --reasoning-parser), enable_in_reasoning (the grammar holds "
        "while the model thinks too); docs/openai.md")
    reasoning_config: Optional[dict] = _arg(None,
        "where the reasoning starts and what is forced to end it once a request's "
        "thinking_token_budget is spent, vLLM's keys (on the CLI as JSON): reasoning_parser "
        "(default: --reasoning-parser's, which alone turns budgets on), reasoning_start_str, "
        "reasoning_end_str (default: the parser's <think> and </think>); docs/openai.md")
    enable_lora: bool = _arg(False,
        "serve PEFT LoRA adapters on the base model (vLLM's flag; docs/lora.md)")
    lora_modules: Optional[list] = field(default=None, metadata={
        "help": "adapters served by name, as vLLM's: name=path, or JSON {\"name\": ..., "
                "\"path\": ..., \"base_model_name\": ...}; several after one flag; a request "
                "whose model is a name runs with that adapter (needs enable_lora)",
        "cli_nargs": "+"})
    max_loras: int = _arg(1,
        "the most different adapters in one step (vLLM's flag)")
    max_lora_rank: int = _arg(16,
        "the largest adapter rank taken; a larger adapter is refused (vLLM's flag)")
    max_cpu_loras: Optional[int] = _arg(None,
        "adapters each WorkAgent keeps loaded, least recently used dropped first (vLLM's "
        "flag; default and minimum: max_loras)")
    runner: str = _arg("auto",
        "generate, or pooling (an embedding model: /v1/embeddings, LLM.embed; a sequence "
        "classifier: /classify, /score, /rerank, LLM.classify, LLM.score); auto: pooling for a "
        "config.json naming a base model (LlamaModel, Qwen3Model, ...) or a sequence classifier "
        "(LlamaForSequenceClassification, ...), else generate")
    convert: str = _arg("auto",
        "vLLM's model conversion: embed serves a causal LM as an embedding model (runner "
        "pooling), classify a *ForSequenceClassification checkpoint as a classifier (what "
        "auto does for one); none or auto: as the runner decides")
    custom_histogram_buckets: Optional[dict] = _arg(None,
        "/metrics histogram bounds by vLLM's bucket family (on the CLI as JSON), e.g. "
        "'{\"time_to_first_token\": [0.1, 0.5, 1]}': request_latency, time_to_first_token, "
        "inter_token_latency, iteration_tokens, request_params_n, request_num_preemptions, "
        "request_tokens, kv_cache_residency (kv_cache_metrics' three)")
    kv_events_config: Optional[dict] = _arg(None,
        "publish the prefix cache's KV events (blocks stored, removed, all cleared) over "
        "ZeroMQ for a KV-aware router, vLLM's keys and wire format (on the CLI as JSON): "
        "enable_kv_cache_events, publisher (zmq or null), endpoint (default tcp://*:5557), "
        "replay_endpoint, buffer_steps, hwm, max_queue_size, topic; needs pip install "
        "'llm_serving[kv_events]' (docs/design.md)")
    otlp_traces_endpoint: Optional[str] = _arg(None,
        "the OTLP collector each request's OpenTelemetry span is sent to (vLLM's flag), e.g. "
        "http://collector:4317; grpc, or http/protobuf with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL "
        "(then the URL ends in /v1/traces); needs pip install 'llm_serving[tracing]'")
    collect_detailed_traces: Optional[list] = field(default=None, metadata={
        "help": "model, worker or all (vLLM's flag; needs otlp_traces_endpoint): taken and "
                "checked as vLLM 0.32 takes it, which adds nothing to the spans either",
        "cli_nargs": "+"})
    per_request_spec_decode_metrics: str = _arg("none",
        "with speculative_config: answers of one prompt and n 1 carry metrics."
        "speculative_decoding, the request's draft acceptance (vLLM's flag): summary (mean "
        "acceptance length, draft acceptance rate, the accepted-drafts histogram) or detailed "
        "(also each verify step's counts); none: off")
    kv_cache_metrics: bool = _arg(False,
        "vLLM's KV cache residency histograms on /metrics (kv_block_lifetime_seconds, "
        "kv_block_idle_before_evict_seconds, kv_block_reuse_gap_seconds), from a sample of the "
        "blocks (kv_cache_metrics_sample); recorded with prefix caching, as vLLM")
    kv_cache_metrics_sample: float = _arg(0.01,
        "the fraction of KV blocks kv_cache_metrics follows, in (0, 1] (vLLM's flag)")
    enable_logging_iteration_details: bool = _arg(False,
        "log a line per model step at info (vLLM's flag): its context (prompt) requests and "
        "tokens, generation requests and tokens, elapsed time and KV cache usage")
    enable_mfu_metrics: bool = _arg(False,
        "vLLM's Model FLOPs Utilization counters on /metrics (estimated_flops_per_gpu, "
        "estimated_read_bytes_per_gpu, estimated_write_bytes_per_gpu: per tensor-parallel "
        "rank) and the stats log's MFU line, estimated from the model's shape each step")
    logits_processors: Optional[list] = field(default=None, metadata={
        "help": "the user's logits processors, vLLM's: 'pkg.module:Class' (several after one "
                "flag; LLM(...) takes class objects too), subclasses of LogitsProcessor run on "
                "each step's logits (needs torch); a request's extra_args (vllm_xargs) reach "
                "them; docs/openai.md",
        "cli_nargs": "+"})
    profiler_config: Optional[dict] = _arg(None,
        "vLLM's profiler (on the CLI as JSON): profiler 'torch' and torch_profiler_dir turn on "
        "POST /start_profile and /stop_profile (LLM.start_profile/stop_profile), recorded "
        "with VizTracer (the profiling extra): one Chrome trace per process; "
        "torch_profiler_use_gzip, max_trace_entries (each process's ring buffer, 1000000), "
        "delay_iterations, max_iterations")
    pooler_config: Optional[dict] = _arg(None,
        "a pooling runner's pooler, vLLM's keys (on the CLI as JSON): pooling_type (LAST, "
        "MEAN, CLS; default LAST, or the model's sentence-transformers Pooling module), "
        "use_activation (L2-normalize; default true), dimensions (Matryoshka models)")

    def __post_init__(self):
        def positive(key, value, allow_none=False):
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, f"expected a positive integer, got {value!r}")
        from llm_serving.tokenizer import load_chat_template
        self.chat_template = load_chat_template(self.chat_template)   # a file's path, or text
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", f"expected a model directory path, got {self.model!r}")
        if self.tool_call_parser not in (None, "hermes", "llama3_json"):
            raise ConfigError("tool_call_parser", f"expected hermes or llama3_json, got "
                              f"{self.tool_call_parser!r}")
        so = StructuredOutputsConfig.from_value(self.structured_outputs_config)
        if so.reasoning_parser not in ("", *REASONING_PARSERS):
            raise ConfigError("structured_outputs_config.reasoning_parser", f"expected one of "
                              f"{', '.join(REASONING_PARSERS)}, got {so.reasoning_parser!r}")
        # kept whole (its defaults filled in) for the routes; --reasoning-parser wins, as vLLM
        self.structured_outputs_config = dataclasses.asdict(so)
        self.reasoning_parser = self.reasoning_parser or so.reasoning_parser or None
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ConfigError("reasoning_parser", f"expected one of "
                              f"{', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        reasoning = ReasoningConfig.resolve(self.reasoning_config, self.reasoning_parser)
        self.reasoning_config = dataclasses.asdict(reasoning) if reasoning else None
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ConfigError("hf_overrides", "expected a mapping of config.json keys to "
                              f"values, got {type(self.hf_overrides).__name__} (a function, "
                              "as vLLM's Python API also takes, is not supported)")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ConfigError("runner", f"expected auto, generate or pooling, got {self.runner!r}")
        if self.convert not in ("auto", "none", "embed", "classify"):
            raise ConfigError("convert", f"expected auto, none, embed or classify, got "
                              f"{self.convert!r}")
        if self.convert in ("embed", "classify") and self.runner == "generate":
            raise ConfigError("convert", f"{self.convert} makes a pooling model; it cannot run "
                              "with runner generate")
        if self.pooler_config is not None and not isinstance(self.pooler_config, dict):
            raise ConfigError("pooler_config", f"expected a mapping, got {self.pooler_config!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice", "needs tool_call_parser (hermes or "
                              "llama3_json) to read the model's tool calls")
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens, True)
        positive("max_num_scheduled_tokens", self.max_num_scheduled_tokens, True)
        positive("max_num_active_seqs", self.max_num_active_seqs, True)
        if self.max_num_active_seqs is not None and self.max_num_active_seqs > self.max_num_seqs:
            raise ConfigError("max_num_active_seqs", f"{self.max_num_active_seqs} cannot be "
                              f"greater than max_num_seqs ({self.max_num_seqs})")
        positive("max_model_len", self.max_model_len, True)
        positive("block_size", self.block_size)
        positive("stream_interval", self.stream_interval)
        positive("num_blocks", self.num_blocks, True)
        positive("num_gpu_blocks_override", self.num_gpu_blocks_override, True)
        if self.num_gpu_blocks_override is not None:     # vLLM's: wins over the sizing
            self.num_blocks = self.num_gpu_blocks_override
        positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, True)
        if self.kv_cache_space is None:
            self.kv_cache_space = vllm_env.kv_cache_space()
        if (not isinstance(self.kv_cache_space, (int, float)) or isinstance(self.kv_cache_space, bool)
                or self.kv_cache_space <= 0):
            raise ConfigError("kv_cache_space", f"expected GiB > 0, got {self.kv_cache_space!r}")
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):
            self.dtype = str(self.dtype)[len("torch."):]     # a torch.dtype, as vLLM takes
        if isinstance(self.dtype, str):
            self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, QUANT_METHOD):
            raise ConfigError("quantization", f"{self.quantization!r} is not supported here "
                              f"(only {QUANT_METHOD}, W8A8 int8, or None: read from the "
                              "model's config.json)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"expected one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        check_kv_skip_layers(self.kv_cache_dtype_skip_layers)
        if str(self.device).lower() not in DEVICES:
            raise ConfigError("device", f"expected auto, cpu or ascend, got {self.device!r}")
        positive("max_waiting_requests", self.max_waiting_requests)
        positive("max_num_queued_reqs", self.max_num_queued_reqs, True)
        positive("max_num_queued_tokens", self.max_num_queued_tokens, True)
        if isinstance(self.long_prefill_token_threshold, bool) or not isinstance(
                self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold", "expected an integer >= 0 (0: no "
                              f"cap), got {self.long_prefill_token_threshold!r}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ConfigError("long_prefill_token_threshold", "caps prefill chunks: it needs "
                              "enable_chunked_prefill")
        positive("dump_logits_every", self.dump_logits_every)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < -1:
            raise ConfigError("max_logprobs", "expected an integer >= 0, or -1 for the "
                              f"vocabulary size, got {self.max_logprobs!r}")

        def number(key, value, low, allow_none=False, low_inclusive=True, high=None,
                   high_inclusive=False):
            if value is None and allow_none:
                return
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
                value >= low if low_inclusive else value > low) and (
                high is None or (value <= high if high_inclusive else value < high))
            if not ok:
                rng = f"{'>=' if low_inclusive else '>'} {low}" + (
                    f" and {'<=' if high_inclusive else '<'} {high}" if high else "")
                raise ConfigError(key, f"expected a number {rng}, got {value!r}")
        number("swap_space", self.swap_space, 0)
        number("queue_timeout", self.queue_timeout, 0, allow_none=True, low_inclusive=False)
        number("execute_model_timeout", self.execute_model_timeout, 0, allow_none=True,
               low_inclusive=False)
        number("watermark", self.watermark, 0, high=1)
        positive("tensor_parallel_size", self.tensor_parallel_size)
        for key in ("start_device_id", "max_capture_batch"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(key, f"expected an integer >= 0, got {value!r}")
        if self.cpu_affinity is None and vllm_env.cpu_affinity() is not None:
            try:                # vLLM-CPU's variable, read as this argument
                self.cpu_affinity = self._checked_affinity(vllm_env.cpu_affinity())
            except ConfigError as e:
                raise ConfigError("VLLM_CPU_OMP_THREADS_BIND", e.problem) from None
        elif self.cpu_affinity is not None:
            self.cpu_affinity = self._checked_affinity(self.cpu_affinity)
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = (
                "mp" if self.tensor_parallel_size > 1 or self.cpu_affinity else "uni")
        elif self.distributed_executor_backend == "uni":
            if self.tensor_parallel_size > 1:
                raise ConfigError("distributed_executor_backend", "uni runs one model in this "
                                  f"process; tensor_parallel_size {self.tensor_parallel_size} "
                                  "needs mp (one WorkAgent per rank)")
            if self.cpu_affinity:
                raise ConfigError("cpu_affinity", "pins WorkAgent processes, and "
                                  "distributed_executor_backend uni has none (use mp)")
        for key, allowed in (("distributed_executor_backend", EXECUTOR_BACKENDS),
                             ("preemption_mode", PREEMPTION_MODES),
                             ("scheduling_policy", SCHEDULING_POLICIES),
                             ("cpu_allreduce", CPU_ALLREDUCE)):
            if getattr(self, key) not in allowed:
                raise ConfigError(key, f"expected one of {', '.join(allowed)}, "
                                  f"got {getattr(self, key)!r}")
        if not isinstance(self.multi_stream, (dict, type(None))):
            raise ConfigError("multi_stream", f"expected a mapping of knobs, got "
                              f"{self.multi_stream!r}")
        MultiStreamConfig.from_dict(self.multi_stream)      # names a bad knob now
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError("generation_config", "expected auto, vllm or a directory, got "
                              f"{self.generation_config!r}")
        if not isinstance(self.override_generation_config, (dict, type(None))):
            raise ConfigError("override_generation_config", "expected a mapping of sampling "
                              f"defaults, got {self.override_generation_config!r}")
        KVTransferConfig.from_dict(self.kv_transfer_config)   # names a bad key now
        ProfilerConfig.from_value(self.profiler_config)       # names a bad key now
        positive("max_loras", self.max_loras)
        positive("max_lora_rank", self.max_lora_rank)
        positive("max_cpu_loras", self.max_cpu_loras, True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError("max_cpu_loras", f"{self.max_cpu_loras} is fewer than max_loras "
                              f"({self.max_loras}): a step's adapters must all be loaded")
        self.lora_modules = parse_lora_modules(self.lora_modules)
        check_histogram_buckets(self.custom_histogram_buckets)     # names a bad family now
        KVEventsConfig.resolve(self.kv_events_config, self.enable_prefix_caching)
        self.collect_detailed_traces = check_tracing(self.otlp_traces_endpoint,
                                                     self.collect_detailed_traces)
        self.speculative_config = self._with_spec_short_forms()
        spec = SpeculativeConfig.from_value(self.speculative_config)   # names a bad key now
        if self.per_request_spec_decode_metrics not in SPEC_METRICS_LEVELS:
            raise ConfigError("per_request_spec_decode_metrics", "expected one of "
                              f"{', '.join(SPEC_METRICS_LEVELS)}, got "
                              f"{self.per_request_spec_decode_metrics!r}")
        if spec is None and self.per_request_spec_decode_metrics != "none":
            raise ConfigError("per_request_spec_decode_metrics", "requires speculative "
                              "decoding to be enabled (via speculative_config), as vLLM")
        if spec is not None and self.async_scheduling:
            raise ConfigError("async_scheduling", "cannot be combined with speculative_config "
                              "(method ngram): drafts are proposed from the tokens the last "
                              "step sampled; leave async_scheduling unset (vLLM's rule too)")
        if spec is not None and self.logits_processors:
            raise ConfigError("logits_processors", "custom logits processors are not supported "
                              "with speculative_config (vLLM's rule too)")
        if spec is not None and self.dump_logits:
            raise ConfigError("dump_logits", "cannot be combined with speculative_config "
                              "(the dump's rows are one per sequence and step)")
        number("kv_cache_metrics_sample", self.kv_cache_metrics_sample, 0, low_inclusive=False,
               high=1, high_inclusive=True)
        for key in ("enable_chunked_prefill", "enable_prefix_caching", "async_scheduling",
                    "enable_multi_stream", "enforce_eager", "enable_lora",
                    "skip_tokenizer_init", "kv_cache_metrics", "enable_mfu_metrics",
                    "enable_logging_iteration_details", "enable_prompt_embeds"):
            if key == "async_scheduling" and self.async_scheduling is None:
                continue
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(key, f"expected true or false, got {getattr(self, key)!r}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(unknown[0], "unknown engine argument; known ones are "
                              + ", ".join(sorted(known)))
        return cls(model=model, **kwargs)

    def _runs_on_cpu(self) -> bool:
        device = str(self.device).lower()
        if device == "cpu":
            return True
        if device != "auto":
            return False
        return auto_device_target() == "CPU"

    def _resolved_device(self) -> str:
        """The configured device, "auto" decided here (as MindSpore would), so that the
        master and every WorkAgent run with the same one."""
        device = str(self.device).lower()
        return auto_device_target().lower() if device == "auto" else device

    def _kv_cache_dtype(self, on_cpu: bool, asked: Optional[str] = None) -> str:
        """The KV cache storage dtype this configuration runs with (or ``asked`` would)."""
        asked = self.kv_cache_dtype if asked is None else asked
        if on_cpu:
            return {"auto": "float32", "fp8": "fp8_e4m3"}.get(asked, asked)
        if asked not in ("auto", "float16"):
            raise ConfigError("kv_cache_dtype", "the Ascend attention backend stores KV in "
                              "float16 (its PagedAttention kernel's dtype); use auto or float16")
        return "float16"

    def _kv_layer_dtypes(self, on_cpu: bool, num_layers: int) -> tuple:
        """Each layer's KV storage dtype: kv_cache_dtype's, or auto's for the layers
        kv_cache_dtype_skip_layers names (vLLM keeps those at the model's dtype)."""
        kv, full = self._kv_cache_dtype(on_cpu), self._kv_cache_dtype(on_cpu, "auto")
        skip = kv_skip_layer_indices(self.kv_cache_dtype_skip_layers, num_layers)
        if any(str(i).strip() == SLIDING_WINDOW for i in self.kv_cache_dtype_skip_layers or ()):
            logger.info("kv_cache_dtype_skip_layers: %s keeps no layer at %s (this model has "
                        "no sliding-window layers)", SLIDING_WINDOW, full)
        return tuple(full if i in skip else kv for i in range(num_layers))

    def _execute_model_timeout(self) -> float:
        """execute_model_timeout, else vLLM's environment variable, else the default."""
        if self.execute_model_timeout is not None:
            return float(self.execute_model_timeout)
        env = os.environ.get(EXECUTE_MODEL_TIMEOUT_ENV, "").strip()
        if not env:
            return DEFAULT_EXECUTE_MODEL_TIMEOUT
        try:
            value = float(env)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise ConfigError(EXECUTE_MODEL_TIMEOUT_ENV,
                              f"expected a number of seconds > 0, got {env!r}")
        return value

    def _with_spec_short_forms(self) -> Optional[dict]:
        """speculative_config with vLLM's --spec-method / --spec-tokens set in it, as vLLM
        combines them (a key given both ways is an error); the short forms are then cleared,
        so that the arguments re-checked (dataclasses.replace) combine the same."""
        short = {key: v for key, v in (("method", self.spec_method),
                                       ("num_speculative_tokens", self.spec_tokens))
                 if v is not None}
        if self.spec_model is not None:
            raise ConfigError("spec_model", f"{self.spec_model!r}: draft models are not "
                              "supported here, only n-gram (prompt lookup) drafts: --spec-method "
                              "ngram (docs/speculative.md)")
        if not short:
            return self.speculative_config
        config = dict(config_mapping("speculative_config", self.speculative_config or {}))
        for key, name in (("method", "spec_method"), ("num_speculative_tokens", "spec_tokens")):
            if key in short and key in config:
                raise ConfigError(name, f"both it and speculative_config's {key} are given: "
                                  "give one (vLLM's rule too)")
        self.spec_method = self.spec_tokens = None
        return {**config, **short}

    def _checked_affinity(self, value) -> list:
        affinity = parse_cpu_affinity(value)
        if len(affinity) != self.tensor_parallel_size:
            raise ConfigError("cpu_affinity", f"gives {len(affinity)} core set(s) for "
                              f"tensor_parallel_size {self.tensor_parallel_size}: give one per "
                              "rank, e.g. '0|1' for two")
        return affinity

    def _kv_cache_scheme(self, on_cpu: bool) -> None:
        """A checkpoint with a kv_cache_scheme (FP8 KV scales): kv_cache_dtype auto is fp8
        (E4M3) on CPU, as vLLM takes it; fp8_e5m2 is refused (vLLM's rule too)."""
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ConfigError("kv_cache_dtype", "fp8_e5m2 is not served with a checkpoint "
                              "whose quantization_config has a kv_cache_scheme (its scales "
                              "are for E4M3: use fp8, or auto)")
        if on_cpu and self.kv_cache_dtype == "auto":
            logger.info("kv_cache_dtype auto: fp8 (E4M3), as the checkpoint's kv_cache_scheme "
                        "asks (vLLM's rule); its k_scale / v_scale scale the cache")
            self.kv_cache_dtype = "fp8"

    def _check_quantization(self, hf, on_cpu: bool) -> None:
        """A W8A8 int8 checkpoint (config.json's quantization_config) runs on our CPU int8
        kernel, its other layers in float32 (with dtype bfloat16, as vLLM-CPU takes it: the
        linear layers it leaves in float hold bf16 weights); quantization=compressed-tensors
        needs one."""
        if hf.quantization is None or not hf.quantization.groups:    # none, or KV scales only
            if hf.quantization is None and self.quantization is not None:
                raise ConfigError("quantization", f"{self.quantization} asked, but the "
                                  "model's config.json has no quantization_config")
            return
        why = ("the device is not the CPU" if not on_cpu
               else "LLM_SERVING_NATIVE_OPS=1 turns our CPU kernels off"
               if os.environ.get("LLM_SERVING_NATIVE_OPS") == "1" else None)
        if why is not None:
            raise ConfigError("quantization", f"the model is a W8A8 int8 checkpoint "
                              f"(compressed-tensors), served by our CPU int8 kernel only: {why}")
        logger.info("the model is a W8A8 int8 checkpoint (compressed-tensors): its quantized "
                    "linear layers run on the CPU int8 kernel, the others in %s",
                    "float32 (the linear layers it leaves in float: bfloat16 weights)"
                    if self.dtype == "bfloat16" else "float32")

    def create_engine_config(self) -> "EngineConfig":
        """Resolve the arguments once: read the model's config.json, size the KV pools, and
        decide the defaults that depend on other knobs. Raises ConfigError naming the key."""
        from llm_serving.model_executor.loader import ModelConfig
        hf = ModelConfig.from_pretrained(self.model, self.hf_overrides)
        if self.hf_overrides:
            logger.info("the model's config.json with hf_overrides: %s", self.hf_overrides)
        check_tensor_parallel(hf, self.tensor_parallel_size)
        max_len = self.max_model_len or hf.max_position_embeddings
        if max_len > hf.max_position_embeddings:
            raise ConfigError("max_model_len", f"{max_len} exceeds the model's "
                              f"max_position_embeddings ({hf.max_position_embeddings})")
        on_cpu = self._runs_on_cpu()
        if hf.quantization is not None and hf.quantization.kv_cache_scheme:
            self._kv_cache_scheme(on_cpu)
        kv_dtype = self._kv_cache_dtype(on_cpu)
        layer_dtypes = self._kv_layer_dtypes(on_cpu, hf.num_layers)
        transfer = KVTransferConfig.from_dict(self.kv_transfer_config)
        if len(set(layer_dtypes)) > 1 and transfer is not None and transfer.kv_connector in (
                "MooncakeConnector", "MooncakeStoreConnector"):
            raise ConfigError(SKIP_LAYERS_KEY, f"{transfer.kv_connector} moves every layer's "
                              "KV blocks as one block size: layers of different KV dtypes are "
                              "not supported with it (InProcessConnector takes them)")
        block_bytes = kv_bytes_per_block(hf, self.block_size, self.tensor_parallel_size,
                                         layer_dtypes)
        kv_bytes = (self.kv_cache_memory_bytes if self.kv_cache_memory_bytes is not None
                    else int(self.kv_cache_space * 2**30))
        num_blocks = self.num_blocks or max(1, kv_bytes // block_bytes)
        capacity = num_blocks * self.block_size
        if capacity < max_len and self.max_model_len is None:
            logger.warning("max_model_len lowered from %d to %d, what %d KV blocks hold",
                           max_len, capacity, num_blocks)
            max_len = capacity
        if capacity < max_len:
            raise ConfigError("num_blocks", f"{num_blocks} blocks of {self.block_size} tokens "
                              f"cannot hold one sequence of max_model_len ({max_len}) tokens; "
                              "raise num_blocks or lower max_model_len")
        budget = self.max_num_batched_tokens or (2048 if self.enable_chunked_prefill
                                                 else max_len)
        if not self.enable_chunked_prefill and budget < max_len:
            raise ConfigError("max_num_batched_tokens",
                              f"{budget} is smaller than max_model_len ({max_len}); without "
                              "chunked prefill a whole prompt must fit in one step")
        scheduled = self.max_num_scheduled_tokens or budget
        if scheduled > budget:
            raise ConfigError("max_num_scheduled_tokens", f"{scheduled} is more than "
                              f"max_num_batched_tokens ({budget}), which sizes the step buffers")
        if not self.enable_chunked_prefill and scheduled < max_len:
            raise ConfigError("max_num_scheduled_tokens",
                              f"{scheduled} is smaller than max_model_len ({max_len}); without "
                              "chunked prefill a whole prompt must fit in one step")
        if on_cpu and self.dtype == "float16":
            raise ConfigError("dtype", "float16 is not supported on CPU (use auto or float32, "
                              "or bfloat16 for bf16 linear weights)")
        self._check_quantization(hf, on_cpu)
        if on_cpu and self.dtype == "bfloat16" and os.environ.get("LLM_SERVING_NATIVE_OPS") == "1":
            raise ConfigError("dtype", "bfloat16 weights need our CPU kernels, which "
                              "LLM_SERVING_NATIVE_OPS=1 turns off")
        mp = self.distributed_executor_backend == "mp"
        max_logprobs = hf.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        spec = SpeculativeConfig.from_value(self.speculative_config)
        pooler = self._pooler(hf)
        if pooler is not None and (self.enable_lora or self.speculative_config is not None):
            raise ConfigError("enable_lora" if self.enable_lora else "speculative_config",
                              "not supported with a pooling runner (embeddings)")
        if self.enable_prompt_embeds and (pooler is not None
                                          or self.kv_transfer_config is not None):
            raise ConfigError("enable_prompt_embeds", "not with a pooling runner" if pooler
                              else "not with kv_transfer_config (a prompt's embeddings do "
                              "not travel to another instance)")
        processors = ()
        if pooler is None and spec is None:     # (installed plugins: generation only)
            from llm_serving.sample.custom_logits_processors import resolve
            processors = resolve(self.logits_processors, not mp)
        elif self.logits_processors:
            raise ConfigError("logits_processors", "pooling models do not support custom "
                              "logits processors (vLLM's rule too)")
        if mp:
            check_result_channel(max_logprobs,
                                 max_sample_rows(spec, self.max_num_seqs, budget), budget,
                                 pooler.hidden_size if pooler is not None else 0)
        prefix_caching = self.enable_prefix_caching
        if pooler is not None and pooler.pooling_type != "LAST" and prefix_caching:
            # MEAN and CLS read positions a cached prefix would skip (vLLM turns it off too)
            logger.info("prefix caching off: %s pooling needs every prompt position",
                        pooler.pooling_type)
            prefix_caching = False
        return EngineConfig(
            model=ModelSettings(
                path=self.model, tokenizer=self.tokenizer or self.model,
                checkpoint=self.checkpoint, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
                kv_storage_dtype=kv_dtype, kv_layer_dtypes=layer_dtypes, max_model_len=max_len,
                seed=self.seed, chat_template=self.chat_template, hf=hf,
                max_logprobs=max_logprobs, pooler=pooler,
                structured_outputs=StructuredOutputsConfig(**self.structured_outputs_config),
                skip_tokenizer_init=self.skip_tokenizer_init, logits_processors=processors,
                enable_prompt_embeds=self.enable_prompt_embeds,
                reasoning=(ReasoningConfig(**self.reasoning_config)
                           if self.reasoning_config else None),
                default_sampling_params=generation_defaults(
                    self.model, self.generation_config, self.override_generation_config,
                    max_len)),
            cache=CacheConfig(
                block_size=self.block_size, num_blocks=num_blocks,
                num_cpu_blocks=(int(self.swap_space * 2**30) // block_bytes
                                if self.preemption_mode == "swap" else 0),
                enable_prefix_caching=prefix_caching, watermark=self.watermark),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
                max_num_scheduled_tokens=self.max_num_scheduled_tokens,
                max_num_active_seqs=self.max_num_active_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy, preemption_mode=self.preemption_mode,
                max_waiting=self.max_waiting_requests, queue_timeout=self.queue_timeout,
                max_in_flight=self.max_num_queued_reqs,
                max_prefill_backlog=self.max_num_queued_tokens,
                long_prefill_cap=self.long_prefill_token_threshold,
                long_prefill_adaptive=self.long_prefill_token_threshold_adaptive,
                reserve_full_prompt=self.scheduler_reserve_full_isl,
                max_loras=self.max_loras if self.enable_lora else 0,
                async_scheduling=(self.async_scheduling if self.async_scheduling is not None
                                  else mp and self.speculative_config is None),
                stream_interval=self.stream_interval),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, backend=self.distributed_executor_backend,
                cpu_affinity=(tuple(tuple(c) for c in self.cpu_affinity)
                              if self.cpu_affinity else None),
                cpu_allreduce=self.cpu_allreduce),
            device=DeviceConfig(device=self._resolved_device(),
                                start_device_id=self.start_device_id),
            execution=ExecutionConfig(enforce_eager=self.enforce_eager,
                                      max_capture_batch=self.max_capture_batch,
                                      execute_model_timeout=self._execute_model_timeout()),
            dump=(DumpConfig(self.dump_logits, self.dump_logits_every)
                  if self.dump_logits else None),
            multi_stream=(MultiStreamConfig.from_dict(self.multi_stream)
                          if self.enable_multi_stream else None),
            kv_transfer=_kv_transfer(self.kv_transfer_config),
            lora=self._lora_config(hf),
            speculative=spec,
            histogram_buckets={k: list(v) for k, v in
                               check_histogram_buckets(self.custom_histogram_buckets).items()},
            otlp_traces_endpoint=self.otlp_traces_endpoint,
            kv_events=KVEventsConfig.resolve(self.kv_events_config, prefix_caching),
            per_request_spec_decode_metrics=self.per_request_spec_decode_metrics,
            kv_cache_metrics_sample=(self.kv_cache_metrics_sample if self.kv_cache_metrics
                                     else None),
            enable_mfu_metrics=self.enable_mfu_metrics,
            log_iterations=self.enable_logging_iteration_details,
            profiler=ProfilerConfig.from_value(self.profiler_config))

    def _lora_config(self, hf) -> Optional["LoRAConfig"]:
        """The LoRA settings (None without enable_lora), checked against the rest of the
        configuration and the model."""
        if not self.enable_lora:
            if self.lora_modules:
                raise ConfigError("lora_modules", "adapters are served with enable_lora "
                                  "(--enable-lora)")
            return None
        from llm_serving.lora.peft import LORA_ARCHITECTURES
        if hf.architecture not in LORA_ARCHITECTURES:
            raise ConfigError("enable_lora", f"LoRA adapters are not supported for "
                              f"{hf.architecture} (supported: {', '.join(LORA_ARCHITECTURES)})")
        if self.tensor_parallel_size > 1:
            raise ConfigError("enable_lora", "LoRA adapters run on one WorkAgent: "
                              f"tensor_parallel_size {self.tensor_parallel_size} is not "
                              "supported with them")
        if self.enable_multi_stream:
            raise ConfigError("enable_lora", "LoRA adapters are not supported with "
                              "enable_multi_stream")
        if self.kv_transfer_config is not None:
            raise ConfigError("enable_lora", "LoRA adapters are not supported with KV "
                              "transfer (kv_transfer_config: PD disaggregation)")
        if self.speculative_config is not None:
            raise ConfigError("enable_lora", "LoRA adapters are not supported with "
                              "speculative_config (n-gram drafts) yet")
        from llm_serving.lora.peft import read_adapter
        for name, path, _ in self.lora_modules or ():
            try:                # a bad adapter stops the start, before the model loads
                read_adapter(path, hf, self.max_lora_rank)
            except ValueError as e:
                raise ConfigError("lora_modules", f"adapter {name!r}: {e}") from None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras or self.max_loras,
                          modules=tuple(self.lora_modules or ()))


    def _pooler(self, hf) -> Optional[PoolerSettings]:
        """The pooler of a pooling runner (None: a generate runner), vLLM's resolution:
        runner auto is pooling for a base-model checkpoint (no LM head), a sequence
        classifier (task classify) or convert embed / classify."""
        pooling = (self.runner == "pooling" or self.convert in ("embed", "classify")
                   or (self.runner == "auto" and (hf.base_model or hf.num_labels > 0)))
        if not pooling:
            if hf.base_model:
                raise ConfigError("runner", f"this checkpoint is a base model without an LM "
                                  f"head ({hf.architecture.replace('ForCausalLM', 'Model')}): "
                                  "it serves embeddings (runner pooling), it cannot generate")
            if hf.num_labels:
                raise ConfigError("runner", "this checkpoint is a sequence classifier without "
                                  "an LM head: it serves classify and score (runner pooling), "
                                  "it cannot generate")
            if self.pooler_config is not None:
                raise ConfigError("pooler_config", "only a pooling runner has a pooler "
                                  "(runner pooling)")
            return None
        if hf.architecture not in POOLING_ARCHITECTURES:
            raise ConfigError("runner", f"pooling is served for the Llama-shaped decoders "
                              f"({', '.join(POOLING_ARCHITECTURES)}), not "
                              f"{hf.architecture}")
        if self.enable_multi_stream:
            raise ConfigError("enable_multi_stream", "not with a pooling runner")
        if self.kv_transfer_config is not None:
            raise ConfigError("kv_transfer_config", "not with a pooling runner (a pooling "
                              "request has no decode to hand over)")
        raw = {}
        path = os.path.join(os.path.expanduser(self.model), "config.json")
        if os.path.isfile(path):
            with open(path) as f:
                raw = json.load(f)
        task = ("classify" if self.convert == "classify"
                or (hf.num_labels and self.convert != "embed") else "embed")
        if task == "classify" and not hf.num_labels:
            raise ConfigError("convert", "classify needs a *ForSequenceClassification "
                              "checkpoint (its score head); converting a causal LM's tokens "
                              "into classes (vLLM's classifier_from_token) is not supported")
        return resolve_pooler(self.pooler_config, os.path.expanduser(self.model),
                              hf.hidden_size, raw, ConfigError, task, hf.num_labels)



@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's arguments of ``AsyncLLMEngine.from_engine_args``: EngineArgs and vLLM's one
    more."""
    enable_log_requests: bool = _arg(False,
        "log each request's arrival and abort at INFO (\"Added request <id>.\", as vLLM)")


def _takes_no_effect_args(cls) -> None:
    """``cls(...)`` takes vLLM's no-effect arguments as ``LLM(...)`` does (one warning), so a
    vLLM script's ``EngineArgs(model=..., gpu_memory_utilization=0.9)`` runs."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **drop_no_effect_args(kwargs, cls.__name__))
    cls.__init__ = __init__


_takes_no_effect_args(EngineArgs)
_takes_no_effect_args(AsyncEngineArgs)

# generation_config.json's keys that set a request's sampling defaults (vLLM's set) -> the
# SamplingParams field each sets (which checks the value).
_GENERATION_DEFAULTS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model: str, source: str, override: Optional[dict],
                        max_model_len: int) -> dict:
    """The sampling defaults of requests that leave a field out, as vLLM's ``--generation-
    config``: ``auto`` reads the model directory's generation_config.json, ``vllm`` none, a
    directory its generation_config.json; ``override`` goes over them. Only the keys that
    set sampling (``_GENERATION_DEFAULTS``) count; a value SamplingParams refuses, or a
    temperature above 2 (the OpenAI routes' bound), is a ConfigError. ``max_new_tokens`` is
    capped at ``max_model_len`` (a request gets what is left)."""
    from llm_serving.sampling_params import SamplingParams
    found: dict = {}
    if source != "vllm":
        path = os.path.join(os.path.expanduser(model if source == "auto" else source),
                            "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    found = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError("generation_config", f"cannot read {path}: {e}") from None
        elif source != "auto":
            raise ConfigError("generation_config", f"{path} does not exist (expected auto, "
                              "vllm or a directory holding a generation_config.json)")
        if not isinstance(found, dict):
            raise ConfigError("generation_config", f"{path} does not hold a JSON object")
    override = override or {}
    unknown = sorted(set(override) - set(_GENERATION_DEFAULTS))
    if unknown:
        raise ConfigError("override_generation_config", f"{unknown[0]} is not a sampling "
                          f"default; known: {', '.join(_GENERATION_DEFAULTS)}")
    found = {**found, **override}
    out = {name: found[key] for key, name in _GENERATION_DEFAULTS.items()
           if found.get(key) is not None}
    try:
        if isinstance(out.get("temperature"), (int, float)) and out["temperature"] > 2:
            raise ValueError(f"temperature must be in [0, 2], got {out['temperature']}")
        SamplingParams(**out)
    except (ValueError, TypeError) as e:
        bad = next((k for k, name in _GENERATION_DEFAULTS.items()
                    if name in out and str(e).startswith(name)), "")
        raise ConfigError("override_generation_config" if bad in override
                          else "generation_config", str(e)) from None
    if "max_tokens" in out:
        out["max_tokens"] = min(out["max_tokens"], max_model_len)
    if out and source != "vllm":
        logger.info("sampling defaults of requests that leave them out, from %s: %s (turn "
                    "them off with generation_config: vllm)",
                    "generation_config.json" if source == "auto" else source, out)
    return out


def parse_lora_modules(value) -> Optional[list]:
    """``lora_modules`` as a list of (name, path, base_model_name) triples, from vLLM's forms:
    'name=path' or a JSON object string (the command line), or mappings (YAML)."""
    if value is None:
        return None
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError("lora_modules", f"expected a list of name=path, got {value!r}")
    out = []
    for item in value:
        if isinstance(item, str) and "=" in item and "," not in item:
            name, path = item.split("=", 1)
            item = {"name": name, "path": path}
        elif isinstance(item, str):
            try:
                item = json.loads(item)
            except ValueError:
                raise ConfigError("lora_modules", f"{item!r} is neither name=path nor a JSON "
                                  "object") from None
        if isinstance(item, (list, tuple)) and len(item) == 3:
            item = dict(zip(("name", "path", "base_model_name"), item))
        if not isinstance(item, dict) or not item.get("name") or not item.get("path"):
            raise ConfigError("lora_modules", f"expected name=path or {{\"name\": ..., "
                              f"\"path\": ...}}, got {item!r}")
        unknown = sorted(set(item) - {"name", "path", "base_model_name"})
        if unknown:
            raise ConfigError("lora_modules", f"unknown field {unknown[0]!r} in {item!r}")
        out.append((str(item["name"]), str(item["path"]), item.get("base_model_name")))
    names = [m[0] for m in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError("lora_modules", f"adapter name {dup!r} is given twice")
    return out


def _kv_transfer(data) -> Optional[KVTransferConfig]:
    cfg = KVTransferConfig.from_dict(data)
    return cfg.with_engine_id() if cfg is not None else None


# ---- the resolved configuration ------------------------------------------------------------

@dataclass(frozen=True)
class ModelSettings:
    path: str                      # model directory (HF layout)
    tokenizer: str                 # tokenizer directory
    checkpoint: Optional[str]      # a MindSpore .ckpt to load instead of safetensors
    dtype: str
    kv_cache_dtype: str            # as asked (auto: the attention backend's own)
    kv_storage_dtype: str          # what it resolves to on this device (float32, float16 or
                                   # bfloat16 on CPU, float16 on Ascend): what the KV pool was
                                   # sized for
    max_model_len: int             # resolved: the model's, capped by the KV pool
    seed: int                      # the sampler's seed for requests without their own
    chat_template: Optional[str]
    hf: "ModelConfig"              # the architecture, from config.json
    # What OpenAI requests that leave a sampling field out get (generation_defaults).
    default_sampling_params: dict = field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS   # the most logprobs a request may ask for
    pooler: Optional[PoolerSettings] = None   # a pooling runner's (None: generate)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    skip_tokenizer_init: bool = False     # token ids in and out only (vLLM's)
    enable_prompt_embeds: bool = False    # prompts may be given as embeddings (vLLM's)
    # where reasoning starts and ends, for thinking_token_budget (None: budgets off)
    reasoning: Optional[ReasoningConfig] = None
    # the user's logits processors, 'module:Class' (or classes, in process); checked
    logits_processors: tuple = ()
    # each layer's KV storage dtype: kv_storage_dtype, or auto's for the layers
    # kv_cache_dtype_skip_layers names (EngineArgs fills it in)
    kv_layer_dtypes: tuple = ()

    @property
    def kv_skip_layers(self) -> tuple:
        """The layers whose KV is stored otherwise than kv_storage_dtype."""
        return tuple(i for i, d in enumerate(self.kv_layer_dtypes) if d != self.kv_storage_dtype)

    @property
    def vocab_size(self) -> int:
        return self.hf.vocab_size

    @property
    def weight_dtype(self) -> str:
        """What the weights load as (auto: float32)."""
        return "float32" if self.dtype == "auto" else self.dtype


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int                # device KV blocks (per rank)
    num_cpu_blocks: int            # host blocks for swapped-out sequences (0 unless swap)
    enable_prefix_caching: bool
    watermark: float               # fraction of blocks admission keeps free


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int    # resolved token budget per step
    enable_chunked_prefill: bool
    policy: str                    # SCHEDULING_POLICIES
    preemption_mode: str           # PREEMPTION_MODES
    max_waiting: int
    queue_timeout: Optional[float]
    async_scheduling: bool         # resolved: on with WorkAgents, off in process
    stream_interval: int = 1       # tokens per streamed chunk (AsyncLLMEngine's streams)
    max_in_flight: Optional[int] = None         # requests (n counts n) admitted at once
    max_prefill_backlog: Optional[int] = None   # prompt tokens of requests before their token
    long_prefill_cap: int = 0      # most prompt tokens per step for one of several prefills
    long_prefill_adaptive: bool = False     # the cap at least the budget's fair share
    reserve_full_prompt: bool = True        # admission: the whole prompt must fit
    max_loras: int = 0             # most LoRA adapters among the running sequences (0: off)
    # vLLM's caps below the two above (None: the same): tokens issued per step, sequences
    # admitted into running (max_num_seqs still sizes the buffers and captures)
    max_num_scheduled_tokens: Optional[int] = None
    max_num_active_seqs: Optional[int] = None

    @property
    def step_tokens(self) -> int:
        """The most tokens the scheduler issues in a step."""
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens

    @property
    def running_seqs(self) -> int:
        """The most sequences that run at once."""
        return self.max_num_active_seqs or self.max_num_seqs


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    backend: str                   # EXECUTOR_BACKENDS: "uni" in process, "mp" WorkAgents
    cpu_affinity: Optional[tuple]  # per rank, a tuple of cores
    cpu_allreduce: str = "shm"     # CPU_ALLREDUCE: shared memory, or MindSpore's mccl

    def cores_of(self, rank: int) -> Optional[tuple]:
        return self.cpu_affinity[rank] if self.cpu_affinity else None


@dataclass(frozen=True)
class DeviceConfig:
    device: str                    # auto, cpu, ascend (npu)
    start_device_id: int           # rank r uses start_device_id + r


@dataclass(frozen=True)
class ExecutionConfig:
    """How steps run: decode steps replayed from a capture (model_executor/cpu_graph.py), and
    how long one may take before its WorkAgent is taken for hung."""
    enforce_eager: bool = False
    max_capture_batch: int = MAX_CAPTURE_BATCH
    execute_model_timeout: float = DEFAULT_EXECUTE_MODEL_TIMEOUT


@dataclass(frozen=True)
class LoRAConfig:
    """--enable-lora: adapters a step may hold, their largest rank, how many a WorkAgent keeps
    loaded, and the adapters served by name ((name, path, base_model_name) triples)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    modules: tuple = ()


@dataclass(frozen=True)
class DumpConfig:
    """--dump-logits: raw logits of every request saved at every ``every``-th position."""
    directory: str
    every: int


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSettings
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    dump: Optional[DumpConfig] = None
    multi_stream: Optional[MultiStreamConfig] = None   # None: multi-stream off
    kv_transfer: Optional[KVTransferConfig] = None     # PD disaggregation; None: off
    lora: Optional[LoRAConfig] = None                  # LoRA adapters; None: off
    speculative: Optional[SpeculativeConfig] = None    # n-gram speculative decoding; None: off
    # --custom-histogram-buckets: family -> bounds (the engine counts two of them itself)
    histogram_buckets: dict = field(default_factory=dict)
    otlp_traces_endpoint: Optional[str] = None        # OpenTelemetry spans; None: off
    kv_events: Optional[KVEventsConfig] = None        # KV cache events published; None: off
    per_request_spec_decode_metrics: str = "none"     # spec_decode/request_metrics.py
    # --kv-cache-metrics: the fraction of blocks followed (engine/kv_cache_residency.py);
    # None: off
    kv_cache_metrics_sample: Optional[float] = None
    enable_mfu_metrics: bool = False                  # engine/mfu.py
    log_iterations: bool = False      # --enable-logging-iteration-details: llm_engine.py
    profiler: Optional[ProfilerConfig] = None         # profiler.py; None: off

    def to_json(self) -> str:
        """The whole config as JSON, for a WorkAgent's command line (small; not pickled)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EngineConfig":
        return _from_dict(cls, json.loads(text))


def _from_dict(cls, data):
    """Rebuild a (nested) config dataclass from ``dataclasses.asdict`` output."""
    import typing
    from llm_serving.model_executor.loader import ModelConfig
    hints = typing.get_type_hints(cls, {**globals(), "ModelConfig": ModelConfig})
    kw = {}
    for f in fields(cls):
        value, hint = data.get(f.name), hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if value is not None and dataclasses.is_dataclass(base):
            value = (base(**value) if base is ModelConfig
                     else KVTransferConfig.from_dict(value) if base is KVTransferConfig
                     else _from_dict(base, value))
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        kw[f.name] = value
    return cls(**kw)


# ---- tensor parallelism: what one rank holds -------------------------------------------------

def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds. With fewer KV heads than ranks they are replicated (as vLLM
    does): each rank holds one, shared by tp_size / num_kv_heads ranks."""
    return max(1, num_kv_heads // tp_size)


def kv_bytes_per_block(config: "ModelConfig", block_size: int, tp_size: int = 1,
                       kv_cache_dtype="float32") -> int:
    """Bytes of one KV block on one rank (each holds its share of the KV heads), every layer's
    KV stored as ``kv_cache_dtype``, or as each layer's (a sequence: ModelSettings'
    kv_layer_dtypes) when their dtypes differ."""
    kv_heads = kv_heads_per_rank(config.num_kv_heads, tp_size)
    dtypes = ((kv_cache_dtype,) * config.num_layers if isinstance(kv_cache_dtype, str)
              else kv_cache_dtype)
    return (2 * block_size * kv_heads * config.head_dim
            * sum(KV_DTYPE_BYTES[d] for d in dtypes))


SKIP_LAYERS_KEY = "kv_cache_dtype_skip_layers"
SLIDING_WINDOW = "sliding_window"      # vLLM's attention type name in that list


def check_kv_skip_layers(value) -> None:
    """kv_cache_dtype_skip_layers' form, as far as it is known without the model: None, or a
    list of layer indices (ints, or their digits as the command line gives them) and
    sliding_window. ConfigError naming the key otherwise."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)):
        raise ConfigError(SKIP_LAYERS_KEY, "expected a list of layer indices (or "
                          f"{SLIDING_WINDOW}), got {value!r}")
    for item in value:
        text = item.strip() if isinstance(item, str) else None
        if isinstance(item, bool) or not (isinstance(item, int) or text == SLIDING_WINDOW
                                          or (text or "").isdigit()):
            raise ConfigError(SKIP_LAYERS_KEY, f"{item!r} is neither a layer index nor "
                              f"{SLIDING_WINDOW} (several are separate values: 0 11)")


def kv_skip_layer_indices(value, num_layers: int) -> frozenset:
    """The layer indices kv_cache_dtype_skip_layers names (sliding_window names none: no model
    served here has sliding-window layers); an index outside the model is a ConfigError."""
    check_kv_skip_layers(value)
    out = set()
    for item in value or ():
        if str(item).strip() == SLIDING_WINDOW:
            continue
        if not 0 <= int(item) < num_layers:
            raise ConfigError(SKIP_LAYERS_KEY, f"layer {int(item)} is out of range: the model "
                              f"has {num_layers} layers (0 to {num_layers - 1})")
        out.add(int(item))
    return frozenset(out)


def describe_kv_cache(config: "EngineConfig") -> str:
    """The KV pool in one line, as start.py logs it before starting (and --dry-run prints it):
    its blocks, tokens, storage dtype and size on each rank, and the swap pool's."""
    c, m = config.cache, config.model
    block = kv_bytes_per_block(m.hf, c.block_size, config.parallel.tensor_parallel_size,
                               m.kv_layer_dtypes)
    def size(n):
        b = n * block
        return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
    skipped = m.kv_skip_layers
    dtype = (f"{m.kv_storage_dtype} (layers {', '.join(map(str, skipped))}: "
             f"{m.kv_layer_dtypes[skipped[0]]})" if skipped else m.kv_storage_dtype)
    line = (f"KV cache: {c.num_blocks} blocks of {c.block_size} tokens "
            f"({c.num_blocks * c.block_size} tokens), {dtype}, "
            f"{size(c.num_blocks)} per rank")
    if c.num_cpu_blocks:
        line += f"; swap pool: {c.num_cpu_blocks} blocks, {size(c.num_cpu_blocks)} per rank"
    return line


def check_tensor_parallel(config: "ModelConfig", tp_size: int) -> None:
    """Raise a ConfigError naming tensor_parallel_size if the model cannot be split that way."""
    if tp_size == 1:
        return
    key = "tensor_parallel_size"
    if config.num_heads % tp_size:
        raise ConfigError(key, f"{tp_size} does not divide the model's {config.num_heads} "
                          "attention heads")
    kv = config.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise ConfigError(key, f"{tp_size} and the model's {kv} KV heads must divide one "
                          "another (KV heads are split, or replicated when fewer than ranks)")
    if config.intermediate_size % tp_size:
        raise ConfigError(key, f"{tp_size} does not divide the model's intermediate_size "
                          f"({config.intermediate_size})")
    if config.num_experts and config.moe_intermediate_size % tp_size:
        raise ConfigError(key, f"{tp_size} does not divide the model's moe_intermediate_size "
                          f"({config.moe_intermediate_size}): each expert is split over the "
                          "ranks")


def _core_set(text: str) -> list[int]:
    """'0', '0,2', '0-3' or '0-3,8' -> sorted cores."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError("cpu_affinity", f"cannot read core set {text!r} (expected e.g. "
                              "'0', '0,2' or '0-3')")
        cores.update(range(int(lo), int(hi or lo) + 1))
    if not cores:
        raise ConfigError("cpu_affinity", f"core set {text!r} is empty")
    return sorted(cores)


def parse_cpu_affinity(value) -> list[list[int]]:
    """The cores of each rank, from '0|1' / '0-3|4-7' (CLI and YAML) or a YAML list with one
    entry per rank: a core, a list of cores or a core-set string. Every core must be one this
    process may run on."""
    if isinstance(value, str):
        sets = [_core_set(s) for s in value.split("|")]
    elif isinstance(value, (list, tuple)) and value:
        sets = []
        for entry in value:
            if isinstance(entry, int) and not isinstance(entry, bool) and entry >= 0:
                sets.append([entry])
            elif isinstance(entry, str):
                sets.append(_core_set(entry))
            elif (isinstance(entry, (list, tuple)) and entry and all(
                    isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in entry)):
                sets.append(sorted(set(entry)))
            else:
                raise ConfigError("cpu_affinity", f"cannot read rank entry {entry!r} (expected "
                                  "a core, a list of cores or a string like '0-3')")
    else:
        raise ConfigError("cpu_affinity", f"expected e.g. '0|1' or [[0], [1]], got {value!r}")
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if usable is not None:
        for cores in sets:
            bad = [c for c in cores if c not in usable]
            if bad:
                raise ConfigError("cpu_affinity", f"core {bad[0]} is not available here (this "
                                  f"process may run on {sorted(usable)})")
    return sets
