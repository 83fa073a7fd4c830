"""Losses a method composes its terms of: pure functions of tensors and masks.

Every function returns an unnormalised *sum* over the real (unpadded) positions it is given; the
criterion base divides by fairseq's ``sample_size`` once, as fairseq does for cross-entropy, so
loss weights mean the same at any batch size and on any number of workers. The vocabulary-sized
losses (CE, word-level KD and its divergences) are the base's, in :mod:`.chunked`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .chunked import (  # noqa: F401 - the vocabulary losses and chunk sizes, also reachable from here
    CHUNK_ELEMENTS, CHUNK_TEMPORARIES, CUDA_CHUNK_ELEMENTS_RANGE, CUDA_CHUNK_MEMORY_SHARE, DIVERGENCES, MIN_CHUNKS,
    Divergence, _keep_gradients, _kept_gradients, _wants_gradient, cuda_chunk_elements, cuda_free_bytes,
    label_smoothed_ce_and_word_kd, label_smoothed_cross_entropy, rows_per_chunk, topk_word_level_kd,
    word_level_divergence, word_level_kd)


# ----------------------------------------------------------------------------------------------
# Hidden-state losses (PKD, CKD, ALP-KD, RAIL-KD, internal KD). States are ``(..., batch, len, dim)``
# with any leading (layer) dimensions; ``padding_mask`` is ``(batch, len)``, True at padding.


def masked_mean_pool(states: Tensor, padding_mask: Tensor) -> Tensor:
    """Sentence vectors (RAIL-KD Eq. 1): the mean of ``states`` over each sentence's real positions,
    ``(..., batch, len, dim)`` -> ``(..., batch, dim)``, float32."""
    real = (~padding_mask).to(torch.float32).unsqueeze(-1)  # (batch, len, 1)
    counts = real.sum(-2).clamp_min(1.0)  # (batch, 1)
    return (states.float() * real).sum(-2) / counts


def normalized_squared_distance(a: Tensor, b: Tensor) -> Tensor:
    """``|| a/||a|| - b/||b|| ||^2`` over the last dimension (PKD, Sun et al. 2019, Eq. 3 as cited by
    ALP-KD; RAIL-KD Eq. 2-3), in float32; the result drops the last dimension."""
    return (F.normalize(a.float(), dim=-1) - F.normalize(b.float(), dim=-1)).pow(2).sum(-1)


def masked_mse_sum(a: Tensor, b: Tensor, padding_mask: Tensor) -> Tensor:
    """``sum over real positions of MSE(a_t, b_t)``, the MSE a mean over the ``dim`` features (CKD
    Eq. 3, ALP-KD Eq. 7); a, b: ``(..., batch, len, dim)``, also summed over leading dimensions."""
    difference = a.float() - b.float()
    # in place: no second tensor of the states' size is made or kept
    difference.masked_fill_(padding_mask.unsqueeze(-1), 0.0)
    return sum_of_squares(difference) / difference.size(-1)


def sum_of_squares(values: Tensor, dims=None) -> Tensor:
    """``sum(values ** 2)`` over ``dims`` (all by default), as a squared vector norm (no elementwise
    square kept for the backward pass)."""
    return torch.linalg.vector_norm(values, dim=dims).square()


def masked_row_kl(student_log_probs: Tensor, mask: Tensor, teacher_probs: Tensor = None,
                  teacher_log_probs: Tensor = None) -> Tensor:
    """Per row ``KL(p || q) = sum_k p_k (log p_k - log q_k)`` over the last dimension, in float32,
    over the entries where ``mask`` (broadcastable) is True; the others are selected away, so a row
    without a True entry is exactly 0 with a finite gradient. Finite values are needed at the True
    entries: ``log q`` and exactly one of ``teacher_probs`` (``0 log 0 = 0``) and
    ``teacher_log_probs``."""
    if (teacher_probs is None) == (teacher_log_probs is None):
        raise ValueError("masked_row_kl needs exactly one of teacher_probs and teacher_log_probs")
    log_q = torch.where(mask, student_log_probs.float(), 0.0)
    if teacher_log_probs is not None:
        log_p = torch.where(mask, teacher_log_probs.float(), 0.0)
        p = torch.where(mask, log_p.exp(), 0.0)
        return (p * (log_p - log_q)).sum(-1)
    p = torch.where(mask, teacher_probs.float(), 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(-1)


def masked_log_softmax_kl(teacher_logits: Tensor, student_logits: Tensor, mask: Tensor) -> Tensor:
    """``KL(softmax(teacher) || softmax(student))`` per row over the True entries of ``mask`` (a finite
    fill elsewhere, so a row without one stays finite), float32. The teacher comes first here, the
    student first in :func:`masked_row_kl`."""
    fill = torch.finfo(torch.float32).min
    teacher_log_probs = torch.log_softmax(teacher_logits.float().masked_fill(~mask, fill), -1)
    student_log_probs = torch.log_softmax(student_logits.float().masked_fill(~mask, fill), -1)
    return masked_row_kl(student_log_probs, mask, teacher_log_probs=teacher_log_probs)


def projected_mse_sum(
    student_states: Tensor, student_layers: Tensor, weight: Tensor, bias: Optional[Tensor],
    teacher_states: Tensor, teacher_layers: Tensor, padding_mask: Tensor, pair_weight: Optional[Tensor] = None,
    rows: Optional[int] = None) -> Tensor:
    """``sum_p w_p sum_t mean_k ((h_S^{s_p}[t] W_p + b_p) - h_T^{t_p}[t])_k^2`` over layer pairs ``p``
    and real positions ``t`` (CKD's student-side map, Wu et al. 2020 Eq. 3; TinyBERT's ``W_h`` and
    ``W_e``, Jiao et al. 2020 Eq. 8-9), float32, in chunks of positions.

    student_states ``(m + 1, B, T, d_S)``, teacher_states ``(n + 1, B, T, d_T)``, padding_mask
    ``(B, T)`` True at padding; student_layers, teacher_layers: ``(P,)`` long, the stack index of
    each pair's two sides; weight ``(P or 1, d_S, d_T)``; bias ``(P or 1, d_T)`` or None;
    pair_weight ``(P,)``, default 1. The products run in the parameters' dtype.
    """
    batch_index, time_index = padding_mask.logical_not().nonzero(as_tuple=True)
    inputs = student_states[student_layers[:, None], batch_index, time_index]  # (P, N, d_S)
    if pair_weight is None:
        pair_weight = torch.ones(len(student_layers), device=inputs.device)
    chunk = rows_per_chunk(len(student_layers) * weight.size(-1), rows, inputs.size(1), inputs.device.type)
    wants_gradient = _wants_gradient(inputs, weight, bias)
    # the function chooses its dtypes itself: an enclosing autocast (--amp) must not recast them
    with torch.autocast(inputs.device.type, enabled=False):
        return _ProjectedMSE.apply(inputs, weight, bias, teacher_states, teacher_layers, batch_index, time_index,
                                   pair_weight.float(), chunk, wants_gradient)


class _ProjectedMSE(torch.autograd.Function):
    """:func:`projected_mse_sum` over gathered inputs ``(P, N, d_S)``. With ``r = x W + b - t`` and
    ``c = 2 w_p / d_T``: the gradient is ``c r W^T`` for ``x``, ``sum c x^T r`` for ``W`` and ``sum c
    r`` for ``b`` (summed over the pairs when one map serves them all), formed in float32."""

    @staticmethod
    def forward(ctx, inputs, weight, bias, teacher_states, teacher_layers, batch_index, time_index, pair_weight, rows,
                wants_gradient):
        pairs, positions, out_dim = inputs.size(0), inputs.size(1), weight.size(-1)
        shared = weight.size(0) == 1 and pairs > 1
        matmul_dtype = weight.dtype
        maps = weight.expand(pairs, -1, -1)
        maps_transposed = maps.float().transpose(1, 2) if wants_gradient else None  # for the gradient of x
        offset_bias = None if bias is None else bias.float().expand(pairs, -1).unsqueeze(1)  # (P, 1, d_T)
        coefficient = (2.0 / out_dim) * pair_weight.view(pairs, 1, 1)
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        grad_inputs = grad_weight = grad_bias = None
        if wants_gradient:
            grad_inputs = torch.empty(inputs.shape, dtype=torch.float32, device=inputs.device)
            grad_weight = torch.zeros((pairs,) + weight.shape[1:], dtype=torch.float32, device=inputs.device)
            grad_bias = None if bias is None else torch.zeros(pairs, out_dim, dtype=torch.float32, device=inputs.device)
        for start in range(0, positions, rows):
            x = inputs[:, start:start + rows].to(matmul_dtype)
            targets = teacher_states[teacher_layers[:, None], batch_index[None, start:start + rows],
                                     time_index[None, start:start + rows]]  # (P, n, d_T), a copy
            # residual = x W + b - t, with b - t (in place on the gathered copy) as the addend
            offset = targets.float().neg_() if targets.dtype != torch.float32 else targets.neg_()
            if offset_bias is not None:
                offset.add_(offset_bias)
            if matmul_dtype == torch.float32:
                residual = torch.baddbmm(offset, x, maps)
            else:
                residual = torch.bmm(x, maps).float().add_(offset)
            total += (torch.linalg.vector_norm(residual, dim=(1, 2)).square() * pair_weight).sum()
            if wants_gradient:
                residual.mul_(coefficient)
                grad_inputs[:, start:start + rows] = torch.bmm(residual, maps_transposed)
                # in float32 whatever the parameters' dtype: it sums every chunk (and pair, if shared)
                grad_weight.baddbmm_(x.float().transpose(1, 2), residual)
                if grad_bias is not None:
                    grad_bias += residual.sum(1)
        if wants_gradient:
            if shared:
                grad_weight = grad_weight.sum(0, keepdim=True)
                grad_bias = None if grad_bias is None else grad_bias.sum(0, keepdim=True)
            _keep_gradients(ctx, (grad_inputs, grad_weight, grad_bias), (inputs, weight, bias))
        return total / out_dim

    @staticmethod
    def backward(ctx, grad_output):
        return _kept_gradients(ctx, grad_output) + (None,) * 7
