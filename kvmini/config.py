"""ModelConfig: the few numbers that define a Llama / Mistral / Qwen2 / Qwen3 model.

Built from a Hugging Face `config.json`. Unknown families and rope variants fail
with one clear `KvminiError` instead of producing a silently different model.
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvmini.errors import KvminiError

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int  # C
    intermediate_size: int
    num_layers: int  # L
    num_heads: int  # H (query heads)
    num_kv_heads: int  # H_kv
    head_dim: int  # D (explicit in Qwen3, hidden_size // H elsewhere)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # llama3: (factor, low_freq_factor, high_freq_factor, original_max_pos)
    max_position_embeddings: int = 4096
    sliding_window: int | None = None  # tokens a query may see, itself included
    sliding_layers: tuple = ()  # indices of layers that use the sliding window
    qkv_bias: bool = False  # Qwen2, or Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each query/key head before RoPE
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()

    @property
    def group_size(self) -> int:
        """g = H / H_kv query heads share one KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, hf: dict) -> "ModelConfig":
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
        return cls(
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

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
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
            return cls.from_hf_config(hf)
        except KvminiError as e:
            raise KvminiError(f"{path}: {e}") from None


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
