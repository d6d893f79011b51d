"""Load an HF-layout checkpoint folder (config.json + safetensors) into a `Transformer`.

config.json is read field by field: an unknown family or rope variant, or a field of the
wrong kind, fails with one clear `KvminiError` instead of producing a silently different model.

Only safetensors are read (never pickle). Loading is strict: every tensor the
model needs must be present with the right shape, and nothing unknown may be
left over. The model is built on the meta device and the loaded tensors are
assigned in place, so no memory is spent on a random initialization.
"""
import dataclasses
import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvmini.config import ModelConfig
from kvmini.errors import KvminiError
from kvmini.files import not_special
from kvmini.model import Transformer, rope_frequencies

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed here
KV_PROJ = tuple(f"self_attn.{p}_proj.{w}" for p in "kv" for w in ("weight", "bias"))  # repeated by per_query_head
LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a decoder layer's tensors (HF names)
SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu; 'cpu', 'cuda' or 'cuda:N'. An absent GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::([0-9]+))?", name)
    if m is None:
        raise KvminiError(f"unsupported device {name!r}: kvmini runs on auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise KvminiError(f"device {name!r} requested but no CUDA GPU is available (try --device cpu)")
    if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise KvminiError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> float32 on CPU, bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise KvminiError(f"unknown dtype {name!r} (use auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: one file, or the shards named by the index."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    for link in (single, index):
        if link.is_symlink() and not link.exists():
            raise KvminiError(f"{link} is a link to nothing ({link.readlink()})")
    if single.exists():
        return [single]
    if index.exists():
        try:
            weight_map = json.loads(not_special(index, "shard index").read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise KvminiError(f"broken shard index {index}: {type(e).__name__}: {e}") from None
        if not all(isinstance(n, str) and n and Path(n).name == n for n in names):
            raise KvminiError(f"broken shard index {index}: weight_map must map tensor names to file names")
        return [folder / name for name in names]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise KvminiError(f"{folder} holds only pickle weights (.bin/.pt); kvmini loads safetensors only")
    raise KvminiError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def readable_shard(path: Path) -> Path:
    if not path.exists():
        raise KvminiError(f"missing weight shard: {path}")
    if not path.is_file():
        raise KvminiError(f"{path} is not a file")
    path.open("rb").close()  # an unreadable file fails here with the OS's own reason
    return path


def layers_held(files: list[Path]) -> int:
    """How many decoder layers the checkpoint's tensors hold (model.layers.<i>.*), from the files' headers."""
    found = set()
    for path in files:
        try:
            with safe_open(str(readable_shard(path)), framework="pt", device="cpu") as f:
                found.update(int(m.group(1)) for name in f.keys() if (m := LAYER.match(name)))
        except SafetensorError as e:
            raise KvminiError(f"cannot read {path}: {e}") from None
    return max(found, default=-1) + 1


def load_model(folder: str | Path, device: str = "auto", dtype: str = "auto", per_query_head: bool = False) -> Transformer:
    """The checkpoint in `folder` as a Transformer. `per_query_head`: every query head gets a KV head of its
    own, k_proj's and v_proj's rows repeated for each query head of their group (what `repeat_kv` does to
    the keys and values, done once to the weights): the same model, whose cache holds one entry set per
    query head, g = H / H_kv times the memory, as the authors' codes hold it; every method then selects
    per query head (docs/methods.md, "Per KV head or per query head")."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise KvminiError(f"{folder} is a file, not a checkpoint folder (config.json and safetensors)")
    if not folder.is_dir():
        raise KvminiError(f"model folder not found: {folder}")
    config = read_config(folder / "config.json")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    files = safetensors_files(folder)
    held = layers_held(files)  # before the model is built, which a config of absurd size would make take forever
    if held != config.num_layers:
        raise KvminiError(f"config.json has num_hidden_layers {config.num_layers} but the weights in {folder} hold "
                          f"{held} layers: config and weights do not match")
    groups = config.num_heads // config.num_kv_heads if per_query_head else 1
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(config, num_kv_heads=config.num_kv_heads * groups))
    expected = {name: t.shape for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    state = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                        continue
                    if name not in expected:
                        raise KvminiError(f"unexpected tensor {name!r} in {path.name}")
                    t = f.get_tensor(name)
                    if groups > 1 and name.endswith(KV_PROJ):  # (H_kv D, ...) -> (H D, ...): each head g times
                        t = t.unflatten(0, (config.num_kv_heads, -1)).repeat_interleave(groups, 0).flatten(0, 1)
                    if not t.dtype.is_floating_point:
                        raise KvminiError(f"tensor {name!r} in {path.name} has dtype {str(t.dtype).removeprefix('torch.')}; "
                                          "weights must be floating point")
                    if t.shape != expected[name]:
                        raise KvminiError(
                            f"shape mismatch for {name!r}: checkpoint {tuple(t.shape)}, model {tuple(expected[name])}"
                        )
                    state[name] = t.to(device=dev, dtype=dt)
        except SafetensorError as e:
            raise KvminiError(f"cannot read {path}: {e}") from None
    missing = [name for name in expected if name not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KvminiError(f"missing tensor {missing[0]!r}{more} in {folder}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_frequencies(config, dev)  # the buffer, recomputed: it was built on the meta device
    return model.eval().requires_grad_(False)


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint's config.json; every refusal names the file."""
    path = Path(path)
    if not path.exists():
        raise KvminiError(f"missing config.json: {path}")
    if not path.is_file():
        raise KvminiError(f"{path} is not a file")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvminiError(f"broken config.json {path}: {e}") from None
    try:
        return config_from_hf(hf)
    except KvminiError as e:
        raise KvminiError(f"{path}: {e}") from None


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig a Hugging Face config.json's object describes; a KvminiError names what kvmini
    cannot run (an unknown family, rope variant or activation) or a field that is not what it must be."""
    if not isinstance(hf, dict):
        raise KvminiError(f"config.json must hold a JSON object, not a {type(hf).__name__}")
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        archs = hf.get("architectures")
        archs = ",".join(map(str, archs)) if isinstance(archs, list) and archs else "unknown"
        raise KvminiError(
            f"unsupported architecture: model_type={model_type!r} ({archs}); "
            f"kvmini supports {', '.join(sorted(SUPPORTED))}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise KvminiError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
    heads = _int(hf, "num_attention_heads")
    kv_heads = _int(hf, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise KvminiError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    hidden = _int(hf, "hidden_size")
    if hf.get("head_dim") is None and hidden % heads:
        raise KvminiError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (and no head_dim)")
    rope = {**_dict(hf, "rope_parameters"), **_dict(hf, "rope_scaling")}  # transformers >= 5 / older configs
    theta = _float(hf, "rope_theta", _float(rope, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        scaling = (_float(rope, "factor"), _float(rope, "low_freq_factor"), _float(rope, "high_freq_factor"),
                   _int(rope, "original_max_position_embeddings"))
    else:
        raise KvminiError(f"unsupported rope_type {rope_type!r} (kvmini supports default and llama3)")
    layers = _int(hf, "num_hidden_layers")
    window, sliding = _sliding_window(hf, model_type, layers)
    eos = hf.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    bos = hf.get("bos_token_id")
    if not all(_is_int(i) and i >= 0 for i in eos) or not (bos is None or (_is_int(bos) and bos >= 0)):
        raise KvminiError("config.json: bos_token_id and eos_token_id must be token ids (integers >= 0)")
    attention_bias = _bool(hf, "attention_bias")
    return ModelConfig(
        model_type=model_type,
        vocab_size=_int(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(hf, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_int(hf, "head_dim", hidden // heads),
        rms_norm_eps=_float(hf, "rms_norm_eps", 1e-6, nullable=False),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(hf, "max_position_embeddings", 4096, nullable=False),
        sliding_window=window,
        sliding_layers=sliding,
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type in ("llama", "qwen3") and attention_bias,
        mlp_bias=_bool(hf, "mlp_bias"),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=_bool(hf, "tie_word_embeddings"),
        bos_token_id=bos,
        eos_token_ids=eos,
    )


MISSING = object()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _field(hf: dict, key: str, default, nullable: bool = True):
    """hf[key]; a missing key (or null, where `nullable`) takes `default` (MISSING: required)."""
    value = hf.get(key)
    if value is None:
        if default is MISSING or (key in hf and not nullable):
            raise KvminiError(f"config.json lacks the field {key!r}" if key not in hf else f"{key} must not be null")
        return default
    return value


def _int(hf: dict, key: str, default=MISSING, nullable: bool = True) -> int:
    """A positive integer field: a string, a float, a bool, 0 or a negative number is refused."""
    value = _field(hf, key, default, nullable)
    if not _is_int(value) or value < 1:
        raise KvminiError(f"{key} must be a positive integer, got {json.dumps(value)}")
    return value


def _float(hf: dict, key: str, default=MISSING, nullable: bool = True) -> float:
    value = _field(hf, key, default, nullable)
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value <= 0:
        raise KvminiError(f"{key} must be a positive number, got {json.dumps(value)}")
    return float(value)


def _bool(hf: dict, key: str) -> bool:
    value = _field(hf, key, False)
    if not isinstance(value, bool):
        raise KvminiError(f"{key} must be true or false, got {json.dumps(value)}")
    return value


def _dict(hf: dict, key: str) -> dict:
    value = _field(hf, key, {})
    if not isinstance(value, dict):
        raise KvminiError(f"{key} must be an object (or null), got {json.dumps(value)}")
    return value


def _sliding_window(hf: dict, model_type: str, layers: int) -> tuple[int | None, tuple]:
    """Which layers use a sliding window, and its size (None: full attention everywhere)."""
    if model_type == "llama" or not hf.get("sliding_window"):
        return None, ()
    window = _int(hf, "sliding_window")
    if hf.get("layer_types"):
        types = hf["layer_types"]
        if not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) for t in types):
            raise KvminiError(f"layer_types must list one attention type per layer ({layers})")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif model_type == "mistral":
        sliding = tuple(range(layers))
    elif hf.get("use_sliding_window", False):  # Qwen2/3: layers from max_window_layers on
        first = _field(hf, "max_window_layers", 0)
        if not _is_int(first) or first < 0:
            raise KvminiError(f"max_window_layers must be an integer >= 0, got {json.dumps(first)}")
        sliding = tuple(range(first, layers))
    else:
        sliding = ()
    return (window if sliding else None), sliding
