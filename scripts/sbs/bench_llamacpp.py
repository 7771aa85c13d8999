#!/usr/bin/env python3
"""`tiermoe bench ...` against llama-server: same CLI, llama.cpp's /tokenize dialect.

The bench client calibrates prompt lengths with POST /tokenize {"prompt": ...} (vLLM's and
tiermoe's shape). llama-server reads {"content": ...} instead and answers {"tokens": []} for a
body without it, which the calibration loop would take as a zero count. This wrapper swaps in
a /tokenize call that speaks llama-server's dialect (and treats an empty answer for non-empty
text as "no tokenizer"), then runs the ordinary `tiermoe` CLI, so both engines are measured by
the same code. Usage: python3 scripts/sbs/bench_llamacpp.py bench sweep --url ... (as tiermoe).
"""

from __future__ import annotations

import sys

import httpx

from tiermoe.bench import client


async def _tokenize(c: httpx.AsyncClient, model: str, text: str, special: bool) -> dict | None:
    body = {"content": text, "add_special": special, "parse_special": special}
    try:
        resp = await c.post("/tokenize", json=body)
    except httpx.HTTPError:
        return None
    if resp.status_code >= 400:
        return None
    try:
        data = resp.json()
    except ValueError:
        return None
    toks = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(toks, list) or (text and not toks):
        return None
    return {"tokens": toks, "count": len(toks)}


def main(argv: list[str]) -> int:
    client._tokenize = _tokenize  # count_tokens / token_ids look it up at call time
    from tiermoe.cli import main as tiermoe_main

    return tiermoe_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
