"""TIE-KD's top-1 term (Zhang et al., ACL 2023, "Towards Understanding and Improving Knowledge
Distillation for Neural Machine Translation"): word-level KD plus the hierarchical ranking loss.

    loss = (1 - a) L_CE + a (L_KD + w L_HR)
    L_HR = sum_t [ sum_{i=2..K} [q(t_i) - q(t_1)]_+ + sum_{i,j<=K} 1[p(t_i) > p(s_j)] [q(s_j) - q(t_i)]_+ ]

over real target positions; ``t_1..t_K``: the teacher's top K tokens, ``s_1..s_K``: the student's;
``p``, ``q``: teacher and student probabilities (tau = 1), ``[x]_+ = max(x, 0)``. The first level
makes the teacher's top-1 the student's top-1 among the teacher's top K, the second keeps a token
the teacher ranks lower from passing one of the teacher's top K. a = 0.5, K = 5, w = 1 (the
authors' scripts). Deviation: the paper's iterative KD on the student's own predictions is not
part of this term (``docs/methods/tie_kd.md``).
"""
from dataclasses import dataclass

import torch
from fairseq.criterions import register_criterion
from torch import Tensor

from .chunked import chunked_logsumexp
from .config import ranged, weight
from .word_kd import WordKDConfig, WordKDCriterion


@dataclass
class TieKDConfig(WordKDConfig):
    tie_topk: int = ranged(5, 2, meaning="a number of tokens",
                           help="K: the teacher's top K tokens the hierarchical ranking loss orders")
    tie_rank_weight: float = weight(
        1.0, help="w in (1-a)*CE + a*(KD + w*L_HR): the weight of the ranking term beside word-level KD",
    )


def hierarchical_ranking_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, k: int) -> Tensor:
    """``L_HR`` summed over the positions where ``mask`` is True (see the module docstring), float32.
    The ranks are read from the detached logits; the gradient reaches the student's logits through
    the probabilities at the ``2 K`` tokens of each position."""
    k = min(k, student_logits.size(-1))
    with torch.no_grad():
        teacher_values, teacher_ids = teacher_logits.topk(k, dim=-1)
        student_ids = student_logits.detach().topk(k, dim=-1).indices
        # p(t_i) > p(s_j), compared on the teacher's logits (the softmax keeps their order)
        ranked_lower = teacher_values.unsqueeze(-1) > teacher_logits.gather(-1, student_ids).unsqueeze(-2)
    log_normaliser = chunked_logsumexp(student_logits).unsqueeze(-1)
    q_teacher_top = (student_logits.gather(-1, teacher_ids).float() - log_normaliser).exp()  # q(t_i)
    q_student_top = (student_logits.gather(-1, student_ids).float() - log_normaliser).exp()  # q(s_j)
    top1 = (q_teacher_top[..., 1:] - q_teacher_top[..., :1]).clamp_min(0.0).sum(-1)
    passed = (q_student_top.unsqueeze(-2) - q_teacher_top.unsqueeze(-1)).clamp_min(0.0)  # [i, j]
    top_k = torch.where(ranked_lower, passed, 0.0).sum((-2, -1))
    return torch.where(mask, top1 + top_k, 0.0).sum()


@register_criterion("tie_kd", dataclass=TieKDConfig)
class TieKDCriterion(WordKDCriterion):
    """Word-level KD and TIE-KD's hierarchical ranking loss; see the module docstring."""

    TERM_NAMES = ("word_kd", "tie_rank")
    WEIGHT_FLAGS = {"ce": "1 - --kd-weight", "word_kd": "--kd-weight", "tie_rank": "--tie-rank-weight"}

    def loss_weights(self):
        return {"ce": 1.0 - self.kd_weight, "word_kd": self.kd_weight,
                "tie_rank": self.kd_weight * float(self.cfg.tie_rank_weight)}

    def terms(self, batch):
        if self.loss_weights()["tie_rank"] == 0:
            return {}
        return {"tie_rank": hierarchical_ranking_loss(batch.student_logits, batch.teacher_logits, batch.target_mask,
                                                      int(self.cfg.tie_topk))}
