"""The one table of distillation methods: what the recipes train, what the benchmark measures, and
the README's table of criterions and their flags, all derived from here.

Adding a method is one criterion file in ``fairseq_kd/criterions/`` (its config dataclass gives
the flags' choices, defaults and ranges), its test file, one row of :data:`CRITERIA` here (its paper,
main flags, notes, head requirement) and one of :class:`Method` (more for more variants: trained by
the recipes and/or measured by ``fairseq_kd_recipes.benchmark``). The README's table of criterions
and flags is derived from those rows and the registered configs (:func:`criteria`; ``python -m
fairseq_kd_recipes.methods`` prints it).
``tests/test_recipe.py`` checks that the table, the methods and the README agree and that every
listed flag value parses with fairseq-train's parser for its criterion.

A :class:`Method` names the student it trains (a *role*, which each pair maps to an architecture
in :mod:`fairseq_kd_recipes.pairs`), the registered fairseq criterion with the flags that select
the paper's variant, and the training data (the original corpus, or a sequence-level KD corpus of
:data:`SEQKD_DATA`). Weights not written here are the criterions' own defaults, which are the
papers' values (see each criterion's config dataclass); a pair adds flags only where its paper
differs (e.g. A2D's lambda = 0.1 on WMT'14).

Student roles (the papers' setups):

* ``student``: the pair's main student (3+3 layers in the low-resource setup, 4+4 on WMT'14);
* ``student_4h`` / ``student_8h``: the main student with 4 or 8 attention heads (A2D Table 1);
* ``student_2l``: the 2+2-layer student of the CKD comparison (A2D Table 1, lower block).
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Mapping

STUDENT_ROLES = ("student", "student_4h", "student_8h", "student_2l")
#: each sequence-level KD corpus: the fairseq-kd-seqkd flags beside the profile's beam and length
#: limits (with ``--select``, the recipe adds ``--nbest`` = the beam and the pair's ``--remove-bpe``);
#: its folder is ``WORKDIR/data-<kind>``, ``_`` written ``-``. Values: docs/methods/seq_kd.md
SEQKD_DATA: Mapping[str, tuple[str, ...]] = {
    "seqkd": (),
    "seqkd_nbest": ("--select", "chrf", "--filter-keep-share", "0.95"),
    "seqkd_mbr": ("--select", "mbr", "--filter-keep-share", "0.95"),
}
DATA_KINDS = ("original", *SEQKD_DATA)
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
    #: a system the recipes can train (False: a variant only the benchmark measures)
    in_recipes: bool = True
    #: measured by default by the benchmark (step time and memory against plain training)
    benchmarked: bool = False
    #: the epoch whose training step the benchmark times (a later one for a method whose terms
    #: change with the epoch)
    timed_epoch: int = 1

    def __post_init__(self) -> None:
        if self.student not in STUDENT_ROLES:
            raise ValueError(f"method {self.name}: unknown student role {self.student!r}")
        if self.data not in DATA_KINDS:
            raise ValueError(f"method {self.name}: unknown data kind {self.data!r}")
        if self.figure is not None and self.figure not in FIGURES:
            raise ValueError(f"method {self.name}: unknown figure {self.figure!r}")


def _ckd(strategy: str, label: str, benchmarked: bool = False) -> Method:
    return Method(
        f"ckd_{strategy}", f"Combinatorial KD, {label} mapping (Wu et al. 2020), 2-layer student",
        "student_2l", "ckd", ("--ckd-mapping", strategy), benchmarked=benchmarked,
    )


_METHOD_LIST = (
    Method("no_kd", "student trained on the references only (label-smoothed CE)", "student",
           "label_smoothed_cross_entropy", uses_teacher=False),
    Method("word_kd", "word-level KD (Hinton et al. 2015), (1-a) CE + a KL; a = 0.5 as A2D's code "
           "(0.1 on the CKD paper's pairs)",
           "student", "word_kd", ("--kd-weight", "0.5"), benchmarked=True),
    *(Method(f"word_kd_{divergence}", f"word_kd with --kd-divergence {divergence} ({label}) in place of the "
             "forward KL", "student", "word_kd", ("--kd-weight", "0.5", "--kd-divergence", divergence))
      for divergence, label in (("reverse_kl", "KL(q||p)"), ("jsd", "GKD's generalised JSD, beta 0.5"),
                                ("skew_kl", "DistiLLM's skew KL, alpha 0.1"),
                                ("skew_reverse_kl", "DistiLLM's skew reverse KL, alpha 0.1"),
                                ("tvd", "total variation distance"))),
    Method("word_kd_cached", "word-level KD as word_kd, the teacher read from its top-8 cache "
           "(fairseq-kd-teacher-cache) instead of run at every step", "student", "word_kd", ("--kd-weight", "0.5"),
           teacher_cache=True, benchmarked=True),
    Method("tie_kd", "TIE-KD's top-1 term (Zhang et al. 2023): word-level KD plus the hierarchical ranking loss "
           "over the teacher's top 5, a = 0.5", "student", "tie_kd"),
    Method("on_policy_kd", "on-policy word-level KD (GKD, Agarwal et al. 2024): half the batches are the "
           "student's own samples (temperature 1, at most 1.2 x source + 10 tokens), on which it learns the "
           "teacher's distributions without CE; the other half word_kd's (1-a) CE + a KL, a = 0.5",
           "student", "word_kd", ("--kd-weight", "0.5", "--on-policy-rate", "0.5")),
    Method("word_kd_on_policy", "word_kd with every batch the student's own samples (--on-policy-rate 1): an "
           "on-policy step's cost, generation included", "student", "word_kd",
           ("--kd-weight", "0.5", "--on-policy-rate", "1"), in_recipes=False),
    Method("word_kd_on_policy_greedy", "word_kd_on_policy with greedy generation", "student", "word_kd",
           ("--kd-weight", "0.5", "--on-policy-rate", "1", "--on-policy-sampling", "greedy"), in_recipes=False),
    Method("on_policy_kd_jsd", "on_policy_kd with GKD's generalised JSD (beta 0.5) as the divergence of "
           "both kinds of batch", "student", "word_kd",
           ("--kd-weight", "0.5", "--on-policy-rate", "0.5", "--kd-divergence", "jsd")),
    Method("seq_kd", "sequence-level KD (Kim & Rush 2016): CE on the teacher's beam-5 outputs",
           "student", "label_smoothed_cross_entropy", data="seqkd", uses_teacher=False),
    Method("seq_kd_nbest", "sequence-level KD on the teacher's n-best: per source the hypothesis of highest "
           "sentence chrF against the reference, the 5% of pairs of highest teacher cross-entropy removed "
           "(mozilla/translations)", "student", "label_smoothed_cross_entropy", data="seqkd_nbest",
           uses_teacher=False),
    Method("seq_kd_mbr", "sequence-level KD on the teacher's n-best: per source the MBR hypothesis (mean chrF "
           "against the others, Finkelstein et al. 2023), the 5% of highest cross-entropy removed",
           "student", "label_smoothed_cross_entropy", data="seqkd_mbr", uses_teacher=False),
    Method("selective_kd", "selective KD (Wang et al. 2021), batch-level, word rate 0.5 (A2D Sec. 5.3)",
           "student", "selective_kd", ("--word-rate", "0.5", "--selection", "batch"), benchmarked=True),
    # global selection adds the FIFO queue of recent CE values (Wang et al. 2021: 30k tokens)
    Method("selective_kd_global", "selective KD, global-level selection over a queue of 30k recent tokens",
           "student", "selective_kd", ("--word-rate", "0.5", "--selection", "global"), in_recipes=False,
           benchmarked=True),
    Method("pkd", "Patient KD, PKD-skip (Sun et al. 2019) on the encoder, intermediate layers", "student", "pkd",
           ("--pkd-mapping", "skip"), benchmarked=True),
    _ckd("rc", "regular (RC)", benchmarked=True),
    _ckd("oc", "overlap (OC)", benchmarked=True),
    _ckd("sc", "skip (SC)"),
    _ckd("cc", "cross (CC)"),
    Method("ckd_decoder_too", "Combinatorial KD, regular mapping, on the encoder and the decoder", "student", "ckd",
           ("--ckd-mapping", "rc", "--layer-sides", "both"), in_recipes=False, benchmarked=True),
    Method("alp_kd", "ALP-KD (Passban et al. 2021), attention over all teacher layers", "student",
           "alp_kd", ("--alp-buckets", "all"), figure="alp", benchmarked=True),
    Method("alp_kd_no", "ALP-KD, no-overlap buckets of teacher layers", "student", "alp_kd", ("--alp-buckets", "no"),
           in_recipes=False, benchmarked=True),
    Method("rail_kd", "RAIL-KD (Haidar et al. 2022), layer-wise variant, u = 128", "student", "rail_kd",
           ("--rail-variant", "layerwise"), benchmarked=True),
    Method("rail_kd_concat", "RAIL-KD, concatenated variant, u = 128", "student", "rail_kd",
           ("--rail-variant", "concatenated"), in_recipes=False, benchmarked=True),
    # The internal phase without CE on the references, as the paper's Exp3.5 (soft labels kept
    # throughout), chosen on validation nll of the Multi30k benchmark against CE kept through the
    # phase (internal_kd_ce) and no KD: docs/results/README.md, second run.
    Method("internal_kd", "internal-representation KD (Aguilar et al. 2020), stacked schedule (SID), "
           "soft labels kept during the internal phase (the paper's Exp3.5)",
           "student", "internal_kd", ("--internal-schedule", "sid", "--internal-soft-labels-throughout"),
           benchmarked=True),
    Method("internal_kd_ce", "internal-representation KD, stacked schedule (SID), CE on the references kept "
           "during the internal phase (the paper's Exp3.6 hard labels)",
           "student", "internal_kd", ("--internal-schedule", "sid", "--hard-label-weight", "1.0")),
    # every pair at once: the most expensive epochs of internal KD
    Method("internal_kd_all", "internal-representation KD, every layer pair at once", "student", "internal_kd",
           ("--internal-schedule", "all"), in_recipes=False, benchmarked=True),
    Method("tinybert", "TinyBERT (Jiao et al. 2020) as A2D adapts it: attention, hidden, embedding, KD",
           "student", "tinybert", benchmarked=True),
    Method("minilm", "MiniLM (Wang et al. 2020): last-layer attention and value relations, plus CE and KD",
           "student", "minilm", benchmarked=True),
    Method("a2d_kd_4h", "Align-to-Distill (Jin et al. 2024), head-wise AAM, 4-head student, the criterion's "
           "defaults (mixture normalisation, KL averaged over the teacher's maps)", "student_4h",
           "a2d_kd", ("--a2d-granularity", "head", "--a2d-attention-kinds", "all"), figure="alignment"),
    Method("a2d_kd_on_policy", "a2d_kd_4h with half its batches the student's own samples (its attention "
           "terms and word-level KD on them, no CE)", "student_4h", "a2d_kd",
           ("--a2d-granularity", "head", "--a2d-attention-kinds", "all", "--on-policy-rate", "0.5")),
    Method("a2d_kd_seqkd_nbest", "a2d_kd_4h on seq_kd_nbest's distilled corpus (the teacher's chrF-selected, "
           "filtered n-best as targets; its attention and distributions on them)", "student_4h", "a2d_kd",
           ("--a2d-granularity", "head", "--a2d-attention-kinds", "all"), data="seqkd_nbest"),
    Method("a2d_kd", "Align-to-Distill, the criterion's defaults", "student_4h", "a2d_kd", in_recipes=False,
           benchmarked=True),
    Method("a2d_kd_cached", "Align-to-Distill after its attention epochs (--a2d-attention-epochs 1, timed "
           "in epoch 2): word KD read from the teacher's top-8 cache, no teacher run", "student_4h", "a2d_kd",
           ("--a2d-attention-epochs", "1"), teacher_cache=True, in_recipes=False, benchmarked=True,
           timed_epoch=2),
    Method("a2d_kd_layerwise", "Align-to-Distill, layer-wise AAM", "student_4h", "a2d_kd",
           ("--a2d-granularity", "layer"), in_recipes=False, benchmarked=True),
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

#: the system every student of the main shape is compared with in the report
BASELINE = "no_kd"
#: the no-KD system of each other student shape: its students are compared with it, in a table of
#: their own, when the recipe trains it (a 2+2 CKD student against the 3+3 no-KD one would measure
#: the depth, not the distillation)
SHAPE_BASELINES: Mapping[str, str] = {"student_2l": "no_kd_2l"}


def baseline_of(method: "Method") -> str:
    """The no-KD system ``method`` is compared with (itself for a baseline)."""
    return SHAPE_BASELINES.get(method.student, BASELINE)
#: the system name of the teacher in every output
TEACHER = "teacher"


@dataclass(frozen=True)
class CriterionRow:
    """What a registered distillation criterion is, for people: its paper, the config fields shown
    as its main flags (their choices, default and ``example`` come from the config dataclass), what
    the flags alone do not say (markdown), and whether the student needs the teacher's head count
    for every attention kind it distils (methods that compare attention head by head)."""

    paper: str
    main_flags: tuple[str, ...]
    note: str = ""
    needs_teacher_heads: bool = False


#: one row per registered distillation criterion (``tests/test_recipe.py`` checks that every
#: registered one has its row), in no particular order: :func:`criteria` orders them
CRITERIA: Mapping[str, CriterionRow] = {
    "word_kd": CriterionRow("word-level KD (Hinton et al. 2015)", ("kd_weight", "kd_temperature", "kd_divergence"),
                            "(`--kd-divergence` and its `--kd-jsd-beta`/`--kd-skew-alpha` in every criterion's "
                            "word-level KD, see `docs/methods/divergences.md`)"),
    "tie_kd": CriterionRow("TIE-KD's top-1 term (Zhang et al. 2023)", ("kd_weight", "tie_topk", "tie_rank_weight"),
                           "(the hierarchical ranking loss beside word-level KD; not the paper's iterative KD)"),
    "selective_kd": CriterionRow("selective KD (Wang et al. 2021)", ("word_rate", "selection", "queue_size")),
    "pkd": CriterionRow("Patient KD (Sun et al. 2019)", ("pkd_mapping", "layer_sides", "pkd_include_top_layer"),
                        "(default: intermediate layers only, as the paper)"),
    "ckd": CriterionRow("combinatorial KD (Wu et al. 2020)", ("ckd_mapping", "ckd_layer_map", "ckd_map_side"),
                        "(default: the student's states mapped to the teacher's; the paper's teacher-side fusion "
                        "admits a collapsed student, see `docs/results/README.md`)"),
    "alp_kd": CriterionRow("ALP-KD (Passban et al. 2021)", ("alp_buckets", "alp_bucket_map")),
    "rail_kd": CriterionRow("RAIL-KD (Haidar et al. 2022)", ("rail_variant", "rail_projection_dim")),
    "internal_kd": CriterionRow(
        "internal-representation KD (Aguilar et al. 2020)",
        ("internal_schedule", "internal_epochs_per_layer", "internal_cos_threshold", "hard_label_weight",
         "internal_soft_labels_throughout"),
        "(a positive `--hard-label-weight` keeps CE on the references, "
        "`--internal-soft-labels-throughout` the soft labels, during the internal phase)"),
    "tinybert": CriterionRow(
        "TinyBERT (Jiao et al. 2020)",
        ("tinybert_att_weight", "tinybert_hidden_weight", "tinybert_emb_weight", "tinybert_pred_weight"),
        needs_teacher_heads=True),
    "minilm": CriterionRow("MiniLM (Wang et al. 2020)",
                           ("minilm_att_weight", "minilm_vr_weight", "minilm_kd_weight", "minilm_attention_kinds"),
                           needs_teacher_heads=True),
    "a2d_kd": CriterionRow("Align-to-Distill (Jin et al. 2024)",
                           ("a2d_preset", "a2d_lambda_decay", "a2d_granularity", "a2d_attention_kinds",
                            "a2d_normalization", "a2d_map_reduction", "a2d_attention_epochs")),
}


def needs_teacher_heads(criterion: str) -> bool:
    """Whether the criterion compares attention head by head (False for one without a row)."""
    row = CRITERIA.get(criterion)
    return bool(row and row.needs_teacher_heads)


@dataclass(frozen=True)
class Criterion:
    """One registered criterion as the README's table of flags shows it: the method's paper and its
    main flags, each a flag with the values it takes (the first is the default where the criterion
    has one; no value: a switch)."""

    name: str
    paper: str
    flags: tuple[tuple[str, ...], ...]
    #: what the flags alone do not say (markdown, after the flags)
    note: str = ""

    def flags_text(self) -> str:
        """``--flag a|b --other 1``: the values of a flag joined by ``|``, each shell-quoted."""
        return " ".join(" ".join([flag, "|".join(map(shlex.quote, values))]) if values else flag
                        for flag, *values in self.flags)


def _shown_values(config_field) -> tuple[str, ...]:
    """What the README lists for one config field: its choices, the default first; its default;
    the ``example`` of its metadata when it has no default; nothing for a switch."""
    import enum

    default = config_field.default
    if config_field.type is bool:
        return ()
    if isinstance(config_field.type, type) and issubclass(config_field.type, enum.Enum):
        choices = [choice.value for choice in config_field.type]
        return (str(default), *(choice for choice in choices if choice != str(default)))
    if default is None:
        return (config_field.metadata["example"],)
    return (f"{default:g}" if isinstance(default, float) else str(default),)


def criteria() -> tuple[Criterion, ...]:
    """Every registered distillation criterion (each a class on ``KDCriterionBase``), in the order
    of the first method that trains it, as its row of :data:`CRITERIA` and its config dataclass
    (choices, defaults, examples) describe it."""
    import dataclasses

    import fairseq_kd.criterions  # noqa: F401 - registers every criterion
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY, CRITERION_REGISTRY
    from fairseq_kd.criterions.base import KDCriterionBase

    registered = [name for name, cls in CRITERION_REGISTRY.items()
                  if isinstance(cls, type) and issubclass(cls, KDCriterionBase)]
    missing = sorted(set(registered) - set(CRITERIA))
    if missing:
        raise RuntimeError(f"criterions without a row in fairseq_kd_recipes.methods.CRITERIA: {', '.join(missing)}")
    first_use = {method.criterion: index for index, method in reversed(list(enumerate(_METHOD_LIST)))}
    rows = []
    for name in sorted(registered, key=lambda name: (first_use.get(name, len(_METHOD_LIST)), name)):
        row = CRITERIA[name]
        fields = {f.name: f for f in dataclasses.fields(CRITERION_DATACLASS_REGISTRY[name])}
        flags = tuple(("--" + flag.replace("_", "-"), *_shown_values(fields[flag])) for flag in row.main_flags)
        rows.append(Criterion(name, row.paper, flags, row.note))
    return tuple(rows)


#: fairseq's own criterion, which the methods without a distillation term train with
PLAIN_CRITERION = "label_smoothed_cross_entropy"
README_TABLE_HEADER = "| criterion | method | main flags |\n|---|---|---|\n"


def readme_flag_table() -> str:
    """The README's table of criterions and their flags (markdown)."""
    rows = []
    for criterion in criteria():
        flags = f"`{criterion.flags_text()}`".replace("|", "\\|")
        note = f" {criterion.note}" if criterion.note else ""
        rows.append(f"| `{criterion.name}` | {criterion.paper} | {flags}{note} |")
    return README_TABLE_HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(readme_flag_table())
