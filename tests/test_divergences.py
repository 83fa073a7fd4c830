"""--kd-divergence: each divergence against a slow reference written here from its definition
(value and gradient, padding, temperature, half precision), zero for a student equal to its
teacher, non-negative, chunked equal to unchunked, fused with CE equal to apart; over the live
teacher and the top-k cache; and through the criterions (word_kd, selective_kd)."""
import math

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

from conftest import build_tiny_student
from hidden_kd_support import build_criterion
from fairseq_kd.criterions.chunked import (DIVERGENCES, Divergence, label_smoothed_ce_and_word_kd,
                                           label_smoothed_cross_entropy, word_level_divergence, word_level_kd)
from fairseq_kd.criterions.selective_kd import SelectiveKDCriterion
from fairseq_kd.criterions.word_kd import WordKDCriterion
from fairseq_kd.errors import InputError

BETA, ALPHA = 0.3, 0.2
CACHE_DIVERGENCES = [name for name in DIVERGENCES if name != "reverse_kl"]


def slow_divergence(name, p, q):
    """D(p, q) of one position, p the teacher's distribution, q the student's (1-D, float64 tensors),
    from the definitions of docs/methods/divergences.md; a torch scalar differentiable in q."""
    def kl(a, b):  # sum a log(a / b), 0 log 0 = 0
        terms = [a[v] * (torch.log(a[v]) - torch.log(b[v])) for v in range(a.numel()) if float(a[v].detach()) > 0]
        return sum(terms) if terms else torch.zeros((), dtype=torch.float64)

    if name == "forward_kl":
        return kl(p, q)
    if name == "reverse_kl":
        return kl(q, p)
    if name == "jsd":  # GKD: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
        m = BETA * p + (1 - BETA) * q
        return BETA * kl(p, m) + (1 - BETA) * kl(q, m)
    if name == "skew_kl":  # DistiLLM: KL(p || alpha p + (1 - alpha) q)
        return kl(p, ALPHA * p + (1 - ALPHA) * q)
    if name == "skew_reverse_kl":  # DistiLLM: KL(q || alpha q + (1 - alpha) p)
        return kl(q, ALPHA * q + (1 - ALPHA) * p)
    return 0.5 * sum((p[v] - q[v]).abs() for v in range(p.numel()))


def slow_reference(name, student, teacher_probs, mask, temperature):
    """tau^2 sum over masked positions of D(p, q), with its gradient w.r.t. the student's logits."""
    logits = student.detach().double().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for b in range(mask.size(0)):
        for t in range(mask.size(1)):
            if mask[b, t]:
                q = torch.softmax(logits[b, t] / temperature, -1)
                total = total + temperature**2 * slow_divergence(name, teacher_probs[b, t], q)
    total.backward()
    return total.item(), logits.grad


def _inputs(seed=0, shape=(2, 4, 7)):
    torch.manual_seed(seed)
    student = 3 * torch.randn(*shape)
    teacher = 3 * torch.randn(*shape)
    mask = torch.tensor([[True, True, False, True], [True, False, False, True]])
    return student, teacher, mask


def _divergence(name):
    return Divergence(name, beta=BETA, alpha=ALPHA)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("name", DIVERGENCES)
def test_live_divergence_matches_the_slow_reference_value_and_gradient(name, temperature):
    student, teacher, mask = _inputs()
    student.requires_grad_()
    (1.5 * word_level_divergence(student, teacher, mask, _divergence(name), temperature, rows=3)).backward()
    probs = torch.softmax(teacher.double() / temperature, -1)
    value, gradient = slow_reference(name, student, probs, mask, temperature)
    with torch.no_grad():
        assert word_level_divergence(student, teacher, mask, _divergence(name), temperature).item() == pytest.approx(
            value, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(student.grad.double(), 1.5 * gradient, atol=1e-5, rtol=1e-4)
    assert (student.grad[~mask] == 0).all()


def _topk(teacher, k):
    log_probs = torch.log_softmax(teacher, -1)
    return log_probs.topk(k, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("name", CACHE_DIVERGENCES)
def test_cached_divergence_is_the_divergence_from_the_renormalised_top_k(name, temperature):
    """Over the cache, p is the teacher renormalised to its k tokens at tau and 0 elsewhere, the
    student its full-vocabulary distribution: the distribution the cache's forward KL uses."""
    student, teacher, mask = _inputs(1)
    values, ids = _topk(teacher, 3)
    student.requires_grad_()
    word_level_divergence(student, None, mask, _divergence(name), temperature, rows=2,
                          teacher_topk=(values, ids)).backward()
    probs = torch.zeros(teacher.shape, dtype=torch.float64)
    probs.scatter_(-1, ids, torch.softmax(values.double() / temperature, -1))
    value, gradient = slow_reference(name, student, probs, mask, temperature)
    with torch.no_grad():
        got = word_level_divergence(student, None, mask, _divergence(name), temperature, teacher_topk=(values, ids))
    assert got.item() == pytest.approx(value, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(student.grad.double(), gradient, atol=1e-5, rtol=1e-4)


def test_cached_forward_kl_through_the_divergence_path_equals_todays_function():
    from fairseq_kd.criterions.chunked import topk_word_level_kd

    student, teacher, mask = _inputs(2)
    values, ids = _topk(teacher, 4)
    generic = word_level_divergence(student, None, mask, _divergence("forward_kl"), 2.0, teacher_topk=(values, ids))
    assert generic.item() == pytest.approx(topk_word_level_kd(student, values, ids, mask, 2.0).item(), rel=1e-6)
    live = word_level_divergence(student, teacher, mask, _divergence("forward_kl"), 2.0)
    assert live.item() == pytest.approx(word_level_kd(student, teacher, mask, 2.0).item(), rel=1e-6)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_zero_for_a_student_equal_to_its_teacher_and_non_negative(name):
    student, teacher, mask = _inputs(3)
    for temperature in (1.0, 2.0):
        same = word_level_divergence(teacher.clone().requires_grad_(), teacher, mask, _divergence(name), temperature)
        assert abs(same.item()) < 1e-5
        for seed in range(5):
            other, _, _ = _inputs(10 + seed)
            assert word_level_divergence(other, teacher, mask, _divergence(name), temperature).item() >= -1e-6
    if name != "reverse_kl":
        values, ids = _topk(teacher, 3)
        # a student that is the renormalised top k (its other logits far below)
        equal = torch.full(teacher.shape, -1e4).scatter_(-1, ids, values)
        cached = word_level_divergence(equal, None, mask, _divergence(name), 1.0, teacher_topk=(values, ids))
        assert abs(cached.item()) < 1e-5


@pytest.mark.parametrize("name", DIVERGENCES)
def test_chunks_padding_and_half_precision(name):
    student, teacher, mask = _inputs(4)
    results = []
    for rows in (1, 3, None):
        logits = student.clone().requires_grad_()
        loss = word_level_divergence(logits, teacher, mask, _divergence(name), 2.0, rows=rows)
        loss.backward()
        results.append((loss.detach(), logits.grad))
    for loss, gradient in results[:-1]:
        torch.testing.assert_close(loss, results[-1][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gradient, results[-1][1], rtol=1e-6, atol=1e-7)
    # padded positions holding anything change nothing
    noisy = torch.where(mask[..., None], student, 1e3 * torch.randn(student.shape))
    assert word_level_divergence(noisy, teacher, mask, _divergence(name), 2.0).item() == pytest.approx(
        results[-1][0].item(), rel=1e-6)
    for dtype in (torch.float16, torch.bfloat16):
        half = (20 * student).to(dtype).requires_grad_()
        loss = word_level_divergence(half, (20 * teacher).to(dtype), mask, _divergence(name), 1.0)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(half.grad).all() and half.grad.dtype == dtype


@pytest.mark.parametrize("name", [n for n in DIVERGENCES if n != "forward_kl"])
@pytest.mark.parametrize("temperature,subset", [(1.0, False), (2.0, True)])
def test_fused_with_ce_equals_the_two_apart(name, temperature, subset):
    student, teacher, mask = _inputs(5)
    target = torch.randint(0, student.size(-1), mask.shape)
    kd_mask = mask & torch.tensor([[True, False, False, True], [True, False, False, False]]) if subset else None
    fused_logits = student.clone().requires_grad_()
    combined, ce, nll, kd = label_smoothed_ce_and_word_kd(fused_logits, teacher, target, mask, 0.1, temperature,
                                                          0.6, 0.4, rows=3, kd_mask=kd_mask, divergence=_divergence(name))
    combined.backward()
    apart_logits = student.clone().requires_grad_()
    ce_apart, _ = label_smoothed_cross_entropy(apart_logits, target, mask, 0.1)
    kd_apart = word_level_divergence(apart_logits, teacher, mask if kd_mask is None else kd_mask, _divergence(name),
                                     temperature)
    (0.6 * ce_apart + 0.4 * kd_apart).backward()
    assert kd.item() == pytest.approx(kd_apart.item(), rel=1e-6)
    assert combined.item() == pytest.approx((0.6 * ce_apart + 0.4 * kd_apart).item(), rel=1e-6)
    torch.testing.assert_close(fused_logits.grad, apart_logits.grad, rtol=1e-5, atol=1e-7)


def test_a_teacher_that_requires_grad_gets_the_same_value():
    student, teacher, mask = _inputs(6)
    for name in DIVERGENCES:
        joint = word_level_divergence(student, teacher.clone().requires_grad_(), mask, _divergence(name), 2.0)
        assert joint.requires_grad
        assert joint.item() == pytest.approx(
            word_level_divergence(student, teacher, mask, _divergence(name), 2.0).item(), rel=1e-5)


# ------------------------------------------------------------------------------ the criterions
def _slow_criterion_reference(name, student, teacher_model, sample, pad, temperature, positions=None):
    with torch.no_grad():
        student_logits = student(**sample["net_input"])[0]
        teacher_logits = teacher_model(**sample["net_input"])[0]
    mask = sample["target"].ne(pad) if positions is None else positions
    probs = torch.softmax(teacher_logits.double() / temperature, -1)
    return slow_reference(name, student_logits, probs, mask, temperature)[0]


@pytest.mark.parametrize("name", DIVERGENCES)
def test_word_kd_criterion_with_each_divergence(kd_task, tiny_batch, name):
    student = build_tiny_student(kd_task)
    criterion = build_criterion(WordKDCriterion, kd_task, label_smoothing=0.1, kd_weight=0.3, kd_temperature=2.0,
                                kd_divergence=name, kd_jsd_beta=BETA, kd_skew_alpha=ALPHA)
    loss, _, log = criterion(student, tiny_batch)
    loss.backward()
    ce, _, _ = LabelSmoothedCrossEntropyCriterion(kd_task, False, 0.1)(student, tiny_batch)
    reference = _slow_criterion_reference(name, student, kd_task.teacher.model, tiny_batch,
                                          kd_task.target_dictionary.pad(), 2.0)
    assert log["word_kd_loss"].item() == pytest.approx(reference, rel=1e-4, abs=1e-6)
    assert loss.item() == pytest.approx(0.7 * ce.item() + 0.3 * reference, rel=1e-5)
    assert all(torch.isfinite(p.grad).all() for p in student.parameters() if p.grad is not None)
    _, _, same = criterion(kd_task.teacher.model, tiny_batch)
    assert abs(same["word_kd_loss"].item()) < 1e-4


@pytest.mark.parametrize("name", ["jsd", "tvd"])
def test_selective_kd_takes_the_divergence_at_its_chosen_tokens(kd_task, tiny_batch, name):
    student = build_tiny_student(kd_task)
    criterion = build_criterion(SelectiveKDCriterion, kd_task, label_smoothing=0.1, kd_weight=0.5, word_rate=0.5,
                                selection="batch", kd_divergence=name, kd_jsd_beta=BETA)
    _, _, log = criterion(student, tiny_batch)
    from fairseq_kd.criterions.selective_kd import select_batch_level, token_cross_entropy

    with torch.no_grad():
        logits = student(**tiny_batch["net_input"])[0]
    chosen = select_batch_level(token_cross_entropy(logits, tiny_batch["target"]),
                                criterion.target_mask(tiny_batch), 0.5)
    reference = _slow_criterion_reference(name, student, kd_task.teacher.model, tiny_batch,
                                          kd_task.target_dictionary.pad(), 1.0, positions=chosen)
    assert log["selective_kd_loss"].item() == pytest.approx(reference, rel=1e-4, abs=1e-6)


def test_reverse_kl_over_the_cache_is_refused_and_ranges_are_checked(kd_task, monkeypatch):
    monkeypatch.setattr(kd_task, "teacher_cache", object(), raising=False)
    with pytest.raises(InputError, match="--kd-divergence reverse_kl cannot read --teacher-cache"):
        build_criterion(WordKDCriterion, kd_task, kd_divergence="reverse_kl")
    monkeypatch.undo()
    for flag, bad in (("kd_jsd_beta", 1.0), ("kd_jsd_beta", 0.0), ("kd_skew_alpha", 1.0), ("kd_skew_alpha", -0.1)):
        with pytest.raises(InputError, match="--" + flag.replace("_", "-") + " must be in"):
            build_criterion(WordKDCriterion, kd_task, **{flag: bad})

