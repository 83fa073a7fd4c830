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
