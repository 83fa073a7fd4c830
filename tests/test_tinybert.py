"""TinyBERT (criterion tinybert): hand-computed losses, a slow loop reference for the whole
criterion, padding and identity invariants, start-up errors, and real fairseq-train runs."""
import copy
import math

import pytest
import torch
from conftest import build_tiny_student, train_student
from hidden_kd_support import allowed_entries, assert_invariant_to_batch_padding, train_four_head_student
from torch import nn

from fairseq_kd.criterions.tinybert import TinyBERTConfig, TinyBERTCriterion, attention_score_mse, hidden_mse
from fairseq_kd.models.feature_capture import ATTENTION_KINDS, CaptureRequest, FeatureCapture

FOUR_HEADS = {"encoder_attention_heads": 4, "decoder_attention_heads": 4}


def build_tinybert(task, **overrides):
    return TinyBERTCriterion.build_criterion(TinyBERTConfig(sentence_avg=False, **overrides), task)


# ----------------------------------------------------------------------------- hand-computed
def test_attention_score_mse_by_hand():
    # one student layer and the teacher layer mapped to it; one sentence, two heads, a causal 2x2 map
    student = torch.tensor([[[[[1.0, 5.0], [2.0, 3.0]], [[0.0, 0.0], [1.0, 1.0]]]]])
    teacher = torch.tensor([[[[[0.0, 9.0], [4.0, 1.0]], [[2.0, 7.0], [1.0, 3.0]]]]])
    attendable = torch.tensor([[[[True, False], [True, True]]]])
    # head 1: query 1 sees key 1 only: (1-0)^2 = 1; query 2: ((2-4)^2 + (3-1)^2) / 2 = 4
    # head 2: query 1: (0-2)^2 = 4;               query 2: ((1-1)^2 + (1-3)^2) / 2 = 2
    # mean over heads per query: 2.5 and 3; summed: 5.5 (the masked scores 5 vs 9, 0 vs 7 excluded)
    assert attention_score_mse(student, teacher, attendable).item() == pytest.approx(5.5)


def test_hidden_mse_by_hand():
    student = torch.tensor([
        [[[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]],  # h^0 (B=1, T=3, d=2)
        [[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]],  # h^1, the mapped one
    ])
    teacher = torch.tensor([
        [[[5.0, 5.0], [5.0, 5.0], [5.0, 5.0]]],  # h^0
        [[[7.0, 7.0], [7.0, 7.0], [7.0, 7.0]]],  # h^1
        [[[1.0, 0.0], [3.0, 3.0], [0.0, 0.0]]],  # h^2, the mapped one
    ])
    padding = torch.tensor([[False, False, True]])
    # position 1: (0^2 + 2^2) / 2 = 2; position 2: (0^2 + 1^2) / 2 = 0.5; position 3 is padding
    assert hidden_mse(nn.Identity(), student, (1,), teacher, (2,), padding).item() == pytest.approx(2.5)
    assert hidden_mse(nn.Identity(), student[:, :, :1], (1,), teacher[:, :, :1], (0,), padding[:, :1]).item() == (
        pytest.approx(((1 - 5) ** 2 + (2 - 5) ** 2) / 2))
    # through a map of the student's 2 features to 3: W h + b at position 1 is (1, 4, 3.5), at 2
    # (3, 8, 7.5); against a teacher of 3 features
    projection = nn.Linear(2, 3)
    with torch.no_grad():
        projection.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]))
        projection.bias.copy_(torch.tensor([0.0, 0.0, 0.5]))
    wide_teacher = torch.tensor([[[[1.0, 4.0, 3.5], [3.0, 8.0, 4.5], [0.0, 0.0, 0.0]]]])
    # position 1 matches exactly; position 2: (0 + 0 + 3^2) / 3 = 3
    assert hidden_mse(projection, student, (1,), wide_teacher, (0,), padding).item() == pytest.approx(3.0)


# --------------------------------------------------------------------------- slow reference
def loop_linear(module, vector):
    if isinstance(module, nn.Identity):
        return list(vector)
    weight, bias = module.weight.tolist(), module.bias.tolist()
    return [sum(w * x for w, x in zip(row, vector)) + b for row, b in zip(weight, bias)]


def test_tinybert_matches_slow_reference(kd_task, tiny_batch):
    student = build_tiny_student(kd_task, **FOUR_HEADS)  # 2 layers, width 16; teacher 3 layers, width 32
    criterion = build_tinybert(kd_task)
    _, _, log = criterion(student, tiny_batch)

    request = CaptureRequest(encoder_hidden=True, decoder_hidden=True, attention_kinds=ATTENTION_KINDS,
                             attention_scores=True)
    with torch.no_grad(), FeatureCapture(student, request) as capture:
        student(**tiny_batch["net_input"])
    s_features = capture.features()
    _, t_features = kd_task.teacher.forward(tiny_batch["net_input"], request)
    pad = kd_task.source_dictionary.pad()
    src = tiny_batch["net_input"]["src_tokens"].tolist()
    prev = tiny_batch["net_input"]["prev_output_tokens"].tolist()
    mapping = [j * 3 // 2 for j in (1, 2)]  # uniform: student layer j <- teacher layer j*n/m
    assert mapping == [1, 3]
    may_attend = allowed_entries(tiny_batch, pad)

    attention = 0.0
    for kind in ATTENTION_KINDS:
        s_scores = s_features.attention[kind].scores.tolist()
        t_scores = t_features.attention[kind].scores.tolist()
        for j, g in enumerate(mapping):
            for b in range(len(src)):
                for q in range(len(s_scores[0][0][0])):
                    per_head = []
                    for h in range(4):
                        keys = [k for k in range(len(s_scores[0][0][0][0])) if may_attend(kind, b, q, k)]
                        if keys:
                            per_head.append(sum((s_scores[j][b][h][q][k] - t_scores[g - 1][b][h][q][k]) ** 2
                                                for k in keys) / len(keys))
                    if per_head:
                        attention += sum(per_head) / 4
    assert log["att_score_loss"].item() == pytest.approx(attention, rel=1e-4)

    hidden = embedding = 0.0
    for side, tokens in (("encoder", src), ("decoder", prev)):
        s_states, t_states = s_features.hidden(side).tolist(), t_features.hidden(side).tolist()
        for b, row in enumerate(tokens):
            for t, token in enumerate(row):
                if token == pad:
                    continue
                for j, g in enumerate(mapping, start=1):
                    projected = loop_linear(criterion.hidden_projections[side], s_states[j][b][t])
                    hidden += sum((x - y) ** 2 for x, y in zip(projected, t_states[g][b][t])) / len(projected)
                projected = loop_linear(criterion.embedding_projections[side], s_states[0][b][t])
                embedding += sum((x - y) ** 2 for x, y in zip(projected, t_states[0][b][t])) / len(projected)
    assert log["hidden_loss"].item() == pytest.approx(hidden, rel=1e-4)
    assert log["embedding_loss"].item() == pytest.approx(embedding, rel=1e-4)
    assert float(log["word_kd_loss"]) > 0
    assert log["loss"].item() == pytest.approx(
        log["ce_loss"].item() + attention + hidden + embedding + log["word_kd_loss"].item(), rel=1e-4)


def test_projections_exist_only_where_widths_differ(kd_task):
    build_tiny_student(kd_task, **FOUR_HEADS)
    narrow = build_tinybert(kd_task)
    assert isinstance(narrow.hidden_projections["encoder"], nn.Linear)
    assert narrow.hidden_projections["encoder"].weight.shape == (32, 16)
    assert "embedding_projections.decoder.weight" in narrow.state_dict()
    build_tiny_student(kd_task, encoder_embed_dim=32, decoder_embed_dim=32, **FOUR_HEADS)
    wide = build_tinybert(kd_task)
    assert isinstance(wide.hidden_projections["encoder"], nn.Identity) and not list(wide.parameters())
    no_hidden = build_tinybert(kd_task, tinybert_hidden_weight=0.0, tinybert_emb_weight=0.0)
    assert not no_hidden.student_request.encoder_hidden and len(no_hidden.hidden_projections) == 0


# ------------------------------------------------------------------------------- invariants
def test_student_identical_to_teacher_gives_zero_terms(kd_task, tiny_batch):
    task = copy.copy(kd_task)
    task.student_shape = kd_task.teacher.shape
    criterion = build_tinybert(task)
    assert criterion.mapping == {"encoder": (1, 2, 3), "decoder": (1, 2, 3)}
    _, _, log = criterion(kd_task.teacher.model, tiny_batch)
    for term in criterion.TERM_NAMES:
        assert float(log[f"{term}_loss"]) == pytest.approx(0.0, abs=1e-5), term


def test_tinybert_is_invariant_to_batch_padding(kd_task):
    student = build_tiny_student(kd_task, **FOUR_HEADS)
    criterion = build_tinybert(kd_task)
    assert_invariant_to_batch_padding(criterion, student, kd_task)


# ------------------------------------------------------------------------------------ errors
def test_unequal_heads_fail_at_start_naming_flags_and_counts(kd_task):
    build_tiny_student(kd_task, encoder_attention_heads=4, decoder_attention_heads=2)
    with pytest.raises(ValueError) as error:
        build_tinybert(kd_task)
    message = str(error.value)
    assert "decoder self attention: student 2 heads, teacher 4 (--decoder-attention-heads)" in message
    assert "encoder self attention" not in message and "a2d_kd" in message


def test_deeper_student_fails_at_start(kd_task):
    build_tiny_student(kd_task, encoder_layers=4, **FOUR_HEADS)
    with pytest.raises(ValueError, match=r"--encoder-layers <= 3"):
        build_tinybert(kd_task)


@pytest.mark.parametrize("flag,value", [("tinybert_att_weight", -1.0), ("kd_temperature", 0.0)])
def test_bad_options_fail_at_start(kd_task, flag, value):
    build_tiny_student(kd_task, **FOUR_HEADS)
    with pytest.raises(ValueError, match=flag.replace("_", "-")):
        build_tinybert(kd_task, **{flag: value})


# ----------------------------------------------------------------------------- fairseq-train
def test_tinybert_fairseq_train(tiny_data_bin, tiny_teacher, tmp_path):
    records = train_four_head_student(tiny_data_bin, tiny_teacher, tmp_path / "tinybert", "tinybert")
    assert len(records) == 3
    for record in records:
        v = record.values
        assert min(v["att_score_loss"], v["hidden_loss"], v["embedding_loss"], v["word_kd_loss"]) > 0
        assert v["loss"] == pytest.approx(v["ce_loss"] + v["att_score_loss"] + v["hidden_loss"]
                                          + v["embedding_loss"] + v["word_kd_loss"], abs=0.005)
    assert math.isfinite(records[-1].values["loss"])


def test_tinybert_fairseq_train_refuses_unequal_heads(tiny_data_bin, tiny_teacher, tmp_path):
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path / "bad", ["--criterion", "tinybert"],
                         max_update=1, refused=True)
    assert proc.returncode != 0
    assert "encoder self attention: student 2 heads, teacher 4 (--encoder-attention-heads)" in proc.stderr
    assert not (tmp_path / "bad" / "checkpoint_last.pt").exists()
