"""Scoring text pairs, as vLLM's /score, /rerank and ``LLM.score`` do: on a cross-encoder (a
sequence classifier of one label) each pair is one prompt, the tokenizer's pair encoding of
the two texts (``<s> query <s> document`` for Llama's tokenizer.json), and its score the
classifier's output; on an embedding model (a bi-encoder) each text is embedded once and a
pair's score is the cosine similarity of its two embeddings."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def score_texts(data_1, data_2, names: Sequence[str] = ("data_1", "data_2")
                ) -> tuple[list[str], list[str]]:
    """The two sides as lists of texts, paired 1:1, 1:N or N:N (vLLM's rule); ValueError
    naming the field for anything else (multimodal content among it)."""
    sides = []
    for data, name in zip((data_1, data_2), names):
        items = data if isinstance(data, list) else [data]
        for item in items:
            if not isinstance(item, str):
                raise ValueError(f"{name}: multimodal content is not supported by this server "
                                 "(text only)")
        sides.append(items)
    first, second = sides
    if not first:
        raise ValueError(f"{names[0]}: at least one text element must be given")
    if not second:
        raise ValueError(f"{names[1]}: at least one text_pair element must be given")
    if len(first) > 1 and len(first) != len(second):
        raise ValueError(f"{names[1]}: input lengths must be either 1:1, 1:N or N:N "
                         f"(got {len(first)} and {len(second)})")
    return first, second


def pair_indices(n_first: int, n_second: int) -> list[tuple[int, int]]:
    """(first, second) index of each scored pair: the one first text with every second, or
    the i-th with the i-th."""
    return [(0 if n_first == 1 else i, i) for i in range(n_second)]


def cross_encoder_prompt(tokenizer, pooler, first: str, second: str,
                         add_special_tokens: bool = True, chat_template=None) -> list[int]:
    """A pair's prompt on a cross-encoder: with a score template given (--chat-template, or
    LLM.score's chat_template), the template's text of the messages {"role": "query"} and
    {"role": "document"}, as vLLM renders it; else the tokenizer's pair encoding, or (a model
    whose config.json says use_sep_token false, vLLM's "LLM as reranker") the texts joined."""
    if chat_template is not None:
        text = tokenizer.render_chat_template(
            [{"role": "query", "content": first}, {"role": "document", "content": second}],
            add_generation_prompt=False, chat_template=chat_template)
        return tokenizer.encode(text, add_special_tokens)
    if pooler.use_sep_token:
        return tokenizer.encode_pair(first, second, add_special_tokens)
    return tokenizer.encode(first + second, add_special_tokens)


def cosine(u, v) -> float:
    """torch's cosine_similarity (eps 1e-8 on each norm), in float32 as vLLM computes it."""
    u = np.asarray(u, np.float32)
    v = np.asarray(v, np.float32)
    norms = max(float(np.linalg.norm(u)), 1e-8) * max(float(np.linalg.norm(v)), 1e-8)
    return float(np.dot(u, v) / norms)
