"""Why a seed method wins or loses: its parts switched off one at a time, at equal memory, paired over windows.

Each window is N prompt tokens of the long text and the K after them, scored as in kvmini.eval.fidelity
(KL(full ‖ method) over the K teacher-forced tokens). In every window the suite runs:

    the seed method       at `budget` (DBudgetKV: the budget its rule chooses)
    each of its ablations the seed with one option changed (SEEDS: what the option switches off)
    each rival            the baselines the paper claims to beat, run at the share of the K/V entries
                          the seed (or the ablation) measurably kept: every comparison is at equal memory

The rows are compared window by window in kvmini.eval.paired (a sign test; the verdicts and their causes).
"""
import time

SAME = 0.005  # two measured shares within half a percentage point are equal memory: one rival run serves both
SEEDS = {  # seed spec -> the rivals its paper claims to beat, and {what is switched off: the spec that does it}
    "d2o": {"rivals": ["h2o", "streaming_llm", "roco", "cam"],
            "parts": {"the merge": "d2o[merge=off]",
                      "the merge of keys (values still merged)": "d2o[merge_writes=values]",
                      "the merge of values (keys still merged)": "d2o[merge_writes=keys]",
                      "variance layer budgets": "d2o[allocation=uniform]",
                      "protected layers": "d2o[protected_layers=]"}},
    "dynamickv": {"rivals": ["snapkv"], "parts": {"progressive layer budgets": "dynamickv[layer_budgets=uniform]"}},
    "dbudgetkv": {"rivals": ["snapkv"], "parts": {"the stopping rule": "dbudgetkv[fixed_share={share}]"}},
    "weightedkv": {"rivals": ["streaming_llm", "h2o", "tova", "cam"], "parts": {"the value merge": "weightedkv[value_merge=off]"}},
}


def specs(seeds: list[str]) -> list[str]:
    """Every spec the experiment runs for `seeds` (DBudgetKV's ablation with its share left as {share})."""
    out = []
    for seed in seeds:
        out += [seed, *SEEDS[seed]["parts"].values(), *SEEDS[seed]["rivals"]]
    return list(dict.fromkeys(out))


def windows(length: int, span: int, count: int) -> list[int]:
    """The first token of `count` windows of `span` tokens spread evenly over a text of `length`."""
    step = (length - span) // max(count - 1, 1)
    return [i * step for i in range(count)]


def run_window(model, ids, n: int, budget: float, seeds: list[str], log=print) -> list[dict]:
    """Rows of one window, ids (1, N + K) a tensor: the full cache, each seed and its ablations, and each rival at the
    measured share of each of them (`at`: the specs whose share it matches)."""
    from kvmini.eval import fidelity
    from kvmini.methods.registry import chooses_budget, make_policy, parse_spec

    targets = ids[0, n:]
    full, _ = fidelity.continuation_logits(model, ids, n)

    def one(spec: str, b) -> dict:
        t0 = time.perf_counter()
        name, options = parse_spec(spec)
        logits, kept = fidelity.continuation_logits(model, ids, n, make_policy(name, b, **options))
        row = {"method": spec, "budget": b, **fidelity.compare(logits, full, targets),
               "kept_share": sum(kept) / (n * len(kept)), "kept_per_layer": kept, "seconds": time.perf_counter() - t0}
        log(f"  {spec} budget {'self-chosen' if b is None else f'{b:.4g}'}: KL {row['kl']:.4f}, "
            f"kept {row['kept_share']:.1%} ({row['seconds']:.1f} s)")
        return row

    rows = [{"method": "full", "budget": None, **fidelity.compare(full, full, targets), "kept_share": 1.0}]
    for seed in seeds:
        b = None if chooses_budget(parse_spec(seed)[0]) else budget
        mine = [one(seed, b)]
        for spec in SEEDS[seed]["parts"].values():
            spec = spec.format(share=f"{mine[0]['kept_share']:.4f}")
            mine.append(one(spec, None if chooses_budget(parse_spec(spec)[0]) else budget))
        rows += mine
        for rival in SEEDS[seed]["rivals"]:
            for r in mine:
                done = next((x for x in rows if x["method"] == rival and abs(x["budget"] - r["kept_share"]) <= SAME), None)
                if done is None:
                    done = one(rival, round(r["kept_share"], 4))
                    done["at"] = []
                    rows.append(done)
                done["at"].append(r["method"])
    return rows


def run(model, text_ids: list[int], n: int, k: int, count: int, budget: float, seeds: list[str], log=print) -> list[dict]:
    """Rows of `count` windows of the text (each row carries its `window` and first token)."""
    import torch

    out = []
    for w, start in enumerate(windows(len(text_ids), n + k, count)):
        log(f"why: window {w + 1}/{count} (tokens {start}..{start + n + k})")
        ids = torch.tensor([text_ids[start : start + n + k]], device=model.device)
        out += [{"window": w, "start": start, **r} for r in run_window(model, ids, n, budget, seeds, log)]
    return out
