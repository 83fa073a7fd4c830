"""Combinatorial KD, CKD (Wu et al. 2020, "Why Skip If You Can Combine", EMNLP, arXiv:2010.03034).

    L_CKD = sum_positions sum_i MSE(h_S^i, W_i [h_T^{j_1}; h_T^{j_2}; ...] + b_i),   j in M(i)   (Eq. 3-4)

with the paper's mappings ``M`` (RC, OC, SC, CC, generalised to any depths ``n >= m``) or an explicit
``--ckd-layer-map``; total ``beta L_CE + eta L_KD + lambda L_CKD`` with ``eta = 0.1``, ``lambda =
0.7`` (Sec. 4). Deviation (``--ckd-map-side student``, the default): the learnt map sits on the
student's side, ``MSE(W_i h_S^i + b_i, [h_T^{j_1}; ...])``, because the paper's teacher-side fusion
(``--ckd-map-side teacher``) is minimised by a constant student. Why, the measurements, and the
batched implementation: ``docs/methods/ckd.md``.
"""
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from ..modules.layer_mapping import CKD_STRATEGIES, LayerMapping, resolve_mapping
from ..modules.projection import StackedLinear
from .hidden_state import HiddenStateKDConfig, HiddenStateKDCriterion, in_param_dtype
from .losses import masked_mse_sum, projected_mse_sum

CKD_MAPPING_CHOICES = ChoiceEnum(list(CKD_STRATEGIES))
CKD_MAP_SIDES = ChoiceEnum(["student", "teacher"])


@dataclass
class CombinatorialKDConfig(HiddenStateKDConfig):
    ckd_mapping: CKD_MAPPING_CHOICES = field(
        default="rc",
        metadata={"help": "combination strategy: rc (regular), oc (overlap), sc (skip), cc (cross); "
                  "for 6 teacher and 2 student layers exactly the paper's {1,2,3},{4,5,6} / "
                  "{1,2,3,4},{3,4,5,6} / {1,2},{5,6} / {1,3},{4,6}"},
    )
    ckd_layer_map: Optional[str] = field(
        default=None,
        metadata={"help": "explicit mapping overriding --ckd-mapping: one comma-separated group of "
                  "1-based teacher layers per student layer, bottom-up, groups separated by '|', "
                  "e.g. '1,2,3|4,5,6'", "example": "1,2,3|4,5,6"},
    )
    ckd_map_side: CKD_MAP_SIDES = field(
        default="student",
        metadata={"help": "where the learnable linear map sits: student (default; W_i h_S^i + b_i is "
                  "compared with the concatenated teacher layers [h_T^j; ...], a fixed target) or "
                  "teacher (the paper's Eq. 4: h_S^i is compared with the learnt fusion "
                  "W_i [h_T^j; ...] + b_i; this objective is minimised by a constant student, see "
                  "docs/methods/ckd.md)"},
    )


class LayerFusion(nn.Module):
    """``f^i = W_i [h^{j_1}; ...; h^{j_k}] + b_i`` for every student layer ``i`` at once: one ``d_T x
    d_S`` block per (student layer, teacher layer) pair, in mapping order, each initialised like the
    ``nn.Linear(k_i d_T, d_S)`` it is a part of."""

    def __init__(self, mapping: LayerMapping, teacher_dim: int, student_dim: int):
        super().__init__()
        self.mapping = mapping
        fan_in = [len(group) * teacher_dim for group in mapping for _ in group]
        self.blocks = StackedLinear(len(fan_in), teacher_dim, student_dim, bias=False, fan_in=fan_in)
        self.bias = nn.Parameter(torch.empty(len(mapping), student_dim))
        with torch.no_grad():
            for i, group in enumerate(mapping):
                bound = (len(group) * teacher_dim) ** -0.5
                self.bias[i].uniform_(-bound, bound)
        pairs = [(i, j) for i, group in enumerate(mapping) for j in group]
        self.register_buffer("pair_teacher_layer", torch.tensor([j for _, j in pairs]), persistent=False)
        self.register_buffer("pair_student_slot", torch.tensor([i for i, _ in pairs]), persistent=False)

    def forward(self, teacher_states: Tensor) -> Tensor:
        """teacher_states ``(n + 1, B, T, d_T)`` -> fused ``(m, B, T, d_S)`` in float32."""
        pairs = teacher_states.index_select(0, self.pair_teacher_layer)  # (P, B, T, d_T)
        contributions = in_param_dtype(self.blocks, pairs)  # (P, B, T, d_S)
        fused = contributions.new_zeros((len(self.mapping),) + contributions.shape[1:])
        fused = fused.index_add(0, self.pair_student_slot, contributions)
        return fused + self.bias.float()[:, None, None, :]


class StudentProjection(nn.Module):
    """``W_i h^i_S + b_i`` in the space of the concatenated teacher layers ``[h_T^{j_1}; ...]``: one
    ``d_S x d_T`` block (with its bias) per (student layer, teacher layer) pair, in mapping order,
    each initialised like the ``nn.Linear(d_S, |M(i)| d_T)`` it is a part of."""

    def __init__(self, mapping: LayerMapping, teacher_dim: int, student_dim: int):
        super().__init__()
        self.mapping = mapping
        pairs = [(i, j) for i, group in enumerate(mapping) for j in group]
        self.blocks = StackedLinear(len(pairs), student_dim, teacher_dim)
        self.register_buffer("pair_teacher_layer", torch.tensor([j for _, j in pairs]), persistent=False)
        self.register_buffer("pair_student_layer", torch.tensor([i + 1 for i, _ in pairs]), persistent=False)
        # The MSE of student layer i is a mean over its |M(i)| d_T features: each of its pairs
        # contributes its own d_T-feature mean divided by |M(i)|.
        self.register_buffer("pair_weight", torch.tensor([1.0 / len(mapping[i]) for i, _ in pairs]), persistent=False)

    def loss(self, student_states: Tensor, teacher_states: Tensor, padding_mask: Tensor) -> Tensor:
        return projected_mse_sum(
            student_states, self.pair_student_layer, self.blocks.weight, self.blocks.bias,
            teacher_states, self.pair_teacher_layer, padding_mask, self.pair_weight,
        )


@register_criterion("ckd", dataclass=CombinatorialKDConfig)
class CombinatorialKDCriterion(HiddenStateKDCriterion):
    LAYER_TERM = "ckd"
    TERM_NAMES = ("word_kd", "ckd")

    def __init__(self, cfg: CombinatorialKDConfig, task):
        super().__init__(cfg, task)
        self.ckd_map_side = str(cfg.ckd_map_side)
        self.mappings = {}
        self.fusions = nn.ModuleDict()
        self.projections = nn.ModuleDict()
        for side in self.sides:
            mapping = resolve_mapping(
                CKD_STRATEGIES, str(cfg.ckd_mapping), cfg.ckd_layer_map or None,
                self.teacher_shape.layers(side), self.student_shape.layers(side),
                "--ckd-mapping", "--ckd-layer-map", f" [{side}]",
            )
            self.mappings[side] = mapping
            widths = (self.teacher_shape.embed_dim(side), self.student_shape.embed_dim(side))
            if self.ckd_map_side == "teacher":
                self.fusions[side] = LayerFusion(mapping, *widths)
            else:
                self.projections[side] = StudentProjection(mapping, *widths)

    def checkpoint_state_hint(self, saved_state: dict):
        """Why a checkpoint's criterion parameters do not fit, when its learnable maps sit on the
        other side (a CKD run saved before ``--ckd-map-side student`` became the default has
        ``fusions.*``, and its config no ``ckd_map_side`` to compare); None otherwise."""
        saved_sides = {key.split(".", 1)[0] for key in saved_state} & {"fusions", "projections"}
        expected = "projections" if self.ckd_map_side == "student" else "fusions"
        if not saved_sides or expected in saved_sides:
            return None
        saved = "teacher" if "fusions" in saved_sides else "student"
        return (f"its CKD maps were trained with --ckd-map-side {saved}, this run has --ckd-map-side "
                f"{self.ckd_map_side}: resume with --ckd-map-side {saved} (the default is student since the "
                "paper's teacher-side fusion was found to collapse the student)")

    def layer_loss(self, side, student_states, teacher_states, padding_mask):
        if self.ckd_map_side == "student":
            return self.projections[side].loss(student_states, teacher_states, padding_mask)
        fused = self.fusions[side](teacher_states)  # (m, B, T, d_S)
        return masked_mse_sum(student_states[1:], fused, padding_mask)
