"""The offline API, with vLLM's names: ``LLM(model=...).generate(prompts, sampling_params)``."""
from __future__ import annotations

import collections
import functools
import itertools
from typing import Optional, Sequence, Union

import numpy as np
from pydantic import ValidationError
from tqdm import tqdm

from llm_serving.chat_content_format import CONTENT_FORMATS
from llm_serving.cli_args import resolve_model
from llm_serving.config import VLLM_NO_EFFECT_ARGS, EngineArgs, drop_no_effect_args
from llm_serving.engine.input_processor import NO_TOKENIZER
from llm_serving.engine.engine_client import EngineLimits
from llm_serving.engine.llm_engine import LLMEngine, PromptType
from llm_serving.entrypoints.beam_search import BeamSearch, BeamSearchOutput
from llm_serving.inputs import salt_of
from llm_serving.prompt_embeds import FIELD as EMBEDS, embeds_of
from llm_serving.entrypoints.openai_protocol import ChatMessage
from llm_serving.entrypoints.step_interrupt import StepInterrupt
from llm_serving.entrypoints.frontend_args import CHAT_OWN_FIELDS
from llm_serving.entrypoints.metrics import ServerMetrics
from llm_serving.entrypoints.metrics_reader import Metric, snapshot
from llm_serving.entrypoints.vllm_engine import VllmLLMEngine
from llm_serving.errors import QueueFullError
from llm_serving.lora.request import LoRARequest
from llm_serving.entrypoints.scoring import (cosine, cross_encoder_prompt, pair_indices,
                                             score_texts)
from llm_serving.outputs import (ClassificationOutput, ClassificationRequestOutput,
                                 EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                 PoolingRequestOutput, RequestOutput, ScoringOutput,
                                 ScoringRequestOutput)
from llm_serving.pooling_params import PoolingParams
from llm_serving.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams



def _no_pooling(method: str) -> ValueError:
    return ValueError(f"LLM.{method}() is for pooling models of its kind: llm_serving serves "
                      "LLM.embed() on an embedding model, LLM.classify() on a sequence "
                      "classifier, LLM.score() on either (a classifier of one label: a "
                      "cross-encoder), all on a pooling runner (runner='pooling'); a "
                      "generative model serves generate() and chat()")


def _no_tokenization_kwargs(kwargs) -> None:
    if kwargs:
        raise ValueError("tokenization_kwargs: not supported by this server")


class LLM:
    def __init__(self, model: str, **engine_args):
        """``model``: an HF model directory, or ``builtin:tiny-llama`` (as start.py's
        --model: the built-in tiny model, generated on first use)."""
        engine_args = drop_no_effect_args(engine_args, "LLM", VLLM_NO_EFFECT_ARGS)
        # vLLM's LLM keeps no stats unless asked (its default: True); they feed get_metrics
        log_stats = not engine_args.pop("disable_log_stats", True)
        self._start(EngineArgs.from_kwargs(resolve_model(model), **engine_args), log_stats)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """vLLM's: an LLM of ready EngineArgs (``llm_serving.EngineArgs``)."""
        llm = cls.__new__(cls)
        llm._start(engine_args)
        return llm

    def _start(self, engine_args: EngineArgs, log_stats: bool = False) -> None:
        self.engine = LLMEngine(engine_args)
        self._metrics = None
        if log_stats:
            self._metrics = ServerMetrics.for_engine(engine_args.model, engine_args)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._enqueued: list = []       # enqueue()'s checked requests, for wait_for_completion

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the ranks the model runs on (tensor parallel; no data or pipeline
        parallelism here)."""
        return self.engine.config.parallel.tensor_parallel_size

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's metrics now, as ``/metrics`` would serve them (``Counter``,
        ``Gauge``, ``Histogram`` and ``Vector`` of ``llm_serving.entrypoints.metrics_reader``,
        vLLM's classes). Needs ``LLM(..., disable_log_stats=False)``, as vLLM's."""
        if self._metrics is None:
            raise ValueError("get_metrics: this LLM keeps no stats; create it with "
                             "disable_log_stats=False (vLLM's LLM too)")
        limits = EngineLimits.of(self.engine.config, getattr(self.engine.runner, "device", None))
        self._metrics.update(self.engine.get_stats(), limits.cache, limits.max_loras)
        return snapshot(self._metrics.registry)

    def get_tokenizer(self):
        if self.engine.config.model.skip_tokenizer_init:
            raise ValueError(f"get_tokenizer: {NO_TOKENIZER}")
        return self.tokenizer

    @functools.cached_property
    def llm_engine(self) -> VllmLLMEngine:
        """vLLM's ``llm.llm_engine``: its tokenizer, model_config and request loop."""
        return VllmLLMEngine(self.engine)

    def collective_rpc(self, method, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        """vLLM's: run ``method`` on every model process and return one result per process,
        by tensor-parallel rank. ``method`` is a worker method's name ("reload_weights",
        "apply_model", "get_model", "check_health") or a callable taking the worker first,
        ``method(worker, *args, **kwargs)`` (``llm_serving.executor.collective_rpc.Worker``:
        its ``rank``, ``model_runner``, ``config``, ...). To WorkAgents (``mp``) the call is
        pickled with cloudpickle, at most 64 MiB, and so is each result; ``timeout`` seconds
        (None: no limit) then raise a TimeoutError. In process (``uni``) it runs here. A call
        that raises is a CollectiveRPCError (a RuntimeError) with the worker's message."""
        return self.engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func) -> list:
        """vLLM's: ``func(model)`` on every model process (the model Cell the runner runs),
        the results by rank. Linear layers hold their weights packed for the CPU kernels:
        change one with ``layer.set_weight(w, in_place=True)`` (float32 [out, in]), or
        reload weights with ``collective_rpc("reload_weights", ...)`` (docs/design.md,
        "collective_rpc")."""
        return self.engine.collective_rpc("apply_model", None, (func,))

    def start_profile(self, profile_prefix: Optional[str] = None, *,
                      delay_iterations: Optional[int] = None,
                      max_iterations: Optional[int] = None) -> None:
        """vLLM's: with ``profiler_config`` (``{"profiler": "torch", "torch_profiler_dir":
        ...}``) this process and every WorkAgent record a VizTracer trace until
        ``stop_profile`` (``llm_serving/profiler.py``); ``profile_prefix`` starts the files'
        names; ``delay_iterations`` model steps pass before recording, and the traces are
        written after ``max_iterations`` recorded (0: at stop_profile), as vLLM's. A
        ValueError without ``profiler_config``."""
        self.engine.profile(True, profile_prefix, delay_iterations, max_iterations)

    def stop_profile(self) -> None:
        """vLLM's: every process writes its trace under ``torch_profiler_dir``."""
        self.engine.profile(False)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as vLLM's: True once done, False while requests run."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without sampling params: the model's
        generation_config.json defaults (``generation_config``), as vLLM's."""
        return SamplingParams(**self.engine.config.model.default_sampling_params)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False,
                 lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None,
                 priority: Union[int, Sequence[int], None] = None) -> list[RequestOutput]:
        """vLLM's arguments in vLLM's order. ``lora_request``: the adapter every prompt runs
        with, or a list with one per prompt (None: the base model; needs enable_lora)."""
        return self._run(self._process(prompts, sampling_params, lora_request, priority),
                         use_tqdm)

    def enqueue(self, prompts: Union[PromptType, Sequence[PromptType]],
                sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                lora_request: Union[LoRARequest, Sequence[LoRARequest], None] = None,
                priority: Union[int, Sequence[int], None] = None, use_tqdm: bool = True,
                tokenization_kwargs: Optional[dict] = None,
                mm_processor_kwargs: Optional[dict] = None) -> list[str]:
        """vLLM 0.32's: check and keep the prompts, as ``generate`` takes them, without
        running them; ``wait_for_completion`` runs everything enqueued. The request ids."""
        _no_tokenization_kwargs(tokenization_kwargs)
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: not supported by this server")
        news = self._process(prompts, sampling_params, lora_request, priority, use_tqdm)
        self._enqueued.extend(news)
        return [new.request_id for new in news]

    def wait_for_completion(self, output_type=None, *,
                            use_tqdm: bool = True) -> list[RequestOutput]:
        """vLLM 0.32's: run every enqueued request to its end; their outputs in the order
        they were enqueued."""
        news, self._enqueued = self._enqueued, []
        return self._run(news, use_tqdm)

    def _process(self, prompts, sampling_params, lora_request, priority,
                 use_tqdm: bool = False) -> list:
        """``generate``'s arguments as checked requests, not queued yet."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(lora_request, (list, tuple)):
            lora_request = [lora_request] * len(prompts)
        elif len(lora_request) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(lora_request)} "
                             "lora requests")
        if isinstance(priority, int):
            priority = [priority] * len(prompts)      # one for every prompt, as vLLM's
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()
                               ] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} "
                             "sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        # Only final outputs are wanted here; intermediate ones would be built for nothing.
        final = {}
        for p in sampling_params:
            if id(p) not in final:
                final[id(p)] = p
                if p.output_kind is not RequestOutputKind.FINAL_ONLY:
                    final[id(p)] = p.clone()
                    final[id(p)].output_kind = RequestOutputKind.FINAL_ONLY
        # Every prompt is checked before any runs; they are queued as the waiting queue
        # (max_waiting_requests, the server's bound) has room, so any number can be given.
        items = enumerate(zip(prompts, sampling_params))
        return [self.engine.process_request(prompt, final[id(params)],
                                            request_id=f"llm-{id(self)}-{next(self._ids)}",
                                            priority=priority[i] if priority else 0,
                                            lora_request=lora_request[i])
                for i, (prompt, params) in tqdm(items, total=len(prompts),
                                                desc="Adding requests", disable=not use_tqdm)]

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams],
                                                   None] = None,
             use_tqdm: bool = False, lora_request=None, *,
             priority: Union[int, Sequence[int], None] = None,
             chat_template: Optional[str] = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Optional[list] = None,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of conversations, with
        vLLM's arguments in vLLM's order. A message's content may be a string or OpenAI's list
        of text parts, given to the template as ``chat_template_content_format`` says (auto,
        string: joined with newlines, or openai: the parts; as vLLM's
        --chat-template-content-format); ``tools`` and ``chat_template_kwargs`` go to the
        chat template; ``continue_final_message`` carries on the last message instead of
        starting a new turn. ``lora_request`` as ``generate``'s."""
        prompts = self._chat_prompts(messages, chat_template, chat_template_content_format,
                                     add_generation_prompt, continue_final_message, tools,
                                     chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, priority)

    def enqueue_chat(self, messages, sampling_params: Union[SamplingParams,
                                                            Sequence[SamplingParams],
                                                            None] = None,
                     use_tqdm: bool = True, lora_request=None,
                     priority: Union[int, Sequence[int], None] = None,
                     chat_template: Optional[str] = None,
                     chat_template_content_format: str = "auto",
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     tools: Optional[list] = None, chat_template_kwargs: Optional[dict] = None,
                     tokenization_kwargs: Optional[dict] = None,
                     mm_processor_kwargs: Optional[dict] = None) -> list[str]:
        """vLLM 0.32's, in its order: ``chat``'s conversations enqueued (see ``enqueue``)."""
        prompts = self._chat_prompts(messages, chat_template, chat_template_content_format,
                                     add_generation_prompt, continue_final_message, tools,
                                     chat_template_kwargs)
        return self.enqueue(prompts, sampling_params, lora_request, priority, use_tqdm,
                            tokenization_kwargs, mm_processor_kwargs)

    def _chat_prompts(self, messages, chat_template, chat_template_content_format,
                      add_generation_prompt, continue_final_message, tools,
                      chat_template_kwargs) -> list[dict]:
        """One prompt (its text and token ids) per conversation, from the chat template."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: it continues the last message, so "
                             "add_generation_prompt must be False (it defaults to True)")
        if self.engine.config.model.skip_tokenizer_init:
            raise ValueError(f"chat: {NO_TOKENIZER}")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format: expected one of "
                             f"{', '.join(CONTENT_FORMATS)}, got {chat_template_content_format!r}")
        kwargs = dict(chat_template_kwargs or {})
        taken = sorted({*CHAT_OWN_FIELDS, "chat_template"} & kwargs.keys())
        if taken:
            raise ValueError(f"chat_template_kwargs: {taken[0]!r} is chat()'s own argument, "
                             "not a template variable to set here")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = chat_template or self.engine.config.model.chat_template
        prompts = []
        for conv in conversations:
            try:
                conv = [ChatMessage.model_validate(m).for_template() for m in conv]
            except ValidationError as e:
                raise ValueError(f"messages: {e.errors()[0]['msg']} at "
                                 f"{e.errors()[0]['loc']}") from None
            text = self.tokenizer.render_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=template,
                continue_final_message=continue_final_message, tools=tools,
                content_format=chat_template_content_format, **kwargs)
            # The template already holds any BOS token; don't add a second one.
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer.encode(text,
                                                                      add_special_tokens=False)})
        return prompts

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]],
              pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
              use_tqdm: bool = False, lora_request=None) -> list[EmbeddingRequestOutput]:
        """vLLM's: one embedding per prompt (a pooling runner: ``runner="pooling"``, or a
        base-model checkpoint)."""
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.embedding),
                                       out.prompt_token_ids, out.finished,
                                       out.num_cached_tokens or 0)
                for out in self._pool("embed", prompts, pooling_params, use_tqdm,
                                      lora_request)]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]],
                 pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
                 use_tqdm: bool = False, lora_request=None,
                 tokenization_kwargs=None) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's class probabilities (a sequence classifier's checkpoint,
        ``*ForSequenceClassification``; softmax over its labels, sigmoid for one label, the
        raw logits with ``PoolingParams(use_activation=False)``)."""
        _no_tokenization_kwargs(tokenization_kwargs)
        return [ClassificationRequestOutput(out.request_id, ClassificationOutput(out.embedding),
                                            out.prompt_token_ids, out.finished,
                                            out.num_cached_tokens or 0)
                for out in self._pool("classify", prompts, pooling_params, use_tqdm,
                                      lora_request)]

    def score(self, data_1, data_2, /, *, use_tqdm: bool = False,
              pooling_params: Optional[PoolingParams] = None, lora_request=None,
              tokenization_kwargs=None, chat_template=None) -> list[ScoringRequestOutput]:
        """vLLM's: the score of each pair of texts, 1:1, 1:N or N:N (entrypoints/scoring.py):
        a cross-encoder's (a classifier of one label: its sigmoid; ``chat_template``, a score
        template rendering each pair) or an embedding model's (the cosine similarity of the
        two embeddings)."""
        _no_tokenization_kwargs(tokenization_kwargs)
        pooler = self.engine.config.model.pooler
        if pooler is None:
            raise _no_pooling("score")
        if pooler.task == "classify" and pooler.num_labels != 1:
            raise ValueError("Scoring API is only enabled for num_labels == 1 (this "
                             f"classifier has {pooler.num_labels})")
        first, second = score_texts(data_1, data_2)
        pairs = pair_indices(len(first), len(second))
        if pooler.task == "classify":
            prompts = [{"prompt_token_ids": cross_encoder_prompt(
                self.tokenizer, pooler, first[i], second[j], chat_template=chat_template)}
                for i, j in pairs]
            return [ScoringRequestOutput(out.request_id, ScoringOutput(out.embedding[0]),
                                         out.prompt_token_ids, out.finished,
                                         out.num_cached_tokens or 0)
                    for out in self._pool("score", prompts, pooling_params, use_tqdm,
                                          lora_request)]
        outs = self._pool("score", first + second, pooling_params, use_tqdm, lora_request)
        pad = [] if self.tokenizer.pad_token_id is None else [self.tokenizer.pad_token_id]
        results = []
        for i, j in pairs:
            a, b = outs[i], outs[len(first) + j]
            results.append(ScoringRequestOutput(
                f"{a.request_id}_{b.request_id}", ScoringOutput(cosine(a.embedding, b.embedding)),
                a.prompt_token_ids + pad + b.prompt_token_ids, True,
                (a.num_cached_tokens or 0) + (b.num_cached_tokens or 0)))
        return results

    def _pool(self, method: str, prompts, pooling_params, use_tqdm: bool,
              lora_request) -> list[RequestOutput]:
        """Run prompts on the pooling runner; ``method`` is the LLM method (for errors)."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported with pooling models")
        pooler = self.engine.config.model.pooler
        task = {"embed": "embed", "classify": "classify"}.get(method)
        if pooler is None or (task is not None and pooler.task != task):
            raise _no_pooling(method)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(pooling_params)} "
                             "pooling params")
        news = [self.engine.process_request(prompt, params, request_id=f"llm-{id(self)}-{i}")
                for i, (prompt, params) in enumerate(zip(prompts, pooling_params))]
        return self._run(news, use_tqdm)

    # vLLM's other pooling-model methods: refused by name, as vLLM refuses pooling on a
    # generative model, rather than as a missing attribute.
    def encode(self, prompts: Union[PromptType, Sequence[PromptType]],
               pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
               use_tqdm: bool = False, lora_request=None, pooling_task: Optional[str] = None,
               tokenization_kwargs=None) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call: ``pooling_task`` "embed" (as ``embed``) or "classify"
        (as ``classify``, the probabilities), each prompt's ``outputs.data`` a numpy array.
        The token-level tasks (token_embed, token_classify) and plugins are not served."""
        _no_tokenization_kwargs(tokenization_kwargs)
        if self.engine.config.model.pooler is None:
            raise _no_pooling("encode")
        if pooling_task is None:
            raise ValueError("pooling_task required for LLM.encode: 'embed' (LLM.embed) or "
                             "'classify' (LLM.classify)")
        if pooling_task not in ("embed", "classify"):
            raise ValueError(f"pooling_task: {pooling_task!r} is not served here (only "
                             "'embed' and 'classify'; no token-level pooling or plugins)")
        if pooling_params is not None:       # vLLM's: the task rides on the params too
            for p in (pooling_params if isinstance(pooling_params, Sequence)
                      else [pooling_params]):
                if p.task is not None and p.task != pooling_task:
                    raise ValueError(f"pooling_params.task {p.task!r} differs from "
                                     f"pooling_task {pooling_task!r}")
        return [PoolingRequestOutput(out.request_id,
                                     PoolingOutput(np.asarray(out.embedding, np.float32)),
                                     out.prompt_token_ids, out.finished,
                                     out.num_cached_tokens or 0)
                for out in self._pool(pooling_task, prompts, pooling_params, use_tqdm,
                                      lora_request)]

    def reward(self, *args, **kwargs):
        raise _no_pooling("reward")

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool = False,
                    concurrency_limit: Optional[int] = None) -> list[BeamSearchOutput]:
        """vLLM's: the best ``params.beam_width`` hypotheses of each prompt (a string, a
        {"prompt": ...} or a {"prompt_token_ids": [...]}), each with the prompt's tokens and
        its own, and its whole text; the prompts in groups of ``concurrency_limit`` (all at
        once by default); ``lora_request`` as ``generate``'s. See entrypoints/beam_search.py."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora requests")
        tok = self.tokenizer
        searches = []
        for p in prompts:
            if isinstance(p, str):
                p = {"prompt": p}
            if embeds_of(p) is not None:
                raise ValueError(f"{EMBEDS}: beam search takes text or token id prompts "
                                 "(its beams are prompts of token ids)")
            ids = p.get("prompt_token_ids")
            if ids is None:
                ids = self.engine.process_request(p, SamplingParams(max_tokens=1),
                                                  "beam-search-tokenize", 0).prompt_token_ids
            searches.append(BeamSearch(list(ids), params, tok.eos_token_id,
                                       self.engine.max_model_len, salt_of(p)))
        lora_of = {id(s): lora for s, lora in zip(searches, loras)}
        group = concurrency_limit or len(searches)
        step = params.step_params()
        for start in range(0, len(searches), group):
            live = searches[start:start + group]
            bar = tqdm(desc="Beam search", unit="token", disable=not use_tqdm)
            while True:
                live = [s for s in live if not s.done]
                if not live:
                    break
                bar.update()
                outs = iter(self.generate([s.step_prompt(b) for s in live for b in s.beams],
                                          step,
                                          lora_request=[lora_of[id(s)] for s in live
                                                        for _ in s.beams]))
                for s in live:
                    s.advance([_step_logprobs(next(outs)) for _ in s.beams])
        results = []
        for s in searches:
            best = s.best()
            for beam in best:      # vLLM: the whole text, prompt included
                beam.text = tok.decode(beam.tokens,
                                       skip_special_tokens=params.skip_special_tokens)
            results.append(BeamSearchOutput(best))
        return results

    def _run(self, news: list, use_tqdm: bool) -> list[RequestOutput]:
        order = {new.request_id: i for i, new in enumerate(news)}
        pending = collections.deque(news)
        results: list[Optional[RequestOutput]] = [None] * len(order)
        remaining = len(order)
        bar = tqdm(total=remaining, desc="Processed prompts", disable=not use_tqdm)
        with StepInterrupt() as interrupt:       # Ctrl-C: at a step boundary
            try:
                while remaining:
                    while pending:
                        try:
                            self.engine.add_processed(pending[0])
                        except QueueFullError:
                            break
                        pending.popleft()
                    for out in self.engine.step():
                        if out.finished and out.request_id in order:
                            results[order[out.request_id]] = out
                            remaining -= 1
                            bar.update(1)
                            if self.engine.tracer is not None:
                                self.engine.tracer.record(news[order[out.request_id]], None,
                                                          out.request_id, out)
                    if interrupt.pending:
                        interrupt.raise_pending()
            finally:
                bar.close()
                for rid in order:
                    self.engine.abort_request(rid)
        return results


def _step_logprobs(out: RequestOutput):
    """A beam search step's candidates from its one-token request (None if it ended
    without one)."""
    c = out.outputs[0]
    return c.logprobs[0] if c.logprobs else None
