"""The vocabulary-sized losses of the criterion base (label-smoothed CE; word-level KD from the live
teacher or its cached top-k, as the forward KL or another divergence; CE and word KD in one pass),
in chunks of positions with the gradient formed in the forward pass; and the chunk sizes and
gradient buffers that the other chunked losses share. Every loss returns an unnormalised sum over
the positions it is given, in float32 whatever the logits' dtype (docs/methods/README.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


#: positions x vocabulary entries per chunk on the CPU (4 MiB per float32 temporary); on CUDA the
#: budget follows the free memory (:func:`cuda_chunk_elements`)
CHUNK_ELEMENTS = {"cpu": 2**20}
#: and never fewer chunks than this
MIN_CHUNKS = 8
#: float32 temporaries of a chunk's shape that a vocabulary loss holds at once
CHUNK_TEMPORARIES = 4
#: the share of the GPU's free memory that one loss's chunk temporaries may take together
CUDA_CHUNK_MEMORY_SHARE = 1 / 16
#: the least and most entries of a CUDA chunk
CUDA_CHUNK_ELEMENTS_RANGE = (2**16, 2**24)


def cuda_chunk_elements(free_bytes: int) -> int:
    """Entries per chunk on a GPU with ``free_bytes`` free: the most whose
    :data:`CHUNK_TEMPORARIES` float32 temporaries fit in :data:`CUDA_CHUNK_MEMORY_SHARE` of it, within
    :data:`CUDA_CHUNK_ELEMENTS_RANGE`."""
    low, high = CUDA_CHUNK_ELEMENTS_RANGE
    fitting = int(free_bytes * CUDA_CHUNK_MEMORY_SHARE) // (4 * CHUNK_TEMPORARIES)
    return max(low, min(high, fitting))


def cuda_free_bytes() -> int:
    """The current GPU's free bytes plus what torch's caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def rows_per_chunk(vocab: int, rows: Optional[int] = None, positions: int = 0, device: str = "cpu",
                   free_bytes: Optional[int] = None) -> int:
    """Positions per chunk: ``rows`` if given (tests), else what ``device``'s type allows
    (:data:`CHUNK_ELEMENTS`; CUDA: :func:`cuda_chunk_elements` of ``free_bytes``, by default the
    current GPU's), and at most a :data:`MIN_CHUNKS`-th of the ``positions``."""
    if rows is not None:
        if rows < 1:
            raise ValueError(f"rows per chunk must be at least 1, got {rows}")
        return rows
    if device == "cuda":
        elements = cuda_chunk_elements(cuda_free_bytes() if free_bytes is None else free_bytes)
    else:
        elements = CHUNK_ELEMENTS.get(device, CHUNK_ELEMENTS["cpu"])
    budget = elements // vocab
    return max(1, min(budget, -(-positions // MIN_CHUNKS)) if positions else budget)


def _chunk_rows(logits: Tensor, rows: Optional[int]) -> int:
    return rows_per_chunk(logits.size(-1), rows, logits.numel() // logits.size(-1), logits.device.type)


def _gradient_buffer(ctx, flat: Tensor) -> Optional[Tensor]:
    """The float32 gradient buffer of a function whose first input is ``flat``'s (None: none asked)."""
    return torch.empty(flat.shape, dtype=torch.float32, device=flat.device) if ctx.needs_input_grad[0] else None


def _keep_gradient(ctx, gradient: Optional[Tensor], logits: Tensor) -> None:
    """Save the gradient a vocabulary loss formed in its forward pass (None: none asked)."""
    if gradient is not None:
        ctx.save_for_backward(gradient)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype


def _kept_gradient(ctx, grad_output: Tensor) -> Tensor:
    """That gradient times the upstream one (in place: the backward pass runs once), in the logits'
    shape and dtype."""
    (gradient,) = ctx.saved_tensors
    return gradient.mul_(grad_output).view(ctx.logits_shape).to(ctx.logits_dtype)


def _wants_gradient(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd is on and one of ``tensors`` requires a gradient (``needs_input_grad`` says
    True for a parameter under ``no_grad``)."""
    return torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors)


def _keep_gradients(ctx, gradients, inputs) -> None:
    """Save the float32 gradients (None where an input takes none), with their inputs' dtypes."""
    ctx.save_for_backward(*gradients)
    ctx.dtypes = tuple(None if tensor is None else tensor.dtype for tensor in inputs)


def _kept_gradients(ctx, grad_output: Tensor) -> tuple:
    """Those gradients times the upstream one, in place, in their inputs' dtypes."""
    return tuple(None if gradient is None else gradient.mul_(grad_output).to(dtype)
                 for gradient, dtype in zip(ctx.saved_tensors, ctx.dtypes))


def _log_softmax_at(logits: Tensor, temperature: float) -> Tensor:
    """``log_softmax(logits / tau)`` in float32, without a scaled copy when ``tau = 1``."""
    logits = logits.float()
    return F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)


def label_smoothed_cross_entropy(
    logits: Tensor, target: Tensor, target_mask: Tensor, epsilon: float, rows: Optional[int] = None
) -> Tuple[Tensor, Tensor]:
    """fairseq's label-smoothed CE (``label_smoothed_nll_loss``): ``sum_t (1 - eps - eps_i) nll_t +
    eps_i smooth_t``, ``nll_t = -log p(y_t)``, ``smooth_t = -sum_v log p(v)``, ``eps_i = eps / (V -
    1)``; returns (that sum, the sum of ``nll_t``) over ``target_mask``. Its gradient, formed in the
    forward pass, is ``p - eps_i - (1 - eps - eps_i) onehot(y)``. logits ``(..., V)``; target and
    target_mask: the leading shape."""
    return _LabelSmoothedCE.apply(logits, target, target_mask, float(epsilon), _chunk_rows(logits, rows))


class _LabelSmoothedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, target_mask, epsilon, rows):
        vocab = logits.size(-1)
        flat = logits.reshape(-1, vocab)
        targets = target.reshape(-1, 1)
        keep = target_mask.reshape(-1)
        eps_i = epsilon / (vocab - 1)
        gradient = _gradient_buffer(ctx, flat)
        nll_sum = torch.zeros((), dtype=torch.float32, device=flat.device)
        smooth_sum = torch.zeros((), dtype=torch.float32, device=flat.device)
        for start in range(0, flat.size(0), rows):
            here, index = keep[start:start + rows], targets[start:start + rows]
            log_probs = F.log_softmax(flat[start:start + rows].float(), dim=-1)
            # torch.where, not a product with the mask: a padded position's row is never summed
            nll_sum -= torch.where(here, log_probs.gather(-1, index).squeeze(-1), 0.0).sum()
            smooth_sum -= torch.where(here, log_probs.sum(-1), 0.0).sum()
            if gradient is not None:
                chunk = gradient[start:start + rows]
                torch.exp(log_probs, out=chunk)
                chunk.sub_(eps_i)
                chunk.scatter_add_(-1, index, chunk.new_full(index.shape, -(1.0 - epsilon - eps_i)))
                chunk.masked_fill_(~here.unsqueeze(-1), 0.0)
        loss = (1.0 - epsilon - eps_i) * nll_sum + eps_i * smooth_sum
        ctx.mark_non_differentiable(nll_sum)
        _keep_gradient(ctx, gradient, logits)
        return loss, nll_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll):
        return _kept_gradient(ctx, grad_loss), None, None, None, None


DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd")


@dataclass(frozen=True)
class Divergence:
    """Which divergence (--kd-divergence; docs/methods/divergences.md), with its mixture weight:
    ``beta`` of the generalised JSD (GKD), ``alpha`` of the skew KLs (DistiLLM)."""

    name: str
    beta: float = 0.5
    alpha: float = 0.1

    def __post_init__(self):
        if self.name not in DIVERGENCES:
            raise ValueError(f"unknown divergence {self.name!r}; expected one of {', '.join(DIVERGENCES)}")


def _mixture_log(log_a: Tensor, log_b: Tensor, weight_a: float) -> Tensor:
    """``log(w a + (1 - w) b)`` from ``log a`` and ``log b`` (``w`` in (0, 1))."""
    return torch.logaddexp(log_a + math.log(weight_a), log_b + math.log1p(-weight_a))


def _weighted_log_ratio(p: Tensor, log_p: Tensor, log_m: Tensor) -> Tensor:
    """``sum p (log p - log m)`` over the last dimension, 0 where ``p`` is 0 (``log p`` may be -inf:
    the top-k cache's teacher is 0 outside its k tokens)."""
    return torch.where(p > 0, p * (log_p - log_m), 0.0).sum(-1)


def divergence_rows(student_lp: Tensor, teacher_lp: Tensor, divergence: Divergence,
                    gradient: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """``D(p, q)`` per row and (``gradient``) ``dD/dz`` for the tempered student logits ``z``, from
    float32 log-probabilities ``log q`` (finite) and ``log p`` (-inf allowed where p is 0).
    Differentiable through autograd when ``gradient`` is False (the slow path)."""
    q, p = student_lp.exp(), teacher_lp.exp()
    name = divergence.name
    if name == "forward_kl":
        values = _weighted_log_ratio(p, teacher_lp, student_lp)
        if gradient:  # q (g - <q, g>) with g = -p / q, p summing to 1
            return values, q - p
        g = None
    elif name == "reverse_kl":
        values = (q * (student_lp - teacher_lp)).sum(-1)
        g = student_lp - teacher_lp if gradient else None
    elif name == "jsd":
        beta = divergence.beta
        log_m = _mixture_log(teacher_lp, student_lp, beta)
        values = beta * _weighted_log_ratio(p, teacher_lp, log_m) + (1 - beta) * (q * (student_lp - log_m)).sum(-1)
        g = (1 - beta) * (student_lp - log_m) if gradient else None
    elif name == "skew_kl":
        alpha = divergence.alpha
        log_m = _mixture_log(teacher_lp, student_lp, alpha)
        values = _weighted_log_ratio(p, teacher_lp, log_m)
        g = -(1 - alpha) * (teacher_lp - log_m).exp() if gradient else None
    elif name == "skew_reverse_kl":
        alpha = divergence.alpha
        log_m = _mixture_log(student_lp, teacher_lp, alpha)
        values = (q * (student_lp - log_m)).sum(-1)
        g = student_lp - log_m - alpha * (student_lp - log_m).exp() if gradient else None
    else:  # tvd
        values = 0.5 * (p - q).abs().sum(-1)
        g = 0.5 * torch.sign(q - p) if gradient else None
    if g is None:
        return values, None
    # the softmax's Jacobian: dD/dz = q (g - <q, g>)
    return values, g.sub_((q * g).sum(-1, keepdim=True)).mul_(q)


class _DivergenceStep:
    """Word-level KD on one chunk of positions, for :class:`_WordLevelKD` and :class:`_CEAndWordKD`:
    ``values`` (``D`` per position, and what its gradient needs), ``gradient`` (``dD/dz`` into a
    chunk), ``fused_gradient`` (``ce_weight (p_S - eps_i) + w_t tau dD/dz`` into CE's chunk, which
    holds ``p_S``). This one: a :class:`Divergence` from the live teacher's logits or (a tuple) its
    cached top k's log-probabilities and ids."""

    def __init__(self, teacher, temperature: float, divergence: Optional[Divergence] = None):
        self.temperature, self.divergence = temperature, divergence
        self.teacher = (tuple(t.reshape(-1, t.size(-1)) for t in teacher) if isinstance(teacher, tuple)
                        else teacher.reshape(-1, teacher.size(-1)))

    def teacher_log_probs(self, start: int, rows: int, vocab: int) -> Tensor:
        if not isinstance(self.teacher, tuple):
            return _log_softmax_at(self.teacher[start:start + rows], self.temperature)
        topk_lp, ids = (t[start:start + rows] for t in self.teacher)
        full = torch.full((ids.size(0), vocab), -math.inf, dtype=torch.float32, device=ids.device)
        return full.scatter_(-1, ids, _log_softmax_at(topk_lp, self.temperature))

    def values(self, start, rows, student_lp, gradient):
        teacher_lp = self.teacher_log_probs(start, rows, student_lp.size(-1))
        return divergence_rows(student_lp, teacher_lp, self.divergence, gradient)

    def gradient(self, chunk, student_lp, kd_gradient):
        chunk.copy_(kd_gradient)

    def fused_gradient(self, chunk, student_lp, kd_gradient, kd_here, per_row, ce_weight, kd_weight, eps_i):
        row_kd_weight = (kd_here.to(torch.float32) * (kd_weight * self.temperature)).unsqueeze(-1)
        chunk.sub_(eps_i).mul_(ce_weight).addcmul_(kd_gradient, row_kd_weight)


class _ForwardKLStep(_DivergenceStep):
    """The forward KL from the live teacher, gradient ``p_S^tau - p_T^tau`` (its own operations,
    whose rounding the suite's expected numbers record)."""

    def values(self, start, rows, student_lp, gradient):
        teacher_lp = self.teacher_log_probs(start, rows, student_lp.size(-1))
        teacher_p = teacher_lp.exp()
        # in place: the chunk's tensors are this function's own
        return teacher_lp.sub_(student_lp).mul_(teacher_p).sum(-1), teacher_p

    def gradient(self, chunk, student_lp, teacher_p):
        torch.exp(student_lp, out=chunk)
        chunk.sub_(teacher_p)

    def fused_gradient(self, chunk, student_lp, teacher_p, kd_here, per_row, ce_weight, kd_weight, eps_i):
        temperature = self.temperature
        if per_row:
            row_kd_weight = (kd_here.to(torch.float32) * kd_weight).unsqueeze(-1)
            p_tau = chunk.clone() if temperature == 1.0 else student_lp.exp_()
            chunk.mul_(ce_weight).addcmul_(p_tau, row_kd_weight, value=temperature)
            chunk.addcmul_(teacher_p, row_kd_weight, value=-temperature).sub_(ce_weight * eps_i)
            return
        if temperature == 1.0:
            chunk.mul_(ce_weight + kd_weight)
        else:
            chunk.mul_(ce_weight).add_(student_lp.exp_(), alpha=kd_weight * temperature)
        chunk.add_(teacher_p, alpha=-kd_weight * temperature).sub_(ce_weight * eps_i)


class _TopkForwardKLStep(_DivergenceStep):
    """The forward KL from the cached top k, against the student's full distribution read at the k
    ids; gradient ``p_S^tau - q`` scattered at the ids, ``q`` summing to 1 over them."""

    def values(self, start, rows, student_lp, gradient):
        topk_lp, ids = (t[start:start + rows] for t in self.teacher)
        teacher_lp = _log_softmax_at(topk_lp, self.temperature)
        teacher_p = teacher_lp.exp()
        return (teacher_p * (teacher_lp - student_lp.gather(-1, ids))).sum(-1), (teacher_p, ids)

    def gradient(self, chunk, student_lp, kd_gradient):
        teacher_p, ids = kd_gradient
        torch.exp(student_lp, out=chunk)
        chunk.scatter_add_(-1, ids, -teacher_p)


class _WordLevelKD(torch.autograd.Function):
    """``tau^2 sum_t D`` over ``target_mask`` of a step (:class:`_DivergenceStep`)."""

    @staticmethod
    def forward(ctx, student_logits, target_mask, rows, step):
        temperature = step.temperature
        student = student_logits.reshape(-1, student_logits.size(-1))
        keep = target_mask.reshape(-1)
        gradient = _gradient_buffer(ctx, student)
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for start in range(0, student.size(0), rows):
            here = keep[start:start + rows]
            student_lp = _log_softmax_at(student[start:start + rows], temperature)
            values, kd_gradient = step.values(start, rows, student_lp, gradient is not None)
            total += torch.where(here, values, 0.0).sum()
            if gradient is not None:
                chunk = gradient[start:start + rows]
                step.gradient(chunk, student_lp, kd_gradient)
                chunk.mul_(temperature).masked_fill_(~here.unsqueeze(-1), 0.0)
        _keep_gradient(ctx, gradient, student_logits)
        return (temperature**2) * total

    @staticmethod
    def backward(ctx, grad_loss):
        return _kept_gradient(ctx, grad_loss), None, None, None


class _CEAndWordKD(torch.autograd.Function):
    """:func:`label_smoothed_ce_and_word_kd` with its word-level KD given as a step."""

    @staticmethod
    def forward(ctx, logits, target, target_mask, epsilon, ce_weight, kd_weight, rows, kd_mask, step):
        temperature = step.temperature
        vocab = logits.size(-1)
        student = logits.reshape(-1, vocab)
        targets, keep = target.reshape(-1, 1), target_mask.reshape(-1)
        # KD at a subset of the CE positions (kd_mask): each row's KD weight is kd_weight or 0; with
        # none, the forward KL's scalar path, whose rounding the suite's expected numbers record
        kd_rows = None if kd_mask is None else kd_mask.reshape(-1)
        eps_i = epsilon / (vocab - 1)
        gradient = _gradient_buffer(ctx, student)
        nll_sum, smooth_sum, kd_sum = (torch.zeros((), dtype=torch.float32, device=student.device) for _ in range(3))
        for start in range(0, student.size(0), rows):
            here, index = keep[start:start + rows], targets[start:start + rows]
            kd_here = here if kd_rows is None else kd_rows[start:start + rows]
            student_chunk = student[start:start + rows].float()
            log_probs = F.log_softmax(student_chunk, dim=-1)
            nll_sum -= torch.where(here, log_probs.gather(-1, index).squeeze(-1), 0.0).sum()
            smooth_sum -= torch.where(here, log_probs.sum(-1), 0.0).sum()
            student_lp = log_probs if temperature == 1.0 else F.log_softmax(student_chunk / temperature, dim=-1)
            values, kd_gradient = step.values(start, rows, student_lp, gradient is not None)
            kd_sum += torch.where(kd_here, values, 0.0).sum()
            if gradient is not None:
                chunk = gradient[start:start + rows]
                torch.exp(log_probs, out=chunk)
                step.fused_gradient(chunk, student_lp, kd_gradient, kd_here, kd_rows is not None, ce_weight,
                                    kd_weight, eps_i)
                chunk.scatter_add_(-1, index, chunk.new_full(index.shape, -ce_weight * (1.0 - epsilon - eps_i)))
                chunk.masked_fill_(~here.unsqueeze(-1), 0.0)
        ce = (1.0 - epsilon - eps_i) * nll_sum + eps_i * smooth_sum
        kd = (temperature**2) * kd_sum
        combined = ce_weight * ce + kd_weight * kd
        ctx.mark_non_differentiable(ce, nll_sum, kd)
        _keep_gradient(ctx, gradient, logits)
        return combined, ce, nll_sum, kd

    @staticmethod
    def backward(ctx, grad_combined, _grad_ce, _grad_nll, _grad_kd):
        return (_kept_gradient(ctx, grad_combined),) + (None,) * 8


def label_smoothed_ce_and_word_kd(
    logits: Tensor, teacher_logits: Tensor, target: Tensor, target_mask: Tensor, epsilon: float,
    temperature: float, ce_weight: float, kd_weight: float, rows: Optional[int] = None,
    kd_mask: Optional[Tensor] = None, divergence: Optional[Divergence] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``ce_weight * CE + kd_weight * KD`` in one pass over the student's logits: CE is
    :func:`label_smoothed_cross_entropy` at ``target_mask``, KD :func:`word_level_kd` (or, with
    ``divergence``, :func:`word_level_divergence`) at ``kd_mask`` (within ``target_mask``; default
    ``target_mask``). Returns (that weighted sum, CE, nll, KD); only the sum carries a gradient.
    """
    kd_mask = None if kd_mask is None or kd_mask is target_mask else kd_mask & target_mask
    temperature = float(temperature)
    forward_kl = divergence is None or divergence.name == "forward_kl"
    step = (_ForwardKLStep(teacher_logits, temperature) if forward_kl
            else _DivergenceStep(teacher_logits, temperature, divergence))
    return _CEAndWordKD.apply(logits, target, target_mask, float(epsilon), float(ce_weight), float(kd_weight),
                              _chunk_rows(logits, rows), kd_mask, step)


def word_level_kd(student_logits: Tensor, teacher_logits: Tensor, target_mask: Tensor, temperature: float = 1.0,
                  rows: Optional[int] = None) -> Tensor:
    """Word-level KD (Hinton et al., 2015): ``tau^2 * sum_t KL(p_T^tau(.|t) || p_S^tau(.|t))``.
    logits ``(batch, tgt_len, vocab)``; target_mask ``(batch, tgt_len)``; ``rows``: for tests."""
    if teacher_logits.requires_grad:  # a jointly trained teacher: plain autograd, both sides
        student_lp = _log_softmax_at(student_logits, temperature)
        teacher_lp = _log_softmax_at(teacher_logits, temperature)
        per_position = F.kl_div(student_lp, teacher_lp, reduction="none", log_target=True).sum(-1)
        return (temperature**2) * per_position.masked_select(target_mask).sum()
    return _WordLevelKD.apply(student_logits, target_mask, _chunk_rows(student_logits, rows),
                              _ForwardKLStep(teacher_logits, float(temperature)))


def topk_word_level_kd(
    student_logits: Tensor, teacher_topk_logprobs: Tensor, teacher_topk_ids: Tensor, target_mask: Tensor,
    temperature: float = 1.0, rows: Optional[int] = None) -> Tensor:
    """Word-level KD from a cached teacher (:mod:`fairseq_kd.teacher_pass.teacher_cache`):
    ``tau^2 * sum_t sum_i q_i (log q_i - log p_S^tau(id_i | t))``, ``q`` the softmax of the teacher's
    ``k`` stored log-probabilities over ``tau``, ``p_S^tau`` read at their ids; both ``(batch,
    tgt_len, k)``, the rest as :func:`word_level_kd`."""
    if teacher_topk_logprobs.requires_grad:  # stored values never do; a caller's own teacher might
        student_lp = _log_softmax_at(student_logits, temperature).gather(-1, teacher_topk_ids)
        teacher_lp = _log_softmax_at(teacher_topk_logprobs, temperature)
        per_position = (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1)
        return (temperature**2) * per_position.masked_select(target_mask).sum()
    return _WordLevelKD.apply(student_logits, target_mask, _chunk_rows(student_logits, rows),
                              _TopkForwardKLStep((teacher_topk_logprobs, teacher_topk_ids), float(temperature)))


def word_level_divergence(
    student_logits: Tensor, teacher_logits: Optional[Tensor], target_mask: Tensor, divergence: Divergence,
    temperature: float = 1.0, rows: Optional[int] = None, teacher_topk: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tensor:
    """``tau^2 sum_t D(p_T^tau, p_S^tau)`` over ``target_mask``: from the live teacher's logits, or
    (``teacher_topk``: log-probabilities and ids) from its cached top k, zero outside it. The forward
    KL's own functions are :func:`word_level_kd` and :func:`topk_word_level_kd`."""
    if teacher_topk is None and teacher_logits.requires_grad:  # a jointly trained teacher: plain autograd
        values, _ = divergence_rows(_log_softmax_at(student_logits, temperature),
                                    _log_softmax_at(teacher_logits, temperature), divergence, gradient=False)
        return (temperature**2) * values.masked_select(target_mask).sum()
    teacher = tuple(teacher_topk) if teacher_logits is None else teacher_logits
    return _WordLevelKD.apply(student_logits, target_mask, _chunk_rows(student_logits, rows),
                              _DivergenceStep(teacher, float(temperature), divergence))


class _LogSumExp(torch.autograd.Function):
    """``logsumexp`` over the vocabulary in float32, in chunks; keeps only the logits themselves."""

    @staticmethod
    def forward(ctx, logits, rows):
        flat = logits.reshape(-1, logits.size(-1))
        result = torch.empty(flat.size(0), dtype=torch.float32, device=flat.device)
        for start in range(0, flat.size(0), rows):
            result[start:start + rows] = torch.logsumexp(flat[start:start + rows].float(), -1)
        ctx.save_for_backward(logits, result)
        ctx.rows = rows
        return result.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_output):
        logits, result = ctx.saved_tensors
        flat, upstream = logits.reshape(-1, logits.size(-1)), grad_output.reshape(-1, 1).float()
        gradient = torch.empty(flat.shape, dtype=logits.dtype, device=flat.device)
        for start in range(0, flat.size(0), ctx.rows):
            # out of place: .float() of float32 logits is the logits themselves
            chunk = torch.exp(flat[start:start + ctx.rows].float() - result[start:start + ctx.rows, None])
            gradient[start:start + ctx.rows] = chunk.mul_(upstream[start:start + ctx.rows])
        return gradient.view(logits.shape), None


def chunked_logsumexp(logits: Tensor, rows: Optional[int] = None) -> Tensor:
    """``logsumexp(logits, -1)`` in float32 (:class:`_LogSumExp`)."""
    return _LogSumExp.apply(logits, _chunk_rows(logits, rows))
