"""Patient knowledge distillation, PKD (Sun et al. 2019), as the CKD paper applies it to NMT.

Student layer ``j`` learns from one teacher layer ``A(j)``: PKD-skip takes every ``n/m``-th
teacher layer (``A(j) = floor(j n / m)``), PKD-last the top ``m`` (``A(j) = n - m + j``). The layer
term is the squared distance between L2-normalised states (Eq. 3 of PKD as cited by ALP-KD),
per position::

    L_PKD = sum_positions sum_j || P h_S^j / ||P h_S^j|| - h_T^A(j) / ||h_T^A(j)|| ||^2

where ``P`` is a learnable linear map ``d_S -> d_T``, one per side and shared by its layers like
TinyBERT's ``W_h`` (the identity when the widths agree). PKD matched the ``[CLS]`` vector of BERT;
for translation every real position of the distilled stack is matched, as in the CKD paper's
NMT adaptation. Total: ``beta L_CE + eta L_KD + lambda L_PKD`` (CKD paper's weights). Unit of
``pkd_loss``: real tokens of the distilled side(s).
"""
from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import nn

from ..modules.layer_mapping import last_layers_mapping, uniform_mapping, validate_mapping
from ..modules.projection import width_projection
from .hidden_state import HiddenStateKDConfig, HiddenStateKDCriterion, in_param_dtype
from .losses import normalized_squared_distance

PKD_MAPPINGS = {"skip": uniform_mapping, "last": last_layers_mapping}
PKD_MAPPING_CHOICES = ChoiceEnum(list(PKD_MAPPINGS))


@dataclass
class PatientKDConfig(HiddenStateKDConfig):
    pkd_mapping: PKD_MAPPING_CHOICES = field(
        default="skip",
        metadata={"help": "PKD-skip (student layer j <- teacher layer floor(j*n/m)) or PKD-last "
                  "(student layer j <- teacher layer n-m+j); both need a teacher at least as deep"},
    )


@register_criterion("pkd", dataclass=PatientKDConfig)
class PatientKDCriterion(HiddenStateKDCriterion):
    LAYER_TERM = "pkd"
    TERM_NAMES = ("word_kd", "pkd")

    def __init__(self, task, sentence_avg, label_smoothing, kd_weight, kd_temperature, layer_weight,
                 layer_sides, pkd_mapping, ignore_prefix_size=0, report_accuracy=False):
        super().__init__(task, sentence_avg, label_smoothing, kd_weight, kd_temperature, layer_weight,
                         layer_sides, ignore_prefix_size, report_accuracy)
        pkd_mapping = str(pkd_mapping)
        if pkd_mapping not in PKD_MAPPINGS:
            raise ValueError(f"--pkd-mapping {pkd_mapping!r}: choose one of {sorted(PKD_MAPPINGS)}")
        self.pkd_mapping = pkd_mapping
        self.mappings = {}
        self.projections = nn.ModuleDict()
        for side in self.sides:
            n, m = self.teacher_shape.layers(side), self.student_shape.layers(side)
            flag = f"--pkd-mapping {pkd_mapping} [{side}]"
            mapping = validate_mapping(PKD_MAPPINGS[pkd_mapping](n, m, flag), n, m, flag)
            self.mappings[side] = mapping
            self.register_layer_index(f"{side}_teacher_layers", [group[0] for group in mapping])
            self.projections[side] = width_projection(
                self.student_shape.embed_dim(side), self.teacher_shape.embed_dim(side)
            )

    def layer_loss(self, side, student_states, teacher_states, padding_mask):
        student = in_param_dtype(self.projections[side], student_states[1:])  # (m, B, T, d_T)
        teacher = teacher_states.index_select(0, getattr(self, f"{side}_teacher_layers"))
        distance = normalized_squared_distance(student, teacher)  # (m, B, T)
        return distance.masked_fill(padding_mask, 0.0).sum()
