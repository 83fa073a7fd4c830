"""Test helpers shared by the criterion tests (hidden-state methods above all).

Not a test module: it builds criterions from their configs, what a criterion's
``distillation_terms`` receives, a student that is an exact copy of the tiny teacher, fairseq's
own label-smoothed CE for the weight-0 checks, and the checks several methods share (padding
invariance of a whole batch, training through fairseq-train).
"""
import copy

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

from conftest import TINY_STUDENT_ARGS, build_tiny_student, make_batch, train_student
from fairseq_kd.criterions.method import DistillationBatch
from fairseq_kd.models.feature_capture import FeatureCapture

COMMON = dict(sentence_avg=False, label_smoothing=0.1, kd_temperature=1.0)


def build_criterion(criterion_class, task, **overrides):
    """``criterion_class`` as fairseq builds it: from its registered dataclass config and the task
    (the per-token normalisation unless ``sentence_avg=True`` is passed)."""
    config_class = getattr(criterion_class, "__dataclass")
    overrides.setdefault("sentence_avg", False)
    return criterion_class.build_criterion(config_class(**overrides), task)


def distillation_batch(criterion, student, sample) -> DistillationBatch:
    """The features ``criterion`` asked for, from one student and one teacher forward pass."""
    criterion.teacher.follow(next(student.parameters()))  # as the criterion does
    with FeatureCapture(student, criterion.student_request) as capture:
        net_output = student(**sample["net_input"])
    teacher_output, teacher_features = criterion.teacher.forward(sample["net_input"], criterion.teacher_request)
    return DistillationBatch(
        sample=sample, student_output=net_output, teacher_output=teacher_output,
        student=capture.features(), teacher=teacher_features, target_mask=criterion.target_mask(sample),
    )


def teacher_copy(task):
    """A student with the teacher's architecture and weights (eval mode)."""
    student = build_tiny_student(
        task, encoder_layers=3, decoder_layers=3, encoder_embed_dim=32, decoder_embed_dim=32,
        encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
        decoder_attention_heads=4,
    )
    student.load_state_dict(task.teacher.model.state_dict())
    student.eval()
    return student


def real_positions(padding_mask):
    """(sentence, position) of every real token of a ``(batch, len)`` padding mask."""
    return [(b, t) for b in range(padding_mask.size(0)) for t in range(padding_mask.size(1))
            if not bool(padding_mask[b, t])]


def scramble_padding(states, padding_mask, generator_seed=0):
    """``states`` ``(..., batch, len, dim)`` with every padded position replaced by large noise."""
    generator = torch.Generator().manual_seed(generator_seed)
    noise = 100 * torch.randn(states.shape, generator=generator, dtype=states.dtype)
    return torch.where(padding_mask[..., None], noise, states)


def assert_reduces_to_label_smoothed_ce(criterion, student, sample):
    """With every distillation weight 0 the criterion is fairseq's label_smoothed_cross_entropy:
    same loss, same sample size, and the teacher is never run."""
    calls = []
    original = criterion.teacher.forward
    criterion.teacher.forward = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        loss, sample_size, log = criterion(student, sample)
    finally:
        criterion.teacher.forward = original
    reference = LabelSmoothedCrossEntropyCriterion(criterion.task, False, 0.1)
    ref_loss, ref_size, ref_log = reference(student, sample)
    assert not calls, "the teacher ran although no distillation term has a weight"
    assert sample_size == ref_size
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log["nll_loss"], ref_log["nll_loss"], rtol=1e-6, atol=1e-6)


def checkpoint(path):
    import fairseq_kd
    from fairseq import checkpoint_utils

    fairseq_kd.register()  # the checkpoint allow-list for torch.load
    return checkpoint_utils.load_checkpoint_to_cpu(str(path))


def assert_finite_in_half_precision(criterion, task, sample, **student_overrides):
    """The trainer converts model and criterion to fp16/bf16 (--fp16/--bf16); the loss and every
    criterion gradient stay finite. bfloat16 is used because CPU kernels support it throughout."""
    student = build_tiny_student(task, **student_overrides).to(torch.bfloat16)
    criterion = criterion.to(torch.bfloat16)
    # The teacher follows the student to bfloat16, which rounds its weights (and fairseq's cached
    # sinusoidal positions) for good: give this criterion its own copy of the session's teacher.
    criterion.teacher = copy.deepcopy(criterion.teacher)
    criterion.train()
    loss, _, log = criterion(student, sample)
    loss.backward()
    assert next(criterion.teacher.model.parameters()).dtype == torch.bfloat16
    assert torch.isfinite(loss)
    assert all(torch.isfinite(torch.as_tensor(log[f"{name}_loss"])) for name in criterion.TERM_NAMES)
    assert all(torch.isfinite(p.grad).all() for p in criterion.parameters())
    assert all(torch.isfinite(p.grad).all() for p in student.parameters() if p.grad is not None)


def assert_sentence_term_is_a_mean_over_sentences(make_criterion, student, sample, term):
    """A per-sentence term (``SENTENCE_TERMS``) is normalised to the mean over sentences, whether
    fairseq normalises by target tokens or by sentences: its weight then means the paper's weight
    at any sentence length (a per-sentence sum divided by tokens would shrink by the mean length)."""
    import torch

    nsentences, ntokens = sample["target"].size(0), sample["ntokens"]
    assert ntokens > 2 * nsentences, "the sample must have sentences longer than two tokens"
    per_token = make_criterion(sentence_avg=False)
    per_sentence = make_criterion(sentence_avg=True)
    per_sentence.load_state_dict(per_token.state_dict())  # the same (random) projections
    assert term in per_token.SENTENCE_TERMS
    with torch.no_grad():
        summed = per_token.distillation_terms(distillation_batch(per_token, student, sample))[term].item()
        _, token_size, token_log = per_token(student, sample)
        _, sentence_size, sentence_log = per_sentence(student, sample)
    assert (token_size, sentence_size) == (ntokens, nsentences)
    mean = summed / nsentences
    assert float(token_log[f"{term}_loss"]) / token_size == pytest.approx(mean, rel=1e-5)
    assert float(sentence_log[f"{term}_loss"]) / sentence_size == pytest.approx(mean, rel=1e-5)


def assert_invariant_to_batch_padding(criterion, student, task):
    """Each sentence alone (no padding) gives the same terms as inside a padded batch."""
    sources = ["w1 w2 w3", "w4 w5 w6 w7 w8 w9", "w10 w11"]
    targets = ["W3 W2 W1", "W9 W8 W7 W6 W5 W4", "W11 W10"]
    _, _, batched = criterion(student, make_batch(task, sources, targets))
    for term in criterion.TERM_NAMES:
        alone = sum(criterion(student, make_batch(task, [s], [t]))[2][f"{term}_loss"].item()
                    for s, t in zip(sources, targets))
        assert batched[f"{term}_loss"].item() == pytest.approx(alone, rel=1e-4), term


def allowed_entries(sample, pad):
    """may_attend(kind, b, q, k), from the tokens alone (left-padded source, right-padded target)."""
    src = sample["net_input"]["src_tokens"].tolist()
    prev = sample["net_input"]["prev_output_tokens"].tolist()

    def may_attend(kind, b, q, k):
        if kind == "encoder_self":
            return src[b][q] != pad and src[b][k] != pad
        if kind == "decoder_self":
            return prev[b][q] != pad and prev[b][k] != pad and k <= q
        return prev[b][q] != pad and src[b][k] != pad

    return may_attend


def train_four_head_student(data, teacher, folder, criterion, max_update=3):
    """fairseq-train's ``train_inner`` records of a tiny student with the teacher's 4 heads."""
    from fairseq_kd.figures.training_log import parse_fairseq_log

    student_args = list(TINY_STUDENT_ARGS)
    student_args[student_args.index("--encoder-attention-heads") + 1] = "4"
    student_args[student_args.index("--decoder-attention-heads") + 1] = "4"
    proc = train_student(data, teacher, folder, ["--criterion", criterion], student_args=student_args,
                         max_update=max_update)
    return [r for r in parse_fairseq_log(proc.stdout.splitlines()) if r.split == "train_inner"]
