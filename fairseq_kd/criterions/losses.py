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


def topk_word_level_kd(
    student_logits: Tensor, teacher_topk_logprobs: Tensor, teacher_topk_ids: Tensor, target_mask: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """Word-level KD from a cached teacher (:mod:`fairseq_kd.data.teacher_cache`):
    ``tau^2 * sum_t sum_i q_i (log q_i - log p_S^tau(id_i | t))``, where ``q`` is the softmax of the
    teacher's ``k`` stored log-probabilities divided by ``tau`` (the teacher renormalised to its top
    k) and ``p_S^tau`` the student's full-vocabulary distribution at ``tau``, read at the teacher's
    ``k`` token ids. When the teacher's mass lies within its top k this is :func:`word_level_kd`.

    teacher_topk_logprobs, teacher_topk_ids: ``(batch, tgt_len, k)``; the rest as
    :func:`word_level_kd`. Computed in float32.
    """
    student_lp = F.log_softmax(student_logits.float() / temperature, dim=-1).gather(-1, teacher_topk_ids)
    teacher_lp = F.log_softmax(teacher_topk_logprobs.float() / temperature, dim=-1)
    per_position = (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1)
    return (temperature**2) * per_position.masked_select(target_mask).sum()


def word_kd_term(batch, target_mask: Tensor, temperature: float) -> Tensor:
    """Word-level KD of a :class:`~.base.DistillationBatch` at ``target_mask``: from the live
    teacher's logits, or from the cached top-k teacher when the batch carries it."""
    if batch.teacher_topk is not None:
        return topk_word_level_kd(batch.student_logits, *batch.teacher_topk, target_mask, temperature)
    return word_level_kd(batch.student_logits, batch.teacher_logits, target_mask, temperature)


# ----------------------------------------------------------------------------------------------
# Hidden-state losses (PKD, CKD, ALP-KD, RAIL-KD, internal KD). States are ``(..., batch, len, dim)``
# with any leading (layer) dimensions; ``padding_mask`` is ``(batch, len)``, True at padding.


def masked_mean_pool(states: Tensor, padding_mask: Tensor) -> Tensor:
    """Sentence vectors: the mean of ``states`` over each sentence's real positions.

    states ``(..., batch, len, dim)`` -> ``(..., batch, dim)`` in float32 (RAIL-KD Eq. 1, the
    mean-pooled sentence representation; padded positions take no part).
    """
    real = (~padding_mask).to(torch.float32).unsqueeze(-1)  # (batch, len, 1)
    counts = real.sum(-2).clamp_min(1.0)  # (batch, 1)
    return (states.float() * real).sum(-2) / counts


def normalized_squared_distance(a: Tensor, b: Tensor) -> Tensor:
    """``|| a/||a|| - b/||b|| ||^2`` over the last dimension (PKD, Sun et al. 2019, Eq. 3 as cited by
    ALP-KD; RAIL-KD Eq. 2-3), in float32; the result drops the last dimension."""
    return (F.normalize(a.float(), dim=-1) - F.normalize(b.float(), dim=-1)).pow(2).sum(-1)


def masked_mse_sum(a: Tensor, b: Tensor, padding_mask: Tensor) -> Tensor:
    """``sum over real positions of MSE(a_t, b_t)`` where the MSE of two vectors is the mean of the
    squared differences over their ``dim`` features (CKD Eq. 3, ALP-KD Eq. 7).

    a, b: ``(..., batch, len, dim)``; the sum also runs over the leading (layer) dimensions.
    """
    difference = a.float() - b.float()
    # In place: the subtraction's backward does not need its output, and the norm's backward reads
    # the masked difference, so no second (layers x batch x len x dim) tensor is made or kept.
    difference.masked_fill_(padding_mask.unsqueeze(-1), 0.0)
    return sum_of_squares(difference) / difference.size(-1)


def sum_of_squares(values: Tensor, dims=None) -> Tensor:
    """``sum(values ** 2)`` over ``dims`` (all by default), as a squared vector norm: one reduction
    without an elementwise square, and a backward of one pass that reads only ``values`` (zero
    gradient where the norm is 0)."""
    return torch.linalg.vector_norm(values, dim=dims).square()


def masked_row_kl(student_log_probs: Tensor, mask: Tensor, teacher_probs: Tensor = None,
                  teacher_log_probs: Tensor = None) -> Tensor:
    """Row-wise ``KL(p || q) = sum_k p_k (log p_k - log q_k)`` over the last dimension, in float32:
    the one KL of attention-like distributions (internal KD's attention rows, A2D's maps, MiniLM's
    attention and value relations), summed over the row and returned per row (shape of the inputs
    without the last dimension); the caller reduces rows, heads and maps as its paper does.

    Masking convention: ``mask`` (broadcastable to the inputs) is True at the entries that belong to
    a row's distribution; every other entry is *selected away* (``torch.where``), never multiplied
    by an infinite log, so a row with no True entry (a padded query) is exactly 0 and its gradient
    stays finite. The caller must give finite values at the True entries: ``student_log_probs``
    (``log q``, never clamped probabilities) and the teacher either as probabilities
    (``teacher_probs``; ``0 log 0 = 0`` through ``xlogy``) or as log-probabilities
    (``teacher_log_probs``; ``p = exp(log p)``), exactly one of the two.
    """
    if (teacher_probs is None) == (teacher_log_probs is None):
        raise ValueError("masked_row_kl needs exactly one of teacher_probs and teacher_log_probs")
    log_q = torch.where(mask, student_log_probs.float(), 0.0)
    if teacher_log_probs is not None:
        log_p = torch.where(mask, teacher_log_probs.float(), 0.0)
        p = torch.where(mask, log_p.exp(), 0.0)
        return (p * (log_p - log_q)).sum(-1)
    p = torch.where(mask, teacher_probs.float(), 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(-1)
