"""Combinatorial KD, CKD (Wu et al. 2020, "Why Skip If You Can Combine", EMNLP, arXiv:2010.03034).

Student layer ``i`` learns from a fusion of the teacher layers ``M(i)`` (Eq. 3)::

    f^i = W_i [h_T^{j_1} ; h_T^{j_2} ; ...] + b_i,   j in M(i)      (concatenation + linear map)
    L_CKD = sum_positions sum_i MSE(h_S^i, f^i)

with ``W_i`` of shape ``d_S x |M(i)| d_T`` and ``b_i`` learnable distillation-only parameters (the
paper has ``d_S = d_T``; mapping straight to the student's width bridges any widths). The MSE of
two vectors is the mean squared difference over their ``d_S`` features; the sum runs over real
positions and student layers (unit of ``ckd_loss``: real tokens of the distilled side(s)).
Total: ``beta L_CE + eta L_KD + lambda L_CKD`` with ``eta = 0.1``, ``lambda = 0.7`` (Sec. 4).

Mappings ``M``: the paper's RC, OC, SC and CC, generalised to any depths ``n >= m`` by the rules
of :mod:`fairseq_kd.modules.layer_mapping` (which reproduce the paper's 6-to-2 sets exactly), or
an explicit ``--ckd-layer-map`` such as ``1,2,3|4,5,6``. The paper distils the encoder only,
having found decoder KD to hurt; ``--layer-sides decoder|both`` adds the decoder, with the same
strategy (or explicit map) applied to the decoder's depths.

Implementation: ``W_i [h^{j_1}; h^{j_2}]`` equals ``W_{i,1} h^{j_1} + W_{i,2} h^{j_2}`` for the column
blocks ``W_{i,k}`` of ``W_i``, so all (student layer, teacher layer) pairs are projected in one
batched matmul over the stacked teacher states and summed per student layer with ``index_add``.
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
from .losses import masked_mse_sum

CKD_MAPPING_CHOICES = ChoiceEnum(list(CKD_STRATEGIES))


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
                  "e.g. '1,2,3|4,5,6'"},
    )


class LayerFusion(nn.Module):
    """``f^i = W_i [h^{j_1}; ...; h^{j_k}] + b_i`` for every student layer ``i`` at once.

    ``blocks`` holds one ``d_T x d_S`` block per (student layer, teacher layer) pair, in mapping
    order; each block is initialised like the ``nn.Linear(k_i d_T, d_S)`` it is a part of.
    """

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
        self.register_buffer(
            "pair_teacher_layer", torch.tensor([j for group in mapping for j in group]), persistent=False
        )
        self.register_buffer(
            "pair_student_slot",
            torch.tensor([i for i, group in enumerate(mapping) for _ in group]),
            persistent=False,
        )

    def forward(self, teacher_states: Tensor) -> Tensor:
        """teacher_states ``(n + 1, B, T, d_T)`` -> fused ``(m, B, T, d_S)`` in float32."""
        pairs = teacher_states.index_select(0, self.pair_teacher_layer)  # (P, B, T, d_T)
        contributions = in_param_dtype(self.blocks, pairs)  # (P, B, T, d_S)
        fused = contributions.new_zeros((len(self.mapping),) + contributions.shape[1:])
        fused = fused.index_add(0, self.pair_student_slot, contributions)
        return fused + self.bias.float()[:, None, None, :]


@register_criterion("ckd", dataclass=CombinatorialKDConfig)
class CombinatorialKDCriterion(HiddenStateKDCriterion):
    LAYER_TERM = "ckd"
    TERM_NAMES = ("word_kd", "ckd")

    def __init__(self, cfg: CombinatorialKDConfig, task):
        super().__init__(cfg, task)
        self.ckd_mapping = str(cfg.ckd_mapping)
        self.ckd_layer_map = cfg.ckd_layer_map or None
        self.mappings = {}
        self.fusions = nn.ModuleDict()
        for side in self.sides:
            mapping = resolve_mapping(
                CKD_STRATEGIES, self.ckd_mapping, self.ckd_layer_map,
                self.teacher_shape.layers(side), self.student_shape.layers(side),
                "--ckd-mapping", "--ckd-layer-map", f" [{side}]",
            )
            self.mappings[side] = mapping
            self.fusions[side] = LayerFusion(
                mapping, self.teacher_shape.embed_dim(side), self.student_shape.embed_dim(side)
            )

    def layer_loss(self, side, student_states, teacher_states, padding_mask):
        fused = self.fusions[side](teacher_states)  # (m, B, T, d_S)
        return masked_mse_sum(student_states[1:], fused, padding_mask)
