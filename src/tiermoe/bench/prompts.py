"""Prompt material for the benchmarks: fresh random text of a target token length, filler with a
needle, story requests, and the built-in quality-panel prompts.

Prefill must be measured on text the server has never seen, or a prefix cache turns the
measurement into a lookup; every random prompt therefore starts with a fresh nonce and draws
its words from a seeded RNG. Token lengths are calibrated against the server's own /tokenize
when it has one (the only exact count for an unknown tokenizer), else estimated at 4 characters
per token.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

CHARS_PER_TOKEN_ESTIMATE = 4.0

_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education river stone garden lamp "
    "window bridge engine signal harbor valley forest copper silver orange purple quiet rapid "
    "gentle bright hollow narrow ancient modern simple heavy light early late open closed north "
    "south east west winter summer autumn spring metal glass paper cloth bread salt honey pepper "
    "market ticket letter number planet orbit comet ocean island desert canyon meadow thunder "
    "falcon otter badger heron maple cedar willow marble granite velvet canvas lantern compass "
    "anchor harvest festival journey shadow whisper echo ripple ember frost pebble"
).split()

STORY_TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint",
    "two rival bakers in a small town",
    "a cartographer mapping an island that keeps changing",
    "a child who can talk to birds",
    "an astronaut stranded on a quiet moon",
    "a violin that plays by itself at night",
    "a detective who solves crimes with smells",
)

PANEL_PROMPTS = (
    "The capital of France is",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.\n\ndef fib(n):",
    "List three uses of copper:\n1.",
    "Translate to German: 'The weather is nice today.'\nGerman:",
    "Q: What is 12 times 12?\nA:",
    "Once upon a time, in a village at the edge of a forest,",
    "The three laws of thermodynamics are",
)

CountFn = Callable[[str], Awaitable[int | None]]


def random_text(rng: random.Random, n_words: int) -> str:
    """`n_words` random words behind a fresh nonce, with a number every ~8 words."""
    nonce = f"[{rng.getrandbits(64):016x}]"
    parts = [nonce]
    for _ in range(max(n_words, 1)):
        if rng.random() < 0.12:
            parts.append(str(rng.randint(10, 9999)))
        else:
            parts.append(rng.choice(_WORDS))
    return " ".join(parts)


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN_ESTIMATE))


async def sized_random_text(
    rng: random.Random, n_tokens: int, count: CountFn | None, tolerance: float = 0.02
) -> tuple[str, int, str]:
    """Random text of about `n_tokens` tokens: (text, token count, "tokenize" | "estimate").

    With a counting function (the server's /tokenize) the word count is rescaled until the
    text is within `tolerance` of the target (at most five rounds). A tokenizer that spends
    several tokens on a word can keep whole-word texts outside the tolerance, so the last step
    bisects the character length of a text known to be too long. Without a counting function the
    length comes from the chars-per-token estimate.
    """
    words = max(1, round(n_tokens / 1.4))
    seed = rng.getrandbits(64)
    allowed = max(1, tolerance * n_tokens)
    counted: int | None = None
    text = ""
    longest: tuple[str, int] | None = None  # a counted text with more tokens than the target
    rounds = halvings = 0
    while rounds < 5:
        text = random_text(random.Random(seed), words)  # same words, different length
        counted = await count(text) if count is not None else None
        if counted is None:
            # A server may refuse to count a text longer than its context window (a tokenizer with
            # many tokens per word makes the first guess too long): halve it until one is counted.
            if count is not None and halvings < 8 and words > 1:
                words, halvings = max(1, words // 2), halvings + 1
                continue
            break
        rounds += 1
        if abs(counted - n_tokens) <= allowed:
            return text, counted, "tokenize"
        if counted > n_tokens and (longest is None or counted < longest[1]):
            longest = (text, counted)
        words = max(1, round(words * n_tokens / max(counted, 1)))
    if count is not None and counted is not None:
        if longest is None:  # every count fell short: one longer text gives the bisection its top
            long_text = random_text(random.Random(seed), 2 * words + 2)
            long_count = await count(long_text)
            if long_count is not None and long_count > n_tokens:
                longest = (long_text, long_count)
        if longest is not None:
            return await _bisect_characters(longest[0], n_tokens, count)
        return text, counted, "tokenize"
    # No tokenizer on the server: size by the character estimate.
    words = max(1, round(n_tokens * CHARS_PER_TOKEN_ESTIMATE / 6.2))
    text = random_text(random.Random(seed), words)
    scale = n_tokens * CHARS_PER_TOKEN_ESTIMATE / max(len(text), 1)
    text = random_text(random.Random(seed), max(1, round(words * scale)))
    return text, estimate_tokens(text), "estimate"


async def _bisect_characters(long_text: str, n_tokens: int, count: CountFn) -> tuple[str, int, str]:
    """The prefix of `long_text` whose token count is nearest `n_tokens` (a prefix's count grows
    with its length, give or take a merge at the cut): about log2(len) counting calls."""
    best_text, best_count = long_text, await count(long_text)
    lo, hi = 1, len(long_text)
    while lo <= hi:
        mid = (lo + hi) // 2
        prefix = long_text[:mid].rstrip() or long_text[:mid]
        counted = await count(prefix)
        if counted is None:
            hi = mid - 1
            continue
        if best_count is None or abs(counted - n_tokens) < abs(best_count - n_tokens):
            best_text, best_count = prefix, counted
        if counted == n_tokens:
            break
        if counted < n_tokens:
            lo = mid + 1
        else:
            hi = mid - 1
    return best_text, best_count if best_count is not None else estimate_tokens(best_text), "tokenize"


_FILLER_SENTENCES = (
    "The harbor master logged {n} boats arriving before noon, each with a routine cargo.",
    "In report {n}, the weather over the valley stayed mild and nothing unusual happened.",
    "Inventory line {n} lists copper wire, glass jars, and a crate of dried pepper.",
    "The archive clerk filed letter {n} under general correspondence without comment.",
    "Train {n} left the northern station on time and reached the coast by evening.",
    "Garden plot {n} was planted with maple saplings and watered twice that week.",
)


def filler_text(n_sentences: int, start: int = 0) -> str:
    """Plain, forgettable sentences; numbered so no two are identical."""
    out = []
    for i in range(start, start + n_sentences):
        out.append(_FILLER_SENTENCES[i % len(_FILLER_SENTENCES)].format(n=i + 1))
    return " ".join(out)


def vault_code(rng: random.Random) -> str:
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    return f"{rng.randint(1000, 9999)}-{rng.choice(letters)}{rng.choice(letters)}{rng.randint(10, 99)}"


def needle_sentence(code: str) -> str:
    return f"IMPORTANT: the vault code is {code}. Remember this vault code."


NEEDLE_QUESTION = "What is the vault code mentioned in the text above? Reply with the code only."


async def needle_prompt(
    rng: random.Random, n_tokens: int, count: CountFn | None, depth: float
) -> tuple[str, str, int, str]:
    """Filler of about `n_tokens` tokens with the needle at `depth` (0 = start, 1 = end).

    Returns (prompt, code, token count, "tokenize" | "estimate"). The question follows the
    filler, so the prompt tests recall across the whole distance from the needle.
    """
    code = vault_code(rng)
    needle = needle_sentence(code)

    def build(n_sent: int) -> str:
        cut = round(n_sent * min(max(depth, 0.0), 1.0))
        before = filler_text(cut)
        after = filler_text(n_sent - cut, start=cut)
        body = " ".join(p for p in (before, needle, after) if p)
        return f"Read the following notes carefully.\n\n{body}\n\n{NEEDLE_QUESTION}"

    n_sent = max(1, round(n_tokens / 18))
    if count is not None:
        for _ in range(6):
            text = build(n_sent)
            counted = await count(text)
            if counted is None:
                break
            if abs(counted - n_tokens) <= max(2, 0.01 * n_tokens):
                return text, code, counted, "tokenize"
            n_sent = max(1, round(n_sent * n_tokens / max(counted, 1)))
        else:
            text = build(n_sent)
            counted = await count(text)
            if counted is not None:
                return text, code, counted, "tokenize"
    per_sentence = max(len(build(2)) - len(build(1)), 1)
    n_sent = max(1, round(n_tokens * CHARS_PER_TOKEN_ESTIMATE / per_sentence))
    text = build(n_sent)
    return text, code, estimate_tokens(text), "estimate"


def story_request(topic_index: int, words: int = 400) -> str:
    topic = STORY_TOPICS[topic_index % len(STORY_TOPICS)]
    return f"Write a story of about {words} words about {topic}."
