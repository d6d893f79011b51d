"""CUDA: the same model on the GPU agrees with the CPU. Skipped, with the reason shown, without a GPU."""
import pytest
import torch

from conftest import cuda
from kvmini.generate import generate
from kvmini.loading import load_model

pytestmark = [pytest.mark.cuda, cuda]


def test_cuda_fp32_logits_equal_cpu(tiny):
    family, folder, _ = tiny
    ids = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(0))
    cpu = load_model(folder, "cpu", "float32")(ids, all_logits=True)
    gpu = load_model(folder, "cuda", "float32")(ids.cuda(), all_logits=True)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=0)


def test_cuda_default_dtype_is_bfloat16_and_generates(default_model_dir, default_tokenizer):
    model = load_model(default_model_dir, "cuda", "auto")
    assert model.dtype == torch.bfloat16
    ids = torch.tensor([default_tokenizer.encode("The capital of France is")])
    result = generate(model, ids, 8)
    assert "Paris" in default_tokenizer.decode(result.tokens[0])


@pytest.mark.parametrize("name", ["streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "weightedkv", "d2o",
                                  "dynamickv", "dbudgetkv"])
def test_cuda_compression_keeps_what_cpu_keeps(name):
    from kvmini.methods.registry import make_policy
    from reference import random_model

    model = random_model(seed=1)
    ids = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(0))
    options = {"window": 4, "kernel": 3} if name in ("snapkv", "pyramidkv", "dynamickv") else {}
    budget = None if name == "dbudgetkv" else 12
    cpu = generate(model, ids, 6, policy=make_policy(name, budget, **options))
    gpu = generate(model.cuda(), ids.cuda(), 6, policy=make_policy(name, budget, **options))
    assert gpu.tokens == cpu.tokens
    for g, c in zip(gpu.cache.layers, cpu.cache.layers):
        assert torch.equal(g.positions.cpu(), c.positions)


def test_cuda_largest_batch_under_a_memory_cap():
    from kvmini.eval.speed import batch_under_cap
    from reference import random_model

    model = random_model(seed=2).cuda()
    ids = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(0)).cuda()
    roomy = batch_under_cap(model, ids, ["h2o", "d2o"], 0.25, cap_gib=4, steps=3, max_batch=8, log=lambda m: None)
    assert all(r["batch"] == 8 and r["tokens_per_s"] > 0 and r["peak_gib"] <= 4 for r in roomy.values())
    assert batch_under_cap(model, ids, [], 0.25, cap_gib=1e-9, steps=3, log=lambda m: None) == {"full": None}
