"""PNG figures of the evaluation suite's results (matplotlib, an optional dependency).

`write_plots(results, folder)` returns the files written, or raises PlotsUnavailable with the
reason (matplotlib missing) so the suite can say why it skipped them; tables never need it.

The README's frontier figures (FIGURES) are drawn from the committed results files: the suite draws
those of one file after a run, `python -m kvmini.eval.docs` all of them. Each PNG records a digest of
the numbers it shows and of this module (`data_digest`), so `--check` names a figure that no longer
shows the committed results without drawing it again.
"""
import hashlib
import json
import math
import struct
import zlib
from pathlib import Path

from kvmini.eval.tables import FULL_SPEED, QUICK, fidelity_by_spec, name

SEEDS = ("d2o", "dbudgetkv", "weightedkv", "dynamickv")  # the seed papers' methods: drawn apart from the baselines
DIGEST_KEY = "kvmini-data"


class PlotsUnavailable(Exception):
    pass


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotsUnavailable("matplotlib is not installed (pip install matplotlib); the tables are complete without it")
    return plt


def write_plots(results: dict, folder: Path) -> list[str]:
    plt = _pyplot()
    written = []
    for experiment, draw in (("streaming", _streaming), ("passkey", _passkey), ("layers", _layers),
                             ("queryaware", _queryaware)):
        if results.get(experiment):
            for fig_name, fig in draw(plt, results[experiment]):
                path = Path(folder) / fig_name
                fig.savefig(path, dpi=110, bbox_inches="tight")
                plt.close(fig)
                written.append(str(path))
    for file, (sources, draw) in FIGURES.items():  # the frontiers drawn from one file alone
        if len(sources) == 1 and sweep(results, sources[0][1]):
            path = Path(folder) / Path(file).name
            save(plt, draw(plt, results), path, figure_digest(file, results))
            written.append(str(path))
    return written


def sweep(results: dict, experiment: str) -> bool:
    """Does `results` hold `experiment` at more than one budget (a frontier to draw)?"""
    rows = results.get(experiment)
    return isinstance(rows, list) and len({r["budget"] for r in rows if r["budget"] is not None}) > 1


def save(plt, fig, path: Path, digest: str) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={DIGEST_KEY: digest})
    plt.close(fig)


def figure_digest(file: str, *results: dict) -> str:
    """A digest of what README figure `file` draws (an experiment of each of its results files) and of
    this module."""
    data = [res.get(experiment) for (_, experiment), res in zip(FIGURES[file][0], results)]
    h = hashlib.sha256(json.dumps(data, sort_keys=True).encode())
    h.update(Path(__file__).read_bytes().replace(b"\r\n", b"\n"))
    return h.hexdigest()[:16]


def recorded_digest(path: Path) -> str | None:
    """The digest a PNG written by `save` records (its tEXt chunk), or None."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return None
    at = 8  # after the signature: chunks of length, type, data, CRC
    while at + 8 <= len(raw):
        size, kind = struct.unpack(">I4s", raw[at : at + 8])
        body = raw[at + 8 : at + 8 + size]
        if kind == b"tEXt" and body.startswith(DIGEST_KEY.encode() + b"\0"):
            return body[len(DIGEST_KEY) + 1 :].decode("latin-1")
        if kind == b"zTXt" and body.startswith(DIGEST_KEY.encode() + b"\0"):
            return zlib.decompress(body[len(DIGEST_KEY) + 2 :]).decode("latin-1")
        at += 12 + size
    return None


SEED_COLOURS = {"d2o": "tab:red", "dbudgetkv": "tab:orange", "weightedkv": "tab:green", "dynamickv": "tab:purple"}
MARKERS = "os^vDPX<>hp*d"


def label(spec: str) -> str:
    """The method as the README's table names it, without markdown."""
    return name(spec).strip("`")


def _style(spec: str, i: int) -> dict:
    """Seed methods: thick lines, one strong colour per paper (its other variant dashed); baselines:
    thin dotted lines in shades of grey-blue, each with its own marker."""
    if spec.split("[")[0] in SEEDS:
        return dict(color=SEED_COLOURS[spec.split("[")[0]], linewidth=2.4, marker="o", markersize=5, zorder=3,
                    linestyle="-" if "variant" not in spec else "--")
    greys = ["#5b7fa3", "#8aa6c1", "#3d5a80", "#98c1d9", "#6c757d", "#adb5bd", "#4a6fa5", "#7d8fa3", "#a3b8cc"]
    return dict(color=greys[i % len(greys)], linewidth=1.1, marker=MARKERS[i % len(MARKERS)], markersize=4,
                zorder=2, linestyle=":")


def _ordered(specs) -> list[str]:
    """Seed methods first (their legend entries on top), each group in the order measured."""
    specs = list(dict.fromkeys(specs))
    return [s for s in specs if s.split("[")[0] in SEEDS] + [s for s in specs if s.split("[")[0] not in SEEDS]


def _frontier_kl(plt, quick: dict):
    """KL to the full cache against the measured share of K/V kept, one line per method (its budgets)."""
    f = fidelity_by_spec(quick["fidelity"])
    size = quick["sizes"]["fidelity"]
    fig, ax = plt.subplots(figsize=(8.2, 5.0))
    seeds = baselines = 0
    for spec in _ordered(m for m, _ in f):
        pts = sorted((x["kept"], x["kl"]) for (m, b), x in f.items() if m == spec)
        seed = spec.split("[")[0] in SEEDS
        style = _style(spec, seeds if seed else baselines)
        seeds, baselines = seeds + seed, baselines + (not seed)
        if len(pts) == 1:  # a self-chosen budget: one point (a hollow star for the other variant)
            style.update(marker="*", markersize=13, linestyle="none", markeredgewidth=1.3,
                         markerfacecolor="white" if "variant" in spec else style["color"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label(spec), **style)
    ax.set(xlabel="share of K/V kept (measured, mean over layers and prompts)",
           ylabel="KL(full ‖ method), nats per token (log scale)", yscale="log",
           title=f"How far each method's next-token distribution drifts from the full cache's\n"
                 f"({size['prompts']} prompts of {size['n']:,} tokens, {size['k']} tokens scored, budgets "
                 f"{', '.join(f'{b:.0%}' for b in size['budgets'])})")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1), title="thick: seed papers\n(dashed: other variant)",
              title_fontsize=8)
    return fig


def _frontier_passkey(plt, quick: dict):
    """Passkey answers right at each budget, one row per method (a grid: the lines of 20 methods over
    a few cells each would lie on top of one another)."""
    rows = quick["passkey"]
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None and r["budget"] <= 1})
    lengths = sorted({r["length"] for r in rows})
    cells = sum(1 for r in rows if r["method"] == "full")
    right, kept = {}, {}
    for r in rows:
        key = (r["method"], r["budget"])
        right[key] = right.get(key, 0) + bool(r["correct"])
        kept.setdefault(key, []).append(r["kept"] / r["prompt_tokens"])
    specs = ["full"] + _ordered(m for m, _ in right if m != "full")
    fig, ax = plt.subplots(figsize=(8.2, 0.32 * len(specs) + 1.4))
    grid = []
    for spec in specs:
        own = (spec, None) in right
        grid.append([right[(spec, None)] / cells if own else right.get((spec, b), 0) / cells for b in budgets])
    ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, spec in enumerate(specs):
        for j, b in enumerate(budgets):
            key = (spec, None) if (spec, None) in right else (spec, b)
            share = sum(kept[key]) / len(kept[key])
            text = f"{right[key]}/{cells}" + ("" if spec == "full" else f"  ({share:.0%})")
            if (spec, None) in right and (spec != "full" or j == 0):
                text = f"{right[key]}/{cells}" + ("" if spec == "full" else f" own budget ({share:.0%})")
            if (spec, None) in right and j > 0:
                continue
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(specs)), [label(s) for s in specs], fontsize=8)
    for tick, spec in zip(ax.get_yticklabels(), specs):
        if spec.split("[")[0] in SEEDS:
            tick.set_fontweight("bold")
    ax.set_xticks(range(len(budgets)), [f"{b:.0%}" for b in budgets], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_xlabel(f"budget (in brackets: the share of K/V measured kept); passkey prompts of "
                  f"{', '.join(f'{n:,}' for n in lengths)} tokens, {cells // len(lengths)} needle depths each",
                  fontsize=8)
    ax.set_title("Passkey answers right (green: all; bold: seed papers)", fontsize=10, pad=18)
    return fig


def _speed_vs_kl(plt, quick: dict, fs: dict):
    """Decode speed after 8k tokens (ratio to the full cache) against KL at 20%, one point per method."""
    f = fidelity_by_spec(quick["fidelity"])
    sp = fs["speed"]
    dec = sp["decode"]
    fig, ax = plt.subplots(figsize=(7.6, 5.0))
    seeds = baselines = 0
    named = []
    for spec in _ordered(m for m in dec if m != "full"):
        key = (spec, 0.2) if (spec, 0.2) in f else (spec, None)
        if key not in f:
            continue
        seed = spec.split("[")[0] in SEEDS
        style = _style(spec, seeds if seed else baselines)
        seeds, baselines = seeds + seed, baselines + (not seed)
        x, y = f[key]["kl"], dec[spec]["ratio"]
        text = label(spec) + ("" if abs(f[key]["kept"] - 0.2) < 0.005 else f" ({f[key]['kept']:.0%} kept)")
        marker = "*" if key[1] is None else ("o" if "variant" not in spec else "s") if seed else style["marker"]
        face = "white" if seed and key[1] is None and "variant" in spec else style["color"]
        ax.scatter([x], [y], color=face, s=110 if seed else 30, zorder=style["zorder"], marker=marker, label=text,
                   edgecolors=style["color"] if face == "white" else "black" if seed else "none",
                   linewidths=1.3 if face == "white" else 0.5)
        if seed:  # the seed papers named beside their points too; the baselines in the legend only
            named.append((text, x, y, style["color"]))
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    for text, x, y, colour in named:  # names of points in the right half go to their left
        left = math.log(x) > (math.log(lo) + math.log(hi)) / 2
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(-7 if left else 7, -3), fontsize=7.5,
                    color=colour, fontweight="bold", ha="right" if left else "left")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="full cache")
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1), title="large: seed papers", title_fontsize=8)
    ax.set(xlabel=f"KL(full ‖ method) at a {sp['budget']:.0%} budget (quick fidelity), nats per token, "
                  "log scale: left is closer to the full cache",
           ylabel=f"decode speed after {sp['decode_n']:,} tokens / full cache's",
           title="What a method keeps against how fast it decodes (upper left is better)")
    ax.grid(alpha=0.3, which="both")
    return fig


# README figure -> ((results file, the experiment it draws from it), ...), the drawing
FIGURES = {
    "results/quick/frontier_kl.png": (((QUICK, "fidelity"),), _frontier_kl),
    "results/quick/frontier_passkey.png": (((QUICK, "passkey"),), _frontier_passkey),
    "results/full-speed/speed_vs_kl.png": (((QUICK, "fidelity"), (FULL_SPEED, "speed")), _speed_vs_kl),
}


def draw_figure(file: str, path: Path, *results: dict) -> None:
    """Draw README figure `file` from its results files' contents into `path`."""
    plt = _pyplot()
    save(plt, FIGURES[file][1](plt, *results), path, figure_digest(file, *results))


def _streaming(plt, rows):
    """Cumulative mean NLL along the text, one panel per capacity."""
    capacities = sorted({r["capacity"] for r in rows})
    fig, axes = plt.subplots(1, len(capacities), figsize=(5.5 * len(capacities), 4), squeeze=False)
    for ax, cap in zip(axes[0], capacities):
        for r in (r for r in rows if r["capacity"] == cap):
            xs = [i * (r["tokens"] - 1) / max(len(r["curve"]) - 1, 1) for i in range(len(r["curve"]))]
            held = f", {r['held']:.0f} held per layer" if "held" in r else ""
            ax.plot(xs, r["curve"], label=f"{r['method']} (ppl {r['ppl']:.2f}{held})")
        ax.set(title=f"cache capacity {cap}", xlabel="tokens after the prompt", ylabel="cumulative mean NLL (nats)")
    axes[0, -1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))  # outside: never over the curves
    yield "streaming_nll.png", fig


def _passkey(plt, rows):
    """Depth x length accuracy, one panel per (method, budget)."""
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    runs = list(dict.fromkeys((r["method"], r["budget"]) for r in rows))
    cols = min(5, len(runs))
    nrows = -(-len(runs) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols, 2.8 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (method, budget) in zip(axes.flat, runs):
        grid = [[next(float(r["correct"]) for r in rows if (r["method"], r["budget"], r["length"], r["depth"])
                      == (method, budget, n, d)) for n in lengths] for d in depths]
        ax.axis("on")
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid):  # the cell's value, readable without the colours
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [f"{n // 1000}k" if n >= 1000 else str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        ax.set_title(method if budget is None else f"{method} {budget:g}", fontsize=8)
    fig.supxlabel("context length (green: key retrieved)")
    fig.supylabel("needle depth")
    fig.tight_layout()
    yield "passkey_heatmaps.png", fig


def _layers(plt, res):
    maps = res["density_maps"]
    block = max(1, res["n"] // max(len(next(iter(maps.values()))), 1))  # tokens per block
    fig, axes = plt.subplots(1, len(maps), figsize=(3.6 * len(maps), 3.4), squeeze=False)
    for ax, (layer, grid) in zip(axes[0], maps.items()):
        im = ax.imshow([[v ** 0.5 for v in row] for row in grid], cmap="magma")  # sqrt: faint structure visible
        ax.set(title=f"layer {layer}", xlabel=f"key block ({block} tokens)", ylabel="query block")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.yaxis.get_major_locator().set_params(integer=True)
        fig.colorbar(im, ax=ax, shrink=0.75, label="sqrt(probability)")
    fig.suptitle("attention density (mean over heads)")
    fig.tight_layout()
    yield "layers_density.png", fig

    stats = res["statistics"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    layers = [s["layer"] for s in stats]
    a1.bar(layers, [s["variance"] for s in stats])
    a1.set(title="attention-score variance F_v per layer (D2O Eq. 4)", xlabel="layer", yscale="log")
    a2.plot(layers, [s["top10_share"] for s in stats], label="top-10% keys' share")
    a2.plot(layers, [s["sink_share"] for s in stats], label="first 4 tokens' share")
    a2.set(title="where attention goes", xlabel="layer", ylim=(0, 1))
    a2.legend(fontsize=8)
    yield "layers_variance.png", fig

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, kept in res["retention"].items():
        ax.plot(range(len(kept)), kept, marker=".", label=name)
    mean = res["budget"] * res["n"] if res["budget"] <= 1 else res["budget"]
    ax.axhline(mean, color="gray", linestyle="--", linewidth=1, label=f"mean budget ({mean:.0f})")
    ax.set(title=f"entries kept per layer (prompt {res['n']} tokens, budget {res['budget']:g})", xlabel="layer",
           ylabel="entries kept")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    yield "layers_retention.png", fig


def _queryaware(plt, rows):
    """Per method, accuracy and answer KL with the question in the prompt (filled) and after (open),
    joined by a line; one pair of panels per budget; red labels: question-dependent at some budget
    (kvmini.eval.query_aware.depends)."""
    from kvmini.eval import query_aware

    m = query_aware.by_condition(rows)
    budgets = sorted({b for (_, b) in m if b is not None})
    methods = list(dict.fromkeys(name for (name, _) in m if name != "full"))[::-1]  # first method on top
    full_acc = m[("full", None)]["in prompt"]["accuracy"]
    fig, axes = plt.subplots(1, 2 * len(budgets), figsize=(3.3 * 2 * len(budgets), 0.3 * len(methods) + 1.6),
                             sharey=True, squeeze=False)
    for i, b in enumerate(budgets):
        keys = [(name, b) if (name, b) in m else (name, None) for name in methods]  # self-budgeted: its own
        labels = [name + (" (own budget)" if key[1] is None else "") for name, key in zip(methods, keys)]
        for ax, metric, title in ((axes[0, 2 * i], "accuracy", "passkey accuracy"),
                                  (axes[0, 2 * i + 1], "kl", "answer KL(full‖method), nats")):
            before = [m[k]["in prompt"][metric] for k in keys]
            after = [m[k]["after"][metric] for k in keys]
            ys = range(len(keys))
            ax.hlines(ys, before, after, color="gray", linewidth=1.5, zorder=1)
            ax.scatter(before, ys, color="tab:blue", zorder=2, label="question in the prompt")
            ax.scatter(after, ys, facecolors="white", edgecolors="tab:orange", linewidths=1.5, zorder=3,
                       label="question after (context compressed first)")
            if metric == "accuracy":
                ax.axvline(full_acc, color="gray", linestyle="--", linewidth=1, label="full cache")
                ax.set_xlim(-0.08, 1.08)
            ax.set_title(f"budget {b:g}: {title}", fontsize=9)
            ax.grid(axis="x", alpha=0.3)
            ax.set_yticks(list(ys), labels, fontsize=8)
    dependent = set(query_aware.question_dependent(rows))
    for tick, name in zip(axes[0, 0].get_yticklabels(), methods):
        if name in dependent:
            tick.set_color("tab:red")
    top = max(max(c["kl"] for c in conds.values()) for conds in m.values())
    for ax in axes[0, 1::2]:
        ax.set_xlim(0, 1.05 * top)  # the same scale at every budget
    axes[0, 0].legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.06))
    fig.suptitle("the same context compressed with the question in the prompt and before it arrives "
                 "(red: depends on seeing it at some budget)", fontsize=10, y=1.0)
    fig.tight_layout()
    yield "queryaware.png", fig
