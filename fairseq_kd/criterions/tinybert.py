"""TinyBERT (Jiao et al. 2020) for encoder-decoder NMT, as Align-to-Distill's baseline (Sec. 5.3).

    L = L_CE + a L_att + h L_hidden + e L_emb + p L_pred        (all weights 1 by default)

Student layer ``j`` learns from teacher layer ``g(j) = j n / m`` on each side (the uniform
mapping), the embedding output from the teacher's. ``L_att`` (Eq. 7): MSE of the pre-softmax
attention scores head by head (encoder self, decoder self and cross), over the keys a query may
attend to; ``L_hidden`` (Eq. 8): ``MSE(h_S^j W_h, h_T^{g(j)})``; ``L_emb`` (Eq. 9): ``MSE(h_S^0
W_e, h_T^0)``, one ``W_h`` and ``W_e`` per side (the identity at equal widths); ``L_pred`` (Eq.
10): word-level KD. Each MSE is a mean over its inner axes per real position, summed over
positions and layer pairs. Equal head counts per kind are required (else use ``a2d_kd``).
Details: ``docs/methods/tinybert.md``.
"""
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch
from fairseq.criterions import register_criterion
from torch import Tensor, nn

from ..errors import InputError
from ..models.feature_capture import ATTENTION_KINDS, DECODER_CROSS, DECODER_SELF, ENCODER_SELF, CaptureRequest
from ..modules.layer_mapping import LayerMappingError, uniform_mapping
from ..modules.projection import width_projection
from .startup_checks import check_capturable, check_equal_heads
from .base import KDCriterionBase
from .config import KDCriterionConfig, weight
from .losses import masked_mse_sum, projected_mse_sum, sum_of_squares

#: the side whose layer mapping each attention kind follows
KIND_SIDE = {ENCODER_SELF: "encoder", DECODER_SELF: "decoder", DECODER_CROSS: "decoder"}
SIDES = ("encoder", "decoder")


@dataclass
class TinyBERTConfig(KDCriterionConfig):
    tinybert_att_weight: float = weight(1.0, term="att_score",
                                        help="weight of the attention-score MSE (TinyBERT Eq. 7)")
    tinybert_hidden_weight: float = weight(1.0, term="hidden",
                                           help="weight of the hidden-state MSE through W_h (Eq. 8)")
    tinybert_emb_weight: float = weight(1.0, term="embedding",
                                        help="weight of the embedding-output MSE through W_e (Eq. 9)")
    tinybert_pred_weight: Optional[float] = weight(
        None, example="1", kd_weight_alias=True,
        help="this method's name for --kd-weight, the weight of the prediction loss, word-level KD "
        "(Eq. 10; default 1); when given, it replaces --kd-weight",
    )


@register_criterion("tinybert", dataclass=TinyBERTConfig)
class TinyBERTCriterion(KDCriterionBase):
    TERM_NAMES = ("att_score", "hidden", "embedding", "word_kd")

    def __init__(self, cfg: TinyBERTConfig, task):
        super().__init__(cfg, task)
        self.weights = self.additive_weights()

        teacher, student = self.teacher.shape, task.require_student_shape(self.criterion_name())
        check_equal_heads(teacher, student, ATTENTION_KINDS, self.criterion_name())
        # Teacher layer (1-based) of every student layer (1-based), per side.
        self.mapping = {}
        for side in SIDES:
            try:
                self.mapping[side] = tuple(g for (g,) in uniform_mapping(teacher.layers(side), student.layers(side)))
            except LayerMappingError as err:
                raise InputError(
                    f"criterion 'tinybert' maps student {side} layer j to teacher layer j*n/m: {err}; "
                    f"use a student with --{side}-layers <= {teacher.layers(side)}"
                ) from err
        # W_h and W_e exist only for terms in use, so no parameter goes unused (DDP refuses those).
        self.hidden_projections = nn.ModuleDict(
            {side: width_projection(student.embed_dim(side), teacher.embed_dim(side))
             for side in SIDES if self.weights["hidden"] != 0}
        )
        self.embedding_projections = nn.ModuleDict(
            {side: width_projection(student.embed_dim(side), teacher.embed_dim(side))
             for side in SIDES if self.weights["embedding"] != 0}
        )
        attention = self.weights["att_score"] != 0
        hidden = self.weights["hidden"] != 0 or self.weights["embedding"] != 0
        kinds = ATTENTION_KINDS if attention else ()
        self.student_request = CaptureRequest(
            encoder_hidden=hidden, decoder_hidden=hidden, attention_kinds=kinds, attention_scores=attention,
        )
        # The teacher's scores only where the mapping reads them: its other attention modules keep
        # fairseq's fused path (half of them for the usual 2:1 depth ratio).
        self.teacher_request = CaptureRequest(
            encoder_hidden=hidden, decoder_hidden=hidden, attention_kinds=kinds, attention_scores=attention,
            attention_layers={kind: self.mapping[KIND_SIDE[kind]] for kind in kinds},
        )
        check_capturable(self.teacher, self.teacher_request, self.criterion_name())

    def loss_weights(self) -> Dict[str, float]:
        return dict(self.weights)

    def terms(self, batch) -> Dict[str, Tensor]:
        terms = {}
        if self.weights["att_score"] != 0:
            student, teacher = batch.student.attention, batch.teacher.attention
            terms["att_score"] = sum(
                attention_score_mse(
                    student[kind].scores, teacher[kind].of_layers(teacher[kind].scores, self.mapping[KIND_SIDE[kind]]),
                    student[kind].attendable,
                )
                for kind in ATTENTION_KINDS
            )
        if self.weights["hidden"] != 0:
            terms["hidden"] = sum(
                hidden_mse(
                    self.hidden_projections[side], batch.student.hidden(side), range(1, len(self.mapping[side]) + 1),
                    batch.teacher.hidden(side), self.mapping[side], batch.student.padding_mask(side),
                )
                for side in SIDES
            )
        if self.weights["embedding"] != 0:
            terms["embedding"] = sum(
                hidden_mse(
                    self.embedding_projections[side], batch.student.hidden(side), (0,),
                    batch.teacher.hidden(side), (0,), batch.student.padding_mask(side),
                )
                for side in SIDES
            )
        return terms


def attention_score_mse(student_scores: Tensor, teacher_scores: Tensor, attendable: Tensor) -> Tensor:
    """TinyBERT's attention loss (Eq. 7), float32: per real query the mean of ``(s - t)^2`` over
    heads and attendable keys, summed over queries, sentences and layer pairs. scores ``(m, B, H,
    Tq, Tk)``, the teacher's of the layer mapped to each student layer; attendable ``(B, 1, Tq, Tk)``.
    """
    difference = student_scores.float() - teacher_scores.float()
    difference.masked_fill_(~attendable.unsqueeze(0), 0.0)
    per_row = sum_of_squares(difference, dims=-1)  # (m, B, H, Tq)
    keys = attendable.sum(-1).clamp_min(1).unsqueeze(0)  # (1, B, 1, Tq); 0 only on padded queries
    return (per_row / keys).mean(dim=2).sum()


def hidden_mse(projection: nn.Module, student_states: Tensor, student_layers: Sequence[int],
               teacher_states: Tensor, teacher_layers: Sequence[int], padding_mask: Tensor) -> Tensor:
    """``sum_j sum_t mean_d (h_S^{s_j} W + b - h_T^{t_j})^2`` over the layer pairs ``j`` (the stack
    indices ``student_layers``, ``teacher_layers``) and real positions ``t``, float32 (Eq. 8 with
    ``W_h``, Eq. 9 with ``W_e``); ``projection``: ``nn.Linear`` or ``nn.Identity``."""
    if isinstance(projection, nn.Identity):
        return masked_mse_sum(student_states[list(student_layers)], teacher_states[list(teacher_layers)], padding_mask)
    device = student_states.device
    return projected_mse_sum(
        student_states, torch.tensor(list(student_layers), device=device), projection.weight.t().unsqueeze(0),
        None if projection.bias is None else projection.bias.unsqueeze(0),
        teacher_states, torch.tensor(list(teacher_layers), device=device), padding_mask,
    )
