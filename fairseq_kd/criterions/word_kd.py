"""Word-level knowledge distillation (Hinton et al. 2015, arXiv:1503.02531; Kim & Rush 2016, Sec. 3.1).

    loss = (1 - a) L_CE + a L_KD,   L_KD = tau^2 sum_t KL(p_T^tau || p_S^tau)

over real target positions; the base computes ``L_KD``. The CKD paper uses a = 0.1; the
Align-to-Distill code uses 0.5, our default.
"""
from dataclasses import dataclass

from fairseq.criterions import register_criterion

from .base import KDCriterionBase
from .config import KDCriterionConfig, ranged


@dataclass
class WordKDConfig(KDCriterionConfig):
    kd_weight: float = ranged(
        0.5, 0.0, 1.0, meaning="a in (1-a) CE + a KD",
        help="a in (1-a)*CE + a*KD; 0 reduces to label_smoothed_cross_entropy (CKD paper 0.1, Align-to-Distill 0.5)",
    )


@register_criterion("word_kd", dataclass=WordKDConfig)
class WordKDCriterion(KDCriterionBase):
    TERM_NAMES = ("word_kd",)
    WEIGHT_FLAGS = {"ce": "1 - --kd-weight", "word_kd": "--kd-weight"}

    def loss_weights(self):
        return {"ce": 1.0 - self.kd_weight, "word_kd": self.kd_weight}
