"""The base of every distillation criterion: label-smoothed CE plus named, weighted terms.

    loss = w_ce L_CE + w_kd L_KD + sum_i w_i L_i

What a method gives it is :class:`~.method.DistillationMethod` (:mod:`.method`). The base resolves
the step's teacher signal once (live outputs and features, the cached top-k of ``--teacher-cache``,
or none), captures what the method asked for, computes word-level KD ``L_KD`` (Hinton et al. 2015,
the term ``KD_TERM``) at :meth:`~.method.DistillationMethod.kd_positions` (from the live teacher in
CE's pass over the student's logits), divides every term by fairseq's ``sample_size`` as CE is
(``SENTENCE_TERMS``: made a mean over sentences) and logs each unweighted as ``<name>_loss``.
``--kd-divergence`` replaces word-level KD's KL (``docs/methods/divergences.md``);
``--on-policy-rate`` trains a share of the batches on the student's own outputs (:mod:`.on_policy`).
The protocol in full: ``docs/methods/README.md``.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from fairseq import utils
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.logging import metrics
from torch import Tensor

from ..errors import InputError
from ..models.feature_capture import CapturedFeatures, CaptureRequest, FeatureCapture
from .config import KDCriterionConfig, check_numeric_options, option_flag, option_ranges  # noqa: F401 - used here, or from here
from .method import DistillationBatch, DistillationMethod
from .on_policy import OnPolicy, reduce_on_policy
from .chunked import (Divergence, label_smoothed_ce_and_word_kd, label_smoothed_cross_entropy, topk_word_level_kd,
                      word_level_divergence, word_level_kd)

#: the logging-output key counting the steps whose scheduled weights were logged (each worker's
#: micro-batch adds 1), by which their sum is divided back into the step's value
SCHEDULED_WEIGHT_STEPS = "scheduled_weight_steps"


@dataclass
class TeacherSignal:
    """What the teacher gives one step, resolved once per step (:meth:`KDCriterionBase.teacher_signal`):
    the live teacher's output and captured features, or the cached top-k (log-probabilities, token
    ids; ``(batch, tgt_len, k)`` each)."""

    output: Optional[tuple] = None
    features: CapturedFeatures = field(default_factory=CapturedFeatures)
    topk: Optional[Tuple[Tensor, Tensor]] = None


class KDCriterionBase(DistillationMethod, LabelSmoothedCrossEntropyCriterion):
    """Label-smoothed CE plus weighted distillation terms; see the module docstring."""

    def __init__(self, cfg: KDCriterionConfig, task):
        check_numeric_options(cfg, self.criterion_name())  # every declared range, before any work
        super().__init__(task, cfg.sentence_avg, cfg.label_smoothing, cfg.ignore_prefix_size, cfg.report_accuracy)
        self.cfg = cfg
        self.kd_temperature = float(cfg.kd_temperature)
        alias = getattr(cfg, self.kd_weight_alias()) if self.kd_weight_alias() else None
        self.kd_weight = float(cfg.kd_weight if alias is None else alias)
        divergence = str(getattr(cfg, "kd_divergence", "forward_kl"))
        # None: the forward KL, through its own functions (the numbers of every earlier run)
        self.divergence = None if divergence == "forward_kl" else Divergence(
            divergence, float(getattr(cfg, "kd_jsd_beta", 0.5)), float(getattr(cfg, "kd_skew_alpha", 0.1)))
        self.student_request = self.teacher_request = CaptureRequest()
        require_teacher = getattr(task, "require_teacher", None)
        if require_teacher is None:
            raise InputError(
                f"criterion {self.criterion_name()!r} needs --task translation_kd "
                f"(got --task {getattr(task.cfg, '_name', type(task).__name__)})"
            )
        self.teacher_cache = getattr(task, "teacher_cache", None)
        if self.teacher_cache is not None and divergence == "reverse_kl":
            raise InputError(
                "--kd-divergence reverse_kl cannot read --teacher-cache: the cached teacher is 0 outside its "
                "top k, where KL(student || teacher) is infinite; use skew_reverse_kl (bounded) or the live teacher"
            )
        if self.teacher_cache is None:
            self.teacher = require_teacher(self.criterion_name())
        elif self.reads_output_only():
            self.teacher = None  # the cache replaces the teacher's forward pass
        elif (last_live_epoch := self.last_live_teacher_epoch()) is not None:
            # the live teacher for the epochs that need its features, the cache for the rest
            if getattr(task, "teacher", None) is None:
                raise InputError(
                    f"criterion {self.criterion_name()!r} runs the teacher until epoch "
                    f"{last_live_epoch} and reads --teacher-cache after it: pass "
                    "--teacher-checkpoint PATH as well (the teacher the cache was made by)"
                )
            self.teacher = require_teacher(self.criterion_name())
        else:
            raise InputError(
                f"criterion {self.criterion_name()!r} needs the teacher's features or full output, which "
                "--teacher-cache does not hold (it serves word_kd, selective_kd, and a2d_kd after "
                "--a2d-attention-epochs): pass --teacher-checkpoint without --teacher-cache"
            )
        self.on_policy = OnPolicy.from_config(cfg, self)  # None unless --on-policy-rate > 0
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

    @classmethod
    def reads_output_only(cls) -> bool:
        """Whether word-level KD is the method's only term: the teacher's output distribution is all
        it needs, which a top-k cache (--teacher-cache) serves."""
        return tuple(cls.TERM_NAMES) == (cls.KD_TERM,)

    # ------------------------------------------------------------- forward
    def forward(self, model, sample, reduce=True):
        if not reduce:
            raise ValueError("distillation criterions only compute reduced losses")
        weights = self.checked_loss_weights()
        source = self.teacher_source(weights, model.training)
        on_policy = self.on_policy is not None and self.on_policy.chosen(model, sample, source, self.is_dummy_batch)
        if on_policy:  # the student's own outputs replace the target, which is then no reference: no CE
            sample, weights = self.on_policy.generated_sample(model, sample), dict(weights, ce=0.0)
        student_request, teacher_request = self.capture_requests(weights) if source else (CaptureRequest(),) * 2
        with FeatureCapture(model, student_request) as capture:
            net_output = model(**sample["net_input"])
        target_mask = self.target_mask(sample)
        teacher = self.teacher_signal(source, model, sample, teacher_request)
        kd_weight = weights.get(self.KD_TERM, 0) if source else 0
        # Word-level KD from the live teacher shares CE's pass over the student's logits (one
        # log-softmax, one vocabulary-sized gradient buffer), which carries both gradients.
        fused = (kd_weight != 0 and teacher.output is not None and not teacher.output[0].requires_grad
                 and self.plain_logits(model))
        terms, logs, kd_mask = {}, {}, None
        if source:
            batch = DistillationBatch(sample, net_output, teacher.output, capture.features(), teacher.features,
                                      target_mask, teacher.topk)
            terms = self.distillation_terms(batch, word_kd=not fused)
            logs, kd_mask = getattr(terms, "logs", {}), batch.kd_mask
            # The teacher's features go before CE's pass allocates its vocabulary-sized buffer.
            del batch
            capture = teacher.features = None
            teacher.output = teacher.output and (teacher.output[0],)
        if fused:
            loss, ce_loss, nll_loss, terms[self.KD_TERM] = label_smoothed_ce_and_word_kd(
                net_output[0], teacher.output[0], sample["target"], target_mask, self.eps, self.kd_temperature,
                weights["ce"], kd_weight, kd_mask=kd_mask, divergence=self.divergence)
        elif not on_policy:
            ce_loss, nll_loss = self.cross_entropy(model, net_output, sample, target_mask, bool(source))
            loss = weights["ce"] * ce_loss
        if on_policy:  # CE logged as 0; the fused pass's loss is the KD term's alone (CE weight 0)
            ce_loss = nll_loss = torch.zeros((), device=target_mask.device)
            loss = loss if fused else ce_loss
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        nsentences = sample["target"].size(0)
        for name in self.SENTENCE_TERMS:
            if name in terms and nsentences > 0:
                terms[name] = terms[name] * (sample_size / nsentences)
        for name in self.TERM_NAMES:
            if name in terms and weights[name] != 0 and not (fused and name == self.KD_TERM):
                loss = loss + weights[name] * terms[name]
        loss = self.with_own_parameters(loss, model)
        logging_output = self.logging_output(model, net_output, sample, sample_size, loss, ce_loss, nll_loss, terms,
                                             logs, weights)
        if self.on_policy is not None:
            logging_output.update(self.on_policy.logs(sample, on_policy, sample_size))
        return loss, sample_size, logging_output

    def distillation_terms(self, batch: DistillationBatch, word_kd: bool = True) -> Dict[str, Tensor]:
        """Every active term of a batch: the method's (:meth:`~.method.DistillationMethod.terms`) and,
        unless ``word_kd`` is False (the base computes it with CE), word-level KD at
        :meth:`~.method.DistillationMethod.kd_positions`."""
        weights = self.loss_weights()
        if weights.get(self.KD_TERM, 0) != 0 and batch.kd_mask is None:
            batch.kd_mask = self.kd_positions(batch)
        terms = self.terms(batch)
        if word_kd and weights.get(self.KD_TERM, 0) != 0:
            if self.divergence is not None:
                kd = word_level_divergence(batch.student_logits, batch.teacher_output and batch.teacher_output[0],
                                           batch.kd_mask, self.divergence, self.kd_temperature,
                                           teacher_topk=batch.teacher_topk)
            elif batch.teacher_topk is not None:
                kd = topk_word_level_kd(batch.student_logits, *batch.teacher_topk, batch.kd_mask, self.kd_temperature)
            else:
                kd = word_level_kd(batch.student_logits, batch.teacher_logits, batch.kd_mask, self.kd_temperature)
            terms[self.KD_TERM] = kd
        return terms

    def teacher_source(self, weights: Dict[str, float], training: bool) -> Optional[str]:
        """Where this step's teacher signal comes from: ``"cache"``, ``"live"``, or None (no term is
        active, or validation with --teacher-cache, which holds the training split only)."""
        active = {name for name in self.TERM_NAMES if weights[name] != 0}
        if not active or (self.teacher_cache is not None and not training):
            return None
        if self.teacher_cache is not None and active <= {self.KD_TERM}:
            return "cache"
        if self.teacher is None:
            raise RuntimeError(
                f"{self.criterion_name()}: terms {sorted(active)} at epoch {self.epoch} need the live "
                "teacher, but only --teacher-cache was loaded (last_live_teacher_epoch disagrees with loss_weights)"
            )
        return "live"

    def teacher_signal(self, source: Optional[str], model, sample, request: CaptureRequest) -> TeacherSignal:
        """The teacher's part of one step, from ``source`` (:meth:`teacher_source`)."""
        if source == "cache":
            return TeacherSignal(topk=self.teacher_cache.lookup(sample["id"], sample["target"].ne(self.padding_idx)))
        if source == "live":
            self.teacher.follow(next(model.parameters()))
            return TeacherSignal(*self.teacher.forward(sample["net_input"], request))
        return TeacherSignal()

    def with_own_parameters(self, loss: Tensor, model) -> Tensor:
        """``loss`` with every trainable parameter of the criterion in its graph (zero gradients), as
        DistributedDataParallel expects even where its term is off."""
        if model.training and torch.is_grad_enabled():
            trainable = [p for p in self.parameters() if p.requires_grad]
            if trainable:
                loss = loss + 0.0 * sum(p.reshape(-1)[0].float() for p in trainable)
        return loss

    def logging_output(self, model, net_output, sample, sample_size, loss, ce_loss, nll_loss, terms, logs,
                       weights) -> dict:
        """The step's logging output: fairseq's keys, ``ce_loss``, every term and log key (0 when
        absent, so every worker has the same keys), the scheduled weights."""
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
            logging_output[key] = logs.get(key, 0)
        if self.SCHEDULED_WEIGHT_KEYS:
            logging_output.update(self.scheduled_weights(weights))
            logging_output[SCHEDULED_WEIGHT_STEPS] = 1
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = utils.item(n_correct.data)
            logging_output["total"] = utils.item(total.data)
        return logging_output

    def checked_loss_weights(self) -> Dict[str, float]:
        """:meth:`~.method.DistillationMethod.loss_weights`, refusing a negative weight (its flag named)."""
        weights = self.loss_weights()
        term_fields = {term: name for name, term in self.config_fields("term").items()}
        for name, weight in weights.items():
            if weight < 0:
                flag = self.WEIGHT_FLAGS.get(name, f"the weight of {name}_loss")
                alias = self.kd_weight_alias()
                if name in term_fields:
                    flag = option_flag(term_fields[name])
                elif name == "word_kd" and alias and getattr(self.cfg, alias) is not None:
                    flag = option_flag(alias, self.criterion_name())
                raise InputError(f"{flag} must be >= 0, got {weight} (criterion {self.criterion_name()})")
        return weights

    def cross_entropy(self, model, net_output, sample, target_mask: Tensor, distilling: bool = True
                      ) -> Tuple[Tensor, Tensor]:
        """fairseq's label-smoothed CE and nll, reduced: in chunks of positions
        (:func:`.chunked.label_smoothed_cross_entropy`), or fairseq's own ``compute_loss`` without
        distillation and for a decoder whose output is not plain logits (adaptive softmax)."""
        if not distilling or not self.plain_logits(model):
            return self.compute_loss(model, net_output, sample, reduce=True)
        return label_smoothed_cross_entropy(net_output[0], sample["target"], target_mask, self.eps)

    @staticmethod
    def plain_logits(model) -> bool:
        """Whether the model's first output is the logits its log-probabilities are the log-softmax
        of (not an adaptive softmax's head)."""
        return getattr(getattr(model, "decoder", None), "adaptive_softmax", None) is None

    def target_mask(self, sample) -> Tensor:
        """True at target tokens that count: not padding and not in the ignored prefix."""
        mask = sample["target"].ne(self.padding_idx)
        if self.ignore_prefix_size > 0:
            mask[:, : self.ignore_prefix_size] = False
        return mask

    # ------------------------------------------------------------- logging
    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        # with on-policy batches, CE and fairseq's nll are over the reference batches' tokens only
        reference, ce_sample_size = reduce_on_policy(logging_outputs)
        super().reduce_metrics(reference)
        cls.reduce_scheduled_weights(logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        if sample_size == 0:
            return
        for name in ("ce",) + tuple(cls.TERM_NAMES):
            key = f"{name}_loss"
            value = sum(log.get(key, 0) for log in logging_outputs)
            size = ce_sample_size if name == "ce" else sample_size
            metrics.log_scalar(key, value / size / math.log(2), size, round=3)

    @classmethod
    def reduce_scheduled_weights(cls, logging_outputs) -> None:
        """Each scheduled weight as the step's value: every worker's micro-batch logged the same
        number and fairseq sums logging outputs, so the sum is divided by the count."""
        steps = sum(log.get(SCHEDULED_WEIGHT_STEPS, 0) for log in logging_outputs)
        if not cls.SCHEDULED_WEIGHT_KEYS or not steps:
            return
        for key in cls.SCHEDULED_WEIGHT_KEYS:
            metrics.log_scalar(key, sum(log.get(key, 0) for log in logging_outputs) / steps)
