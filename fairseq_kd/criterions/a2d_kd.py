"""Align-to-Distill, A2D (Jin et al., LREC-COLING 2024, arXiv:2403.01479).

    fairseq-train DATA --user-dir fairseq_kd --task translation_kd --teacher-checkpoint T.pt \\
        --criterion a2d_kd [--a2d-preset low_resource|wmt] ...

For each attention kind in use (encoder self, decoder self, decoder cross) all student maps go
through that kind's Attention Alignment Module (:mod:`fairseq_kd.modules.attention_alignment`,
Eq. 9), which makes one intermediate map ``H^I_c`` per teacher map ``A_T^c``. Then

    L_kind = sum_c KL(A_T^c || H^I_c)                                   (Eq. 10)
    L_att  = L_enc-self + (L_dec-self + L_dec-cross) / 2                 (Eq. 11)
    L      = L_CE + lambda_e * L_att + mu * L_KD                         (Eq. 12)

with ``L_KD`` word-level KD (:func:`~fairseq_kd.criterions.losses.word_level_kd`) and
``lambda_e = lambda_0 * decay^(e - 1)`` at epoch ``e`` (Sec. 5.2: lambda decays exponentially, by a
factor 0.9 per epoch), a pure function of the epoch so a resumed run continues the schedule.
The modules are sized from the actual teacher and student when the criterion is built; no head,
layer or width parity is needed.

Choices the paper leaves open, documented here:

* **Making ``H^I`` a distribution** (``--a2d-normalization``). Eq. 9's ``H^I`` is a signed linear
  combination, not a distribution, and the paper does not say how Eq. 10 turns it into one. Every
  mode below has its minimum where the intermediate map equals the teacher's map (a student
  identical to its teacher, with an identity alignment, gives 0; ``tests/test_a2d_kd.py`` checks
  it for every mode and kind against a slow reference):

  - ``mixture`` (default): the AAM combines the student maps convexly (softmax-normalised
    weights, no bias; :class:`~fairseq_kd.modules.attention_alignment.AttentionAlignment`), so
    each row of ``H^I`` is a distribution over the keys its query may attend to, and Eq. 10 is the
    KL between two attention distributions per query, summed over real queries. Why it is the
    default: it is the only mode whose KL compares attention rows as they are. ``row`` and
    ``flat`` softmax *probabilities* (values in [0, 1]), which flattens every target towards
    uniform (a one-hot teacher row of length 10 becomes a distribution whose largest entry is
    0.23), so the attention signal they give is weak; and the old ``row`` mode (raw teacher
    probabilities against a log-softmax of ``H^I``) had its minimum away from the teacher's maps.
    The real-data comparison of the modes is recorded in ``docs/results/README.md`` as it is run.
  - ``row``: Eq. 9 as written (signed weights, bias); a log-softmax over each query's attendable
    keys is applied to ``H^I`` and to the teacher's probabilities alike, so the minimum is at
    ``H^I = A_T`` (up to a constant per row).
  - ``flat``: the same with one log-softmax over all attendable entries of a map (query x key),
    both sides alike: one distribution per map and sentence, masked.
  - ``authors``: the authors' public code (github.com/ncsoft/Align-to-Distill,
    ``kd_label_smoothed_cross_entropy.py``) exactly: ``torch.nn.Conv2d``-initialised signed AAM;
    a log-softmax over every entry of each flattened map, padded and future entries included, on
    both sides; ``KL`` summed over maps and sentences; ``(1 - alpha) CE + alpha KD`` with
    ``--a2d-alpha 0.5``, where the authors average CE and KD over the batch's ``B x T`` target
    positions. To keep that balance under fairseq's per-token normalisation the summed KL is
    multiplied by ``B x T``: the objective is then the authors' times ``B x T`` (a per-batch
    factor that Adam's update does not see), and the logged ``*_att_loss`` is their summed KL
    times ``B x T / ntokens``, i.e. thousands of times the other modes' per-token values.
* **Safe KL.** ``sum p_T (log p_T - log q)`` with ``xlogy(p_T, p_T)`` (``0 log 0 = 0``) and
  excluded entries removed by selection, never by multiplying an infinite log by zero; all in
  float32 even when the model runs in fp16/bf16.
* **Map reduction** (``--a2d-map-reduction``). Eq. 10 sums over the teacher maps ``c``
  (``sum``); the default (``auto``) is ``mean`` (each kind's sum divided by its number of teacher
  maps, so ``lambda`` weighs one map's KL whatever the teacher's depth and head count), except
  under ``--a2d-normalization authors``, which reproduces the authors' code and so sums. Why
  ``mean`` is the default: with the paper's ``lambda_0 = 1`` and a 6-layer, 4-head teacher the
  summed terms are 24 KLs per token, several times the CE at the start; they dominate the
  gradient until lambda has decayed, and the student learns the task later than without KD. The
  real-corpus comparison that chose ``mean`` on validation nll (against ``sum``, word-level KD
  alone and no KD), with the measured sizes of the terms, is in ``docs/results/README.md``
  (Multi30k Fr-En, CPU budget). The presets keep the paper's lambda values, which the paper
  states for the sum: ``sum`` gives the paper's scale. Each KL is summed over real query positions (``mixture``, ``row``) or sentences
  (``flat``), and the criterion base divides by fairseq's ``sample_size`` as it does for CE. The terms are logged
  unweighted per kind as ``enc_self_att_loss``, ``dec_self_att_loss``, ``dec_cross_att_loss``,
  next to ``word_kd_loss``; with ``all`` kinds, ``L_att = enc + (dec_self + dec_cross) / 2``.
* **Which kinds** (``--a2d-attention-kinds``, Table 4): ``all`` (weights 1, 1/2, 1/2),
  ``enc_self`` (1), ``dec_all`` (1/2, 1/2), ``dec_self`` (1) and ``dec_cross`` (1): a single decoder
  kind takes weight 1 so that its loss has the scale of Dec-All's (Table 4 caption). Only the
  kinds in use are captured.
* **Head-wise or layer-wise maps** (``--a2d-granularity``, Table 6): ``head`` (default) aligns
  every head's map; ``layer`` averages each layer's heads first, for teacher and student, and
  aligns the per-layer maps.
* **Presets** (``--a2d-preset``, Sec. 5.2): ``low_resource`` (default; IWSLT, WMT'22 De-Dsb):
  ``lambda_0 = 1``, decay 0.9 per epoch, ``mu = 1``. ``wmt`` (WMT'14 En-De, many more maps):
  ``lambda_0 = 0.1``; the paper states no other change for this setting, so the decay stays 0.9. ``--a2d-lambda`` and
  ``--a2d-lambda-decay`` override the preset; ``--kd-weight 0`` (alias ``--a2d-mu 0``) is Table 2's
"A2D w/o L_KD".

* **Ending the attention phase** (``--a2d-attention-epochs N``, not in the paper, whose lambda
  decays for ever): ``lambda_e = 0`` after epoch ``N``, leaving ``L_CE + mu * L_KD``. Word-level KD
  needs only the teacher's output distribution, so with ``--teacher-cache`` (made by
  ``fairseq-kd-teacher-cache`` from the same ``--teacher-checkpoint``) the epochs after ``N`` read
  the teacher's top k from the cache and run no teacher at all: those steps cost what word KD from
  the cache costs. With lambda decaying by 0.9 per epoch, epoch 30 weighs the attention at 0.05 of
  epoch 1.

The alignment weights can be drawn as the paper's Figure 2: ``fairseq-kd-plot alignment
--checkpoint CKPT --output aam.png``.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from ..models.feature_capture import DECODER_CROSS, DECODER_SELF, ENCODER_SELF, AttentionMaps, CaptureRequest
from ..modules.attention_alignment import AttentionAlignment
from .startup_checks import check_capturable
from .base import KDCriterionBase, KDCriterionConfig, ranged, weight
from .losses import masked_row_kl, word_kd_term

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
    # Student softmax rows are strictly positive on attendable keys; the clamp only guards an
    # underflow, so a teacher entry can never meet log(0).
    log_q = intermediate.clamp_min(torch.finfo(torch.float32).tiny).log()
    return masked_row_kl(log_q, mask, teacher_probs=teacher_maps).sum()


def _masked_log_softmax_kl(intermediate: Tensor, teacher_maps: Tensor, entry_mask: Tensor) -> Tensor:
    """A log-softmax of both sides over the last axis's ``entry_mask`` entries, then their KL."""
    fill = torch.finfo(torch.float32).min
    log_q = torch.log_softmax(intermediate.masked_fill(~entry_mask, fill), dim=-1)
    log_p = torch.log_softmax(teacher_maps.masked_fill(~entry_mask, fill), dim=-1)
    return masked_row_kl(log_q, entry_mask, teacher_log_probs=log_p).sum()


def _row_kl(intermediate: Tensor, teacher_maps: Tensor, mask: Tensor) -> Tensor:
    """Log-softmax over each query's attendable keys, both sides; one KL per real query."""
    return _masked_log_softmax_kl(intermediate, teacher_maps, mask)


def _flat_kl(intermediate: Tensor, teacher_maps: Tensor, mask: Tensor) -> Tensor:
    """Log-softmax over all attendable entries of each map, both sides; one KL per map and sentence."""
    return _masked_log_softmax_kl(intermediate.flatten(-2), teacher_maps.flatten(-2), mask.flatten(-2))


def _authors_kl(intermediate: Tensor, teacher_maps: Tensor, mask: Tensor) -> Tensor:
    """Log-softmax over every entry of each map, padded and future ones included (no mask)."""
    log_q = torch.log_softmax(intermediate.flatten(-2), dim=-1)
    log_p = torch.log_softmax(teacher_maps.flatten(-2), dim=-1)
    return masked_row_kl(log_q, torch.ones_like(log_q, dtype=torch.bool), teacher_log_probs=log_p).sum()


def _ce_and_mu_kd(mu: float, alpha: float) -> Tuple[float, float]:
    """Eq. 12: ``L_CE + mu * L_KD``."""
    return 1.0, mu


def _authors_alpha(mu: float, alpha: float) -> Tuple[float, float]:
    """The authors' code: ``(1 - alpha) CE + alpha KD`` (``--a2d-alpha`` replaces ``mu``)."""
    return 1.0 - alpha, alpha


@dataclass(frozen=True)
class NormalizationMode:
    """Everything one ``--a2d-normalization`` value decides (the module docstring says why)."""

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

    @property
    def allows_mean(self) -> bool:
        return self.mean_refusal is None

    def divergence(self, intermediate: Tensor, teacher_maps: Tensor, attendable: Tensor) -> Tensor:
        """``sum_c KL(A_T^c || H^I_c)`` in float32 (see :func:`alignment_kl`)."""
        return self.kl(intermediate.float(), teacher_maps.float(), attendable.unsqueeze(0))


#: ``--a2d-normalization`` -> its mode (see the module docstring)
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
        raise ValueError(
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
        None, help="the paper's name for --kd-weight (mu, Eq. 12); when given, it replaces it",
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
                  "KD): its attention term is the authors' summed KL times B x T target positions, "
                  "thousands of times the other modes' per-token values at the same --a2d-lambda"},
    )
    a2d_map_reduction: ChoiceEnum(list(MAP_REDUCTIONS)) = field(
        default="auto",
        metadata={"help": "sum: Eq. 10 as written, each kind's KL summed over the teacher's maps (the "
                  "paper's lambda values are for this scale); mean: divided by that number of maps "
                  "(n_layers x n_heads), so lambda weighs one map's KL at any teacher size; auto "
                  "(default): mean, or sum with --a2d-normalization authors (the authors' code). "
                  "mean won the real-corpus comparison on validation (docs/results/)"},
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
    KD_WEIGHT_ALIAS = "a2d_mu"
    WEIGHT_FLAGS = {"ce": "1 - --a2d-alpha", "word_kd": "--kd-weight",
                    **{term: "--a2d-lambda" for term in KIND_TERMS.values()}}
    PAPER = "Align-to-Distill (Jin et al. 2024)"
    MAIN_FLAGS = ("a2d_preset", "a2d_lambda_decay", "a2d_granularity", "a2d_attention_kinds", "a2d_normalization",
                  "a2d_map_reduction", "a2d_attention_epochs")

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
        # With lambda_0 = 0 no module is built: the criterion then has no parameters and is exactly
        # CE + mu * KD (no unused parameters in the optimizer or under DDP).
        self.alignments = nn.ModuleDict()
        for kind in self.kind_weights if self.lambda_0 != 0 else ():
            student_layers, student_heads = student_shape.kind_size(kind)
            teacher_layers, teacher_heads = teacher_shape.kind_size(kind)
            if self.layerwise:
                student_heads = teacher_heads = 1
            self.alignments[kind] = AttentionAlignment(
                student_layers, student_heads, teacher_layers, teacher_heads,
                combination=self.mode.combination, init=self.mode.init,
            )

        # Instance-level requests: only the kinds in use are captured, and nothing when lambda_0 = 0.
        kinds = tuple(self.kind_weights) if self.lambda_0 != 0 else ()
        self.student_request = CaptureRequest(attention_kinds=kinds)
        self.teacher_request = CaptureRequest(attention_kinds=kinds)
        check_capturable(self.teacher, self.teacher_request, self.criterion_name())

    def last_live_teacher_epoch(self) -> Optional[int]:
        """Under ``--a2d-attention-epochs N`` only word-level KD is left after epoch N, which
        ``--teacher-cache`` serves."""
        return self.cfg.a2d_attention_epochs

    # ------------------------------------------------------------ weights
    def attention_weight(self, epoch: Optional[int] = None) -> float:
        """``lambda_e = lambda_0 * decay^(e - 1)`` (epochs count from 1), 0 after
        ``--a2d-attention-epochs``."""
        epoch = self.epoch if epoch is None else epoch
        if self.attention_epochs is not None and epoch > self.attention_epochs:
            return 0.0
        return self.lambda_0 * self.lambda_decay ** (max(epoch, 1) - 1)

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
    def distillation_terms(self, batch) -> Dict[str, Tensor]:
        weights = self.loss_weights()
        terms = {}
        for kind in self.kind_weights:
            if weights[KIND_TERMS[kind]] != 0:
                terms[KIND_TERMS[kind]] = self.attention_term(
                    kind, batch.student.attention[kind], batch.teacher.attention[kind]
                )
                if self.mode.scales_by_positions:
                    terms[KIND_TERMS[kind]] = terms[KIND_TERMS[kind]] * batch.target_mask.numel()
        if weights["word_kd"] != 0:
            terms["word_kd"] = word_kd_term(batch, batch.target_mask, self.kd_temperature)
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
    """``sum`` or ``mean`` for ``--a2d-map-reduction requested`` under ``--a2d-normalization``.

    ``auto`` is ``mean`` (the module docstring says why), except for ``authors``, whose code sums
    over maps; asking ``authors`` to average would no longer be the authors' objective, so it is
    refused rather than silently changed.
    """
    if requested not in MAP_REDUCTIONS:
        raise ValueError(f"--a2d-map-reduction must be one of {', '.join(MAP_REDUCTIONS)}, got {requested!r}")
    mode = normalization_mode(normalization)
    if requested == "mean" and not mode.allows_mean:
        raise ValueError(
            f"--a2d-map-reduction mean cannot be combined with --a2d-normalization {mode.name}, "
            f"{mode.mean_refusal}; drop --a2d-map-reduction or choose another --a2d-normalization"
        )
    return mode.default_reduction if requested == "auto" else requested


def alignment_kl(intermediate: Tensor, teacher_maps: Tensor, attendable: Tensor, normalization: str = "mixture") -> Tensor:
    """``sum_c KL(A_T^c || H^I_c)`` (Eq. 10) under ``--a2d-normalization``, in float32, unnormalised.

    intermediate: ``(C, B, Tq, Tk)`` AAM output; teacher_maps: ``(C, B, Tq, Tk)`` teacher
    probabilities, rows summing to 1 over attendable keys (any float dtype); attendable:
    ``(B, Tq, Tk)`` bool, True where the query is real and may attend to the key.

    ``mixture``: ``intermediate`` rows are distributions already; one KL per (map, sentence, real
    query). ``row``: log-softmax over each query's attendable keys of both sides, one KL per real
    query. ``flat``: log-softmax over all attendable entries of each map, both sides. ``authors``:
    log-softmax over every entry of each map, no mask. Excluded entries are removed by selection,
    never by multiplying an infinite log by zero.
    """
    return normalization_mode(normalization).divergence(intermediate, teacher_maps, attendable)
