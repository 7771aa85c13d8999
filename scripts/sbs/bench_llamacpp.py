#!/usr/bin/env python3
"""`tiermoe bench ...` against llama-server: the ordinary CLI, kept as the runner's entry point.

llama-server's POST /tokenize reads {"content": ...} where vLLM and tiermoe read {"prompt": ...},
and answers {"tokens": []} for a body without it. The shared bench client
(`tiermoe.bench.client.count_tokens` / `token_ids`) sends one body that carries both dialects'
fields and takes an empty answer for non-empty text as "no tokenizer", so both engines are
measured by the same code with nothing swapped in. This script stays so that
`scripts/llamacpp_side_by_side.sh` can keep calling it.
Usage: python3 scripts/sbs/bench_llamacpp.py bench sweep --url ... (as tiermoe).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from tiermoe.cli import main as tiermoe_main

    return tiermoe_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
