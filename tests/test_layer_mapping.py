"""Layer mappings of the hidden-state methods: CKD's RC/OC/SC/CC, ALP-KD's buckets, PKD's skip and
last mappings, explicit mapping strings, and RAIL-KD's per-epoch draw."""
import random

import pytest

from fairseq_kd.modules.layer_mapping import (
    ALP_BUCKETS,
    CKD_STRATEGIES,
    LayerMappingError,
    draw_layers,
    last_layers_mapping,
    resolve_mapping,
    uniform_mapping,
)


# --------------------------------------------------------------------------------------- CKD
def test_ckd_reproduces_the_papers_six_to_two_mappings():
    # Wu et al. 2020, Sec. 4: the exact sets used for Table 1.
    assert CKD_STRATEGIES["sc"](6, 2) == ((1, 2), (5, 6))
    assert CKD_STRATEGIES["cc"](6, 2) == ((1, 3), (4, 6))
    assert CKD_STRATEGIES["rc"](6, 2) == ((1, 2, 3), (4, 5, 6))
    assert CKD_STRATEGIES["oc"](6, 2) == ((1, 2, 3, 4), (3, 4, 5, 6))


def test_ckd_twelve_to_four_and_six_to_three():
    assert CKD_STRATEGIES["rc"](12, 4) == ((1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12))
    assert CKD_STRATEGIES["oc"](12, 4) == ((1, 2, 3, 4), (3, 4, 5, 6, 7), (6, 7, 8, 9, 10), (9, 10, 11, 12))
    assert CKD_STRATEGIES["sc"](12, 4) == ((1, 2), (4, 5), (8, 9), (11, 12))
    assert CKD_STRATEGIES["cc"](12, 4) == ((1, 3), (4, 6), (7, 9), (10, 12))
    assert CKD_STRATEGIES["rc"](6, 3) == ((1, 2), (3, 4), (5, 6))
    assert CKD_STRATEGIES["oc"](6, 3) == ((1, 2, 3), (2, 3, 4, 5), (4, 5, 6))
    assert CKD_STRATEGIES["sc"](6, 3) == ((1,), (4,), (6,))
    # Groups of two keep their top layer only: the PKD-skip layers.
    assert CKD_STRATEGIES["cc"](6, 3) == ((2,), (4,), (6,)) == uniform_mapping(6, 3)


@pytest.mark.parametrize("strategy", sorted(CKD_STRATEGIES))
def test_ckd_rules_hold_for_every_depth(strategy):
    for n in range(1, 17):
        for m in range(1, n + 1):
            mapping = CKD_STRATEGIES[strategy](n, m)
            assert len(mapping) == m
            for group in mapping:
                assert group and list(group) == sorted(set(group)) and 1 <= group[0] and group[-1] <= n
            flat = [layer for group in mapping for layer in group]
            # Bottom-up: no student layer's group starts below the previous one's.
            assert [group[0] for group in mapping] == sorted(group[0] for group in mapping)
            if strategy == "rc":
                assert flat == list(range(1, n + 1))  # a partition, in order
            if strategy in ("rc", "oc"):
                assert set(flat) == set(range(1, n + 1))  # no layer skipped
            if strategy == "oc" and m > 1:
                # neighbours share exactly the two layers around their RC boundary
                for lower, upper in zip(mapping, mapping[1:]):
                    assert len(set(lower) & set(upper)) == 2
            if strategy == "sc":
                assert len(set(flat)) == len(flat)  # disjoint windows
                assert flat[0] == 1 and flat[-1] == n
                widths = {len(group) for group in mapping}
                assert len(widths) == 1
            if strategy == "cc":
                assert [group[-1] for group in mapping] == list(uniform_mapping(n, m)[j][0] for j in range(m))
                for group in mapping:
                    assert all(b - a == 2 for a, b in zip(group, group[1:]))


def test_ckd_rejects_a_student_deeper_than_the_teacher_naming_the_flag():
    with pytest.raises(LayerMappingError, match=r"--ckd-mapping rc \[encoder\].*valid student depths are 1\.\.3"):
        resolve_mapping(CKD_STRATEGIES, "rc", None, 3, 4, "--ckd-mapping", "--ckd-layer-map", " [encoder]")


# ------------------------------------------------------------------------------ explicit maps
def test_explicit_mapping_string():
    assert resolve_mapping(CKD_STRATEGIES, "rc", " 1, 2,3 | 4,5,6 ", 6, 2, "--m", "--map") == ((1, 2, 3), (4, 5, 6))


@pytest.mark.parametrize(
    "text, message",
    [
        ("1,2,3|", r"--map '1,2,3\|': group 2 \(student layer 2\) is empty"),
        ("1,,2|3", None),  # empty items between commas are tolerated, the group is not empty
        ("1,x|3", r"group 1 contains a non-integer"),
        ("1,2|7", r"--map: student layer 2 names teacher layer\(s\) \[7\]; valid teacher layers are 1\.\.6"),
        ("0,1|2", r"names teacher layer\(s\) \[0\]; valid teacher layers are 1\.\.6"),
        ("1,2,3", r"--map: the mapping has 1 group\(s\) but the student has 2 layer\(s\)"),
        ("1,1|2", r"repeats a teacher layer"),
    ],
)
def test_bad_explicit_mappings_fail_with_the_flag_and_the_valid_range(text, message):
    if message is None:
        assert resolve_mapping(CKD_STRATEGIES, "rc", text, 6, 2, "--m", "--map") == ((1, 2), (3,))
        return
    with pytest.raises(LayerMappingError, match=message):
        resolve_mapping(CKD_STRATEGIES, "rc", text, 6, 2, "--m", "--map")


# ---------------------------------------------------------------------------------- ALP-KD
def test_alp_buckets_follow_the_paper():
    # ALP-KD, Table 1 setting: 12 teacher layers into 3 buckets.
    assert ALP_BUCKETS["no"](12, 3) == ((1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12))
    assert ALP_BUCKETS["po"](12, 3) == ((1, 2, 3, 4, 5), (5, 6, 7, 8, 9), (9, 10, 11, 12))
    assert ALP_BUCKETS["all"](6, 2) == (tuple(range(1, 7)),) * 2
    # The default needs no depth relation at all.
    assert ALP_BUCKETS["all"](2, 3) == ((1, 2),) * 3


def test_alp_buckets_cannot_be_empty():
    with pytest.raises(LayerMappingError, match=r"--alp-buckets no \[decoder\].*valid student depths are 1\.\.2"):
        resolve_mapping(ALP_BUCKETS, "no", None, 2, 3, "--alp-buckets", "--alp-bucket-map", " [decoder]")
    with pytest.raises(LayerMappingError, match="is empty"):
        resolve_mapping(ALP_BUCKETS, "all", "1,2||3", 3, 3, "--alp-buckets", "--alp-bucket-map")


# ------------------------------------------------------------------------------------ PKD
def test_pkd_skip_and_last():
    assert uniform_mapping(12, 6) == ((2,), (4,), (6,), (8,), (10,), (12,))
    assert last_layers_mapping(12, 6) == ((7,), (8,), (9,), (10,), (11,), (12,))
    assert uniform_mapping(6, 4) == ((1,), (3,), (4,), (6,))
    with pytest.raises(LayerMappingError, match="--pkd-mapping last: .*teacher 2 layers, student 3"):
        last_layers_mapping(2, 3, "--pkd-mapping last")


# ------------------------------------------------------------------------------- RAIL-KD
def test_draw_is_a_pure_function_of_seed_epoch_and_stream():
    first = [draw_layers(7, epoch, 11, 5) for epoch in range(1, 21)]
    # Interleaving other draws (another worker, another side) changes nothing.
    random.seed(123)
    draw_layers(7, 3, 11, 5, stream="decoder")
    second = [draw_layers(7, epoch, 11, 5) for epoch in range(1, 21)]
    assert first == second
    for layers in first:
        assert len(layers) == 5 and list(layers) == sorted(set(layers)) and 1 <= layers[0] and layers[-1] <= 11
    assert len(set(first)) > 10  # epochs differ
    # Another seed, or another stream of the same run, gives other layers.
    assert sum(draw_layers(8, e, 11, 5) != draw_layers(7, e, 11, 5) for e in range(1, 21)) > 10
    assert sum(draw_layers(7, e, 11, 5, "encoder") != draw_layers(7, e, 11, 5, "decoder") for e in range(1, 21)) > 10


def test_draw_is_uniform_over_layers():
    counts = [0] * 11
    for epoch in range(1, 2201):
        for layer in draw_layers(3, epoch, 11, 5):
            counts[layer - 1] += 1
    expected = 2200 * 5 / 11  # 1000 per layer
    assert all(abs(count - expected) < 120 for count in counts), counts


def test_draw_rejects_impossible_counts():
    with pytest.raises(LayerMappingError, match=r"must be in 1\.\.2"):
        draw_layers(1, 1, 2, 3)
