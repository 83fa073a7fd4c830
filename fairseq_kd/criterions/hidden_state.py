"""What the hidden-state criterions share (PKD, CKD, ALP-KD, RAIL-KD, internal KD).

    loss = beta L_CE + eta L_KD + lambda L_layer,   beta = 1 - eta - lambda

(CKD, Wu et al. 2020, Sec. 4; ALP-KD, Passban et al. 2021, Eq. 7), with the papers' ``eta = 0.1``,
``lambda = 0.7`` as defaults. ``--layer-sides`` chooses the distilled stack (encoder by default,
as CKD found decoder KD to hurt; decoder or both on request). Learnable modules run in their
parameters' dtype (:func:`in_param_dtype`), every loss in float32. A subclass gives its term's name
(``LAYER_TERM``) and :meth:`~HiddenStateKDCriterion.layer_loss` for one side.
"""
from dataclasses import dataclass, field
from typing import Dict, Tuple

import torch
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from ..models.feature_capture import CaptureRequest
from ..errors import InputError
from .base import KDCriterionBase
from .method import DistillationBatch
from .config import KDCriterionConfig, weight

LAYER_SIDES = ChoiceEnum(["encoder", "decoder", "both"])
SIDES_OF = {"encoder": ("encoder",), "decoder": ("decoder",), "both": ("encoder", "decoder")}


@dataclass
class HiddenStateKDConfig(KDCriterionConfig):
    kd_weight: float = weight(
        0.1, help="eta: weight of the word-level KD term; the CE weight is beta = 1 - eta - lambda "
        "(CKD and ALP-KD papers: eta = 0.1)",
    )
    layer_weight: float = weight(
        0.7, help="lambda: weight of the method's intermediate-layer term (CKD and ALP-KD papers: 0.7); "
        "0 together with --kd-weight 0 is plain label-smoothed CE",
    )
    layer_sides: LAYER_SIDES = field(
        default="encoder",
        metadata={"help": "which stack's layers are distilled: encoder (default; the CKD paper found "
                  "decoder-side KD to hurt translation), decoder, or both"},
    )


class HiddenStateKDCriterion(KDCriterionBase):
    """Base of the hidden-state methods: weights, sides, capture request and shapes."""

    LAYER_TERM: str = ""
    WEIGHT_FLAGS = {"ce": "1 - --kd-weight - --layer-weight", "word_kd": "--kd-weight"}

    def __init__(self, cfg: HiddenStateKDConfig, task):
        super().__init__(cfg, task)
        self.layer_weight = float(cfg.layer_weight)
        self.check_weights(self.kd_weight, self.layer_weight)
        self.sides: Tuple[str, ...] = SIDES_OF[str(cfg.layer_sides)]
        self.teacher_shape = self.teacher.shape
        self.student_shape = task.require_student_shape(self.criterion_name())
        hidden = self.layer_weight != 0  # hidden states of the distilled sides, no attention maps
        self.student_request = self.teacher_request = CaptureRequest(
            encoder_hidden=hidden and "encoder" in self.sides, decoder_hidden=hidden and "decoder" in self.sides)

    @classmethod
    def check_weights(cls, kd_weight: float, layer_weight: float) -> None:
        """The CE weight ``1 - kd_weight - layer_weight`` must not be negative (each weight's own
        range, >= 0, is checked by the base)."""
        if kd_weight + layer_weight > 1.0 + 1e-9:
            raise InputError(
                f"--kd-weight ({kd_weight}) and --layer-weight ({layer_weight}) must be >= 0 with a sum "
                "of at most 1, since the CE weight is 1 - kd_weight - layer_weight"
            )

    # ------------------------------------------------------------------ method API
    def layer_loss(self, side: str, student_states: Tensor, teacher_states: Tensor,
                   padding_mask: Tensor) -> Tensor:
        """The layer term of one side, unnormalised. student_states ``(m + 1, batch, len, d_S)``,
        teacher_states ``(n + 1, batch, len, d_T)`` (index 0 the embedding output), padding_mask
        ``(batch, len)`` True at padding."""
        raise NotImplementedError

    # ---------------------------------------------------------------- criterion
    def loss_weights(self) -> Dict[str, float]:
        return {
            "ce": 1.0 - self.kd_weight - self.layer_weight,
            "word_kd": self.kd_weight,
            self.LAYER_TERM: self.layer_weight,
        }

    def terms(self, batch: DistillationBatch) -> Dict[str, Tensor]:
        if self.loss_weights()[self.LAYER_TERM] == 0:
            return {}
        return {self.LAYER_TERM: sum(
            self.layer_loss(side, batch.student.hidden(side), batch.teacher.hidden(side),
                            batch.student.padding_mask(side))
            for side in self.sides
        )}

    # ------------------------------------------------------------------ helpers
    def register_layer_index(self, name: str, layers) -> None:
        """Keep 1-based layer numbers as a device-following index into ``(layers + 1, ...)`` stacks
        (index 0 there is the embedding output, so layer ``l`` sits at index ``l``)."""
        self.register_buffer(name, torch.tensor(list(layers), dtype=torch.long), persistent=False)


def in_param_dtype(module: nn.Module, inputs: Tensor) -> Tensor:
    """``module(inputs)`` computed in the module's parameter dtype (fp16/bf16 with the model), in
    float32."""
    parameter = next(module.parameters(), None)
    if parameter is None:
        return module(inputs.float())
    return module(inputs.to(parameter.dtype)).float()
