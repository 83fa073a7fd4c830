"""Align-to-Distill, A2D (Jin et al., LREC-COLING 2024, arXiv:2403.01479).

    H^I_c  = AAM_kind(A_S)_c, one intermediate map per teacher map A_T^c   (Eq. 9)
    L_kind = sum_c KL(A_T^c || H^I_c)                                      (Eq. 10)
    L_att  = L_enc-self + (L_dec-self + L_dec-cross) / 2                    (Eq. 11)
    L      = L_CE + lambda_e L_att + mu L_KD,  lambda_e = lambda_0 decay^(e-1)  (Eq. 12, Sec. 5.2)

The alignment modules (:mod:`fairseq_kd.modules.attention_alignment`) are sized from the actual
teacher and student: no head, layer or width parity is needed. Choices the paper leaves open, each a
flag: how ``H^I`` becomes a distribution (``--a2d-normalization``; ``authors`` is the authors'
public code), the reduction over maps (``--a2d-map-reduction``; ``mean`` by default), which kinds
(Table 4), head- or layer-wise maps (Table 6), the presets (Sec. 5.2), and an end to the attention
phase (``--a2d-attention-epochs``, after which ``--teacher-cache`` can serve word KD). Why each
default, and the measurements behind them: ``docs/methods/a2d_kd.md``.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from ..errors import InputError
from ..models.feature_capture import DECODER_CROSS, DECODER_SELF, ENCODER_SELF, AttentionMaps, CaptureRequest
from ..modules.attention_alignment import AttentionAlignment
from .startup_checks import check_capturable
from .base import KDCriterionBase
from .config import KDCriterionConfig, ranged, weight
from .losses import masked_log_softmax_kl, masked_row_kl

#: ``--a2d-attention-kinds`` -> weight of each kind's loss inside L_att (Eq. 11, Table 4).
KIND_WEIGHTS = {
    "all": {ENCODER_SELF: 1.0, DECODER_SELF: 0.5, DECODER_CROSS: 0.5},
    "enc_self": {ENCODER_SELF: 1.0},
    "dec_all": {DECODER_SELF: 0.5, DECODER_CROSS: 0.5},
    "dec_self": {DECODER_SELF: 1.0},
    "dec_cross": {DECODER_CROSS: 1.0},
}
#: the logged term of each attention kind
KIND_TERMS = {ENCODER_SELF: "enc_self_att", DECODER_SELF: "dec_self_att", DECODER_CROSS: "dec_cross_att"}
#: ``--a2d-preset`` -> (lambda_0, per-epoch decay of lambda), Sec. 5.2
PRESETS = {"low_resource": (1.0, 0.9), "wmt": (0.1, 0.9)}
#: ``--a2d-map-reduction`` values; ``auto`` resolves to :func:`resolve_map_reduction`'s choice
MAP_REDUCTIONS = ("auto", "mean", "sum")


# ------------------------------------------------------- --a2d-normalization: the modes' KLs
# Each takes float32 maps ``(C, B, Tq, Tk)`` and the attendable mask broadcast over maps
# ``(1, B, Tq, Tk)``, and returns ``sum_c KL(A_T^c || H^I_c)`` (Eq. 10), unnormalised.
def _mixture_kl(intermediate: Tensor, teacher_maps: Tensor, mask: Tensor) -> Tensor:
    """``intermediate`` rows are distributions already; one KL per (map, sentence, real query)."""
    # the clamp only guards an underflow, so that a teacher entry never meets log(0)
    log_q = intermediate.clamp_min(torch.finfo(torch.float32).tiny).log()
    return masked_row_kl(log_q, mask, teacher_probs=teacher_maps).sum()


def _row_kl(intermediate: Tensor, teacher_maps: Tensor, mask: Tensor) -> Tensor:
    """Log-softmax over each query's attendable keys, both sides; one KL per real query."""
    return masked_log_softmax_kl(teacher_maps, intermediate, mask).sum()


def _flat_kl(intermediate: Tensor, teacher_maps: Tensor, mask: Tensor) -> Tensor:
    """Log-softmax over all attendable entries of each map, both sides; one KL per map and sentence."""
    return _row_kl(intermediate.flatten(-2), teacher_maps.flatten(-2), mask.flatten(-2))


def _authors_kl(intermediate: Tensor, teacher_maps: Tensor, mask: Tensor) -> Tensor:
    """Log-softmax over every entry of each map, padded and future ones included (no mask)."""
    intermediate = intermediate.flatten(-2)
    everything = torch.ones_like(intermediate, dtype=torch.bool)
    return masked_log_softmax_kl(teacher_maps.flatten(-2), intermediate, everything).sum()


def _ce_and_mu_kd(mu: float, alpha: float) -> Tuple[float, float]:
    """Eq. 12: ``L_CE + mu * L_KD``."""
    return 1.0, mu


def _authors_alpha(mu: float, alpha: float) -> Tuple[float, float]:
    """The authors' code: ``(1 - alpha) CE + alpha KD`` (``--a2d-alpha`` replaces ``mu``)."""
    return 1.0 - alpha, alpha


@dataclass(frozen=True)
class NormalizationMode:
    """Everything one ``--a2d-normalization`` value decides (docs/methods/a2d_kd.md says why)."""

    name: str
    #: how the AAM combines the student maps (``AttentionAlignment``'s ``combination``)
    combination: str
    #: how the AAM is initialised (``AttentionAlignment``'s ``init``)
    init: str
    #: what ``--a2d-map-reduction auto`` resolves to
    default_reduction: str
    #: ``(intermediate, teacher_maps, mask) -> sum_c KL``, see ``_mixture_kl``
    kl: Callable[[Tensor, Tensor, Tensor], Tensor]
    #: ``(mu, alpha) -> (CE weight, word-KD weight)``
    ce_kd_weights: Callable[[float, float], Tuple[float, float]]
    #: multiply each attention term by the batch's ``B x T`` target positions (the authors' balance
    #: of a summed KL against CE and KD averaged over positions, kept under fairseq's per-token
    #: normalisation)
    scales_by_positions: bool = False
    #: why ``--a2d-map-reduction mean`` is refused (completes "cannot be combined with
    #: --a2d-normalization NAME, ..."); None: it is allowed
    mean_refusal: Optional[str] = None

    def divergence(self, intermediate: Tensor, teacher_maps: Tensor, attendable: Tensor) -> Tensor:
        """``sum_c KL(A_T^c || H^I_c)`` in float32 (see :func:`alignment_kl`)."""
        return self.kl(intermediate.float(), teacher_maps.float(), attendable.unsqueeze(0))


#: ``--a2d-normalization`` -> its mode (see docs/methods/a2d_kd.md)
NORMALIZATION_MODES = {mode.name: mode for mode in (
    NormalizationMode("mixture", combination="mixture", init="mean", default_reduction="mean",
                      kl=_mixture_kl, ce_kd_weights=_ce_and_mu_kd),
    NormalizationMode("row", combination="signed", init="mean", default_reduction="mean",
                      kl=_row_kl, ce_kd_weights=_ce_and_mu_kd),
    NormalizationMode("flat", combination="signed", init="mean", default_reduction="mean",
                      kl=_flat_kl, ce_kd_weights=_ce_and_mu_kd),
    NormalizationMode("authors", combination="signed", init="conv", default_reduction="sum",
                      kl=_authors_kl, ce_kd_weights=_authors_alpha, scales_by_positions=True,
                      mean_refusal="which reproduces the authors' code (a KL summed over maps)"),
)}


def normalization_mode(normalization: str) -> NormalizationMode:
    """The :class:`NormalizationMode` of ``--a2d-normalization normalization``."""
    try:
        return NORMALIZATION_MODES[normalization]
    except KeyError:
        raise InputError(
            f"--a2d-normalization must be one of {sorted(NORMALIZATION_MODES)}, got {normalization!r}"
        ) from None


@dataclass
class A2DConfig(KDCriterionConfig):
    a2d_preset: ChoiceEnum(list(PRESETS)) = field(
        default="low_resource",
        metadata={"help": "paper settings for lambda (Sec. 5.2): low_resource = lambda 1 decayed "
                  "x0.9 per epoch; wmt = lambda 0.1 decayed x0.9 per epoch"},
    )
    a2d_lambda: Optional[float] = weight(
        None, help="initial weight lambda_0 of the attention loss L_att (Eq. 12); overrides --a2d-preset; "
        "0 disables attention distillation",
    )
    a2d_lambda_decay: Optional[float] = ranged(
        None, 0.0, 1.0, low_open=True, meaning="lambda_e = lambda_0 * decay^(e-1); 1 keeps it constant",
        example="0.9", help="lambda at epoch e is lambda_0 * decay^(e-1); in (0, 1], 1 = constant; "
        "overrides --a2d-preset (whose value is 0.9)",
    )
    kd_weight: float = weight(
        1.0, help="weight mu of word-level KD (Eq. 12), CE weight 1; 0 = 'A2D w/o L_KD' (Table 2)",
    )
    a2d_mu: Optional[float] = weight(
        None, kd_weight_alias=True, help="the paper's name for --kd-weight (mu, Eq. 12); when given, it replaces it",
    )
    a2d_attention_kinds: ChoiceEnum(list(KIND_WEIGHTS)) = field(
        default="all",
        metadata={"help": "attention distilled (Table 4): all = enc-self + (dec-self + dec-cross)/2; "
                  "enc_self; dec_all = (dec-self + dec-cross)/2; dec_self or dec_cross alone with "
                  "weight 1"},
    )
    a2d_granularity: ChoiceEnum(["head", "layer"]) = field(
        default="head",
        metadata={"help": "head: align every head's map (the paper's A2D); layer: average each "
                  "layer's heads first (layer-wise A2D, Table 6)"},
    )
    a2d_normalization: ChoiceEnum(list(NORMALIZATION_MODES)) = field(
        default="mixture",
        metadata={"help": "how intermediate maps become distributions (every mode is 0 when they equal "
                  "the teacher's): mixture = convex AAM, KL of attention rows per real query; row = "
                  "signed AAM (Eq. 9), log-softmax over each query's attendable keys on both sides; "
                  "flat = the same over each whole masked map; authors = the authors' public code "
                  "(unmasked flattened maps, KL summed over maps and sentences, (1-alpha) CE + alpha "
                  "KD): its attention term is the authors' summed KL times B x T target positions"},
    )
    a2d_map_reduction: ChoiceEnum(list(MAP_REDUCTIONS)) = field(
        default="auto",
        metadata={"help": "sum: Eq. 10 as written, each kind's KL summed over the teacher's maps (the "
                  "paper's lambda values are for this scale); mean: divided by that number of maps "
                  "(n_layers x n_heads), so lambda weighs one map's KL at any teacher size; auto "
                  "(default): mean, or sum with --a2d-normalization authors (the authors' code)"},
    )
    a2d_attention_epochs: Optional[int] = ranged(
        None, 1, meaning="the last epoch with the attention loss; --a2d-lambda 0 trains without it", example="10",
        help="last epoch with the attention loss: lambda_e = 0 after it (default: every epoch, the paper's "
        "exponential decay). With --teacher-cache as well, the epochs after it read word-level KD from the "
        "cache instead of running the teacher",
    )
    a2d_alpha: float = ranged(
        0.5, 0.0, 1.0, meaning="(1 - alpha) CE + alpha KD",
        help="--a2d-normalization authors only: the authors' --alpha, CE weight 1 - alpha and word-KD "
        "weight alpha (replaces --a2d-mu)",
    )


@register_criterion("a2d_kd", dataclass=A2DConfig)
class AlignToDistillCriterion(KDCriterionBase):
    TERM_NAMES = ("enc_self_att", "dec_self_att", "dec_cross_att", "word_kd")
    #: lambda_e, logged every step next to the terms (0 after --a2d-attention-epochs)
    SCHEDULED_WEIGHT_KEYS = ("a2d_lambda",)
    WEIGHT_FLAGS = {"ce": "1 - --a2d-alpha", "word_kd": "--kd-weight",
                    **{term: "--a2d-lambda" for term in KIND_TERMS.values()}}

    def __init__(self, cfg: A2DConfig, task):
        super().__init__(cfg, task)
        preset_lambda, preset_decay = PRESETS[str(cfg.a2d_preset)]
        self.lambda_0 = preset_lambda if cfg.a2d_lambda is None else float(cfg.a2d_lambda)
        self.lambda_decay = preset_decay if cfg.a2d_lambda_decay is None else float(cfg.a2d_lambda_decay)
        self.mu = self.kd_weight
        self.layerwise = str(cfg.a2d_granularity) == "layer"
        self.mode = normalization_mode(str(cfg.a2d_normalization))
        self.alpha = float(cfg.a2d_alpha)
        self.map_reduction = resolve_map_reduction(str(cfg.a2d_map_reduction), self.mode.name)
        self.kind_weights = KIND_WEIGHTS[str(cfg.a2d_attention_kinds)]
        self.attention_epochs = cfg.a2d_attention_epochs

        teacher_shape = self.teacher.shape
        student_shape = task.require_student_shape(self.criterion_name())
        # With lambda_0 = 0 nothing is built or captured: the criterion is exactly CE + mu * KD, with no
        # parameter left unused by the optimizer or DDP.
        kinds = tuple(self.kind_weights) if self.lambda_0 != 0 else ()
        self.alignments = nn.ModuleDict()
        for kind in kinds:
            student_layers, student_heads = student_shape.kind_size(kind)
            teacher_layers, teacher_heads = teacher_shape.kind_size(kind)
            if self.layerwise:
                student_heads = teacher_heads = 1
            self.alignments[kind] = AttentionAlignment(
                student_layers, student_heads, teacher_layers, teacher_heads,
                combination=self.mode.combination, init=self.mode.init,
            )
        self.student_request = CaptureRequest(attention_kinds=kinds)
        self.teacher_request = CaptureRequest(attention_kinds=kinds)
        check_capturable(self.teacher, self.teacher_request, self.criterion_name())

    def last_live_teacher_epoch(self) -> Optional[int]:
        """Under ``--a2d-attention-epochs N`` only word-level KD is left after epoch N, which
        ``--teacher-cache`` serves."""
        return self.cfg.a2d_attention_epochs

    # ------------------------------------------------------------ weights
    def attention_weight(self) -> float:
        """``lambda_e = lambda_0 * decay^(e - 1)`` (epochs count from 1), 0 after
        ``--a2d-attention-epochs``."""
        if self.attention_epochs is not None and self.epoch > self.attention_epochs:
            return 0.0
        return self.lambda_0 * self.lambda_decay ** (max(self.epoch, 1) - 1)

    def scheduled_weights(self, weights: Dict[str, float]) -> Dict[str, float]:
        """lambda_e of this step's epoch (every attention kind's weight is it times the kind's)."""
        return {"a2d_lambda": self.attention_weight()}

    def loss_weights(self) -> Dict[str, float]:
        lam = self.attention_weight()
        ce_weight, kd_weight = self.mode.ce_kd_weights(self.mu, self.alpha)
        weights = {"ce": ce_weight, "word_kd": kd_weight}
        for kind, term in KIND_TERMS.items():
            weights[term] = lam * self.kind_weights.get(kind, 0.0)
        return weights

    def capture_requests(self, weights: Dict[str, float]):
        """Only the kinds whose loss has a non-zero weight this epoch (none after
        ``--a2d-attention-epochs``): the teacher then runs, if at all, for word-level KD alone."""
        kinds = tuple(kind for kind in self.student_request.attention_kinds if weights[KIND_TERMS[kind]] != 0)
        if kinds == tuple(self.student_request.attention_kinds):
            return self.student_request, self.teacher_request
        return CaptureRequest(attention_kinds=kinds), CaptureRequest(attention_kinds=kinds)

    # -------------------------------------------------------------- terms
    def terms(self, batch) -> Dict[str, Tensor]:
        weights = self.loss_weights()
        terms = {}
        for kind in self.kind_weights:
            term = KIND_TERMS[kind]
            if weights[term] != 0:
                terms[term] = self.attention_term(kind, batch.student.attention[kind], batch.teacher.attention[kind])
                if self.mode.scales_by_positions:
                    terms[term] = terms[term] * batch.target_mask.numel()
        return terms

    def attention_term(self, kind: str, student: AttentionMaps, teacher: AttentionMaps) -> Tensor:
        """Eq. 10 for one kind: AAM of the student maps, then the KL to every teacher map."""
        student_probs, teacher_probs = student.probs, teacher.probs
        if self.layerwise:
            student_probs = student_probs.mean(dim=2, keepdim=True)
            teacher_probs = teacher_probs.mean(dim=2, keepdim=True)
        intermediate = self.alignments[kind](student_probs)
        # (n, B, H_T, Tq, Tk) -> (n * H_T, B, Tq, Tk), layer-major like the AAM's output.
        teacher_maps = teacher_probs.transpose(1, 2).flatten(0, 1)
        divergence = self.mode.divergence(intermediate, teacher_maps, student.attendable[:, 0])
        return divergence / teacher_maps.shape[0] if self.map_reduction == "mean" else divergence


def resolve_map_reduction(requested: str, normalization: str) -> str:
    """``sum`` or ``mean`` for ``--a2d-map-reduction requested`` under ``--a2d-normalization``:
    ``auto`` is the mode's default; ``mean`` with ``authors`` is refused."""
    if requested not in MAP_REDUCTIONS:
        raise InputError(f"--a2d-map-reduction must be one of {', '.join(MAP_REDUCTIONS)}, got {requested!r}")
    mode = normalization_mode(normalization)
    if requested == "mean" and mode.mean_refusal is not None:
        raise InputError(
            f"--a2d-map-reduction mean cannot be combined with --a2d-normalization {mode.name}, "
            f"{mode.mean_refusal}; drop --a2d-map-reduction or choose another --a2d-normalization"
        )
    return mode.default_reduction if requested == "auto" else requested


def alignment_kl(intermediate: Tensor, teacher_maps: Tensor, attendable: Tensor, normalization: str = "mixture") -> Tensor:
    """``sum_c KL(A_T^c || H^I_c)`` (Eq. 10) under ``--a2d-normalization``, in float32, unnormalised.
    intermediate, teacher_maps: ``(C, B, Tq, Tk)`` (the AAM's output, the teacher's probabilities);
    attendable: ``(B, Tq, Tk)`` bool, True where the query is real and may attend to the key."""
    return normalization_mode(normalization).divergence(intermediate, teacher_maps, attendable)
