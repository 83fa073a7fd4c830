"""RAIL-KD: random intermediate layer mapping (Haidar et al. 2022, arXiv:2110.08532).

    L_RAIL = sum_i || P_S v_S^i / ||.|| - P_T v_T^{t_i} / ||.|| ||^2   (layer-wise, Eq. 2)
    L      = l1 L_CE + l2 L_KD + l3 L_RAIL                              (Eq. 4, 1/3 each)

Every epoch ``k`` teacher intermediate layers are drawn without replacement, sorted and paired with
the student's ``k`` intermediate layers (:func:`~fairseq_kd.modules.layer_mapping.draw_layers`, a
function of ``--seed``, the epoch and the side: the same on every worker and after a resume).
``v`` is a layer's mean over real positions (Eq. 1); ``P`` maps to ``u = 128``. The concatenated
variant (Eq. 3) concatenates the ``k`` vectors and compares once. Per sentence as the paper
defines it (a ``SENTENCE_TERMS`` entry). ``--rail-include-top-layers`` also uses the top layers.
"""
import logging
from dataclasses import dataclass, field
from typing import Dict

import torch
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from omegaconf import II
from torch import nn

from ..modules.layer_mapping import LayerMappingError, draw_layers
from ..modules.projection import StackedLinear
from .config import ranged, weight
from .hidden_state import HiddenStateKDConfig, HiddenStateKDCriterion, in_param_dtype
from .losses import masked_mean_pool, normalized_squared_distance

logger = logging.getLogger(__name__)

RAIL_VARIANT_CHOICES = ChoiceEnum(["layerwise", "concatenated"])


@dataclass
class RailKDConfig(HiddenStateKDConfig):
    kd_weight: float = weight(
        1.0 / 3.0, help="lambda_2: weight of the word-level KD term; the CE weight is 1 - kd_weight - "
        "layer_weight (RAIL-KD paper: 1/3 each)",
    )
    layer_weight: float = weight(
        1.0 / 3.0, help="lambda_3: weight of the RAIL-KD term (paper: 1/3); 0 together with --kd-weight 0 "
        "is plain label-smoothed CE",
    )
    rail_variant: RAIL_VARIANT_CHOICES = field(
        default="layerwise",
        metadata={"help": "layerwise (Eq. 2: per-layer projections, distances summed) or "
                  "concatenated (Eq. 3: the layers' sentence vectors concatenated, one projection)"},
    )
    rail_projection_dim: int = ranged(
        128, 1, meaning="a dimension", help="u: width of the common space both models are projected to (paper: 128)"
    )
    rail_include_top_layers: bool = field(
        default=False,
        metadata={"help": "draw from teacher layers 1..n and distil student layers 1..m instead of the "
                  "paper's intermediate layers 1..n-1 and 1..m-1"},
    )
    seed: int = II("common.seed")


@register_criterion("rail_kd", dataclass=RailKDConfig)
class RailKDCriterion(HiddenStateKDCriterion):
    LAYER_TERM = "rail"
    TERM_NAMES = ("word_kd", "rail")
    SENTENCE_TERMS = ("rail",)

    def __init__(self, cfg: RailKDConfig, task):
        super().__init__(cfg, task)
        self.rail_variant = str(cfg.rail_variant)
        rail_projection_dim = cfg.rail_projection_dim
        self.seed = int(cfg.seed)
        self.include_top = bool(cfg.rail_include_top_layers)
        self.teacher_candidates: Dict[str, int] = {}
        self.teacher_projections = nn.ModuleDict()
        self.student_projections = nn.ModuleDict()
        for side in self.sides:
            n, m = self.teacher_shape.layers(side), self.student_shape.layers(side)
            candidates, distilled = (n, m) if self.include_top else (n - 1, m - 1)
            self._check_depths(side, n, m, candidates, distilled)
            self.teacher_candidates[side] = candidates
            self.register_layer_index(f"{side}_student_layers", range(1, distilled + 1))
            self.register_layer_index(f"{side}_teacher_layers", range(1, distilled + 1))
            d_t, d_s = self.teacher_shape.embed_dim(side), self.student_shape.embed_dim(side)
            if self.rail_variant == "layerwise":
                self.teacher_projections[side] = StackedLinear(distilled, d_t, rail_projection_dim)
                self.student_projections[side] = StackedLinear(distilled, d_s, rail_projection_dim)
            else:
                self.teacher_projections[side] = nn.Linear(distilled * d_t, rail_projection_dim)
                self.student_projections[side] = nn.Linear(distilled * d_s, rail_projection_dim)
        self.draw(self.epoch)

    def _check_depths(self, side, n, m, candidates, distilled) -> None:
        """The student needs 1..n layers (2..n for intermediate layers only): one distinct teacher
        layer per distilled student layer, and at least one layer to distil."""
        lowest = 1 if self.include_top else 2
        if lowest <= m <= n:
            return
        if n < lowest:
            raise LayerMappingError(
                f"--criterion rail_kd [{side}]: the {n}-layer teacher has no intermediate layer to draw "
                "from; pass --rail-include-top-layers to use its top layer"
            )
        if distilled < 1:
            reason = "its only layer is its top layer, which intermediate-layer RAIL-KD leaves out"
        else:
            reason = (f"its {distilled} distilled layers each need a distinct teacher layer, drawn from "
                      f"only {candidates} (teacher layers 1..{candidates})")
        raise LayerMappingError(
            f"--criterion rail_kd [{side}]: with a {n}-layer teacher the student's {side} must have "
            f"{lowest}..{n} layers, but it has {m}: {reason}"
            + ("" if self.include_top else "; --rail-include-top-layers also uses the top layers")
        )

    # ------------------------------------------------------------------ the draw
    def draw(self, epoch: int) -> None:
        """Set the teacher layers paired with the student's layers for ``epoch``."""
        self.drawn = {}
        for side in self.sides:
            index = getattr(self, f"{side}_teacher_layers")
            self.drawn[side] = draw_layers(self.seed, epoch, self.teacher_candidates[side], index.numel(), stream=side)
            index.copy_(torch.tensor(self.drawn[side], dtype=torch.long))

    def begin_epoch(self, epoch: int) -> None:
        super().begin_epoch(epoch)
        self.draw(epoch)
        logger.info("rail_kd epoch %d: %s", epoch, self.describe_draw())

    def describe_draw(self) -> str:
        return "; ".join(
            f"{side} student layers {getattr(self, f'{side}_student_layers').tolist()} <- teacher layers "
            f"{list(self.drawn[side])}"
            for side in self.sides
        )

    # ------------------------------------------------------------------ the loss
    def layer_loss(self, side, student_states, teacher_states, padding_mask):
        student = masked_mean_pool(
            student_states.index_select(0, getattr(self, f"{side}_student_layers")), padding_mask
        )  # (k, B, d_S)
        teacher = masked_mean_pool(
            teacher_states.index_select(0, getattr(self, f"{side}_teacher_layers")), padding_mask
        )  # (k, B, d_T)
        if self.rail_variant == "concatenated":
            # (k, B, d) -> (B, k*d), layer 1's features first, as [h_1, ..., h_k] in Eq. 3.
            student = student.transpose(0, 1).flatten(1)
            teacher = teacher.transpose(0, 1).flatten(1)
        student = in_param_dtype(self.student_projections[side], student)
        teacher = in_param_dtype(self.teacher_projections[side], teacher)
        return normalized_squared_distance(student, teacher).sum()
