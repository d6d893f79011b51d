"""results/*/summary.md: the markdown tables of one results file (`python -m kvmini.eval.suite` prints and
writes it after a run; `python -m kvmini.eval.docs` rewrites it from the committed file). The speed and
parts tables are those of docs/speed.md (kvmini.eval.tables)."""
import statistics

from kvmini.eval import paired, passkey, query_aware, tables


def summary(results: dict) -> str:
    """The markdown tables of whatever experiments ran."""
    out = [f"# kvmini evaluation ({results['profile']} profile, {results['device']})", ""]
    if results["profile"] == "smoke":
        out += ["> **Smoke profile: these numbers mean nothing.** The sizes only exercise every code path (a",
                "> compressed cache may even score better than the full one on 128 tokens). Use --profile quick", ""]
    if "streaming" in results:
        out += ["## Streaming perplexity", "", "| capacity | method | tokens scored | entries held per layer | perplexity |",
                "|---|---|---|---|---|"]
        out += [f"| {r['capacity']} | {r['method']} | {r['tokens']} | {r['held']:.0f} | {r['ppl']:.3f} |" if "held" in r
                else f"| {r['capacity']} | {r['method']} | {r['tokens']} | — | {r['ppl']:.3f} |" for r in results["streaming"]]
        out.append("")
    if "passkey" in results:
        rows = results["passkey"]
        lengths = sorted({r["length"] for r in rows})
        out += ["## Passkey retrieval (accuracy over depths)", "",
                "| method | budget | " + " | ".join(map(str, lengths)) + " | all |",
                "|---|---|" + "---|" * (len(lengths) + 1)]
        for (m, b), acc in passkey.accuracy(rows).items():
            per = [passkey.accuracy([r for r in rows if r["length"] == n and (r["method"], r["budget"]) == (m, b)])
                   [(m, b)] for n in lengths]
            shown = "—" if m == "full" else "self-chosen" if b is None else f"{b:g}"
            out.append(f"| {m} | {shown} | " + " | ".join(f"{a:.2f}" for a in per) + f" | {acc:.2f} |")
        out.append("")
    if "fidelity" in results:
        out += ["## Prefill fidelity over prompts (mean over prompts; range of KL in brackets)", "",
                "| method | budget | kept share | perplexity / full | KL(full‖method) | top-1 agree |",
                "|---|---|---|---|---|---|"]
        out += [_fidelity_line(results["fidelity"], key) for key in dict.fromkeys(
            (r["method"], r["budget"]) for r in results["fidelity"] if r["method"] != "full")]
        db = [r for r in results["fidelity"] if r["method"] == "dbudgetkv"]
        if db:
            out += ["", "DBudgetKV's self-chosen budget per prompt: " + ", ".join(
                f"prompt {r['prompt']} {r['kept_share']:.1%} (KL {r['kl']:.3f})" for r in db),
                "", "Its per-layer budgets, prompt 0: " + " ".join(map(str, db[0]["kept_per_layer"]))]
        out.append("")
    if "layers" in results:
        res = results["layers"]
        out += [f"## Layers (prompt {res['n']} tokens)", "",
                "| layer | F_v | top-10% share | sink share | " + " | ".join(res["retention"]) + " |",
                "|---|---|---|---|" + "---|" * len(res["retention"])]
        for s in res["statistics"]:
            kept = " | ".join(str(k[s["layer"]]) for k in res["retention"].values())
            out.append(f"| {s['layer']} | {s['variance']:.3g} | {s['top10_share']:.2f} | {s['sink_share']:.2f} | {kept} |")
        out.append("")
    if "speed" in results:
        sp = results["speed"]
        out += [f"## Speed and memory (budget {sp['budget']:g})", "", tables.speed_table(results), "",
                "Decode is timed after the first decode step (shown apart: D2O's official variant compresses there), "
                "in rounds interleaved (at each step every method decodes one token, in an order rotated from step to "
                "step), each method's median round; decode / SnapKV's is the median of the paired rounds, their lowest "
                "and highest in brackets. Policy time is spent in the method's hooks (scoring, budgeting, compressing), "
                "the rest of a method's extra prefill time is its attention statistics; policy ops are the tensor "
                "operations its hooks run in one decode step (torch.profiler's count, views included)."]
        if any("joint_speedup" in dec for dec in sp["decode"].values()):
            out += ["", "A decode step's evictions for all layers at once (the former kvmini.at_once, then the default) "
                    "against layer by layer (the same evictions), on a copy of the cache forked after the first decode "
                    "step, interleaved in the same rounds:", "", tables.together_table(results)]
        if "peak_skipped" in sp:
            out.append(f"\n{sp['peak_skipped']}")
        if "batch" in sp:
            out += ["", f"Largest batch of {sp['batch_n']}-token prompts under {sp['cap_gib']:g} GiB of GPU memory:", "",
                    "| method | batch | decode tokens/s (all sequences) | peak GiB |", "|---|---|---|---|"]
            out += [f"| {m} | {b['batch']} | {b['tokens_per_s']:.0f} | {b['peak_gib']:.2f} |" if b else f"| {m} | none fits | — | — |"
                    for m, b in sp["batch"].items()]
        out.append("")
    if "parts_speed" in results:
        out += ["## Where D2O's decode step goes", "", tables.parts_table(results), ""]
    if "ablations" in results:
        out += ["## Ablations: one prompt, each difference on its own", "",
                "| method | budget | kept share | perplexity / full | KL(full‖method) | top-1 agree |",
                "|---|---|---|---|---|---|"]
        out += [_fidelity_line([{"prompt": 0, **r} for r in results["ablations"]], key) for key in dict.fromkeys(
            (r["method"], r["budget"]) for r in results["ablations"] if r["method"] != "full")]
        out.append("")
    if "why" in results:
        out += ["## Why: each seed method with one part switched off, at equal memory", "",
                paired.table(results["why"], tables.name), ""]
    if "queryaware" in results:
        m = query_aware.by_condition(results["queryaware"])
        out += ["## Query-aware: the question in the prompt, or after the context was compressed", "",
                "| method | budget | accuracy: in prompt | after | KL: in prompt | after | top-1: in prompt | after | "
                "depends |", "|---|---|---|---|---|---|---|---|---|"]
        for (spec, b), conds in m.items():
            if spec != "full":
                x, y = conds["in prompt"], conds["after"]
                out.append(f"| {spec} | {'self-chosen' if b is None else f'{b:g}'} | {x['accuracy']:.2f} | "
                           f"{y['accuracy']:.2f} | {x['kl']:.3f} | {y['kl']:.3f} | {x['top1']:.2f} | {y['top1']:.2f} | "
                           f"{'yes' if query_aware.depends(conds) else 'no'} |")
        out += ["", f"Full cache accuracy: {m[('full', None)]['in prompt']['accuracy']:.2f}. Depending on the question "
                f"(kvmini.eval.query_aware.depends): {', '.join(query_aware.question_dependent(results['queryaware'])) or 'none'}.", ""]
    if results.get("plots_skipped"):
        out += [f"Plots skipped: {results['plots_skipped']}", ""]
    if results.get("provenance"):
        out += ["## Provenance", "", "| experiment | command | commit | date |", "|---|---|---|---|"]
        out += [f"| {name} | `{p['command']}` | {p.get('commit') or 'unknown'} | {p['date']} |"
                for name, p in results["provenance"].items()]
        out += [""] + [f"{name}: backfilled {p['backfilled']}." for name, p in results["provenance"].items()
                       if "backfilled" in p] + [""]
    return "\n".join(out)


def _fidelity_line(rows, key) -> str:
    mine = [r for r in rows if (r["method"], r["budget"]) == key]
    full = {r["prompt"]: r["ppl"] for r in rows if r["method"] == "full"}
    mean = lambda xs: statistics.fmean(xs)  # noqa: E731
    kl = [r["kl"] for r in mine]
    shown = "self-chosen" if key[1] is None else f"{key[1]:g}"
    return (f"| {key[0]} | {shown} | {mean([r['kept_share'] for r in mine]):.1%} | "
            f"{mean([r['ppl'] / full[r['prompt']] for r in mine]):.3f} | {mean(kl):.3f} [{min(kl):.3f}–{max(kl):.3f}] | "
            f"{mean([r['top1'] for r in mine]):.3f} |")
