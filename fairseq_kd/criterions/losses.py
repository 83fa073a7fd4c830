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
    if teacher_logits.requires_grad:
        # a teacher trained jointly (self-distillation) needs the gradient on its side too, which
        # the fused function below does not form
        student_lp = _log_softmax_at(student_logits, temperature)
        teacher_lp = _log_softmax_at(teacher_logits, temperature)
        per_position = F.kl_div(student_lp, teacher_lp, reduction="none", log_target=True).sum(-1)
        return (temperature**2) * per_position.masked_select(target_mask).sum()
    return _WordLevelKD.apply(student_logits, teacher_logits, target_mask, float(temperature))


class _WordLevelKD(torch.autograd.Function):
    """:func:`word_level_kd` with its gradient formed in the forward pass.

    The gradient with respect to the student's logits is ``tau (p_S^tau - p_T^tau)`` at the masked
    positions, so the forward pass, which has both distributions at hand, keeps that one
    ``(batch, len, vocab)`` tensor for the backward pass instead of the student's and the
    teacher's log-probabilities that autograd through ``log_softmax`` and ``kl_div`` would keep
    (plus their elementwise KL). At a real vocabulary (10k types, 4k target tokens: 160 MB per such
    float32 tensor) this is most of what word-level KD adds to a step's memory.
    """

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, target_mask, temperature):
        student_lp = _log_softmax_at(student_logits, temperature)
        teacher_lp = _log_softmax_at(teacher_logits, temperature)
        teacher_p = teacher_lp.exp()
        # in place from here on: the three tensors are this function's own
        per_position = teacher_lp.sub_(student_lp).mul_(teacher_p).sum(-1)
        loss = (temperature**2) * per_position.masked_select(target_mask).sum()
        if ctx.needs_input_grad[0]:
            gradient = student_lp.exp_().sub_(teacher_p).mul_(temperature)
            gradient.masked_fill_(~target_mask.unsqueeze(-1), 0.0)
            ctx.save_for_backward(gradient)
            ctx.student_dtype = student_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (gradient,) = ctx.saved_tensors
        return (gradient * grad_loss).to(ctx.student_dtype), None, None, None


def _log_softmax_at(logits: Tensor, temperature: float) -> Tensor:
    """``log_softmax(logits / tau)`` in float32, without a scaled copy when ``tau = 1``."""
    logits = logits.float()
    return F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)


def topk_word_level_kd(
    student_logits: Tensor, teacher_topk_logprobs: Tensor, teacher_topk_ids: Tensor, target_mask: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """Word-level KD from a cached teacher (:mod:`fairseq_kd.teacher_pass.teacher_cache`):
    ``tau^2 * sum_t sum_i q_i (log q_i - log p_S^tau(id_i | t))``, where ``q`` is the softmax of the
    teacher's ``k`` stored log-probabilities divided by ``tau`` (the teacher renormalised to its top
    k) and ``p_S^tau`` the student's full-vocabulary distribution at ``tau``, read at the teacher's
    ``k`` token ids. When the teacher's mass lies within its top k this is :func:`word_level_kd`.

    teacher_topk_logprobs, teacher_topk_ids: ``(batch, tgt_len, k)``; the rest as
    :func:`word_level_kd`. Computed in float32.
    """
    student_lp = _log_softmax_at(student_logits, temperature).gather(-1, teacher_topk_ids)
    teacher_lp = _log_softmax_at(teacher_topk_logprobs, temperature)
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
