"""Slow literal references for the compression engine.

`simulate` re-runs a model call by call with every key and value ever computed kept in plain
lists; what a method "keeps" is only a per-(layer, batch, KV head) set of positions, turned into
a -inf mask. A method is a `choose` function written with Python loops from its paper. If the
engine (which physically evicts) is right, its logits and kept positions equal these.
"""
import torch

from kvmini.cache import PAD
from kvmini.config import ModelConfig
from kvmini.model import Transformer, apply_rope


def random_model(L=3, H=4, H_kv=2, D=8, vocab=61, seed=0, sharp=3.0) -> Transformer:
    """A small random Llama; q/k weights scaled by `sharp` so attention is far from uniform."""
    config = ModelConfig("llama", vocab, H * D, 2 * H * D, L, H, H_kv, D, rms_norm_eps=1e-5,
                         rope_theta=1000.0, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(sharp)
            block.self_attn.k_proj.weight.mul_(sharp)
    return model


@torch.no_grad()
def simulate(model: Transformer, calls: list[torch.Tensor], choose, after_layer=None, with_keys=False,
             with_values=False):
    """Run `calls` (each ids (B, T)) in order. Returns (last-position logits per call,
    kept-position sets entering each call: kept[c][layer][b][h] = sorted list of positions).

    choose(layer, c, probs, kept, new) -> the kept sets after call c, where probs (B, H, T, N)
    is the masked attention of call c's queries over all N positions so far, kept[b][h] the
    positions entering the call and new the positions of its tokens (with_keys: a sixth argument,
    the layer's keys after RoPE at every position so far, (B, H_kv, N, D); with_values: then its
    values at every position so far, (B, H_kv, N, D)). after_layer(layer, c,
    kept), if given, may then change the kept sets of any layer (kept[layer][b][h]) in place.
    """
    cfg = model.config
    L, g = cfg.num_layers, cfg.num_heads // cfg.num_kv_heads
    B = calls[0].shape[0]
    K = [None] * L  # full history per layer, (B, H_kv, N, D)
    V = [None] * L
    kept = [[[[] for _ in range(cfg.num_kv_heads)] for _ in range(B)] for _ in range(L)]
    logits, entering = [], []
    start = 0
    for c, ids in enumerate(calls):
        T = ids.shape[1]
        new = list(range(start, start + T))
        entering.append([[[list(s) for s in row] for row in layer] for layer in kept])
        pos = torch.tensor(new)
        angles = pos[:, None].float() * model.inv_freq
        angles = torch.cat((angles, angles), -1)
        cos, sin = angles.cos(), angles.sin()
        x = model.model.embed_tokens(ids)  # (B, T, C)
        for layer, block in enumerate(model.model.layers):
            attn = block.self_attn
            h = block.input_layernorm(x)
            q = apply_rope(attn.q_proj(h).view(B, T, -1, cfg.head_dim).transpose(1, 2), cos, sin)
            k = apply_rope(attn.k_proj(h).view(B, T, -1, cfg.head_dim).transpose(1, 2), cos, sin)
            v = attn.v_proj(h).view(B, T, -1, cfg.head_dim).transpose(1, 2)
            K[layer] = k if K[layer] is None else torch.cat([K[layer], k], 2)
            V[layer] = v if V[layer] is None else torch.cat([V[layer], v], 2)
            N = start + T
            probs = torch.zeros(B, cfg.num_heads, T, N)
            out = torch.zeros(B, cfg.num_heads, T, cfg.head_dim)
            for b in range(B):
                for hq in range(cfg.num_heads):
                    hk = hq // g
                    allowed = set(kept[layer][b][hk]) | set(new)
                    for i, p in enumerate(new):
                        s = K[layer][b, hk] @ q[b, hq, i] / cfg.head_dim**0.5  # (N,)
                        ok = torch.tensor([j <= p and j in allowed for j in range(N)])
                        probs[b, hq, i] = s.masked_fill(~ok, float("-inf")).softmax(-1)
                        out[b, hq, i] = probs[b, hq, i] @ V[layer][b, hk]
            x = x + attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
            x = x + block.mlp(block.post_attention_layernorm(x))
            extra = ((K[layer],) if with_keys else ()) + ((V[layer],) if with_values else ())
            kept[layer] = choose(layer, c, probs, kept[layer], new, *extra)
            if after_layer is not None:
                after_layer(layer, c, kept)
        logits.append(model.lm_head(model.model.norm(x[:, -1])))
        start += T
    return logits, entering


@torch.no_grad()
def engine_run(model: Transformer, calls: list[torch.Tensor], policy, n: int):
    """The engine's side of a comparison with `simulate`: run `calls` through the model with `policy`
    (a prompt of n tokens, then the rest). Returns (last-position logits per call, kept positions
    entering each call: kept[c][layer][b][h] = sorted list), as `simulate` does."""
    B, L, H_kv = calls[0].shape[0], model.config.num_layers, model.config.num_kv_heads
    cache = model.new_cache(B, 4)
    policy.start(n, sum(ids.shape[1] for ids in calls), model)
    logits, kept = [], []
    for ids in calls:
        kept.append([[[sorted(cache[l].positions[b, h].tolist()) for h in range(H_kv)] for b in range(B)]
                     for l in range(L)])
        logits.append(model(ids, cache, policy)[:, -1])
    return logits, kept


def group_mean(probs: torch.Tensor, g: int) -> torch.Tensor:
    """(B, H, T, N) -> (B, H_kv, T, N): mean over the g query heads of each KV head, written out."""
    B, H, T, N = probs.shape
    out = torch.zeros(B, H // g, T, N)
    for hq in range(H):
        out[:, hq // g] += probs[:, hq] / g
    return out


def top_positions(candidates: list[int], score: dict, count: int) -> list[int]:
    """The `count` candidates with the highest score; ties go to the earlier position."""
    return sorted(sorted(candidates, key=lambda p: (-score[p], p))[:count])


def in_position_order(lc, b: int | None = None):
    """A layer cache's positions, keys and values with every head's entries sorted by position
    (per-step eviction leaves a buffer in any order; attention does not depend on it); b: sequence b's
    held entries alone (1, H_kv, S_b), its pads left out."""
    order = lc.positions.argsort(dim=-1)  # (B, H_kv, S): pads last
    at = order[..., None].expand_as(lc.keys)
    pos, keys, values = lc.positions.gather(2, order), lc.keys.gather(2, at), lc.values.gather(2, at)
    if b is None:
        return pos, keys, values
    S_b = int((pos[b] != PAD).sum(-1).max())
    return pos[b : b + 1, :, :S_b], keys[b : b + 1, :, :S_b], values[b : b + 1, :, :S_b]
