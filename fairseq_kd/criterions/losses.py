"""Loss functions shared by several methods: pure functions of tensors and masks.

Every function returns an unnormalised *sum* over the real (unpadded) positions it is given; the
criterion base divides by fairseq's ``sample_size`` once, as fairseq does for cross-entropy, so
loss weights mean the same at any batch size and on any number of workers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def word_level_kd(
    student_logits: Tensor, teacher_logits: Tensor, target_mask: Tensor, temperature: float = 1.0
) -> Tensor:
    """Word-level KD (Hinton et al., 2015): ``tau^2 * sum_t KL(p_T^tau(.|t) || p_S^tau(.|t))``.

    student_logits, teacher_logits: ``(batch, tgt_len, vocab)``; target_mask: ``(batch, tgt_len)``,
    True at real target tokens. The ``tau^2`` factor keeps gradient magnitudes comparable across
    temperatures (Hinton et al., Sec. 2). Computed in float32 whatever the model dtype.
    """
    student_lp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher_lp = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    per_position = F.kl_div(student_lp, teacher_lp, reduction="none", log_target=True).sum(-1)
    return (temperature**2) * per_position.masked_select(target_mask).sum()


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``values`` where ``mask`` (broadcastable) is True, in float32."""
    return values.float().masked_fill(~mask, 0.0).sum()
