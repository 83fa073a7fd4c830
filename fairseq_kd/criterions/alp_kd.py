"""ALP-KD: attention-based layer projection (Passban et al. 2021, AAAI, arXiv:2012.14022).

    alpha_jk = softmax_{k in A(j)} (h_S^j . h_T^k)        C^j = sum_{k in A(j)} alpha_jk h_T^k   (Eq. 5)
    L_ALP    = sum_positions sum_j MSE(h_S^j, C^j)                                             (Eq. 7)

The bucket ``A(j)`` is every teacher layer by default (Eq. 6); ``--alp-buckets no|po`` or
``--alp-bucket-map`` choose others. At ``d_S != d_T`` the student's states go through a learnable
map ``P`` (one per side) before the dot product and the MSE. Total ``beta L_CE + eta L_KD + lambda
L_ALP`` (0.2, 0.1, 0.7). The mean ``alpha`` over the epoch's real positions is kept per side
(:meth:`ALPKDCriterion.layer_weights`, saved with the checkpoint) for ``fairseq-kd-plot alp``.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from ..modules.layer_mapping import ALP_BUCKETS, resolve_mapping
from ..modules.projection import width_projection
from .epoch_sums import EpochSums
from .hidden_state import HiddenStateKDConfig, HiddenStateKDCriterion
from .chunked import _keep_gradients, _kept_gradients, _wants_gradient, rows_per_chunk

ALP_BUCKET_CHOICES = ChoiceEnum(list(ALP_BUCKETS))


@dataclass
class ALPKDConfig(HiddenStateKDConfig):
    alp_buckets: ALP_BUCKET_CHOICES = field(
        default="all",
        metadata={"help": "teacher layers each student layer attends over: all (Eq. 6, default), no "
                  "(contiguous disjoint buckets), po (each bucket also takes the next bucket's first "
                  "layer; 12 into 3: 1-5, 5-9, 9-12)"},
    )
    alp_bucket_map: Optional[str] = field(
        default=None,
        metadata={"help": "explicit buckets overriding --alp-buckets: one comma-separated group of "
                  "1-based teacher layers per student layer, groups separated by '|', e.g. "
                  "'1,2,3,4|5,6,7,8|9,10,11,12'", "example": "1,2,3,4|5,6,7,8|9,10,11,12"},
    )


@register_criterion("alp_kd", dataclass=ALPKDConfig)
class ALPKDCriterion(HiddenStateKDCriterion):
    LAYER_TERM = "alp"
    TERM_NAMES = ("word_kd", "alp")

    def __init__(self, cfg: ALPKDConfig, task):
        super().__init__(cfg, task)
        self.buckets = {}
        self.projections = nn.ModuleDict()
        for side in self.sides:
            n, m = self.teacher_shape.layers(side), self.student_shape.layers(side)
            buckets = resolve_mapping(
                ALP_BUCKETS, str(cfg.alp_buckets), cfg.alp_bucket_map or None, n, m,
                "--alp-buckets", "--alp-bucket-map", f" [{side}]",
            )
            self.buckets[side] = buckets
            member = torch.zeros(m, n, dtype=torch.bool)
            for j, bucket in enumerate(buckets):
                member[j, [k - 1 for k in bucket]] = True
            self.register_buffer(f"{side}_bucket_member", member, persistent=False)
            self.projections[side] = width_projection(
                self.student_shape.embed_dim(side), self.teacher_shape.embed_dim(side)
            )
        # sums of alpha over real positions ("alpha/<side>", "positions/<side>"); not buffers, which
        # --fp16 would halve
        self.alpha_sums = EpochSums()

    # ------------------------------------------------------------------ the method
    def layer_loss(self, side, student_states, teacher_states, padding_mask):
        projection = self.projections[side]
        linear = isinstance(projection, nn.Linear)
        loss, alpha_sum, positions = alp_layer_mse(
            student_states, projection.weight.t() if linear else None,
            projection.bias if linear else None, teacher_states, padding_mask,
            getattr(self, f"{side}_bucket_member"),
        )
        if self.training and not self.is_dummy_batch:
            self.alpha_sums.add(f"alpha/{side}", alpha_sum)
            self.alpha_sums.add(f"positions/{side}", alpha_sum.new_tensor(float(positions)))
        return loss

    # ------------------------------------------------------------ weight read-out
    def begin_epoch(self, epoch: int) -> None:
        super().begin_epoch(epoch)
        self.alpha_sums.begin_epoch(epoch)

    def layer_weights(self) -> Dict[str, List[List[float]]]:
        """Mean ``alpha`` of every student layer over teacher layers, per side, over the real
        positions trained on since the current epoch began (rows sum to 1)."""
        weights = mean_alpha(self.alpha_sums.sums)
        if not weights:
            raise RuntimeError(
                "ALP-KD has no layer weights yet: they are averaged over training batches, and none "
                "has been seen since the epoch began"
            )
        return weights

    def checkpoint_state(self) -> dict:
        return {"alpha_sums": self.alpha_sums.state()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.alpha_sums.load_state(state.get("alpha_sums") or {})


def alp_layer_mse(student_states: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], teacher_states: Tensor,
                  padding_mask: Tensor, bucket_member: Tensor, rows: Optional[int] = None):
    """``L_ALP`` of one side (Eq. 5 and 7), in chunks of positions, and what the layer weights are
    read from.

    student_states ``(m + 1, B, T, d_S)``, teacher_states ``(n + 1, B, T, d_T)`` (index 0 the
    embedding output, not distilled); weight ``(d_S, d_T)`` and bias ``(d_T,)`` the map ``P``, both
    None when the widths agree; padding_mask ``(B, T)`` True at padding; bucket_member ``(m, n)``
    True where teacher layer ``k`` is in student layer ``j``'s bucket. Returns (``sum_t sum_j
    mean_d (P h_S^j - C^j)^2`` over real positions ``t``, in float32; the sum of ``alpha`` over those
    positions ``(m, n)``, float64, no gradient; their number).
    """
    batch_index, time_index = padding_mask.logical_not().nonzero(as_tuple=True)
    inputs = student_states[1:, batch_index, time_index].transpose(0, 1)  # (N, m, d_S)
    width, pairs = teacher_states.size(-1), bucket_member.numel()
    chunk = rows_per_chunk(pairs * width, rows, inputs.size(0), inputs.device.type)
    wants_gradient = _wants_gradient(inputs, weight, bias)
    # the function chooses its dtypes itself: an enclosing autocast (--amp) must not recast them
    with torch.autocast(inputs.device.type, enabled=False):
        loss, alpha_sum = _ALPLayerMSE.apply(inputs, weight, bias, teacher_states, batch_index, time_index,
                                             bucket_member, chunk, wants_gradient)
    return loss, alpha_sum, inputs.size(0)


class _ALPLayerMSE(torch.autograd.Function):
    """:func:`alp_layer_mse` over the student's states at the real positions ``(N, m, d_S)``, position
    major. Per position, with ``S_j = P h_S^j``, ``s_jk = S_j . T_k``, ``alpha = softmax_k(s)`` over the
    bucket, ``C_j = sum_k alpha_jk T_k`` and ``G_j = 2 (S_j - C_j) / d``: ``dL/dalpha_jk = -G_j . T_k``,
    ``dL/ds_jk = alpha_jk (dL/dalpha_jk - sum_l alpha_jl dL/dalpha_jl)`` and ``dL/dS_j = G_j + sum_k
    dL/ds_jk T_k`` (the teacher takes no gradient); then ``P``'s: ``dL/dh_S = dL/dS P^T``, ``dL/dP =
    sum h_S^T dL/dS``, ``dL/db = sum dL/dS``, all in float32 (as :class:`.losses._ProjectedMSE`)."""

    @staticmethod
    def forward(ctx, inputs, weight, bias, teacher_states, batch_index, time_index, bucket_member, rows,
                wants_gradient):
        positions, width = inputs.size(0), teacher_states.size(-1)
        weight_transposed = None if weight is None or not wants_gradient else weight.float().t()
        matmul_dtype = inputs.dtype if weight is None else weight.dtype
        outside = bucket_member.logical_not()
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        alpha_sum = torch.zeros(bucket_member.shape, dtype=torch.float64, device=inputs.device)
        grad_inputs = grad_weight = grad_bias = None
        if wants_gradient:
            grad_inputs = torch.empty(inputs.shape, dtype=torch.float32, device=inputs.device)
            if weight is not None:
                grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=inputs.device)
            if bias is not None:
                grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=inputs.device)
        for start in range(0, positions, rows):
            x = inputs[start:start + rows]  # (n, m, d_S)
            if weight is None:
                student = x.float()
            else:
                student = torch.matmul(x.to(matmul_dtype), weight).float()
                if bias is not None:
                    student += bias.float()
            chunk = slice(start, start + rows)
            teacher = teacher_states[1:, batch_index[chunk], time_index[chunk]].float().transpose(0, 1)  # (n, K, d)
            scores = torch.bmm(student, teacher.transpose(1, 2)).masked_fill_(outside, float("-inf"))
            alpha = torch.softmax(scores, dim=-1)  # (n, m, K)
            alpha_sum += alpha.sum(0).double()
            difference = student - torch.bmm(alpha, teacher)  # S - C
            total += torch.linalg.vector_norm(difference).square()
            if wants_gradient:
                gradient = difference.mul_(2.0 / width)  # G
                d_alpha = torch.bmm(gradient, teacher.transpose(1, 2)).neg_()
                d_scores = alpha.mul_(d_alpha.sub_((alpha * d_alpha).sum(-1, keepdim=True)))
                gradient.baddbmm_(d_scores, teacher)  # dL/dS
                if weight is None:
                    grad_inputs[start:start + rows] = gradient
                else:
                    grad_inputs[start:start + rows] = torch.matmul(gradient, weight_transposed)
                    flat_x = x.reshape(-1, x.size(-1)).float()
                    grad_weight.addmm_(flat_x.t(), gradient.reshape(-1, width))
                    if grad_bias is not None:
                        grad_bias += gradient.sum((0, 1))
        if wants_gradient:
            _keep_gradients(ctx, (grad_inputs, grad_weight, grad_bias), (inputs, weight, bias))
        ctx.mark_non_differentiable(alpha_sum)
        return total / width, alpha_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_alpha_sum):
        return _kept_gradients(ctx, grad_loss) + (None,) * 6


def mean_alpha(sums: Dict[str, Tensor]) -> Dict[str, List[List[float]]]:
    """Per side, the ``alpha`` sums divided by their real positions (rows sum to 1)."""
    weights = {}
    for name, total in sums.items():
        if name.startswith("alpha/"):
            side = name.split("/", 1)[1]
            weights[side] = (total / torch.as_tensor(sums[f"positions/{side}"]).clamp_min(1.0)).cpu().tolist()
    return weights
