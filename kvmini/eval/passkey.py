"""Passkey retrieval (D2O Table 3, DynamicKV Fig. 4): can the model still find one number hidden
in a long, dull context after its cache was compressed?

A context of `length` tokens repeats filler sentences; at `depth` (0 = start, 1 = end) one
sentence gives a five-digit passkey. The chat-formatted question comes after the context, so
it is part of the prompt that the method compresses. The assistant's turn starts with
"The passkey is" (as the usual passkey test does); the continuation is greedy-decoded
(10 tokens) and counts as correct when its first number equals the key. Keys are drawn from a seeded
generator, so a run is repeatable.

    accuracy(method, budget) = mean over (length, depth) cells of [answer == key]

The full cache's accuracy is the ceiling: a 135M model does not retrieve everywhere even
uncompressed, so every method is read against it.
"""
import random
import re

import torch

from kvmini.generate import generate
from kvmini.methods.registry import policy_for

FILLER = (
    "The lamps along the harbour were lit one by one. A cart rolled slowly over the bridge. "
    "Somewhere a dog barked twice and then was quiet. The baker set out the morning bread. "
)
QUESTION = "What is the passkey hidden in the text above? Answer with the number only."
ANSWER_START = "The passkey is"


def needle(key: int) -> str:
    return f"Remember this: the passkey is {key}. The passkey is {key}. "


def passkey_prompt(tokenizer, chat, length: int, depth: float, key: int) -> list[int]:
    """Token ids of a chat prompt of about `length` tokens with the key sentence at `depth` of the filler."""
    def render(n_filler: int) -> list[int]:
        units = [FILLER] * n_filler
        units.insert(round(depth * n_filler), needle(key))
        text = "".join(units) + "\n\n" + QUESTION
        prompt = chat.render([{"role": "user", "content": text}]) if chat else text + "\n"
        return tokenizer.encode(prompt + ANSWER_START)

    per_unit = len(tokenizer.encode(FILLER))
    base = len(render(0))
    return render(max(1, round((length - base) / per_unit)))


def answer_is(text: str, key: int) -> bool:
    """Is the first number in the answer the key?  "The passkey is 48213." -> 48213."""
    m = re.search(r"\d+", text)
    return m is not None and int(m.group()) == key


def keys_for(cells: list[tuple[int, float]], seed: int = 0) -> list[int]:
    """One five-digit key per (length, depth) cell, from a seeded generator."""
    rng = random.Random(seed)
    return [rng.randrange(10_000, 100_000) for _ in cells]


@torch.inference_mode()
def run(model, tokenizer, chat, methods: list[tuple[str, float | None]], lengths: list[int], depths: list[float],
        stop_ids: set[int], seed: int = 0, log=print) -> list[dict]:
    """One row per (method, budget, length, depth): the answer and whether it is right.

    methods: (name, budget) pairs; ("full", None) is the uncompressed cache.
    """
    cells = [(n, d) for n in lengths for d in depths]
    keys = keys_for(cells, seed)
    rows = []
    total = len(methods) * len(cells)
    for name, budget in methods:
        for (n, d), key in zip(cells, keys):
            ids = torch.tensor([passkey_prompt(tokenizer, chat, n, d, key)], device=model.device)
            policy = policy_for(name, budget)
            out = generate(model, ids, 10, stop_ids=stop_ids, policy=policy)
            text = tokenizer.decode(out.tokens[0])
            rows.append({"method": name, "budget": budget, "length": n, "depth": d, "key": key,
                         "prompt_tokens": ids.shape[1], "answer": text.strip(), "correct": answer_is(text, key),
                         "kept": sum(out.cache.lengths()) / len(out.cache)})
            shown = "" if budget is None else f" {budget:g}"
            log(f"[{len(rows)}/{total}] passkey {name}{shown} length {n} depth {d:.2f}: "
                f"{'right' if rows[-1]['correct'] else 'wrong'} ({text.strip()[:20]!r})")
    return rows


def accuracy(rows: list[dict]) -> dict:
    """(method, budget) -> fraction correct over its cells."""
    acc: dict = {}
    for r in rows:
        acc.setdefault((r["method"], r["budget"]), []).append(r["correct"])
    return {k: sum(v) / len(v) for k, v in acc.items()}

