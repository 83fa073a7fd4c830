"""word_kd: the loss against hand-computed numbers and a slow reference, and its invariants."""
import copy
import math

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

from conftest import build_tiny_student
from float_bounds import kl_float32_tolerance
from hidden_kd_support import build_criterion
from fairseq_kd.criterions.base import KDCriterionBase
from fairseq_kd.criterions.losses import word_level_kd
from fairseq_kd.criterions.word_kd import WordKDCriterion

#: tests/test_multirank.py's runs of this criterion (2 CPU ranks equal 1 rank with --update-freq 2):
#: run name -> flags after --criterion NAME
# on-policy at rate 1: every micro-batch generated, so two ranks must make the samples one rank
# makes with --update-freq 2 (the draw is keyed on the update's seed and the batch's ids)
MULTI_RANK_RUNS = {"word_kd": [], "word_kd_on_policy": ["--on-policy-rate", "1", "--kd-divergence", "jsd"]}


def _criterion(task, kd_weight=0.5, temperature=1.0):
    return build_criterion(WordKDCriterion, task, label_smoothing=0.1, kd_weight=kd_weight,
                           kd_temperature=temperature)


def test_word_level_kd_hand_computed_with_padding():
    # one sentence, two real positions and one padded position, vocabulary of 3
    teacher = torch.tensor([[[0.0, math.log(3.0), 0.0], [0.0, 0.0, 0.0], [9.0, -9.0, 4.0]]])
    student = torch.tensor([[[0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0], [-5.0, 7.0, 1.0]]])
    mask = torch.tensor([[True, True, False]])
    # position 1: p = (1/5, 3/5, 1/5), q uniform -> KL = 2/5 ln(3/5) + 3/5 ln(9/5)
    kl1 = 2 / 5 * math.log(3 / 5) + 3 / 5 * math.log(9 / 5)
    # position 2: p uniform, q = (1/2, 1/4, 1/4) -> KL = 1/3 (ln(2/3) + 2 ln(4/3))
    kl2 = (math.log(2 / 3) + 2 * math.log(4 / 3)) / 3
    # float32's error is a few ulps of the log-probabilities the KL sums, not of the KL (see float_bounds)
    rows = [((1 / 5, 3 / 5, 1 / 5), (1 / 3,) * 3), ((1 / 3,) * 3, (1 / 2, 1 / 4, 1 / 4))]
    assert word_level_kd(student, teacher, mask).item() == pytest.approx(kl1 + kl2, abs=kl_float32_tolerance(rows))
    # temperature 2: p = (1, sqrt 3, 1)/(2 + sqrt 3), q uniform, times tau^2 = 4 (position 1), and
    # p uniform, q ∝ (sqrt 2, 1, 1) (position 2)
    z = 2 + math.sqrt(3)
    p = [1 / z, math.sqrt(3) / z, 1 / z]
    kl1_t = sum(pi * math.log(3 * pi) for pi in p)
    qz = math.sqrt(2) + 2
    q = [math.sqrt(2) / qz, 1 / qz, 1 / qz]
    kl2_t = sum(1 / 3 * math.log((1 / 3) / qi) for qi in q)
    rows_t = [(p, (1 / 3,) * 3), ((1 / 3,) * 3, q)]
    assert word_level_kd(student, teacher, mask, temperature=2.0).item() == pytest.approx(
        4 * (kl1_t + kl2_t), abs=kl_float32_tolerance(rows_t, scale=4))


def _slow_reference_kd(student_logits, teacher_logits, target, pad, temperature):
    total = 0.0
    for b in range(target.size(0)):
        for t in range(target.size(1)):
            if target[b, t] == pad:
                continue
            p = torch.softmax(teacher_logits[b, t].double() / temperature, -1)
            q = torch.softmax(student_logits[b, t].double() / temperature, -1)
            total += sum(float(p[v]) * math.log(float(p[v] / q[v])) for v in range(p.numel()) if p[v] > 0)
    return temperature**2 * total


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_word_level_kd_gradient_matches_autograd_through_a_per_position_reference(temperature, dtype):
    """word_level_kd forms its gradient in the forward pass; it equals autograd's gradient of the
    KL written position by position here (float64), is zero at masked positions, arrives in the
    logits' dtype and scales with the upstream gradient."""
    torch.manual_seed(0)
    student = (3 * torch.randn(2, 4, 7)).to(dtype).requires_grad_()
    teacher = (3 * torch.randn(2, 4, 7)).to(dtype)
    mask = torch.tensor([[True, True, False, True], [True, False, False, False]])
    (2.5 * word_level_kd(student, teacher, mask, temperature)).backward()

    reference_logits = student.detach().double().requires_grad_()
    reference = 0.0
    for b in range(2):
        for t in range(4):
            if mask[b, t]:
                p = torch.softmax(teacher[b, t].double() / temperature, -1)
                log_q = torch.log_softmax(reference_logits[b, t] / temperature, -1)
                reference = reference + temperature**2 * (p * (p.log() - log_q)).sum()
    (2.5 * reference).backward()
    assert student.grad.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(student.grad.double(), reference_logits.grad, atol=tolerance, rtol=tolerance)
    assert (student.grad[~mask] == 0).all() and student.grad[mask].abs().sum() > 0
    with torch.no_grad():
        assert word_level_kd(student, teacher, mask, temperature).item() == pytest.approx(
            reference.item(), rel=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kd_weight,temperature", [(0.5, 1.0), (0.3, 2.0)])
def test_criterion_equals_weighted_fairseq_ce_plus_slow_reference(kd_task, tiny_batch, kd_weight, temperature):
    student = build_tiny_student(kd_task)
    criterion = _criterion(kd_task, kd_weight, temperature)
    loss, sample_size, log = criterion(student, tiny_batch)
    fairseq_ce = LabelSmoothedCrossEntropyCriterion(kd_task, sentence_avg=False, label_smoothing=0.1)
    ce, _, ce_log = fairseq_ce(student, tiny_batch)
    student_logits = student(**tiny_batch["net_input"])[0]
    teacher_logits = kd_task.teacher.model(**tiny_batch["net_input"])[0]
    kd = _slow_reference_kd(student_logits, teacher_logits, tiny_batch["target"], kd_task.target_dictionary.pad(), temperature)
    assert log["word_kd_loss"].item() == pytest.approx(kd, rel=1e-5)
    assert loss.item() == pytest.approx((1 - kd_weight) * ce.item() + kd_weight * kd, rel=1e-5)
    assert sample_size == tiny_batch["ntokens"] == ce_log["sample_size"]


def test_weight_zero_is_exactly_fairseqs_criterion_and_skips_the_teacher(kd_task, tiny_batch, monkeypatch):
    student = build_tiny_student(kd_task)
    criterion = _criterion(kd_task, kd_weight=0.0)
    monkeypatch.setattr(kd_task.teacher, "forward", lambda *a, **k: pytest.fail("teacher ran at weight 0"))
    loss, sample_size, log = criterion(student, tiny_batch)
    ce, ce_size, ce_log = LabelSmoothedCrossEntropyCriterion(kd_task, False, 0.1)(student, tiny_batch)
    assert torch.equal(loss, ce) and sample_size == ce_size
    assert torch.equal(log["nll_loss"], ce_log["nll_loss"])


def test_padding_does_not_change_the_loss(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    criterion = _criterion(kd_task)
    loss, _, _ = criterion(student, tiny_batch)
    # the same sentences batched with a much longer one: more padding for these three
    from conftest import make_batch

    padded = make_batch(kd_task, ["w1 w2 w3", "w4 w5 w6 w7 w8 w9", "w10 w11", " ".join(["w12"] * 20)],
                        ["W3 W2 W1", "W9 W8 W7 W6 W5 W4", "W11 W10", " ".join(["W12"] * 20)])
    single = make_batch(kd_task, [" ".join(["w12"] * 20)], [" ".join(["W12"] * 20)])
    loss_padded, _, _ = criterion(student, padded)
    loss_single, _, _ = criterion(student, single)
    assert (loss_padded - loss_single).item() == pytest.approx(loss.item(), rel=1e-4)


def test_identical_student_gives_zero_kd(kd_task, tiny_batch):
    criterion = _criterion(kd_task)
    _, _, log = criterion(kd_task.teacher.model, tiny_batch)
    assert abs(log["word_kd_loss"].item()) < 1e-5


def test_gradients_reach_the_student_only(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    student.train()
    criterion = _criterion(kd_task)
    loss, _, _ = criterion(student, tiny_batch)
    loss.backward()
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    assert all(p.grad is None and not p.requires_grad for p in kd_task.teacher.model.parameters())
    assert not kd_task.teacher.model.training


def test_teacher_follows_the_student_dtype_and_fp16_values_stay_finite(kd_task, tiny_batch):
    student = build_tiny_student(kd_task).to(torch.bfloat16)
    criterion = _criterion(kd_task)
    # Following the student to bfloat16 rounds the teacher's weights for good (float() does not
    # restore them): this criterion gets its own copy so that later tests see the exact teacher.
    criterion.teacher = copy.deepcopy(criterion.teacher)
    loss, _, log = criterion(student, tiny_batch)
    assert next(criterion.teacher.model.parameters()).dtype == torch.bfloat16
    assert torch.isfinite(loss) and torch.isfinite(log["word_kd_loss"])
    half_logits = torch.randn(2, 3, 50).half() * 60  # large fp16 logits: softmax must not overflow
    assert torch.isfinite(word_level_kd(half_logits, half_logits.flip(-1), torch.ones(2, 3, dtype=torch.bool)))


def test_reduce_metrics_logs_each_term_normalised_like_fairseq():
    from fairseq.logging import metrics

    logs = [{"loss": 6.0, "ce_loss": 8.0, "nll_loss": 7.0, "word_kd_loss": 4.0, "ntokens": 10,
             "nsentences": 2, "sample_size": 10}] * 2
    with metrics.aggregate() as agg:
        WordKDCriterion.reduce_metrics(logs)
    values = agg.get_smoothed_values()
    assert values["word_kd_loss"] == pytest.approx(8.0 / 20 / math.log(2), abs=1e-3)
    assert values["ce_loss"] == pytest.approx(16.0 / 20 / math.log(2), abs=1e-3)
    assert values["loss"] == pytest.approx(12.0 / 20 / math.log(2), abs=1e-3)


def test_bad_weights_and_missing_teacher_are_clear_errors(kd_task):
    with pytest.raises(ValueError, match="--kd-weight"):
        _criterion(kd_task, kd_weight=1.5)
    with pytest.raises(ValueError, match="--kd-temperature"):
        _criterion(kd_task, temperature=0.0)
    teacher = kd_task.teacher
    kd_task.teacher = None
    try:
        with pytest.raises(ValueError, match="--teacher-checkpoint"):
            _criterion(kd_task)
    finally:
        kd_task.teacher = teacher
    assert issubclass(WordKDCriterion, KDCriterionBase)


def test_word_level_kd_gives_a_teacher_that_requires_grad_its_gradient_too():
    """A jointly trained teacher keeps its gradient: the loss matches the autograd formula on both
    sides (the fused path forms only the student's)."""
    torch.manual_seed(1)
    student = torch.randn(2, 3, 5, requires_grad=True)
    teacher = torch.randn(2, 3, 5, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    word_level_kd(student, teacher, mask, 2.0).backward()
    ref_student = student.detach().clone().requires_grad_()
    ref_teacher = teacher.detach().clone().requires_grad_()
    log_q = torch.log_softmax(ref_student / 2.0, -1)
    log_p = torch.log_softmax(ref_teacher / 2.0, -1)
    (4.0 * (log_p.exp() * (log_p - log_q)).sum(-1)[mask].sum()).backward()
    torch.testing.assert_close(student.grad, ref_student.grad)
    torch.testing.assert_close(teacher.grad, ref_teacher.grad)
    assert teacher.grad.abs().sum() > 0
