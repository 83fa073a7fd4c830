"""Learnable width adapters between student and teacher representations."""
import torch
from torch import nn


def width_projection(in_dim: int, out_dim: int, bias: bool = True) -> nn.Module:
    """A linear map ``in_dim -> out_dim``, or the identity when the widths agree (training-only:
    it lives in the criterion)."""
    if in_dim == out_dim:
        return nn.Identity()
    return nn.Linear(in_dim, out_dim, bias=bias)


class StackedLinear(nn.Module):
    """``count`` independent linear maps ``in_dim -> out_dim`` in one batched matmul: slice ``i`` of
    ``(count, ..., in_dim)`` goes through map ``i``. Each is initialised like ``nn.Linear``; ``fan_in``
    per map when a map is one block of a wider linear layer (CKD's fusion of a concatenation)."""

    def __init__(self, count: int, in_dim: int, out_dim: int, bias: bool = True, fan_in=None):
        super().__init__()
        self.count, self.in_dim, self.out_dim = count, in_dim, out_dim
        self.weight = nn.Parameter(torch.empty(count, in_dim, out_dim))
        self.bias = nn.Parameter(torch.empty(count, out_dim)) if bias else None
        fan_in = [in_dim] * count if fan_in is None else list(fan_in)
        if len(fan_in) != count:
            raise ValueError(f"fan_in has {len(fan_in)} entries for {count} maps")
        with torch.no_grad():
            for index, fan in enumerate(fan_in):
                bound = fan ** -0.5
                self.weight[index].uniform_(-bound, bound)
                if self.bias is not None:
                    self.bias[index].uniform_(-bound, bound)

    def forward(self, inputs):
        count = inputs.size(0)
        if count != self.count:
            raise ValueError(f"StackedLinear holds {self.count} maps but got {count} input slices")
        flat = inputs.reshape(count, -1, self.in_dim).to(self.weight.dtype)
        if self.bias is None:
            out = flat.bmm(self.weight)
        else:
            out = self.bias.unsqueeze(1).baddbmm(flat, self.weight)
        return out.reshape(*inputs.shape[:-1], self.out_dim)

    def extra_repr(self) -> str:
        return f"count={self.count}, in_dim={self.in_dim}, out_dim={self.out_dim}, bias={self.bias is not None}"
