"""Exercise checks: a failing equality says what it checks, what it wants and what it got (a bare
`assert torch.equal(a, b)` prints only `where False = <built-in method equal ...>`)."""
import torch


def shown(x):
    """x as a student compares it by hand: a small tensor as nested lists, anything else as it prints."""
    return x.tolist() if isinstance(x, torch.Tensor) and x.numel() <= 64 else x


def assert_equal(got, want, what: str) -> None:
    """got == want exactly (tensors: the same shape and values), else an AssertionError: `what`, want, got."""
    same = torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
    assert same, f"{what}: want {shown(want)}, got {shown(got)}"
