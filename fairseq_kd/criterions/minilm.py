"""MiniLM (Wang et al. 2020) for encoder-decoder NMT, as Align-to-Distill's baseline (Sec. 5.3).

    L = L_CE + a L_AT + v L_VR + mu L_KD        (all weights 1 by default)

Only the last layer is distilled (MiniLM Sec. 3): ``L_AT`` is ``KL(A_T^a || A_S^a)`` per head and
query (Eq. 6), ``L_VR`` the KL of the value relations ``softmax(V^a V^a^T / sqrt(d_head))``
(Eq. 7-8); both averaged over heads, summed over real queries, keys a query may not attend to
excluded. The head sizes may differ, the head counts may not. ``--minilm-attention-kinds self``
distils encoder and decoder self-attention, ``all`` adds cross-attention. Deviations (the decoder's
causal value relation, CE and word KD added): ``docs/methods/minilm.md``.
"""
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import Tensor

from ..models.feature_capture import DECODER_CROSS, DECODER_SELF, ENCODER_SELF, AttentionMaps, CaptureRequest
from .startup_checks import check_capturable, check_equal_heads
from .base import KDCriterionBase
from .config import KDCriterionConfig, weight
from .losses import masked_log_softmax_kl

MINILM_KINDS = {"self": (ENCODER_SELF, DECODER_SELF), "all": (ENCODER_SELF, DECODER_SELF, DECODER_CROSS)}


@dataclass
class MiniLMConfig(KDCriterionConfig):
    minilm_att_weight: float = weight(1.0, term="attention_kl",
                                      help="weight of the last layer's attention KL (MiniLM Eq. 6)")
    minilm_vr_weight: float = weight(1.0, term="value_relation",
                                     help="weight of the last layer's value-relation KL (MiniLM Eq. 8)")
    minilm_kd_weight: Optional[float] = weight(
        None, example="1", kd_weight_alias=True,
        help="this method's name for --kd-weight, the weight mu of word-level KD added as in "
        "Align-to-Distill's baseline (default 1); when given, it replaces --kd-weight",
    )
    minilm_attention_kinds: ChoiceEnum(list(MINILM_KINDS)) = field(
        default="self",
        metadata={"help": "self: encoder and decoder self-attention of the last layer; all: also the "
                  "decoder's cross-attention"},
    )


@register_criterion("minilm", dataclass=MiniLMConfig)
class MiniLMCriterion(KDCriterionBase):
    TERM_NAMES = ("attention_kl", "value_relation", "word_kd")

    def __init__(self, cfg: MiniLMConfig, task):
        super().__init__(cfg, task)
        self.weights = self.additive_weights()
        self.kinds = MINILM_KINDS[str(cfg.minilm_attention_kinds)]
        check_equal_heads(self.teacher.shape, task.require_student_shape(self.criterion_name()),
                          self.kinds, self.criterion_name())
        needs_attention = self.weights["attention_kl"] != 0 or self.weights["value_relation"] != 0
        self.student_request = self.teacher_request = CaptureRequest(
            attention_kinds=self.kinds if needs_attention else (),
            attention_scores=self.weights["attention_kl"] != 0,
            attention_values=self.weights["value_relation"] != 0,
            last_layer_attention_only=True,  # MiniLM distils the top layer only
        )
        check_capturable(self.teacher, self.teacher_request, self.criterion_name())

    def loss_weights(self) -> Dict[str, float]:
        return dict(self.weights)

    def terms(self, batch) -> Dict[str, Tensor]:
        terms = {}
        if self.weights["attention_kl"] != 0:
            terms["attention_kl"] = sum(
                last_layer_attention_kl(batch.student.attention[kind], batch.teacher.attention[kind])
                for kind in self.kinds
            )
        if self.weights["value_relation"] != 0:
            terms["value_relation"] = sum(
                last_layer_value_relation_kl(batch.student.attention[kind], batch.teacher.attention[kind], kind)
                for kind in self.kinds
            )
        return terms


def head_mean_row_kl(teacher_logits: Tensor, student_logits: Tensor, mask: Tensor) -> Tensor:
    """``sum_rows mean_heads KL(softmax(t) || softmax(s))`` over the True entries of ``mask``.
    logits: ``(B, H, R, K)``; mask: ``(B, 1, R, K)``, True where a row's key counts."""
    return masked_log_softmax_kl(teacher_logits, student_logits, mask).mean(1).sum()


def last_layer_attention_kl(student: AttentionMaps, teacher: AttentionMaps) -> Tensor:
    """MiniLM Eq. 6 on the last layer of one kind, from the pre-softmax scores."""
    return head_mean_row_kl(teacher.scores[-1], student.scores[-1], student.attendable)


def value_relation_logits(values: Tensor) -> Tensor:
    """``V V^T / sqrt(d_head)`` per head: values ``(B, H, T, d_head)`` -> ``(B, H, T, T)``."""
    values = values.float()
    return torch.matmul(values, values.transpose(-1, -2)) * values.size(-1) ** -0.5


def value_relation_mask(maps: AttentionMaps, kind: str) -> Tensor:
    """Where a value relation entry counts, ``(B, 1, T, T)``: for self-attention the attention's own
    mask (real queries, attendable keys: causal in the decoder); for cross-attention, whose values
    sit at source positions, every pair of real source positions."""
    if kind == DECODER_CROSS:
        real = ~maps.key_padding_mask
        return (real[:, :, None] & real[:, None, :]).unsqueeze(1)
    return maps.attendable


def last_layer_value_relation_kl(student: AttentionMaps, teacher: AttentionMaps, kind: str) -> Tensor:
    """MiniLM Eq. 7-8 on the last layer of one kind."""
    return head_mean_row_kl(
        value_relation_logits(teacher.values[-1]), value_relation_logits(student.values[-1]),
        value_relation_mask(student, kind),
    )
