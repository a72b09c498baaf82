"""Incremental detokenizer: joined deltas == decode, UTF-8 safety, stop strings, flush."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_serving.engine.detokenizer import IncrementalDetokenizer
from llm_serving.model_executor.tiny_model import corpus_texts, make_tiny_model
from llm_serving.tokenizer import Tokenizer

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MULTIBYTE = "你好，世界！😀🚀 naïve café ✨ 👩‍👩‍👧 ok\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(make_tiny_model(str(tmp_path_factory.mktemp("detok") / "tiny")))


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("sp")
    texts, _ = corpus_texts()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(d / "tokenizer"), vocab_size=600, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
    )
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "unk_token": "<unk>", "legacy": False}))
    return Tokenizer.from_pretrained(str(d))


def run(tok, ids, chunks=None, prompt=(), **kw):
    """Feed ids in the given chunk sizes (default: one by one); return (deltas, detokenizer)."""
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas = []
    i = 0
    sizes = iter(chunks or [])
    while i < len(ids):
        n = max(1, next(sizes, 1))
        deltas.append(d.step(ids[i:i + n]))
        i += n
    deltas.append(d.flush())
    return deltas, d


def whole_chars(tok, ids, skip=True):
    """decode(ids) without the bytes of a character the last ids leave incomplete (vLLM drops
    them): the decode of the longest prefix of ids that does not end in U+FFFD."""
    for k in range(len(ids), 0, -1):
        text = tok.decode(ids[:k], skip_special_tokens=skip)
        if not text.endswith("\ufffd"):
            return text
    return ""


def expected_text(tok, prompt, ids, skip):
    """What the output adds to the prompt's text."""
    if not prompt:
        return tok.decode(ids, skip_special_tokens=skip)
    full = tok.decode(list(prompt) + list(ids), skip_special_tokens=skip)
    before = tok.decode(list(prompt), skip_special_tokens=skip)
    assert full.startswith(before)
    return full[len(before):]


@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_random_ids_join_to_decode(tok, data):
    """Any token sequence (byte-level BPE), any chunking: joined deltas == decode(output ids),
    less a character the last ids leave incomplete."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40), label="chunks")
    skip = data.draw(st.booleans(), label="skip")
    deltas, d = run(tok, ids, chunks, skip_special_tokens=skip)
    assert "".join(deltas) == whole_chars(tok, ids, skip) == d.output_text
    assert d.stop_reason is None


@settings(max_examples=200, **SETTINGS)
@given(data=st.data())
def test_text_with_prompt_joins_to_decode(tok, sp_tok, data):
    """Real text (multi-byte chars split across byte tokens) after a prompt, both tokenizer kinds."""
    t = data.draw(st.sampled_from([tok, sp_tok]), label="tokenizer")
    pieces = ["你", "好", "😀", "🚀", "é", "a", "the", " ", "\n", "<s>", "</s>", "\u0301", "👩‍👧"]
    text = "".join(data.draw(st.lists(st.sampled_from(pieces), max_size=20), label="text"))
    prompt_text = "".join(data.draw(st.lists(st.sampled_from(pieces), max_size=8), label="prompt"))
    prompt = t.encode(prompt_text)
    ids = t.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=40), label="chunks")
    skip = data.draw(st.booleans(), label="skip")
    deltas, d = run(t, ids, chunks, prompt=prompt, skip_special_tokens=skip)
    assert "".join(deltas) == expected_text(t, prompt, ids, skip) == d.output_text


def test_multibyte_split_across_tokens_never_emits_partial(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    # the tiny vocab has no Chinese/emoji merges: characters are split into byte tokens
    assert len(ids) > len(MULTIBYTE)
    deltas, d = run(tok, ids)
    assert "".join(deltas) == MULTIBYTE
    assert not any("\ufffd" in x for x in deltas)
    assert any(x == "" for x in deltas)  # some steps had to wait for the rest of a character


def test_sentencepiece_byte_fallback_and_space(sp_tok):
    prompt = sp_tok.encode("Say hi:")
    ids = sp_tok.encode("Hello 你好 😀", add_special_tokens=False)
    assert "<0xE4>" in sp_tok.convert_ids_to_tokens(ids)
    deltas, d = run(sp_tok, ids, prompt=prompt)
    assert not any("\ufffd" in x for x in deltas)
    # after a prompt the first word keeps the space its "▁" marks
    assert "".join(deltas) == " Hello 你好 😀"
    deltas, d = run(sp_tok, ids)  # no prompt: exactly decode()
    assert "".join(deltas) == sp_tok.decode(ids) == "Hello 你好 😀"


def test_trailing_partial_character_is_dropped_as_vllm_does(tok):
    ids = tok.encode("ab😀", add_special_tokens=False)
    # stop in the middle of the emoji (max_tokens): its held-back bytes are dropped, not
    # flushed as U+FFFD (vLLM's text is "ab" too)
    partial = ids[:-1]
    assert tok.decode(partial).endswith("\ufffd")
    d = IncrementalDetokenizer(tok, [])
    streamed = "".join(d.step([i]) for i in partial)
    assert streamed == "ab"
    assert d.flush() == "" and d.output_text == "ab"
    assert d.flush() == "" and d.step([5]) == ""
    # the emoji's bytes completed: nothing is lost
    d = IncrementalDetokenizer(tok, [])
    assert "".join(d.step([i]) for i in ids) + d.flush() == "ab😀"
    # one step of several tokens: the whole characters before the cut one come out
    d = IncrementalDetokenizer(tok, [])
    assert d.step(partial) == "ab" and d.flush() == ""
    # text held for a stop string still comes out at the end
    d = IncrementalDetokenizer(tok, [], stop=["bc"])
    streamed = "".join(d.step([i]) for i in partial)
    assert streamed + d.flush() == "ab"


def test_stop_string_spanning_tokens(tok):
    text = "The answer is 42. STOP here and then more text"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, d = run(tok, ids, stop=["STOP here"])
    assert d.stop_reason == "STOP here"
    assert "".join(deltas) == d.output_text == "The answer is 42. "
    # it spans several tokens
    assert len(tok.encode("STOP here", add_special_tokens=False)) > 1
    deltas, d = run(tok, ids, stop=["STOP here"], include_stop_str_in_output=True)
    assert "".join(deltas) == d.output_text == "The answer is 42. STOP here"


def test_stop_text_is_never_emitted_before_the_cut(tok):
    """Deltas never contain text that the stop later cuts (a stop-string prefix is held back)."""
    text = "ab\n\ncd"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["\n\n"])
    seen = ""
    for i in ids:
        seen += d.step([i])
        assert "\n" not in seen
    seen += d.flush()
    assert seen == "ab" and d.stop_reason == "\n\n"
    # a partial stop that does not complete is released
    deltas, d = run(tok, tok.encode("ab\ncd\n", add_special_tokens=False), stop=["\n\n"])
    assert "".join(deltas) == "ab\ncd\n" and d.stop_reason is None


@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_stop_strings_random(tok, data):
    alphabet = st.sampled_from(list("ab c\n你😀"))
    text = "".join(data.draw(st.lists(alphabet, max_size=30), label="text"))
    stops = data.draw(st.lists(st.lists(alphabet, min_size=1, max_size=4).map("".join), min_size=1, max_size=3),
                      label="stops")
    include = data.draw(st.booleans(), label="include")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40), label="chunks")
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    # expected: the match that ends first (ties: starts first)
    best = None
    for s in stops:
        i = full.find(s)
        if i != -1 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    deltas, d = run(tok, ids, chunks, stop=stops, include_stop_str_in_output=include)
    joined = "".join(deltas)
    assert joined == d.output_text
    if best is None:
        assert joined == full and d.stop_reason is None
    else:
        i, s = best
        assert d.stop_reason == s
        assert joined == (full[: i + len(s)] if include else full[:i])


@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_stop_strings_count_only_past_min_tokens(tok, data):
    """vLLM's min_tokens rule: a stop string counts only if it ends in text that came after
    the first min_tokens tokens (the text those released: whole tokens of whole characters)."""
    alphabet = st.sampled_from(list("ab c\n你😀"))
    text = "".join(data.draw(st.lists(alphabet, max_size=30), label="text"))
    stops = data.draw(st.lists(st.lists(alphabet, min_size=1, max_size=4).map("".join),
                               min_size=1, max_size=3), label="stops")
    include = data.draw(st.booleans(), label="include")
    ids = tok.encode(text, add_special_tokens=False)
    min_tokens = data.draw(st.integers(0, len(ids)), label="min_tokens")
    full = tok.decode(ids)
    released = max(j for j in range(min_tokens + 1)
                   if j == 0 or not tok.decode(ids[:j]).endswith("\ufffd"))
    off = len(tok.decode(ids[:released]))
    best = None
    for s in stops:
        i = full.find(s, max(off - len(s) + 1, 0))
        if i != -1 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    deltas, d = run(tok, ids, stop=stops, include_stop_str_in_output=include,
                    min_tokens=min_tokens)
    joined = "".join(deltas)
    if best is None:
        assert joined == full and d.stop_reason is None
    else:
        i, s = best
        assert d.stop_reason == s
        assert joined == (full[: i + len(s)] if include else full[:max(i, off)])


@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_text_is_held_back_only_where_a_stop_string_could_start(tok, data):
    """A stream holds back only the end of the text that could still begin a stop string (the
    longest end that is a proper beginning of one); everything before it goes out at once."""
    alphabet = st.sampled_from(list("ab c"))
    text = "".join(data.draw(st.lists(alphabet, max_size=30), label="text"))
    stops = data.draw(st.lists(st.lists(alphabet, min_size=1, max_size=8).map("".join),
                               min_size=1, max_size=4), label="stops")
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=stops)
    emitted = ""
    for n in range(1, len(ids) + 1):
        emitted += d.step([ids[n - 1]])
        if d.stop_reason is not None:
            break
        so_far = tok.decode(ids[:n])
        held = max((k for s in stops for k in range(1, min(len(s), len(so_far) + 1))
                    if so_far.endswith(s[:k])), default=0)
        assert emitted == so_far[:len(so_far) - held]


def test_step_cost_does_not_grow(tok):
    """Per-step work is bounded: the token window stays short however long the output gets."""
    ids = tok.encode(" ".join(corpus_texts()[0][:200]), add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("prompt"), stop=["zzzz"])
    out = []
    for i in ids:
        out.append(d.step([i]))
        assert len(d._tokens) < 200
        assert len(d._pending) + len(d._tail) < 50
    out.append(d.flush())
    assert "".join(out) == tok.decode(ids)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|></s>", add_special_tokens=False)
    assert "".join(run(tok, ids)[0]) == "hi"
    assert "".join(run(tok, ids, skip_special_tokens=False)[0]) == "<|im_start|>hi<|im_end|></s>"


def test_ids_outside_tokenizer_vocab_are_skipped(tok, sp_tok):
    for t in (tok, sp_tok):
        ids = t.encode("hi there", add_special_tokens=False)
        ids = ids[:1] + [t.vocab_size + 5] + ids[1:]
        assert t.convert_ids_to_tokens([t.vocab_size + 5]) == [None]
        assert "".join(run(t, ids)[0]) == t.decode(ids) == "hi there"
