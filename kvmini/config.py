"""ModelConfig: the few numbers that define a Llama / Mistral / Qwen2 / Qwen3 model.

Built from a Hugging Face `config.json`. Unknown families and rope variants fail
with one clear `KvminiError` instead of producing a silently different model.
"""
import json
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
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED:
            archs = ",".join(hf.get("architectures") or []) or "unknown"
            raise KvminiError(
                f"unsupported architecture: model_type={model_type!r} ({archs}); "
                f"kvmini supports {', '.join(sorted(SUPPORTED))}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise KvminiError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise KvminiError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 writes this
        rope.update(hf.get("rope_scaling") or {})  # older configs
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type == "llama3":
            scaling = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        else:
            raise KvminiError(f"unsupported rope_type {rope_type!r} (kvmini supports default and llama3)")
        layers = hf["num_hidden_layers"]
        window, sliding = _sliding_window(hf, model_type, layers)
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            sliding_window=window,
            sliding_layers=sliding,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "qwen3") and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        try:
            hf = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise KvminiError(f"missing config.json: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KvminiError(f"broken config.json {path}: {e}") from None
        try:
            return cls.from_hf_config(hf)
        except KeyError as e:
            raise KvminiError(f"config.json {path} lacks the field {e.args[0]!r}") from None


def _sliding_window(hf: dict, model_type: str, layers: int) -> tuple[int | None, tuple]:
    """Which layers use a sliding window, and its size (None: full attention everywhere)."""
    window = hf.get("sliding_window")
    if model_type == "llama" or not window:
        return None, ()
    if "layer_types" in hf and hf["layer_types"]:
        sliding = tuple(i for i, t in enumerate(hf["layer_types"]) if t == "sliding_attention")
    elif model_type == "mistral":
        sliding = tuple(range(layers))
    elif hf.get("use_sliding_window", False):  # Qwen2/3: layers from max_window_layers on
        sliding = tuple(range(hf.get("max_window_layers", 0), layers))
    else:
        sliding = ()
    return (int(window) if sliding else None), sliding
