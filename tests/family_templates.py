"""Real chat templates and special tokens of the model families nbserve serves, as data, and
tiny Hugging Face directories that carry them.

Each template is quoted verbatim from the model's own tokenizer_config.json (or
chat_template.jinja), as copied into public repositories that mirror it; the comment above
each says which model and where it was read. `make_family_dir` writes a tokenizer directory
(tokenizer.json, tokenizer_config.json, generation_config.json, optionally
chat_template.jinja) whose tokenizer is the tiny byte-level BPE of `tiny_models` (or its
sentencepiece-style sibling) plus the family's added tokens, so transformers and nbserve can be
compared on the same files. `make_family_model_dir` adds a tiny random Llama for loader checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiny_models import (
    LLAMA32_TEMPLATE,
    make_byte_fallback_tokenizer,
    make_tiny_hf_dir,
    make_tiny_tokenizer,
)
from tokenizers import AddedToken, Tokenizer, processors

# ----------------------------------------------------------------------------- templates

# Qwen3 (hybrid thinking): Qwen/Qwen3-8B's tokenizer_config.json, the current template of the
# Qwen3 dense and MoE checkpoints. Read from guidance-ai/guidance, guidance/chat.py
# (qwen3_it_template, commit 5413339), which cites
# https://huggingface.co/Qwen/Qwen3-8B/blob/main/tokenizer_config.json#L230.
QWEN3_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML "
    "tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) "
    "%}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is "
    "string and not(message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = "
    "content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + "
    "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n"
    "                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)

# Qwen/Qwen3-0.6B as first released (April 2025; no `content is string` guards yet). Read from
# huggingface/huggingface.js, packages/jinja/test/e2e.test.js ("Qwen/Qwen3-0.6B", commit
# fe42e68).
QWEN3_0_6B_APRIL_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML "
    "tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) "
    "%}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and "
    "not(message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set content = message.content %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is defined and message.reasoning_content "
    "is not none %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in message.content %}\n"
    "                {%- set content = message.content.split('</think>')[-1].lstrip('\\n')"
    " %}\n"
    "                {%- set reasoning_content = "
    "message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') "
    "%}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + "
    "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n"
    "                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)

# Gemma 3: google/gemma-3-1b-it's template (gemma-3-4b-it and 12b-it carry the same text). No
# system role: a system message becomes the start of the first user turn. Read from the Hub
# API's gguf.chat_template of ggml-org/gemma-3-1b-it-GGUF (converted from google/gemma-3-1b-it)
# as captured in a public session log, and the google/gemma-3-4b-it copy in a public Rust test
# of a chat-template port ("output checked against python transformers"); both read the same.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n"
    "\n"
    "' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n"
    "\n"
    "' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n"
    "' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n"
    "' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n"
    "'}}\n"
    "{%- endif -%}\n"
)

# Gemma 2: google/gemma-2-9b-it's tokenizer_config.json (gemma-2-2b-it ships the same text);
# raises on a system message. Read from guidance-ai/guidance, guidance/chat.py
# (gemma2_9b_it_template), which cites
# https://huggingface.co/google/gemma-2-9b-it/blob/main/tokenizer_config.json#L1747; the same
# text is in oxide-lab/Oxide-Lab, src-tauri/src/core/templates/gemma2.rs.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System "
    "role not supported') }}{% endif %}{% for message in messages %}{% if "
    "(message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% "
    "endif %}{{ '<start_of_turn>' + role + '\n"
    "' + message['content'] | trim + '<end_of_turn>\n"
    "' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n"
    "'}}{% endif %}"
)

# Phi-4-mini: microsoft/Phi-4-mini-instruct's tokenizer_config.json. Tools go in the system
# message's `tools` field (a JSON string), not in the `tools` variable. Read from
# guidance-ai/guidance, guidance/chat.py (phi_4_mini_template, dated 06/16/25), which cites
# https://huggingface.co/microsoft/Phi-4-mini-instruct/blob/main/tokenizer_config.json#L104.
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in "
    "message and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% "
    "else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif "
    "%}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ "
    "eos_token }}{% endif %}"
)

# Phi-3-mini: microsoft/Phi-3-mini-4k-instruct's tokenizer_config.json. Read from
# guidance-ai/guidance, guidance/chat.py (phi3_mini_template), which cites
# https://huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/tokenizer_config.json#L119.
PHI3_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n"
    "' + message['content'] + '<|end|>\n"
    "'}}{% elif message['role'] == 'user' %}{{'<|user|>\n"
    "' + message['content'] + '<|end|>\n"
    "'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n"
    "' + message['content'] + '<|end|>\n"
    "'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n"
    "' }}{% else %}{{ eos_token }}{% endif %}"
)

# SmolLM3: HuggingFaceTB/SmolLM3-3B's chat_template.jinja (/think and /no_think in the system
# message, enable_thinking, xml_tools/python_tools, a {% generation %} block). Read from
# huggingface/huggingface.js, packages/jinja/test/e2e.test.js ("HuggingFaceTB/SmolLM3-3B").
SMOLLM3_TEMPLATE = (
    "{# ───── defaults ───── #}\n"
    "{%- if enable_thinking is not defined -%}\n"
    "{%- set enable_thinking = true -%}\n"
    "{%- endif -%}\n"
    "\n"
    "{# ───── reasoning mode ───── #}\n"
    "{%- if enable_thinking -%}\n"
    "  {%- set reasoning_mode = \"/think\" -%}\n"
    "{%- else -%}\n"
    "  {%- set reasoning_mode = \"/no_think\" -%}\n"
    "{%- endif -%}\n"
    "\n"
    "{# ───── header (system message) ───── #}\n"
    "{{- \"<|im_start|>system\\n\" -}}\n"
    "\n"
    "{%- if messages[0].role == \"system\" -%}\n"
    "  {%- set system_message = messages[0].content -%}\n"
    "  {%- if \"/no_think\" in system_message -%}\n"
    "    {%- set reasoning_mode = \"/no_think\" -%}\n"
    "  {%- elif \"/think\" in system_message -%}\n"
    "    {%- set reasoning_mode = \"/think\" -%}\n"
    "  {%- endif -%}\n"
    "  {%- set custom_instructions = system_message.replace(\"/no_think\", "
    "\"\").replace(\"/think\", \"\").rstrip() -%}\n"
    "{%- endif -%}\n"
    "\n"
    "{%- if \"/system_override\" in system_message -%}\n"
    "  {{- custom_instructions.replace(\"/system_override\", \"\").rstrip() -}}\n"
    "  {{- \"<|im_end|>\\n\" -}}\n"
    "{%- else -%}\n"
    "  {{- \"## Metadata\\n\\n\" -}}\n"
    "  {{- \"Knowledge Cutoff Date: June 2025\\n\" -}}\n"
    "  {%- set today = strftime_now(\"%d %B %Y\") -%}\n"
    "  {{- \"Today Date: \" ~ today ~ \"\\n\" -}}\n"
    "  {{- \"Reasoning Mode: \" + reasoning_mode + \"\\n\\n\" -}}\n"
    "  \n"
    "  {{- \"## Custom Instructions\\n\\n\" -}}\n"
    "  {%- if custom_instructions -%}\n"
    "    {{- custom_instructions + \"\\n\\n\" -}}\n"
    "  {%- elif reasoning_mode == \"/think\" -%}\n"
    "    {{- \"You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your "
    "role as an assistant involves thoroughly exploring questions through a systematic "
    "thinking process before providing the final precise and accurate solutions. This "
    "requires engaging in a comprehensive cycle of analysis, summarizing, exploration, "
    "reassessment, reflection, backtracking, and iteration to develop well-considered "
    "thinking process. Please structure your response into two main sections: Thought "
    "and Solution using the specified format: <think> Thought section </think> Solution "
    "section. In the Thought section, detail your reasoning process in steps. Each step "
    "should include detailed considerations such as analysing questions, summarizing "
    "relevant findings, brainstorming new ideas, verifying the accuracy of the current "
    "steps, refining any errors, and revisiting previous steps. In the Solution section, "
    "based on various attempts, explorations, and reflections from the Thought section, "
    "systematically present the final solution that you deem correct. The Solution "
    "section should be logical, accurate, and concise and detail necessary steps needed "
    "to reach the conclusion.\\n\\n\" -}}\n"
    "  {%- else -%}\n"
    "    {{- \"You are a helpful AI assistant named SmolLM, trained by Hugging Face.\\n\\n\" "
    "-}}\n"
    "  {%- endif -%}\n"
    "\n"
    "  {%- if xml_tools or python_tools or tools -%}\n"
    "    {{- \"### Tools\\n\\n\" -}}\n"
    "    {%- if xml_tools or tools -%}\n"
    "      {%- if tools -%}\n"
    "        {%- set xml_tools = tools -%}\n"
    "      {%- endif -%}\n"
    "      {%- set ns = namespace(xml_tool_string=\"You may call one or more functions to "
    "assist with the user query.\\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\\n\\n<tools>\\n\") -%}\n"
    "      {%- for tool in xml_tools[:] -%} {# The slicing makes sure that xml_tools is "
    "a list #}\n"
    "        {%- set ns.xml_tool_string = ns.xml_tool_string ~ (tool | string) ~ \"\\n\" "
    "-%}\n"
    "      {%- endfor -%}\n"
    "      {%- set xml_tool_string = ns.xml_tool_string + \"</tools>\\n\\nFor each function "
    "call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call>\" -%}\n"
    "      {{- xml_tool_string -}}\n"
    "    {%- endif -%}\n"
    "    {%- if python_tools -%}\n"
    "      {%- set ns = namespace(python_tool_string=\"When you send a message containing "
    "Python code between '<code>' and '</code>' tags, it will be executed in a stateful "
    "Jupyter notebook environment, and you will then be given the output to continued "
    "reasoning in an agentic loop.\\n\\nYou can use the following tools in your python "
    "code like regular functions:\\n<tools>\\n\") -%}\n"
    "      {%- for tool in python_tools[:] -%} {# The slicing makes sure that "
    "python_tools is a list #}\n"
    "        {%- set ns.python_tool_string = ns.python_tool_string ~ (tool | string) ~ "
    "\"\\n\" -%}\n"
    "      {%- endfor -%}\n"
    "      {%- set python_tool_string = ns.python_tool_string + \"</tools>\\n\\nThe state "
    "persists between code executions: so variables that you define in one step are "
    "still available thereafter.\" -%}\n"
    "      {{- python_tool_string -}}\n"
    "    {%- endif -%}\n"
    "    {{- \"\\n\\n\" -}}\n"
    "    {{- \"<|im_end|>\\n\" -}}\n"
    "  {%- endif -%}\n"
    "{%- endif -%}\n"
    "{# ───── main loop ───── #}\n"
    "{%- for message in messages -%}\n"
    "    {%- set content = message.content if message.content is string else \"\" -%}\n"
    "    {%- if message.role == \"user\" -%}\n"
    "        {{ \"<|im_start|>\" + message.role + \"\\n\"  + content + \"<|im_end|>\\n\" }}\n"
    "    {%- elif message.role == \"assistant\" -%}\n"
    "        {% generation %}\n"
    "        {%- if reasoning_mode == \"/think\" -%}\n"
    "            {{ \"<|im_start|>assistant\\n\" + content.lstrip(\"\\n\") + \"<|im_end|>\\n\" }}\n"
    "        {%- else -%}\n"
    "            {{ \"<|im_start|>assistant\\n\" + \"<think>\\n\\n</think>\\n\" + "
    "content.lstrip(\"\\n\") + \"<|im_end|>\\n\" }}\n"
    "        {%- endif -%}\n"
    "        {% endgeneration %}\n"
    "    {%- elif message.role == \"tool\" -%}\n"
    "    {{ \"<|im_start|>\" + \"user\\n\"  + content + \"<|im_end|>\\n\" }}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{# ───── generation prompt ───── #}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {%- if reasoning_mode == \"/think\" -%}\n"
    "        {{ \"<|im_start|>assistant\\n\" }}\n"
    "    {%- else -%}\n"
    "        {{ \"<|im_start|>assistant\\n\" + \"<think>\\n\\n</think>\\n\"  }}\n"
    "    {%- endif -%}\n"
    "{%- endif -%}"
)

# OLMo 2 Instruct: the Tülu 3 format with bos_token, as public code quotes it for
# allenai/OLMo-2-1124-7B (and OLMo-2-1124-7B-SFT's tokenizer_config.json) and sets it for
# allenai/OLMo-2-0425-1B; not read from the OLMo-2-0425-1B-Instruct repository itself.
OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ "
    "'<|system|>\n"
    "' + message['content'] + '\n"
    "' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n"
    "' + message['content'] + '\n"
    "' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ "
    "'<|assistant|>\n"
    "'  + message['content'] + eos_token + '\n"
    "' }}{% else %}{{ '<|assistant|>\n"
    "'  + message['content'] + eos_token }}{% endif %}{% endif %}{% if loop.last and "
    "add_generation_prompt %}{{ '<|assistant|>\n"
    "' }}{% endif %}{% endfor %}"
)

# Mixtral: mistralai/Mixtral-8x7B-Instruct-v0.1's tokenizer_config.json; user/assistant only.
# Read from huggingface/huggingface.js, packages/jinja/test/e2e.test.js; the same text is
# guidance/chat.py's mistral_7b_instruct_llamacpp_template.
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' "
    "%}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only "
    "user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Llama 3.2 Instruct's template is tiny_models.LLAMA32_TEMPLATE (the same text as
# guidance/chat.py's llama3dot2_template, checked when this module was written).


# ----------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """What a tiny stand-in for one model family needs: its template, its added tokens, the
    special-token strings of its tokenizer_config.json, and the end-of-turn tokens its
    generation_config.json lists (the real ids are in the comments; the tiny ones differ)."""

    name: str
    template: str
    specials: tuple[str, ...]  # added tokens marked special (besides the tiny BPE's own three)
    tokens: dict[str, str | None]  # tokenizer_config.json bos/eos/pad/unk (None: null)
    stop: tuple[str, ...]  # generation_config.json eos_token_id, as token strings
    plain: tuple[str, ...] = ()  # added tokens that are not special (<think>, <tool_call>)
    config_eos: tuple[str, ...] = ()  # config.json eos_token_id (model dirs only)
    bos_post: str | None = None  # token the tokenizer.json post-processor puts first
    add_bos_token: bool | None = None
    jinja_file: bool = False  # template in chat_template.jinja instead of tokenizer_config
    sentencepiece: bool = False  # the ▁ / <0xAB> byte-fallback tokenizer instead of GPT-2 BPE
    system: bool = True  # the template takes a system message
    tools: bool = False  # the template reads the `tools` variable
    thinking: bool = False  # the template has an enable_thinking switch
    extra: dict[str, Any] = field(default_factory=dict)  # more tokenizer_config.json keys


_QWEN_PLAIN = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
               "</think>")
_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
_GEMMA_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                 "unk_token": "<unk>"}
_LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")

FAMILIES: dict[str, Family] = {f.name: f for f in [
    # Qwen3: generation_config eos_token_id [151645 <|im_end|>, 151643 <|endoftext|>],
    # config.json 151645; tokenizer_config bos_token null. Qwen3-MoE shares all of it.
    Family("qwen3", QWEN3_TEMPLATE, specials=(),
           tokens={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "unk_token": None},
           stop=("<|im_end|>", "<|endoftext|>"), plain=_QWEN_PLAIN, config_eos=("<|im_end|>",),
           tools=True, thinking=True),
    Family("qwen3-0.6b-april", QWEN3_0_6B_APRIL_TEMPLATE, specials=(),
           tokens={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "unk_token": None},
           stop=("<|im_end|>", "<|endoftext|>"), plain=_QWEN_PLAIN, config_eos=("<|im_end|>",),
           tools=True, thinking=True),
    # Gemma 3: <start_of_turn> 105, <end_of_turn> 106; generation_config and config.json
    # eos_token_id [1 <eos>, 106 <end_of_turn>]; the tokenizer adds <bos>.
    # Its tokenizer_config.json also names the image tokens (boi/eoi/image_token).
    Family("gemma3", GEMMA3_TEMPLATE,
           specials=(*_GEMMA_SPECIALS, "<start_of_image>", "<end_of_image>", "<image_soft_token>"),
           tokens=_GEMMA_TOKENS, stop=("<eos>", "<end_of_turn>"),
           config_eos=("<eos>", "<end_of_turn>"), bos_post="<bos>", add_bos_token=True,
           extra={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                  "image_token": "<image_soft_token>"}),
    # Gemma 2: <start_of_turn> 106, <end_of_turn> 107; eos_token_id [1, 107].
    Family("gemma2", GEMMA2_TEMPLATE, specials=_GEMMA_SPECIALS, tokens=_GEMMA_TOKENS,
           stop=("<eos>", "<end_of_turn>"), config_eos=("<eos>", "<end_of_turn>"),
           bos_post="<bos>", add_bos_token=True, system=False),
    # Phi-4-mini: <|endoftext|> 199999, <|end|> 200020; generation_config eos_token_id
    # [200020, 199999], config.json 199999.
    Family("phi4-mini", PHI4_MINI_TEMPLATE,
           specials=("<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>",
                     "<|/tool|>", "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>"),
           tokens={"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
           stop=("<|end|>", "<|endoftext|>"), config_eos=("<|endoftext|>",)),
    # Phi-3-mini (Llama-2 sentencepiece vocabulary): <|endoftext|> 32000, <|assistant|> 32001,
    # <|end|> 32007; generation_config eos_token_id [32000, 32001, 32007], config.json 32000.
    Family("phi3-mini", PHI3_MINI_TEMPLATE,
           specials=("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"),
           tokens={"bos_token": "<s>", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "unk_token": "<unk>"},
           stop=("<|endoftext|>", "<|assistant|>", "<|end|>"), config_eos=("<|endoftext|>",),
           sentencepiece=True, add_bos_token=False),
    # Llama 3.2 Instruct: generation_config eos_token_id [128001 <|end_of_text|>,
    # 128008 <|eom_id|>, 128009 <|eot_id|>]; tokenizer_config eos_token <|eot_id|>.
    Family("llama3.2", LLAMA32_TEMPLATE, specials=_LLAMA3_SPECIALS,
           tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                   "pad_token": None, "unk_token": None},
           stop=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
           config_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
           bos_post="<|begin_of_text|>", tools=True),
    # SmolLM3-3B: <|im_start|> 128011, <|im_end|> 128012; generation_config and config.json
    # eos_token_id 128012. Its template ships as chat_template.jinja.
    Family("smollm3", SMOLLM3_TEMPLATE, specials=("<|begin_of_text|>", "<|end_of_text|>"),
           tokens={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                   "unk_token": None},
           stop=("<|im_end|>",), plain=_QWEN_PLAIN, config_eos=("<|im_end|>",),
           jinja_file=True, tools=True, thinking=True),
    # OLMo 2 Instruct (dolma2 tokenizer): <|endoftext|> 100257 is bos and eos, <|pad|> 100277;
    # eos_token_id 100257.
    Family("olmo2", OLMO2_TEMPLATE, specials=("<|pad|>",),
           tokens={"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                   "pad_token": "<|pad|>", "unk_token": None},
           stop=("<|endoftext|>",), config_eos=("<|endoftext|>",)),
    # Mixtral-8x7B-Instruct-v0.1 (Llama-2 sentencepiece vocabulary): <s> 1, </s> 2;
    # eos_token_id 2. Its template refuses a system message.
    Family("mixtral", MIXTRAL_TEMPLATE, specials=(),
           tokens={"bos_token": "<s>", "eos_token": "</s>", "pad_token": None,
                   "unk_token": "<unk>"},
           stop=("</s>",), config_eos=("</s>",), bos_post="<s>", add_bos_token=True,
           sentencepiece=True, system=False),
]}


# ----------------------------------------------------------------------------- directories


def family_tokenizer(family: Family) -> Tokenizer:
    """The tiny tokenizer with `family`'s added tokens (appended after the trained vocabulary)
    and, where the real one has it, a post-processor that puts BOS first."""
    tok = make_byte_fallback_tokenizer() if family.sentencepiece else make_tiny_tokenizer()
    new = [t for t in family.specials if tok.token_to_id(t) is None]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain
                    if tok.token_to_id(t) is None])
    if family.bos_post:
        bos_id = tok.token_to_id(family.bos_post)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos_post} $A", pair=f"{family.bos_post} $A $B",
            special_tokens=[(family.bos_post, bos_id)])
    return tok


def _ids(tok: Tokenizer, names: tuple[str, ...]) -> int | list[int] | None:
    ids = [tok.token_to_id(t) for t in names]
    assert None not in ids, f"{names} not all in the tokenizer"
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _write_tokenizer_files(path: Path, family: Family, tok: Tokenizer) -> None:
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **family.tokens,
                              "clean_up_tokenization_spaces": False, "model_max_length": 4096,
                              **family.extra}
    if family.add_bos_token is not None:
        config["add_bos_token"] = family.add_bos_token
    if family.jinja_file:
        (path / "chat_template.jinja").write_text(family.template, encoding="utf-8")
    else:
        config["chat_template"] = family.template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    bos = family.tokens.get("bos_token")
    generation = {"bos_token_id": tok.token_to_id(bos) if bos else None,
                  "eos_token_id": _ids(tok, family.stop)}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))


def make_family_dir(path: str | Path, family: Family) -> Path:
    """A tokenizer-only Hugging Face directory for `family` (enough for AutoTokenizer and for
    nbserve's tokenizer and template loading)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer_files(path, family, family_tokenizer(family))
    return path


def make_family_model_dir(path: str | Path, family: Family, **overrides: Any) -> Path:
    """`make_family_dir` plus a tiny random Llama whose embedding covers the added tokens and
    whose config.json names the family's eos ids."""
    tok = family_tokenizer(family)
    eos = _ids(tok, family.config_eos)
    bos = family.tokens.get("bos_token")
    overrides.setdefault("num_hidden_layers", 1)
    path = make_tiny_hf_dir(path, arch="llama", vocab_size=tok.get_vocab_size(),
                            bos_token_id=tok.token_to_id(bos) if bos else None,
                            eos_token_id=eos, **overrides)
    _write_tokenizer_files(path, family, tok)  # replaces the tiny ChatML files
    return path
