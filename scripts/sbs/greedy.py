#!/usr/bin/env python3
"""Greedy completions with top logprobs from one server, and the agreement of two such files.

python3 scripts/sbs/greedy.py record URL OUT.json [--model M] [--max-tokens 32] [--top 5]
python3 scripts/sbs/greedy.py compare A.json B.json

The two engines run in turn, so agreement is measured offline: each records greedy
/v1/completions of the same raw prompts (no chat template, so no template differences) with
the top logprobs of every generated token; `compare` reports the share of identical
completions, the tokens generated identically before the first divergence, and over that
common prefix how far the chosen tokens' logprobs differ and how much the top-N sets overlap.
Both answer shapes are read (by the panel scorer's `completion_logprobs`): the legacy
completions logprobs (tokens / token_logprobs / top_logprobs, vLLM and tiermoe) and the
chat-style `logprobs.content` llama-server returns.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

from tiermoe.bench.panel import top_pairs
from tiermoe.bench.panel import completion_logprobs
from tiermoe.bench.prompts import PANEL_PROMPTS


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def normalize(choice: dict) -> list[dict]:
    """[{'token': str, 'logprob': float, 'top': {token: logprob}}] from either logprobs shape."""
    lp = completion_logprobs(choice)
    toks = lp.get("tokens") or []
    lps = lp.get("token_logprobs") or [None] * len(toks)
    tops = lp.get("top_logprobs") or [None] * len(toks)
    return [{"token": t, "logprob": lps[i], "top": dict(top_pairs(tops[i]))} for i, t in enumerate(toks)]


def record(url: str, out: str, model: str | None, max_tokens: int, top: int) -> dict:
    items = []
    for prompt in PANEL_PROMPTS:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": top}
        if model:
            body["model"] = model
        choice = _post(url.rstrip("/") + "/v1/completions", body)["choices"][0]
        items.append({"prompt": prompt, "text": choice.get("text", ""), "tokens": normalize(choice)})
    data = {"url": url, "model": model, "max_tokens": max_tokens, "top": top, "items": items}
    with open(out, "w") as f:
        json.dump(data, f, indent=1)
    return data


def compare(a: dict, b: dict) -> dict:
    same_text, prefix, total, dl, overlap = 0, 0, 0, [], []
    for x, y in zip(a["items"], b["items"]):
        same_text += x["text"] == y["text"]
        tx, ty = x["tokens"], y["tokens"]
        total += max(len(tx), len(ty))
        for p, q in zip(tx, ty):
            if p["token"] != q["token"]:
                break
            prefix += 1
            if p["logprob"] is not None and q["logprob"] is not None:
                dl.append(abs(p["logprob"] - q["logprob"]))
            if p["top"] and q["top"]:
                overlap.append(len(set(p["top"]) & set(q["top"])) / max(len(p["top"]), len(q["top"])))
    n = len(a["items"])
    return {
        "prompts": n,
        "identical_completions": same_text,
        "tokens": total,
        "tokens_before_divergence": prefix,
        "topn_overlap_on_prefix": sum(overlap) / len(overlap) if overlap else None,
        "max_abs_logprob_diff": max(dl) if dl else None,
        "mean_abs_logprob_diff": sum(dl) / len(dl) if dl else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("url")
    r.add_argument("out")
    r.add_argument("--model", default=None)
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--top", type=int, default=5)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cmd == "record":
        data = record(args.url, args.out, args.model, args.max_tokens, args.top)
        print(f"recorded {len(data['items'])} greedy completions into {args.out}")
        return 0
    with open(args.a) as fa, open(args.b) as fb:
        result = compare(json.load(fa), json.load(fb))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
