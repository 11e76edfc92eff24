"""nbserve renders each model family's own chat template exactly as transformers'
`apply_chat_template` does (text and token ids), and stops on every end-of-turn token the
family's generation_config.json lists.

The templates are the real ones (tests/family_templates.py); the tokenizers are tiny stand-ins
that carry each family's special tokens, so transformers and nbserve read the same files.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from family_templates import FAMILIES, Family, make_family_dir, make_family_model_dir
from server_util import app_running, engine_running

from nbserve.text.chat_template import ChatTemplate, load_chat_template
from nbserve.text.tokenizer import Tokenizer, load_tokenizer
from nbserve.types import InvalidRequestError

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
USER = {"role": "user", "content": "What is the capital of France?"}
ANSWER = {"role": "assistant", "content": "  The capital of France is Paris.  "}
USER_2 = {"role": "user", "content": "And of Japan? Café ☕ 東京 🎉"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'}
THOUGHT = "The user wants a capital.\nParis is the capital of France."

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [USER],
    "system+user": [SYSTEM, USER],
    "multi-turn": [USER, ANSWER, USER_2],
    "system+multi-turn": [SYSTEM, USER, ANSWER, USER_2],
    "ends-with-answer": [USER, ANSWER],
}


# ----------------------------------------------------------------------------- the two sides


class Pair:
    """One family's directory read by transformers and by nbserve."""

    def __init__(self, family: Family, path: Path):
        from transformers import AutoTokenizer

        self.family = family
        self.path = path
        self.hf = AutoTokenizer.from_pretrained(path)
        self.tokenizer, config = load_tokenizer(path)
        template = load_chat_template(path, config)
        assert template is not None
        self.template: ChatTemplate = template

    def reference(self, messages: list[dict[str, Any]], **kw: Any) -> tuple[str, list[int]]:
        text = self.hf.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kw)
        ids = self.hf.apply_chat_template(copy.deepcopy(messages), tokenize=True, **kw)
        return text, list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def ours(self, messages: list[dict[str, Any]], tools: Any = None,
             add_generation_prompt: bool = False, **kw: Any) -> tuple[str, list[int]]:
        text = self.template.render(copy.deepcopy(messages), tools=copy.deepcopy(tools),
                                    add_generation_prompt=add_generation_prompt, **kw)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def check(self, messages: list[dict[str, Any]], ours: list[dict[str, Any]] | None = None,
              **kw: Any) -> str:
        """Both render `messages` (nbserve gets `ours` instead when given) to the same text and
        the same ids; returns the text."""
        want_text, want_ids = self.reference(messages, **kw)
        got_text, got_ids = self.ours(messages if ours is None else ours, **kw)
        assert got_text == want_text
        assert got_ids == want_ids
        return got_text


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    root = tmp_path_factory.mktemp("families")
    return {name: Pair(f, make_family_dir(root / name, f)) for name, f in FAMILIES.items()}


def _families(**flags: bool) -> list[str]:
    return [n for n, f in FAMILIES.items() if all(getattr(f, k) == v for k, v in flags.items())]


def _string_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as an OpenAI client sends them: tool-call arguments as JSON strings."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


# ----------------------------------------------------------------------------- conversations


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_plain_conversations_render_as_transformers(pairs: dict[str, Pair], family: str,
                                                    conversation: str,
                                                    add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[conversation]
    if not FAMILIES[family].system and messages[0]["role"] == "system":
        pytest.skip("the template refuses a system message (test_system_refused)")
    pairs[family].check(messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("family", _families(system=False))
def test_system_refused_as_the_template_says(pairs: dict[str, Pair], family: str) -> None:
    pair = pairs[family]
    with pytest.raises(Exception) as ref:
        pair.reference([SYSTEM, USER], add_generation_prompt=True)
    with pytest.raises(InvalidRequestError) as err:
        pair.ours([SYSTEM, USER], add_generation_prompt=True)
    assert str(ref.value) in str(err.value)
    assert err.value.param == "messages"


def test_gemma3_folds_the_system_prompt_into_the_first_user_turn(
        pairs: dict[str, Pair]) -> None:
    pair = pairs["gemma3"]
    text = pair.check([SYSTEM, USER, ANSWER, USER_2], add_generation_prompt=True)
    assert text.startswith(f"<bos><start_of_turn>user\n{SYSTEM['content']}\n\n{USER['content']}")
    parts = [{"role": "system", "content": [{"type": "text", "text": SYSTEM["content"]}]},
             {"role": "user", "content": [{"type": "text", "text": " Hello "},
                                          {"type": "text", "text": "there "}]}]
    pair.check(parts, add_generation_prompt=True)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mixtral"])
def test_roles_that_do_not_alternate_are_refused(pairs: dict[str, Pair], family: str) -> None:
    pair = pairs[family]
    with pytest.raises(Exception) as ref:
        pair.reference([USER, USER_2], add_generation_prompt=True)
    with pytest.raises(InvalidRequestError) as err:
        pair.ours([USER, USER_2], add_generation_prompt=True)
    assert str(ref.value) in str(err.value)


# ----------------------------------------------------------------------------- tools


TOOL_CASES: dict[str, list[dict[str, Any]]] = {
    "user": [USER],
    "system+user": [SYSTEM, USER],
    "call-and-result": [USER, CALL, RESULT],
    "call-result-answer": [SYSTEM, USER, CALL, RESULT,
                           {"role": "assistant", "content": "It is 21 °C and clear."}, USER_2],
}


@pytest.mark.parametrize("family", _families(tools=True))
@pytest.mark.parametrize("case", list(TOOL_CASES))
def test_tools_render_as_transformers(pairs: dict[str, Pair], family: str, case: str) -> None:
    messages = TOOL_CASES[case]
    pair = pairs[family]
    pair.check(messages, tools=[WEATHER], add_generation_prompt=True)
    # An OpenAI client sends the arguments as a JSON string; the template gets them parsed.
    pair.check(messages, ours=_string_arguments(messages), tools=[WEATHER],
               add_generation_prompt=True)


def test_phi4_mini_tools_in_the_system_message(pairs: dict[str, Pair]) -> None:
    system = {**SYSTEM, "tools": json.dumps([WEATHER["function"]])}
    text = pairs["phi4-mini"].check([system, USER], add_generation_prompt=True)
    assert "<|tool|>[{" in text and "<|/tool|>" in text


# Templates that ignore the `tools` variable get nbserve's own tool prompt (Hermes format,
# text/tool_prompt.py), which transformers does not write: these check where it goes.


@pytest.mark.parametrize("family", ["gemma2", "mixtral"])
def test_tool_prompt_fits_a_template_without_a_system_role(pairs: dict[str, Pair],
                                                           family: str) -> None:
    """nbserve's tool list goes where the template can take it (the first user turn), not in a
    system message the template refuses; the rest renders as transformers renders it."""
    from nbserve.text.tool_prompt import tools_section

    pair = pairs[family]
    assert pair.template.ignores_tools
    folded = [{"role": "user", "content": tools_section([WEATHER]) + "\n\n" + USER["content"]}]
    pair.check(folded, ours=[USER], tools=[WEATHER], add_generation_prompt=True)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mixtral", "phi3-mini", "olmo2"])
def test_tool_results_reach_a_template_without_a_tool_role(pairs: dict[str, Pair],
                                                           family: str) -> None:
    """A template that refuses or drops `tool` messages gets nbserve's tool results as a user
    turn, so the model sees them."""
    pair = pairs[family]
    second = {"role": "tool", "tool_call_id": "call_2", "content": "rain tomorrow"}
    text, _ = pair.ours([USER, CALL, RESULT, second], tools=[WEATHER],
                        add_generation_prompt=True)
    assert RESULT["content"] in text and "rain tomorrow" in text
    assert '"name": "get_weather"' in text  # the earlier call, in the assistant turn
    assert text.index("get_weather\", \"arguments\"") < text.index(RESULT["content"])


def test_template_sees_the_special_tokens_transformers_passes(
        tmp_path: Path) -> None:
    """Every named special token of tokenizer_config.json is a template variable, as in
    transformers (Gemma 3 names boi/eoi/image_token; sep/cls/mask are standard names)."""
    import dataclasses

    names = ["bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
             "mask_token", "boi_token", "eoi_token", "image_token"]
    probe = "|".join(f"{{{{ {n} if {n} is defined else '-' }}}}" for n in names)
    family = dataclasses.replace(FAMILIES["gemma3"], template=probe, extra={
        **FAMILIES["gemma3"].extra, "sep_token": "<eos>", "mask_token": "<pad>"})
    text = Pair(family, make_family_dir(tmp_path / "g", family)).check([USER])
    assert "<start_of_image>" in text and "<pad>|<eos>|-|<pad>" in text


def test_template_globals_match_transformers(tmp_path: Path) -> None:
    """The helpers transformers gives templates behave the same here: dict() and
    dict.fromkeys, namespace, tojson with its options, raise_exception's message."""
    import dataclasses

    probe = ("{% set d = dict(a=1, b=[2, 3]) %}{{ d | tojson }}|"
             "{{ dict.fromkeys(['x', 'y'], 0) | tojson(indent=2, sort_keys=true) }}|"
             "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
             "{% endfor %}{{ ns.n }}|{{ messages | tojson(separators=(',', ':')) }}|"
             "{{ 'é<&>' | tojson }}{% if messages | length > 1 %}"
             "{{ raise_exception('only one message, please') }}{% endif %}")
    family = dataclasses.replace(FAMILIES["qwen3"], template=probe)
    pair = Pair(family, make_family_dir(tmp_path / "q", family))
    pair.check([USER])
    with pytest.raises(InvalidRequestError, match="only one message, please"):
        pair.ours([USER, ANSWER])


# ----------------------------------------------------------------------------- thinking


REASONED = {"role": "assistant", "content": "Paris.", "reasoning_content": THOUGHT}
INLINE = {"role": "assistant", "content": f"<think>\n{THOUGHT}\n</think>\n\nParis."}
CALL_REASONED = {**CALL, "reasoning_content": "I should look up the weather."}

THINKING_CASES: dict[str, list[dict[str, Any]]] = {
    "user": [USER],
    "system+multi-turn": [SYSTEM, USER, ANSWER, USER_2],
    "earlier-reasoning": [USER, REASONED, USER_2],
    "inline-think": [USER, INLINE, USER_2],
    "reasoning-last": [USER, REASONED],
    "reasoning-alias": [USER, {"role": "assistant", "content": "Paris.", "reasoning": THOUGHT}],
    "tool-step-after-query": [USER, CALL_REASONED, RESULT],
}


@pytest.mark.parametrize("family", _families(thinking=True))
@pytest.mark.parametrize("case", list(THINKING_CASES))
@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_thinking_switch_renders_as_transformers(pairs: dict[str, Pair], family: str, case: str,
                                                 enable_thinking: bool | None,
                                                 add_generation_prompt: bool) -> None:
    kw: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    messages = THINKING_CASES[case]
    tools = [WEATHER] if case.startswith("tool") else None
    pairs[family].check(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                        **kw)


def test_qwen3_thinking_off_closes_an_empty_thought(pairs: dict[str, Pair]) -> None:
    text = pairs["qwen3"].check([USER], add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("system", ["Be brief. /no_think", "Think hard. /think",
                                    "Only this. /system_override"])
@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_smollm3_system_flags(pairs: dict[str, Pair], system: str,
                              enable_thinking: bool | None) -> None:
    kw: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    messages = [{"role": "system", "content": system}, USER, ANSWER, USER_2]
    pairs["smollm3"].check(messages, add_generation_prompt=True, **kw)


# ----------------------------------------------------------------------------- stop tokens


def _stop_ids(tok: Tokenizer, family: Family) -> set[int]:
    """The tiny ids of the tokens the family's generation_config.json lists."""
    ids = [tok.token_to_id(t) for t in family.stop]
    assert None not in ids
    return {i for i in ids if i is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tokenizer_stops_on_every_generation_config_eos(pairs: dict[str, Pair],
                                                        family: str) -> None:
    pair = pairs[family]
    generation = json.loads((pair.path / "generation_config.json").read_text())
    listed = generation["eos_token_id"]
    listed = set(listed if isinstance(listed, list) else [listed])
    assert listed == _stop_ids(pair.tokenizer, pair.family)
    assert listed <= set(pair.tokenizer.eos_token_ids)
    assert listed <= pair.tokenizer.special_ids  # skipped when decoding the answer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-models")
    return {name: make_family_model_dir(root / name, f) for name, f in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loaded_model_stops_on_every_end_of_turn(model_dirs: dict[str, Path],
                                                 family: str) -> None:
    from nbserve.loading.hf_dir import load_hf_dir

    loaded = load_hf_dir(model_dirs[family])
    stop = set(loaded.stop_token_ids)
    assert _stop_ids(loaded.tokenizer, FAMILIES[family]) <= stop
    eos = loaded.tokenizer.token_to_id(FAMILIES[family].tokens["eos_token"])
    assert eos in stop
    assert loaded.template is not None and loaded.template.source == FAMILIES[family].template


# ----------------------------------------------------------------------------- through the API


def _error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return err


def test_gemma2_system_message_is_a_400(model_dirs: dict[str, Path]) -> None:
    with engine_running(model_dirs["gemma2"]) as engine, app_running(engine) as url:
        body = {"messages": [SYSTEM, USER], "max_tokens": 2}
        err = _error(httpx.post(url + "/v1/chat/completions", json=body))
        assert "System role not supported" in err["message"] and err["param"] == "messages"
        assert "at the start of the first user message" in err["message"]  # what to do
        err = _error(httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}))
        assert "System role not supported" in err["message"]
        err = _error(httpx.post(url + "/tokenize", json={"messages": [SYSTEM, USER]}))
        assert "System role not supported" in err["message"]
        ok = httpx.post(url + "/v1/chat/completions",
                        json={"messages": [USER], "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_tokenize_endpoint_matches_transformers(pairs: dict[str, Pair],
                                                model_dirs: dict[str, Path]) -> None:
    """The API path (OpenAI messages with JSON-string arguments, chat_template_kwargs) gives
    the ids transformers gives for the same conversation."""
    cases = [("qwen3", [SYSTEM, USER, CALL, RESULT], [WEATHER], {"enable_thinking": False}),
             ("gemma3", [SYSTEM, USER, ANSWER, USER_2], None, {}),
             ("llama3.2", [USER, CALL, RESULT], [WEATHER], {})]
    for family, messages, tools, kwargs in cases:
        _, want = pairs[family].reference(messages, tools=tools, add_generation_prompt=True,
                                          **kwargs)
        with engine_running(model_dirs[family]) as engine, app_running(engine) as url:
            body: dict[str, Any] = {"messages": _string_arguments(messages),
                                    "chat_template_kwargs": kwargs}
            if tools:
                body["tools"] = tools
            resp = httpx.post(url + "/tokenize", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["tokens"] == want, family
