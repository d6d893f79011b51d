"""Tiny random checkpoints of every supported family, written by HF transformers itself."""
import torch

FAMILIES = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama3_rope": dict(
        model_type="llama",
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16),
        tie_word_embeddings=True,
    ),
    "mistral": dict(model_type="mistral", sliding_window=5),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=12),
}


def make_tiny(family: str, folder, seed: int = 0, vocab_size: int = 97):
    """Save a random 2-layer model of `family` (fp32, safetensors) to `folder`; return the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=1000.0, rms_norm_eps=1e-5, **spec,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # HF initializes biases/norms to 0/1; randomize them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model
