"""Knowledge distillation from internal representations (Aguilar et al. 2020, AAAI, arXiv:1910.03723).

Student layer ``j`` is paired with teacher layer ``floor(j n / m)``; per pair ``internal_kl``,
``KL(A_T || A_S)`` of every query's self-attention (Eq. 2; head-averaged maps when the head counts
differ), averaged over heads and summed over real queries, and ``internal_cos``, ``1 - cos(P v_S,
v_T)`` of sentence vectors (Eq. 3; per sentence), both weighted by ``--layer-weight``. Schedules
(Algorithm 1): ``all`` pairs every epoch with soft labels; ``pid`` one pair at a time, ``sid``
stacking them, moving on after ``--internal-epochs-per-layer`` epochs or an epoch whose mean
cosine loss, over every worker's sentences, fell below ``--internal-cos-threshold``; then soft
labels (word-level KD) only. ``--hard-label-weight`` keeps CE in every phase (Exp3.6).
Deviations (``v`` is a mean over real positions, not ``[CLS]``; our schedule defaults) and how the
schedule resumes: ``docs/methods/internal_kd.md``.
"""
import logging
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import Tensor, nn

from ..models.feature_capture import DECODER_SELF, ENCODER_SELF, CaptureRequest
from ..modules.layer_mapping import uniform_mapping, validate_mapping
from ..modules.projection import width_projection
from .hidden_state import HiddenStateKDConfig, HiddenStateKDCriterion, in_param_dtype
from .method import DistillationTerms
from .config import ranged, weight
from .epoch_sums import EpochSums
from .losses import masked_mean_pool, masked_row_kl

logger = logging.getLogger(__name__)

SCHEDULE_CHOICES = ChoiceEnum(["all", "pid", "sid"])
SELF_ATTENTION = {"encoder": ENCODER_SELF, "decoder": DECODER_SELF}


@dataclass
class InternalKDConfig(HiddenStateKDConfig):
    kd_weight: float = weight(
        1.0, help="weight of the soft labels (word-level KD) once the internal phase is over, throughout "
        "with --internal-schedule all or --internal-soft-labels-throughout",
    )
    layer_weight: float = weight(
        1.0, help="weight of each internal term (attention KL and cosine) while layers are distilled",
    )
    hard_label_weight: float = weight(
        0.0, help="weight of the label-smoothed CE on the references, in every phase (the paper's "
        "'hard labels'; 0 = soft labels only)",
    )
    internal_schedule: SCHEDULE_CHOICES = field(
        default="sid",
        metadata={"help": "all: every pair every epoch; pid: one pair at a time bottom-up; sid: "
                  "pairs stack up bottom-up (Algorithm 1); pid/sid end with soft labels only"},
    )
    internal_epochs_per_layer: int = ranged(
        5, 1, meaning="a number of epochs",
        help="pid/sid: epochs spent on a pair before moving to the next one at the latest",
    )
    internal_cos_threshold: float = ranged(
        0.05, 0.0, meaning="a cosine-distance threshold",
        help="pid/sid: move to the next pair after an epoch whose mean cosine loss (1 - cos, over all "
        "workers' sentences) of the current pair is below this; 0 disables",
    )
    internal_soft_labels_throughout: bool = field(
        default=False,
        metadata={"help": "pid/sid: also train on the soft labels during the internal phase"},
    )


def schedule_stage(epoch: int, num_stages: int, epochs_per_stage: int, crossings: Iterable[int]) -> int:
    """Index of the pair distilled in ``epoch`` (``num_stages`` once all are done) under PID/SID: the
    schedule moves on after ``epochs_per_stage`` finished epochs on a pair, or after an epoch listed
    in ``crossings`` (its cosine loss fell below the threshold), whichever comes first."""
    crossings = set(crossings)
    stage = spent = 0
    for finished in range(1, epoch):
        if stage >= num_stages:
            break
        spent += 1
        if spent >= epochs_per_stage or finished in crossings:
            stage, spent = stage + 1, 0
    return stage


@register_criterion("internal_kd", dataclass=InternalKDConfig)
class InternalKDCriterion(HiddenStateKDCriterion):
    TERM_NAMES = ("word_kd", "internal_kl", "internal_cos")
    #: the phase schedule, logged every step next to the terms: word KD's weight (0 during the
    #: internal phase unless soft labels run throughout) and the internal terms' (0 after it)
    SCHEDULED_WEIGHT_KEYS = ("word_kd_weight", "internal_kl_weight")
    LOG_KEYS = ("internal_schedule_cos", "internal_schedule_sentences")
    WEIGHT_FLAGS = {"ce": "--hard-label-weight", "word_kd": "--kd-weight", "internal_kl": "--layer-weight",
                    "internal_cos": "--layer-weight"}
    SENTENCE_TERMS = ("internal_cos",)

    def __init__(self, cfg: InternalKDConfig, task):
        super().__init__(cfg, task)
        self.schedule = str(cfg.internal_schedule)
        self.hard_label_weight = float(cfg.hard_label_weight)
        self.epochs_per_layer = int(cfg.internal_epochs_per_layer)
        self.cos_threshold = float(cfg.internal_cos_threshold)
        self.soft_labels_throughout = bool(cfg.internal_soft_labels_throughout)

        self.pairs: Dict[str, Tuple[Tuple[int, int], ...]] = {}
        self.projections = nn.ModuleDict()
        for side in self.sides:
            n, m = self.teacher_shape.layers(side), self.student_shape.layers(side)
            flag = f"--criterion internal_kd [{side}]"
            mapping = validate_mapping(uniform_mapping(n, m, flag), n, m, flag)
            self.pairs[side] = tuple((j, group[0]) for j, group in enumerate(mapping, start=1))
            self.register_layer_index(f"{side}_pair_teacher_layers", [group[0] for group in mapping])
            self.register_layer_index(f"{side}_active_slots", [])
            self.projections[side] = width_projection(
                self.student_shape.embed_dim(side), self.teacher_shape.embed_dim(side)
            )
        self.num_stages = max(len(pairs) for pairs in self.pairs.values())
        self.crossings: List[int] = []
        self._announced_stage = None
        #: the newest pair's 1 - cos and sentences, pooled over workers, in ``schedule_sums.epoch``
        self.schedule_sums = EpochSums()
        self.schedule_sums.begin_epoch(self.epoch)
        self._enter_stage(self.stage_at(self.epoch))

    @classmethod
    def check_weights(cls, kd_weight, layer_weight):
        """No bound on the sum: the CE weight is --hard-label-weight (each weight's range is the base's)."""

    # ---------------------------------------------------------------- schedule
    def stage_at(self, epoch: int) -> int:
        if self.schedule == "all":
            return 0
        return schedule_stage(epoch, self.num_stages, self.epochs_per_layer, self.crossings)

    @property
    def internal_phase(self) -> bool:
        return self.schedule == "all" or self.stage < self.num_stages

    def active_slots(self, stage: int) -> List[int]:
        """0-based student layer slots distilled at ``stage``."""
        if self.schedule == "all":
            return list(range(self.num_stages))
        if stage >= self.num_stages:
            return []
        return [stage] if self.schedule == "pid" else list(range(stage + 1))

    def _enter_stage(self, stage: int) -> None:
        self.stage = stage
        slots = self.active_slots(stage)
        self.slots: Dict[str, List[int]] = {}
        for side in self.sides:
            self.slots[side] = [slot for slot in slots if slot < len(self.pairs[side])]
            name = f"{side}_active_slots"
            device = getattr(self, name).device
            self.register_buffer(name, torch.tensor(self.slots[side], dtype=torch.long, device=device),
                                 persistent=False)
        distilling = self.internal_phase and self.layer_weight != 0
        # maps of the active pairs' layers only
        sides = [side for side in self.sides if distilling and self.slots[side]]
        student_layers = {SELF_ATTENTION[side]: self.active_student_layers(side) for side in sides}
        teacher_layers = {SELF_ATTENTION[side]: self.active_teacher_layers(side) for side in sides}
        kinds = tuple(student_layers)
        hidden = dict(encoder_hidden=distilling and "encoder" in self.sides,
                      decoder_hidden=distilling and "decoder" in self.sides)
        self.teacher_request = CaptureRequest(attention_kinds=kinds, attention_layers=teacher_layers, **hidden)
        # The student's pre-softmax scores give exact log-probabilities for the KL.
        self.student_request = CaptureRequest(attention_kinds=kinds, attention_scores=bool(kinds),
                                              attention_layers=student_layers, **hidden)

    def active_student_layers(self, side: str) -> List[int]:
        """The student layer (1-based) of each active pair of ``side``, in slot order."""
        return [slot + 1 for slot in self.slots[side]]

    def active_teacher_layers(self, side: str) -> List[int]:
        """The teacher layer (1-based) of each active pair of ``side``, in slot order."""
        return [self.pairs[side][slot][1] for slot in self.slots[side]]

    def begin_epoch(self, epoch: int) -> None:
        super().begin_epoch(epoch)
        accumulating = self.schedule_sums.epoch
        if epoch > accumulating:
            self._close_epoch(accumulating)
        elif epoch < accumulating:
            # Training restarted at an earlier epoch (e.g. --reset-dataloader): later crossings
            # belong to a history that is being replaced.
            self.crossings = [e for e in self.crossings if e < epoch]
        # epoch == accumulating epoch: a resume in the middle of that epoch; EpochSums keeps its sums.
        self.schedule_sums.begin_epoch(epoch)
        self._enter_stage(self.stage_at(epoch))
        if self.schedule != "all" and self.stage != self._announced_stage:
            logger.info("internal_kd epoch %d: %s", epoch, self.describe_stage())
            self._announced_stage = self.stage

    def _close_epoch(self, epoch: int) -> None:
        """Record a threshold crossing if ``epoch`` distilled a pair whose mean cosine loss, over
        every worker's sentences, fell below the threshold."""
        if self.schedule == "all" or self.stage_at(epoch) >= self.num_stages:
            return
        total, sentences = self.epoch_cosine_sums()
        if sentences > 0 and total / sentences < self.cos_threshold and epoch not in self.crossings:
            self.crossings.append(epoch)
            logger.info(
                "internal_kd: epoch %d mean cosine loss %.4f < threshold %.4f, moving to the next pair",
                epoch, total / sentences, self.cos_threshold,
            )

    def epoch_cosine_sums(self) -> Tuple[float, float]:
        """(sum of 1 - cos, sentences) of the current pair so far in this epoch, all workers."""
        sums = self.schedule_sums.sums
        return float(sums.get("cos", 0.0)), float(sums.get("sentences", 0.0))

    def reduce_worker_logs(self, logging_outputs) -> None:
        """Add a step's pooled schedule statistics (zeros in validation and dummy batches)."""
        sentences = sum(utils.item(log.get("internal_schedule_sentences", 0)) for log in logging_outputs)
        if sentences:
            total = sum(utils.item(log.get("internal_schedule_cos", 0)) for log in logging_outputs)
            self._add_schedule_sums(total, sentences)

    def _add_schedule_sums(self, total: float, sentences: float) -> None:
        self.schedule_sums.add("cos", torch.tensor(float(total)))
        self.schedule_sums.add("sentences", torch.tensor(float(sentences)))

    def describe_stage(self) -> str:
        if not self.internal_phase:
            return "all pairs done, soft labels only"
        parts = []
        for side in self.sides:
            pairs = [self.pairs[side][slot] for slot in self.slots[side]]
            if pairs:  # a side with fewer layers may have finished already
                parts.append(f"{side} " + ", ".join(f"S{j}<-T{t}" for j, t in pairs))
        return f"stage {self.stage + 1}/{self.num_stages}: " + "; ".join(parts)

    def checkpoint_state(self) -> dict:
        total, sentences = self.epoch_cosine_sums()
        return {"crossings": list(self.crossings), "accumulating_epoch": self.schedule_sums.epoch,
                "epoch_cos": total, "epoch_sentences": sentences}

    def load_checkpoint_state(self, state: dict) -> None:
        self.crossings = [int(e) for e in state.get("crossings", [])]
        accumulating = int(state.get("accumulating_epoch", self.schedule_sums.epoch))
        self.schedule_sums = EpochSums()
        self.schedule_sums.begin_epoch(accumulating)
        if state.get("epoch_sentences", 0.0) > 0:
            self._add_schedule_sums(state["epoch_cos"], state["epoch_sentences"])
        self._enter_stage(self.stage_at(accumulating))

    # ---------------------------------------------------------------- weights
    def loss_weights(self) -> Dict[str, float]:
        internal = self.layer_weight if self.internal_phase else 0.0
        soft = self.schedule == "all" or not self.internal_phase or self.soft_labels_throughout
        return {
            "ce": self.hard_label_weight,
            "word_kd": self.kd_weight if soft else 0.0,
            "internal_kl": internal,
            "internal_cos": internal,
        }

    # ------------------------------------------------------------------- terms
    def terms(self, batch):
        terms: Dict[str, Tensor] = {}
        if self.loss_weights()["internal_kl"] == 0:
            return terms
        kl_terms, cos_terms, current_cos, current_sentences = [], [], [], 0
        for side in self.sides:
            slots = getattr(self, f"{side}_active_slots")
            if slots.numel() == 0:
                continue
            teacher_layers = getattr(self, f"{side}_pair_teacher_layers").index_select(0, slots)
            kl_terms.append(self.attention_term(side, batch))
            per_sentence = self.cosine_losses(side, batch, slots, teacher_layers)  # (pairs, B)
            cos_terms.append(per_sentence.sum())
            if self.schedule != "all" and self.stage in self.slots[side]:
                # The threshold watches the newest pair: the last active slot.
                current_cos.append(per_sentence[-1].detach().sum())
                current_sentences += per_sentence.size(1)
        terms["internal_kl"] = sum(kl_terms)
        terms["internal_cos"] = sum(cos_terms)
        logs = {}
        if self.training and current_cos and not self.is_dummy_batch:
            # Summed over workers by fairseq, then added to the epoch's sums in reduce_worker_logs.
            logs = {"internal_schedule_cos": sum(current_cos).data,
                    "internal_schedule_sentences": current_sentences}
        return DistillationTerms(terms, logs)

    def attention_term(self, side: str, batch) -> Tensor:
        """Summed KL of the active pairs' self-attention rows (see the module docstring)."""
        kind = SELF_ATTENTION[side]
        student_maps, teacher_maps = batch.student.attention[kind], batch.teacher.attention[kind]
        teacher_probs = teacher_maps.of_layers(teacher_maps.probs, self.active_teacher_layers(side))
        student_scores = student_maps.of_layers(student_maps.scores, self.active_student_layers(side)).float()
        # Padded query rows stay unmasked so that they remain finite; masked_row_kl ignores them.
        allowed = student_maps.attendable | student_maps.query_padding_mask[:, None, :, None]
        student_log_probs = torch.log_softmax(student_scores.masked_fill(~allowed, float("-inf")), dim=-1)
        # Blocked keys: a finite placeholder keeps the head average's gradient finite.
        student_log_probs = student_log_probs.masked_fill(~allowed, 0.0)
        if student_maps.num_heads != teacher_maps.num_heads:
            teacher_probs = teacher_probs.float().mean(2, keepdim=True)
            student_log_probs = (
                torch.logsumexp(student_log_probs, dim=2, keepdim=True) - math.log(student_maps.num_heads)
            )
        # Aguilar et al. 2020, Eq. 2: each query's KL, averaged over heads, summed over real queries.
        per_row = masked_row_kl(student_log_probs, student_maps.attendable, teacher_probs=teacher_probs)
        return per_row.mean(2).sum()

    def cosine_losses(self, side: str, batch, slots: Tensor, teacher_layers: Tensor) -> Tensor:
        """``1 - cos(P v_S, v_T)`` per active pair and sentence: ``(pairs, batch)``."""
        padding_mask = batch.student.padding_mask(side)
        student = masked_mean_pool(batch.student.hidden(side).index_select(0, slots + 1), padding_mask)
        teacher = masked_mean_pool(batch.teacher.hidden(side).index_select(0, teacher_layers), padding_mask)
        student = in_param_dtype(self.projections[side], student)
        return 1.0 - F.cosine_similarity(student, teacher, dim=-1)
