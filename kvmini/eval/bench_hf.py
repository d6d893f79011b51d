"""Benchmark: kvmini vs HF transformers generate() on the default model, same process, side by side.

    python -m kvmini.eval.bench_hf [--prompt-tokens 2048] [--new-tokens 128] [--repeats 3] [--dtype bfloat16]

Both libraries are measured the same way, alternating, and the median of `repeats` is kept:
    time to first token (TTFT) = wall time of generating 1 token after the prompt
    decode tokens/s            = new_tokens / (time(1 + new_tokens tokens) - time(1 token))
Decode is memory-bound, so we also print the share of the machine's memory bandwidth that
decoding reaches: bytes read per token (weights + KV cache) * tokens/s / measured copy bandwidth.
Then it profiles kvmini's decode steps: where the time per token goes (the weights' matmuls,
attention's matmuls, every other tensor op, and Python between them), next to the floor that
memory bandwidth sets. Absolute times vary between runs on shared machines; compare the ratios.
"""
import statistics
import sys
import time

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
    return cli.run(lambda: benchmark(p.parse_args(argv)))


def benchmark(args) -> int:
    dtype = getattr(torch, args.dtype)
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
    decode_profile(ours, ids, bytes_per_token / bw)
    return 0


WEIGHTS = {"aten::mm", "aten::addmm", "aten::linear"}  # x W^T of the linear layers (one query row)
ATTENTION = {"aten::bmm", "aten::_softmax"}  # q K^T, softmax, p V over the cache


@torch.inference_mode()
def decode_profile(model, ids: torch.Tensor, floor_s: float, steps: int = 16) -> None:
    """Where kvmini's decode time per token goes, from torch.profiler's self time per op."""
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


if __name__ == "__main__":
    sys.exit(main())
