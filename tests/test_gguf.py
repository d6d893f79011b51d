"""The GGUF -> HF conversion of the default model."""
import numpy as np
import pytest
import torch

from kvmini.weights import GGUF_NAME, hf_name, unpermute_rope_rows


def llama_cpp_permute(w, n_head):
    """llama.cpp's convert script: interleave the two RoPE halves of every head's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)  # 3 heads of dim 8
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
    # head 0's rows in GGUF order are (0, 4, 1, 5, 2, 6, 3, 7): pairs (x_i, x_{i+D/2}) side by side
    assert llama_cpp_permute(w, 3)[:8, 0].tolist() == [0, 20, 5, 25, 10, 30, 15, 35]


def test_names_map_to_hf():
    assert hf_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"


@pytest.mark.slow
def test_conversion_equals_transformers_gguf_loader(default_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(default_model_dir.parent, gguf_file=GGUF_NAME, dtype=torch.float32)
    expected = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    ours = load_file(default_model_dir / "model.safetensors")
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


def test_prepared_folder_loads_in_transformers(default_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_model_dir)
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        "llama", 30, 9, 3)
    assert config.tie_word_embeddings and config.max_position_embeddings == 8192
