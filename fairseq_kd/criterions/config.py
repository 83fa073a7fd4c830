"""The options every distillation criterion shares (:class:`KDCriterionConfig`) and the declared
range of every number of a criterion's config (:func:`ranged`, :func:`weight`), checked once by
:func:`check_numeric_options`: by the task before it builds any criterion (fairseq's own
included), and by the base when a criterion is built. A number without a declared range must only
be finite.
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, Optional

from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterionConfig
from fairseq.dataclass import ChoiceEnum

from ..errors import InputError
from .chunked import DIVERGENCES


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
    """A config field holding a loss weight: >= 0, 0 switching its term off. Its metadata may say
    which term it weighs in an additive objective (``term="hidden"``, read by
    :meth:`.method.DistillationMethod.additive_weights`), or that it is the paper's name for ``--kd-weight``
    (``kd_weight_alias=True``: when given, it replaces it)."""
    return ranged(default, 0.0, help=help, meaning="a loss weight (0 switches the term off)", **metadata)


DIVERGENCE_CHOICES = ChoiceEnum(list(DIVERGENCES))
#: how the student generates its on-policy targets (:mod:`.on_policy`)
ON_POLICY_SAMPLING_CHOICES = ChoiceEnum(["sample", "greedy"])


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
    kd_divergence: DIVERGENCE_CHOICES = field(
        default="forward_kl",
        metadata={"help": "the divergence D(teacher, student) of word-level KD: forward_kl KL(p||q); reverse_kl "
                  "KL(q||p); jsd the generalised JSD of GKD (--kd-jsd-beta); skew_kl KL(p||a p + (1-a) q) and "
                  "skew_reverse_kl KL(q||a q + (1-a) p) of DistiLLM (--kd-skew-alpha); tvd 1/2 sum|p - q| "
                  "(docs/methods/divergences.md)"},
    )
    kd_jsd_beta: float = ranged(
        0.5, 0.0, 1.0, low_open=True, high_open=True, meaning="the teacher's share of the JSD's mixture",
        help="beta of --kd-divergence jsd: beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q",
    )
    kd_skew_alpha: float = ranged(
        0.1, 0.0, 1.0, low_open=True, high_open=True, meaning="the skew of the mixture",
        help="alpha of --kd-divergence skew_kl and skew_reverse_kl: the first argument's share of the mixture",
    )
    ignore_prefix_size: int = ranged(0, 0, meaning="a number of tokens", help="Ignore first N tokens")
    on_policy_rate: float = ranged(
        0.0, 0.0, 1.0, meaning="the share of training batches the student generates",
        help="lambda of on-policy distillation (GKD): the share of training batches whose targets the "
        "student generates and teacher and student then score, without CE; 0 switches it off "
        "(docs/methods/on_policy.md)",
    )
    on_policy_sampling: ON_POLICY_SAMPLING_CHOICES = field(
        default="sample", metadata={"help": "how the student generates on-policy targets: sample from its "
                                    "tempered distribution, or greedy (its argmax)"},
    )
    on_policy_temperature: float = ranged(
        1.0, 0.0, low_open=True, meaning="a softmax temperature",
        help="temperature of the student's distribution that on-policy targets are sampled from",
    )
    on_policy_max_len_a: float = ranged(
        1.2, 0.0, meaning="a length ratio",
        help="on-policy targets have at most a*src_len + b tokens before EOS (this a)",
    )
    on_policy_max_len_b: int = ranged(
        10, 0, meaning="a number of tokens", help="on-policy targets have at most a*src_len + b tokens before EOS (this b)",
    )


def declared_ranges(config_class) -> Dict[str, Range]:
    """The :class:`Range` of every field of ``config_class`` that declares one."""
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
    if getattr(CRITERION_REGISTRY.get(criterion_name), "kd_weight_alias", lambda: None)() == name:
        flag += " (alias of --kd-weight)"
    return flag


def check_numeric_options(cfg, criterion_name: str = "") -> None:
    """Raise :class:`~fairseq_kd.errors.InputError` naming the flag if a numeric option of a criterion
    config is NaN, infinite, or outside its declared range (:func:`option_ranges`); None passes."""
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
            raise InputError(f"{flag} must be a finite number{expected}{where}, got {value}")
        if rule is not None and value not in rule:
            raise InputError(f"{flag} must be {rule.text()} ({rule.meaning}){where}, got {value}")
