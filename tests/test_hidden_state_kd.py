"""Invariants every hidden-state criterion (each registered class on HiddenStateKDCriterion: alp_kd,
ckd, pkd, rail_kd, internal_kd) shares, checked once for all: with every distillation weight 0 it is
fairseq's label_smoothed_cross_entropy, padded positions take no part in its layer term, and it
stays finite in half precision. Each is built by the ``make_*`` of its own test file."""
import pytest
import torch

from conftest import build_tiny_student, criterion_maker, hidden_state_criterions
from hidden_kd_support import (
    assert_finite_in_half_precision,
    assert_reduces_to_label_smoothed_ce,
    distillation_batch,
    scramble_padding,
)

MAKERS = {name: criterion_maker(name) for name in hidden_state_criterions()}
#: options that give a method a layer term on both sides of the tiny models (default: its maker's)
LAYER_TERM_OPTIONS = {
    "ckd": [{"ckd_mapping": "oc"}],
    "rail_kd": [{"rail_variant": variant, "rail_include_top_layers": True} for variant in ("layerwise", "concatenated")],
}
#: methods whose layer terms also read attention maps, with a padding test of their own
OWN_PADDING_TEST = {"internal_kd"}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_zero_weights_are_label_smoothed_ce(kd_task, tiny_batch, name):
    student = build_tiny_student(kd_task)
    # internal KD's CE weight is --hard-label-weight (0 by default: soft labels only)
    ce_only = {"hard_label_weight": 1.0} if name == "internal_kd" else {}
    criterion = MAKERS[name](kd_task, kd_weight=0.0, layer_weight=0.0, **ce_only)
    assert_reduces_to_label_smoothed_ce(criterion, student, tiny_batch)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_finite_in_half_precision(kd_task, tiny_batch, name):
    build_tiny_student(kd_task)
    options = {"rail_include_top_layers": True} if name == "rail_kd" else {}
    assert_finite_in_half_precision(MAKERS[name](kd_task, **options), kd_task, tiny_batch)


@pytest.mark.parametrize("name", sorted(set(MAKERS) - OWN_PADDING_TEST))
def test_layer_term_ignores_padding(kd_task, tiny_batch, name):
    """Large noise at padded positions of both models' states leaves the layer term unchanged
    (internal KD, whose terms also read attention maps, has its own test)."""
    student = build_tiny_student(kd_task)
    for options in LAYER_TERM_OPTIONS.get(name, [{}]):
        criterion = MAKERS[name](kd_task, **options)
        batch = distillation_batch(criterion, student, tiny_batch)
        for side in ("encoder", "decoder"):
            mask = batch.student.padding_mask(side)
            s, t = batch.student.hidden(side), batch.teacher.hidden(side)
            clean = criterion.layer_loss(side, s, t, mask)
            noisy = criterion.layer_loss(side, scramble_padding(s, mask, 5), scramble_padding(t, mask, 6), mask)
            torch.testing.assert_close(clean, noisy)


@pytest.mark.parametrize("name", ["ckd", "alp_kd"])
def test_teachers_features_are_released_before_ces_pass(kd_task, tiny_batch, monkeypatch, name):
    """The base forms the method's terms, then lets the teacher's captured features and per-layer
    decoder states go, then runs CE's pass with word KD (whose vocabulary-sized gradient buffer
    would otherwise count together with them); the word-KD value the step logs is that pass's."""
    import weakref

    from fairseq_kd.criterions import base

    student = build_tiny_student(kd_task)
    criterion = MAKERS[name](kd_task)
    held = {}
    teacher_forward = criterion.teacher.forward

    def forward(net_input, request):
        output, features = teacher_forward(net_input, request)
        held["features"] = weakref.ref(features)
        held["states"] = [weakref.ref(state) for state in output[1]["inner_states"]]
        return output, features

    fused_pass = base.label_smoothed_ce_and_word_kd
    alive_at_ce = []

    def spy(*args, **kwargs):
        alive_at_ce.append(held["features"]() is not None or any(state() is not None for state in held["states"]))
        result = fused_pass(*args, **kwargs)
        held["word_kd"] = result[3]
        return result

    monkeypatch.setattr(criterion.teacher, "forward", forward)
    monkeypatch.setattr(base, "label_smoothed_ce_and_word_kd", spy)
    _, _, log = criterion(student, tiny_batch)
    assert alive_at_ce == [False]
    assert log["word_kd_loss"] == held["word_kd"].data
