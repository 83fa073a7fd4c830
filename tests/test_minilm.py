"""MiniLM (criterion minilm): hand-computed attention and value-relation KL, a slow loop
reference for the whole criterion, padding and identity invariants, start-up errors, and a real
fairseq-train run."""
import copy
import math

import pytest
import torch
from conftest import build_tiny_student
from float_bounds import kl_float32_tolerance
from hidden_kd_support import allowed_entries, assert_invariant_to_batch_padding, train_four_head_student

from fairseq_kd.criterions.minilm import (
    MiniLMConfig,
    MiniLMCriterion,
    head_mean_row_kl,
    value_relation_logits,
)
from fairseq_kd.models.feature_capture import ATTENTION_KINDS, CaptureRequest, FeatureCapture

FOUR_HEADS = {"encoder_attention_heads": 4, "decoder_attention_heads": 4}


def build_minilm(task, **overrides):
    return MiniLMCriterion.build_criterion(MiniLMConfig(sentence_avg=False, **overrides), task)


# ----------------------------------------------------------------------------- hand-computed
def test_attention_kl_by_hand():
    # one sentence, one head, a causal 2x2 map; logits of the teacher give p = (1/4, 3/4) on row 2
    teacher = torch.tensor([[[[5.0, -7.0], [0.0, math.log(3.0)]]]])
    student = torch.tensor([[[[-2.0, 8.0], [1.0, 1.0]]]])  # row 2: uniform
    mask = torch.tensor([[[[True, False], [True, True]]]])
    # row 1 has one attendable key: both distributions are (1), KL 0 whatever the masked logits
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    # float32's error is a few ulps of the log-probabilities the KL sums, not of the KL (see float_bounds)
    rows = [((1.0,), (1.0,)), ((0.25, 0.75), (0.5, 0.5))]
    assert head_mean_row_kl(teacher, student, mask).item() == pytest.approx(expected, abs=kl_float32_tolerance(rows))
    # a second head with KL 0 halves the head mean
    two_heads = head_mean_row_kl(torch.cat([teacher, student], 1), torch.cat([student, student], 1), mask)
    rows += [((1.0,), (1.0,)), ((0.5, 0.5), (0.5, 0.5))]  # the second head's rows; the mean halves the sum
    assert two_heads.item() == pytest.approx(expected / 2, abs=kl_float32_tolerance(rows, scale=0.5))


def test_value_relation_by_hand():
    teacher_values = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # V V^T / sqrt(2) = I / sqrt(2)
    student_values = torch.tensor([[[[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]]])  # every relation equal
    logits = value_relation_logits(teacher_values)
    assert torch.allclose(logits, torch.eye(2).view(1, 1, 2, 2) / math.sqrt(2))
    a = 1 / math.sqrt(2)
    p_same, p_other = math.exp(a) / (math.exp(a) + 1), 1 / (math.exp(a) + 1)
    per_row = p_same * math.log(2 * p_same) + p_other * math.log(2 * p_other)  # KL to uniform
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    value = head_mean_row_kl(logits, value_relation_logits(student_values), mask)
    assert value.item() == pytest.approx(2 * per_row, rel=1e-6)


# --------------------------------------------------------------------------- slow reference
def softmax_over(logits, keys):
    top = max(logits[k] for k in keys)
    norm = sum(math.exp(logits[k] - top) for k in keys)
    return {k: math.exp(logits[k] - top) / norm for k in keys}


def test_minilm_matches_slow_reference(kd_task, tiny_batch):
    student = build_tiny_student(kd_task, **FOUR_HEADS)
    criterion = build_minilm(kd_task, minilm_attention_kinds="all")
    _, _, log = criterion(student, tiny_batch)

    request = CaptureRequest(attention_kinds=ATTENTION_KINDS, attention_values=True)
    with torch.no_grad(), FeatureCapture(student, request) as capture:
        student(**tiny_batch["net_input"])
    s_features = capture.features()
    _, t_features = kd_task.teacher.forward(tiny_batch["net_input"], request)
    pad = kd_task.source_dictionary.pad()
    may_attend = allowed_entries(tiny_batch, pad)
    src = tiny_batch["net_input"]["src_tokens"].tolist()

    def relation_allowed(kind, b, q, k):  # value relation: the attention's mask; source pairs for cross
        if kind == "decoder_cross":
            return src[b][q] != pad and src[b][k] != pad
        return may_attend(kind, b, q, k)

    def relation(values, b, h):  # values[b][h][t][d] of the last layer -> logits[q][k]
        rows = values[b][h]
        scale = len(rows[0]) ** -0.5
        return [[sum(x * y for x, y in zip(rows[q], rows[k])) * scale for k in range(len(rows))]
                for q in range(len(rows))]

    attention = value_relation = 0.0
    for kind in ATTENTION_KINDS:
        s_maps, t_maps = s_features.attention[kind], t_features.attention[kind]
        s_probs, t_probs = s_maps.probs[-1].tolist(), t_maps.probs[-1].tolist()
        s_values, t_values = s_maps.values[-1].tolist(), t_maps.values[-1].tolist()
        for b in range(len(src)):
            for h in range(4):
                for q in range(len(s_probs[b][h])):
                    keys = [k for k in range(len(s_probs[b][h][q])) if may_attend(kind, b, q, k)]
                    attention += sum(t_probs[b][h][q][k] * math.log(t_probs[b][h][q][k] / s_probs[b][h][q][k])
                                     for k in keys) / 4
                s_rel, t_rel = relation(s_values, b, h), relation(t_values, b, h)
                for q in range(len(s_rel)):
                    keys = [k for k in range(len(s_rel)) if relation_allowed(kind, b, q, k)]
                    if not keys:
                        continue
                    p, r = softmax_over(t_rel[q], keys), softmax_over(s_rel[q], keys)
                    value_relation += sum(p[k] * math.log(p[k] / r[k]) for k in keys) / 4
    assert log["attention_kl_loss"].item() == pytest.approx(attention, rel=1e-4)
    assert log["value_relation_loss"].item() == pytest.approx(value_relation, rel=1e-4)
    assert log["loss"].item() == pytest.approx(
        log["ce_loss"].item() + attention + value_relation + log["word_kd_loss"].item(), rel=1e-4)


def test_only_the_requested_kinds_count(kd_task, tiny_batch):
    student = build_tiny_student(kd_task, **FOUR_HEADS)
    self_only = build_minilm(kd_task)
    everything = build_minilm(kd_task, minilm_attention_kinds="all")
    assert self_only.student_request.attention_kinds == ("encoder_self", "decoder_self")
    assert self_only.student_request.attention_values and self_only.student_request.attention_scores
    _, _, small = self_only(student, tiny_batch)
    _, _, large = everything(student, tiny_batch)
    assert 0 < small["attention_kl_loss"].item() < large["attention_kl_loss"].item()
    assert 0 < small["value_relation_loss"].item() < large["value_relation_loss"].item()


# ------------------------------------------------------------------------------- invariants
def test_student_identical_to_teacher_gives_zero_terms(kd_task, tiny_batch):
    task = copy.copy(kd_task)
    task.student_shape = kd_task.teacher.shape
    criterion = build_minilm(task, minilm_attention_kinds="all")
    _, _, log = criterion(kd_task.teacher.model, tiny_batch)
    for term in criterion.TERM_NAMES:
        assert float(log[f"{term}_loss"]) == pytest.approx(0.0, abs=1e-6), term


def test_minilm_is_invariant_to_batch_padding(kd_task):
    student = build_tiny_student(kd_task, **FOUR_HEADS)
    criterion = build_minilm(kd_task, minilm_attention_kinds="all")
    assert_invariant_to_batch_padding(criterion, student, kd_task)


def test_low_precision_values_stay_finite():
    logits = torch.tensor([[[[60000.0, -60000.0, 0.0], [1.0, 2.0, 3.0]]]], dtype=torch.float16)
    mask = torch.tensor([[[[True, True, False], [True, True, True]]]])
    value = head_mean_row_kl(logits, torch.zeros_like(logits), mask)
    assert torch.isfinite(value) and value.dtype == torch.float32


# ------------------------------------------------------------------------------------ errors
def test_unequal_heads_fail_at_start_naming_flags_and_counts(kd_task):
    build_tiny_student(kd_task)  # 2 heads vs the teacher's 4
    with pytest.raises(ValueError) as error:
        build_minilm(kd_task)
    message = str(error.value)
    assert "encoder self attention: student 2 heads, teacher 4 (--encoder-attention-heads)" in message
    assert "decoder self attention: student 2 heads, teacher 4 (--decoder-attention-heads)" in message


def test_negative_weight_fails_at_start(kd_task):
    build_tiny_student(kd_task, **FOUR_HEADS)
    with pytest.raises(ValueError, match="--minilm-vr-weight"):
        build_minilm(kd_task, minilm_vr_weight=-1.0)


# ----------------------------------------------------------------------------- fairseq-train
def test_minilm_fairseq_train(tiny_data_bin, tiny_teacher, tmp_path):
    records = train_four_head_student(tiny_data_bin, tiny_teacher, tmp_path / "minilm", "minilm")
    assert len(records) == 3
    for record in records:
        v = record.values
        assert min(v["attention_kl_loss"], v["value_relation_loss"], v["word_kd_loss"]) > 0
        assert v["loss"] == pytest.approx(
            v["ce_loss"] + v["attention_kl_loss"] + v["value_relation_loss"] + v["word_kd_loss"], abs=0.004)
