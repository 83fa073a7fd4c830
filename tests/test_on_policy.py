"""On-policy distillation (--on-policy-rate, GKD): the student's incremental generation against a
slow greedy decoder written here; at rate 1 the loss and gradient against the divergence between
teacher and student on the generated sequences, no CE; rate 0 exactly today's criterion; padding,
reproducible draws, temperature, half precision, a Hugging Face teacher, A2D's terms on the
generated sequences, the refusals, and fairseq-train with --update-freq and a resume."""
import copy
import math
import re

import pytest
import torch

from conftest import build_tiny_student, make_batch, train_student
from hidden_kd_support import build_criterion
from fairseq_kd.criterions.on_policy import generate
from fairseq_kd.criterions.word_kd import WordKDCriterion
from fairseq_kd.errors import InputError
from fairseq_kd.models.teacher import FrozenTeacher


def _word_kd(task, **overrides):
    args = dict(label_smoothing=0.1, kd_weight=0.5, kd_temperature=1.0)
    args.update(overrides)
    return build_criterion(WordKDCriterion, task, **args)


def _sharp_student(task, scale=4.0, seed=0):
    """A tiny student whose output distributions are far from uniform (scaled output weights)."""
    torch.manual_seed(seed)
    student = build_tiny_student(task)
    with torch.no_grad():
        student.decoder.output_projection.weight.mul_(scale)
    return student


@torch.no_grad()
def slow_greedy(model, sample, pad, eos, a, b):
    """Greedy decoding by re-running the whole model on the prefix at every step, sentence by
    sentence (no incremental state, no batch): tokens, then EOS (forced after a*len+b tokens)."""
    model.eval()
    outputs = []
    for src in sample["net_input"]["src_tokens"]:
        src = src[src.ne(pad)].unsqueeze(0)
        limit = int(a * int(src.ne(eos).sum()) + b)
        prefix = [eos]
        while True:
            prev = torch.tensor([prefix])
            logits = model(src, torch.tensor([src.size(1)]), prev)[0][0, -1].clone()
            logits[pad] = -float("inf")
            word = eos if len(prefix) - 1 >= limit else int(logits.argmax())
            prefix.append(word)
            if word == eos:
                break
        outputs.append(prefix[1:])
    model.train()
    return outputs


def _rows(tokens, pad):
    return [[int(t) for t in row if t != pad] for row in tokens]


def _kl_or_jsd(name, p, q, beta=0.5):
    """D(p, q) at one position from its definition, float64 (p teacher, q student)."""
    def kl(a, c):
        return sum(a[v] * (torch.log(a[v]) - torch.log(c[v])) for v in range(a.numel()) if float(a[v].detach()) > 0)
    if name == "forward_kl":
        return kl(p, q)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


def _reference_loss(student, teacher, sequences, sample, pad, eos, name, weight, temperature=1.0):
    """``weight * sum_{sentences, generated positions} tau^2 D(p_T, p_S)`` on ``sequences`` under
    teacher forcing, sentence by sentence, differentiable in the student's parameters."""
    total = torch.zeros((), dtype=torch.float64)
    for src, sequence in zip(sample["net_input"]["src_tokens"], sequences):
        src = src[src.ne(pad)].unsqueeze(0)
        prev = torch.tensor([[eos] + sequence[:-1]])
        lengths = torch.tensor([src.size(1)])
        student_logits = student(src, lengths, prev)[0][0].double()
        with torch.no_grad():
            teacher_logits = teacher(src, lengths, prev)[0][0].double()
        for t in range(len(sequence)):
            p = torch.softmax(teacher_logits[t] / temperature, -1)
            q = torch.softmax(student_logits[t] / temperature, -1)
            total = total + temperature ** 2 * _kl_or_jsd(name, p, q)
    return weight * total


def _gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------ generation
def test_incremental_generation_equals_a_full_rerun_per_step(kd_task, tiny_batch):
    dictionary = kd_task.target_dictionary
    pad, eos = dictionary.pad(), dictionary.eos()
    student = _sharp_student(kd_task)
    student.train()
    for a, b in ((1.2, 10), (0.5, 1), (0.0, 0)):
        tokens = generate(student, tiny_batch["net_input"]["src_tokens"], tiny_batch["net_input"]["src_lengths"],
                          pad, eos, a, b, None)
        assert student.training  # the mode is restored
        assert _rows(tokens, pad) == slow_greedy(student, tiny_batch, pad, eos, a, b)
        assert (tokens.eq(eos).sum(1) == 1).all()  # one EOS per sentence, padding after it only
        for row in tokens:
            end = int(row.eq(eos).nonzero()[0])
            assert row[end + 1:].eq(pad).all() and not row[:end].eq(pad).any()
    # the teacher's greedy output on the copy task it was trained on is longer than a token
    teacher = kd_task.teacher.model
    tokens = generate(teacher, tiny_batch["net_input"]["src_tokens"], tiny_batch["net_input"]["src_lengths"], pad, eos,
                      1.2, 10, None)
    assert _rows(tokens, pad) == slow_greedy(teacher, tiny_batch, pad, eos, 1.2, 10)
    teacher.eval()


def test_sampling_follows_the_tempered_distribution_and_tiny_temperature_is_greedy(kd_task):
    dictionary = kd_task.target_dictionary
    pad, eos = dictionary.pad(), dictionary.eos()
    student = _sharp_student(kd_task, scale=3.0)
    batch = make_batch(kd_task, ["w1 w2 w3"] * 4000, ["W3 W2 W1"] * 4000)
    src, lengths = batch["net_input"]["src_tokens"], batch["net_input"]["src_lengths"]
    student.eval()
    with torch.no_grad():
        logits = student(src[:1], lengths[:1], torch.tensor([[eos]]))[0][0, -1].double()
    logits[pad] = -float("inf")
    frequencies = {}
    for temperature in (0.5, 2.0):
        generator = torch.Generator().manual_seed(1)
        # one sampled token, then EOS forced (a = 0, b = 1)
        first = generate(student, src, lengths, pad, eos, 0.0, 1, temperature, generator)[:, 0]
        observed = torch.bincount(first, minlength=logits.numel()).double() / first.numel()
        expected = torch.softmax(logits / temperature, -1)
        # 4000 draws: each frequency within 0.03 (about 4 standard deviations) of its probability
        assert (observed - expected).abs().max() < 0.03, temperature
        assert observed[pad] == 0
        frequencies[temperature] = observed
    assert (frequencies[0.5] - frequencies[2.0]).abs().max() > 0.06  # the temperature matters
    few = make_batch(kd_task, ["w1 w2 w3", "w4 w5 w6 w7 w8 w9", "w10 w11"], ["W3"] * 3)
    args = (few["net_input"]["src_tokens"], few["net_input"]["src_lengths"], pad, eos, 1.2, 10)
    greedy = generate(student, *args, None)
    assert torch.equal(generate(student, *args, 1e-6, torch.Generator().manual_seed(3)), greedy)


# ------------------------------------------------------------------------------ the criterion
def test_rate_zero_is_todays_criterion_exactly(kd_task, tiny_batch):
    for divergence in ("forward_kl", "jsd"):
        results = []
        for overrides in ({}, {"on_policy_rate": 0.0, "on_policy_sampling": "greedy"}):
            student = _sharp_student(kd_task)
            criterion = _word_kd(kd_task, kd_divergence=divergence, **overrides)
            loss, sample_size, log = criterion(student, tiny_batch)
            loss.backward()
            results.append((loss.detach(), sample_size, log, _gradients(student)))
        (loss_a, size_a, log_a, grad_a), (loss_b, size_b, log_b, grad_b) = results
        assert torch.equal(loss_a, loss_b) and size_a == size_b and log_a.keys() == log_b.keys()
        assert "on_policy" not in log_b
        assert all(torch.equal(torch.as_tensor(log_a[k]), torch.as_tensor(log_b[k])) for k in log_a)
        assert grad_a.keys() == grad_b.keys() and all(torch.equal(grad_a[k], grad_b[k]) for k in grad_a)


@pytest.mark.parametrize("divergence,temperature", [("forward_kl", 1.0), ("jsd", 2.0)])
def test_rate_one_is_the_divergence_on_the_generated_sequences_without_ce(kd_task, tiny_batch, divergence,
                                                                           temperature):
    dictionary = kd_task.target_dictionary
    pad, eos = dictionary.pad(), dictionary.eos()
    student = _sharp_student(kd_task)
    criterion = _word_kd(kd_task, on_policy_rate=1.0, on_policy_sampling="greedy", kd_divergence=divergence,
                         kd_temperature=temperature)
    student.train()
    before = copy.deepcopy(tiny_batch)
    loss, sample_size, log = criterion(student, tiny_batch)
    loss.backward()
    got = _gradients(student)
    # the caller's batch is untouched
    assert all(torch.equal(before["net_input"][k], tiny_batch["net_input"][k]) for k in before["net_input"])
    assert torch.equal(before["target"], tiny_batch["target"]) and before["ntokens"] == tiny_batch["ntokens"]

    sequences = slow_greedy(student, tiny_batch, pad, eos, 1.2, 10)
    assert len({len(s) for s in sequences}) > 1 and max(len(s) for s in sequences) > 3  # padding in the batch
    student.zero_grad()
    reference = _reference_loss(student, kd_task.teacher.model, sequences, tiny_batch, pad, eos, divergence, 0.5,
                                temperature)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert sample_size == log["ntokens"] == sum(len(s) for s in sequences) == log["on_policy_ntokens"]
    assert log["on_policy"] == 3 and float(log["ce_loss"]) == 0 and float(log["nll_loss"]) == 0
    assert log["word_kd_loss"].item() == pytest.approx(reference.item() / 0.5, rel=1e-5)
    expected = _gradients(student)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    # validation never generates
    student.eval()
    _, _, valid = criterion(student, tiny_batch)
    assert valid["on_policy"] == 0 and valid["ntokens"] == tiny_batch["ntokens"] and float(valid["ce_loss"]) > 0


def test_padding_does_not_change_a_sentences_contribution(kd_task):
    student = _sharp_student(kd_task)
    criterion = _word_kd(kd_task, on_policy_rate=1.0, on_policy_sampling="greedy", kd_divergence="jsd")
    pairs = [("w1 w2", "W2 W1"), ("w4 w5 w6 w7 w8 w9 w12 w13", "W9 W8 W7 W6 W5 W4")]
    alone = [criterion(student, make_batch(kd_task, [s], [t])) for s, t in pairs]
    together = criterion(student, make_batch(kd_task, [s for s, _ in pairs], [t for _, t in pairs]))
    assert together[0].item() == pytest.approx(sum(loss.item() for loss, _, _ in alone), rel=1e-5)
    assert together[1] == sum(size for _, size, _ in alone)


def test_same_seed_same_choices_and_samples_different_update_different(kd_task, tiny_batch):
    student = _sharp_student(kd_task)
    criterion = _word_kd(kd_task, on_policy_rate=0.5)
    student.train()

    def draws(seed):
        torch.manual_seed(seed)  # what fairseq does before each update: --seed + the update number
        torch.rand(17)  # the global stream's position (dropout, ...) changes nothing
        chosen = criterion.on_policy.chosen(student, tiny_batch, "live", False)
        return chosen, criterion.on_policy.generated_sample(student, tiny_batch)["target"]

    updates = range(1, 31)
    first = [draws(1 + u) for u in updates]
    again = [draws(1 + u) for u in updates]
    assert [c for c, _ in first] == [c for c, _ in again]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, again))
    share = sum(c for c, _ in first) / len(first)
    assert 0.2 < share < 0.8  # both kinds of batch occur
    assert len({tuple(t.flatten().tolist()) for _, t in first}) > 20  # other updates, other samples
    # another batch of the same update draws for itself
    other = make_batch(kd_task, ["w5 w6", "w7"], ["W6 W5", "W7"])
    choices = []
    for u in updates:
        torch.manual_seed(1 + u)
        choices.append(criterion.on_policy.chosen(student, other, "live", False))
    assert choices != [c for c, _ in first]
    # never in validation, on a dummy batch, or without a live teacher signal
    assert not criterion.on_policy.chosen(student, tiny_batch, None, False)
    assert not criterion.on_policy.chosen(student, tiny_batch, "live", True)
    student.eval()
    assert not any(criterion.on_policy.chosen(student, tiny_batch, "live", False) for _ in range(5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite(kd_task, tiny_batch, dtype):
    student = _sharp_student(kd_task).to(dtype)
    task = copy.copy(kd_task)  # a private teacher: following the student's dtype must not round the shared one
    task.teacher = FrozenTeacher(copy.deepcopy(kd_task.teacher.model), kd_task.teacher.path)
    criterion = _word_kd(task, on_policy_rate=1.0, kd_divergence="jsd")
    try:
        loss, _, log = criterion(student, tiny_batch)
        loss.backward()
    except RuntimeError as err:  # an op without a CPU kernel for this dtype
        pytest.skip(f"{dtype} not supported on this CPU build: {err}")
    assert log["on_policy"] == 3 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in student.parameters() if p.grad is not None)


@pytest.fixture(scope="module")
def hf_task(tmp_path_factory):
    """A translation_kd task whose teacher is a tiny MarianMT folder (tests/test_hf_teacher.py's)."""
    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    from test_hf_teacher import SRC, TGT, save_teachers

    from fairseq_kd.cli import hf_data
    from fairseq_kd.data.synthetic import write_corpus
    from fairseq_kd.tasks.translation_kd import TranslationKDConfig, TranslationKDTask

    raw = tmp_path_factory.mktemp("on_policy_hf_raw")
    write_corpus(raw, seed=3, train_size=60, valid_size=8, test_size=8, source_lang=SRC, target_lang=TGT)
    folder = save_teachers(("marian",), raw, tmp_path_factory.mktemp("on_policy_hf_teacher"))["marian"]
    data = tmp_path_factory.mktemp("on_policy_hf_bin")
    hf_data.cli_main(["--teacher", str(folder), "-s", SRC, "-t", TGT, "--trainpref", str(raw / "train"),
                      "--validpref", str(raw / "valid"), "--destdir", str(data)])
    task = TranslationKDTask.setup_task(TranslationKDConfig(data=str(data), source_lang=SRC, target_lang=TGT,
                                                            teacher_checkpoint=str(folder), max_source_positions=64,
                                                            max_target_positions=64, dataset_impl="mmap",
                                                            required_seq_len_multiple=1))
    task.load_dataset("valid")
    return task


def test_a_hugging_face_teacher_scores_the_generated_sequences(hf_task):
    dictionary = hf_task.target_dictionary
    pad, eos = dictionary.pad(), dictionary.eos()
    dataset = hf_task.dataset("valid")
    sample = dataset.collater([dataset[i] for i in range(4)])
    student = build_tiny_student(hf_task, max_target_positions=64, max_source_positions=64)
    with torch.no_grad():
        student.decoder.output_projection.weight.mul_(4.0)
    criterion = _word_kd(hf_task, on_policy_rate=1.0, on_policy_sampling="greedy", on_policy_max_len_b=4)
    loss, _, log = criterion(student, sample)
    loss.backward()
    got = _gradients(student)
    sequences = slow_greedy(student, sample, pad, eos, 1.2, 4)
    student.zero_grad()
    reference = _reference_loss(student, hf_task.teacher.model, sequences, sample, pad, eos, "forward_kl", 0.5)
    reference.backward()
    assert log["on_policy"] == 4 and log["ntokens"] == sum(len(s) for s in sequences) > 4
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    for name, gradient in _gradients(student).items():
        torch.testing.assert_close(got[name], gradient, rtol=1e-4, atol=1e-6, msg=name)


def _feature_method(name, task):
    """(criterion with --on-policy-rate 1 and greedy targets, a student it accepts, the term that
    reads the decoder's features)."""
    on_policy = dict(on_policy_rate=1.0, on_policy_sampling="greedy")
    if name == "a2d_kd":
        from test_a2d_kd import build_a2d, randomize_alignments

        student = _sharp_student(task)  # first: the task records its shape, which the criterion reads
        criterion = build_a2d(task, **on_policy)
        randomize_alignments(criterion)
        return criterion, student, "dec_self_att"
    if name == "pkd":
        from test_pkd import make_pkd

        student = _sharp_student(task)
        return make_pkd(task, **on_policy), student, "pkd"
    from test_minilm import FOUR_HEADS, build_minilm

    torch.manual_seed(0)
    student = build_tiny_student(task, **FOUR_HEADS)
    return build_minilm(task, **on_policy), student, "attention_kl"


@pytest.mark.parametrize("name", ["a2d_kd", "pkd", "minilm"])
def test_feature_methods_take_their_terms_on_the_generated_sequences(kd_task, tiny_batch, name):
    """An on-policy batch is the method's batch with the generated sequences as targets, without
    CE: every term as the same criterion computes it when given those sequences."""
    criterion, student, decoder_term = _feature_method(name, kd_task)
    loss, sample_size, on_policy = criterion(student, tiny_batch)
    loss.backward()
    generated = criterion.on_policy.generated_sample(student, tiny_batch)
    criterion.on_policy = None  # the same criterion, given the generated sequences as its batch
    _, size, direct = criterion(student, generated)
    _, _, reference = criterion(student, tiny_batch)
    assert sample_size == size == generated["ntokens"] != tiny_batch["ntokens"]
    assert on_policy["on_policy"] == 3 and float(on_policy["ce_loss"]) == 0 < float(direct["ce_loss"])
    weights = criterion.loss_weights()
    expected = sum(weights[term] * direct[f"{term}_loss"].item() for term in criterion.TERM_NAMES)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    for term in criterion.TERM_NAMES:
        assert on_policy[f"{term}_loss"].item() == pytest.approx(direct[f"{term}_loss"].item(), rel=1e-5), term
    assert on_policy[f"{decoder_term}_loss"].item() != pytest.approx(reference[f"{decoder_term}_loss"].item(),
                                                                     rel=1e-3)
    assert all(torch.isfinite(p.grad).all() for p in student.parameters() if p.grad is not None)


def test_refusals_name_the_flag(kd_task, monkeypatch):
    from fairseq_kd.criterions.selective_kd import SelectiveKDCriterion

    with pytest.raises(InputError, match="--on-policy-rate does not combine with --criterion selective_kd"):
        build_criterion(SelectiveKDCriterion, kd_task, on_policy_rate=0.5)
    build_criterion(SelectiveKDCriterion, kd_task, on_policy_rate=0.0)
    for flag, bad, rule in (("on_policy_rate", 1.5, "in"), ("on_policy_rate", -0.1, "in"),
                            ("on_policy_temperature", 0.0, ">"), ("on_policy_max_len_a", -1.0, ">="),
                            ("on_policy_max_len_b", -1, ">=")):
        with pytest.raises(InputError, match="--" + flag.replace("_", "-") + " must be " + rule):
            _word_kd(kd_task, **{flag: bad})
    monkeypatch.setattr(kd_task, "teacher_cache", object(), raising=False)
    with pytest.raises(InputError, match="--on-policy-rate cannot read --teacher-cache"):
        _word_kd(kd_task, on_policy_rate=0.5)
    _word_kd(kd_task)  # the cache alone is fine


# ------------------------------------------------------------------------------ fairseq-train
def _train_inner(log):
    return {int(m.group(2)): m.group(1) for m in re.finditer(
        r"\| train_inner \|(.*?)\bnum_updates=(\d+),", log)}


def test_fairseq_train_with_update_freq_and_resume(tiny_data_bin, tiny_teacher, tmp_path):
    args = ["--criterion", "word_kd", "--on-policy-rate", "0.5", "--kd-divergence", "jsd"]
    extra = ["--update-freq", "2", "--max-tokens", "300"]  # a dozen batches an epoch: the resume is in epoch 1
    straight = train_student(tiny_data_bin, tiny_teacher, tmp_path / "straight", args, max_update=4, extra=extra)
    train_student(tiny_data_bin, tiny_teacher, tmp_path / "resumed", args, max_update=2, extra=extra)
    resumed = train_student(tiny_data_bin, tiny_teacher, tmp_path / "resumed", args, max_update=4, extra=extra)
    expected, after = _train_inner(straight.stdout + straight.stderr), _train_inner(resumed.stdout + resumed.stderr)
    assert sorted(expected) == [1, 2, 3, 4] and sorted(after) == [3, 4], (straight.stdout + straight.stderr)[-3000:]

    def share(fields):
        found = re.search(r"\bon_policy=([\d.]+)", fields)
        return float(found.group(1)) if found else None

    shares = [share(expected[u]) for u in sorted(expected)]
    assert all(s is not None for s in shares) and 0 < sum(shares) < 4, shares
    assert any(0 < s for s in shares) and "gen_len=" in "".join(expected.values())
    # the choices are a function of the seed, the update and the batch: the same after a resume
    assert [share(after[u]) for u in (3, 4)] == shares[2:]
    for update in (3, 4):  # fairseq's own resume is not bit-exact on CPU (tests/test_end_to_end.py)
        loss = [float(re.search(r"\bloss=([\d.]+)", fields).group(1)) for fields in (expected[update], after[update])]
        assert loss[0] == pytest.approx(loss[1], abs=0.05), update

