"""The text layer: tokenizer wrapper, chat templates (vs transformers, and the sandbox),
incremental detokenizing and stop strings."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError
from tiny_models import (
    LLAMA32_TEMPLATE,
    QWEN25_TEMPLATE,
    SMOLLM2_TEMPLATE,
    make_byte_fallback_tokenizer,
    make_tiny_tokenizer,
    utf8_cut,
)
from tokenizers import processors

from nbserve.text import ChatTemplate, IncrementalDetokenizer, StopStringMatcher, Tokenizer
from nbserve.types import InvalidRequestError

FIXTURES_OK = [HealthCheck.function_scoped_fixture]  # session fixtures are safe to share
# database=None below: runs do not depend on examples saved by earlier runs
MIXED_TEXT = "Hi there! 你好，世界 🎉👍🏽 café naïve — 日本語 🇫🇷 done."

# ----------------------------------------------------------------------------- tokenizer


def test_encode_maps_special_token_text_to_ids(tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids
    assert tiny_tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\n"


def test_roundtrip_and_token_bytes(tiny_tokenizer):
    ids = tiny_tokenizer.encode(MIXED_TEXT)
    assert tiny_tokenizer.decode(ids) == MIXED_TEXT
    assert b"".join(tiny_tokenizer.token_bytes(i) for i in ids) == MIXED_TEXT.encode()
    # Some byte-level pieces are parts of a character: their bytes are not valid UTF-8 alone.
    partial = [i for i in ids if not _valid_utf8(tiny_tokenizer.token_bytes(i))]
    assert partial, "expected emoji/CJK to be split across tokens"
    assert tiny_tokenizer.token_bytes(1) == b"<|im_start|>"
    hello = tiny_tokenizer.encode(" capital")
    assert [tiny_tokenizer.id_to_token(i) for i in hello] == ["\u0120capital"]
    assert tiny_tokenizer.id_to_token(10**7) == ""


def test_byte_fallback_token_bytes(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    ids = tok.encode("好 🎉 ok")
    pieces = [tok.id_to_token(i) for i in ids]
    assert "<0xF0>" in pieces
    assert tok.token_bytes(tok.token_to_id("<0xF0>")) == b"\xf0"
    # Metaspace puts a "▁" (a space) in front of the first word; decode strips it again.
    assert b"".join(tok.token_bytes(i) for i in ids) == " 好 🎉 ok".encode()
    assert tok.decode(ids) == "好 🎉 ok"


def test_bos_added_once_when_asked(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    assert tok.encode("hello")[0] != 1
    assert tok.encode("hello", add_special_tokens=True)[0] == 1
    with_bos = tok.encode("<s>hello", add_special_tokens=True)
    assert with_bos[0] == 1 and with_bos[1] != 1


def test_vocab_and_specials(tiny_tokenizer):
    assert tiny_tokenizer.vocab_size == make_tiny_tokenizer().get_vocab_size()
    assert {0, 1, 2} <= tiny_tokenizer.special_ids
    assert tiny_tokenizer.eos_token_ids == [2]


def test_from_file_infers_bos_from_post_processor(tmp_path):
    raw = make_tiny_tokenizer()
    raw.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json", eos_token="<|im_end|>")
    assert tok.bos_token_id == 0 and tok.add_bos_token and tok.eos_token_ids == [2]
    ids = tok.encode("<|endoftext|>hi", add_special_tokens=True)
    assert ids.count(0) == 1  # never a double BOS
    assert tok.encode("hi") == raw.encode("hi", add_special_tokens=False).ids


def test_from_any_accepts_the_documented_kinds(tmp_path, tiny_llama_dir):
    raw = make_tiny_tokenizer()
    raw.save(str(tmp_path / "tokenizer.json"))
    expected = raw.encode(MIXED_TEXT).ids
    for source in (raw, str(tmp_path / "tokenizer.json"), tmp_path / "tokenizer.json",
                   tiny_llama_dir, Tokenizer(raw)):
        tok = Tokenizer.from_any(source)
        assert tok.encode(MIXED_TEXT) == expected
        assert tok.decode(expected) == MIXED_TEXT
    assert Tokenizer.from_any(tiny_llama_dir).eos_token_ids == [2]


def test_from_any_transformers_tokenizer(tiny_llama_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tok = Tokenizer.from_any(hf)
    for text in (MIXED_TEXT, "<|im_start|>user\nhi<|im_end|>", " leading  spaces\n\n"):
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=True) == hf.encode(text)
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1 and not tok.add_bos_token


class _ByteTokenizer:
    """A duck-typed tokenizer: one token per UTF-8 byte, id 256 = end of text."""

    eos_token_id = 256

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def __len__(self):
        return 257


def test_from_any_duck_typed():
    tok = Tokenizer.from_any(_ByteTokenizer())
    ids = tok.encode("é🎉")
    assert ids == list("é🎉".encode()) and tok.vocab_size == 257
    assert tok.decode(ids) == "é🎉" and tok.eos_token_ids == [256]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(i) for i in ids) + detok.finish() == "é🎉"


def test_from_any_rejects_other_things():
    with pytest.raises(TypeError,
                       match="tokenizers.Tokenizer.*transformers tokenizer.*tokenizer.json"):
        Tokenizer.from_any(42)


# ----------------------------------------------------------------------------- chat template

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city — «quoted» ünïcode",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]
TOOL_CHAT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and 東京?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18°C"},
    {"role": "tool", "tool_call_id": "c2", "content": "25°C"},
    {"role": "assistant", "content": "Paris 18°C, Tokyo 25°C 🌤"},
    {"role": "user", "content": "Thanks!"},
]
LLAMA_TOOL_CHAT = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": {"temp": 18}},
    {"role": "tool", "content": "sunny"},
]
SIMPLE = [{"role": "user", "content": "Hello! 你好 🎉"}]
MULTI = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And <b>3+3</b> & \"quotes\"?"},
]
EXTRAS_TEMPLATE = (  # loop controls, namespace, dict(), generation tag, tojson options
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}"
    "{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}[{{ m.role }}:{{ m.content }}]"
    "{% endgeneration %}{% if ns.n >= 2 %}{% break %}{% endif %}{% endfor %}"
    "{{ dict(a=1, b='é') | tojson(indent=2, sort_keys=True) }}{{ tools | tojson }}"
)
LIST_TEMPLATE = (  # a template that understands content-part lists
    "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}({{ p.text }}){% endfor %}{% endif %}{% endfor %}"
)
CASES = {
    "smollm2-default-system": (SMOLLM2_TEMPLATE, SIMPLE, None, {}),
    "smollm2-multi": (SMOLLM2_TEMPLATE, MULTI, None, {}),
    "smollm2-no-generation-prompt": (SMOLLM2_TEMPLATE, MULTI, None,
                                     {"add_generation_prompt": False}),
    "qwen25-plain": (QWEN25_TEMPLATE, SIMPLE, None, {}),
    "qwen25-tools": (QWEN25_TEMPLATE, TOOL_CHAT, TOOLS, {}),
    "qwen25-tool-messages-no-tools": (QWEN25_TEMPLATE, TOOL_CHAT, None, {}),
    "llama32-date": (LLAMA32_TEMPLATE, MULTI, None, {"date_string": "01 Jan 2030"}),
    "llama32-strftime": (LLAMA32_TEMPLATE, SIMPLE, None, {}),
    "llama32-tools": (LLAMA32_TEMPLATE, LLAMA_TOOL_CHAT, TOOLS, {"date_string": "26 Jul 2024"}),
    "llama32-tools-in-system": (LLAMA32_TEMPLATE, LLAMA_TOOL_CHAT, TOOLS,
                                {"tools_in_user_message": False}),
    "extras": (EXTRAS_TEMPLATE, MULTI, TOOLS, {}),
    "content-lists": (LIST_TEMPLATE, [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], None, {}),
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=make_tiny_tokenizer(), bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>")


def test_from_transformers_tokenizer(hf_tokenizer):
    assert ChatTemplate.from_transformers(hf_tokenizer) is None
    hf_tokenizer = copy.copy(hf_tokenizer)
    hf_tokenizer.chat_template = LLAMA32_TEMPLATE
    template = ChatTemplate.from_transformers(hf_tokenizer)
    assert template.render(SIMPLE).startswith("<|im_start|><|start_header_id|>system")


@pytest.mark.parametrize("case", CASES)
def test_render_matches_transformers(case, hf_tokenizer):
    source, messages, tools, kwargs = CASES[case]
    kwargs = {"add_generation_prompt": True, **kwargs}
    before = copy.deepcopy(messages)
    expected = hf_tokenizer.apply_chat_template(
        copy.deepcopy(messages), tools=tools, chat_template=source, tokenize=False, **kwargs)
    template = ChatTemplate(source, **hf_tokenizer.special_tokens_map)
    assert template.render(messages, tools=tools, **kwargs) == expected
    assert messages == before  # the caller's messages are left alone


def test_text_part_lists_are_flattened_for_string_templates():
    template = ChatTemplate(SMOLLM2_TEMPLATE)
    parts = [{"role": "user", "content": [{"type": "text", "text": "line one"},
                                          {"type": "text", "text": "line two"}]}]
    assert template.render(parts) == template.render(
        [{"role": "user", "content": "line one\nline two"}])
    with pytest.raises(InvalidRequestError, match="image_url.*text only"):
        template.render([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])


def test_openai_string_tool_arguments_render_like_dicts():
    template = ChatTemplate(QWEN25_TEMPLATE)
    as_string = copy.deepcopy(TOOL_CHAT)
    for call in as_string[2]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    as_string[1]["name"] = None  # None values are dropped, as OpenAI clients send them
    assert template.render(as_string, tools=TOOLS) == template.render(TOOL_CHAT, tools=TOOLS)


def test_template_errors_become_invalid_request():
    template = ChatTemplate(LLAMA32_TEMPLATE)
    two_calls = copy.deepcopy(TOOL_CHAT[:3])
    with pytest.raises(InvalidRequestError, match="only supports single tool-calls"):
        template.render(two_calls, tools=TOOLS)
    with pytest.raises(InvalidRequestError, match="at least one message"):
        template.render([])
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].*role"):
        template.render([{"content": "no role"}])
    with pytest.raises(ValueError, match="syntax error"):
        ChatTemplate("{% for m in messages %}")


def test_default_template():
    template = ChatTemplate.default()
    assert template.is_default and not ChatTemplate(SMOLLM2_TEMPLATE).is_default
    assert template.render(MULTI) == (
        "<|im_start|>system\nAnswer in one line.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
        "<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n"
        "And <b>3+3</b> & \"quotes\"?<|im_end|>\n<|im_start|>assistant\n")
    with_tools = template.render(TOOL_CHAT, tools=TOOLS, add_generation_prompt=False)
    assert with_tools.startswith("<|im_start|>system\nYou are a weather bot.\n\n")
    assert '"description": "Get the weather in a city — «quoted» ünïcode"' in with_tools
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "東京"}}</tool_call>' \
        in with_tools
    assert with_tools.endswith("<|im_start|>user\nThanks!<|im_end|>\n")


MALICIOUS = [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch pwned').read() }}",
    "{{ joiner.__init__.__globals__['os'].system('touch pwned') }}",
    "{{ lipsum.__globals__['os'].system('touch pwned') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ strftime_now.__globals__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ messages | attr('__class__') }}",
    "{{ messages | map(attribute='__class__') | list }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ messages[0].items.__self__ }}",
    "{% for m in messages %}{{ loop.__class__ }}{% endfor %}",
    "{% set x = messages.append({'role': 'system', 'content': 'injected'}) %}",
    "{% set x = messages[0].update({'role': 'system'}) %}",
    "{% set ns = namespace(__class__=1) %}",
    "{% set ns = namespace() %}{% set ns.__init__ = 1 %}",
    "{{ 'x' * 1000000000 }}",
    "{{ 2 ** 100000000 }}",
]


@pytest.mark.parametrize("source", MALICIOUS)
def test_sandbox_stops_escapes(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    template = ChatTemplate(source)
    with pytest.raises(InvalidRequestError, match="sandbox forbids") as err:
        template.render([{"role": "user", "content": "hi"}])
    assert isinstance(err.value.__cause__, SecurityError)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("source", ["{% include '/etc/passwd' %}", "{% import 'os' as os %}",
                                    "{% extends '/etc/passwd' %}"])
def test_templates_cannot_read_files(source):
    with pytest.raises(InvalidRequestError) as err:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert "root:" not in str(err.value)


# ----------------------------------------------------------------------------- detokenizer


def _stream(tokenizer, ids, chunk=1, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.finish()


@pytest.mark.parametrize("tok_fixture", ["tiny_tokenizer", "byte_fallback_tokenizer"])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_detokenizer_emoji_cjk(tok_fixture, chunk, request):
    tok = request.getfixturevalue(tok_fixture)
    ids = tok.encode(MIXED_TEXT)
    deltas, tail = _stream(tok, ids, chunk)
    assert "".join(deltas) + tail == tok.decode(ids) == MIXED_TEXT
    assert tail == ""
    assert not any("\ufffd" in d for d in deltas)
    # Multi-byte characters spanned tokens, so some steps had to emit nothing.
    assert chunk > 1 or "" in deltas


def test_detokenizer_byte_fallback_pieces(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    party = [tok.token_to_id(f"<0x{b:02X}>") for b in "🎉".encode()]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in party] == ["", "", "", "🎉"]
    assert detok.add(tok.encode(" ok")) == " ok"


@pytest.mark.parametrize("tok_fixture", ["tiny_tokenizer", "byte_fallback_tokenizer"])
@pytest.mark.parametrize(("text", "shown"), [("ok 🎉", "ok "), ("中文", "中"),
                                             ("a\ufffd 中", "a\ufffd ")])
def test_detokenizer_drops_a_character_cut_at_the_end(tok_fixture, text, shown, request):
    """max_tokens can end an answer inside a character: its bytes are dropped, not shown as
    U+FFFD, whichever token the cut falls in (the tiny BPE has tokens like b" \xf0\x9f" that
    hold a space and the start of an emoji); a U+FFFD the tokens spell (EF BF BD) stays."""
    tok = request.getfixturevalue(tok_fixture)
    ids = tok.encode(text)
    deltas, tail = _stream(tok, ids[:-1])
    assert "".join(deltas) + tail == shown
    cuts = 0
    for end in range(1, len(ids) + 1):
        raw = b"".join(tok.token_bytes(i) for i in ids[:end])
        if not utf8_cut(raw):
            continue
        cuts += 1
        complete = raw[:len(raw) - utf8_cut(raw)].decode()
        deltas, tail = _stream(tok, ids[:end])
        # (sentencepiece drops the space it puts in front of the text)
        assert "".join(deltas) + tail in (complete, complete.removeprefix(" "))
    assert cuts >= 2


@pytest.mark.parametrize("tok_fixture", ["tiny_tokenizer", "byte_fallback_tokenizer"])
def test_detokenizer_keeps_a_replacement_character_the_tokens_spell(tok_fixture, request):
    tok = request.getfixturevalue(tok_fixture)
    for text in ("a\ufffd", "\ufffd", "ok \ufffd\ufffd"):
        deltas, tail = _stream(tok, tok.encode(text))
        assert "".join(deltas) + tail == tok.decode(tok.encode(text)) == text.lstrip(" ")


def test_detokenizer_skip_special_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|im_start|>assistant\nHi 🎉<|im_end|>")
    deltas, tail = _stream(tiny_tokenizer, ids, skip_special_tokens=True)
    assert "".join(deltas) + tail == "assistant\nHi 🎉"
    deltas, tail = _stream(tiny_tokenizer, ids)
    assert "".join(deltas) + tail == "<|im_start|>assistant\nHi 🎉<|im_end|>"


class _CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.longest = inner, 0

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_decodes_a_small_window(tiny_tokenizer):
    counting = _CountingTokenizer(tiny_tokenizer)
    ids = tiny_tokenizer.encode(MIXED_TEXT * 40)
    deltas, tail = _stream(counting, ids)
    assert "".join(deltas) + tail == MIXED_TEXT * 40
    assert len(ids) > 500 and counting.longest <= 16


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=FIXTURES_OK)
@given(ids=st.lists(st.integers(0, 639), max_size=40), chunk=st.integers(1, 4),
       skip=st.booleans())
def test_detokenizer_property_random_ids(tiny_tokenizer, ids, chunk, skip):
    """The deltas add up to the text of the tokens' bytes (what a byte-level BPE decodes),
    less the bytes of a character left incomplete at the end."""
    deltas, tail = _stream(tiny_tokenizer, ids, chunk, skip_special_tokens=skip)
    shown = [i for i in ids if not (skip and i in tiny_tokenizer.special_ids)]
    raw = b"".join(tiny_tokenizer.token_bytes(i) for i in shown)
    full = tiny_tokenizer.decode(ids, skip_special_tokens=skip)
    assert full == raw.decode("utf-8", "replace")
    assert "".join(deltas) + tail == raw[:len(raw) - utf8_cut(raw)].decode("utf-8", "replace")
    assert "".join(deltas).count("\ufffd") <= full.count("\ufffd")


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=FIXTURES_OK)
@given(text=st.text(max_size=30), chunk=st.integers(1, 3), cut=st.integers(0, 3))
def test_detokenizer_property_byte_fallback_text(byte_fallback_tokenizer, text, chunk, cut):
    """Valid text, its last `cut` tokens dropped: the deltas add up to the decoded tokens,
    less the byte tokens of a character left incomplete at the end."""
    tok = byte_fallback_tokenizer
    ids = tok.encode(text)
    ids = ids[:max(0, len(ids) - cut)]
    deltas, tail = _stream(tok, ids, chunk)
    whole = len(ids)
    while utf8_cut(b"".join(tok.token_bytes(i) for i in ids[:whole])):
        whole -= 1  # a byte token (<0xAB>) of the cut character
    assert "".join(deltas) + tail == tok.decode(ids[:whole])


# ----------------------------------------------------------------------------- stop strings


def _run_stops(stops, deltas, ends_answer=None):
    matcher = StopStringMatcher(stops, ends_answer)
    out, matched = [], None
    for d in deltas:
        text, matched = matcher.feed(d)
        out.append(text)
        if matched:
            break
    return "".join(out) + matcher.flush(), matched


def test_stop_spanning_deltas():
    assert _run_stops(["</s>"], ["Hello </", "s> world"]) == ("Hello ", "</s>")
    assert _run_stops(["STOP"], list("abcSTOPdef")) == ("abc", "STOP")


def test_stop_holds_back_only_possible_prefixes():
    matcher = StopStringMatcher(["Human:"])
    assert matcher.feed("Hello Hu") == ("Hello ", None)
    assert matcher.feed("go") == ("Hugo", None)
    assert matcher.feed(" H") == (" ", None)
    assert matcher.flush() == "H"


def test_stop_overlapping_prefix():
    # "ababc" inside "abababc": the first "abab" is not the start of the match.
    assert _run_stops(["ababc"], list("abababc")) == ("ab", "ababc")
    assert _run_stops(["aab"], ["a", "a", "a", "b", "c"]) == ("a", "aab")


def test_several_stops_first_completed_wins():
    assert _run_stops(["world", "lo w"], ["hello world"]) == ("hel", "lo w")
    assert _run_stops(["abcd", "bc"], ["abcd"]) == _run_stops(["abcd", "bc"], list("abcd")) \
        == ("a", "bc")
    assert _run_stops(["\n\n", "END"], ["one\n", "\ntwo END"]) == ("one", "\n\n")


def test_a_stop_counts_only_where_the_answer_may_end():
    """A constrained answer (`ends_answer`: its grammar accepts the text so far) passes over
    a stop string that would cut it short."""
    whole = {"yes", "yes sir"}.__contains__
    assert _run_stops(["e", " "], list("yes sir!"), whole) == ("yes", " ")
    assert _run_stops(["s"], ["yes s", "ir"], whole) == ("yes sir", None)
    assert _run_stops(["s"], ["y", "es sir"], lambda t: t == "yes ") == ("yes ", "s")


@settings(max_examples=300, deadline=None, database=None)
@given(text=st.text(alphabet="ab.", max_size=30),
       stops=st.lists(st.text(alphabet="ab.", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=6))
def test_stop_property_only_where_the_answer_may_end(text, stops, cuts):
    """The first stop string (by its end) whose text before it may end the answer, however
    the text is chunked."""
    def ends_answer(before):
        return before.endswith(".")
    hits = sorted((at + len(s), at, s) for s in stops for at in range(len(text))
                  if text.startswith(s, at) and ends_answer(text[:at]))
    expected = (text[:hits[0][1]], hits[0][2]) if hits else (text, None)
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert _run_stops(stops, chunks, ends_answer) == expected


def test_stop_after_match_and_no_stops():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("axb") == ("a", "x")
    assert matcher.feed("more") == ("", "x") and matcher.flush() == ""
    assert _run_stops([], ["free ", "text"]) == ("free text", None)


@settings(max_examples=300, deadline=None, database=None)
@given(text=st.text(alphabet="ab\n", max_size=30),
       stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=6))
def test_stop_property_chunking_does_not_matter(text, stops, cuts):
    ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if ends:
        _, start, stop = min(ends)
        expected = (text[:start], stop)
    else:
        expected = (text, None)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert _run_stops(stops, deltas) == expected


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_byte_fallback_tokenizer_is_deterministic():
    assert make_byte_fallback_tokenizer().to_str() == make_byte_fallback_tokenizer().to_str()
    assert make_tiny_tokenizer().to_str() == make_tiny_tokenizer().to_str()
