"""Greedy, top-k and top-p sampling on hand-made distributions."""
import torch

from kvmini.generate import Sampling, sample


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 1.0]])
    assert sample(logits, Sampling(), None).tolist() == [1, 0]


def test_top_k_only_draws_from_the_k_best():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, Sampling(temperature=1.0, top_k=2), g).item() for _ in range(200)}
    assert draws == {1, 3}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # sorted probabilities 0.5, 0.3, 0.15, 0.05: p = 0.7 needs {0, 1}; p = 0.85 needs {0, 1, 2}
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, Sampling(temperature=1.0, top_p=0.7), g).item() for _ in range(300)} == {0, 1}
    assert {sample(logits, Sampling(temperature=1.0, top_p=0.85), g).item() for _ in range(300)} == {0, 1, 2}


def test_seed_makes_sampling_repeatable():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    run = lambda: [sample(logits, Sampling(1.0), g).item() for g in [torch.Generator().manual_seed(7)] for _ in range(20)]  # noqa: E731
    assert run() == run()


def test_any_positive_temperature_samples_a_token():
    # logits / 1e-40 overflows float32; a tiny temperature is greedy, a huge one is uniform
    logits = torch.tensor([[1.0, 30.0, -20.0, 29.0]])
    g = torch.Generator().manual_seed(0)
    for t in (1e-40, 5e-324, 1e-300):
        assert {sample(logits, Sampling(temperature=t), g).item() for _ in range(50)} == {1}
    assert {sample(logits, Sampling(temperature=1e300), g).item() for _ in range(400)} == {0, 1, 2, 3}
    assert {sample(logits, Sampling(temperature=1e300, top_k=2), g).item() for _ in range(200)} == {1, 3}
