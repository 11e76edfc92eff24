"""Tiny random models saved in the real Hugging Face layout, and the chat templates tests share.

`make_tiny_tokenizer()` trains a byte-level BPE in-process; `make_tiny_hf_dir()` writes a random
`LlamaForCausalLM` / `Qwen2ForCausalLM` with that tokenizer, a ChatML template and a generation
config. Everything is deterministic: the same call gives the same files on every run.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (as in SmolLM2)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# ChatML with a default system prompt, the shape of SmolLM2-Instruct's template.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# Qwen2.5-Instruct's template: tools in the system prompt, <tool_call> / <tool_response> blocks.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama-3.2-Instruct's template: bos_token, strftime_now, tojson(indent=4), raise_exception.
LLAMA32_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# A few KB of varied text so the BPE learns real merges: prose, code, numbers, JSON, accents,
# CJK and emoji (multi-byte characters split across tokens are what the detokenizer must handle).
_CORPUS = """\
Hello, world! What is the capital of France? The capital of France is Paris.
You are a helpful AI assistant. Answer the question briefly and politely.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
It was the best of times, it was the worst of times, it was the age of wisdom.
def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0
for i in range(10):\n    print(f"step {i}: loss={0.5 / (i + 1):.4f}")
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
<tool_call>\n{"name": "search", "arguments": {"query": "tokenizers"}}\n</tool_call>
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e-5 65536 0x1F600
Caf\u00e9, na\u00efve, \u00fcber, r\u00e9sum\u00e9, jalape\u00f1o, \u00c5ngstr\u00f6m, fa\u00e7ade, stra\u00dfe.
\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002\u6211\u4eec\u53bb\u516c\u56ed\u6563\u6b65\u5427\u3002\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\u3002
\u3053\u3093\u306b\u3061\u306f\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4.
Emoji: \U0001F600 \U0001F389 \U0001F680 \U0001F44D\U0001F3FD \u2764\ufe0f \U0001F1EB\U0001F1F7 \U0001F468\u200d\U0001F469\u200d\U0001F467 \u2705 \U0001F914
Symbols: \u2192 \u2190 \u2264 \u2265 \u2260 \u221e \u00b1 \u00d7 \u00f7 \u2022 \u2026 \u20ac \u00a3 \u00a5 \u00a9 \u00ae \u2122
Markdown: **bold**, _italic_, `code`, [link](https://example.com/path?q=1&r=2#frag)
- item one\n- item two\n  1. nested\n  2. list\n> a quote\n\n| a | b |\n|---|---|\n| 1 | 2 |
Whitespace:  two  spaces,\ttabs\tand\nnew lines\r\nand trailing spaces   \n
SELECT name, age FROM users WHERE age > 21 ORDER BY name LIMIT 10;
The mitochondria is the powerhouse of the cell. Photosynthesis converts light into energy.
Once upon a time, in a land far away, there lived a small dragon who loved to read books.
"""


def _corpus_lines() -> list[str]:
    lines = _CORPUS.splitlines(keepends=True)
    # Repeat with light variation so frequent pairs get merged deterministically.
    return [f"{line}" for _ in range(3) for line in lines] + [
        f"Example {i}: {w} {w.upper()} {w.capitalize()}.\n"
        for i, w in enumerate(["alpha", "beta", "gamma", "delta", "epsilon", "token", "model",
                               "serve", "stream"])
    ]


def make_tiny_tokenizer(vocab_size: int = 640) -> Tokenizer:
    """A byte-level BPE (GPT-2 / SmolLM2 style) trained in-process, specials at ids 0, 1, 2.

    Every byte is in the base alphabet, so any text round-trips. Training is deterministic.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer)
    return tok


def make_byte_fallback_tokenizer() -> Tokenizer:
    """A sentencepiece-style BPE (Llama-2 / Mistral layout): `▁` for spaces, `<0xAB>` byte tokens.

    Characters outside the small ASCII vocab come out as byte-fallback tokens, so CJK and emoji are
    spelled with `<0x..>` pieces, and the decoder strips the first leading space.
    """
    # Train merges over a fixed alphabet, then lay the vocab out like Llama-2: specials, the 256
    # byte pieces, then the trained pieces.
    alphabet = ["\u2581", *map(chr, range(33, 127)), "\u00e9", "\u597d"]  # ASCII, é, 好
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    base.train_from_iterator(_corpus_lines(), trainer)
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def _tiny_config(arch: str, vocab_size: int, tie: bool, overrides: dict[str, Any]):
    import transformers

    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "bos_token_id": IM_START_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": None,
        # Wider than the 0.02 default so logits are spread out and greedy picks are decisive.
        "initializer_range": 0.1,
    }
    kwargs.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**kwargs), transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(**kwargs), transformers.Qwen2ForCausalLM
    raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")


def make_tiny_hf_dir(path: str | Path, arch: str = "llama", tie: bool = True, *,
                     max_shard_size: str | int | None = None, seed: int = 0,
                     chat_template: str = SMOLLM2_TEMPLATE, **overrides: Any) -> Path:
    """Save a random tiny `arch` model, its tokenizer and configs into `path`; return `path`.

    `overrides` go to the transformers config (e.g. `num_hidden_layers=4`). `max_shard_size`
    (e.g. "100KB") writes a sharded checkpoint with `model.safetensors.index.json`.
    """
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer()
    config, model_cls = _tiny_config(arch, tok.get_vocab_size(), tie, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    model.generation_config.eos_token_id = [IM_END_ID]
    model.generation_config.bos_token_id = IM_START_ID
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)

    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def utf8_cut(raw: bytes) -> int:
    """How many bytes at the end of `raw` begin a UTF-8 character that they do not complete
    (what nbserve drops from an answer that max_tokens ends inside a character)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(raw)
    return len(decoder.getstate()[0])
