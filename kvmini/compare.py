"""What compression changed: a method's answer beside the full cache's on the same prompt (run.py --compare).

Three numbers say it, each read off one of the two runs or one more pass of the method:
    parts at   the first token where the two answers differ (a greedy answer never meets again after it)
    KL, top-1  the method teacher-forced on the full cache's answer: mean KL(p_full || p_method) per token,
               and how often its most likely token is the full cache's (kvmini.eval.fidelity's measures,
               so the two tools agree on the same prompt and continuation)
    kept       the share of K/V bytes the method's cache holds of what the full cache holds
"""
from dataclasses import dataclass

import torch

from kvmini.eval.fidelity import compare
from kvmini.generate import fork, prefill
from kvmini.report import full_nbytes


def parts_at(full: list[int], method: list[int]) -> int | None:
    """The index of the first token where two answers differ (one ending first counts), None if they are equal.

    parts_at([5, 6, 7], [5, 6, 9]) -> 2;  parts_at([5, 6], [5, 6, 7]) -> 2;  parts_at([5], [5]) -> None
    """
    same = next((i for i, (a, b) in enumerate(zip(full, method)) if a != b), min(len(full), len(method)))
    return None if same == len(full) == len(method) else same


@dataclass
class Comparison:
    name: str  # the method
    full: list[int]  # the full cache's answer
    method: list[int]  # the method's answer
    kl: float | None  # nats per token, None when the full cache answered nothing
    top1: float | None
    kept: float  # share of the full cache's K/V bytes the method's cache holds

    @property
    def parts(self) -> int | None:
        return parts_at(self.full, self.method)

    def lines(self, text) -> list[str]:
        """The block run.py prints; text(ids) -> the answer's text of those tokens."""
        n, at = len(self.full), self.parts
        if at is None:
            where = f"nowhere: the answers are the same ({n} tokens)"
        else:
            said = lambda ids: repr(text(ids[at : at + 1])) if at < len(ids) else "its end"  # noqa: E731
            where = f"at token {at + 1} of the full cache's {n}: {self.name} {said(self.method)}, full {said(self.full)}"
        agree = n if at is None else at
        scores = ("the full cache answered nothing to score" if self.kl is None else  # (KL >= 0; -1e-9 is rounding)
                  f"KL {max(self.kl, 0):.3f} nats/token · top-1 {self.top1:.0%}")
        return ["", f"--- {self.name} beside the full cache ---",
                f"parts     {where}",
                f"changed   kept {self.kept:.1%} of K/V bytes · answers agree for {agree} of {n} tokens · {scores}",
                f"          (KL, top-1: {self.name}'s next-token predictions with the full cache's answer fed in, against "
                "the full cache's)"]


@torch.inference_mode()
def teacher_forced(model, prompt: list[int], answer: list[int], policy=None, cache=None, chunk_size=None):
    """-> logits (K, V) predicting each of the K answer tokens: the prompt fills the cache (or continues
    `cache`, a run's), then the answer is fed a token a step, as the run's decode loop feeds its own."""
    if cache is None:
        cache = model.new_cache(1, capacity=len(prompt) + len(answer))
    ids = torch.tensor([prompt + answer], device=model.device)  # (1, T + K)
    logits = [prefill(model, ids[:, : len(prompt)], cache, policy, chunk_size,
                      cache.seen_tokens + ids.shape[1] - 1)]  # (1, V) each
    for t in range(len(prompt), ids.shape[1] - 1):
        logits.append(model(ids[:, t : t + 1], cache, policy)[:, -1])
    return torch.cat(logits).float()


def comparison(name: str, model, prompt: list[int], full: list[int], method, policy, context=None,
               chunk_size=None) -> Comparison:
    """Compare a method's result (`method`, kvmini.generate's) with the full cache's answer `full` to `prompt`.
    `policy`: a fresh policy of the method for the teacher-forced pass; context: for a question about a
    compressed context, (the context's ids, the compressed cache and policy to fork, used instead of
    `policy`) — the full cache then reads context + prompt."""
    kept = method.cache.nbytes() / max(full_nbytes(method.cache), 1)
    if not full:
        return Comparison(name, full, method.tokens[0], None, None, kept)
    before, cache = [], None
    if context is not None:
        before, (cache, policy) = context[0], fork(*context[1:])
    logits = teacher_forced(model, prompt, full, policy, cache, chunk_size)  # (K, V)
    reference = teacher_forced(model, before + prompt, full)
    scores = compare(logits, reference, torch.tensor(full, device=model.device))
    return Comparison(name, full, method.tokens[0], scores["kl"], scores["top1"], kept)
