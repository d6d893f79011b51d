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

from kvmini.eval.fidelity import compare, continuation_logits
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


def comparison(name: str, model, prompt: list[int], full: list[int], method, policy, context=None,
               chunk_size=None) -> Comparison:
    """Compare a method's result (`method`, kvmini.generate's) with the full cache's answer `full` to `prompt`.
    `policy`: a fresh policy of the method for the teacher-forced pass; context: for a question about a
    compressed context, (the context's ids, the compressed cache and policy to fork) — the full cache then
    reads context + prompt."""
    kept = method.cache.nbytes() / max(full_nbytes(method.cache), 1)
    if not full:
        return Comparison(name, full, method.tokens[0], None, None, kept)
    before, cache = [], None
    if context is not None:
        from kvmini.generate import fork

        before, (cache, policy) = context[0], fork(*context[1:])
    ids = torch.tensor([prompt + full], device=model.device)
    logits, _ = continuation_logits(model, ids, len(prompt), policy, cache, chunk_size)  # (K, V)
    reference, _ = continuation_logits(model, torch.tensor([before + prompt + full], device=model.device),
                                       len(before) + len(prompt))
    scores = compare(logits, reference, ids[0, len(prompt) :])
    return Comparison(name, full, method.tokens[0], scores["kl"], scores["top1"], kept)
