"""Tokenizer: encode/decode match transformers' AutoTokenizer; chat templates; errors."""

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.tiny_model import corpus_texts, make_tiny_model
from llm_serving.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

STRINGS = [
    "Hello world",
    "Give three tips for staying healthy.",
    "",
    " ",
    " leading space",
    "trailing space ",
    "two  spaces\tand\ttabs\n\nnewlines\r\n",
    "你好，世界。こんにちは",
    "emoji 😀🚀✨ ok 👩‍👩‍👧",
    "Ünïcödé café naïve e\u0301",
    "12345 3.14159 -7",
    "<s>Hello</s> there<unk>",
    "a<|im_start|>user\nhi<|im_end|>\n",
    "▁literal▁marker",
    "\x00\x07 control",
]

# text pieces the hypothesis strategy glues together: corpus-like words, specials, odd unicode
PIECES = ["the", " quick", "  ", "\n", "\t", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "你好",
          "😀", "é", "e\u0301", "▁", "123", ".", "'s", "<", ">", "|"]
text_strategy = st.lists(
    st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=12
).map("".join)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tok") / "tiny"))


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """A Llama-style sentencepiece BPE with byte fallback, trained on the bundled corpus."""
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("sp")
    texts, _ = corpus_texts()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(d / "tokenizer"), vocab_size=600, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=0.9995,
        num_threads=1, minloglevel=2, allow_whitespace_only_pieces=True,
    )
    (d / "tokenizer.vocab").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
        "clean_up_tokenization_spaces": False,
    }))
    return str(d)


@pytest.fixture(scope="module", params=["tiny", "sp"])
def pair(request, tiny_dir, sp_dir):
    d = tiny_dir if request.param == "tiny" else sp_dir
    return Tokenizer.from_pretrained(d), transformers.AutoTokenizer.from_pretrained(d)


def _check_same(ours, hf, text):
    for add in (True, False):
        assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), (text, add)
    ids = hf.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)


@pytest.mark.parametrize("text", STRINGS)
def test_matches_transformers(pair, text):
    _check_same(*pair, text)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=text_strategy)
def test_matches_transformers_random_text(pair, text):
    _check_same(*pair, text)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_random_ids_matches_transformers(pair, data):
    ours, hf = pair
    ids = data.draw(st.lists(st.integers(0, len(ours) - 1), max_size=16))
    for skip in (True, False):
        expected = hf.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ids, skip_special_tokens=skip) == expected
        kept = [i for i in ids if not (skip and i in ours.special_ids)]
        assert ours.convert_tokens_to_string(ours.convert_ids_to_tokens(kept)) == expected
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_special_ids_and_sizes(pair):
    ours, hf = pair
    assert len(ours) == len(hf) and ours.vocab_size == hf.vocab_size
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.all_special_tokens == hf.all_special_tokens
    assert ours.is_fast is hf.is_fast is True


def test_special_tokens_listed_as_transformers_lists_them(tiny_dir, tmp_path):
    """all_special_ids / all_special_tokens as transformers' (and so vLLM's get_tokenizer()):
    the named tokens, then the additional ones; an added token marked special that the config
    does not name (Llama 3's reserved tokens) is not listed, yet decode still skips it."""
    d = tmp_path / "unnamed"
    shutil.copytree(tiny_dir, d)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((d / name).read_text())
        config.pop("additional_special_tokens")
        config["pad_token"] = "<|im_end|>"
        (d / name).write_text(json.dumps(config))
    ours, hf = Tokenizer.from_pretrained(str(d)), transformers.AutoTokenizer.from_pretrained(d)
    assert ours.all_special_tokens == hf.all_special_tokens == ["<s>", "</s>", "<unk>",
                                                                "<|im_end|>"]
    assert ours.all_special_ids == hf.all_special_ids == [1, 2, 0, 4]
    ids = [3] + hf.encode("Hello", add_special_tokens=False)      # 3: <|im_start|>
    assert ours.decode(ids, skip_special_tokens=True) == \
        hf.decode(ids, skip_special_tokens=True) == "Hello"


def test_tiny_model_specials(tiny_dir):
    tok = Tokenizer.from_pretrained(tiny_dir)
    assert tok.eos_token_ids == {2, 4}  # tokenizer eos + generation_config's list
    assert tok.add_bos_token
    ids = tok.encode("hi")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # post-processor only, once
    assert tok.encode("<s>hi", add_special_tokens=False)[0] == 1  # specials split out of text
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=False) == "<s><|im_start|>hi<|im_end|>"


def test_sentencepiece_details(sp_dir):
    tok = Tokenizer.from_pretrained(sp_dir)
    assert tok.encode("a") [0] == 1
    newline = tok.convert_tokens_to_ids(["<0x0A>"])[0]
    assert tok.decode([newline]) == "\n"
    assert tok.convert_tokens_to_string(["▁Hello", "▁wor", "ld", "<0x0A>", "<0xE4>", "<0xBD>", "<0xA0>"]) == "Hello world\n你"
    assert tok.decode(tok.encode("Hello 你好 😀\n"), skip_special_tokens=True) == "Hello 你好 😀\n"
    assert tok.eos_token_ids == {2}


def test_sentencepiece_without_config(sp_dir, tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    shutil.copy(Path(sp_dir) / "tokenizer.model", d / "tokenizer.model")
    tok = Tokenizer.from_pretrained(str(d))
    ref = Tokenizer.from_pretrained(sp_dir)
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.encode("Hello world") == ref.encode("Hello world")
    assert tok.chat_template is None


def test_chat_template_matches_transformers(tiny_dir):
    ours = Tokenizer.from_pretrained(tiny_dir)
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}]
    for gen in (True, False):
        expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert ours.render_chat_template(msgs, add_generation_prompt=gen) == expected
    assert ours.render_chat_template(msgs[1:2]) == "<s><|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n"
    ids = ours.encode(ours.render_chat_template(msgs), add_special_tokens=False)
    assert ids == hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids.count(ours.bos_token_id) == 1 and ids[0] == ours.bos_token_id


def test_chat_template_features_match_transformers(tiny_dir):
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ours = Tokenizer.from_pretrained(tiny_dir)
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m['role'] == 'user' %}[U]{{ m['content'] | trim }}{% else %}[A]{{ m['content'] }}{{ eos_token }}{% endif %}\n"
        "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}[A]{% endif %}"
        "{% if extra is defined %}<{{ extra }}>{% endif %}"
    )
    msgs = [{"role": "user", "content": " q <&> "}, {"role": "assistant", "content": "a"}]
    tools = [{"name": "f", "description": "<b>"}]
    expected = hf.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True,
                                      tools=tools, extra="x")
    assert ours.render_chat_template(msgs, chat_template=template, tools=tools, extra="x") == expected
    assert expected == '<s>[U]q <&>[A]a</s>[{"name": "f", "description": "<b>"}][A]<x>'


def test_chat_template_helpers(tiny_dir):
    import jinja2

    tok = Tokenizer.from_pretrained(tiny_dir)
    assert len(tok.render_chat_template([], chat_template="{{ strftime_now('%Y') }}")) == 4
    with pytest.raises(jinja2.TemplateError, match="no system"):
        tok.render_chat_template([], chat_template="{{ raise_exception('no system') }}")
    gen = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert tok.render_chat_template([{"role": "assistant", "content": "x"}], chat_template=gen) == "x"
    loop = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
    assert tok.render_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                                   chat_template=loop) == "a"
    assert tok.render_chat_template([], chat_template="{{ pad_token is defined }}") == "False"
    with pytest.raises(jinja2.exceptions.SecurityError):  # sandboxed: inputs are immutable
        tok.render_chat_template([], chat_template="{{ messages.append(1) }}")


def test_chat_template_cannot_build_huge_values(tiny_dir):
    """A template may not make a value or a text of more than MAX_RENDERED_CHARS: one `*`, a
    doubling loop with `~` or `+`, a power of thousands of digits, endless output. Each is
    stopped at once instead of taking gigabytes; ordinary uses of the operators still match
    transformers."""
    import jinja2
    from llm_serving.tokenizer import MAX_RENDERED_CHARS

    tok = Tokenizer.from_pretrained(tiny_dir)
    msgs = [{"role": "user", "content": "hi"}]
    doubling = ("{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                "{% set ns.s = ns.s OP ns.s %}{% endfor %}{{ ns.s }}")
    for template in ('{{ "x" * 100000000 }}', doubling.replace("OP", "~"),
                     doubling.replace("OP", "+"), "{{ 10 ** 100000 }}",
                     "{{ [1] * 100000000 }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.render_chat_template(msgs, chat_template=template)
    endless = "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}"
    with pytest.raises(ValueError, match=f"more than {MAX_RENDERED_CHARS}"):
        tok.render_chat_template(msgs, chat_template=endless)
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ordinary = ("{{ bos_token ~ '[' ~ messages|length ~ ']' }}{% for m in messages %}"
                "{{ m['role'] + ': ' + m['content'] * 2 }}{{ '-' * 3 }}{{ 2 ** 10 }}"
                "{% endfor %}")
    assert tok.render_chat_template(msgs, chat_template=ordinary) == \
        hf.apply_chat_template(msgs, chat_template=ordinary, tokenize=False) == \
        "<s>[1]user: hihi---1024"


def test_continue_final_message_matches_transformers(tiny_dir):
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ours = Tokenizer.from_pretrained(tiny_dir)
    trims = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>"
             "{% endfor %}")
    for template in (None, trims):
        for last in ("The answer is", "The answer is  ", "  spaced out "):
            msgs = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": last}]
            want = hf.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                          add_generation_prompt=False,
                                          continue_final_message=True)
            assert ours.render_chat_template(msgs, chat_template=template,
                                            add_generation_prompt=False,
                                            continue_final_message=True) == want
    with pytest.raises(ValueError, match="continue_final_message"):
        ours.render_chat_template([{"role": "user", "content": "x"}],
                                 chat_template="{{ 'nothing of it' }}",
                                 add_generation_prompt=False, continue_final_message=True)


def test_no_chat_template_error(sp_dir):
    tok = Tokenizer.from_pretrained(sp_dir)
    with pytest.raises(ValueError, match="no chat template.*--chat-template"):
        tok.render_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_file_takes_priority(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }};{% endfor %}")
    assert Tokenizer.from_pretrained(str(d)).render_chat_template([{"role": "user", "content": "x"}]) == "x;"


def test_missing_tokenizer_errors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=str(tmp_path) + ".*tokenizer.json.*tokenizer.model"):
        Tokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.from_pretrained(str(tmp_path / "nope"))


def test_generation_config_eos_int_and_config_fallback(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert Tokenizer.from_pretrained(str(d)).eos_token_ids == {2, 3}
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = [2, 4]
    (d / "config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_pretrained(str(d)).eos_token_ids == {2, 4}


def test_convert_one_token_or_id_as_transformers(pair):
    """vLLM scripts write ``stop_token_ids=[tok.convert_tokens_to_ids("<|eot_id|>")]``: one
    token string gives one id (not a list of its characters' ids), one id one string."""
    ours, hf = pair
    for token in ("</s>", "<s>", "not-a-token-in-the-vocab"):
        assert ours.convert_tokens_to_ids(token) == hf.convert_tokens_to_ids(token)
    tokens = ["</s>", "not-a-token-in-the-vocab"]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    for tid in (2, 40, len(ours) + 5):
        assert ours.convert_ids_to_tokens(tid) == hf.convert_ids_to_tokens(tid)


def test_transformers_call_surface_matches(pair):
    """What vLLM scripts call on llm.get_tokenizer() (vLLM hands out transformers' tokenizer):
    the same results and defaults as transformers on the same files, both tokenizer kinds."""
    ours, hf = pair
    for text in ("Hello world", ["Hello", "Hi there 你好"]):
        for add in (True, False):
            a, b = ours(text, add_special_tokens=add), hf(text, add_special_tokens=add)
            assert dict(a) == dict(b) and a.input_ids == b.input_ids
    with pytest.raises(TypeError, match="return_tensors"):
        ours("Hello", return_tensors="pt")
    ids = hf.encode("Hello world") + [hf.eos_token_id]
    assert ours.decode(ids) == hf.decode(ids)            # special tokens kept by default
    assert ours.decode(ids[1]) == hf.decode(ids[1])      # one id
    assert ours.batch_decode([ids, ids[:2]]) == hf.batch_decode([ids, ids[:2]])
    assert ours.batch_decode([ids], skip_special_tokens=True) == \
        hf.batch_decode([ids], skip_special_tokens=True)
    assert ours.tokenize("Hello world") == hf.tokenize("Hello world")
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id",
                 "eos_token_id", "unk_token_id", "pad_token_id", "vocab_size"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert len(ours) == len(hf) and ours.get_vocab() == hf.get_vocab()
    assert ours.all_special_tokens == hf.all_special_tokens
    assert ours.model_max_length == hf.model_max_length
    # ids as NumPy arrays and integers (what a script slicing logits hands over)
    import numpy as np
    arr = np.array(ids)
    assert ours.decode(arr) == hf.decode(ids) and ours.decode(arr[1]) == hf.decode(ids[1])
    assert ours.convert_ids_to_tokens(arr[1]) == hf.convert_ids_to_tokens(ids[1])
    assert ours.convert_ids_to_tokens(arr) == hf.convert_ids_to_tokens(ids)


def test_apply_chat_template_defaults_match_transformers(tiny_dir):
    """transformers' (5.x) defaults: token ids as a dict, no generation prompt; return_dict
    False the ids, tokenize False the text; a list of conversations gives a list."""
    ours = Tokenizer.from_pretrained(tiny_dir)
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    msgs = [{"role": "user", "content": "Hello there"}]
    convs = [msgs, msgs + [{"role": "assistant", "content": "Hi"}]]
    for conv in (msgs, convs):
        assert dict(ours.apply_chat_template(conv)) == dict(hf.apply_chat_template(conv))
        for kw in ({"return_dict": False}, {"tokenize": False},
                   {"add_generation_prompt": True, "return_dict": False},
                   {"add_generation_prompt": True, "tokenize": False}):
            assert ours.apply_chat_template(conv, **kw) == hf.apply_chat_template(conv, **kw), kw
    assert ours.apply_chat_template(msgs).input_ids == hf.apply_chat_template(msgs).input_ids
    with pytest.raises(TypeError, match="return_tensors"):
        ours.apply_chat_template(msgs, return_tensors="pt")
