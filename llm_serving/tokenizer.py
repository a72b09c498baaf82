"""Tokenizers for served models: HF ``tokenizer.json`` (via the ``tokenizers`` library) or a
sentencepiece ``tokenizer.model`` (Llama style), plus the model's chat template.

Encoding and decoding match ``transformers.AutoTokenizer`` for the tokenizers supported here.
"""

from __future__ import annotations

import functools
import json
import numbers
import re
from datetime import datetime
from pathlib import Path
from typing import (Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set, Tuple,
                    Union)

from llm_serving.chat_content_format import format_contents
from llm_serving.errors import ConfigError, ModelLoadError

__all__ = ["BatchEncoding", "Tokenizer"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers' named special tokens, in the order its all_special_tokens lists them
_NAMED_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


def _token_content(value: Any) -> Optional[str]:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _as_id_list(value: Any) -> List[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


class _AddedToken:
    __slots__ = ("content", "id", "special", "lstrip", "rstrip")

    def __init__(self, content: str, id: int, special: bool, lstrip: bool = False, rstrip: bool = False):
        self.content = content
        self.id = id
        self.special = special
        self.lstrip = lstrip
        self.rstrip = rstrip


def _added_tokens_from_config(config: Mapping[str, Any]) -> List[_AddedToken]:
    out = []
    decoder = config.get("added_tokens_decoder") or {}
    if isinstance(decoder, Mapping):
        for key, spec in decoder.items():
            try:
                tid = int(key)
            except (TypeError, ValueError):
                continue
            content = _token_content(spec)
            if content is None:
                continue
            spec = spec if isinstance(spec, Mapping) else {}
            out.append(
                _AddedToken(
                    content,
                    tid,
                    bool(spec.get("special", True)),
                    bool(spec.get("lstrip", False)),
                    bool(spec.get("rstrip", False)),
                )
            )
    out.sort(key=lambda t: t.id)
    return out


def _extra_special_token_strings(config: Mapping[str, Any]) -> List[str]:
    out: List[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key)
        if isinstance(value, Mapping):
            value = list(value.values())
        if isinstance(value, (list, tuple)):
            for v in value:
                c = _token_content(v)
                if c is not None and c not in out:
                    out.append(c)
    return out


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------


class _HFBackend:
    """``tokenizer.json`` through the ``tokenizers`` library (what transformers' fast tokenizers use)."""

    def __init__(self, path: Path, config: Mapping[str, Any]):
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as _Tok

        try:
            self.tok = _Tok.from_file(str(path))
        except Exception as e:  # the Rust error names what is wrong in the file
            raise ModelLoadError(f"{path}: cannot load tokenizer.json ({e})") from e

        # Like transformers: tokens named in tokenizer_config.json become added tokens if the
        # tokenizer.json does not already list them, so that they are split out of the text.
        present = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        to_add = []
        for t in _added_tokens_from_config(config):
            if t.content not in present:
                to_add.append(AddedToken(t.content, special=t.special, lstrip=t.lstrip, rstrip=t.rstrip,
                                         normalized=False))
                present.add(t.content)
        named = [_token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS] + _extra_special_token_strings(config)
        for c in named:
            if c is not None and c not in present:
                to_add.append(AddedToken(c, special=True, normalized=False))
                present.add(c)
        for t in to_add:  # one by one, in order, so that new ids are assigned as transformers does
            if t.special:
                self.tok.add_special_tokens([t])
            else:
                self.tok.add_tokens([t])

        self.special_ids: Set[int] = {
            tid for tid, t in self.tok.get_added_tokens_decoder().items() if t.special
        }
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.base_vocab_size = self.tok.get_vocab_size(with_added_tokens=False)
        self._decoder = self.tok.decoder
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False)) and type(
            self.tok.model
        ).__name__ != "BPE"  # transformers skips this cleanup for BPE models: it corrupts their output

    def encode(self, text: str, add_special_tokens: bool) -> List[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        text = self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._cleanup else text

    def id_to_token(self, tid: int) -> Optional[str]:
        return self.tok.id_to_token(int(tid))

    def get_vocab(self) -> Dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tok.token_to_id(token)

    def tokens_to_string(self, tokens: List[str]) -> str:
        text = self._decoder.decode(tokens) if self._decoder is not None else " ".join(tokens)
        return _clean_up_tokenization(text) if self._cleanup else text


def _clean_up_tokenization(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _read_varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _write_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _proto_fields(buf: bytes) -> List[Tuple[int, int, bytes]]:
    """Split a protobuf message into (field, wire_type, raw field bytes incl. the tag)."""
    fields = []
    pos = 0
    while pos < len(buf):
        start = pos
        tag, pos = _read_varint(buf, pos)
        wire = tag & 7
        if wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            pos += n
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.append((tag >> 3, wire, buf[start:pos]))
    return fields


def _sp_with_dummy_prefix(model_proto: bytes, add_dummy_prefix: bool) -> Tuple[bytes, bool]:
    """Return (a copy of the sentencepiece ModelProto with normalizer_spec.add_dummy_prefix set,
    the original value). Edits the protobuf wire format directly (no protobuf dependency)."""
    out = bytearray()
    original = True  # proto default
    found = False
    for field, wire, raw in _proto_fields(model_proto):
        if field == 3 and wire == 2:  # ModelProto.normalizer_spec
            found = True
            _, pos = _read_varint(raw, 0)
            n, pos = _read_varint(raw, pos)
            body = raw[pos : pos + n]
            new_body = bytearray()
            for sub_field, sub_wire, sub_raw in _proto_fields(body):
                if sub_field == 3 and sub_wire == 0:  # NormalizerSpec.add_dummy_prefix
                    original = bool(_read_varint(sub_raw, 1)[0])
                    continue
                new_body += sub_raw
            new_body += bytes([3 << 3 | 0, 1 if add_dummy_prefix else 0])
            out += bytes([3 << 3 | 2]) + _write_varint(len(new_body)) + new_body
        else:
            out += raw
    if not found:
        body = bytes([3 << 3 | 0, 1 if add_dummy_prefix else 0])
        out += bytes([3 << 3 | 2]) + _write_varint(len(body)) + body
    return bytes(out), original


class _SentencePieceBackend:
    """A Llama-style sentencepiece ``tokenizer.model``: "▁" marks spaces, ``<0xNN>`` byte fallback.

    Text is split on added/special tokens first; by default (``legacy: false``, as in transformers)
    only the start of the text gets the dummy-prefix space, not the text after a special token.
    """

    def __init__(self, path: Path, config: Mapping[str, Any]):
        import sentencepiece as spm
        from tokenizers import decoders

        try:
            base = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot load sentencepiece model ({e})") from e
        proto = base.serialized_model_proto()
        with_prefix, model_prefix = _sp_with_dummy_prefix(proto, True)
        without_prefix, _ = _sp_with_dummy_prefix(proto, False)
        self.sp_prefix = spm.SentencePieceProcessor(model_proto=with_prefix)
        self.sp_plain = spm.SentencePieceProcessor(model_proto=without_prefix)
        sp = self.sp_plain
        self.n_pieces = sp.get_piece_size()
        # Llama's defaults for a bare tokenizer.model: the model's own <s>, </s>, <unk> pieces.
        # (``config`` is the caller's private copy: filled in place so the Tokenizer sees them.)
        if isinstance(config, dict):
            for key, piece_id in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id())):
                if key not in config and 0 <= piece_id < self.n_pieces:
                    config[key] = sp.id_to_piece(piece_id)

        add_prefix_space = config.get("add_prefix_space")
        add_prefix_space = model_prefix if add_prefix_space is None else bool(add_prefix_space)
        legacy = bool(config.get("legacy", False))
        self.prepend = "never" if not add_prefix_space else ("always" if legacy else "first")

        # Added tokens: from added_tokens_decoder, and the named special tokens.
        self.added: Dict[str, _AddedToken] = {}
        self.id_to_added: Dict[int, str] = {}
        for t in _added_tokens_from_config(config):
            self.added.setdefault(t.content, t)
            self.id_to_added[t.id] = t.content
        named = [_token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS] + _extra_special_token_strings(config)
        for c in named:
            if c is None or c in self.added:
                continue
            tid = sp.piece_to_id(c)
            if tid == sp.unk_id() and c != sp.id_to_piece(sp.unk_id()):
                tid = max([self.n_pieces - 1, *self.id_to_added]) + 1  # a new token after the vocab
            self.added[c] = _AddedToken(c, tid, True)
            self.id_to_added.setdefault(tid, c)
        self._split_re = (
            re.compile("(" + "|".join(re.escape(c) for c in sorted(self.added, key=len, reverse=True)) + ")")
            if self.added
            else None
        )
        self.vocab_size = self.n_pieces + sum(1 for tid in self.id_to_added if tid >= self.n_pieces)
        self.base_vocab_size = self.n_pieces
        self.special_ids: Set[int] = {t.id for t in self.added.values() if t.special}
        self.special_ids |= {i for i in range(self.n_pieces) if sp.is_control(i)}

        seq = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix_space:
            seq.append(decoders.Strip(" ", 1, 0))
        self._decoder = decoders.Sequence(seq)

    def _split(self, text: str) -> List[Tuple[str, Optional[int], int]]:
        """[(text, added_token_id or None, start offset in text)]"""
        if self._split_re is None:
            return [(text, None, 0)]
        parts: List[Tuple[str, Optional[int], int]] = []
        pos = 0
        for m in self._split_re.finditer(text):
            parts.append((text[pos : m.start()], None, pos))
            t = self.added[m.group(0)]
            parts.append((m.group(0), t.id, m.start()))
            pos = m.end()
        parts.append((text[pos:], None, pos))
        # lstrip / rstrip: added tokens that eat the whitespace beside them
        for k, (seg, tid, off) in enumerate(parts):
            if tid is None:
                continue
            t = self.added[seg]
            if t.lstrip and k > 0 and parts[k - 1][1] is None:
                prev, _, poff = parts[k - 1]
                parts[k - 1] = (prev.rstrip(), None, poff)
            if t.rstrip and k + 1 < len(parts) and parts[k + 1][1] is None:
                nxt, _, noff = parts[k + 1]
                stripped = nxt.lstrip()
                parts[k + 1] = (stripped, None, noff + len(nxt) - len(stripped))
        return parts

    def encode(self, text: str, add_special_tokens: bool) -> List[int]:
        ids: List[int] = []
        for seg, tid, off in self._split(text):
            if tid is not None:
                ids.append(tid)
            elif seg:
                # As transformers' Metaspace pre-tokenizer: no dummy prefix if the text already
                # starts with a space (plain sentencepiece would give "▁▁" there).
                if (self.prepend == "always" or (self.prepend == "first" and off == 0)) and seg[0] not in " ▁":
                    ids.extend(self.sp_prefix.encode(seg))
                else:
                    ids.extend(self.sp_plain.encode(seg))
        return ids

    def id_to_token(self, tid: int) -> Optional[str]:
        tid = int(tid)
        tok = self.id_to_added.get(tid)
        if tok is not None:
            return tok
        if 0 <= tid < self.n_pieces:
            return self.sp_plain.id_to_piece(tid)
        return None

    def token_to_id(self, token: str) -> Optional[int]:
        t = self.added.get(token)
        if t is not None:
            return t.id
        tid = self.sp_plain.piece_to_id(token)
        if tid == self.sp_plain.unk_id() and token != self.sp_plain.id_to_piece(tid):
            return None
        return tid

    def tokens_to_string(self, tokens: List[str]) -> str:
        return self._decoder.decode(tokens)

    def get_vocab(self) -> Dict[str, int]:
        vocab = {self.sp_plain.id_to_piece(i): i for i in range(self.n_pieces)}
        vocab.update((c, t.id) for c, t in self.added.items())
        return vocab

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if int(i) not in self.special_ids]
        tokens = [self.id_to_token(i) for i in ids]
        return self.tokens_to_string([t for t in tokens if t is not None])  # unknown ids: skipped


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


# The most characters a chat template may write (a prompt is at most the 4 MiB body, and the
# template's own text around it): a template that writes more is stopped with an error.
MAX_RENDERED_CHARS = 8 << 20


@functools.lru_cache(maxsize=16)
def _parse_template(template: str):
    """The template's syntax tree, by the environment that renders it."""
    return _compile_chat_template(template).environment.parse(template)


def _compile_chat_template(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class _BoundedConcat(CodeGenerator):
        """``a ~ b`` through the environment's bounded_concat (Jinja joins it inline)."""

        def visit_Concat(self, node, frame):
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class _BoundedSandbox(ImmutableSandboxedEnvironment):
        """Jinja's sandbox, where ``*``, ``+`` and ``~`` may not build a string or list longer
        than MAX_RENDERED_CHARS (``{{ "x" * 10**9 }}`` would take gigabytes in one operation,
        before the rendered length could be checked), nor ``**`` a number of thousands of
        digits."""
        intercepted_binops = frozenset(["*", "+", "**"])
        code_generator_class = _BoundedConcat

        @staticmethod
        def bounded_concat(parts) -> str:
            parts = [str(p) for p in parts]
            if sum(map(len, parts)) > MAX_RENDERED_CHARS:
                raise SecurityError(f"the chat template builds a value of more than "
                                    f"{MAX_RENDERED_CHARS} items")
            return "".join(parts)

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and abs(right) > 64 \
                    and isinstance(left, (int, float)) and abs(left) > 1:
                raise SecurityError("the chat template raises a number to a power over 64")
            if operator in ("*", "+"):
                sizes = [len(x) if isinstance(x, (str, list, tuple)) else
                         x if isinstance(x, int) and operator == "*" else 1
                         for x in (left, right)]
                made = sizes[0] * sizes[1] if operator == "*" else sizes[0] + sizes[1]
                if made > MAX_RENDERED_CHARS and any(isinstance(x, (str, list, tuple))
                                                     for x in (left, right)):
                    raise SecurityError(f"the chat template builds a value of more than "
                                        f"{MAX_RENDERED_CHARS} items")
            return super().call_binop(context, operator, left, right)

    class _GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks: render as-is.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Messages as plain JSON-like data (pydantic models and dataclasses become dicts)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _plain(dump(exclude_none=True))
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    return str(value)


def _render_bounded(template, context: Dict[str, Any]) -> str:
    """The template's text, written piece by piece and stopped once longer than
    MAX_RENDERED_CHARS (a loop that writes without end)."""
    parts, size = [], 0
    for piece in template.generate(**context):
        size += len(piece)
        if size > MAX_RENDERED_CHARS:
            raise ValueError(f"the chat template wrote more than {MAX_RENDERED_CHARS} "
                             "characters")
        parts.append(piece)
    return "".join(parts)


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` up to the end of the last message's content, as the template wrote it (a
    template that trims the content's surrounding spaces is followed)."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):          # OpenAI's parts: the text ends with the last one's
        final = next((p.get("text") for p in reversed(final) if isinstance(p, dict)), None)
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message: the last message has no text to continue")
    at = text.rfind(final.strip())
    if at == -1:
        raise ValueError("continue_final_message: the chat template does not write the last "
                         "message's content as given, so it cannot be continued")
    kept = final.lstrip()
    end = at + (len(kept) if text.startswith(kept, at) else len(final.strip()))
    return text[:end]


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------

# transformers' apply_chat_template options that shape tensors, not the text or ids
_HF_CHAT_OPTIONS = ("padding", "truncation", "max_length", "return_tensors",
                    "return_assistant_tokens_mask", "tokenizer_kwargs")


class BatchEncoding(dict):
    """What transformers' ``tokenizer(text)`` returns: a dict of ``input_ids`` and
    ``attention_mask``, also read as attributes (``enc.input_ids``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """A model's tokenizer: ``tokenizer.json`` if present, else a sentencepiece ``tokenizer.model``.

    Reads ``tokenizer_config.json`` (special tokens, chat template, added tokens) and
    ``generation_config.json`` (extra end-of-sequence ids).
    """

    def __init__(
        self,
        backend: Any,
        *,
        config: Optional[Mapping[str, Any]] = None,
        generation_config: Optional[Mapping[str, Any]] = None,
        model_config: Optional[Mapping[str, Any]] = None,
        chat_template: Optional[str] = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        name_or_path: str = "",
    ):
        self._backend = backend
        self._config = dict(config or {})
        self.name_or_path = name_or_path
        self.chat_template: Optional[str] = chat_template
        self._add_bos = add_bos_token
        self._add_eos = add_eos_token

        def tid(key: str) -> Optional[int]:
            c = _token_content(self._config.get(key))
            return None if c is None else backend.token_to_id(c)

        self.bos_token: Optional[str] = _token_content(self._config.get("bos_token"))
        self.eos_token: Optional[str] = _token_content(self._config.get("eos_token"))
        self.unk_token: Optional[str] = _token_content(self._config.get("unk_token"))
        self.pad_token: Optional[str] = _token_content(self._config.get("pad_token"))
        self.bos_token_id: Optional[int] = tid("bos_token")
        self.unk_token_id: Optional[int] = tid("unk_token")
        self.pad_token_id: Optional[int] = tid("pad_token")
        eos_id = tid("eos_token")

        gen_eos = _as_id_list((generation_config or {}).get("eos_token_id"))
        if generation_config is None:  # like transformers: the generation defaults come from config.json
            gen_eos = _as_id_list((model_config or {}).get("eos_token_id"))
        if eos_id is None and gen_eos:
            eos_id = gen_eos[0]
        if self.bos_token_id is None and generation_config and generation_config.get("bos_token_id") is not None:
            self.bos_token_id = int(generation_config["bos_token_id"])
        self.eos_token_id: Optional[int] = eos_id
        self.eos_token_ids: Set[int] = set(gen_eos) | ({eos_id} if eos_id is not None else set())

        special = set(backend.special_ids)
        for i in (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id):
            if i is not None:
                special.add(i)
        # Every id decode(skip_special_tokens=True) drops: the added tokens marked special
        # (Llama 3's reserved ones too) and the named ones.
        self.special_ids: FrozenSet[int] = frozenset(special)
        # transformers' (what vLLM's get_tokenizer() hands out): the named special tokens of
        # tokenizer_config.json, then its additional / extra ones, each once, in that order.
        listed: List[str] = []
        for c in [_token_content(self._config.get(k)) for k in _NAMED_SPECIAL_KEYS] + \
                _extra_special_token_strings(self._config):
            if c is not None and c not in listed:
                listed.append(c)
        self.all_special_tokens: List[str] = listed
        self.all_special_ids: List[int] = [self._token_id(c) for c in listed]

    # --- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "Tokenizer":
        d = Path(model_dir).expanduser()
        if not d.is_dir():
            raise ModelLoadError(f"tokenizer directory {str(d)!r} does not exist (expected a model directory "
                                 "with tokenizer.json or tokenizer.model)")
        config = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
        if (d / "special_tokens_map.json").is_file():
            for k, v in _read_json(d / "special_tokens_map.json").items():
                config.setdefault(k, v)
        gen = _read_json(d / "generation_config.json") if (d / "generation_config.json").is_file() else None
        model_cfg = _read_json(d / "config.json") if (d / "config.json").is_file() else None

        if (d / "tokenizer.json").is_file():
            backend: Any = _HFBackend(d / "tokenizer.json", config)
            # The tokenizer.json post-processor decides about BOS/EOS (as in transformers).
            probe = backend.tok.encode("", add_special_tokens=True).ids
            add_bos, add_eos = False, False
            bos = _token_content(config.get("bos_token"))
            if bos is not None and probe and probe[0] == backend.token_to_id(bos):
                add_bos = True
        elif (d / "tokenizer.model").is_file():
            backend = _SentencePieceBackend(d / "tokenizer.model", config)
            add_bos = bool(config.get("add_bos_token", True))
            add_eos = bool(config.get("add_eos_token", False))
        else:
            raise ModelLoadError(
                f"no tokenizer in {str(d)!r}: expected tokenizer.json (Hugging Face tokenizers) or "
                "tokenizer.model (sentencepiece)"
            )
        return cls(
            backend,
            config=config,
            generation_config=gen,
            model_config=model_cfg,
            chat_template=_find_chat_template(d, config),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            name_or_path=str(d),
        )

    def info(self, chat_template: Optional[str] = None) -> Dict[str, Any]:
        """vLLM's /tokenizer_info: tokenizer_config.json's settings with each token written as
        its text (as transformers' init_kwargs, which vLLM returns), file paths left out, the
        class transformers loads for it, and the chat template in use."""
        def plain(v: Any) -> Any:
            if isinstance(v, dict):
                if isinstance(v.get("content"), str):        # a token (AddedToken's fields)
                    return v["content"]
                return {k: plain(x) for k, x in v.items()}
            return [plain(x) for x in v] if isinstance(v, list) else v
        out = {k: plain(v) for k, v in self._config.items()
               if k not in ("vocab_file", "merges_file")}
        name = str(self._config.get("tokenizer_class") or "PreTrainedTokenizer")
        out["tokenizer_class"] = name if name.endswith("Fast") else name + "Fast"
        out["name_or_path"] = self.name_or_path
        template = chat_template or self.chat_template
        if template:
            out["chat_template"] = template
        return out

    # --- encode / decode -------------------------------------------------------------------------

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` starts with the BOS token."""
        return self._add_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        b = self._backend
        if isinstance(b, _HFBackend):
            return b.encode(text, add_special_tokens)
        ids = b.encode(text, add_special_tokens)
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self._add_eos and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def encode_pair(self, text: str, text_pair: str, add_special_tokens: bool = True) -> List[int]:
        """transformers' ``tokenizer(text, text_pair=...)["input_ids"]``: tokenizer.json's pair
        template (e.g. ``<s> A <s> B`` for Llama's, ``A B`` for one without a pair template);
        for a sentencepiece model, each text encoded as alone (Llama's slow tokenizer)."""
        b = self._backend
        if isinstance(b, _HFBackend):
            return b.tok.encode(text, text_pair, add_special_tokens=add_special_tokens).ids
        return self.encode(text, add_special_tokens) + self.encode(text_pair, add_special_tokens)

    def __call__(self, text: Union[str, Sequence[str]], add_special_tokens: bool = True,
                 **kwargs: Any) -> "BatchEncoding":
        """transformers' ``tokenizer(text)``: ``{"input_ids", "attention_mask"}`` (also as
        attributes), lists of lists for a list of texts. Padding, truncation and tensors are
        not supported: such an argument is a TypeError naming it."""
        if kwargs:
            raise TypeError(f"llm_serving's tokenizer takes add_special_tokens only, not "
                            f"{', '.join(sorted(kwargs))}")
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        ids = [self.encode(t, add_special_tokens) for t in text]
        return BatchEncoding(input_ids=ids, attention_mask=[[1] * len(i) for i in ids])

    def tokenize(self, text: str, add_special_tokens: bool = False) -> List[str]:
        """The token strings of ``text`` (transformers': no special tokens added)."""
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens))

    def decode(self, ids: Union[int, Iterable[int]], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; special tokens are kept unless skip_special_tokens
        (transformers' default)."""
        if isinstance(ids, numbers.Integral):      # an int, or a NumPy integer
            ids = [ids]
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def batch_decode(self, sequences: Iterable[Iterable[int]],
                     skip_special_tokens: bool = False) -> List[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: Union[int, Iterable[int]]):
        """Token strings; None for ids outside the vocabulary (as transformers), which decode
        skips. One id gives one string, as transformers' does."""
        if isinstance(ids, numbers.Integral):
            return self._backend.id_to_token(int(ids))
        return [self._backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: Union[str, Iterable[str]]):
        """Token ids; a token outside the vocabulary is the unknown token's id (None without
        one). One token string gives one id, as transformers' does (vLLM scripts write
        ``stop_token_ids=[tok.convert_tokens_to_ids("<|eot_id|>")]``)."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> Optional[int]:
        tid = self._backend.token_to_id(token)
        return self.unk_token_id if tid is None else tid

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        """Join tokens into text as decode() would (used by the incremental detokenizer)."""
        return self._backend.tokens_to_string(list(tokens))

    def is_special_id(self, token_id: int) -> bool:
        return token_id in self.special_ids

    @property
    def model_max_length(self) -> int:
        """tokenizer_config.json's ``model_max_length``; without one, transformers' "no
        limit" value, 10**30."""
        value = self._config.get("model_max_length")
        return int(value) if isinstance(value, (int, float)) else int(1e30)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, without added tokens (transformers'); ``len()``
        counts those too."""
        return self._backend.base_vocab_size

    def __len__(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.vocab_size

    def get_vocab(self) -> Dict[str, int]:
        """Every token string and its id, added tokens included."""
        return self._backend.get_vocab()

    @property
    def is_fast(self) -> bool:
        """True, as transformers 5's tokenizers (a sentencepiece model is converted too)."""
        return True

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token's text can have (its vocabulary string is at least
        as long): a text longer than n times this needs more than n tokens, which is known
        without tokenizing it."""
        return max(len(t) for t in self.convert_ids_to_tokens(range(len(self))) if t) + 1

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, len={len(self)})"

    # --- chat ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: Sequence[Any],
        tools: Optional[list] = None,
        documents: Optional[list] = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """transformers' (5.x) call, with its defaults: the conversation's token ids as
        ``{"input_ids", "attention_mask"}``, or their list with ``return_dict=False``, or the
        text with ``tokenize=False``; a list of conversations gives one of each. Other keyword
        arguments are template variables; transformers' padding/truncation/tensor options
        are not supported (a TypeError naming them). The servers call render_chat_template."""
        unsupported = sorted(k for k in _HF_CHAT_OPTIONS if kwargs.get(k))
        if unsupported:
            raise TypeError(f"apply_chat_template: {', '.join(unsupported)} not supported by "
                            "llm_serving's tokenizer")
        for k in _HF_CHAT_OPTIONS:
            kwargs.pop(k, None)
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        texts = [self.render_chat_template(conv, add_generation_prompt, chat_template,
                                           continue_final_message, tools=tools,
                                           documents=documents, **kwargs)
                 for conv in (conversation if batched else [conversation])]
        if not tokenize:
            return texts if batched else texts[0]
        # the template writes the special tokens (as transformers: none added)
        ids = [self.encode(text, add_special_tokens=False) for text in texts]
        if not return_dict:
            return ids if batched else ids[0]
        if batched:
            return BatchEncoding(input_ids=ids, attention_mask=[[1] * len(i) for i in ids])
        return BatchEncoding(input_ids=ids[0], attention_mask=[1] * len(ids[0]))

    def render_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        continue_final_message: bool = False,
        content_format: Optional[str] = None,
        **kwargs: Any,
    ) -> str:
        """The text of ``messages`` by the chat template (``chat_template`` overrides the
        model's), with a generation prompt unless told not to: what the servers and LLM.chat
        use (apply_chat_template is transformers' interface to it).

        The template sees ``messages``, ``add_generation_prompt``, ``tools``/``documents`` (None
        unless given), the special tokens (``bos_token``, ``eos_token``, ...) and ``kwargs``.
        ``continue_final_message`` (transformers' and vLLM's): the text ends where the last
        message's content does, without what the template closes a turn with, so the model
        carries on writing that message (an assistant reply begun by the caller).
        ``content_format`` (vLLM's --chat-template-content-format: auto, string or openai;
        chat_content_format.py): the form each message's content is given in; None: as given.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if isinstance(template, str) and template in self._named_templates:
            template = self._named_templates[template]
        if not template:
            raise ValueError(
                f"the model {self.name_or_path or '(unnamed)'} has no chat template (no chat_template in "
                "tokenizer_config.json or chat_template.jinja); supply one with --chat-template"
            )
        context: Dict[str, Any] = {"tools": None, "documents": None}
        # like transformers: the special tokens the tokenizer has (unset ones stay undefined)
        for key in _SPECIAL_TOKEN_KEYS:
            if getattr(self, key) is not None:
                context[key] = getattr(self, key)
        extra = _extra_special_token_strings(self._config)
        if extra:
            context["additional_special_tokens"] = extra
        context.update(_plain(kwargs))
        messages = _developer_as_system(_plain(list(messages)), template)
        if content_format is not None:
            messages = format_contents(messages, content_format, template, _parse_template)
        context["messages"] = messages
        context["add_generation_prompt"] = add_generation_prompt
        text = _render_bounded(_compile_chat_template(template), context)
        return _cut_after_final_message(text, messages) if continue_final_message else text

    @property
    def _named_templates(self) -> Dict[str, str]:
        value = self._config.get("chat_template")
        if isinstance(value, list):
            return {t["name"]: t["template"] for t in value if isinstance(t, Mapping) and "name" in t}
        return {}


def _developer_as_system(messages: list, template: str) -> list:
    """OpenAI's "developer" role (newer SDKs send it for instructions) as "system" when the
    template does not name it, with every system message merged into the first, in order
    (vLLM's way: many templates want one system message, at the start)."""
    if ('"developer"' in template or "'developer'" in template
            or not any(m.get("role") == "developer" for m in messages)):
        return messages
    system, rest = [], []
    for m in messages:
        if m.get("role") in ("developer", "system"):
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(p["text"] for p in content
                                    if isinstance(p, dict) and "text" in p)
            if content:
                system.append(content)
        else:
            rest.append(m)
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


def _find_chat_template(d: Path, config: Mapping[str, Any]) -> Optional[str]:
    """chat_template.jinja / chat_template.json take priority over tokenizer_config.json (as in HF)."""
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    value: Any = None
    if (d / "chat_template.json").is_file():
        value = _read_json(d / "chat_template.json").get("chat_template")
    if value is None:
        value = config.get("chat_template")
    if isinstance(value, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """A server's or an LLM's ``chat_template`` setting read as vLLM reads it: the path of a
    template file, or else the template itself. A value with no Jinja characters that opens
    as no file is taken for a mistyped path: an error naming it, not a template printing it."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:      # ValueError: a NUL in a template's text
        if not any(c in value for c in "{}\n"):
            raise ConfigError("chat_template", f"{value!r} looks like a file path, but it "
                              f"could not be opened ({getattr(e, 'strerror', e)})") from None
        return value
