"""read_config / config_from_hf: families, rope variants, sliding windows, clear errors."""
import pytest

from kvmini.errors import KvminiError
from kvmini.loading import config_from_hf, read_config

BASE = dict(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4)


def test_gqa_and_head_dim_defaults():
    c = config_from_hf(dict(BASE, model_type="llama", num_key_value_heads=2))
    assert (c.head_dim, c.num_kv_heads, c.qkv_bias, c.qk_norm, c.sliding_window) == (4, 2, False, False, None)


def test_qwen_families():
    q2 = config_from_hf(dict(BASE, model_type="qwen2"))
    q3 = config_from_hf(dict(BASE, model_type="qwen3", head_dim=8))
    assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm
    assert q3.qk_norm and q3.head_dim == 8 and not q3.qkv_bias


def test_sliding_window_layers():
    mistral = config_from_hf(dict(BASE, model_type="mistral", sliding_window=3))
    assert mistral.sliding_window == 3 and mistral.sliding_layers == (0, 1, 2, 3)
    qwen = config_from_hf(dict(BASE, model_type="qwen2", sliding_window=3, use_sliding_window=True,
                               max_window_layers=2))
    assert qwen.sliding_layers == (2, 3)
    off = config_from_hf(dict(BASE, model_type="qwen2", sliding_window=3))
    assert off.sliding_window is None


@pytest.mark.parametrize("hf,message", [
    (dict(BASE, model_type="gpt2", architectures=["GPT2LMHeadModel"]), "unsupported architecture: model_type='gpt2'"),
    (dict(BASE, model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 2.0}), "unsupported rope_type 'yarn'"),
    (dict(BASE, model_type="llama", num_key_value_heads=3), "not a multiple"),
    (dict(BASE, model_type="llama", hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_configs_fail_clearly(hf, message):
    with pytest.raises(KvminiError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf(hf)


def test_missing_field_names_it(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(KvminiError, match="lacks the field 'num_attention_heads'|lacks the field"):
        read_config(tmp_path / "config.json")
