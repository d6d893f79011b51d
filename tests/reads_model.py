"""A test-only method that reads the model of its run (`self.model`), as a method built on the residual
stream does (tutorial 9, "Reading the residual stream"): H2O that, in every forward call, hooks the
model's norms and records each layer's cosine between the residual stream before and after its attention
(SqueezeAttention's measure: Wang et al., arXiv 2404.04793). It keeps what H2O keeps; a run started
without its model fails at its first call. `tests/test_reads_model.py` registers it as `reads_model`."""
import torch.nn.functional as F

from kvmini.methods import h2o

Options = h2o.Options


class ReadsModel(h2o.H2O):
    def __init__(self, budget: float, o: Options = Options()):
        super().__init__(budget, o)
        self.name = "reads_model"

    def before(self, cache, step) -> dict | None:
        wants = super().before(cache, step)
        blocks = self.model.model.layers  # AttributeError when the run was started without its model
        self.streams: list = []  # this call's residual stream, (B, T, C): before layer 0's attention, after it, ...
        keep = lambda norm, args: self.streams.append(args[0])  # noqa: E731  (a norm's input: the stream)
        self.hooks = [norm.register_forward_pre_hook(keep) for block in blocks
                      for norm in (block.input_layernorm, block.post_attention_layernorm)]
        return wants

    def after_layers(self, cache, step) -> None:
        for hook in self.hooks:
            hook.remove()
        pairs = zip(self.streams[0::2], self.streams[1::2])  # (before, after) each layer's attention
        self.cosines = [F.cosine_similarity(x, y, dim=-1).mean().item() for x, y in pairs]
        super().after_layers(cache, step)


def build(budget: float, o: Options = Options()) -> ReadsModel:
    return ReadsModel(budget, o)
