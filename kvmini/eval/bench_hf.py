"""Benchmark: kvmini vs HF transformers generate() on the default model, same process, side by side.

    python -m kvmini.eval.bench_hf [--prompt-tokens 2048] [--new-tokens 128] [--repeats 3] [--dtype bfloat16]
    python -m kvmini.eval.bench_hf --out results/hf/bench.json [--dtype bfloat16]   # also record it

With --out the run is recorded under its dtype in that JSON file (other dtypes' entries stay), with
the command, commit, date and machine: docs/speed.md's tables are written from it (kvmini.eval.docs).

Both libraries are measured the same way, alternating, and the median of `repeats` is kept:
    time to first token (TTFT) = wall time of generating 1 token after the prompt
    decode tokens/s            = new_tokens / (time(1 + new_tokens tokens) - time(1 token))
Decode is memory-bound, so we also print the share of the machine's memory bandwidth that
decoding reaches: bytes read per token (weights + KV cache) * tokens/s / measured copy bandwidth.
Then it profiles kvmini's decode steps: where the time per token goes (the weights' matmuls,
attention's matmuls, every other tensor op, and Python between them), next to the floor that
memory bandwidth sets. Absolute times vary between runs on shared machines; compare the ratios.
"""
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from kvmini import cli

cli.exit_on_ctrl_c(__name__)  # before the imports below
import torch  # noqa: E402

from kvmini.errors import KvminiError  # noqa: E402


def copy_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (each byte is read once and written once)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = cli.OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=cli.at_least(1), default=2048)
    p.add_argument("--new-tokens", type=cli.at_least(1), default=128)
    p.add_argument("--repeats", type=cli.at_least(1), default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=cli.path, help="record the run in this JSON file, under its dtype (checked before the work)")
    argv = sys.argv[1:] if argv is None else argv
    return cli.run(lambda: benchmark(p.parse_args(argv), argv))


def benchmark(args, argv: list[str]) -> int:
    dtype = getattr(torch, args.dtype)
    out = cli.writable_file(args.out, "--out") if args.out else None
    recorded = read_record(out) if out else {}
    load = os.getloadavg()[0]
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise KvminiError("this benchmark needs HF transformers (pip install -r requirements-dev.txt)") from None
    import pydoc_data.topics

    from kvmini.generate import generate
    from kvmini.loading import load_model
    from kvmini.tokenizer import load_tokenizer
    from kvmini.weights import ensure_default_model

    folder = ensure_default_model()
    ours = load_model(folder, "cpu", args.dtype)
    context = ours.config.max_position_embeddings
    if args.prompt_tokens + max(args.new_tokens, 32) + 1 > context:  # the profile decodes 32 steps
        raise KvminiError(f"--prompt-tokens {args.prompt_tokens} with --new-tokens {args.new_tokens} exceeds the "
                          f"model's context of {context} tokens")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    text = "\n".join(pydoc_data.topics.topics.values())
    ids = torch.tensor([load_tokenizer(folder).encode(text)[: args.prompt_tokens]])
    n = args.new_tokens

    def run_ours(k):
        return generate(ours, ids, k)

    def run_hf(k):
        with torch.inference_mode():
            return hf.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, eos_token_id=None,
                               pad_token_id=0)

    print(f"SmolLM2-135M-Instruct, CPU {args.dtype}, {torch.get_num_threads()} threads, prompt {ids.shape[1]} tokens, "
          f"{n} new tokens, median of {args.repeats}")
    same = run_ours(16).tokens[0] == run_hf(16)[0, ids.shape[1]:].tolist()  # warm-up + sanity
    times = {"kvmini": {"ttft": [], "full": []}, "hf": {"ttft": [], "full": []}}
    for r in range(args.repeats):
        for name, fn in (("kvmini", run_ours), ("hf", run_hf)):
            times[name]["ttft"].append(timed(lambda: fn(1)))
            times[name]["full"].append(timed(lambda: fn(1 + n)))
        print(f"  repeat {r + 1}/{args.repeats} done", flush=True)
    res = {}
    for name, t in times.items():
        ttft, full = statistics.median(t["ttft"]), statistics.median(t["full"])
        res[name] = (ttft, n / (full - ttft))
    bw = copy_bandwidth()
    weights = sum(p.numel() * p.element_size() for p in ours.parameters())  # tied lm_head counted once
    kv_per_token = 2 * ours.config.num_layers * ours.config.num_kv_heads * ours.config.head_dim * dtype.itemsize
    bytes_per_token = weights + kv_per_token * (ids.shape[1] + n / 2)  # mean cache length while decoding
    print(f"greedy tokens identical: {same}")
    print(f"{'':8} {'TTFT s':>8} {'decode tok/s':>13} {'bandwidth share':>16}")
    for name, (ttft, rate) in res.items():
        print(f"{name:8} {ttft:8.3f} {rate:13.1f} {bytes_per_token * rate / bw:16.1%}")
    print(f"ratios   TTFT kvmini/hf = {res['kvmini'][0] / res['hf'][0]:.2f} (target <= 1.0), "
          f"decode kvmini/hf = {res['kvmini'][1] / res['hf'][1]:.2f}x (target >= 1.5x)")
    print(f"bytes read per decode token {bytes_per_token / 2**20:.0f} MiB, copy bandwidth {bw / 1e9:.1f} GB/s")
    profile = decode_profile(ours, ids, bytes_per_token / bw)
    if out:
        from kvmini.eval.provenance import commit

        recorded[args.dtype] = {
            "command": shlex.join(["python", "-m", "kvmini.eval.bench_hf", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(),
            "machine": {"threads": torch.get_num_threads(), "load_at_start": round(load, 1)},
            "prompt_tokens": ids.shape[1], "new_tokens": n, "repeats": args.repeats, "same_tokens": same,
            **{name: {"ttft_s": round(ttft, 4), "decode_tokens_per_s": round(rate, 2)} for name, (ttft, rate) in res.items()},
            "bytes_per_token": bytes_per_token, "copy_bandwidth": round(bw), "profile": profile}
        out.write_text(json.dumps(recorded, indent=1) + "\n")
        print(f"recorded under {args.dtype} in {out}")
    return 0


def table(recorded: dict) -> str:
    """docs/speed.md's table and profile of the recorded runs (one per dtype)."""
    rows = ["| dtype | TTFT kvmini / HF | decode kvmini (tokens/s) | decode HF | kvmini / HF | greedy tokens equal |",
            "|---|---|---|---|---|---|"]
    notes = []
    for dtype, r in recorded.items():
        ours, hf, prof = r["kvmini"], r["hf"], r["profile"]
        rows.append(f"| {dtype} | {ours['ttft_s'] / hf['ttft_s']:.2f} ({ours['ttft_s']:.2f} s) | "
                    f"{ours['decode_tokens_per_s']:.1f} | {hf['decode_tokens_per_s']:.1f} | "
                    f"{ours['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.2f}x | {'yes' if r['same_tokens'] else 'no'} |")
        parts = prof["parts_ms"]
        notes.append(f"- {dtype} ({r['prompt_tokens']:,}-token prompt, {r['new_tokens']} new tokens, median of "
                     f"{r['repeats']}): {prof['ms_per_token']:.1f} ms per step ({prof['op_calls']:,} op calls): the linear "
                     f"layers {parts['weights (linear layers)']:.1f} ms, against {prof['floor_ms']:.1f} ms for the "
                     f"bytes a step reads at the measured copy bandwidth ({r['copy_bandwidth'] / 1e9:.1f} GB/s); "
                     f"attention {parts['attention (q K^T, softmax, p V)']:.1f} ms, other tensor ops "
                     f"{parts['other tensor ops']:.1f} ms, Python between ops {parts['Python between ops']:.1f} ms")
    runs = "; ".join(f"`{r['command']}` at commit {r['commit']}, {r['date']}, {r['machine']['threads']} threads, "
                     f"load average {r['machine']['load_at_start']} at its start" for r in recorded.values())
    return ("\n".join(rows) + "\n\nWhere kvmini's decode step goes (torch.profiler's self time per kind of op, which "
            "inflates small ops):\n\n" + "\n".join(notes) + f"\n\nRecorded by {runs} (results/hf/bench.json).")


def read_record(path: Path) -> dict:
    """The file's entries by dtype, {} for a new file; anything else is refused before the work."""
    if not path.exists() or not path.stat().st_size:
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise KvminiError(f"--out {path} is not a JSON file of this benchmark's runs") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) and "kvmini" in v for v in data.values()):
        raise KvminiError(f"--out {path} is not a JSON file of this benchmark's runs")
    return data


WEIGHTS = {"aten::mm", "aten::addmm", "aten::linear"}  # x W^T of the linear layers (one query row)
ATTENTION = {"aten::bmm", "aten::_softmax"}  # q K^T, softmax, p V over the cache


@torch.inference_mode()
def decode_profile(model, ids: torch.Tensor, floor_s: float, steps: int = 16) -> dict:
    """Where kvmini's decode time per token goes, from torch.profiler's self time per op (printed, and
    returned in ms for the record)."""
    from kvmini.generate import prefill

    cache = model.new_cache(1, ids.shape[1] + 2 * steps + 1)
    nxt = prefill(model, ids, cache).argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = model(nxt, cache)[:, -1].argmax(-1, keepdim=True)
    wall = (time.perf_counter() - t0) / steps  # unprofiled
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            nxt = model(nxt, cache)[:, -1].argmax(-1, keepdim=True)
    parts = {"weights (linear layers)": 0.0, "attention (q K^T, softmax, p V)": 0.0, "other tensor ops": 0.0}
    calls = 0
    for e in prof.key_averages():
        key = "weights (linear layers)" if e.key in WEIGHTS else (
            "attention (q K^T, softmax, p V)" if e.key in ATTENTION else "other tensor ops")
        parts[key] += e.self_cpu_time_total / 1e6 / steps
        calls += e.count / steps
    parts["Python between ops"] = max(wall - sum(parts.values()), 0.0)
    print(f"kvmini decode profile: {wall * 1e3:.1f} ms per token; self time per op kind (torch.profiler, which "
          f"inflates small ops), {calls:.0f} op calls per token:")
    for name, t in parts.items():
        print(f"  {name:34} {t * 1e3:6.1f} ms  {t / wall:6.1%}")
    print(f"  {'floor: bytes read / copy bandwidth':34} {floor_s * 1e3:6.1f} ms")
    return {"ms_per_token": round(wall * 1e3, 2), "op_calls": round(calls),
            "parts_ms": {name: round(t * 1e3, 2) for name, t in parts.items()}, "floor_ms": round(floor_s * 1e3, 2)}


if __name__ == "__main__":
    sys.exit(main())
