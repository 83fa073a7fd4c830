"""Which teacher layers a student layer learns from.

Layers are numbered 1..n (teacher) and 1..m (student), as the papers' ``h^1..h^n``; index 0 (the
embedding output) is never part of a mapping. A mapping is a tuple with one entry per student
layer, each entry a tuple of teacher layers.
"""
import random
from typing import Sequence, Tuple

from ..errors import InputError

LayerMapping = Tuple[Tuple[int, ...], ...]


class LayerMappingError(InputError):
    """A mapping that names layers the models do not have, or is malformed."""


def uniform_mapping(teacher_layers: int, student_layers: int, flag: str = "") -> LayerMapping:
    """Student layer ``j`` <- teacher layer ``floor(j * n / m)`` (PKD-skip, TinyBERT's uniform mapping); ``n >= m``."""
    _check_depths(teacher_layers, student_layers, flag)
    return tuple((j * teacher_layers // student_layers,) for j in range(1, student_layers + 1))


def last_layers_mapping(teacher_layers: int, student_layers: int, flag: str = "") -> LayerMapping:
    """Student layer ``j`` <- teacher layer ``n - m + j`` (PKD-last)."""
    _check_depths(teacher_layers, student_layers, flag)
    return tuple((teacher_layers - student_layers + j,) for j in range(1, student_layers + 1))


def parse_mapping(text: str, flag: str) -> LayerMapping:
    """An explicit mapping such as ``"1,2,3|4,5,6"``: one group of 1-based teacher layers per student
    layer (bottom-up)."""
    groups = []
    for position, group in enumerate(text.split("|"), start=1):
        items = [item.strip() for item in group.split(",") if item.strip()]
        if not items:
            raise LayerMappingError(
                f"{flag} {text!r}: group {position} (student layer {position}) is empty; write one "
                "comma-separated list of teacher layers per student layer, groups separated by '|', "
                "e.g. '1,2,3|4,5,6'")
        try:
            groups.append(tuple(int(item) for item in items))
        except ValueError:
            raise LayerMappingError(f"{flag} {text!r}: group {position} contains a non-integer ({group.strip()!r}); "
                                    "layers are 1-based integers, e.g. '1,2,3|4,5,6'") from None
    return tuple(groups)


def validate_mapping(mapping: Sequence[Sequence[int]], teacher_layers: int, student_layers: int,
                     flag: str) -> LayerMapping:
    mapping = tuple(tuple(group) for group in mapping)
    if len(mapping) != student_layers:
        raise LayerMappingError(
            f"{flag}: the mapping has {len(mapping)} group(s) but the student has {student_layers} "
            f"layer(s); give exactly one group per student layer")
    for student_layer, group in enumerate(mapping, start=1):
        if not group:
            raise LayerMappingError(f"{flag}: student layer {student_layer} maps to no teacher layer")
        bad = [layer for layer in group if not 1 <= layer <= teacher_layers]
        if bad:
            raise LayerMappingError(
                f"{flag}: student layer {student_layer} names teacher layer(s) {bad}; valid teacher "
                f"layers are 1..{teacher_layers}")
        if len(set(group)) != len(group):
            raise LayerMappingError(f"{flag}: student layer {student_layer} repeats a teacher layer: {group}")
    return mapping


def _check_depths(teacher_layers: int, student_layers: int, flag: str = "") -> None:
    prefix = f"{flag}: " if flag else ""
    if student_layers < 1 or teacher_layers < 1:
        raise LayerMappingError(
            f"{prefix}both models need at least one layer (teacher {teacher_layers}, student {student_layers})")
    if student_layers > teacher_layers:
        raise LayerMappingError(
            f"{prefix}this mapping needs a teacher at least as deep as the student (teacher {teacher_layers} "
            f"layers, student {student_layers}); valid student depths are 1..{teacher_layers}")


# ----------------------------------------------------------------------------------------------
# Combinatorial KD (Wu et al. 2020, "Why Skip If You Can Combine", arXiv:2010.03034): each student layer
# i learns from a *set* M(i) of teacher layers. The paper lists its sets only for a 6-layer
# teacher and a 2-layer student (Sec. 4):
#     SC {1,2},{5,6}   CC {1,3},{4,6}   RC {1,2,3},{4,5,6}   OC {1,2,3,4},{3,4,5,6}
# The rules below generalise them to any depths n >= m and reproduce exactly those four.


def regular_combination(teacher_layers: int, student_layers: int, flag: str = "") -> LayerMapping:
    """RC: the teacher's layers cut into ``m`` contiguous groups, group ``i`` = ``(b_{i-1}, b_i]``
    with ``b_i = floor(i*n/m)``; every teacher layer is used exactly once (6-to-2: {1,2,3},{4,5,6})."""
    _check_depths(teacher_layers, student_layers, flag)
    bounds = [j * teacher_layers // student_layers for j in range(student_layers + 1)]
    return tuple(tuple(range(bounds[i - 1] + 1, bounds[i] + 1)) for i in range(1, student_layers + 1))


def overlap_combination(teacher_layers: int, student_layers: int, flag: str = "") -> LayerMapping:
    """OC: each RC group extended by one layer into each neighbouring group (the last layer of the
    group below and the first of the group above), so neighbours share two layers
    (6-to-2: {1,2,3,4},{3,4,5,6}; 12-to-4: {1..4},{3..7},{6..10},{9..12})."""
    groups = regular_combination(teacher_layers, student_layers, flag)
    extended = []
    for i, group in enumerate(groups):
        layers = set(group)
        if i > 0:
            layers.add(groups[i - 1][-1])
        if i + 1 < len(groups):
            layers.add(groups[i + 1][0])
        extended.append(tuple(sorted(layers)))
    return tuple(extended)


def skip_combination(teacher_layers: int, student_layers: int, flag: str = "") -> LayerMapping:
    """SC: windows of ``k`` adjacent layers, one per student layer, spread evenly from the bottom
    to the top of the teacher with at least one skipped layer between windows.

    ``k = max(1, floor((n - (m - 1)) / m))`` (the widest window that leaves ``m - 1`` gaps); window
    ``i`` starts at ``1 + round((i - 1)(n - k)/(m - 1))`` (halves rounded up), so the first starts
    at layer 1 and the last ends at layer ``n``. 6-to-2: {1,2},{5,6}; 12-to-4: {1,2},{4,5},{8,9},
    {11,12}. Where groups would have fewer than two layers (e.g. 6-to-3) the windows shrink to
    single layers, since skipping is what distinguishes SC from RC; with ``m = 1`` SC equals RC.
    """
    _check_depths(teacher_layers, student_layers, flag)
    n, m = teacher_layers, student_layers
    if m == 1:
        return (tuple(range(1, n + 1)),)
    width = max(1, (n - (m - 1)) // m)
    starts = [1 + ((i - 1) * (n - width) * 2 + (m - 1)) // (2 * (m - 1)) for i in range(1, m + 1)]
    return tuple(tuple(range(start, start + width)) for start in starts)


def cross_combination(teacher_layers: int, student_layers: int, flag: str = "") -> LayerMapping:
    """CC: within each RC group, every second layer counting down from the group's top layer
    (6-to-2: {1,3},{4,6}; 12-to-4: {1,3},{4,6},{7,9},{10,12}). Groups of one or two layers keep only
    their top layer, which then coincides with PKD-skip. (Follows the paper's table for the 6-layer
    teacher, not its Figure 2.)"""
    groups = regular_combination(teacher_layers, student_layers, flag)
    return tuple(tuple(sorted(group[::-1][::2])) for group in groups)


CKD_STRATEGIES = {"rc": regular_combination, "oc": overlap_combination, "sc": skip_combination,
                  "cc": cross_combination}


# ----------------------------------------------------------------------------------------------
# ALP-KD buckets (Passban et al. 2021, "ALP-KD", arXiv:2012.14022). The default spans every teacher layer for every
# student layer (Eq. 6). NO ("no overlap") and PO ("partial overlap") are the paper's bucketed
# variants: for 12-to-4 it uses NO {1-4},{5-8},{9-12} and PO {1-5},{5-9},{9-12} ("each bucket
# shares its first layer with the preceding bucket"). The paper leaves the top BERT layer to the
# output-level loss and so makes m-1 buckets; for translation every student layer gets one.


def all_layers_buckets(teacher_layers: int, student_layers: int, flag: str = "") -> LayerMapping:
    """Every student layer attends over all teacher layers 1..n (ALP-KD Eq. 6)."""
    if teacher_layers < 1 or student_layers < 1:
        _check_depths(teacher_layers, student_layers, flag)
    return tuple(tuple(range(1, teacher_layers + 1)) for _ in range(student_layers))


def partial_overlap_buckets(teacher_layers: int, student_layers: int, flag: str = "") -> LayerMapping:
    """PO: each NO bucket plus the first layer of the next bucket (12 into 3: {1-5},{5-9},{9-12})."""
    groups = regular_combination(teacher_layers, student_layers, flag)
    return tuple(tuple(sorted(set(group) | ({groups[i + 1][0]} if i + 1 < len(groups) else set())))
                 for i, group in enumerate(groups))


#: NO is the RC partition (contiguous, disjoint buckets of near-equal size)
ALP_BUCKETS = {"all": all_layers_buckets, "no": regular_combination, "po": partial_overlap_buckets}


def resolve_mapping(strategies: dict, strategy: str, explicit: str, teacher_layers: int,
                    student_layers: int, strategy_flag: str, explicit_flag: str,
                    where: str = "") -> LayerMapping:
    """The mapping ``explicit`` names, else the one of ``strategy`` (a key of ``strategies``), checked
    against the depths; errors name the flag, then ``where`` (e.g. ``" [encoder]"``)."""
    if explicit:
        flag = f"{explicit_flag}{where}"
        return validate_mapping(parse_mapping(explicit, flag), teacher_layers, student_layers, flag)
    flag = f"{strategy_flag} {strategy}{where}"
    if strategy not in strategies:
        raise LayerMappingError(f"{flag}: choose one of {sorted(strategies)}")
    mapping = strategies[strategy](teacher_layers, student_layers, flag)
    return validate_mapping(mapping, teacher_layers, student_layers, flag)


# ----------------------------------------------------------------------------------------------
# RAIL-KD (Haidar et al. 2022, "RAIL-KD", arXiv:2110.08532): the teacher layers are drawn at random every epoch.


def draw_layers(seed: int, epoch: int, num_candidates: int, count: int, stream: str = "") -> Tuple[int, ...]:
    """``count`` distinct layers drawn uniformly from ``1..num_candidates``, sorted ascending: a pure
    function of its arguments (string seeding, unaffected by ``PYTHONHASHSEED``), so every worker
    and every resumed run draws the same; ``stream`` separates independent draws of one run."""
    if not 1 <= count <= num_candidates:
        raise LayerMappingError(
            f"cannot draw {count} distinct layer(s) from {num_candidates} candidate(s); the count must "
            f"be in 1..{num_candidates}")
    rng = random.Random(f"rail-kd|{stream}|seed={seed}|epoch={epoch}")
    return tuple(sorted(rng.sample(range(1, num_candidates + 1), count)))
