"""Turning a user's text into prompt token ids (offline commands: generate, eval)."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, text: str, raw: bool = False) -> list[int]:
    """The checkpoint's chat template around one user message (or the raw text when raw, or
    when the tokenizer has no template), ending with the assistant generation prompt."""
    if not raw and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer.encode(text))
