"""ModelConfig: the few numbers that define a Llama / Mistral / Qwen2 / Qwen3 model.

`kvmini.loading.read_config` builds one from a Hugging Face `config.json`.
"""
from dataclasses import dataclass


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
