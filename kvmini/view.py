"""See what each method keeps: one self-contained web page of the prompt, token by token.

    python run.py --method d2o --prompt prompt.txt --html kept.html
    python -m kvmini.view --methods h2o snapkv d2o --prompt prompt.txt --out kept.html

Every token of the text is shaded by the share of (layer, KV head) pairs whose cache still holds it;
a layer and a head can be selected; hovering a token shows its position, where it survived, its
score where the cache keeps one, and for merging methods (D2O, WeightedKV) the kept token it was
merged into and with what weight. Several methods on one prompt give one text each, with the tokens
one keeps and another drops outlined. The page is one HTML file (inline CSS and JavaScript, no
network); its numbers come from the cache itself (`LayerCache.positions` of every layer and head)
and from the merge trace the compressors record when asked (`record_merges`).

Encoding (the page decodes it; shading is computed in the browser): per layer and head, a bitset
of the positions held (bit p % 8 of byte p // 8), a bitset of the evicted positions that were
merged, and for those, in position order, the position each was merged into (uint16, or uint32
past 65,536 tokens) and its weight in 1/10000 (int16); scores of the held tokens as float32 in
position order. Base64 each.
"""
import base64
import html
import json
import sys
from pathlib import Path

from kvmini import cli

cli.exit_on_ctrl_c(__name__)  # before the imports below
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvmini.cache import KVCache  # noqa: E402
from kvmini.errors import KvminiError  # noqa: E402
from kvmini.methods.merged import Merged  # noqa: E402

LAZY_IMPORTS = ("kvmini.chat", "kvmini.generate", "kvmini.loading", "kvmini.methods.registry", "kvmini.report",
                "kvmini.tokenizer", "kvmini.weights")  # the comparison's work imports these

TEMPLATE = Path(__file__).with_name("view.html")


def record_merges(policy) -> list[Merged] | None:
    """Ask the policy's merging compressor (D2O's EMAMerge, WeightedKV itself) to record its
    merges in a list, returned (None: the method does not merge). Call before the run."""
    merger = None if policy is None else policy.merger
    if merger is None:
        return None
    merger.trace = []
    return merger.trace


def b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def bitset(positions: np.ndarray, n: int) -> str:
    bits = np.zeros(n, dtype=bool)
    bits[positions] = True
    return b64(np.packbits(bits, bitorder="little"))


def scores_of(lc, policy) -> tuple[str, torch.Tensor | None]:
    """(what it is, (H_kv, S) per held entry) of the score the cache keeps for row 0, or (why not, None):
    the method's `describe(lc)` -> (what its score is, (B, H_kv, S)) or (why none, None)."""
    if policy is None:
        return "no scores: the full cache keeps every token", None
    if any((a if isinstance(a, str) else a[0]) not in lc.aux_names() for a in policy.aux):  # never scored here
        return "not scored: this layer is never compressed", None
    label, score = policy.describe(lc)
    return label, None if score is None else score[0].float()


def panel(cache: KVCache, policy=None, trace: list[Merged] | None = None, name: str | None = None,
          generated: list[str] = ()) -> dict:
    """What the page shows of one finished run (row 0 of the batch), JSON-ready; `generated`: the texts
    of the tokens it generated that its cache saw (positions prompt_len...)."""
    from kvmini.report import aux_nbytes

    n, L = cache.seen_tokens, len(cache)
    protected = set(policy.run.protected) if policy is not None else set()
    merges = {}  # (layer, head) -> [(evicted, into, weight) arrays of each record]
    for m in trace or []:
        for h in range(m.evicted.shape[1]):
            merges.setdefault((m.layer, h), []).append((m.evicted[0, h], m.into[0, h], m.weight[0, h]))
    held, merged, into, scores, notes = [], [], [], [], {}
    width = "<u2" if n <= 2**16 else "<u4"  # merge targets: positions < n
    for layer, lc in enumerate(cache.layers):
        label, score = scores_of(lc, policy)
        notes.setdefault(score is not None, label)
        rows = {"held": [], "merged": [], "into": [], "score": []}
        for h, pos in enumerate(lc.positions[0]):  # pos (S,)
            order = pos.argsort()
            order = order[pos[order] < n]  # row 0's real entries in position order (pads sit at position PAD)
            kept = pos[order].numpy()
            rows["held"].append(bitset(kept, n))
            if score is not None:
                rows["score"].append(b64(score[h][order].numpy().astype("<f4")))
            gone = np.setdiff1d(np.arange(n), kept)  # evicted positions, ascending
            target, weight = np.full(len(gone), -1), np.zeros(len(gone))
            if (layer, h) in merges:
                e, q, w = (torch.cat(x).numpy() for x in zip(*merges[(layer, h)]))
                at = np.searchsorted(gone, e)
                target[at], weight[at] = q, w  # -1: dropped, not merged
            done = target >= 0
            rows["merged"].append(bitset(gone[done], n))
            rows["into"].append(b64(target[done].astype(width)) + "," + b64(np.round(weight[done] * 10000).astype("<i2")))
        for key, out in (("held", held), ("merged", merged), ("into", into)):
            out.append(rows[key])
        scores.append(rows["score"] if score is not None else None)  # None: no score in this layer
    windows = []
    for layer in range(L):
        if policy is None or not policy.run.compresses or layer in protected:
            windows.append(None)
            continue
        end = policy.run.prompt_end if policy.schedule == "prefill" else n
        windows.append([policy.sinks, end - policy.recent(policy.budgets[layer]), end])
    return {
        "name": name or (policy.name if policy is not None else "full"),
        "heads": cache[0].positions.shape[1],
        "seen": n,
        "generated": list(generated),
        "budgets": policy.budgets if policy is not None else None,
        "protected": sorted(protected),
        "windows": windows,  # per layer [sinks, window start, window end) or None (not compressed)
        "held": held,
        "merged": merged if trace is not None else None,
        "into": into if trace is not None else None,
        "into_bytes": int(width[-1]),
        "scores": scores if True in notes else None,
        "score_note": notes.get(True, notes.get(False)),
        "kv_bytes": cache.nbytes(),
        "aux_bytes": aux_nbytes(cache),  # the method's per-token statistics beside K/V
    }


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text; a character split across tokens shows with the token that completes it."""
    from kvmini.tokenizer import StreamDecoder

    stream = StreamDecoder(tokenizer)
    return [stream.push(i) for i in ids]


def page(prompt: list[str], panels: list[dict], title: str) -> str:
    """The HTML of the page: the template with its data inlined (`</script>` cannot occur in it)."""
    blob = json.dumps({"tokens": prompt, "panels": panels}, separators=(",", ":")).replace("<", "\\u003c")
    return TEMPLATE.read_text(encoding="utf-8").replace("{{TITLE}}", html.escape(title)).replace("{{DATA}}", blob)


def write_html(path, cache: KVCache, tokenizer, prompt: list[int], generated: list[int] = (), policy=None, trace=None,
               name: str | None = None) -> Path:
    """Write the page of one finished run: its cache, the prompt's ids and the generated ones (those the
    cache saw are shown), the policy that ran and its merge trace (`record_merges`, else None)."""
    return write_comparison(path, [(cache, policy, trace, name, list(generated))], tokenizer, prompt)


def write_comparison(path, runs: list[tuple], tokenizer, prompt: list[int], title: str | None = None,
                     after: str = "generated", parts: list[int | None] | None = None) -> Path:
    """One page, one text per run of the same prompt: runs are (cache, policy, trace, name, generated ids);
    `after` names the tokens after the prompt (for several prompts: later prompts and answers); parts: per
    run, the index in its generated ids from which its answer differs from the full cache's (run.py
    --compare), or None."""
    parts = parts or [None] * len(runs)
    panels = [panel(cache, policy, trace, name, token_texts(tokenizer, new[: cache.seen_tokens - len(prompt)]))
              | {"after": after, "parts": at} for (cache, policy, trace, name, new), at in zip(runs, parts)]
    title = title or "kvmini: what " + ", ".join(p["name"] for p in panels) + " kept"
    path = Path(path)
    path.write_text(page(token_texts(tokenizer, prompt), panels, title), encoding="utf-8")
    return path


def write_turns(path, turns: list, tokenizer, trace, name: str, context=None, parts=None) -> Path:
    """One page of a run of several prompts (kvmini.conversation): a text per turn, shaded by what the cache
    held after it (the copies `Turn.snapshot`). context: for --question, (its ids, its compressed cache,
    the policy after it), shown first; each question's text then continues the context alone. parts: per
    question, where its answer parts from the full cache's (an index in the answer), or None."""
    runs = []
    if context is None:  # a chat: every turn continues the one before, so each text runs on from the first turn
        prompt, fed = turns[0].ids, []
        for t in turns:
            fed += (t.ids if t is not turns[0] else []) + t.result.tokens[0][: t.result.decode_steps]
            cache, policy = t.snapshot
            runs.append((cache, policy, trace_of(policy), f"after {t.label}", list(fed)))
    else:
        prompt, cache, policy = context
        runs.append((cache, policy, trace, "the context, before any question", []))
        for t in turns:
            cache, policy = t.snapshot
            runs.append((cache, policy, trace_of(policy), t.label, t.ids + t.result.tokens[0][: t.result.decode_steps]))
        if parts is not None:  # the context's text first, then each question's, whose answer follows its ids
            parts = [None] + [None if at is None else len(t.ids) + at for t, at in zip(turns, parts)]
    return write_comparison(path, runs, tokenizer, prompt, title=f"kvmini: what {name} kept, prompt by prompt",
                            after="later prompts and answers" if context is None else "question and answer",
                            parts=parts)


def trace_of(policy) -> list[Merged] | None:
    """The merges a policy's compressor has recorded so far (`record_merges`), or None (also for the full
    cache, which runs no policy)."""
    merger = None if policy is None else policy.merger
    return None if merger is None else merger.trace


def run_method(model, ids: torch.Tensor, spec: str, budget: float | None, max_new_tokens: int = 1) -> tuple:
    """Generate greedily with one method (a fidelity-style spec, e.g. "d2o[variant=paper]"), its merges
    recorded: (cache, policy, trace, name, generated ids)."""
    from kvmini.generate import generate
    from kvmini.methods.registry import policy_for

    policy = policy_for(spec, budget)
    trace = record_merges(policy)
    result = generate(model, ids, max_new_tokens, policy=policy)
    return result.cache, policy, trace, spec, result.tokens[0]


def main(argv=None) -> int:
    p = cli.OneLineParser(prog="python -m kvmini.view",
                          description="One web page of what several methods keep of the same prompt.")
    p.add_argument("--methods", nargs="+", required=True, help="method names or specs, e.g. h2o snapkv d2o[variant=paper]")
    p.add_argument("--prompt", type=cli.path, required=True, help="UTF-8 text file")
    p.add_argument("--out", type=cli.path, required=True, help="the HTML file to write (checked before the work)")
    p.add_argument("--model", type=cli.path, help="HF-layout checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--budget", type=cli.budget, default=None,
                   help="a ratio of the prompt (0.2, 1.0) or whole tokens per layer (128) (default: 0.2)")
    p.add_argument("--max-new-tokens", type=cli.at_least(1), default=8, help="tokens generated after the prompt (default: 8)")
    p.add_argument("--raw", action="store_true", help="no chat template")
    return cli.run(lambda: compare(p.parse_args(argv)), imports=LAZY_IMPORTS)


def compare(args) -> int:
    from kvmini.chat import load_chat_format
    from kvmini.loading import load_model
    from kvmini.methods.registry import DEFAULT_BUDGET, as_run, make_policy, parse_spec
    from kvmini.report import cache_summary
    from kvmini.tokenizer import load_tokenizer
    from kvmini.weights import DEFAULT_MODEL_DIR, ensure_default_model

    seen = {}
    for spec in args.methods:  # unknown names, options and budgets fail before the model loads
        name, given = ("full", {}) if spec == "full" else parse_spec(spec)
        key = as_run(spec)  # by value: `adakv` and `adakv[alpha=0.2]` are one method
        if key in seen:
            raise KvminiError(f"--methods names one method twice ({seen[key]}, {spec}): each gets one text on the page")
        seen[key] = spec
        if args.budget is not None:
            make_policy(name, args.budget, **given)  # as run.py: full and self-budgeted methods take no --budget
    cli.writable_file(cli.not_an_input(args.out, "--out", args.prompt, args.model or DEFAULT_MODEL_DIR), "--out")
    out, text = Path(args.out), cli.read_prompt(args.prompt)  # as run.py reads it
    folder = Path(args.model) if args.model else ensure_default_model()
    model, tok = load_model(folder, "cpu", "float32"), load_tokenizer(folder)
    chat = None if args.raw else load_chat_format(folder)
    prompt = tok.encode(chat.render([{"role": "user", "content": text}]) if chat else text)
    cli.prompt_fits(prompt, args.max_new_tokens, model.config.max_position_embeddings, args.prompt)
    ids = torch.tensor([prompt])
    runs = []
    for spec in args.methods:
        runs.append(run_method(model, ids, spec, DEFAULT_BUDGET if args.budget is None else args.budget,
                               args.max_new_tokens))
        cache, policy = runs[-1][:2]
        note = f"; {policy.run.note}" if policy is not None and policy.run.note else ""  # e.g. a budget raised to fit
        print(f"{spec}: {cache_summary(cache)}{note}", file=sys.stderr)
    write_comparison(out, runs, tok, prompt)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
