"""What a tutorial cell asks in a student copy: is this exercise written (`solved`), does this
method run (`usable`)? When not, the cell says which exercise stops it and skips what needs it."""
from kvmini.course.exercises import Exercise, exercises
from kvmini.errors import KvminiError


def skipping(ex: Exercise) -> None:
    print(f"(this cell skips what needs exercise {ex.name}: it is not done yet in this copy; "
          f"its holes: {ex.where()}; check it with {ex.check})")


def solved(*names: str) -> bool:
    """For a tutorial cell: True when these exercises are written in this copy (always in the
    repository itself); otherwise says which are open (a region of theirs still the stub) and where,
    and returns False: the cell skips."""
    found = exercises()
    unknown = [name for name in names if name not in found]
    if unknown:
        raise KvminiError(f"no exercise {', '.join(unknown)}; the exercises are {', '.join(found)}")
    missing = [found[name] for name in names if found[name].unfinished]
    for ex in missing:
        skipping(ex)
    return not missing


def usable(name: str, **options) -> bool:
    """For a tutorial cell: whether method `name` with `options` runs in this copy, tried on a tiny
    random model (a prompt and three decode steps); if an open exercise stops it, says which, and
    returns False."""
    import torch

    from kvmini.config import ModelConfig
    from kvmini.methods.registry import chooses_budget, make_policy
    from kvmini.model import Transformer

    # 8 layers and 48 tokens: more than any method protects or waits for (DynamicKV re-allocates every 4)
    model = Transformer(ModelConfig("llama", 50, 32, 64, 8, 4, 2, 8, rope_theta=1000.0)).eval()
    policy, cache = make_policy(name, None if chooses_budget(name) else 0.5, **options), model.new_cache()
    policy.start(48, 51, model)
    try:
        with torch.no_grad():
            for chunk in (torch.arange(48)[None] % 50, *torch.arange(3)[:, None, None]):
                model(chunk, cache, policy)
    except NotImplementedError as e:
        ex = exercises().get(str(e).removeprefix("exercise ").split(":")[0])
        if ex is None:
            raise
        skipping(ex)
        return False
    return True
