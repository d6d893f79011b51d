"""Query-aware or query-agnostic? The same context compressed with the question inside the prompt,
and compressed before the question arrives (issue 31; kvpress's "compress once, ask many" pipeline).

Each cell is a passkey prompt (kvmini.eval.passkey: filler, a needle at `depth`, the question, the
assistant's turn starting "The passkey is"), rendered as one string and cut at the end of the context:

    ctx_ids = encode(rendered[:cut])      the filler and the needle (the chat template's start with it)
    q_ids   = encode(rest, bos=False)     "\\n\\n" + question + the template's end + "The passkey is"

and both conditions feed the same ids, ctx_ids + q_ids:

    in the prompt   one prompt, ctx_ids + q_ids: a prefill-time method scores the context with the
                    question's queries in its observation window
    after           ctx_ids is prefilled and compressed first (a run that may continue), then q_ids
                    arrives as the run's next prompt (kvmini.generate.prefill on a cache that holds
                    tokens; docs/design.md, "A cache that lives on")

Both end with the same budget (a ratio of every token seen). Per (method, budget, condition):

    accuracy   passkey answers right (greedy, up to 6 tokens, first number == key), over the cells
    KL         mean_t KL(p_full || p_method) over the full cache's greedy answer (up to K tokens,
               its stop token included), teacher-forced on the method's cache; the full cache's
               one-prompt run is the reference of both conditions
    top-1      fraction of those t where argmax p_method == argmax p_full

A method depends on seeing the question (`question_dependent`) where, at some budget, the question
arriving after the compression costs it at least DROP accuracy, or multiplies its KL by at least
KL_RATIO (and adds at least KL_FLOOR nats, so two tiny KLs are never called different).
"""
import time

import torch

from kvmini.eval.fidelity import compare
from kvmini.eval.passkey import ANSWER_START, FILLER, QUESTION, answer_is, keys_for, needle
from kvmini.generate import fork, prefill
from kvmini.methods.registry import policy_for

CONDITIONS = ("in prompt", "after")
DROP, KL_RATIO, KL_FLOOR = 0.25, 2.0, 0.05
ANSWER_TOKENS = 6  # greedy tokens for the passkey answer: the five digits follow "The passkey is" one by one


def split_prompt(tokenizer, chat, length: int, depth: float, key: int) -> tuple[list[int], list[int]]:
    """(ctx_ids, q_ids) of a passkey prompt of about `length` tokens, cut at the end of the context."""
    def parts(n_filler: int) -> tuple[list[int], list[int]]:
        units = [FILLER] * n_filler
        units.insert(round(depth * n_filler), needle(key))
        context = "".join(units)
        text = context + "\n\n" + QUESTION
        rendered = (chat.render([{"role": "user", "content": text}]) if chat else text + "\n") + ANSWER_START
        cut = rendered.index(context) + len(context)
        return tokenizer.encode(rendered[:cut]), tokenizer.encode(rendered[cut:], bos=False)

    per_unit = len(tokenizer.encode(FILLER, bos=False))
    base = sum(map(len, parts(0)))
    return parts(max(1, round((length - base) / per_unit)))


@torch.inference_mode()
def feed(model, prompts: list[torch.Tensor], policy, room: int = 0):
    """`prompts` in order as one run's prompts: the first starts it on a fresh cache, each later one is
    its next prompt, compressed as the method's schedule says before the next arrives.
    Returns (the last position's logits (1, V), the cache)."""
    cache = model.new_cache(1, capacity=sum(p.shape[1] for p in prompts) + room)
    for ids in prompts:
        logits = prefill(model, ids, cache, policy)  # (1, V); no total_len: the run may continue
    return logits, cache


@torch.inference_mode()
def answer_and_logits(model, prompts: list[torch.Tensor], policy, reference: list[int], stop_ids: set[int]):
    """`feed` the prompts, then from copies of that run: the greedy answer (token ids), and the (K, V)
    logits predicting `reference` teacher-forced. Returns (answer ids, logits, entries kept per layer at
    the end of the teacher-forced copy: after the first decode steps, where D2O's official variant compresses)."""
    first, cache = feed(model, prompts, policy, room=max(ANSWER_TOKENS, len(reference)))
    forced_cache, forced_policy = fork(cache, policy)
    answer, logits = [], first
    for _ in range(ANSWER_TOKENS):
        nxt = logits.argmax(-1)  # (1,)
        if nxt.item() in stop_ids:
            break
        answer.append(nxt.item())
        logits = model(nxt[:, None], cache, policy)[:, -1]
    steps = [first] + [model(torch.tensor([[t]], device=model.device), forced_cache, forced_policy)[:, -1]
                       for t in reference[:-1]]
    return answer, torch.cat(steps).float(), forced_cache.lengths()  # logits (K, V)


@torch.inference_mode()
def reference_answer(model, ids: torch.Tensor, k: int, stop_ids: set[int]) -> list[int]:
    """The full cache's greedy answer: up to k tokens, a stop token included (predicting the end counts)."""
    cache = model.new_cache(1, capacity=ids.shape[1] + k)
    logits, out = prefill(model, ids, cache), []
    while len(out) < k:
        out.append(logits.argmax(-1).item())
        if out[-1] in stop_ids:
            break
        logits = model(torch.tensor([[out[-1]]], device=model.device), cache)[:, -1]
    return out


def run(model, tokenizer, chat, methods: list[tuple[str, float | None]], length: int, depths: list[float], k: int,
        stop_ids: set[int], seed: int = 0, log=print) -> list[dict]:
    """One row per (method, budget, depth, condition); the full cache first (its condition: "in prompt").
    methods: (name, budget) pairs without the full cache."""
    cells = [(length, d) for d in depths]
    rows = []
    total = len(cells) * (1 + 2 * len(methods))
    for (n, d), key in zip(cells, keys_for(cells, seed)):
        ctx, q = split_prompt(tokenizer, chat, n, d, key)
        ctx_ids, q_ids = (torch.tensor([x], device=model.device) for x in (ctx, q))
        ref = reference_answer(model, torch.cat([ctx_ids, q_ids], 1), k, stop_ids)
        targets = torch.tensor(ref, device=model.device)
        runs = [("full", None, "in prompt")] + [(m, b, c) for m, b in methods for c in CONDITIONS]
        full = None
        for name, budget, condition in runs:
            t0 = time.perf_counter()
            prompts = [torch.cat([ctx_ids, q_ids], 1)] if condition == "in prompt" else [ctx_ids, q_ids]
            answer, logits, kept = answer_and_logits(model, prompts, policy_for(name, budget), ref, stop_ids)
            full = logits if full is None else full
            text = tokenizer.decode(answer)
            rows.append({"method": name, "budget": budget, "condition": condition, "length": n, "depth": d, "key": key,
                         "context_tokens": len(ctx), "question_tokens": len(q), "answer": text.strip(),
                         "correct": answer_is(text, key), **compare(logits, full, targets), "k": len(ref),
                         "kept": sum(kept) / len(kept), "seconds": time.perf_counter() - t0})
            shown = "" if budget is None else f" {budget:g}"
            log(f"[{len(rows)}/{total}] queryaware {name}{shown} question {condition}, depth {d:.2f}: "
                f"{'right' if rows[-1]['correct'] else 'wrong'}, KL {rows[-1]['kl']:.3f} ({rows[-1]['seconds']:.1f} s)")
    return rows


def by_condition(rows: list[dict]) -> dict:
    """(method, budget) -> condition -> {"accuracy", "kl", "top1"}: means over the cells."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["method"], r["budget"]), {}).setdefault(r["condition"], []).append(r)
    mean = lambda rs, key: sum(float(r[key]) for r in rs) / len(rs)  # noqa: E731
    return {key: {c: {"accuracy": mean(rs, "correct"), "kl": mean(rs, "kl"), "top1": mean(rs, "top1")}
                  for c, rs in conds.items()} for key, conds in groups.items()}


def depends(m: dict) -> bool:
    """One (method, budget)'s two conditions: does the question arriving after the compression hurt?"""
    before, after = m["in prompt"], m["after"]
    kl_worse = after["kl"] >= KL_RATIO * before["kl"] and after["kl"] - before["kl"] >= KL_FLOOR
    return before["accuracy"] - after["accuracy"] >= DROP or kl_worse


def question_dependent(rows: list[dict]) -> list[str]:
    """The methods that depend on seeing the question at some budget (the rule: `depends`)."""
    found = [m for (m, _), conds in by_condition(rows).items() if m != "full" and depends(conds)]
    return list(dict.fromkeys(found))
