"""The distillation methods a recipe can train, defined once for every language pair.

A :class:`Method` names the student it trains (a *role*, which each pair maps to an architecture
in :mod:`fairseq_kd_recipes.pairs`), the registered fairseq criterion with the flags that select
the paper's variant, and the training data (the original corpus, or the teacher's beam outputs for
sequence-level KD). Weights not written here are the criterions' own defaults, which are the
papers' values (see each criterion's config dataclass); a pair adds flags only where its paper
differs (e.g. A2D's lambda = 0.1 on WMT'14).

Student roles (the papers' setups):

* ``student``: the pair's main student (3+3 layers in the low-resource setup, 4+4 on WMT'14);
* ``student_4h`` / ``student_8h``: the main student with 4 or 8 attention heads (A2D Table 1);
* ``student_2l``: the 2+2-layer student of the CKD comparison (A2D Table 1, lower block).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

STUDENT_ROLES = ("student", "student_4h", "student_8h", "student_2l")
DATA_KINDS = ("original", "seqkd")
#: figures a method's training checkpoint can be drawn as (``fairseq-kd-plot`` sub-commands)
FIGURES = ("alignment", "alp")


@dataclass(frozen=True)
class Method:
    """One student system of a recipe."""

    name: str
    description: str
    student: str
    criterion: str
    criterion_args: tuple[str, ...] = ()
    data: str = "original"
    #: pass ``--teacher-checkpoint`` (False for methods that never query the teacher while training)
    uses_teacher: bool = True
    #: figure drawn from the training checkpoint besides the loss curves
    figure: str | None = None
    #: read the teacher's top-k log-probabilities from a cache built once (fairseq-kd-teacher-cache)
    #: instead of running the teacher at every step (word-level KD terms only)
    teacher_cache: bool = False

    def __post_init__(self) -> None:
        if self.student not in STUDENT_ROLES:
            raise ValueError(f"method {self.name}: unknown student role {self.student!r}")
        if self.data not in DATA_KINDS:
            raise ValueError(f"method {self.name}: unknown data kind {self.data!r}")
        if self.figure is not None and self.figure not in FIGURES:
            raise ValueError(f"method {self.name}: unknown figure {self.figure!r}")


def _ckd(strategy: str, label: str) -> Method:
    return Method(
        f"ckd_{strategy}", f"Combinatorial KD, {label} mapping (Wu et al. 2020), 2-layer student",
        "student_2l", "ckd", ("--ckd-mapping", strategy),
    )


_METHOD_LIST = (
    Method("no_kd", "student trained on the references only (label-smoothed CE)", "student",
           "label_smoothed_cross_entropy", uses_teacher=False),
    Method("word_kd", "word-level KD (Hinton et al. 2015), (1-a) CE + a KL; a = 0.5 as A2D's code "
           "(0.1 on the CKD paper's pairs)",
           "student", "word_kd", ("--kd-weight", "0.5")),
    Method("word_kd_cached", "word-level KD as word_kd, the teacher read from its top-8 cache "
           "(fairseq-kd-teacher-cache) instead of run at every step", "student", "word_kd", ("--kd-weight", "0.5"),
           teacher_cache=True),
    Method("seq_kd", "sequence-level KD (Kim & Rush 2016): CE on the teacher's beam-5 outputs",
           "student", "label_smoothed_cross_entropy", data="seqkd", uses_teacher=False),
    Method("selective_kd", "selective KD (Wang et al. 2021), batch-level, word rate 0.5 (A2D Sec. 5.3)",
           "student", "selective_kd", ("--word-rate", "0.5", "--selection", "batch")),
    Method("pkd", "Patient KD, PKD-skip (Sun et al. 2019) on the encoder, intermediate layers", "student", "pkd",
           ("--pkd-mapping", "skip")),
    _ckd("rc", "regular (RC)"),
    _ckd("oc", "overlap (OC)"),
    _ckd("sc", "skip (SC)"),
    _ckd("cc", "cross (CC)"),
    Method("alp_kd", "ALP-KD (Passban et al. 2021), attention over all teacher layers", "student",
           "alp_kd", ("--alp-buckets", "all"), figure="alp"),
    Method("rail_kd", "RAIL-KD (Haidar et al. 2022), layer-wise variant, u = 128", "student", "rail_kd",
           ("--rail-variant", "layerwise")),
    # The internal phase without CE on the references, as the paper's Exp3.5 (soft labels kept
    # throughout), chosen on validation nll of the Multi30k benchmark: 3.575 after 6 epochs against
    # 3.683 with CE kept through the phase (internal_kd_ce) and 3.786 without KD.
    Method("internal_kd", "internal-representation KD (Aguilar et al. 2020), stacked schedule (SID), "
           "soft labels kept during the internal phase (the paper's Exp3.5)",
           "student", "internal_kd", ("--internal-schedule", "sid", "--internal-soft-labels-throughout")),
    Method("internal_kd_ce", "internal-representation KD, stacked schedule (SID), CE on the references kept "
           "during the internal phase (the paper's Exp3.6 hard labels)",
           "student", "internal_kd", ("--internal-schedule", "sid", "--hard-label-weight", "1.0")),
    Method("tinybert", "TinyBERT (Jiao et al. 2020) as A2D adapts it: attention, hidden, embedding, KD",
           "student", "tinybert"),
    Method("minilm", "MiniLM (Wang et al. 2020): last-layer attention and value relations, plus CE and KD",
           "student", "minilm"),
    Method("a2d_kd_4h", "Align-to-Distill (Jin et al. 2024), head-wise AAM, 4-head student, the criterion's "
           "defaults (mixture normalisation, KL averaged over the teacher's maps)", "student_4h",
           "a2d_kd", ("--a2d-granularity", "head", "--a2d-attention-kinds", "all"), figure="alignment"),
    Method("a2d_kd_row", "Align-to-Distill, signed AAM (Eq. 9), row-wise log-softmax of both maps",
           "student_4h", "a2d_kd", ("--a2d-normalization", "row")),
    Method("a2d_kd_flat", "Align-to-Distill, signed AAM, log-softmax over each whole masked map",
           "student_4h", "a2d_kd", ("--a2d-normalization", "flat")),
    Method("a2d_kd_authors", "Align-to-Distill as the authors' public code computes it (unmasked flat maps, "
           "summed KL, 0.5 CE + 0.5 KD)", "student_4h", "a2d_kd", ("--a2d-normalization", "authors")),
    # The map reduction spelt out on both sides, so these two rows keep their meaning whichever one
    # is the criterion's default.
    Method("a2d_kd_map_sum", "Align-to-Distill, mixture normalisation, each kind's KL summed over the "
           "teacher's maps (Eq. 10 as written)", "student_4h", "a2d_kd",
           ("--a2d-map-reduction", "sum"), figure="alignment"),
    Method("a2d_kd_map_mean", "Align-to-Distill, mixture normalisation, each kind's KL averaged over the "
           "teacher's maps instead of summed (lambda weighs one map)", "student_4h", "a2d_kd",
           ("--a2d-map-reduction", "mean"), figure="alignment"),
    Method("a2d_kd_fast_decay", "Align-to-Distill, mixture normalisation, lambda decayed x0.5 per epoch: "
           "a 40-epoch x0.9 decay compressed into 6 epochs", "student_4h", "a2d_kd",
           ("--a2d-lambda-decay", "0.5")),
    Method("a2d_kd_8h", "Align-to-Distill, head-wise AAM, 8-head student", "student_8h",
           "a2d_kd", ("--a2d-granularity", "head", "--a2d-attention-kinds", "all"), figure="alignment"),
    Method("no_kd_2l", "2-layer student trained on the references only (baseline of the CKD block)",
           "student_2l", "label_smoothed_cross_entropy", uses_teacher=False),
    Method("a2d_kd_2l", "Align-to-Distill, head-wise AAM, 2-layer student (A2D Table 1, CKD block)",
           "student_2l", "a2d_kd", ("--a2d-granularity", "head", "--a2d-attention-kinds", "all"),
           figure="alignment"),
)

#: every method by name, in the order recipes train them and reports list them
METHODS: Mapping[str, Method] = {method.name: method for method in _METHOD_LIST}
if len(METHODS) != len(_METHOD_LIST):
    raise RuntimeError("duplicate method names in fairseq_kd_recipes.methods")

#: the system every student is compared with in the report
BASELINE = "no_kd"
#: the system name of the teacher in every output
TEACHER = "teacher"
