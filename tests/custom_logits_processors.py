"""Custom logits processors written as vLLM's documentation writes them (vLLM's V1
interface), used by tests/test_custom_logits_processors.py. The same file runs under vLLM:
the import falls back to llm_serving's names when vLLM is not installed."""
from __future__ import annotations

import torch

try:
    from vllm.v1.sample.logits_processor import (AdapterLogitsProcessor, LogitsProcessor,
                                                 process_dict_updates)
except ImportError:
    from llm_serving.sample.logits_processor import (AdapterLogitsProcessor, LogitsProcessor,
                                                     process_dict_updates)


class _ExtraArgProcessor(LogitsProcessor):
    """Keeps, by row, the value of its extra_args key ``arg`` of each request that has it."""
    arg = ""
    invariant = False

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        self.req_info: dict[int, object] = {}

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, batch_update):
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _p, _o: (params.extra_args or {}).get(self.arg))


class TargetTokenProcessor(_ExtraArgProcessor):
    """vLLM's documented example: a request whose extra_args has target_token generates only
    that token."""
    arg = "target_token"

    @classmethod
    def validate_params(cls, params):
        target = params.extra_args and params.extra_args.get("target_token")
        if target is not None and (not isinstance(target, int) or isinstance(target, bool)):
            raise ValueError(f"target_token value {target!r} is not an int")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long)
        keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


class CountingProcessor(LogitsProcessor):
    """A request with extra_args {"count_from": t} generates t, t+1, t+2, ... (mod vocab):
    row i's forced token is its own start plus the length of its live output list, so a row
    given another request's state, or an output list that is not the request's own, shows
    in the tokens."""

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        self.vocab = vllm_config.model_config.get_vocab_size()
        self.max_rows = vllm_config.scheduler_config.max_num_seqs
        self.req_info: dict[int, tuple[int, list]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update):
        if batch_update is not None:
            assert batch_update.batch_size <= self.max_rows
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _p, out: (params.extra_args["count_from"], out)
                             if params.extra_args and "count_from" in params.extra_args
                             else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (start, out) in self.req_info.items():
            token = (start + len(out)) % self.vocab
            logits[row] = float("-inf")
            logits[row, token] = 0.0
        return logits


class TopOnlyProcessor(_ExtraArgProcessor):
    """Argmax-invariant: a request with extra_args {"top_only": k} samples among its k
    likeliest tokens (after temperature); greedy requests are left as they are."""
    arg = "top_only"
    invariant = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, k in self.req_info.items():
            kth = torch.topk(logits[row], k).values[-1]
            logits[row][logits[row] < kth] = float("-inf")
        return logits


class BannedTokenAdapter(AdapterLogitsProcessor):
    """vLLM's AdapterLogitsProcessor wrapping a per-request callable: a request with
    extra_args {"ban": t} never generates t."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        ban = params.extra_args and params.extra_args.get("ban")
        if ban is None:
            return None

        def banned(output_ids, row):
            row[ban] = float("-inf")
            return row
        return banned


class FailingProcessor(_ExtraArgProcessor):
    """Raises in apply once a request with extra_args {"fail": true} is in the batch."""
    arg = "fail"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.req_info:
            raise RuntimeError("this processor fails on purpose")
        return logits


class NotAProcessor:
    """Has the methods' names but is no LogitsProcessor subclass."""

    def apply(self, logits):
        return logits
