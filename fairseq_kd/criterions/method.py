"""What a distillation method gives the criterion base (:mod:`.base`), and what it is given.

A method is a registered class on :class:`~.base.KDCriterionBase`, which inherits
:class:`DistillationMethod`: it names its terms (``TERM_NAMES``), sets what it captures of student
and teacher (``self.student_request`` / ``self.teacher_request`` in ``__init__``), gives its weights
(:meth:`~DistillationMethod.loss_weights`) and computes its own terms from a
:class:`DistillationBatch` (:meth:`~DistillationMethod.terms`), each an unnormalised sum over real
target tokens. Word-level KD (``KD_TERM``) is the base's. The other hooks have defaults that most
methods keep. The weight convention: ``docs/methods/README.md``.
"""
import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from torch import Tensor

from ..models.feature_capture import CapturedFeatures, CaptureRequest


@dataclass
class DistillationBatch:
    """Everything a method needs for one batch; features only where the method requested them."""

    sample: dict
    student_output: tuple
    teacher_output: Optional[tuple]
    student: CapturedFeatures
    teacher: CapturedFeatures
    target_mask: Tensor  # (batch, tgt_len), True at target tokens that count
    #: the cached teacher's top-k, when the step reads --teacher-cache instead of running the teacher
    teacher_topk: Optional[Tuple[Tensor, Tensor]] = None
    #: where word-level KD applies (:meth:`DistillationMethod.kd_positions`), set by the base
    kd_mask: Optional[Tensor] = None

    @property
    def student_logits(self) -> Tensor:
        return self.student_output[0]

    @property
    def teacher_logits(self) -> Tensor:
        if self.teacher_output is None:
            raise RuntimeError("no teacher logits: this batch's teacher is the top-k cache (--teacher-cache)")
        return self.teacher_output[0]


class DistillationTerms(dict):
    """What :meth:`DistillationMethod.terms` may return instead of a plain dict: the terms by name,
    plus ``logs``, per-step values (keys from ``LOG_KEYS``) that fairseq sums over workers."""

    def __init__(self, terms: Dict[str, Tensor], logs: Optional[Dict[str, object]] = None):
        super().__init__(terms)
        self.logs = dict(logs or {})


class DistillationMethod:
    """The class attributes and hooks a method sets or overrides. The base gives it ``self.cfg`` (its
    config), ``self.kd_weight``, ``self.kd_temperature``, ``self.epoch`` and ``self.teacher``; its
    ``__init__`` sets ``self.student_request`` and ``self.teacher_request`` (:class:`CaptureRequest`)."""

    #: names of the distillation terms, word-level KD's included (each logged as ``<name>_loss``)
    TERM_NAMES: Tuple[str, ...] = ()
    #: the terms that are sums over sentences (the base makes them means over sentences)
    SENTENCE_TERMS: Tuple[str, ...] = ()
    #: per-step values the method returns in ``DistillationTerms.logs`` (0 when absent)
    LOG_KEYS: Tuple[str, ...] = ()
    #: weights that follow a schedule, logged every step (:meth:`scheduled_weights`)
    SCHEDULED_WEIGHT_KEYS: Tuple[str, ...] = ()
    #: the term that is word-level KD (computed by the base; the one term --teacher-cache serves)
    KD_TERM: str = "word_kd"
    #: how each weight of ``loss_weights()`` is set, for the refusal of a negative one
    WEIGHT_FLAGS: Dict[str, str] = {"ce": "the CE weight", "word_kd": "--kd-weight"}

    @classmethod
    def config_fields(cls, key: str) -> Dict[str, object]:
        """The fields of the criterion's config whose metadata has ``key``: name -> that value."""
        config_class = getattr(cls, "__dataclass", None)
        if config_class is None:
            return {}
        return {f.name: f.metadata[key] for f in dataclasses.fields(config_class) if key in f.metadata}

    @classmethod
    def kd_weight_alias(cls) -> Optional[str]:
        """The config field that names ``--kd-weight`` after the method's paper (``kd_weight_alias=True``)."""
        return next(iter(cls.config_fields("kd_weight_alias")), None)

    # ----------------------------------------------------------------- hooks
    def loss_weights(self) -> Dict[str, float]:
        """Weight of ``"ce"`` and of every name in ``TERM_NAMES`` at the current epoch."""
        raise NotImplementedError

    def terms(self, batch: DistillationBatch) -> Dict[str, Tensor]:
        """The method's own active terms, word-level KD excepted (the base's), each an unnormalised
        sum; a :class:`DistillationTerms` when the method also logs values (``LOG_KEYS``)."""
        return {}

    def kd_positions(self, batch: DistillationBatch) -> Tensor:
        """Where word-level KD applies, once per step: ``batch.target_mask`` (the same object) by
        default; a subset of it for a method that distils chosen tokens (selective KD)."""
        return batch.target_mask

    def capture_requests(self, weights: Dict[str, float]) -> Tuple[CaptureRequest, CaptureRequest]:
        """What to capture from the student and from the teacher in a step with these weights."""
        return self.student_request, self.teacher_request

    def last_live_teacher_epoch(self) -> Optional[int]:
        """The last epoch in which a term the cache cannot serve has a non-zero weight, after which
        ``--teacher-cache`` replaces the teacher; None: no such epoch. Reads only ``self.cfg``."""
        return None

    def additive_weights(self) -> Dict[str, float]:
        """For ``CE + sum_i w_i L_i + kd_weight L_KD``: CE weight 1, each term at its config field
        (``weight(..., term=NAME)``), word-level KD at ``kd_weight``."""
        weights = {"ce": 1.0}
        weights.update({term: float(getattr(self.cfg, name)) for name, term in self.config_fields("term").items()})
        weights[self.KD_TERM] = self.kd_weight
        return weights

    def scheduled_weights(self, weights: Dict[str, float]) -> Dict[str, float]:
        """Each ``SCHEDULED_WEIGHT_KEYS`` value in a step with these weights: ``<term>_weight`` is
        ``weights[term]`` unless the method says otherwise."""
        return {key: float(weights[key[: -len("_weight")]]) for key in self.SCHEDULED_WEIGHT_KEYS}

    def begin_epoch(self, epoch: int) -> None:
        """Called by the task at the start of every epoch (also after a resume, with its epoch)."""
        self.epoch = epoch

    def reduce_worker_logs(self, logging_outputs) -> None:
        """Called on every worker after each step with all workers' logging outputs (gathered by
        fairseq): where a method pools a statistic across workers into its state."""

    def checkpoint_state(self) -> dict:
        """Non-parameter state to keep across a resume (tensors and plain values only)."""
        return {}

    def load_checkpoint_state(self, state: dict) -> None:
        """Restore what :meth:`checkpoint_state` returned."""
