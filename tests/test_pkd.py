"""Patient KD (--criterion pkd): loss against a slow loop reference, padding, identity, weight 0,
mapping errors, and a real fairseq-train run with save/restore of the width projections."""
import pytest
import torch

from conftest import build_tiny_student, criterion_factory, train_student
from fairseq_kd.criterions.pkd import PatientKDCriterion
from fairseq_kd.models.feature_capture import CaptureRequest
from fairseq_kd.modules.layer_mapping import LayerMappingError
from hidden_kd_support import (
    build_criterion,
    COMMON,
    checkpoint,
    distillation_batch,
    real_positions,
    teacher_copy,
)

# Tiny teacher: 3 layers per side; tiny student: 2. Skip: floor(j*3/2); last: 3 - 2 + j. Sun et al.
# match only the intermediate student layers (j = 1); --pkd-include-top-layer adds j = 2.
EXPECTED_TEACHER_LAYER = {"skip": (1, 3), "last": (2, 3)}


def expected_layers(mapping, include_top):
    layers = EXPECTED_TEACHER_LAYER[mapping]
    return layers if include_top else layers[:-1]


@criterion_factory("pkd")
def make_pkd(task, **overrides):
    args = dict(COMMON, kd_weight=0.1, layer_weight=0.7, layer_sides="both", pkd_mapping="skip")
    args.update(overrides)
    return build_criterion(PatientKDCriterion, task, **args)


@torch.no_grad()
def slow_pkd(criterion, batch, mapping, include_top=False):
    """Eq. 3: per side, student layer, sentence and real position, the squared distance of the
    L2-normalised (projected) student state and the teacher state of layer A(j)."""
    total = 0.0
    for side in ("encoder", "decoder"):
        student, teacher = batch.student.hidden(side), batch.teacher.hidden(side)
        projection = criterion.projections[side]
        for j, teacher_layer in enumerate(expected_layers(mapping, include_top), start=1):
            for b, t in real_positions(batch.student.padding_mask(side)):
                s = projection.weight @ student[j, b, t] + projection.bias
                h = teacher[teacher_layer, b, t]
                total += float(((s / s.norm() - h / h.norm()) ** 2).sum())
    return total


@pytest.mark.parametrize("include_top", [False, True])
@pytest.mark.parametrize("mapping", ["skip", "last"])
def test_pkd_term_matches_a_slow_reference(kd_task, tiny_batch, mapping, include_top):
    student = build_tiny_student(kd_task)
    criterion = make_pkd(kd_task, pkd_mapping=mapping, pkd_include_top_layer=include_top)
    # Hidden states of the distilled sides, no attention maps.
    assert criterion.student_request == criterion.teacher_request == CaptureRequest(encoder_hidden=True, decoder_hidden=True)
    assert criterion.mappings["encoder"] == tuple((layer,) for layer in expected_layers(mapping, include_top))
    batch = distillation_batch(criterion, student, tiny_batch)
    terms = criterion.distillation_terms(batch)
    assert terms["pkd"].item() == pytest.approx(slow_pkd(criterion, batch, mapping, include_top), rel=1e-5)

    loss, sample_size, log = criterion(student, tiny_batch)
    assert sample_size == tiny_batch["ntokens"]
    torch.testing.assert_close(log["pkd_loss"], terms["pkd"].detach())
    expected = 0.2 * log["ce_loss"] + 0.1 * log["word_kd_loss"] + 0.7 * log["pkd_loss"]
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)


def test_pkd_is_zero_for_a_student_identical_to_its_teacher(kd_task, tiny_batch):
    student = teacher_copy(kd_task)
    criterion = make_pkd(kd_task, pkd_include_top_layer=True)
    assert criterion.mappings["encoder"] == ((1,), (2,), (3,))
    assert not list(criterion.parameters())  # equal widths: no projection
    terms = criterion.distillation_terms(distillation_batch(criterion, student, tiny_batch))
    assert terms["pkd"].item() < 1e-8
    assert terms["word_kd"].item() < 1e-6


def test_pkd_start_up_errors_name_the_flag(kd_task):
    build_tiny_student(kd_task, encoder_layers=4)
    with pytest.raises(LayerMappingError, match=r"--pkd-mapping skip \[encoder\].*valid student depths are 1\.\.3"):
        make_pkd(kd_task)
    build_tiny_student(kd_task, encoder_layers=1)
    with pytest.raises(LayerMappingError, match=r"1-layer student has no intermediate layer.*--pkd-include-top-layer"):
        make_pkd(kd_task)
    make_pkd(kd_task, pkd_include_top_layer=True)  # the top layer alone is a valid choice
    build_tiny_student(kd_task)
    with pytest.raises(ValueError, match=r"--kd-weight \(0\.5\) and --layer-weight \(0\.7\)"):
        make_pkd(kd_task, kd_weight=0.5)


def test_pkd_trains_with_fairseq_train_and_checkpoints_its_projections(tiny_data_bin, tiny_teacher, kd_task, tmp_path):
    proc = train_student(
        tiny_data_bin, tiny_teacher, tmp_path,
        ["--criterion", "pkd", "--pkd-mapping", "last", "--layer-sides", "both"], max_update=3,
    )
    train_lines = [line for line in proc.stdout.splitlines() if "| train |" in line]
    assert train_lines and all("pkd_loss" in line and "word_kd_loss" in line for line in train_lines)
    state = checkpoint(tmp_path / "checkpoint_last.pt")
    assert set(state["criterion"]) == {
        "projections.encoder.weight", "projections.encoder.bias",
        "projections.decoder.weight", "projections.decoder.bias",
    }
    assert not [key for key in state["model"] if "projections" in key]
    # fairseq's trainer restores the criterion with load_state_dict(strict=True): do the same.
    build_tiny_student(kd_task)
    restored = make_pkd(kd_task, pkd_mapping="last")
    restored.load_state_dict(state["criterion"], strict=True)
    for name, value in restored.state_dict().items():
        torch.testing.assert_close(value, state["criterion"][name].float())
