"""Tokenizers and tools for the tool and environment tests, built locally (no model hub)."""

from __future__ import annotations

from rlflow.data.tokenizer import build_char_tokenizer

# Qwen 2.5's tool template, cut to what the tests read: the tools listed in the system turn, calls
# taught as <tool_call>, and consecutive tool results in one user turn of <tool_response> elements.
HERMES_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>\\nFor each function call, return a json object within <tool_call></tool_call> XML tags:\\n' }}
{{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}
{%- elif not (message.role == 'system' and loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"""

# A chat template without tools: user, assistant and system turns only; any other role is refused.
CHAT_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"""


def chat_tokenizer(template: str | None):
    """A character tokenizer whose EOS is Qwen's end of turn ``<|im_end|>`` (one token), with ``template``."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"eos_token": "<|im_end|>"})
    tok.chat_template = template
    return tok


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def lookup(key: str) -> dict:
    """Looks a key up.

    Args:
        key: what to look up.
    """
    return {"key": key, "found": [1, 2]}
