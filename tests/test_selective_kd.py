"""Selective KD (Wang et al., 2021): token selection by the student's CE, batch and global level.

References here are independent of the implementation: token sets and thresholds written by hand,
and slow loops over Python lists (sorting by ``(-ce, position)``; exact ``ceil`` with fractions).
"""
import math
import re
import shutil
import socket
from fractions import Fraction

import pytest
import torch
import torch.multiprocessing as mp
from conftest import build_tiny_student, train_student
from hidden_kd_support import build_criterion

import fairseq_kd
from fairseq_kd.checkpoints import safe_load
from fairseq_kd.criterions.method import DistillationBatch
from fairseq_kd.criterions.losses import word_level_kd
from fairseq_kd.criterions.selective_kd import (
    SelectiveKDCriterion,
    queue_threshold,
    select_batch_level,
    token_cross_entropy,
)
from fairseq_kd.criterions.word_kd import WordKDCriterion

fairseq_kd.register()

#: tests/test_multirank.py's runs of this criterion (2 CPU ranks equal 1 rank with --update-freq 2):
#: run name -> flags after --criterion NAME
MULTI_RANK_RUNS = {"selective_kd_global": ["--selection", "global", "--queue-size", "2000"]}


def selective(task, **overrides):
    args = dict(sentence_avg=False, label_smoothing=0.1, kd_weight=0.5, kd_temperature=1.0,
                word_rate=0.5, selection="batch", queue_size=30000)
    args.update(overrides)
    return build_criterion(SelectiveKDCriterion, task, **args)


# ------------------------------------------------------------------ slow references
def exact_count(word_rate, total):
    return math.ceil(Fraction(str(word_rate)) * total)


def reference_batch_selection(ce, mask, word_rate):
    """Loop: rank real tokens by CE (highest first), earlier row-major position first on ties."""
    rows, cols = mask.shape
    real = [(float(ce[i, j]), i * cols + j) for i in range(rows) for j in range(cols) if mask[i, j]]
    real.sort(key=lambda item: (-item[0], item[1]))
    chosen = {position for _, position in real[: exact_count(word_rate, len(real))]}
    return torch.tensor([[i * cols + j in chosen for j in range(cols)] for i in range(rows)])


def reference_threshold(values, word_rate):
    """The k-th largest of a list, k = ceil(r * n)."""
    ordered = sorted(values, reverse=True)
    return ordered[exact_count(word_rate, len(ordered)) - 1]


def logits_with_ce(target, wanted_ce, vocab=6):
    """Student logits whose CE at ``target`` is ``wanted_ce``: zeros except the target logit x, with
    CE = log(e^x + vocab - 1) - x, i.e. x = log((vocab - 1) / (e^ce - 1))."""
    x = torch.log((vocab - 1) / torch.expm1(wanted_ce))
    logits = torch.zeros(*target.shape, vocab)
    logits.scatter_(-1, target.unsqueeze(-1), x.unsqueeze(-1))
    return logits


def hand_batch(criterion, ce, mask, vocab=6, seed=0):
    """A DistillationBatch whose student has exactly the per-token CE ``ce`` (padding = mask False)."""
    generator = torch.Generator().manual_seed(seed)
    pad = criterion.padding_idx
    target = torch.randint(pad + 1, vocab, ce.shape, generator=generator)
    target[~mask] = pad
    student = logits_with_ce(target, ce, vocab)
    teacher = torch.randn(*ce.shape, vocab, generator=generator)
    return DistillationBatch(sample={"target": target}, student_output=(student,),
                             teacher_output=(teacher,), student=None, teacher=None, target_mask=mask)


# -------------------------------------------------------------------------- tests
@pytest.mark.parametrize("selection", ["batch", "global"])
def test_word_rate_one_is_word_level_kd(kd_task, tiny_batch, selection):
    student = build_tiny_student(kd_task)
    word = build_criterion(WordKDCriterion, kd_task, label_smoothing=0.1, kd_weight=0.5, kd_temperature=2.0)
    sel = selective(kd_task, word_rate=1.0, selection=selection, kd_temperature=2.0)
    loss_word, size_word, log_word = word(student, tiny_batch)
    loss_sel, size_sel, log_sel = sel(student, tiny_batch)
    assert torch.equal(loss_sel, loss_word) and size_sel == size_word
    assert torch.equal(log_sel["selective_kd_loss"], log_word["word_kd_loss"])
    assert int(log_sel["kd_selected_tokens"]) == tiny_batch["ntokens"]
    # a smaller word rate distils a strict subset of the tokens: less KD loss, same CE
    half = selective(kd_task, word_rate=0.5, selection=selection, kd_temperature=2.0)
    _, _, log_half = half(student, tiny_batch)
    assert torch.equal(log_half["ce_loss"], log_word["ce_loss"])
    assert 0 < log_half["selective_kd_loss"] < log_word["word_kd_loss"]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_selected_tokens_get_kd_in_the_step_and_the_rest_ce_only(kd_task, tiny_batch, temperature):
    """Word rate 0.5: the criterion's loss and its gradient are (1 - a) CE over every target token
    plus a word KD over the chosen half only, written here with fairseq's label_smoothed_nll_loss and
    torch's kl_div, with the selection recomputed from the student's own per-token CE."""
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    student = build_tiny_student(kd_task)
    criterion = selective(kd_task, word_rate=0.5, selection="batch", kd_temperature=temperature, kd_weight=0.4,
                          label_smoothing=0.1)
    loss, _, log = criterion(student, tiny_batch)
    loss.backward()
    got = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
    student.zero_grad()

    logits = student(**tiny_batch["net_input"])[0].float()
    teacher = kd_task.teacher.model(**tiny_batch["net_input"])[0].float().detach()
    target = tiny_batch["target"]
    mask = target.ne(criterion.padding_idx)
    token_ce = -torch.log_softmax(logits.detach(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    chosen = select_batch_level(token_ce, mask, 0.5)
    lprobs = torch.log_softmax(logits, -1)
    ce, _ = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1), 0.1,
                                    ignore_index=criterion.padding_idx, reduce=True)
    kl = torch.nn.functional.kl_div(torch.log_softmax(logits / temperature, -1),
                                    torch.log_softmax(teacher / temperature, -1), reduction="none", log_target=True)
    kd = temperature**2 * kl.sum(-1)[chosen].sum()
    (0.6 * ce + 0.4 * kd).backward()
    assert int(log["kd_selected_tokens"]) == int(chosen.sum()) < int(mask.sum())
    torch.testing.assert_close(log["selective_kd_loss"].double(), kd.detach().double(),
                               rtol=1e-5, atol=1e-5)
    for name, p in student.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6)


def test_token_cross_entropy_of_hand_made_logits():
    target = torch.tensor([[1, 2, 3], [4, 5, 1]])
    wanted = torch.tensor([[0.25, 1.0, 2.5], [0.7, 3.0, 0.1]])
    logits = logits_with_ce(target, wanted)
    # the formula, independently: -log softmax at the target
    x = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    by_hand = torch.log(torch.exp(x) + 5) - x
    assert torch.allclose(by_hand, wanted, atol=1e-5)
    assert torch.allclose(token_cross_entropy(logits, target), wanted, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_cross_entropy_in_chunks_equals_cross_entropy(rows, dtype):
    """The ranking's per-token CE, in chunks of positions, is torch's cross-entropy in float64."""
    torch.manual_seed(0)
    logits = (5 * torch.randn(3, 7, 50)).to(dtype)
    target = torch.randint(0, 50, (3, 7))
    expected = torch.nn.functional.cross_entropy(logits.double().reshape(-1, 50), target.reshape(-1),
                                                 reduction="none").view(3, 7)
    got = token_cross_entropy(logits, target, rows=rows)
    assert got.dtype == torch.float32 and got.shape == (3, 7)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)


def test_batch_level_selects_the_expected_tokens(kd_task):
    criterion = selective(kd_task, word_rate=0.5)
    ce = torch.tensor([[0.10, 2.00, 0.50, 9.00],
                       [3.00, 0.20, 2.00, 1.00]])
    mask = torch.tensor([[True, True, True, False],   # the 9.0 is padding: never selected
                         [True, True, True, True]])
    # 7 real tokens, k = ceil(3.5) = 4: 3.0, then the two 2.0 (tie, both fit), then 1.0
    expected = torch.tensor([[False, True, False, False],
                             [True, False, True, True]])
    batch = hand_batch(criterion, ce, mask)
    terms = criterion.distillation_terms(batch)
    assert torch.equal(criterion.select(token_cross_entropy(batch.student_logits, batch.sample["target"]), mask),
                       expected)
    assert int(terms.logs["kd_selected_tokens"]) == 4
    assert torch.allclose(terms["selective_kd"],
                          word_level_kd(batch.student_logits, batch.teacher_logits, expected))
    # a tie across the cut: k = ceil(0.25 * 7) = 2 -> 3.0 and the *earlier* 2.0 (row 0) only
    expected_tie = torch.tensor([[False, True, False, False],
                                 [True, False, False, False]])
    assert torch.equal(select_batch_level(ce, mask, 0.25), expected_tie)


@pytest.mark.parametrize("word_rate", [0.1, 0.3, 0.5, 0.7, 1.0])
def test_batch_level_matches_a_loop_reference(word_rate):
    generator = torch.Generator().manual_seed(int(word_rate * 100))
    for _ in range(20):
        rows, cols = torch.randint(1, 6, (2,), generator=generator).tolist()
        ce = torch.randint(0, 4, (rows, cols), generator=generator).float() / 2  # many ties
        mask = torch.rand(rows, cols, generator=generator) < 0.8
        selected = select_batch_level(ce, mask, word_rate)
        assert torch.equal(selected, reference_batch_selection(ce, mask, word_rate))
        assert int(selected.sum()) == exact_count(word_rate, int(mask.sum()))


def test_global_level_against_a_hand_filled_queue(kd_task):
    criterion = selective(kd_task, selection="global", word_rate=0.3, queue_size=10)
    old = [5.0, 0.5, 4.0, 1.5, 3.0, 2.5, 0.2, 6.0]
    criterion.queue = torch.tensor(old)
    ce = torch.tensor([[3.5, 0.1, 8.0],
                       [2.0, 4.5, 7.0]])
    mask = torch.tensor([[True, True, True],
                         [True, True, False]])  # 7.0 is padding: not queued, not selected
    batch = hand_batch(criterion, ce, mask)
    criterion.train()
    terms = criterion.distillation_terms(batch)
    # FIFO: 8 old + 5 new = 13 values, keep the newest 10 (5.0, 0.5, 4.0 dropped)
    expected_queue = [1.5, 3.0, 2.5, 0.2, 6.0, 3.5, 0.1, 8.0, 2.0, 4.5]
    assert torch.allclose(criterion.queue, torch.tensor(expected_queue), atol=1e-5)
    # k = ceil(0.3 * 10) = 3: third largest of the queue is 4.5 -> selected: 8.0 and 4.5
    threshold = queue_threshold(criterion.queue, 0.3)
    assert threshold == pytest.approx(4.5, abs=1e-5)
    expected = torch.tensor([[False, False, True],
                             [False, True, False]])
    assert int(terms.logs["kd_selected_tokens"]) == 2
    assert torch.allclose(terms["selective_kd"],
                          word_level_kd(batch.student_logits, batch.teacher_logits, expected))

    # in eval mode (validation) the queue is not modified
    criterion.queue = torch.tensor(old)
    criterion.eval()
    evaluated = criterion.select(ce, mask)
    assert torch.equal(criterion.queue, torch.tensor(old))
    assert torch.equal(evaluated, expected)


def test_global_threshold_matches_a_loop_reference_and_warms_up(kd_task):
    generator = torch.Generator().manual_seed(3)
    criterion = selective(kd_task, selection="global", word_rate=0.4, queue_size=25)
    criterion.train()
    seen = []
    for step in range(8):
        ce = torch.randint(0, 6, (3, 4), generator=generator).float() / 3
        mask = torch.rand(3, 4, generator=generator) < 0.75
        selected = criterion.select(ce, mask)
        seen += [float(v) for v in ce[mask]]
        window = seen[-25:]  # the queue while filling, then the newest 25
        assert criterion.queue.tolist() == pytest.approx(window)
        threshold = reference_threshold(window, 0.4)
        assert torch.equal(selected, mask & (ce >= threshold))
        if step == 0:  # first batch: ranked against itself, i.e. at least ceil(r N) tokens
            assert int(selected.sum()) >= exact_count(0.4, int(mask.sum()))


def test_queue_is_saved_and_restored_in_process(kd_task):
    criterion = selective(kd_task, selection="global", queue_size=6)
    criterion.queue = torch.arange(6.0)
    state = criterion.checkpoint_state()
    restored = selective(kd_task, selection="global", queue_size=6)
    restored.load_checkpoint_state(state)
    assert torch.equal(restored.queue, torch.arange(6.0))
    smaller = selective(kd_task, selection="global", queue_size=4)
    smaller.load_checkpoint_state(state)
    assert torch.equal(smaller.queue, torch.tensor([2.0, 3.0, 4.0, 5.0]))  # the most recent
    assert selective(kd_task, selection="batch").checkpoint_state() == {}


@pytest.mark.parametrize("word_rate", [0.0, -0.5, 1.01])
def test_word_rate_outside_zero_one_is_refused(kd_task, word_rate):
    with pytest.raises(ValueError, match=r"--word-rate must be in \(0, 1\]"):
        selective(kd_task, word_rate=word_rate)


def test_queue_size_must_be_positive(kd_task):
    with pytest.raises(ValueError, match="--queue-size"):
        selective(kd_task, selection="global", queue_size=0)


# ------------------------------------------------------------ data parallel (gloo)
def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Each worker sees different local batches (different sizes, different values).
WORKER_STEPS = {
    0: [torch.tensor([[4.0, 1.0, 0.5]]), torch.tensor([[0.3, 2.2], [1.1, 0.0]])],
    1: [torch.tensor([[2.0, 3.0], [0.7, 5.0], [1.5, 0.2]]), torch.tensor([[6.0]])],
}


def _gloo_worker(rank, world_size, port, data, teacher, out_dir):
    import torch.distributed as dist

    from fairseq_kd.criterions.selective_kd import queue_threshold as threshold_of
    from fairseq_kd.tasks.translation_kd import TranslationKDConfig, TranslationKDTask

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        task = TranslationKDTask.setup_task(TranslationKDConfig(
            data=data, source_lang="src", target_lang="tgt", teacher_checkpoint=teacher, dataset_impl=None))
        criterion = selective(task, selection="global", word_rate=0.5, queue_size=12)
        criterion.train()
        record = []
        for ce in WORKER_STEPS[rank]:
            selected = criterion.select(ce, torch.ones_like(ce, dtype=torch.bool))
            record.append({"queue": criterion.queue.clone(), "threshold": threshold_of(criterion.queue, 0.5),
                           "selected": selected})
        torch.save(record, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_workers_share_queue_and_threshold(tiny_data_bin, tiny_teacher, tmp_path):
    mp.spawn(_gloo_worker, args=(2, _free_port(), str(tiny_data_bin), str(tiny_teacher), str(tmp_path)),
             nprocs=2, join=True)
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    seen = []
    for step in range(2):
        # rank order: worker 0's values, then worker 1's, appended to the FIFO at every step
        seen += WORKER_STEPS[0][step].flatten().tolist() + WORKER_STEPS[1][step].flatten().tolist()
        expected_queue = seen[-12:]
        threshold = reference_threshold(expected_queue, 0.5)
        for rank in (0, 1):
            rec = records[rank][step]
            assert rec["queue"].tolist() == pytest.approx(expected_queue)
            assert float(rec["threshold"]) == pytest.approx(threshold)
            assert torch.equal(rec["selected"], WORKER_STEPS[rank][step] >= threshold)
        assert torch.equal(records[0][step]["queue"], records[1][step]["queue"])


# ------------------------------------------------------------------- real CLI runs
def _train_inner(stdout_and_err):
    """(wpb, kd_selected_rate) of every train_inner log line."""
    return [(float(m.group(2)), float(m.group(1))) for m in
            re.finditer(r"train_inner .*?kd_selected_rate=([\d.]+).*?wpb=([\d.]+)", stdout_and_err)]


def test_batch_selection_trains_through_fairseq_train(tiny_data_bin, tiny_teacher, tmp_path):
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path / "ckpt",
                         ["--criterion", "selective_kd", "--word-rate", "0.5"], max_update=3)
    lines = _train_inner(proc.stdout + proc.stderr)
    assert len(lines) == 3
    for tokens, rate in lines:  # exactly ceil(N / 2) tokens per batch (one batch per update)
        assert rate == pytest.approx(math.ceil(tokens / 2) / tokens, abs=6e-4)
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").is_file()


def test_fairseq_train_refuses_a_bad_word_rate(tiny_data_bin, tiny_teacher, tmp_path):
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path / "ckpt",
                         ["--criterion", "selective_kd", "--word-rate", "1.5"], max_update=1, refused=True)
    assert proc.returncode != 0
    assert "--word-rate must be in (0, 1]" in proc.stderr
    assert "num_updates" not in proc.stdout + proc.stderr  # refused before any training


def _saved_queue(checkpoint):
    state = safe_load(checkpoint)
    return state["extra_state"]["TranslationKDTask"]["criterion"]["selective_kd_queue"]


def test_global_queue_survives_a_resume(tiny_data_bin, tiny_teacher, tmp_path):
    save = tmp_path / "ckpt"
    flags = ["--criterion", "selective_kd", "--selection", "global", "--queue-size", "100000"]
    first = train_student(tiny_data_bin, tiny_teacher, save, flags, max_update=3)
    tokens_first = [tokens for tokens, _ in _train_inner(first.stdout + first.stderr)]
    shutil.copy(save / "checkpoint_last.pt", tmp_path / "after3.pt")
    saved = _saved_queue(tmp_path / "after3.pt")
    assert saved.numel() == sum(tokens_first)  # one CE value per real target token trained on

    second = train_student(tiny_data_bin, tiny_teacher, save, flags, max_update=5)
    log = second.stdout + second.stderr
    assert f"restored the global CE queue: {saved.numel()} values" in log
    tokens_second = [tokens for tokens, _ in _train_inner(log)]
    assert len(tokens_second) == 2
    resumed = _saved_queue(save / "checkpoint_last.pt")
    # the queue continued where it stopped: the saved values first, then updates 4 and 5
    assert resumed.numel() == saved.numel() + sum(tokens_second)
    assert torch.equal(resumed[: saved.numel()], saved)
