"""Internal-representation KD (--criterion internal_kd): attention KL and cosine terms against a
slow reference (per head and head-averaged), the ALL/PID/SID schedules (epoch budget, cosine
threshold on the all-worker epoch mean, stop-and-resume), padding, identity, weight 0, and
fairseq-train runs including a stop-and-resume through the CLI."""
import dataclasses
import math
import re

import pytest
import torch

from conftest import build_tiny_student, criterion_factory, make_batch, train_student
from fairseq_kd.criterions.internal_kd import InternalKDCriterion, schedule_stage
from fairseq_kd.models.feature_capture import DECODER_SELF, ENCODER_SELF
from fairseq_kd.modules.layer_mapping import LayerMappingError
from hidden_kd_support import (
    build_criterion,
    assert_sentence_term_is_a_mean_over_sentences,
    COMMON,
    checkpoint,
    distillation_batch,
    real_positions,
    scramble_padding,
    teacher_copy,
)

KINDS = {"encoder": ENCODER_SELF, "decoder": DECODER_SELF}
PAIRS = ((1, 1), (2, 3))  # 3 teacher layers, 2 student layers: student j <- teacher floor(3j/2)


@criterion_factory("internal_kd")
def make_internal(task, **overrides):
    args = dict(COMMON, kd_weight=1.0, layer_weight=1.0, layer_sides="both", hard_label_weight=0.0,
                internal_schedule="all", internal_epochs_per_layer=5, internal_cos_threshold=0.05,
                internal_soft_labels_throughout=False)
    args.update(overrides)
    return build_criterion(InternalKDCriterion, task, **args)


@torch.no_grad()
def slow_internal(criterion, batch, pairs=PAIRS):
    """Eq. 2 and 3 with loops over pairs, sentences, heads, queries and keys. The student's
    probabilities are the captured ones (the criterion itself works from the scores)."""
    kl_total, cos_total = 0.0, 0.0
    for side in ("encoder", "decoder"):
        teacher_maps, student_maps = batch.teacher.attention[KINDS[side]], batch.student.attention[KINDS[side]]
        mask = batch.student.padding_mask(side)
        positions = real_positions(mask)
        heads_match = teacher_maps.num_heads == student_maps.num_heads
        for student_layer, teacher_layer in pairs:
            # (B, H, T, T); the criterion asks for the paired layers' maps only
            p_t = teacher_maps.of_layers(teacher_maps.probs, (teacher_layer,))[0]
            p_s = student_maps.of_layers(student_maps.probs, (student_layer,))[0]
            if not heads_match:
                p_t, p_s = p_t.mean(1, keepdim=True), p_s.mean(1, keepdim=True)
            for b, query in positions:
                keys = [k for bb, k in positions if bb == b and (side == "encoder" or k <= query)]
                row_kl = []
                for h in range(p_t.size(1)):
                    row_kl.append(sum(
                        float(p_t[b, h, query, k]) * math.log(float(p_t[b, h, query, k]) / float(p_s[b, h, query, k]))
                        for k in keys if float(p_t[b, h, query, k]) > 0
                    ))
                kl_total += sum(row_kl) / len(row_kl)
            student, teacher = batch.student.hidden(side), batch.teacher.hidden(side)
            projection = criterion.projections[side]
            for b in range(mask.size(0)):
                real = [t for bb, t in positions if bb == b]
                s = sum(student[student_layer, b, t] for t in real) / len(real)
                h = sum(teacher[teacher_layer, b, t] for t in real) / len(real)
                if hasattr(projection, "weight"):
                    s = projection.weight @ s + projection.bias
                cos_total += 1.0 - float(s @ h) / float(s.norm() * h.norm())
    return kl_total, cos_total


@pytest.mark.parametrize("student_heads", [2, 4])
def test_internal_terms_match_a_slow_reference(kd_task, tiny_batch, student_heads):
    student = build_tiny_student(kd_task, encoder_attention_heads=student_heads, decoder_attention_heads=student_heads)
    criterion = make_internal(kd_task)
    assert criterion.pairs == {"encoder": PAIRS, "decoder": PAIRS}
    # Self-attention maps only, of the kinds used; scores only from the student.
    assert criterion.teacher_request.attention_kinds == (ENCODER_SELF, DECODER_SELF)
    assert not criterion.teacher_request.attention_scores and criterion.student_request.attention_scores
    batch = distillation_batch(criterion, student, tiny_batch)
    terms = criterion.distillation_terms(batch)
    kl, cos = slow_internal(criterion, batch)
    assert terms["internal_kl"].item() == pytest.approx(kl, rel=1e-4)
    assert terms["internal_cos"].item() == pytest.approx(cos, rel=1e-5)
    loss, _, log = criterion(student, tiny_batch)
    torch.testing.assert_close(loss.detach(), log["word_kd_loss"] + log["internal_kl_loss"] + log["internal_cos_loss"])
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in student.parameters() if p.grad is not None)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in criterion.parameters())


def test_internal_ignores_padding(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    criterion = make_internal(kd_task)
    batch = distillation_batch(criterion, student, tiny_batch)
    generator = torch.Generator().manual_seed(0)

    def scramble_maps(maps, field):
        values = getattr(maps, field)
        noise = torch.rand(values.shape, generator=generator) * 50
        return dataclasses.replace(maps, **{field: torch.where(maps.attendable.unsqueeze(0), values, noise)})

    noisy = dataclasses.replace(
        batch,
        student=dataclasses.replace(
            batch.student,
            encoder_hidden=scramble_padding(batch.student.encoder_hidden, batch.student.padding_mask("encoder"), 1),
            decoder_hidden=scramble_padding(batch.student.decoder_hidden, batch.student.padding_mask("decoder"), 2),
            attention={kind: scramble_maps(maps, "scores") for kind, maps in batch.student.attention.items()},
        ),
        teacher=dataclasses.replace(
            batch.teacher,
            encoder_hidden=scramble_padding(batch.teacher.encoder_hidden, batch.student.padding_mask("encoder"), 3),
            decoder_hidden=scramble_padding(batch.teacher.decoder_hidden, batch.student.padding_mask("decoder"), 4),
            attention={kind: scramble_maps(maps, "probs") for kind, maps in batch.teacher.attention.items()},
        ),
    )
    clean_terms, noisy_terms = criterion.distillation_terms(batch), criterion.distillation_terms(noisy)
    for name in ("internal_kl", "internal_cos"):
        torch.testing.assert_close(clean_terms[name], noisy_terms[name])


def test_internal_terms_vanish_for_a_student_identical_to_its_teacher(kd_task, tiny_batch):
    student = teacher_copy(kd_task)
    criterion = make_internal(kd_task)
    assert criterion.pairs["encoder"] == ((1, 1), (2, 2), (3, 3))
    terms = criterion.distillation_terms(distillation_batch(criterion, student, tiny_batch))
    assert terms["internal_kl"].item() < 1e-5
    assert terms["internal_cos"].item() < 1e-5


def test_internal_start_up_errors(kd_task):
    build_tiny_student(kd_task, encoder_layers=4)
    with pytest.raises(LayerMappingError, match=r"internal_kd \[encoder\].*valid student depths are 1\.\.3"):
        make_internal(kd_task)
    build_tiny_student(kd_task)
    with pytest.raises(ValueError, match="--internal-epochs-per-layer must be >= 1"):
        make_internal(kd_task, internal_epochs_per_layer=0)


# ------------------------------------------------------------------------------- schedules
def test_schedule_stage_is_a_function_of_the_epoch_and_the_crossings():
    stages = [schedule_stage(epoch, 2, 2, []) for epoch in range(1, 7)]
    assert stages == [0, 0, 1, 1, 2, 2]  # two epochs per pair, then done
    # A crossing at the end of epoch 1 moves on at once; the next pair has its full budget.
    assert [schedule_stage(epoch, 2, 2, [1]) for epoch in range(1, 6)] == [0, 1, 1, 2, 2]
    assert [schedule_stage(epoch, 3, 5, [2, 3]) for epoch in range(1, 6)] == [0, 0, 1, 2, 2]
    # Crossings after the schedule ended change nothing.
    assert schedule_stage(9, 2, 1, [5, 6]) == 2


def epoch_of_training(criterion, student, batches):
    """One epoch as fairseq runs it: forward in training mode, the all-worker logging outputs of
    each step through the criterion's reduce_metrics and then (the task's reduce_metrics) its
    reduce_worker_logs."""
    criterion.train()
    logs = []
    for batch in batches:
        _, _, log = criterion(student, batch)
        logs.append(log)
        criterion.__class__.reduce_metrics([log])
        criterion.reduce_worker_logs([log])
    return logs


@pytest.mark.parametrize("schedule", ["pid", "sid"])
def test_pid_and_sid_move_on_after_the_epoch_budget(kd_task, tiny_batch, schedule):
    student = build_tiny_student(kd_task)
    criterion = make_internal(kd_task, internal_schedule=schedule, internal_epochs_per_layer=2,
                              internal_cos_threshold=0.0, hard_label_weight=0.1)
    seen = []
    for epoch in range(1, 6):
        criterion.begin_epoch(epoch)
        logs = epoch_of_training(criterion, student, [tiny_batch])
        seen.append((criterion.slots["encoder"], criterion.loss_weights()))
        if criterion.internal_phase:
            # maps of the active pairs' layers only (PAIRS: student 1 <- teacher 1, 2 <- 3)
            teacher_layers = tuple(PAIRS[slot][1] for slot in seen[-1][0])
            student_layers = tuple(slot + 1 for slot in seen[-1][0])
            assert criterion.teacher_request.attention_layers == tuple(
                (kind, teacher_layers) for kind in (ENCODER_SELF, DECODER_SELF))
            assert criterion.student_request.attention_layers == tuple(
                (kind, student_layers) for kind in (ENCODER_SELF, DECODER_SELF))
        # the schedule reaches the log: each step's weights, next to its terms
        assert (logs[0]["word_kd_weight"], logs[0]["internal_kl_weight"]) == (
            seen[-1][1]["word_kd"], seen[-1][1]["internal_kl"])
        if criterion.internal_phase:
            assert logs[0]["internal_kl_loss"] > 0 and logs[0]["word_kd_loss"] == 0.0
        else:
            assert logs[0]["internal_kl_loss"] == 0.0 and logs[0]["word_kd_loss"] > 0
    second = [1] if schedule == "pid" else [0, 1]
    assert [slots for slots, _ in seen] == [[0], [0], second, second, []]
    internal = {"ce": 0.1, "word_kd": 0.0, "internal_kl": 1.0, "internal_cos": 1.0}
    soft_only = {"ce": 0.1, "word_kd": 1.0, "internal_kl": 0.0, "internal_cos": 0.0}
    assert [weights for _, weights in seen] == [internal] * 4 + [soft_only]
    # Once all pairs are done nothing but the logits is captured.
    assert criterion.student_request.is_empty and criterion.teacher_request.is_empty


def test_all_schedule_and_soft_labels_throughout(kd_task):
    build_tiny_student(kd_task)
    everything = make_internal(kd_task, internal_schedule="all")
    everything.begin_epoch(50)
    assert everything.slots == {"encoder": [0, 1], "decoder": [0, 1]}
    assert everything.loss_weights() == {"ce": 0.0, "word_kd": 1.0, "internal_kl": 1.0, "internal_cos": 1.0}
    throughout = make_internal(kd_task, internal_schedule="sid", internal_soft_labels_throughout=True)
    assert throughout.loss_weights()["word_kd"] == 1.0 and throughout.loss_weights()["internal_kl"] == 1.0


def test_cosine_threshold_uses_the_epoch_mean_over_all_workers(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    other_batch = make_batch(kd_task, ["w5 w9 w2 w2", "w7", "w3 w8 w1 w6 w4"], ["W2 W2 W9 W5", "W7", "W4 W6 W1 W8 W3"])
    probe = make_internal(kd_task, internal_schedule="pid", layer_sides="encoder")
    probe.train()
    logs = [probe(student, batch)[2] for batch in (tiny_batch, other_batch)]  # two "workers"
    sums = [float(log["internal_schedule_cos"]) for log in logs]
    sentences = [log["internal_schedule_sentences"] for log in logs]
    assert sentences == [3, 3] and sums[0] != pytest.approx(sums[1])
    pooled = sum(sums) / sum(sentences)
    for threshold, crosses in ((pooled * 1.001, True), (pooled * 0.999, False)):
        criterion = make_internal(kd_task, internal_schedule="pid", layer_sides="encoder",
                                  internal_cos_threshold=threshold)
        criterion.begin_epoch(1)
        criterion.reduce_worker_logs(logs)  # the task passes all workers' gathered outputs
        assert criterion.epoch_cosine_sums() == pytest.approx((sum(sums), 6.0))
        criterion.begin_epoch(2)
        assert criterion.crossings == ([1] if crosses else [])
        assert criterion.stage == (1 if crosses else 0)
    # Validation batches never count towards the threshold, nor do a worker's dummy batches,
    # which still report the keys (as zeros) so that all workers' logging outputs match.
    criterion.eval()
    _, _, log = criterion(student, tiny_batch)
    assert log["internal_schedule_sentences"] == 0 and float(log["internal_schedule_cos"]) == 0.0
    criterion.train()
    criterion.is_dummy_batch = True
    _, _, log = criterion(student, tiny_batch)
    assert log["internal_schedule_sentences"] == 0 and float(log["internal_schedule_cos"]) == 0.0


def test_schedule_survives_a_stop_and_resume(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    options = dict(internal_schedule="sid", internal_epochs_per_layer=3)
    probe = make_internal(kd_task, **options)
    probe.train()
    log = probe(student, tiny_batch)[2]
    # A threshold the first pair's epoch mean crosses: the schedule moves after epoch 1, not 3.
    threshold = float(log["internal_schedule_cos"]) / log["internal_schedule_sentences"] * 1.01

    uninterrupted = make_internal(kd_task, internal_cos_threshold=threshold, **options)
    uninterrupted.load_state_dict(probe.state_dict())  # the same projections as the probe
    stages = {}
    for epoch in (1, 2):
        uninterrupted.begin_epoch(epoch)
        stages[epoch] = uninterrupted.stage
        epoch_of_training(uninterrupted, student, [tiny_batch])
    saved = uninterrupted.checkpoint_state()  # the end-of-epoch-2 checkpoint
    uninterrupted.begin_epoch(3)
    stages[3] = uninterrupted.stage

    resumed = make_internal(kd_task, internal_cos_threshold=threshold, **options)
    assert resumed.epoch_cosine_sums() == (0.0, 0.0)  # a new criterion starts from empty sums
    resumed.load_state_dict(probe.state_dict())  # what the trainer restores
    resumed.load_checkpoint_state(saved)
    resumed.begin_epoch(3)
    assert stages == {1: 0, 2: 1, 3: resumed.stage}
    assert resumed.crossings == uninterrupted.crossings == [1] + ([2] if stages[3] == 2 else [])
    assert resumed.slots == uninterrupted.slots


# ----------------------------------------------------------------------------- fairseq-train
def stage_lines(text):
    return re.findall(r"internal_kd epoch \d+: .*", text)


def test_internal_kd_trains_and_resumes_with_fairseq_train(tiny_data_bin, tiny_teacher, kd_task, tmp_path):
    # Each pair lasts one epoch here because its mean cosine loss (at most 2) is below 2.0.
    flags = ["--criterion", "internal_kd", "--internal-schedule", "pid", "--internal-epochs-per-layer", "5",
             "--internal-cos-threshold", "2.0", "--layer-sides", "both"]
    straight = train_student(tiny_data_bin, tiny_teacher, tmp_path / "straight", flags, max_update=100,
                             extra=["--max-epoch", "3"])
    text = straight.stdout + straight.stderr
    assert stage_lines(text) == [
        "internal_kd epoch 1: stage 1/2: encoder S1<-T1; decoder S1<-T1",
        "internal_kd epoch 2: stage 2/2: encoder S2<-T3; decoder S2<-T3",
        "internal_kd epoch 3: all pairs done, soft labels only",
    ]
    epochs = re.findall(r"\| train \| epoch (\d+) .*word_kd_loss ([\d.]+) \| internal_kl_loss ([\d.]+) \| internal_cos_loss ([\d.]+)", straight.stdout)
    assert [int(e) for e, *_ in epochs] == [1, 2, 3]
    assert all(float(kl) > 0 and float(kd) == 0 for _, kd, kl, _ in epochs[:2])
    assert float(epochs[2][1]) > 0 and float(epochs[2][2]) == 0
    state = checkpoint(tmp_path / "straight" / "checkpoint_last.pt")
    assert state["extra_state"]["TranslationKDTask"]["criterion"]["crossings"] == [1, 2]
    assert set(state["criterion"]) == {f"projections.{s}.{n}" for s in ("encoder", "decoder") for n in ("weight", "bias")}
    assert not [key for key in state["model"] if "projections" in key]

    # Stop after epoch 1, resume: the crossing of epoch 1 is decided after the resume, from the
    # sums saved in the checkpoint, exactly as in the uninterrupted run.
    split = tmp_path / "split"
    train_student(tiny_data_bin, tiny_teacher, split, flags, max_update=100, extra=["--max-epoch", "1"])
    resumed = train_student(tiny_data_bin, tiny_teacher, split, flags, max_update=100, extra=["--max-epoch", "3"])
    resumed_text = resumed.stdout + resumed.stderr
    assert stage_lines(resumed_text) == stage_lines(text)[1:]
    crossing = re.compile(r"internal_kd: epoch (\d) mean cosine loss ([\d.]+) <")
    straight_crossings, resumed_crossings = crossing.findall(text), crossing.findall(resumed_text)
    # Epoch 1 was trained before the stop, so its mean is the very same number; fairseq does not
    # promise a bit-identical epoch 2 after a resume, only the same decisions.
    assert resumed_crossings[0] == straight_crossings[0]
    assert [epoch for epoch, _ in resumed_crossings] == [epoch for epoch, _ in straight_crossings] == ["1", "2"]


def test_cosine_term_is_a_mean_over_sentences_at_any_length(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    assert_sentence_term_is_a_mean_over_sentences(
        lambda **overrides: make_internal(kd_task, **overrides), student, tiny_batch, "internal_cos")
