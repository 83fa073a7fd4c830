"""tie_kd: the hierarchical ranking loss against a slow reference and where its minimum lies, padding,
weight 0 as fairseq's label-smoothed CE, and one fairseq-train run."""
import math
import re

import pytest
import torch

from conftest import build_tiny_student, make_batch, train_student
from hidden_kd_support import assert_reduces_to_label_smoothed_ce, build_criterion
from fairseq_kd.criterions.chunked import word_level_kd
from fairseq_kd.criterions.tie_kd import TieKDCriterion, hierarchical_ranking_loss


def slow_ranking_loss(student_logits, teacher_logits, mask, k):
    """L_HR position by position from the paper's two levels (float64), differentiable in the student."""
    total = torch.zeros((), dtype=torch.float64)
    for b in range(mask.size(0)):
        for t in range(mask.size(1)):
            if not mask[b, t]:
                continue
            p = torch.softmax(teacher_logits[b, t].double(), -1)
            q = torch.softmax(student_logits[b, t].double(), -1)
            teacher_top = sorted(range(p.numel()), key=lambda v: -float(p[v]))[:k]
            student_top = sorted(range(q.numel()), key=lambda v: -float(q[v]))[:k]
            for i in teacher_top[1:]:  # level 1: the teacher's top-1 first among its top k
                total = total + torch.clamp(q[i] - q[teacher_top[0]], min=0)
            for i in teacher_top:  # level 2: no token the teacher ranks lower above one of its top k
                for j in student_top:
                    if float(p[i]) > float(p[j]):
                        total = total + torch.clamp(q[j] - q[i], min=0)
    return total


def _logits(seed, shape=(2, 4, 9)):
    generator = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(*shape, generator=generator)


@pytest.mark.parametrize("k", [2, 5])
def test_ranking_loss_matches_the_slow_reference_value_and_gradient(k):
    student, teacher = _logits(0), _logits(1)
    mask = torch.tensor([[True, True, False, True], [True, False, True, False]])
    student.requires_grad_()
    loss = hierarchical_ranking_loss(student, teacher, mask, k)
    (2.0 * loss).backward()
    reference_logits = student.detach().double().requires_grad_()
    reference = slow_ranking_loss(reference_logits, teacher, mask, k)
    (2.0 * reference).backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-7)
    assert reference.item() > 0
    torch.testing.assert_close(student.grad.double(), reference_logits.grad, atol=1e-6, rtol=1e-5)
    assert (student.grad[~mask] == 0).all()


def test_minimum_where_the_student_ranks_the_teachers_top_tokens_as_the_teacher():
    """Zero when the student orders tokens as the teacher (any monotone map of its logits, so not
    the KL's minimum alone); positive when the student's top-1 is another of the teacher's top k,
    and a step down its gradient raises the student's probability of the teacher's top-1."""
    teacher = _logits(2)
    mask = torch.ones(2, 4, dtype=torch.bool)
    assert hierarchical_ranking_loss(teacher, teacher, mask, 5).item() == 0
    rescaled = 0.3 * teacher + 1.0
    assert hierarchical_ranking_loss(rescaled, teacher, mask, 5).item() == 0
    assert word_level_kd(rescaled, teacher, mask).item() > 0.1
    swapped = teacher.clone()
    top = teacher.topk(2, dim=-1).indices
    first, second = teacher.gather(-1, top[..., :1]), teacher.gather(-1, top[..., 1:])
    swapped.scatter_(-1, top[..., :1], second).scatter_(-1, top[..., 1:], first)
    swapped.requires_grad_()
    loss = hierarchical_ranking_loss(swapped, teacher, mask, 5)
    assert loss.item() > 0
    loss.backward()
    stepped = (swapped - 1.0 * swapped.grad).detach()
    q_before = torch.softmax(swapped.detach(), -1).gather(-1, top[..., :1])
    q_after = torch.softmax(stepped, -1).gather(-1, top[..., :1])
    assert (q_after > q_before).all()


def test_ranking_loss_ignores_padding_and_stays_finite_in_half_precision():
    student, teacher = _logits(3), _logits(4)
    mask = torch.tensor([[True, False, True, False], [True, True, False, False]])
    noisy = torch.where(mask[..., None], student, 1e3 * _logits(5))
    base = hierarchical_ranking_loss(student, teacher, mask, 5).item()
    assert hierarchical_ranking_loss(noisy, teacher, mask, 5).item() == pytest.approx(base, rel=1e-6)
    for dtype in (torch.float16, torch.bfloat16):
        half = (20 * student).to(dtype).requires_grad_()
        loss = hierarchical_ranking_loss(half, (20 * teacher).to(dtype), mask, 5)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(half.grad).all() and half.grad.dtype == dtype


@pytest.fixture
def make_tie_kd(kd_task):
    def make(**overrides):
        options = dict(label_smoothing=0.1, kd_weight=0.5)
        options.update(overrides)
        return build_criterion(TieKDCriterion, kd_task, **options)
    return make


def test_criterion_is_ce_plus_kd_plus_the_ranking_term(kd_task, tiny_batch, make_tie_kd):
    student = build_tiny_student(kd_task)
    criterion = make_tie_kd(kd_weight=0.4, tie_rank_weight=2.0, tie_topk=3)
    loss, _, log = criterion(student, tiny_batch)
    word = make_tie_kd(kd_weight=0.4, tie_rank_weight=0.0)
    word_loss, _, word_log = word(student, tiny_batch)
    with torch.no_grad():
        student_logits = student(**tiny_batch["net_input"])[0]
        teacher_logits = kd_task.teacher.model(**tiny_batch["net_input"])[0]
    mask = tiny_batch["target"].ne(kd_task.target_dictionary.pad())
    reference = slow_ranking_loss(student_logits, teacher_logits, mask, 3).item()
    assert log["tie_rank_loss"].item() == pytest.approx(reference, rel=1e-5)
    assert word_log["tie_rank_loss"] == 0.0
    assert loss.item() == pytest.approx(word_loss.item() + 0.4 * 2.0 * reference, rel=1e-5)


def test_padding_of_the_batch_changes_nothing(kd_task, make_tie_kd):
    student = build_tiny_student(kd_task)
    criterion = make_tie_kd()
    sources, targets = ["w1 w2 w3", "w4 w5 w6 w7 w8 w9", "w10 w11"], ["W3 W2 W1", "W9 W8 W7 W6 W5 W4", "W11 W10"]
    _, _, batched = criterion(student, make_batch(kd_task, sources, targets))
    for term in criterion.TERM_NAMES:
        alone = sum(criterion(student, make_batch(kd_task, [s], [t]))[2][f"{term}_loss"].item()
                    for s, t in zip(sources, targets))
        assert batched[f"{term}_loss"].item() == pytest.approx(alone, rel=1e-4), term


def test_weight_zero_is_label_smoothed_cross_entropy(kd_task, tiny_batch, make_tie_kd):
    assert_reduces_to_label_smoothed_ce(make_tie_kd(kd_weight=0.0), build_tiny_student(kd_task), tiny_batch)


def test_an_identical_student_has_no_ranking_loss(kd_task, tiny_batch, make_tie_kd):
    _, _, log = make_tie_kd()(kd_task.teacher.model, tiny_batch)
    assert log["tie_rank_loss"].item() == 0 and abs(log["word_kd_loss"].item()) < 1e-5


def test_trains_through_fairseq_train(tiny_data_bin, tiny_teacher, tmp_path):
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path, ["--criterion", "tie_kd", "--kd-divergence", "jsd"],
                         max_update=3)
    values = re.findall(r"\btie_rank_loss=([^\s,|]+)", proc.stdout + proc.stderr)
    assert values and all(math.isfinite(float(v)) and float(v) > 0 for v in values), values
