"""The wrong answers a student plausibly writes for each exercise: the misreadings of its equations.
Each is one line of the reference solution changed (`old` -> `new`, inside the exercise's region);
tests/test_wrong_answers.py puts each in place of the reference and runs that exercise's checks, which
must fail. A check that passes a wrong answer is a check that cannot see that misreading.

    python tests/wrong_answers.py NAME    (from the repository's root) runs NAME's exercise's checks
                                          with that wrong answer in place, as the test does
"""
import importlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvmini.course.exercises import BEGIN, END, exercises, function_at, parsed  # noqa: E402


@dataclass(frozen=True)
class Wrong:
    name: str  # how a test run names it
    exercise: str
    misreading: str  # what the student got wrong
    module: str  # the module holding the exercise's region
    old: str  # a line (or part of one) of the reference solution ...
    new: str  # ... and what the student wrote instead
    caught_by: str = ""  # the check, named after the equation and function it checks, that must fail first


WRONG = [
    Wrong("eq12_as_printed", "ema_merging", "Eq. 12 as printed: each merged token's weight is the sum of e^u over every "
          "token merged into the same kept one, so two merges into one token are not convex",
          "kvmini.methods.ema_merging",
          "num.scatter_add_(2, j_star[..., None].expand_as(x_evict), weight[..., None] * x_evict)",
          "num.scatter_add_(2, j_star[..., None].expand_as(x_evict), (den - math.e).gather(2, j_star)[..., None] * x_evict)",
          "test_eq11_12_convex_merge_alone"),
    Wrong("threshold_ignored", "ema_merging", "Eq. 10's threshold ignored: every evicted token merges into its nearest",
          "kvmini.methods.ema_merging", "weight = torch.where(merge, best.exp(), torch.zeros_like(best))",
          "weight = best.exp()", "test_eq11_12_convex_merge_alone"),
    Wrong("own_weight_one", "ema_merging", "Eq. 12's weight of the kept token itself taken as 1, not e^1 (its "
          "similarity to itself is 1)", "kvmini.methods.ema_merging", "num = math.e * x_keep", "num = 1.0 * x_keep",
          "test_eq11_12_convex_merge_alone"),
    Wrong("ema_reversed", "ema_merging", "Eq. 10's EMA the other way round: beta weighs the old threshold",
          "kvmini.methods.ema_merging", "beta * new + (1 - beta) * tau_prev", "(1 - beta) * new + beta * tau_prev",
          "test_eq10_ema_threshold_alone"),
    Wrong("dot_not_cosine", "ema_merging", "Eq. 9's similarity as a dot product, not a cosine",
          "kvmini.methods.ema_merging",
          "u = F.normalize(k_evict, dim=-1, eps=eps) @ keys.transpose(-1, -2) / norms.clamp_min(eps)[..., None, :]",
          "u = k_evict @ keys.transpose(-1, -2)", "test_eq9_nearest_alone"),
    Wrong("ties_to_later", "ema_merging", "Eq. 9's argmax taking the later kept key on a tie (the tutorial: the earlier)",
          "kvmini.methods.ema_merging", "return u.max(-1)",
          "return u.max(-1).values, u.shape[-1] - 1 - u.flip(-1).argmax(-1)",
          "test_eq9_nearest_takes_the_earlier_key_on_a_tie"),
    Wrong("kept_norms_not_divided", "ema_merging", "Eq. 9's cosine without the kept keys' norms divided out",
          "kvmini.methods.ema_merging", " / norms.clamp_min(eps)[..., None, :]", "", "test_eq9_nearest_alone"),
    Wrong("exclude_ignored", "ema_merging", "Eq. 9's `exclude` ignored: an excluded key (a victim itself) may be chosen",
          "kvmini.methods.ema_merging", 'u = u.masked_fill(exclude, float("-inf"))', "pass",
          "test_eq9_nearest_never_chooses_an_excluded_key"),
    Wrong("linear_weights", "ema_merging", "Eq. 12's weights linear in u, u_i / (sum u + 1), not e^u_i / (sum e^u + e) "
          "(close to them where u is near 1)", "kvmini.methods.ema_merging",
          "weight = torch.where(merge, best.exp(), torch.zeros_like(best))",
          "weight = torch.where(merge, math.e * best, torch.zeros_like(best))",  # e u / (e + e sum u): the same
          "test_eq11_12_convex_merge_at_a_low_similarity"),
    Wrong("kept_token_dropped", "ema_merging", "Eq. 11 without the kept token's own term: a kept token that others merge "
          "into becomes their weighted mean", "kvmini.methods.ema_merging", "return num / den[..., None]",
          "return torch.where((den > math.e)[..., None], (num - math.e * x_keep) / (den - math.e)[..., None], x_keep)",
          "test_eq11_12_convex_merge_at_a_low_similarity"),
    Wrong("variance_pooled", "variance_softmax", "Eq. 4's variance pooled over the column sums of all heads at once, "
          "not per head then averaged", "kvmini.methods.variance_softmax", "column_sums.var(dim=-1, correction=correction)",
          "column_sums.flatten(1).var(dim=-1, correction=correction)", "test_eq4_attention_variance_by_hand"),
    Wrong("variance_over_heads", "variance_softmax", "Eq. 4's variance taken across the heads, not over the key positions",
          "kvmini.methods.variance_softmax", "column_sums.var(dim=-1, correction=correction)",
          "column_sums.var(dim=1, correction=correction)", "test_eq4_attention_variance_by_hand"),
    Wrong("std_not_variance", "variance_softmax", "Eq. 4 as the standard deviation of the column sums",
          "kvmini.methods.variance_softmax", "column_sums.var(dim=-1, correction=correction)",
          "column_sums.std(dim=-1, correction=correction)", "test_eq4_attention_variance_by_hand"),
    Wrong("unbiased_always", "variance_softmax", "Eq. 4 divided by n - 1 whatever `correction` says (torch's default)",
          "kvmini.methods.variance_softmax", "column_sums.var(dim=-1, correction=correction)",
          "column_sums.var(dim=-1)", "test_eq4_attention_variance_by_hand"),
    Wrong("softmax_sign", "variance_softmax", "Eq. 5's exponent without its minus: the flattest layers get the least",
          "kvmini.methods.variance_softmax", "return torch.softmax(-F, dim=0).tolist()",
          "return torch.softmax(F, dim=0).tolist()"),
    Wrong("reciprocal_not_normalized", "reciprocal_allocation", "Table 4's reciprocal weights not normalized to sum to 1",
          "kvmini.methods.variance_softmax", "return (inv / inv.sum()).tolist()", "return inv.tolist()"),
    Wrong("reciprocal_rank", "reciprocal_allocation", "Table 4's reciprocal of each layer's variance rank, not of the "
          "variance", "kvmini.methods.variance_softmax", "inv = 1 / F.clamp(min=1e-30)",
          "inv = 1 / (F.argsort().argsort() + 1.0)", "test_reciprocal_allocation_by_hand"),
    Wrong("reciprocal_shifted", "reciprocal_allocation", "the variances shifted so that the smallest is 1 before the "
          "reciprocal", "kvmini.methods.variance_softmax", "inv = 1 / F.clamp(min=1e-30)", "inv = 1 / (F - F.min() + 1)",
          "test_reciprocal_allocation_by_hand"),
    Wrong("reciprocal_of_zero", "reciprocal_allocation", "1/F_v taken literally: a zero variance gives inf, and its "
          "share inf/inf", "kvmini.methods.variance_softmax", "inv = 1 / F.clamp(min=1e-30)", "inv = 1 / F",
          "test_reciprocal_allocation_of_a_zero_variance"),
    Wrong("no_squares", "frobenius_stop", "Eq. 2's Frobenius norm without the squares: a sum of the attention itself",
          "kvmini.methods.frobenius_stop", "sq = s.gather(-1, order).double() ** 2", "sq = s.gather(-1, order).double()"),
    Wrong("removed_not_kept", "frobenius_stop", "Eq. 2's R_i as the norm of the tokens removed, not of those that remain",
          "kvmini.methods.frobenius_stop", "R = sq.flip(-1).cumsum(-1).flip(-1).sqrt()", "R = sq.cumsum(-1).sqrt()"),
    Wrong("one_too_many", "frobenius_stop", "the count of tokens pruned off by one (the first drop, 0, counted)",
          "kvmini.methods.frobenius_stop", "return int((drop <= t).sum().item()) - 1",
          "return int((drop <= t).sum().item())"),
    Wrong("top_per_layer", "progressive_budgets", "Eq. 5's top-k taken over the finished layers without the KV heads' "
          "share of it", "kvmini.methods.progressive_budgets", "k = min((w_t - w) * A.shape[1] * l, int(A.isfinite().sum()))",
          "k = min((w_t - w) * l, int(A.isfinite().sum()))", "test_eq5_6_reallocate_counts_by_hand"),
    Wrong("layer_without_head_stride", "progressive_budgets", "Eq. 5's hits read as layers without taking each KV "
          "head's row apart first", "kvmini.methods.progressive_budgets",
          "top = A.flatten(1).topk(k, dim=-1).indices % A.shape[-1] // (n - w)",
          "top = A.flatten(1).topk(k, dim=-1).indices // (n - w)", "test_eq5_6_reallocate_counts_by_hand"),
    Wrong("total_of_finished", "progressive_budgets", "Eq. 7's total over the l finished layers, not all L",
          "kvmini.methods.progressive_budgets", "Z = proportional(C, (w_t - w) * L, 0, held)",
          "Z = proportional(C, (w_t - w) * l, 0, held)", "test_eq7_8_reallocate_budgets_by_hand"),
    Wrong("cap_with_window", "progressive_budgets", "Eq. 8's cap the whole of what a layer holds, its window included",
          "kvmini.methods.progressive_budgets", "held = [h - w for h in held]", "held = list(held)",
          "test_eq7_8_reallocate_budgets_by_hand"),
    Wrong("l2_always", "value_norm", "VATP's value norm always l2, whatever p", "kvmini.methods.vatp",
          "values.abs().sum(-1) if self.p == 1", "torch.linalg.vector_norm(values, dim=-1) if self.p == 1"),
    Wrong("l1_without_abs", "value_norm", "the l1 norm without the absolute values", "kvmini.methods.vatp",
          "values.abs().sum(-1) if self.p == 1", "values.sum(-1) if self.p == 1"),
    Wrong("norm_over_heads", "value_norm", "a token's l1 norm taken over its values in every KV head together",
          "kvmini.methods.vatp", "values.abs().sum(-1) if self.p == 1",
          "values.abs().sum(-1).sum(-2, keepdim=True) if self.p == 1", "test_value_norm_alone"),
    Wrong("abs_in_place", "value_norm", "the absolute values taken in place: the cached values change",
          "kvmini.methods.vatp", "values.abs().sum(-1) if self.p == 1", "values.abs_().sum(-1) if self.p == 1",
          "test_value_norm_alone"),
    Wrong("four_dims_only", "value_norm", "the norm over dimension 3, as if values were always (B, H_kv, S, D)",
          "kvmini.methods.vatp", "values.abs().sum(-1) if self.p == 1", "values.abs().sum(3) if self.p == 1",
          "test_value_norm_alone"),
    Wrong("shares_swapped", "convex_value_merge", "Alg. 1 line 9's weights swapped: v_j gets its neighbour's share",
          "kvmini.methods.convex_value_merge", "share = torch.where(w_j + w_next > 0, w_j / (w_j + w_next), 0.5)",
          "share = torch.where(w_j + w_next > 0, w_next / (w_j + w_next), 0.5)"),
    Wrong("window_outside", "convex_value_merge", "Alg. 1 line 8's range: the recent window not protected",
          "kvmini.methods.convex_value_merge", "free = (pos >= sinks) & (pos <= top - window)", "free = pos >= sinks"),
    Wrong("a_not_abar", "convex_value_merge", "Alg. 1 line 7's average attention read as the sum a, not a / n",
          "kvmini.methods.convex_value_merge", 'abar = lc.aux("a") / lc.aux("n")', 'abar = lc.aux("a")',
          "test_alg1_one_merge_by_hand"),
    Wrong("tie_to_later", "convex_value_merge", "Alg. 1 line 8's tie going to the later position",
          "kvmini.methods.convex_value_merge", "j = torch.where(low, pos, PAD).argmin(-1, keepdim=True)",
          "j = torch.where(low, pos, -1).argmax(-1, keepdim=True)", "test_alg1_one_merge_by_hand"),
    Wrong("zero_over_zero", "convex_value_merge", "Alg. 1 line 9 read literally: two zero averages give 0/0",
          "kvmini.methods.convex_value_merge", "share = torch.where(w_j + w_next > 0, w_j / (w_j + w_next), 0.5)",
          "share = w_j / (w_j + w_next)", "test_alg1_one_merge_by_hand"),
    Wrong("sinks_one_wider", "convex_value_merge", "Alg. 1 line 8's range one position short: the first position after "
          "the sinks never chosen", "kvmini.methods.convex_value_merge",
          "free = (pos >= sinks) & (pos <= top - window)", "free = (pos > sinks) & (pos <= top - window)",
          "test_alg1_one_merge_by_hand"),
]
BY_NAME = {w.name: w for w in WRONG}


def regions(text: str, exercise: str) -> list[tuple[int, int]]:
    """(first, last) line indices of the bodies of `exercise`'s regions in a module's text."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        begin = BEGIN.match(line)
        if begin and begin.group(2) == exercise:
            end = next(j for j in range(i, len(lines)) if END.match(lines[j]))
            out.append((i + 1, end - 1))
    return out


def put_in_place(w: Wrong) -> None:
    """Write the wrong answer into the exercise's region of the loaded module: the module's source, the one
    line changed, is run as a module of its own, and the functions holding the regions replace the
    module's (or, for a method, its class's) own."""
    module = importlib.import_module(w.module)
    text = Path(module.__file__).read_text()
    lines, tree, found = text.splitlines(), parsed(text), 0
    holders = set()
    for first, last in regions(text, w.exercise):
        for i in range(first, last + 1):
            if w.old in lines[i]:
                lines[i], found = lines[i].replace(w.old, w.new), found + 1
                holders.add(function_at(tree, i + 1))
    if found != 1:
        raise ValueError(f"{w.name}: {w.old!r} is in {found} lines of exercise {w.exercise}'s regions, not one")
    fresh = types.ModuleType(module.__name__)  # the module run again with the line changed
    fresh.__file__ = module.__file__
    exec(compile("\n".join(lines) + "\n", module.__file__, "exec"), fresh.__dict__)
    for holder in holders:  # "function" or "Class.method"
        *outer, last = holder.split(".")
        owner, new = module, fresh
        for part in outer:
            owner, new = getattr(owner, part), getattr(new, part)
        setattr(owner, last, vars(new)[last])


def main(name: str) -> int:
    import pytest

    w = BY_NAME[name]
    put_in_place(w)
    print(f"in place: {w.name} ({w.misreading})", flush=True)
    tests = list(exercises(ROOT)[w.exercise].tests)
    return pytest.main(["-q", "-p", "no:cacheprovider", *tests])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
