"""ALP-KD: attention-based layer projection (Passban et al. 2021, AAAI, arXiv:2012.14022).

For student layer ``j`` and every position, the teacher layers of its bucket ``A(j)`` are combined
by attention (Eq. 5)::

    alpha_jk = softmax_{k in A(j)} (h_S^j . h_T^k)        C^j = sum_{k in A(j)} alpha_jk h_T^k
    L_ALP    = sum_positions sum_j MSE(h_S^j, C^j)                                    (Eq. 7)

The default bucket is every teacher layer for every student layer (Eq. 6: no bucket search);
``--alp-buckets no|po`` selects the paper's no-overlap / partial-overlap buckets (generalised in
:mod:`fairseq_kd.modules.layer_mapping`) and ``--alp-bucket-map`` explicit ones. The attention is
a plain dot product as in the paper (computed in float32). When ``d_S != d_T`` the student's
states go through a learnable map ``P: d_S -> d_T`` (one per side) before both the dot product and
the MSE, so ``h_S^j`` reads ``P h_S^j`` above. The MSE of two vectors is the mean squared difference
over the features; the sum runs over real positions and student layers (unit of ``alp_loss``: real
tokens of the distilled side(s)). Total: ``beta L_CE + eta L_KD + lambda L_ALP`` (Eq. 7; 0.2, 0.1,
0.7 by default as in CKD).

The weights depend on the position, so they are read out as averages: during training the
criterion keeps, per side, the mean of ``alpha_j.`` over all real positions seen since the current
epoch began (saved with the checkpoint; on several GPUs, those of the worker that writes it). :meth:`ALPKDCriterion.layer_weights` returns them as
``{"encoder": [[alpha over teacher layers] per student layer], "decoder": ...}``, the format of
``fairseq-kd-plot alp``; :func:`layer_weights_from_checkpoint` reads them from a saved checkpoint.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from ..modules.layer_mapping import ALP_BUCKETS, resolve_mapping
from ..modules.projection import width_projection
from .base import EpochSums
from .hidden_state import HiddenStateKDConfig, HiddenStateKDCriterion, in_param_dtype
from .losses import masked_mse_sum

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
    PAPER = "ALP-KD (Passban et al. 2021)"
    MAIN_FLAGS = ("alp_buckets", "alp_bucket_map")

    def __init__(self, cfg: ALPKDConfig, task):
        super().__init__(cfg, task)
        self.alp_buckets = str(cfg.alp_buckets)
        self.alp_bucket_map = cfg.alp_bucket_map or None
        self.buckets = {}
        self.projections = nn.ModuleDict()
        for side in self.sides:
            n, m = self.teacher_shape.layers(side), self.student_shape.layers(side)
            buckets = resolve_mapping(
                ALP_BUCKETS, self.alp_buckets, self.alp_bucket_map, n, m,
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
        # Sums of alpha over real positions, per side ("alpha/<side>", "positions/<side>"); not
        # buffers, so that --fp16's criterion.half() leaves their float64 precision alone.
        self.alpha_sums = EpochSums()

    # ------------------------------------------------------------------ the method
    def layer_attention(self, side: str, student_states: Tensor, teacher_states: Tensor):
        """``(P h_S^j for j = 1..m, alpha)``: the (projected) student states ``(m, B, T, d_T)`` and
        the weights ``alpha`` ``(m, n, B, T)``, summing to 1 over each student layer's bucket and 0
        outside it."""
        student = in_param_dtype(self.projections[side], student_states[1:])
        teacher = teacher_states[1:].float()
        scores = torch.einsum("jbtd,kbtd->jkbt", student, teacher)
        member = getattr(self, f"{side}_bucket_member")[:, :, None, None]
        alpha = torch.softmax(scores.masked_fill(~member, float("-inf")), dim=1)
        return student, alpha

    def layer_loss(self, side, student_states, teacher_states, padding_mask):
        student, alpha = self.layer_attention(side, student_states, teacher_states)
        combined = torch.einsum("jkbt,kbtd->jbtd", alpha, teacher_states[1:].float())
        if self.training and not self.is_dummy_batch:
            self._record_alpha(side, alpha.detach(), padding_mask)
        return masked_mse_sum(student, combined, padding_mask)

    # ------------------------------------------------------------ weight read-out
    def _record_alpha(self, side: str, alpha: Tensor, padding_mask: Tensor) -> None:
        real = (~padding_mask).to(torch.float64)
        self.alpha_sums.add(f"alpha/{side}", torch.einsum("jkbt,bt->jk", alpha.double(), real))
        self.alpha_sums.add(f"positions/{side}", real.sum())

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
        self.alpha_sums.load_state(saved_alpha_sums(state))


def mean_alpha(sums: Dict[str, Tensor]) -> Dict[str, List[List[float]]]:
    """Per side, the ``alpha`` sums divided by their real positions (rows sum to 1)."""
    weights = {}
    for name, total in sums.items():
        if name.startswith("alpha/"):
            side = name.split("/", 1)[1]
            weights[side] = (total / torch.as_tensor(sums[f"positions/{side}"]).clamp_min(1.0)).cpu().tolist()
    return weights


def saved_alpha_sums(state: dict) -> dict:
    """The :class:`~.base.EpochSums` state in a criterion's checkpoint state; a state of the format
    before it (``alpha_sum``, ``alpha_positions``) is refused."""
    if "alpha_sum" in state and "alpha_sums" not in state:
        raise ValueError("the ALP-KD state in this checkpoint is of an older fairseq-kd format (alpha_sum); "
                         "re-run the training to write it anew")
    return state.get("alpha_sums") or {}


def layer_weights_from_checkpoint(path) -> Dict[str, List[List[float]]]:
    """The ALP-KD layer weights saved in a checkpoint of a ``--criterion alp_kd`` run."""
    from ..checkpoints import load_fairseq_checkpoint, task_state

    state = load_fairseq_checkpoint(path)  # weights_only=True, explicitly
    saved = task_state(state).get("criterion", {})
    try:
        weights = mean_alpha(saved_alpha_sums(saved).get("sums", {}))
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    if not weights:
        raise ValueError(
            f"{path}: no ALP-KD layer weights in this checkpoint (it must come from fairseq-train "
            "--task translation_kd --criterion alp_kd, saved after at least one training step)"
        )
    return weights
