"""The base of every distillation criterion: label-smoothed CE plus named, weighted terms.

A method subclasses :class:`KDCriterionBase`, declares the loss terms it adds (``TERM_NAMES``), what
it needs captured from student and teacher (``student_request`` / ``teacher_request``), its weights
(``loss_weights``), and computes its terms from a :class:`DistillationBatch`. The base does the
rest, once for all methods:

* ``loss = w_ce * L_CE + sum_i w_i * L_i`` where every ``L`` is a sum over real tokens (or the
  method's documented unit), so ``loss / sample_size`` is normalised exactly like fairseq's CE
  (per target token, or per sentence with ``--sentence-avg``), independent of batch size and
  worker count;
* a term whose paper defines it per *sentence* (a distance between sentence vectors) is listed in
  ``SENTENCE_TERMS`` and returned as a sum over sentences; the base multiplies it by
  ``sample_size / nsentences`` so that after fairseq's division by ``sample_size`` it is the mean
  over sentences, the paper's unit, and its weight means the paper's weight at any sentence length
  (without this, dividing a per-sentence sum by target tokens would shrink it by the mean sentence
  length). With several workers each worker's sentence mean enters with its share of the tokens;
* the teacher runs only when some distillation term has a non-zero weight, without autograd, on
  the student's device and dtype; features are captured only when requested;
* every term is logged unweighted as ``<name>_loss`` next to fairseq's ``loss`` (the weighted
  total), ``ce_loss`` (the label-smoothed CE) and ``nll_loss``, all in base 2 like fairseq's, so
  the total equals the weighted sum of the logged terms;
* every weight that follows a schedule (``SCHEDULED_WEIGHT_KEYS``: A2D's ``a2d_lambda``) is logged
  as a scalar next to the terms, its value at each update, so that a log (JSON, TensorBoard) shows
  the schedule the run trained with;
* ``begin_epoch`` is forwarded from the task for epoch-dependent weights and schedules.

Weights, one convention for every criterion (``loss_weights()`` returns them; the base refuses a
negative one, naming its flag, when the criterion is built and at every step):

* ``--kd-weight`` is always the weight of the word-level KD term ``L_KD`` (Hinton et al. 2015,
  arXiv:1503.02531), logged as ``word_kd_loss`` (``selective_kd_loss`` for selective KD, the same
  term on the selected tokens). Its default is the paper's. Where a paper names that weight, its
  name is an alias that both ``fairseq-train`` and hydra accept and that, when given, replaces
  ``--kd-weight``: ``--a2d-mu`` (Align-to-Distill's mu, Eq. 12), ``--minilm-kd-weight``,
  ``--tinybert-pred-weight`` (TinyBERT's prediction loss, Eq. 10).
* The CE weight is never a second free weight of the same objective: it follows from how the
  paper writes its objective. Convex papers: ``1 - kd`` (word_kd, selective_kd: ``(1 - a) CE + a
  KD``), ``1 - kd - layer`` (ckd, alp_kd, pkd, rail_kd: ``beta = 1 - eta - lambda``). Additive
  papers: ``1`` (a2d_kd, minilm, tinybert: ``CE + mu KD + ...``; A2D's authors' mode ``1 -
  alpha``). Internal KD: ``--hard-label-weight`` (the paper's switch for hard labels, 0 by default).
* ``--layer-weight`` is the weight of a hidden-state method's layer term(s); a method's other
  terms have flags named after the method (``--a2d-lambda``, ``--minilm-att-weight``, ...).
* ``--kd-temperature`` (> 0) is the temperature of ``L_KD`` in every criterion, which is scaled by
  ``tau^2``; it lives in :class:`KDCriterionConfig` with the weight.

Criterions are built as fairseq builds its newer criterions, from ``(cfg, task)``
(``FairseqCriterion.build_criterion`` passes the dataclass config when ``__init__`` takes ``cfg``).
"""

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from fairseq import utils
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics
from torch import Tensor

from ..models.feature_capture import CapturedFeatures, CaptureRequest, FeatureCapture
from .losses import label_smoothed_ce_and_word_kd, label_smoothed_cross_entropy

#: the logging-output key counting the steps whose scheduled weights were logged (each worker's
#: micro-batch adds 1), by which their sum is divided back into the step's value
SCHEDULED_WEIGHT_STEPS = "scheduled_weight_steps"


# --------------------------------------------------------------- option ranges
# Every number of a criterion's config declares its range once, in its dataclass field
# (``ranged`` / ``weight``); :func:`check_numeric_options` checks them all, once: the task calls it
# before building any criterion (fairseq's own included) and the base class when a criterion is
# built. A number without a declared range must only be finite.


@dataclass(frozen=True)
class Range:
    """The values an option takes: ``low`` .. ``high`` (None = unbounded), each end open or not,
    and what the number is (said in the refusal)."""

    low: float
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""

    def text(self) -> str:
        """``>= 0``, ``> 0`` or ``in [0, 1)``: what follows "must be" in a message."""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def __contains__(self, value) -> bool:
        above_low = value > self.low if self.low_open else value >= self.low
        below_high = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above_low and below_high


def ranged(default, low, high=None, *, help: str, meaning: str, low_open=False, high_open=False, **metadata):
    """A config field whose value must lie in a :class:`Range` (checked by the base)."""
    return field(default=default, metadata={"help": help, "range": Range(low, high, low_open, high_open, meaning),
                                            **metadata})


def weight(default, *, help: str, **metadata):
    """A config field holding a loss weight: >= 0, 0 switching its term off."""
    return ranged(default, 0.0, help=help, meaning="a loss weight (0 switches the term off)", **metadata)


@dataclass
class KDCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    label_smoothing: float = ranged(
        0.1, 0.0, 1.0, high_open=True, meaning="the share of probability mass spread over the vocabulary",
        help="epsilon for label smoothing of the CE term (0.1 in all papers implemented)",
    )
    kd_weight: float = weight(
        1.0, help="weight of the word-level KD term in every criterion; the CE weight follows "
        "from the method's objective (see criterions/base.py); 0 switches KD off",
    )
    kd_temperature: float = ranged(
        1.0, 0.0, low_open=True, meaning="a softmax temperature",
        help="softmax temperature tau of teacher and student in word-level KD (> 0; the term is scaled by tau^2)",
    )
    ignore_prefix_size: int = ranged(0, 0, meaning="a number of tokens", help="Ignore first N tokens")


def declared_ranges(config_class) -> Dict[str, Range]:
    """The :class:`Range` of every field of ``config_class`` that declares one."""
    import dataclasses

    return {f.name: f.metadata["range"] for f in dataclasses.fields(config_class) if "range" in f.metadata}


def option_ranges(criterion_name: str = "", config_class=None) -> Dict[str, Range]:
    """The ranges of a criterion's options: those its config declares, over those of
    :class:`KDCriterionConfig` (which also covers the fields it shares with fairseq's own
    label-smoothed CE). Without a criterion, every registered KD config's, the base's first."""
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY

    ranges = declared_ranges(KDCriterionConfig)
    config_class = config_class or CRITERION_DATACLASS_REGISTRY.get(criterion_name)
    if config_class is not None:
        ranges.update(declared_ranges(config_class))
    elif not criterion_name:
        for registered in CRITERION_DATACLASS_REGISTRY.values():
            if isinstance(registered, type) and issubclass(registered, KDCriterionConfig):
                for name, rule in declared_ranges(registered).items():
                    ranges.setdefault(name, rule)
    return ranges


def option_flag(name: str, criterion_name: str = "") -> str:
    """``--name-with-dashes``, saying so when the option is the criterion's paper name for --kd-weight."""
    from fairseq.criterions import CRITERION_REGISTRY

    flag = "--" + name.replace("_", "-")
    if getattr(CRITERION_REGISTRY.get(criterion_name), "KD_WEIGHT_ALIAS", None) == name:
        flag += " (alias of --kd-weight)"
    return flag


def check_numeric_options(cfg, criterion_name: str = "") -> None:
    """Raise ValueError naming the flag if a numeric option of a criterion config is NaN,
    infinite, or outside its declared range (see :func:`option_ranges`). ``None`` (unset optional
    values) passes."""
    import dataclasses

    if dataclasses.is_dataclass(cfg):
        keys, config_class = [f.name for f in dataclasses.fields(cfg)], type(cfg)
    else:
        keys, config_class = list(cfg.keys()), None
    ranges = option_ranges(criterion_name, config_class)
    for name in keys:
        try:
            value = getattr(cfg, name) if config_class else cfg[name]
        except Exception:  # noqa: BLE001 - an unresolvable interpolation is not a number to check
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        flag = option_flag(name, criterion_name)
        where = f" (criterion {criterion_name})" if criterion_name else ""
        rule = ranges.get(name)
        if not math.isfinite(value):
            expected = f" {rule.text()}" if rule else ""
            raise ValueError(f"{flag} must be a finite number{expected}{where}, got {value}")
        if rule is not None and value not in rule:
            raise ValueError(f"{flag} must be {rule.text()} ({rule.meaning}){where}, got {value}")


class _PendingFusedWordKD:
    """Stands for the fused word-KD value while a method forms its terms (the base computes it
    afterwards, see :meth:`KDCriterionBase.distillation_terms`): a method returns it untouched as
    that term; any arithmetic on it, or reading it, says so."""

    def _refuse(self, *_args, **_kwargs):
        raise RuntimeError(
            "word-level KD fused with CE is computed by the criterion base after distillation_terms: "
            "return losses.word_kd_term(batch, ...) untouched as the term; its value is not known yet")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __neg__ = __float__ = __bool__ = item = detach = float = _refuse

    def __repr__(self) -> str:
        return "PENDING_FUSED_WORD_KD"


PENDING_FUSED_WORD_KD = _PendingFusedWordKD()


@dataclass
class DistillationBatch:
    """Everything a method needs for one batch. Hidden/attention features are only present when
    the method requested them."""

    sample: dict
    student_output: tuple
    teacher_output: Optional[tuple]
    student: CapturedFeatures
    teacher: CapturedFeatures
    target_mask: Tensor  # (batch, tgt_len), True at target tokens that count
    #: the cached teacher's top-k (log-probabilities, token ids), (batch, tgt_len, k) each, when the
    #: run reads --teacher-cache instead of running the teacher
    teacher_topk: Optional[Tuple[Tensor, Tensor]] = None
    #: word-level KD at ``target_mask`` and ``fused_temperature``, computed by the base together with
    #: CE (:func:`.losses.label_smoothed_ce_and_word_kd`; its gradient is in the step's loss): what
    #: :func:`.losses.word_kd_term` returns for it. While the method forms its terms this is
    #: :data:`PENDING_FUSED_WORD_KD`, which the method returns untouched as that term; the base runs
    #: the fused pass after the method's terms and puts its value there.
    fused_word_kd: Optional[object] = None
    fused_temperature: float = 1.0
    #: the positions that fused word KD covers when they are not ``target_mask``
    #: (:meth:`KDCriterionBase.fused_kd_mask`: selective KD's chosen tokens)
    fused_kd_mask: Optional[Tensor] = None

    @property
    def student_logits(self) -> Tensor:
        return self.student_output[0]

    @property
    def teacher_logits(self) -> Tensor:
        if self.teacher_output is None:
            raise RuntimeError("no teacher logits: this batch's teacher is the top-k cache (--teacher-cache)")
        return self.teacher_output[0]


class DistillationTerms(dict):
    """What :meth:`KDCriterionBase.distillation_terms` may return instead of a plain dict: the
    terms by name, plus ``logs``, per-step values the base puts into the logging output (keys from
    the criterion's ``LOG_KEYS``) and that fairseq sums over data-parallel workers before the
    criterion's ``reduce_metrics`` sees them."""

    def __init__(self, terms: Dict[str, Tensor], logs: Optional[Dict[str, object]] = None):
        super().__init__(terms)
        self.logs = dict(logs or {})


class EpochSums:
    """Running sums of a training epoch's tensors, with checkpoint state: the one accumulator of
    stateful criterions (ALP-KD's mean layer weights, internal KD's schedule statistics).

    * Adding keeps the sums on the device in float64, without autograd, so it never synchronises a
      training step.
    * Data parallel: every worker sums only its own batches; nothing is reduced across workers
      here. A method that needs the pooled value passes per-step values through
      ``DistillationTerms.logs``, which fairseq gathers from every worker, and adds them in
      :meth:`KDCriterionBase.reduce_worker_logs` (internal KD's schedule does).
      The checkpoint holds the sums of the worker that writes it (rank 0).
    * Dummy batches (a worker out of data trains on one with its loss zeroed): the caller adds
      nothing while ``is_dummy_batch`` is set.
    * Resume: :meth:`begin_epoch` keeps the sums when called again with the epoch they belong to
      (a run resumed in the middle of that epoch) and starts empty otherwise.
    """

    def __init__(self):
        self.epoch: Optional[int] = None
        self.sums: Dict[str, Tensor] = {}

    def begin_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.sums, self.epoch = {}, epoch

    def add(self, name: str, value: Tensor) -> None:
        value = value.detach().to(torch.float64)
        if name in self.sums:
            value = value + self.sums[name].to(value.device)
        self.sums[name] = value

    def state(self) -> dict:
        return {"epoch": self.epoch, "sums": {name: value.cpu() for name, value in self.sums.items()}}

    def load_state(self, state: dict) -> None:
        self.epoch = state.get("epoch")
        self.sums = {name: torch.as_tensor(value, dtype=torch.float64).clone()
                     for name, value in state.get("sums", {}).items()}


class KDCriterionBase(LabelSmoothedCrossEntropyCriterion):
    """Label-smoothed CE plus weighted distillation terms; see the module docstring."""

    #: names of the distillation terms this method adds (each logged as ``<name>_loss``)
    TERM_NAMES: Tuple[str, ...] = ()
    #: the terms among ``TERM_NAMES`` that ``distillation_terms`` returns as sums over sentences
    SENTENCE_TERMS: Tuple[str, ...] = ()
    #: extra per-step values the method returns in ``DistillationTerms.logs`` (0 when absent, so that
    #: every worker's logging output has the same keys, as fairseq's all-reduce needs)
    LOG_KEYS: Tuple[str, ...] = ()
    #: what to capture from the student and from the teacher during the forward pass
    student_request: CaptureRequest = CaptureRequest()
    teacher_request: CaptureRequest = CaptureRequest()
    #: whether the method's terms can come from the cached top-k teacher (--teacher-cache): only
    #: word-level KD terms, which need the teacher's output distribution and nothing else
    SUPPORTS_TEACHER_CACHE: bool = False
    #: the log keys of the weights that follow a schedule (change during training), each logged every
    #: step by :meth:`scheduled_weights`; ``<term>_weight`` is the weight of that term in
    #: :meth:`loss_weights` unless the method overrides :meth:`scheduled_weights`
    SCHEDULED_WEIGHT_KEYS: Tuple[str, ...] = ()
    #: the terms a --teacher-cache can supply: a method whose other terms all have weight 0 from some
    #: epoch on (see :meth:`last_live_teacher_epoch`) reads the cache from then on
    CACHE_SERVED_TERMS: Tuple[str, ...] = ("word_kd",)
    #: the term that is word-level KD from the live teacher's output, which the base computes in CE's
    #: pass over the student's logits (at :meth:`fused_kd_mask`'s positions) when its weight is not 0
    FUSED_WORD_KD_TERM: str = "word_kd"

    #: the config field that names ``--kd-weight`` after the method's paper (see the module
    #: docstring); when set it replaces ``kd_weight``
    KD_WEIGHT_ALIAS: Optional[str] = None
    #: how each weight of ``loss_weights()`` is set, for the refusal of a negative one
    WEIGHT_FLAGS: Dict[str, str] = {"ce": "the CE weight", "word_kd": "--kd-weight"}

    #: methods whose objective is additive, ``L_CE + sum_i w_i L_i + kd_weight L_KD`` (the CE weight
    #: is 1): the config field holding each term's weight, read by :meth:`additive_weights`
    TERM_WEIGHT_FIELDS: Dict[str, str] = {}
    #: whether the student needs the teacher's head count for every attention kind it distils
    #: (methods that compare attention head by head)
    NEEDS_TEACHER_HEADS: bool = False

    #: the README's table of criterions (``python -m fairseq_kd_recipes.methods`` prints it): the
    #: method and its paper, the config fields shown as its main flags (their choices, default and
    #: ``example`` come from the config dataclass), and what the flags alone do not say (markdown)
    PAPER: str = ""
    MAIN_FLAGS: Tuple[str, ...] = ()
    FLAGS_NOTE: str = ""

    def __init__(self, cfg: KDCriterionConfig, task):
        check_numeric_options(cfg, self.criterion_name())  # every declared range, before any work
        super().__init__(task, cfg.sentence_avg, cfg.label_smoothing, cfg.ignore_prefix_size, cfg.report_accuracy)
        self.cfg = cfg
        self.kd_temperature = float(cfg.kd_temperature)
        alias = getattr(cfg, self.KD_WEIGHT_ALIAS) if self.KD_WEIGHT_ALIAS else None
        self.kd_weight = float(cfg.kd_weight if alias is None else alias)
        require_teacher = getattr(task, "require_teacher", None)
        if require_teacher is None:
            raise ValueError(
                f"criterion {self.criterion_name()!r} needs --task translation_kd "
                f"(got --task {getattr(task.cfg, '_name', type(task).__name__)})"
            )
        self.teacher_cache = getattr(task, "teacher_cache", None)
        if self.teacher_cache is None:
            self.teacher = require_teacher(self.criterion_name())
        elif self.SUPPORTS_TEACHER_CACHE:
            self.teacher = None  # the cache replaces the teacher's forward pass
        elif (last_live_epoch := self.last_live_teacher_epoch()) is not None:
            # the live teacher for the epochs that need its features, the cache for the rest
            if getattr(task, "teacher", None) is None:
                raise ValueError(
                    f"criterion {self.criterion_name()!r} runs the teacher until epoch "
                    f"{last_live_epoch} and reads --teacher-cache after it: pass "
                    "--teacher-checkpoint PATH as well (the teacher the cache was made by)"
                )
            self.teacher = require_teacher(self.criterion_name())
        else:
            raise ValueError(
                f"criterion {self.criterion_name()!r} needs the teacher's features or full output, which "
                "--teacher-cache does not hold (it serves word_kd, selective_kd, and a2d_kd after "
                "--a2d-attention-epochs): pass --teacher-checkpoint without --teacher-cache"
            )
        self.epoch = 1
        # True while fairseq trains on a dummy batch (a data-parallel worker out of data, whose
        # loss is zeroed): stateful methods must not learn from it. Set by the task.
        self.is_dummy_batch = False

    @classmethod
    def build_criterion(cls, cfg, task):
        criterion = super().build_criterion(cfg, task)
        criterion.checked_loss_weights()
        return criterion

    @classmethod
    def criterion_name(cls) -> str:
        from fairseq.criterions import CRITERION_REGISTRY

        for name, registered in CRITERION_REGISTRY.items():
            if registered is cls:
                return name
        return cls.__name__

    # ----------------------------------------------------------- method API
    def loss_weights(self) -> Dict[str, float]:
        """Weight of ``"ce"`` and of every name in ``TERM_NAMES`` at the current epoch."""
        raise NotImplementedError

    def additive_weights(self) -> Dict[str, float]:
        """CE weight 1, each ``TERM_WEIGHT_FIELDS`` term at its config value, ``word_kd`` at
        ``kd_weight``."""
        weights = {"ce": 1.0}
        weights.update({term: float(getattr(self.cfg, name)) for term, name in self.TERM_WEIGHT_FIELDS.items()})
        weights["word_kd"] = self.kd_weight
        return weights

    def checked_loss_weights(self) -> Dict[str, float]:
        """:meth:`loss_weights`, refusing a negative weight (its flag named)."""
        weights = self.loss_weights()
        for name, weight in weights.items():
            if weight < 0:
                flag = self.WEIGHT_FLAGS.get(name, f"the weight of {name}_loss")
                if name in self.TERM_WEIGHT_FIELDS:
                    flag = option_flag(self.TERM_WEIGHT_FIELDS[name])
                elif name == "word_kd" and self.KD_WEIGHT_ALIAS and getattr(self.cfg, self.KD_WEIGHT_ALIAS) is not None:
                    flag = option_flag(self.KD_WEIGHT_ALIAS, self.criterion_name())
                raise ValueError(f"{flag} must be >= 0, got {weight} (criterion {self.criterion_name()})")
        return weights

    def scheduled_weights(self, weights: Dict[str, float]) -> Dict[str, float]:
        """The value of each ``SCHEDULED_WEIGHT_KEYS`` weight in a step whose loss weights are
        ``weights``: by default ``<term>_weight`` is ``weights[term]``; a method whose schedule is one
        number that several terms share (A2D's lambda_e) returns that number under its own key."""
        return {key: float(weights[key[: -len("_weight")]]) for key in self.SCHEDULED_WEIGHT_KEYS}

    def last_live_teacher_epoch(self) -> Optional[int]:
        """For a method with terms the cache cannot serve: the last epoch in which any of them has a
        non-zero weight, after which ``--teacher-cache`` can replace the teacher; None (the default)
        when there is no such epoch. Called from the base's ``__init__``, so it may read only
        ``self.cfg``."""
        return None

    def capture_requests(self, weights: Dict[str, float]) -> Tuple[CaptureRequest, CaptureRequest]:
        """What to capture from the student and from the teacher in a step with these loss weights:
        ``student_request`` and ``teacher_request`` unless the method narrows them to the terms whose
        weight is not 0."""
        return self.student_request, self.teacher_request

    def distillation_terms(self, batch: DistillationBatch) -> Dict[str, Tensor]:
        """Each active term as an unnormalised sum (see the module docstring); a
        :class:`DistillationTerms` when the method also logs values of its own (``LOG_KEYS``).

        Word-level KD from the live teacher is computed by the base in CE's pass, after this
        method returns: its term is what :func:`.losses.word_kd_term` gives here
        (:data:`PENDING_FUSED_WORD_KD`), returned untouched; the base puts the value in its place."""
        raise NotImplementedError

    def begin_epoch(self, epoch: int) -> None:
        """Called by the task at the start of every epoch (also after a resume, with its epoch)."""
        self.epoch = epoch

    def reduce_worker_logs(self, logging_outputs) -> None:
        """Called by the task on every worker after each step (training and validation) with all
        workers' logging outputs, already gathered by fairseq: the place for a method that pools a
        statistic across workers into its own state (internal KD's schedule). Nothing by default."""

    def checkpoint_state(self) -> dict:
        """Non-parameter state to keep across a resume (tensors and plain values only).

        Parameters and buffers are saved by the trainer with the criterion's state_dict; this is
        for state that must survive although the criterion has no parameters.
        """
        return {}

    def load_checkpoint_state(self, state: dict) -> None:
        """Restore what :meth:`checkpoint_state` returned."""

    # ------------------------------------------------------------- forward
    def forward(self, model, sample, reduce=True):
        if not reduce:
            raise ValueError("distillation criterions only compute reduced losses")
        weights = self.checked_loss_weights()
        active_terms = {name for name in self.TERM_NAMES if weights[name] != 0}
        distilling = bool(active_terms)
        # The cache holds the training split only: validation reports CE and nll without KD terms.
        if self.teacher_cache is not None and not model.training:
            distilling = False
        from_cache = self.teacher_cache is not None and (
            self.SUPPORTS_TEACHER_CACHE or active_terms <= set(self.CACHE_SERVED_TERMS))
        if distilling and not from_cache and self.teacher is None:
            raise RuntimeError(
                f"{self.criterion_name()}: terms {sorted(active_terms)} at epoch {self.epoch} need the live "
                "teacher, but only --teacher-cache was loaded (last_live_teacher_epoch disagrees with loss_weights)"
            )
        student_request, teacher_request = self.capture_requests(weights) if distilling else (CaptureRequest(),) * 2
        with FeatureCapture(model, student_request) as capture:
            net_output = model(**sample["net_input"])
        target_mask = self.target_mask(sample)
        teacher_output, teacher_features, teacher_topk = None, CapturedFeatures(), None
        if distilling:
            if from_cache:
                teacher_topk = self.teacher_cache.lookup(sample["id"], sample["target"].ne(self.padding_idx))
            else:
                self.teacher.follow(next(model.parameters()))
                teacher_output, teacher_features = self.teacher.forward(sample["net_input"], teacher_request)
        # Word-level KD from the live teacher shares CE's pass over the student's logits (one
        # log-softmax, one vocabulary-sized gradient buffer): its weighted sum with CE carries both
        # gradients, and the criterion's word_kd term is that pass's value.
        fused_term = self.FUSED_WORD_KD_TERM
        fused = (teacher_output is not None and weights.get(fused_term, 0) != 0
                 and fused_term not in self.SENTENCE_TERMS and not teacher_output[0].requires_grad
                 and self.plain_logits(model))
        fused_word_kd = combined = kd_mask = None
        if fused:
            kd_mask = self.fused_kd_mask(net_output[0], sample, target_mask)
            fused_word_kd = PENDING_FUSED_WORD_KD

        terms: Dict[str, Tensor] = {}
        extra_logs: Dict[str, object] = {}
        if distilling:
            batch = DistillationBatch(
                sample=sample,
                student_output=net_output,
                teacher_output=teacher_output,
                student=capture.features(),
                teacher=teacher_features,
                target_mask=target_mask,
                teacher_topk=teacher_topk,
                fused_word_kd=fused_word_kd,
                fused_temperature=self.kd_temperature,
                fused_kd_mask=kd_mask,
            )
            terms = self.distillation_terms(batch)
            extra_logs = getattr(terms, "logs", {})
            if fused and terms.get(fused_term) is not fused_word_kd:
                raise RuntimeError(
                    f"{self.criterion_name()}: its {fused_term} term must come from losses.word_kd_term(batch, "
                    "batch.fused_kd_mask or batch.target_mask, self.kd_temperature), which returns the value "
                    "computed with CE")
            # The method's own terms are formed and keep what their backward passes need: the
            # teacher's hidden states and attention maps (its captured stacks, and the per-layer
            # decoder states its output carries in ``inner_states``; the student's captured copies
            # too) go before CE's pass below allocates its (positions, vocabulary) gradient buffer,
            # so the two never count together in the step's peak memory. The pass needs the
            # teacher's logits only.
            del batch
            teacher_features = capture = None
            if teacher_output is not None:
                teacher_output = (teacher_output[0],)
        if fused:
            combined, ce_loss, nll_loss, fused_word_kd = label_smoothed_ce_and_word_kd(
                net_output[0], teacher_output[0], sample["target"], target_mask, self.eps, self.kd_temperature,
                weights["ce"], weights[fused_term], kd_mask=kd_mask)
            terms[fused_term] = fused_word_kd
        elif distilling:
            ce_loss, nll_loss = self.cross_entropy(model, net_output, sample, target_mask)
        else:  # no term active: exactly fairseq's criterion (its reduction order too)
            ce_loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=True)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        nsentences = sample["target"].size(0)
        for name in self.SENTENCE_TERMS:
            if name in terms and nsentences > 0:
                terms[name] = terms[name] * (sample_size / nsentences)
        loss = combined if fused else weights["ce"] * ce_loss
        for name in self.TERM_NAMES:
            if name in terms and weights[name] != 0 and not (fused and name == fused_term):
                loss = loss + weights[name] * terms[name]
        if model.training and torch.is_grad_enabled():
            # The criterion's own parameters (projections, A2D's alignment) join the graph even in a
            # step whose terms leave them out (a term's weight at 0, word KD from the cache): fairseq
            # wraps a criterion with parameters in DistributedDataParallel, which expects a gradient
            # for every parameter in every step. Zero gradients change nothing else; one element of
            # each (in float32) is enough to put the whole tensor in the graph, and cannot overflow.
            trainable = [p for p in self.parameters() if p.requires_grad]
            if trainable:
                loss = loss + 0.0 * sum(p.reshape(-1)[0].float() for p in trainable)

        logging_output = {
            "loss": loss.data,
            "ce_loss": ce_loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        for name in self.TERM_NAMES:
            value = terms.get(name)
            logging_output[f"{name}_loss"] = value.data if value is not None else 0.0
        for key in self.LOG_KEYS:
            logging_output[key] = extra_logs.get(key, 0)
        if self.SCHEDULED_WEIGHT_KEYS:
            logging_output.update(self.scheduled_weights(weights))
            logging_output[SCHEDULED_WEIGHT_STEPS] = 1
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = utils.item(n_correct.data)
            logging_output["total"] = utils.item(total.data)
        return loss, sample_size, logging_output

    def cross_entropy(self, model, net_output, sample, target_mask: Tensor) -> Tuple[Tensor, Tensor]:
        """fairseq's label-smoothed CE and nll (``compute_loss``, reduced), computed in chunks of
        positions (:func:`.losses.label_smoothed_cross_entropy`: the same values, without the
        full-vocabulary copies fairseq's path holds). A decoder whose output is not plain logits
        (adaptive softmax) goes through fairseq's own ``compute_loss``. ``target_mask``: the step's
        :meth:`target_mask`."""
        if not self.plain_logits(model):
            return self.compute_loss(model, net_output, sample, reduce=True)
        return label_smoothed_cross_entropy(net_output[0], sample["target"], target_mask, self.eps)

    @staticmethod
    def plain_logits(model) -> bool:
        """Whether the model's first output is the logits its log-probabilities are the log-softmax
        of (not an adaptive softmax's head)."""
        return getattr(getattr(model, "decoder", None), "adaptive_softmax", None) is None

    def fused_kd_mask(self, student_logits: Tensor, sample, target_mask: Tensor) -> Tensor:
        """The positions of the fused word-KD term (:data:`FUSED_WORD_KD_TERM`), called once per
        forward pass before it is computed: ``target_mask`` itself by default (the same object).
        A method whose KD covers fewer positions returns them (a subset of ``target_mask``) and
        reads them back from ``batch.fused_kd_mask``."""
        return target_mask

    def target_mask(self, sample) -> Tensor:
        """True at target tokens that count: not padding and not in the ignored prefix."""
        mask = sample["target"].ne(self.padding_idx)
        if self.ignore_prefix_size > 0:
            mask[:, : self.ignore_prefix_size] = False
        return mask

    # ------------------------------------------------------------- logging
    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        cls.reduce_scheduled_weights(logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        if sample_size == 0:
            return
        for name in ("ce",) + tuple(cls.TERM_NAMES):
            key = f"{name}_loss"
            value = sum(log.get(key, 0) for log in logging_outputs)
            metrics.log_scalar(key, value / sample_size / math.log(2), sample_size, round=3)

    @classmethod
    def reduce_scheduled_weights(cls, logging_outputs) -> None:
        """Each scheduled weight as the step's value: every worker's micro-batch logged the same
        number, and fairseq sums logging outputs (as it sums the losses), so the sum is divided by
        the count. Over a ``--log-interval`` of several updates fairseq averages it as any scalar."""
        steps = sum(log.get(SCHEDULED_WEIGHT_STEPS, 0) for log in logging_outputs)
        if not cls.SCHEDULED_WEIGHT_KEYS or not steps:
            return
        for key in cls.SCHEDULED_WEIGHT_KEYS:
            metrics.log_scalar(key, sum(log.get(key, 0) for log in logging_outputs) / steps)
