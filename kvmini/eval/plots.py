"""PNG figures of the evaluation suite's results (matplotlib, an optional dependency).

`write_plots(results, folder)` returns the files written, or raises PlotsUnavailable with the
reason (matplotlib missing) so the suite can say why it skipped them; tables never need it.
"""
from pathlib import Path


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
    for name, draw in (("streaming", _streaming), ("passkey", _passkey), ("layers", _layers),
                       ("queryaware", _queryaware)):
        if results.get(name):
            for fig_name, fig in draw(plt, results[name]):
                path = Path(folder) / fig_name
                fig.savefig(path, dpi=110, bbox_inches="tight")
                plt.close(fig)
                written.append(str(path))
    return written


def _streaming(plt, rows):
    """Cumulative mean NLL along the text, one panel per capacity."""
    capacities = sorted({r["capacity"] for r in rows})
    fig, axes = plt.subplots(1, len(capacities), figsize=(5.5 * len(capacities), 4), squeeze=False)
    for ax, cap in zip(axes[0], capacities):
        for r in (r for r in rows if r["capacity"] == cap):
            xs = [i * (r["tokens"] - 1) / max(len(r["curve"]) - 1, 1) for i in range(len(r["curve"]))]
            ax.plot(xs, r["curve"], label=f"{r['method']} (ppl {r['ppl']:.2f})")
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
