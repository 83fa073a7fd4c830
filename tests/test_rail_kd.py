"""RAIL-KD (--criterion rail_kd): both variants against a slow reference, the per-epoch draw
(identical across simulated workers and across a stop-and-resume, different across epochs),
padding, identity, weight 0, start-up errors, and a fairseq-train run."""
import re

import pytest
import torch

from conftest import build_tiny_student, criterion_factory, train_student
from fairseq_kd.criterions.rail_kd import RailKDCriterion
from fairseq_kd.models.feature_capture import CaptureRequest
from fairseq_kd.modules.layer_mapping import LayerMappingError, draw_layers
from hidden_kd_support import (
    build_criterion,
    assert_sentence_term_is_a_mean_over_sentences,
    COMMON,
    checkpoint,
    distillation_batch,
    real_positions,
    teacher_copy,
)

#: tests/test_multirank.py's runs of this criterion (2 CPU ranks equal 1 rank with --update-freq 2):
#: run name -> flags after --criterion NAME
MULTI_RANK_RUNS = {"rail_kd": []}


@criterion_factory("rail_kd")
def make_rail(task, **overrides):
    args = dict(COMMON, kd_weight=1 / 3, layer_weight=1 / 3, layer_sides="both", rail_variant="layerwise",
                rail_projection_dim=8, rail_include_top_layers=False, seed=1)
    args.update(overrides)
    return build_criterion(RailKDCriterion, task, **args)


@torch.no_grad()
def slow_rail(criterion, batch, variant):
    """Eq. 1-3 with explicit loops: mean over each sentence's real positions, projection,
    normalisation, squared distance; summed over sentences (and layers for the layer-wise form)."""
    total = 0.0
    for side in ("encoder", "decoder"):
        student, teacher = batch.student.hidden(side), batch.teacher.hidden(side)
        mask = batch.student.padding_mask(side)
        pairs = list(zip(range(1, len(criterion.drawn[side]) + 1), criterion.drawn[side]))
        s_proj, t_proj = criterion.student_projections[side], criterion.teacher_projections[side]
        for b in range(mask.size(0)):
            positions = [t for bb, t in real_positions(mask) if bb == b]
            vectors = []
            for student_layer, teacher_layer in pairs:
                s = sum(student[student_layer, b, t] for t in positions) / len(positions)
                h = sum(teacher[teacher_layer, b, t] for t in positions) / len(positions)
                vectors.append((s, h))
            if variant == "layerwise":
                for i, (s, h) in enumerate(vectors):
                    u_s = s @ s_proj.weight[i] + s_proj.bias[i]
                    u_t = h @ t_proj.weight[i] + t_proj.bias[i]
                    total += float(((u_s / u_s.norm() - u_t / u_t.norm()) ** 2).sum())
            else:
                u_s = s_proj.weight @ torch.cat([s for s, _ in vectors]) + s_proj.bias
                u_t = t_proj.weight @ torch.cat([h for _, h in vectors]) + t_proj.bias
                total += float(((u_s / u_s.norm() - u_t / u_t.norm()) ** 2).sum())
    return total


@pytest.mark.parametrize("variant", ["layerwise", "concatenated"])
@pytest.mark.parametrize("include_top", [False, True])
def test_rail_term_matches_a_slow_reference(kd_task, tiny_batch, variant, include_top):
    student = build_tiny_student(kd_task)
    criterion = make_rail(kd_task, rail_variant=variant, rail_include_top_layers=include_top)
    # Hidden states of the distilled sides, no attention maps.
    assert criterion.student_request == criterion.teacher_request == CaptureRequest(encoder_hidden=True, decoder_hidden=True)
    for epoch in (1, 2, 3):
        criterion.begin_epoch(epoch)
        drawn = criterion.drawn["encoder"]
        if include_top:  # 2 of teacher layers 1..3 for student layers 1, 2
            assert drawn == draw_layers(1, epoch, 3, 2, "encoder")
        else:  # 1 of the intermediate teacher layers 1..2 for student layer 1
            assert drawn == draw_layers(1, epoch, 2, 1, "encoder")
        batch = distillation_batch(criterion, student, tiny_batch)
        terms = criterion.distillation_terms(batch)
        assert terms["rail"].item() == pytest.approx(slow_rail(criterion, batch, variant), rel=1e-5)
    loss, _, log = criterion(student, tiny_batch)
    expected = (log["ce_loss"] + log["word_kd_loss"] + log["rail_loss"]) / 3
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in criterion.parameters())


def test_rail_draws_agree_across_workers_and_resumes_and_change_across_epochs(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    worker_a = make_rail(kd_task, rail_include_top_layers=True, seed=11)
    worker_b = make_rail(kd_task, rail_include_top_layers=True, seed=11)
    history = {}
    for epoch in range(1, 9):
        worker_a.begin_epoch(epoch)
        worker_b.begin_epoch(epoch)
        assert worker_a.drawn == worker_b.drawn
        history[epoch] = worker_a.drawn
    # A run resumed at epoch 6 (fresh criterion, begin_epoch(6) only) uses epoch 6's layers.
    resumed = make_rail(kd_task, rail_include_top_layers=True, seed=11)
    resumed.begin_epoch(6)
    assert resumed.drawn == history[6]
    assert torch.equal(resumed.encoder_teacher_layers, torch.tensor(history[6]["encoder"]))
    # Different epochs draw different layers (3 possible pairs per side here).
    assert len({draws["encoder"] for draws in history.values()}) > 1
    assert len({draws["decoder"] for draws in history.values()}) > 1
    # ... and the loss follows the draw.
    changed = next(e for e in range(2, 9) if history[e]["encoder"] != history[1]["encoder"])
    values = {}
    for epoch in (1, changed):
        worker_a.begin_epoch(epoch)
        batch = distillation_batch(worker_a, student, tiny_batch)
        side = "encoder"
        values[epoch] = worker_a.layer_loss(side, batch.student.hidden(side), batch.teacher.hidden(side),
                                            batch.student.padding_mask(side))
    assert not torch.allclose(values[1], values[changed])


def test_rail_is_zero_for_a_student_identical_to_its_teacher_with_equal_projections(kd_task, tiny_batch):
    student = teacher_copy(kd_task)
    criterion = make_rail(kd_task)  # intermediate layers: teacher {1, 2} drawn for student {1, 2}
    assert criterion.drawn == {"encoder": (1, 2), "decoder": (1, 2)}
    with torch.no_grad():
        for side in ("encoder", "decoder"):
            criterion.student_projections[side].load_state_dict(criterion.teacher_projections[side].state_dict())
    terms = criterion.distillation_terms(distillation_batch(criterion, student, tiny_batch))
    assert terms["rail"].item() < 1e-10


def test_rail_start_up_errors(kd_task):
    build_tiny_student(kd_task, encoder_layers=4)
    with pytest.raises(LayerMappingError, match=r"rail_kd \[encoder\]: with a 3-layer teacher the student's encoder must have 2\.\.3 layers, but it has 4"):
        make_rail(kd_task)
    build_tiny_student(kd_task, decoder_layers=1)
    with pytest.raises(LayerMappingError, match=r"\[decoder\].*must have 2\.\.3 layers, but it has 1.*--rail-include-top-layers"):
        make_rail(kd_task)
    assert make_rail(kd_task, rail_include_top_layers=True).drawn["decoder"] in {(1,), (2,), (3,)}
    build_tiny_student(kd_task)
    with pytest.raises(ValueError, match="--rail-projection-dim must be >= 1"):
        make_rail(kd_task, rail_projection_dim=0)


def test_rail_trains_with_fairseq_train_using_the_seed_flag(tiny_data_bin, tiny_teacher, kd_task, tmp_path):
    proc = train_student(
        tiny_data_bin, tiny_teacher, tmp_path,
        ["--criterion", "rail_kd", "--rail-variant", "concatenated", "--layer-sides", "both"], max_update=4,
        extra=["--seed", "2"],
    )
    assert re.search(r"\| train \| epoch 001 .*word_kd_loss [\d.]+ \| rail_loss [\d.]+", proc.stdout)
    logged = proc.stdout + proc.stderr

    def draw_line(seed, epoch):
        encoder = list(draw_layers(seed, epoch, 2, 1, "encoder"))
        decoder = list(draw_layers(seed, epoch, 2, 1, "decoder"))
        return (f"rail_kd epoch {epoch}: encoder student layers [1] <- teacher layers {encoder}; "
                f"decoder student layers [1] <- teacher layers {decoder}")

    for epoch in (1, 2):  # fairseq's --seed reaches the criterion through II("common.seed")
        assert draw_line(2, epoch) in logged
        assert draw_line(1, epoch) not in logged  # seed 1 draws the other layers in these epochs
    state = checkpoint(tmp_path / "checkpoint_last.pt")
    assert set(state["criterion"]) == {
        f"{model}_projections.{side}.{name}"
        for model in ("teacher", "student") for side in ("encoder", "decoder") for name in ("weight", "bias")
    }
    assert state["criterion"]["teacher_projections.encoder.weight"].shape == (128, 32)
    assert not [key for key in state["model"] if "projections" in key]
    build_tiny_student(kd_task)
    make_rail(kd_task, rail_variant="concatenated", rail_projection_dim=128).load_state_dict(state["criterion"], strict=True)


def test_rail_term_is_a_mean_over_sentences_at_any_length(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    assert_sentence_term_is_a_mean_over_sentences(
        lambda **overrides: make_rail(kd_task, **overrides), student, tiny_batch, "rail")
