"""A small, real byte-level BPE tokenizer with a chat template, for tiny test checkpoints.

Tiny random checkpoints (`tiermoe tiny`) must be packable and servable like real ones, so they
ship a genuine tokenizer (tokenizer.json + tokenizer_config.json with a Jinja chat template)
rather than a stub. The BPE merges are trained deterministically on a fixed English corpus, so
every build gives the same ids. Byte-level BPE can encode any UTF-8 input.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
]

# Qwen-style ChatML with hermes tool calls and optional thinking.
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
        ~ 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        ~ '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        ~ '<args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- set fn = tool_call.function if tool_call.function is defined else tool_call %}
                {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
                {%- if fn.arguments is string %}
                    {{- fn.arguments }}
                {%- else %}
                    {{- fn.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for part in message.content %}
                {%- if part.type == 'text' %}
                    {{- part.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

_CORPUS = """
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of
France is Paris. Name three primary colors: red, yellow, blue. Hello! How can I help you today?
Mixture-of-Experts models route each token to a few experts out of many. The weather in Paris
is mild, 17 degrees Celsius. Please answer with only the number. 17 * 23 = 391.
{"name": "get_weather", "arguments": {"city": "Paris"}} def main(): return 0
The user asked a question; the assistant thinks, then answers clearly and briefly.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. Once upon a time there was a small robot who loved
to read stories about the sea, the stars and the mountains.
"""


def build_tokenizer(vocab_size: int = 512):
    """Return a transformers PreTrainedTokenizerFast with CHAT_TEMPLATE, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> int:
    """Write tokenizer files into out_dir; returns the tokenizer's vocabulary size."""
    tok = build_tokenizer(vocab_size)
    tok.save_pretrained(str(out_dir))
    return len(tok)
