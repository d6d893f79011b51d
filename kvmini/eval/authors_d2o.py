"""D2O's released code (AIoT-MLSys-Lab/D2O, LLM_merge_new/LMEval_kv_token_merge/) run under kvmini's fidelity
protocol on CPU, for kvmini.eval.authors. Needs transformers 4.37 (PACKAGES) in --deps. Below, d2o.py is their
modeling_llama3_7b_13b_d2o.py and new.py their modeling_llama3_new.py; run_pred.py is
LLM_merge_new/run_pred_long_bench_sample.py. Their files are read, not edited.
"""
import contextlib
import io
import sys
import types
from pathlib import Path

REPO, COMMIT = "AIoT-MLSys-Lab/D2O", "12c99d8a99617574301be8a853bc7cb59e5c44e3"
FILES = ("LLM_merge_new/LMEval_kv_token_merge/modeling_llama3_new.py", "LLM_merge_new/LMEval_kv_token_merge/modeling_llama3_7b_13b_d2o.py")  # what the cross-check reads of the checkout (checked before any work)
PACKAGES = {"transformers": "4.37.2", "accelerate": "0.25.0", "tokenizers": "0.15.0", "huggingface-hub": "0.20.2"}
SPEC, BUDGET = "d2o[variant=official]", 0.2
FOLDER = "LLM_merge_new/LMEval_kv_token_merge"
PATCHES = [  # (their text, what runs instead, how often it occurs): the model's sizes, hard-coded for Llama-7B
    ("select_hh_scores[:, 0:4] = torch.full((32, 4), float('inf'))",
     "select_hh_scores[:, 0:4] = torch.full((num_heads, 4), float('inf'))", 1),
    (".unsqueeze(-1).repeat(1, 1, 1, 128)", ".unsqueeze(-1).repeat(1, 1, 1, head_dim)", 4),
]
ADAPTATIONS = [
    "d2o.py:346 sets the sink scores with torch.full((32, 4), inf), Llama-7B's 32 heads: (num_heads, 4), from the "
    "cache's shape at d2o.py:340 (their cache holds every query head).",
    "d2o.py:367 (twice), :377, :378 repeat the merge weights to 128, Llama-7B's head_dim: to head_dim, from the "
    "cache's shape at d2o.py:340. Both as text replacements when the file is loaded; its lines keep their numbers.",
    "The model is built as run_pred.py:396-414 builds it (hh_ratio = recent_ratio = budget / 2, as "
    "bash_experiments/run_osc_coqa_h2o_0.2.sh:24-25; alpha = belta = 0.5, run_pred.py:125-133), in float32 on CPU "
    "(run_pred.py:334: float16, device_map='auto').",
    "kvmini's protocol instead of model.generate (run_pred.py:248-263): the prompt in one call, then each "
    "continuation token in its own call with its absolute position (as new.py:913-919 derives it).",
    "Before every window, run_pred.py:277-297's reset, plus prefill_score (the loop resets a misspelt "
    "prfill_score) and the EMA threshold (d2o.py:311, never reset by their code: d2o.py:421), so that each window "
    "starts afresh as in kvmini.",
    "What is kept is read by bookkeeping, not by key: D2O_LayerKVCache.__call__ (d2o.py:316) is wrapped to follow "
    "each slot's position through the kept mask (d2o.py:360 keeps the scores of the kept slots, in order); a merged "
    "key matches no prompt key, so exact matching cannot place it.",
    "Per KV head only (not the authors' behaviour): the same wrapper averages the scores it is given over each KV "
    "head's query heads before their code selects; the query heads of a KV head then keep and merge alike.",
]


def load(code, folder):
    import torch
    from transformers import AutoConfig

    parent = Path(code) / FOLDER.rsplit("/", 1)[0]
    sys.path.insert(0, str(parent))
    import LMEval_kv_token_merge.modeling_llama3_new  # noqa: F401  (theirs, unchanged; d2o.py imports it)

    path = parent / FOLDER.rsplit("/", 1)[1] / "modeling_llama3_7b_13b_d2o.py"
    source = path.read_text()
    for old, new, count in PATCHES:
        if source.count(old) != count:
            raise ValueError(f"{path}: expected {count} of {old!r}; is this commit {COMMIT[:7]}?")
        source = source.replace(old, new)
    mod = types.ModuleType("LMEval_kv_token_merge.modeling_llama3_7b_13b_d2o")
    mod.__file__ = str(path)
    sys.modules[mod.__name__] = mod
    exec(compile(source, str(path), "exec"), mod.__dict__)
    mod.D2O_LayerKVCache.__call__ = followed(mod.D2O_LayerKVCache.__call__)
    config = AutoConfig.from_pretrained(folder)
    config.hh_size, config.recent_size = 4, 512  # unused by D2O (d2o.py:324-328 overwrite them)
    config.hh_ratio = config.recent_ratio = BUDGET / 2  # each run's budget is set by reset()
    config.alpha = config.belta = 0.5
    with contextlib.redirect_stdout(io.StringIO()):
        model = mod.Llama3ForCausalLM_D2O.from_pretrained(folder, config=config, torch_dtype=torch.float32)
    return model.eval()


def followed(call):
    """D2O_LayerKVCache.__call__ that also follows each slot's position (self.slots (H, S)), and with
    self.groups > 1 first averages the scores over each KV head's query heads."""
    import torch

    def __call__(self, past_key_values, scores, *args, **kwargs):
        H, S = scores.shape
        g = self.groups
        if g > 1:
            scores = scores.view(H // g, g, S).mean(1, keepdim=True).expand(-1, g, -1).reshape(H, S).clone()
        S = past_key_values[0].shape[2]
        slots = torch.arange(S).expand(H, S) if self.slots is None else \
            torch.cat([self.slots, (self.slots.max() + 1).repeat(H, 1)], 1)
        out = call(self, past_key_values, scores, *args, **kwargs)
        if self.hh_score is not scores:  # compressed: the kept rows of `scores`, in order (d2o.py:360)
            slots = slots.gather(1, torch.stack([in_order(a, b) for a, b in zip(scores, self.hh_score)]))
        self.slots = slots
        return out

    return __call__


def in_order(before, after):
    """Indices of `after`'s values within `before`, which holds them in the same order."""
    import torch

    b, idx, i = before.tolist(), [], 0
    for x in after.tolist():
        while b[i] != x:
            i += 1
        idx.append(i)
        i += 1
    return torch.tensor(idx)


def reset(model, kv_head: bool, budget: float) -> None:
    groups = model.config.num_attention_heads // model.config.num_key_value_heads if kv_head else 1
    for layer in model.model.layers:
        a = layer.self_attn
        a._clean_cache()  # run_pred.py:277-297
        a.layer_hh_ratio = a.layer_recent_ratio = a.multimodal_entropy = a.prfill_size = 0
        a.prefill_score = None
        a.uniform_hh_ratio = a.uniform_recent_ratio = budget / 2
        c = a.kv_cache
        c.threshold, c.slots, c.groups = None, None, groups
        c.hh_ratio = c.recent_ratio = budget / 2


def run(model, ids, n: int, kv_head: bool, budget: float):
    """ids (1, N + K) -> (logits (K, V) as kvmini's protocol, [layer][query head] kept prompt positions)."""
    import torch

    reset(model, kv_head, budget)
    logits, past = [], None
    with torch.inference_mode(), contextlib.redirect_stdout(io.StringIO()):  # their prints (d2o.py:314, :676-679)
        for t0, t1 in [(0, n)] + [(t, t + 1) for t in range(n, ids.shape[1] - 1)]:
            out = model(input_ids=ids[:, t0:t1], position_ids=torch.arange(t0, t1)[None], past_key_values=past,
                        use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1:].float())
    H = model.config.num_attention_heads
    kept = [[list(range(n))] * H if layer.self_attn.kv_cache.slots is None else  # a protected layer
            [sorted(p[p < n].tolist()) for p in layer.self_attn.kv_cache.slots] for layer in model.model.layers]
    reset(model, False, budget)
    return torch.cat(logits), kept
