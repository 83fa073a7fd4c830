"""Align-to-Distill's Attention Alignment Module, AAM (Jin et al., 2024, Sec. 4.2.1, Eq. 9): a 1x1
("pointwise") convolution over the map axis. With ``m`` student layers of ``H_S`` heads and ``n``
teacher layers of ``H_T`` heads, each of the ``C = n * H_T`` intermediate maps is

    H^I_c = sum_{l,k} w_{c,(l,k)} A_S^{l,k} + b_c        (Eq. 9)

applied as one ``einsum``; map ``(l, k)`` (1-based, layer-major) has index ``(l - 1) * heads + k - 1``.
``combination="signed"`` is Eq. 9 (``init="mean"``: every map starts as the students' mean;
``"conv"``: ``Conv2d``'s default init, as the authors' code); ``"mixture"`` (a deviation) is a
softmax-weighted convex combination without bias, so every intermediate map stays a distribution.
Why: ``docs/design/attention_alignment.md``.
"""
from __future__ import annotations

from typing import Dict, Mapping

import torch
from torch import Tensor, nn

from ..errors import InputError

SIZE_KEYS = ("student_layers", "student_heads", "teacher_layers", "teacher_heads")


class AlignmentShapeError(InputError):
    """Maps or saved weights whose sizes do not fit an Attention Alignment Module."""


COMBINATIONS = ("signed", "mixture")
INITS = ("mean", "conv")


class AttentionAlignment(nn.Module):
    """Eq. 9 for one attention kind: ``(m, B, H_S, Tq, Tk)`` student maps -> ``(n*H_T, B, Tq, Tk)``.

    ``weight``: ``(n * H_T, m * H_S)`` (a 1x1 convolution's kernel); ``bias``: ``(n * H_T,)``
    (``signed`` only). The layer-wise variant (Table 6) builds it with one "head" per layer.
    """

    def __init__(self, student_layers: int, student_heads: int, teacher_layers: int, teacher_heads: int,
                 combination: str = "signed", init: str = "mean"):
        super().__init__()
        sizes = dict(zip(SIZE_KEYS, (student_layers, student_heads, teacher_layers, teacher_heads)))
        bad = {key: value for key, value in sizes.items() if int(value) < 1}
        if bad:
            raise AlignmentShapeError(f"an attention alignment module needs positive sizes, got {bad}")
        if combination not in COMBINATIONS or init not in INITS:
            raise ValueError(f"combination must be one of {COMBINATIONS} and init one of {INITS}, "
                             f"got {combination!r}, {init!r}")
        self.student_layers, self.student_heads = int(student_layers), int(student_heads)
        self.teacher_layers, self.teacher_heads = int(teacher_layers), int(teacher_heads)
        self.combination = combination
        student_maps = self.student_layers * self.student_heads
        teacher_maps = self.teacher_layers * self.teacher_heads
        if combination == "mixture":
            self.weight = nn.Parameter(torch.zeros(teacher_maps, student_maps))
            self.bias = None
        elif init == "mean":
            self.weight = nn.Parameter(torch.full((teacher_maps, student_maps), 1.0 / student_maps))
            self.bias = nn.Parameter(torch.zeros(teacher_maps))
        else:
            bound = student_maps ** -0.5  # kaiming_uniform(a=sqrt(5)) of a 1x1 conv, and its bias
            self.weight = nn.Parameter(torch.empty(teacher_maps, student_maps).uniform_(-bound, bound))
            self.bias = nn.Parameter(torch.empty(teacher_maps).uniform_(-bound, bound))

    def sizes(self) -> Dict[str, int]:
        return {key: getattr(self, key) for key in SIZE_KEYS}

    def coefficients(self) -> Tensor:
        """The ``(n * H_T, m * H_S)`` coefficients applied to the student maps, in float32."""
        weight = self.weight.float()
        return torch.softmax(weight, dim=1) if self.combination == "mixture" else weight

    def forward(self, student_maps: Tensor) -> Tensor:
        """Intermediate maps ``H^I``, ``(n * H_T, batch, Tq, Tk)``, in float32 whatever the dtypes (the
        result feeds a logarithm)."""
        layers, _, heads = student_maps.shape[:3]
        if (layers, heads) != (self.student_layers, self.student_heads):
            raise AlignmentShapeError(f"the alignment module was built for {self.student_layers} student layers x "
                                      f"{self.student_heads} heads but got maps of {layers} layers x {heads} heads")
        kernel = self.coefficients().view(-1, self.student_layers, self.student_heads)
        intermediate = torch.einsum("clh,lbhqk->cbqk", kernel, student_maps.float())
        if self.bias is None:
            return intermediate
        return intermediate + self.bias.float().view(-1, 1, 1, 1)

    # sizes travel in the state dict (torch's extra state: plain ints, loadable with weights_only=True)
    def get_extra_state(self) -> dict:
        return {**self.sizes(), "combination": self.combination}

    def set_extra_state(self, state: Mapping) -> None:
        saved = {key: int(state[key]) for key in SIZE_KEYS if key in state}
        saved_combination = state.get("combination", "signed")
        if saved_combination != self.combination:
            raise AlignmentShapeError(
                f"the checkpoint's attention alignment module combines the student maps as "
                f"{saved_combination!r} but this run asks for {self.combination!r} (--a2d-normalization "
                "differs); resume with the same A2D options or start a new --save-dir")
        if saved != self.sizes():
            raise AlignmentShapeError(
                f"the checkpoint's attention alignment module was trained for {describe(saved)}, but "
                f"this run's student and teacher give {describe(self.sizes())}; resume with the "
                "same student architecture and --teacher-checkpoint, or start a new --save-dir")

    def extra_repr(self) -> str:
        return describe(self.sizes())


def describe(sizes: Mapping) -> str:
    return (f"student {sizes.get('student_layers')} layers x {sizes.get('student_heads')} heads -> "
            f"teacher {sizes.get('teacher_layers')} layers x {sizes.get('teacher_heads')} heads")


def alignment_weights_from_state(criterion_state: Mapping[str, object], prefix: str = "alignments.") -> dict:
    """Heatmap JSON (``{kind: {"weights": student rows x teacher maps, sizes}}``) from the ``criterion``
    state of a checkpoint trained with ``--criterion a2d_kd``."""
    found = {}
    for key, value in criterion_state.items():
        if key.startswith(prefix) and key.endswith(".weight"):
            kind = key[len(prefix): -len(".weight")]
            sizes = criterion_state.get(f"{prefix}{kind}._extra_state")
            if not isinstance(sizes, Mapping) or any(k not in sizes for k in SIZE_KEYS):
                raise AlignmentShapeError(
                    f"criterion state has {key} but no sizes ({prefix}{kind}._extra_state); it was not "
                    "written by this version of fairseq-kd's a2d_kd criterion")
            if sizes.get("combination") == "mixture":
                value = torch.softmax(value.float(), dim=1)
            expected = (sizes["teacher_layers"] * sizes["teacher_heads"],
                        sizes["student_layers"] * sizes["student_heads"])
            if tuple(value.shape) != expected:
                raise AlignmentShapeError(f"alignment weight of shape {tuple(value.shape)} does not fit "
                                          f"{describe(sizes)} (expected {expected})")
            found[kind] = {"weights": value.float().t().cpu().tolist(), **{key: int(sizes[key]) for key in SIZE_KEYS}}
    if not found:
        raise AlignmentShapeError(
            "the criterion state holds no attention alignment module (keys "
            f"{sorted(criterion_state)[:8]}...); was the checkpoint trained with --criterion a2d_kd?")
    return found
