"""Patient knowledge distillation, PKD (Sun et al. 2019), as the CKD paper applies it to NMT.

    L_PKD = sum_positions sum_j || P h_S^j / ||P h_S^j|| - h_T^A(j) / ||h_T^A(j)|| ||^2

(Eq. 3 of PKD as cited by ALP-KD). PKD-skip maps student layer ``j`` to teacher layer ``A(j) =
floor(j n / m)``, PKD-last to ``n - m + j``. As in Sun et al. (Sec. 3.2) only the intermediate
layers ``j = 1 .. m-1`` are matched; ``--pkd-include-top-layer`` adds layer ``m`` (the CKD paper's
adaptation). ``P`` is a learnable ``d_S -> d_T`` map per side (the identity at equal widths).
Deviation: every real position of the distilled stack is matched, not a ``[CLS]`` vector. Total:
``beta L_CE + eta L_KD + lambda L_PKD`` (CKD paper's weights).
"""
from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from torch import nn

from ..modules.layer_mapping import LayerMappingError, last_layers_mapping, uniform_mapping, validate_mapping
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
    pkd_include_top_layer: bool = field(
        default=False,
        metadata={"help": "also match the student's top layer m (with teacher layer n); default: only "
                  "the intermediate layers 1..m-1, as in Sun et al. 2019 (the top layer is left to the "
                  "output-level KD term)"},
    )


@register_criterion("pkd", dataclass=PatientKDConfig)
class PatientKDCriterion(HiddenStateKDCriterion):
    LAYER_TERM = "pkd"
    TERM_NAMES = ("word_kd", "pkd")

    def __init__(self, cfg: PatientKDConfig, task):
        super().__init__(cfg, task)
        pkd_mapping = str(cfg.pkd_mapping)
        self.mappings = {}
        self.projections = nn.ModuleDict()
        for side in self.sides:
            n, m = self.teacher_shape.layers(side), self.student_shape.layers(side)
            flag = f"--pkd-mapping {pkd_mapping} [{side}]"
            mapping = validate_mapping(PKD_MAPPINGS[pkd_mapping](n, m, flag), n, m, flag)
            if not cfg.pkd_include_top_layer:
                if m < 2:
                    raise LayerMappingError(
                        f"{flag}: a {m}-layer student has no intermediate layer to match (Sun et al. match "
                        "layers 1..m-1); pass --pkd-include-top-layer to match its only layer with the "
                        "teacher's top layer"
                    )
                mapping = mapping[:-1]
            self.mappings[side] = mapping
            self.register_layer_index(f"{side}_teacher_layers", [group[0] for group in mapping])
            self.projections[side] = width_projection(
                self.student_shape.embed_dim(side), self.teacher_shape.embed_dim(side)
            )

    def layer_loss(self, side, student_states, teacher_states, padding_mask):
        matched = student_states[1: 1 + len(self.mappings[side])]  # layers 1..m-1 (or 1..m)
        student = in_param_dtype(self.projections[side], matched)  # (matched, B, T, d_T)
        teacher = teacher_states.index_select(0, getattr(self, f"{side}_teacher_layers"))
        distance = normalized_squared_distance(student, teacher)  # (matched, B, T)
        return distance.masked_fill(padding_mask, 0.0).sum()
