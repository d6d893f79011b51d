"""Speed and memory of each method against the full cache, measured side by side in one run.

    prefill ratio   time to prefill (and compress) n tokens / the full cache's time; the methods
                    are timed in turns, `reps` rounds, and each keeps its median
    decode ratio    decode tokens/s after an n-token prompt at the budget / the full cache's, over
                    `steps` steps after the first decode step; that first step is timed apart
                    ("first step"), since a method may compress there (D2O's official variant)
    policy time     time inside the method's hooks (scoring, budgeting, compressing): seconds per
                    prefill, ms per decode step and its share of the step; the rest of a method's extra
                    time is its attention statistics (computed in the attention pass)
    policy ops      tensor operations the hooks run in one decode step (a torch.profiler count)
    kept bytes      K/V bytes the cache holds after the prompt / the full cache's; for a method whose
                    schedule compresses at the first decode step (D2O's official variant), after
                    that step (an untimed extra call), when it has compressed
    peak memory     growth of the process's peak resident memory during an n-token prefill,
                    measured in a fresh child process per method (the peak is reset after the
                    model is loaded and has run once; glibc's mmap threshold fixed, see
                    MEASURED_ALLOCATOR), / the full cache's growth
    batch (CUDA)    the largest batch (a power of two) whose prefill + decode stays under a
                    GPU memory cap, and its decode throughput in tokens/s (D2O Table 5 style)

Times on a shared machine are noisy: read the ratios, not the seconds.
    python -m kvmini.eval.speed --peak METHOD --n N --budget B    (one child measurement; JSON on stdout)
    python -m kvmini.eval.speed --first-step METHOD --n N          (where the first decode step's time goes)
    python -m kvmini.eval.speed --step METHOD --n N [--after 16 --steps 4]   (where later decode steps' time goes)
    python -m kvmini.eval.speed --ops [METHOD ...]   (ops of one steady-state decode step, batch 1 and 8: kvmini.eval.ops)

Why the op count: on a GPU a decode step is bound by the kernels it launches, not the bytes it reads,
and on a CPU each small op costs microseconds too; the count is exact on any machine (docs/speed.md,
"Ops per decode step").
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from kvmini import cli
from kvmini.errors import KvminiError
from kvmini.generate import prefill, synchronize
from kvmini.eval.ops import OPS, ops_table, record_ops
from kvmini.methods.registry import METHODS, policy_for
from kvmini.report import full_nbytes


POLICY = "kvmini.method"  # the profiler label of the method's hooks (ops_per_step)


class Timed:
    """A method's policy whose hooks are timed: `seconds` adds up the time spent in `before`,
    `after_attention` and `after_layers` (scoring, budgeting, compressing). Attention statistics are computed
    inside the attention pass, so they count as model time. CPU wall time (no CUDA synchronization).
    `marked`: the hooks also run under a profiler label (see ops_per_step)."""

    def __init__(self, policy):
        self.policy, self.seconds, self.marked = policy, 0.0, False

    def __getattr__(self, name):
        if name == "policy":  # not set yet (copy.deepcopy builds the object before its state)
            raise AttributeError(name)
        return getattr(self.policy, name)

    def _timed(self, hook, *args):
        t0 = time.perf_counter()
        if self.marked:
            with torch.profiler.record_function(POLICY):
                out = hook(*args)
        else:
            out = hook(*args)
        self.seconds += time.perf_counter() - t0
        return out

    def before(self, cache, step):
        return self._timed(self.policy.before, cache, step)

    def after_attention(self, layer: int, cache, stats: dict, step) -> None:
        self._timed(self.policy.after_attention, layer, cache, stats, step)

    def after_layers(self, cache, step) -> None:
        self._timed(self.policy.after_layers, cache, step)


def ops_per_step(model, nxt: torch.Tensor, cache, policy: Timed) -> int:
    """How many tensor operations the policy runs in one decode step of `nxt` (1, 1): the aten ops called
    directly inside its hooks (views included), counted by torch.profiler, not estimated."""
    policy.marked = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(nxt, cache, policy)
    policy.marked = False
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is not None and e.cpu_parent.name == POLICY)


def _policy(name: str, budget: float):
    policy = policy_for(name, budget)
    return None if policy is None else Timed(policy)


@torch.inference_mode()
def prefill_times(model, ids: torch.Tensor, methods: list[str], budget: float, reps: int = 1, log=print) -> dict:
    """method -> {"seconds": median prefill time, "ratio": / full's, "kept_bytes_ratio"} over `reps` turns.
    kept_bytes_ratio: after the prompt, or after the first decode step for the "decode" schedule (module docstring)."""
    times = {name: [] for name in ["full", *methods]}
    hooks = {name: [] for name in times}
    kept = {}
    prefill(model, ids, model.new_cache(1, ids.shape[1]), None)  # warm up the kernels: the first timed method is full
    for rep in range(reps):
        for name in times:
            cache = model.new_cache(1, ids.shape[1])
            policy = _policy(name, budget)
            t0 = time.perf_counter()
            logits = prefill(model, ids, cache, policy, total_len=ids.shape[1])
            synchronize(model.device)
            times[name].append(time.perf_counter() - t0)
            hooks[name].append(0.0 if policy is None else policy.seconds)
            if policy is not None and policy.schedule == "decode":  # it compresses at the first decode step: take it
                model(logits.argmax(-1, keepdim=True), cache, policy)
            kept[name] = cache.nbytes() / full_nbytes(cache)
            log(f"prefill {ids.shape[1]} tokens, round {rep + 1}/{reps}, {name}: {times[name][-1]:.2f} s")
    full = statistics.median(times["full"])
    return {name: {"seconds": statistics.median(t), "ratio": statistics.median(t) / full,
                   "policy_s": statistics.median(hooks[name]), "kept_bytes_ratio": kept[name]}
            for name, t in times.items()}


@torch.inference_mode()
def decode_speed(model, ids: torch.Tensor, methods: list[str], budget: float, steps: int = 32, rounds: int = 1,
                 log=print) -> dict:
    """method -> {"tokens_per_s", "ratio": / full's, ...} for decode steps after the prompt ids (1, n).

    Every method prefills and takes its first decode step (timed apart). Then `rounds` rounds of `steps` steps, interleaved: at each step every run decodes one token, in
    an order rotated from step to step, so that a slow moment of a shared machine falls on all of them
    alike. A run's round is the sum of its `steps` step times; each run keeps its median round, and
    "rounds_s" records every round. The policy's time and share are of the same rounds."""
    total = decode_length(ids.shape[1], steps, rounds)
    run_id = f"{time.time():.0f}-{os.getpid()}"  # rows of one run pair their rounds (kvmini.eval.tables.paired)
    runs = {}
    for name in ["full", *methods]:
        policy = _policy(name, budget)
        cache = model.new_cache(1, total)
        nxt = prefill(model, ids, cache, policy, total_len=total).argmax(-1, keepdim=True)  # (1, 1)
        synchronize(model.device)
        t0 = time.perf_counter()
        nxt = model(nxt, cache, policy)[:, -1].argmax(-1, keepdim=True)  # the first decode step
        synchronize(model.device)
        runs[name] = {"policy": policy, "cache": cache, "next": nxt, "first_step_s": time.perf_counter() - t0}
    order = list(runs.values())
    for run in order:
        run["rounds_s"], run["policy_rounds_s"] = [], []
    for r in range(rounds):
        for run in order:
            run["rounds_s"].append(0.0)
            run["policy_rounds_s"].append(0.0)
        for step in range(steps):
            turn = (r * steps + step) % len(order)
            for run in order[turn:] + order[:turn]:
                policy, hooks = run["policy"], 0.0 if run["policy"] is None else run["policy"].seconds
                t1 = time.perf_counter()
                run["next"] = model(run["next"], run["cache"], policy)[:, -1].argmax(-1, keepdim=True)
                synchronize(model.device)
                run["rounds_s"][-1] += time.perf_counter() - t1
                run["policy_rounds_s"][-1] += 0.0 if policy is None else policy.seconds - hooks
        log(f"decode after {ids.shape[1]} tokens, round {r + 1}/{rounds}: "
            + ", ".join(f"{name} {steps / run['rounds_s'][-1]:.1f}" for name, run in runs.items()) + " tokens/s")
    measured = {}
    for name, run in runs.items():
        seconds, policy_s = statistics.median(run["rounds_s"]), statistics.median(run["policy_rounds_s"])
        measured[name] = {"tokens_per_s": steps / seconds, "policy_ms_per_step": policy_s / steps * 1e3,
                          "policy_share": policy_s / seconds, "rounds_s": run["rounds_s"],
                          "ops_per_step": 0 if run["policy"] is None else ops_per_step(model, run["next"], run["cache"], run["policy"])}
    out = {}
    for name in ["full", *methods]:
        out[name] = dict(measured[name], first_step_s=runs[name]["first_step_s"], run=run_id)
        log(f"decode after {ids.shape[1]} tokens, {name}: {out[name]['tokens_per_s']:.1f} tokens/s "
            f"(first step {out[name]['first_step_s']:.2f} s; policy {out[name]['policy_share']:.1%} of a step, "
            f"{out[name]['ops_per_step']} ops)")
    for name in out:
        out[name]["ratio"] = out[name]["tokens_per_s"] / out["full"]["tokens_per_s"]
    return out


def decode_length(n: int, steps: int, rounds: int) -> int:
    """The longest sequence `decode_speed` runs after an n-token prompt: its first decode step, the
    rounds, and the step `ops_per_step` profiles."""
    return n + 1 + steps * rounds + 1


@torch.inference_mode()
def batch_under_cap(model, ids: torch.Tensor, methods: list[str], budget: float, cap_gib: float, steps: int = 16,
                    max_batch: int = 1024, log=print) -> dict:
    """CUDA only. method -> {"batch", "tokens_per_s", "peak_gib"} of the largest batch (up to max_batch) of
    copies of ids (1, n) whose peak allocated GPU memory (weights included) stays under cap_gib;
    None if not even batch 1 fits."""
    out = {}
    for name in ["full", *methods]:
        best, B = None, 1
        while B <= max_batch:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(model.device)
            try:
                policy = _policy(name, budget)
                cache = model.new_cache(B, ids.shape[1] + steps)
                nxt = prefill(model, ids.expand(B, -1), cache, policy, total_len=ids.shape[1] + steps).argmax(-1)[:, None]
                synchronize(model.device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    nxt = model(nxt, cache, policy)[:, -1].argmax(-1, keepdim=True)
                synchronize(model.device)
                seconds = time.perf_counter() - t0
            except torch.cuda.OutOfMemoryError:
                break
            finally:
                cache = None
            peak = torch.cuda.max_memory_allocated(model.device) / 2**30
            if peak > cap_gib:
                break
            best, B = {"batch": B, "tokens_per_s": B * steps / seconds, "peak_gib": peak}, 2 * B
        out[name] = best
        log(f"largest batch under {cap_gib:g} GiB, {name}: {best}")
    return out


def _memory_kib() -> dict:
    status = open("/proc/self/status").read()
    return {key: int(re.search(key + r":\s+(\d+)", status).group(1)) for key in ("VmRSS", "VmHWM")}


# glibc's malloc otherwise raises its mmap threshold after the first large free and then keeps freed
# blocks of up to 32 MiB in its heap: the peak would measure the allocator's caching (it varied by 1.7x
# between runs of one method). With a fixed threshold, large tensors are returned when freed.
MEASURED_ALLOCATOR = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def peak_memory(methods: list[str], n: int, budget: float, model_folder: str | None, log=print) -> dict:
    """method -> {"peak_growth_mib", "ratio": / full's}, each measured in its own child process (Linux)."""
    out = {}
    for name in ["full", *methods]:
        cmd = [sys.executable, "-m", "kvmini.eval.speed", "--peak", name, "--n", str(n), "--budget", str(budget)]
        if model_folder:
            cmd += ["--model", str(model_folder)]
        child = subprocess.run(cmd, capture_output=True, text=True, env=MEASURED_ALLOCATOR)
        if child.returncode != 0:
            raise RuntimeError(f"peak-memory child for {name} failed: {child.stderr.strip().splitlines()[-1:]}")
        out[name] = json.loads(child.stdout)
        log(f"peak memory growth in a {n}-token prefill, {name}: {out[name]['peak_growth_mib']:.0f} MiB")
    for name in out:
        out[name]["ratio"] = out[name]["peak_growth_mib"] / out["full"]["peak_growth_mib"]
    return out


def _peak_child(name: str, n: int, budget: float, model_folder: str | None) -> dict:
    from kvmini.eval.fidelity import pydoc_text
    from kvmini.loading import load_model
    from kvmini.tokenizer import load_tokenizer
    from kvmini.weights import ensure_default_model

    folder = model_folder or ensure_default_model(log=lambda m: None)
    model = load_model(folder, "cpu", "float32")
    ids = torch.tensor([load_tokenizer(folder).encode(pydoc_text())[:n]])
    policy = _policy(name, budget)
    with torch.inference_mode():
        model(ids[:, :16], model.new_cache(1, 16))  # page in the weights and warm the kernels first
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak) to the current resident size
    before = _memory_kib()["VmRSS"]
    with torch.inference_mode():
        cache = model.new_cache(1, n)
        prefill(model, ids, cache, policy, total_len=n)
    return {"peak_growth_mib": (_memory_kib()["VmHWM"] - before) / 1024, "kept_mib": cache.nbytes() / 2**20}


def step_profile(method: str, n: int, budget: float, model_folder: str | None, after: int = 0, steps: int = 1,
                 rows: int = 8) -> str:
    """Where a method's decode steps after an n-token prompt spend their time: `steps` steps after `after`
    untimed ones (after = 0: the first decode step, where D2O's official variant compresses the whole
    prompt). Their wall time and the time in the policy's hooks per step, then the tensor operations by self
    CPU time per step (torch.profiler, grouped by operation and input shapes), the `rows` largest with their
    share of the profiled total."""
    from kvmini.eval.fidelity import pydoc_text
    from kvmini.loading import load_model
    from kvmini.tokenizer import load_tokenizer
    from kvmini.weights import ensure_default_model

    folder = model_folder or ensure_default_model(log=lambda m: None)
    model = load_model(folder, "cpu", "float32")
    ids = torch.tensor([load_tokenizer(folder).encode(pydoc_text())[:n]])
    if ids.shape[1] + after + steps > model.config.max_position_embeddings:
        raise KvminiError(f"--n {n} with --after {after} and --steps {steps} is past the model's "
                          f"{model.config.max_position_embeddings:,}-token context")
    total = ids.shape[1] + after + steps
    with torch.inference_mode():
        policy = _policy(method, budget)
        cache = model.new_cache(1, total)
        nxt = prefill(model, ids, cache, policy, total_len=total).argmax(-1, keepdim=True)  # (1, 1)
        for _ in range(after):
            nxt = model(nxt, cache, policy)[:, -1].argmax(-1, keepdim=True)
        hooks = 0.0 if policy is None else policy.seconds
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                nxt = model(nxt, cache, policy)[:, -1].argmax(-1, keepdim=True)
            wall = (time.perf_counter() - t0) / steps
        hooks = (0.0 if policy is None else policy.seconds - hooks) / steps
    ops = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total_us = sum(e.self_cpu_time_total for e in ops)
    which = "first decode step" if after == 0 and steps == 1 else f"decode steps {after + 1} to {after + steps}"
    lines = [f"{method}: {which} after {n:,} tokens at budget {budget:g}: {wall:.3f} s per step (profiled), "
             f"{hooks * 1e3:.2f} ms of it in the policy's hooks, cache {cache.nbytes() / full_nbytes(cache):.3f} "
             "of the full cache after it",
             f"{'operation':<28} {'self CPU':>10} {'share':>7} {'calls':>7}  input shapes"]
    lines += [f"{e.key:<28} {e.self_cpu_time_total / 1e6 / steps:>8.4f} s {e.self_cpu_time_total / total_us:>7.1%} "
              f"{e.count / steps:>7,.0f}  {e.input_shapes}" for e in ops[:rows]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = cli.OneLineParser(description=__doc__.splitlines()[0])
    job = p.add_mutually_exclusive_group(required=True)
    job.add_argument("--peak", metavar="METHOD", help="method whose prefill peak memory to measure (JSON on stdout)")
    job.add_argument("--first-step", metavar="METHOD", help="method whose first decode step to profile")
    job.add_argument("--step", metavar="METHOD", help="method whose decode steps to profile (after --after steps)")
    job.add_argument("--ops", metavar="METHOD", nargs="*", help="ops of one steady-state decode step, batch 1 and 8, "
                     "per method (none named: every method)")
    p.add_argument("--n", type=cli.at_least(1), help="prompt tokens (--ops: 512)")
    p.add_argument("--budget", type=cli.budget, default=0.2)
    p.add_argument("--after", type=cli.at_least(0), default=16, help="--step: untimed decode steps before the profiled ones")
    p.add_argument("--steps", type=cli.at_least(1), default=4, help="--step: decode steps profiled")
    p.add_argument("--model")
    p.add_argument("--out", help=f"--ops: also record the counts in this JSON file (docs/speed.md's: {OPS})")
    a = p.parse_args(argv)
    if a.n is None and a.ops is None:
        p.error("the following arguments are required: --n")
    if unknown := [m for m in a.ops or [] if m not in METHODS]:
        p.error(f"--ops: unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")

    def work() -> int:
        if a.peak:
            print(json.dumps(_peak_child(a.peak, a.n, a.budget, a.model)))
        elif a.ops is not None:
            n = a.n or 512
            print(f"ops of one steady-state decode step, SmolLM2's shape (random weights), {n}-token prompts, "
                  f"budget {a.budget:g}; batch 1 and batch 8, each / the full cache's")
            table = ops_table(a.ops or [m for m in METHODS if m != "full"], n=n, budget=a.budget)
            if a.out:
                record_ops(table, n, a.budget, sys.argv[1:] if argv is None else argv, a.out)
        elif a.first_step:
            print(step_profile(a.first_step, a.n, a.budget, a.model))
        else:
            print(step_profile(a.step, a.n, a.budget, a.model, after=a.after, steps=a.steps))
        return 0
    return cli.run(work)


if __name__ == "__main__":
    sys.exit(main())
