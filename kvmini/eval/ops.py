"""Ops per steady-state decode step (issue 77; docs/speed.md, "Ops per decode step"): every aten op the
model, the cache and the method dispatch in one step, counted exactly by a dispatch mode, and the kernels
among them (the ops that are not views), per method at batch 1 and 8, against the full cache's.
The command is `python -m kvmini.eval.speed --ops`; tests/test_decode_ops.py holds the limits.
"""
import json
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvmini.config import ModelConfig
from kvmini.generate import prefill
from kvmini.methods.registry import policy_for
from kvmini.model import Transformer


class OpCount(TorchDispatchMode):
    """Counts every aten op dispatched while active (`n`, views included, as issue 77 counts them) and those
    that compute (`kernels`: not a view, what a GPU launches a kernel for): what a step dispatches, exactly."""

    def __init__(self):
        super().__init__()
        self.n = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.kernels += not func.is_view and func.overloadpacket.__name__ != "lift_fresh"
        return func(*args, **(kwargs or {}))


# SmolLM2-135M's shape (weights/SmolLM2-135M-Instruct/config.json): what `step_ops` counts on
SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True)
MERGING = ("d2o", "cam", "weightedkv", "snapkv_d2o")  # methods that merge while decoding
OPS_LIMIT = {"evicts": 1.3, "merges": 1.6}  # issue 77's limits: a step's ops / the full cache's


@torch.inference_mode()
def step_ops(model, method: str, batch: int, n: int = 512, budget: float = 0.2, warm: int = 3) -> OpCount:
    """The aten ops of one steady-state decode step (the model, the cache and the method): a batch of
    `batch` different random prompts of n tokens, `warm` decode steps, then the step counted."""
    ids = torch.randint(0, model.config.vocab_size, (batch, n), generator=torch.Generator().manual_seed(batch))
    policy = policy_for(method, budget)
    cache = model.new_cache(batch, n + warm + 1)
    nxt = prefill(model, ids, cache, policy).argmax(-1)[:, None]  # (B, 1)
    for _ in range(warm):
        nxt = model(nxt, cache, policy)[:, -1].argmax(-1, keepdim=True)
    with OpCount() as count:
        model(nxt, cache, policy)
    return count


def ops_table(methods: list[str], batches=(1, 8), n: int = 512, budget: float = 0.2, log=print) -> dict:
    """method -> {batch: (ops, kernels)} on a random-weight model of SmolLM2's shape (`OpCount`)."""
    torch.manual_seed(0)
    model = Transformer(SMOLLM2).eval()
    out = {}
    for name in ["full", *[m for m in methods if m != "full"]]:
        out[name] = {B: (c.n, c.kernels) for B in batches for c in [step_ops(model, name, B, n, budget)]}
        log(f"{name:<14}" + "".join(f"{ops:>9,} {ops / out['full'][B][0]:>6.2f}x  ({k / out['full'][B][1]:.2f}x kernels)"
                                    for B, (ops, k) in out[name].items()))
    return out


def ops_limit(method: str) -> float:
    """The most a step of `method` may cost, in full-cache steps (OPS_LIMIT)."""
    return OPS_LIMIT["merges" if method in MERGING else "evicts"]


OPS = "results/ops/decode_ops.json"  # what `--ops --out` records; docs/speed.md's table is written from it


def record_ops(table: dict, n: int, budget: float, argv: list[str], path: str) -> None:
    """Write `ops_table`'s counts to `path` with the command and the commit that made them."""
    from kvmini.eval import provenance

    out = {"command": " ".join(["python", "-m", "kvmini.eval.speed", *argv]), "commit": provenance.commit(),
           "date": provenance.now(), "n": n, "budget": budget,
           "ops": {name: {str(B): ops for B, (ops, _) in row.items()} for name, row in table.items()},
           "kernels": {name: {str(B): k for B, (_, k) in row.items()} for name, row in table.items()}}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def ops_markdown(res: dict) -> str:
    """docs/speed.md's table of ops per steady-state decode step (a results file of `record_ops`)."""
    full, kernels, L = res["ops"]["full"], res["kernels"], SMOLLM2.num_layers
    rows = ["| method | batch 1 | / full | more per layer | kernels / full | batch 8 | / full | kernels / full | limit |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, ops in res["ops"].items():
        cells = []
        for B in ("1", "8"):
            r = ops[B] / full[B]
            cells += [f"{ops[B]:,}", f"**{r:.2f}×**" if name != "full" and r > ops_limit(name) else f"{r:.2f}×"]
            cells += [f"{(ops[B] - full[B]) / L:.0f}"] if B == "1" else []
            cells += [f"{kernels[name][B] / kernels['full'][B]:.2f}×"]
        rows.append("| " + " | ".join([name, *cells, "" if name == "full" else f"{ops_limit(name):.1f}×"]) + " |")
    per_layer = {name: (ops["1"] - full["1"]) / L for name, ops in res["ops"].items()}
    over = [f"{name} {per_layer[name] - per_layer['h2o']:+.0f}" for name, ops in res["ops"].items()
            if name != "h2o" and ops["1"] / full["1"] > ops_limit(name)]
    return "\n".join([*rows, "", f"{res['n']}-token prompts, budget {res['budget']:g}; bold: above the limit (on "
                       "every op, views included); kernels: the ops that are not views. The full cache's step is "
                       f"{full['1'] / L:.0f} ops a layer, H2O's {per_layer['h2o']:.0f} more; above the limit, ops a "
                       f"layer beyond H2O's at batch 1: {', '.join(over) or 'none'}. "
                       f"Recorded by `{res['command']}` at {res['commit']} ({res['date']})."])
