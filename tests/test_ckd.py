"""Combinatorial KD (--criterion ckd): fusion loss against a slow concatenate-and-multiply
reference, the mapping strategies on the tiny models, padding, identity, weight 0, start-up
errors, and fairseq-train runs that save, resume and restore the fusion parameters.

The mapping rules themselves (the paper's 6-to-2 sets, 12-to-4, 6-to-3, every depth) are tested
in test_layer_mapping.py."""
import re

import pytest
import torch

from conftest import build_tiny_student, criterion_factory, run_module, train_student
from fairseq_kd.criterions.ckd import CombinatorialKDCriterion
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

# 3 teacher layers into 2 student layers: RC boundaries floor(3j/2) = 1, 3.
TINY_MAPPINGS = {
    "rc": ((1,), (2, 3)),
    "oc": ((1, 2), (1, 2, 3)),
    "sc": ((1,), (3,)),
    "cc": ((1,), (3,)),
}


@criterion_factory("ckd")
def make_ckd(task, **overrides):
    args = dict(COMMON, kd_weight=0.1, layer_weight=0.7, layer_sides="both", ckd_mapping="rc", ckd_layer_map=None,
                ckd_map_side="teacher")
    args.update(overrides)
    return build_criterion(CombinatorialKDCriterion, task, **args)


def concatenated_weight(fusion, mapping, student_slot):
    """W_i of the paper, assembled from the per-pair blocks (pairs are stored in mapping order)."""
    first = sum(len(group) for group in mapping[:student_slot])
    return torch.cat([fusion.blocks.weight[first + k].t() for k in range(len(mapping[student_slot]))], dim=1)


@torch.no_grad()
def slow_student_side_ckd(criterion, batch, mapping):
    """sum over student layers i and real positions of MSE(W_i h_S^i + b_i, [h_T^j; ...]), W_i
    assembled as one |M(i)| d_T x d_S matrix and the MSE a mean over its |M(i)| d_T features."""
    total = 0.0
    for side in ("encoder", "decoder"):
        student, teacher = batch.student.hidden(side), batch.teacher.hidden(side)
        blocks = criterion.projections[side].blocks
        first = 0
        for i, group in enumerate(mapping):
            pairs = range(first, first + len(group))
            first += len(group)
            weight = torch.cat([blocks.weight[p].t() for p in pairs], dim=0)
            bias = torch.cat([blocks.bias[p] for p in pairs])
            assert weight.shape == (32 * len(group), 16)
            for b, t in real_positions(batch.student.padding_mask(side)):
                concatenation = torch.cat([teacher[j, b, t] for j in group])
                total += float(((weight @ student[i + 1, b, t] + bias - concatenation) ** 2).mean())
    return total


@torch.no_grad()
def slow_ckd(criterion, batch, mapping):
    """Eq. 3: sum over student layers i and real positions of MSE(h_S^i, W_i [h_T^j; ...] + b_i)."""
    total = 0.0
    for side in ("encoder", "decoder"):
        student, teacher = batch.student.hidden(side), batch.teacher.hidden(side)
        fusion = criterion.fusions[side]
        for i, group in enumerate(mapping):
            weight = concatenated_weight(fusion, mapping, i)
            assert weight.shape == (16, 32 * len(group))
            for b, t in real_positions(batch.student.padding_mask(side)):
                concatenation = torch.cat([teacher[j, b, t] for j in group])
                fused = weight @ concatenation + fusion.bias[i]
                total += float(((student[i + 1, b, t] - fused) ** 2).mean())
    return total


@pytest.mark.parametrize("strategy", sorted(TINY_MAPPINGS))
def test_ckd_strategies_on_the_tiny_models(kd_task, strategy):
    build_tiny_student(kd_task)
    criterion = make_ckd(kd_task, ckd_mapping=strategy)
    assert criterion.mappings == {"encoder": TINY_MAPPINGS[strategy], "decoder": TINY_MAPPINGS[strategy]}


@pytest.mark.parametrize("strategy, explicit", [("oc", None), ("rc", "1,3|2,3")])
def test_ckd_term_matches_a_slow_reference(kd_task, tiny_batch, strategy, explicit):
    student = build_tiny_student(kd_task)
    criterion = make_ckd(kd_task, ckd_mapping=strategy, ckd_layer_map=explicit)
    # Hidden states of the distilled sides, no attention maps.
    assert criterion.student_request == criterion.teacher_request == CaptureRequest(encoder_hidden=True, decoder_hidden=True)
    mapping = ((1, 3), (2, 3)) if explicit else TINY_MAPPINGS[strategy]
    assert criterion.mappings["encoder"] == mapping
    batch = distillation_batch(criterion, student, tiny_batch)
    terms = criterion.distillation_terms(batch)
    assert terms["ckd"].item() == pytest.approx(slow_ckd(criterion, batch, mapping), rel=1e-5)

    loss, _, log = criterion(student, tiny_batch)
    expected = 0.2 * log["ce_loss"] + 0.1 * log["word_kd_loss"] + 0.7 * log["ckd_loss"]
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)
    # Every fusion parameter receives a gradient.
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in criterion.parameters())


@pytest.mark.parametrize("strategy, explicit", [("oc", None), ("rc", "1,3|2")])
def test_student_side_ckd_matches_a_slow_reference(kd_task, tiny_batch, strategy, explicit):
    student = build_tiny_student(kd_task)
    criterion = make_ckd(kd_task, ckd_mapping=strategy, ckd_layer_map=explicit, ckd_map_side="student")
    mapping = ((1, 3), (2,)) if explicit else TINY_MAPPINGS[strategy]
    assert not criterion.fusions
    batch = distillation_batch(criterion, student, tiny_batch)
    terms = criterion.distillation_terms(batch)
    assert terms["ckd"].item() == pytest.approx(slow_student_side_ckd(criterion, batch, mapping), rel=1e-5)
    loss, _, _ = criterion(student, tiny_batch)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in criterion.parameters())


def test_only_the_papers_teacher_side_fusion_is_minimised_by_a_constant_student(kd_task, tiny_batch):
    """The degenerate minimum that collapsed CKD students on Multi30k: student states equal to a
    constant c at every position, with W = 0 and b = c, give the paper's loss 0; the student-side
    map cannot reach 0 that way, because its target is the teacher's (varying) states."""
    student = build_tiny_student(kd_task)
    paper = make_ckd(kd_task, ckd_map_side="teacher")
    ours = make_ckd(kd_task, ckd_map_side="student")
    batch = distillation_batch(paper, student, tiny_batch)
    for side in ("encoder", "decoder"):
        states = batch.student.hidden(side)
        states.data[1:] = 0.5  # every layer's output the same vector at every position
    with torch.no_grad():
        for fusion in paper.fusions.values():
            fusion.blocks.weight.zero_()
            fusion.bias.fill_(0.5)
    assert paper.distillation_terms(batch)["ckd"].item() < 1e-10
    with torch.no_grad():  # the best any map can do from constant inputs is the teacher's mean
        constant_best = sum(
            float(((batch.teacher.hidden(side)[list(group)] - mean_of_real(batch.teacher.hidden(side)[list(group)],
                   batch.student.padding_mask(side))) ** 2).mean(-1).masked_fill(batch.student.padding_mask(side), 0).sum()
                  / len(group))
            for side in ("encoder", "decoder") for group in ours.mappings[side]
        )
    assert ours.distillation_terms(batch)["ckd"].item() >= constant_best * (1 - 1e-5) > 1.0


def mean_of_real(states, padding_mask):
    """Per-layer feature mean over real positions, broadcastable to ``states`` (k, B, T, d)."""
    real = (~padding_mask).float()[None, :, :, None]
    return (states * real).sum((1, 2), keepdim=True) / real.sum((1, 2), keepdim=True)


@pytest.mark.parametrize("map_side", ["student", "teacher"])
def test_ckd_grows_as_the_student_moves_away_from_its_teacher(kd_task, tiny_batch, map_side):
    student = teacher_copy(kd_task)
    criterion = make_ckd(kd_task, ckd_layer_map="1|2|3", ckd_map_side=map_side)
    identity_maps(criterion)
    values = []
    for scale in (0.0, 0.1, 0.5):
        moved = distillation_batch(criterion, student, tiny_batch)
        for side in ("encoder", "decoder"):
            states = moved.student.hidden(side)
            states.data += scale * torch.randn(states.shape, generator=torch.Generator().manual_seed(0))
        values.append(criterion.distillation_terms(moved)["ckd"].item())
    assert values[0] < 1e-8 < values[1] < values[2]


def identity_maps(criterion):
    with torch.no_grad():
        for fusion in criterion.fusions.values():
            fusion.blocks.weight.copy_(torch.eye(32).expand(3, 32, 32))
            fusion.bias.zero_()
        for projection in criterion.projections.values():
            projection.blocks.weight.copy_(torch.eye(32).expand(3, 32, 32))
            projection.blocks.bias.zero_()


def test_ckd_is_zero_for_a_student_identical_to_its_teacher_with_identity_fusion(kd_task, tiny_batch):
    student = teacher_copy(kd_task)
    criterion = make_ckd(kd_task, ckd_layer_map="1|2|3")
    with torch.no_grad():
        for fusion in criterion.fusions.values():
            fusion.blocks.weight.copy_(torch.eye(32).expand(3, 32, 32))
            fusion.bias.zero_()
    terms = criterion.distillation_terms(distillation_batch(criterion, student, tiny_batch))
    assert terms["ckd"].item() < 1e-8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(ckd_layer_map="1,2|4"), r"--ckd-layer-map \[encoder\]: student layer 2 names teacher layer\(s\) \[4\]; valid teacher layers are 1\.\.3"),
        (dict(ckd_layer_map="1,2|"), r"--ckd-layer-map \[encoder\] '1,2\|': group 2 \(student layer 2\) is empty"),
        (dict(ckd_layer_map="1;2|3"), r"--ckd-layer-map \[encoder\] '1;2\|3': group 1 contains a non-integer"),
        (dict(ckd_layer_map="1|2|3"), r"the mapping has 3 group\(s\) but the student has 2 layer\(s\)"),
    ],
)
def test_ckd_bad_mappings_fail_at_start_up(kd_task, overrides, message):
    build_tiny_student(kd_task)
    with pytest.raises(LayerMappingError, match=message):
        make_ckd(kd_task, **overrides)


def test_ckd_student_deeper_than_teacher_fails_at_start_up(kd_task):
    build_tiny_student(kd_task, decoder_layers=4)
    with pytest.raises(LayerMappingError, match=r"--ckd-mapping sc \[decoder\].*valid student depths are 1\.\.3"):
        make_ckd(kd_task, ckd_mapping="sc")
    # Encoder-only (the default side) does not look at the decoder at all.
    assert make_ckd(kd_task, ckd_mapping="sc", layer_sides="encoder").mappings == {"encoder": ((1,), (3,))}


@pytest.mark.parametrize("map_side", ["teacher", "student"])
def test_ckd_fairseq_train_saves_resumes_and_restores_the_fusion(tiny_data_bin, tiny_teacher, kd_task, tmp_path,
                                                                 map_side):
    flags = ["--criterion", "ckd", "--ckd-mapping", "oc", "--layer-sides", "both", "--ckd-map-side", map_side]
    first = train_student(tiny_data_bin, tiny_teacher, tmp_path, flags, max_update=3)
    assert re.search(r"\| train \| epoch 001 .*word_kd_loss [\d.]+ \| ckd_loss [\d.]+", first.stdout)
    saved = checkpoint(tmp_path / "checkpoint_last.pt")
    module, names, shape = {
        "teacher": ("fusions", ("blocks.weight", "bias"), (5, 32, 16)),  # pairs of {1,2},{1,2,3}: d_T -> d_S
        "student": ("projections", ("blocks.weight", "blocks.bias"), (5, 16, 32)),  # d_S -> d_T
    }[map_side]
    assert set(saved["criterion"]) == {f"{module}.{side}.{name}" for side in ("encoder", "decoder") for name in names}
    assert saved["criterion"][f"{module}.encoder.blocks.weight"].shape == shape
    assert not [key for key in saved["model"] if module in key]

    # Resume with a learning rate too small to move anything: the learnable map must come back as
    # saved (a re-initialised one would be far away), and training goes on.
    second = train_student(tiny_data_bin, tiny_teacher, tmp_path, flags, max_update=4, extra=["--lr", "1e-12"])
    assert "Loaded checkpoint" in second.stdout + second.stderr
    assert re.search(r"num_updates=4\b", second.stdout)
    resumed = checkpoint(tmp_path / "checkpoint_last.pt")
    for name, value in saved["criterion"].items():
        torch.testing.assert_close(resumed["criterion"][name], value, atol=1e-6, rtol=0)
    build_tiny_student(kd_task)
    fresh = make_ckd(kd_task, ckd_mapping="oc", ckd_map_side=map_side)
    key = f"{module}.encoder.{names[1]}"
    assert (fresh.state_dict()[key] - saved["criterion"][key]).abs().max() > 1e-3
    fresh.load_state_dict(saved["criterion"], strict=True)
    # Resuming with the maps on the other side is refused before fairseq loads anything, naming the
    # flag (also for a checkpoint from before the flag existed, whose config cannot say it).
    other = "student" if map_side == "teacher" else "teacher"
    flags_other = [*flags[:-1], other]
    refused = train_student(tiny_data_bin, tiny_teacher, tmp_path, flags_other, max_update=5, refused=True)
    assert refused.returncode != 0
    assert re.search(f"trained with --ckd-map-side {map_side}, this run has --ckd-map-side {other}: "
                     f"resume with --ckd-map-side {map_side}", refused.stderr)

    # The exported student carries none of the distillation-only parameters.
    run_module("fairseq_kd.cli.export_student", tmp_path / "checkpoint_last.pt", tmp_path / "student.pt")
    exported = checkpoint(tmp_path / "student.pt")
    assert "criterion" not in exported
    assert not [key for key in exported["model"] if "fusion" in key or "blocks" in key]
