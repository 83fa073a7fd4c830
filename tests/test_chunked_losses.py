"""The vocabulary-sized losses computed in chunks of positions (criterions/losses.py) equal the
unchunked computations they replace, in value and gradient: fairseq's own label-smoothed
cross-entropy (log_softmax over the whole batch, then label_smoothed_nll_loss, gradient by autograd)
and word-level KD written position by position. With padding, an ignored prefix, chunk sizes that
do not divide the positions, one position per chunk and one chunk for all, float32 and bfloat16
logits, and an upstream gradient other than 1."""
import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from fairseq_kd.criterions import losses
from fairseq_kd.criterions.losses import label_smoothed_cross_entropy, word_level_kd

PAD = 1
CHUNKS = [1, 3, 7, None, 10_000]  # None: the default (CHUNK_ELEMENTS // vocab)


def batch(dtype, vocab=11, seed=0):
    torch.manual_seed(seed)
    logits = (4 * torch.randn(3, 5, vocab)).to(dtype)
    target = torch.randint(4, vocab, (3, 5))
    target[0, 3:] = PAD  # padding at the end of two sentences
    target[2, 1:] = PAD
    return logits, target


def fairseq_reference(logits, target, epsilon, ignore_prefix=0):
    """fairseq's LabelSmoothedCrossEntropyCriterion.compute_loss on these logits (float64)."""
    lprobs = torch.log_softmax(logits.double(), dim=-1)[:, ignore_prefix:]
    return label_smoothed_nll_loss(lprobs.reshape(-1, lprobs.size(-1)), target[:, ignore_prefix:].reshape(-1),
                                   epsilon, ignore_index=PAD, reduce=True)


@pytest.mark.parametrize("rows", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epsilon, ignore_prefix", [(0.1, 0), (0.0, 0), (0.2, 1)])
def test_label_smoothed_cross_entropy_equals_fairseqs(rows, dtype, epsilon, ignore_prefix):
    logits, target = batch(dtype)
    mask = target.ne(PAD)
    mask[:, :ignore_prefix] = False
    student = logits.clone().requires_grad_()
    loss, nll = label_smoothed_cross_entropy(student, target, mask, epsilon, rows=rows)
    (3.5 * loss).backward()

    reference_logits = logits.double().requires_grad_()
    reference_loss, reference_nll = fairseq_reference(reference_logits, target, epsilon, ignore_prefix)
    (3.5 * reference_loss).backward()
    assert loss.dtype == nll.dtype == torch.float32 and not nll.requires_grad
    torch.testing.assert_close(loss.double(), reference_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(nll.double(), reference_nll, rtol=1e-6, atol=1e-5)
    assert student.grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(student.grad.double(), reference_logits.grad, rtol=tolerance, atol=tolerance)
    assert (student.grad[~mask] == 0).all()


def test_label_smoothed_cross_entropy_without_gradient_and_padding_invariance():
    """Under no_grad (validation) the values are the same; appending padded positions changes nothing."""
    logits, target = batch(torch.float32)
    mask = target.ne(PAD)
    with torch.no_grad():
        values = label_smoothed_cross_entropy(logits, target, mask, 0.1, rows=4)
    padded_logits = torch.cat([logits, 50 * torch.randn(3, 4, logits.size(-1))], dim=1)
    padded_target = torch.cat([target, torch.full((3, 4), PAD)], dim=1)
    padded = label_smoothed_cross_entropy(padded_logits, padded_target, padded_target.ne(PAD), 0.1, rows=4)
    # The same per-position terms, but chunks of 4 positions now group them into other partial sums.
    # float32 puts any order of a sum of n positive terms within (n - 1) 2**-24 of it (Higham), so
    # two orders within twice that, and the loss's weighting (two products, a sum) adds 3 roundings
    # a side. (rtol=0 held for this seed by coincidence: a quarter of seeds give another last bit,
    # as another CPU's log-softmax could for this one.)
    n = int(mask.sum())
    torch.testing.assert_close(torch.stack(values), torch.stack(padded), rtol=(2 * (n - 1) + 6) * 2.0**-24, atol=0)


@pytest.mark.parametrize("rows", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_word_level_kd_in_chunks_equals_the_per_position_reference(rows, dtype, temperature):
    logits, target = batch(dtype, seed=1)
    teacher = (3 * torch.randn(logits.shape)).to(dtype)
    mask = target.ne(PAD)
    student = logits.clone().requires_grad_()
    (0.7 * word_level_kd(student, teacher, mask, temperature, rows=rows)).backward()

    reference_logits = logits.double().requires_grad_()
    reference = 0.0
    for b in range(mask.size(0)):
        for t in range(mask.size(1)):
            if mask[b, t]:
                p = torch.softmax(teacher[b, t].double() / temperature, -1)
                log_q = torch.log_softmax(reference_logits[b, t] / temperature, -1)
                reference = reference + temperature**2 * (p * (p.log() - log_q)).sum()
    (0.7 * reference).backward()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert student.grad.dtype == dtype and (student.grad[~mask] == 0).all()
    torch.testing.assert_close(student.grad.double(), reference_logits.grad, rtol=tolerance, atol=tolerance)
    with torch.no_grad():
        value = word_level_kd(student, teacher, mask, temperature, rows=rows)
    assert value.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("rows", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_word_level_kd_in_chunks_equals_the_per_position_reference(rows, dtype, temperature):
    """The cached teacher's word KD (its top-k log-probabilities, renormalised): value and gradient
    of the chunked function against autograd through the loss written position by position."""
    logits, target = batch(dtype, seed=3)
    k = 4
    values, ids = torch.log_softmax(3 * torch.randn(logits.shape), -1).topk(k, -1)
    mask = target.ne(PAD)
    student = logits.clone().requires_grad_()
    (0.7 * losses.topk_word_level_kd(student, values, ids, mask, temperature, rows=rows)).backward()

    reference_logits = logits.double().requires_grad_()
    reference = 0.0
    for b in range(mask.size(0)):
        for t in range(mask.size(1)):
            if mask[b, t]:
                q = torch.softmax(values[b, t].double() / temperature, -1)
                log_p = torch.log_softmax(reference_logits[b, t] / temperature, -1)[ids[b, t]]
                reference = reference + temperature**2 * (q * (q.log() - log_p)).sum()
    (0.7 * reference).backward()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert student.grad.dtype == dtype and (student.grad[~mask] == 0).all()
    torch.testing.assert_close(student.grad.double(), reference_logits.grad, rtol=tolerance, atol=tolerance)
    with torch.no_grad():
        value = losses.topk_word_level_kd(student, values, ids, mask, temperature, rows=rows)
    assert value.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-5)
    # padded positions appended change nothing (but the order of the chunks' sums)
    padded = torch.cat([logits, 50 * torch.randn(3, 2, logits.size(-1)).to(dtype)], dim=1)
    padded_values = torch.cat([values, values[:, :2]], dim=1)
    padded_ids = torch.cat([ids, ids[:, :2]], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(3, 2, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        assert losses.topk_word_level_kd(padded, padded_values, padded_ids, padded_mask, temperature,
                                         rows=rows).item() == pytest.approx(value.item(), rel=1e-6)


@pytest.mark.parametrize("rows", [1, 4, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_ce_and_word_kd_at_fewer_positions_equal_their_weighted_sum(rows, dtype, temperature):
    """label_smoothed_ce_and_word_kd with a kd_mask (selective KD's chosen tokens): CE at every
    target token, KD at the chosen ones only, value and gradient against autograd through the
    unchunked references."""
    logits, target = batch(dtype, seed=4)
    teacher = (3 * torch.randn(logits.shape)).to(dtype)
    mask = target.ne(PAD)
    chosen = mask & (torch.rand(mask.shape) < 0.5)
    chosen[1, 0] = True  # at least one
    student = logits.clone().requires_grad_()
    combined, ce, nll, kd = losses.label_smoothed_ce_and_word_kd(student, teacher, target, mask, 0.1, temperature,
                                                                 0.6, 0.4, rows=rows, kd_mask=chosen)
    (1.3 * combined).backward()

    reference_logits = logits.double().requires_grad_()
    reference_ce, reference_nll = fairseq_reference(reference_logits, target, 0.1)
    teacher_lp = torch.log_softmax(teacher.double() / temperature, -1)
    student_lp = torch.log_softmax(reference_logits / temperature, -1)
    reference_kd = temperature**2 * (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1)[chosen].sum()
    (1.3 * (0.6 * reference_ce + 0.4 * reference_kd)).backward()
    for value, reference in ((ce, reference_ce), (nll, reference_nll), (kd, reference_kd),
                             (combined, 0.6 * reference_ce + 0.4 * reference_kd)):
        torch.testing.assert_close(value.double(), reference.detach(), rtol=1e-6, atol=1e-5)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(student.grad.double(), reference_logits.grad, rtol=tolerance, atol=tolerance)
    assert (student.grad[~mask] == 0).all()


def test_default_chunks_hold_a_bounded_number_of_entries():
    for device, budget in losses.CHUNK_ELEMENTS.items():
        assert losses.rows_per_chunk(32_000, positions=4096, device=device) * 32_000 <= budget
        assert losses.rows_per_chunk(10 * budget, positions=4096, device=device) == 1  # one row at least
    # a small batch is still cut into MIN_CHUNKS chunks
    assert losses.rows_per_chunk(100, positions=80) == 80 // losses.MIN_CHUNKS
    with pytest.raises(ValueError):
        losses.rows_per_chunk(100, 0)


def test_cuda_chunks_fit_a_share_of_the_free_memory_within_their_range():
    """The CUDA budget needs no measurement: from the free memory alone, the chunk temporaries of one
    loss take at most CUDA_CHUNK_MEMORY_SHARE of it, as many entries as fit up to the range's top
    (about 64 GiB free and more give 2**24), never below its floor; rows follow the vocabulary."""
    low, high = losses.CUDA_CHUNK_ELEMENTS_RANGE
    gib = 2**30
    previous = 0
    for free in (0, 2**20, 64 * 2**20, gib, 8 * gib, 40 * gib, 80 * gib, 141 * gib):
        elements = losses.cuda_chunk_elements(free)
        assert low <= elements <= high and elements >= previous  # bounded, and never fewer with more memory
        previous = elements
        temporaries = 4 * losses.CHUNK_TEMPORARIES * elements  # float32
        assert elements == low or temporaries <= losses.CUDA_CHUNK_MEMORY_SHARE * free
        assert elements == high or temporaries > losses.CUDA_CHUNK_MEMORY_SHARE * free - 4 * losses.CHUNK_TEMPORARIES
    assert losses.cuda_chunk_elements(141 * gib) == high and losses.cuda_chunk_elements(0) == low
    # 8 GiB free: 8 GiB / 16 / (4 temporaries x 4 bytes) = 2**25 entries, capped at 2**24
    assert losses.cuda_chunk_elements(8 * gib) == 2**24
    # 1 GiB free: 2**30 / 16 / 16 = 2**22 entries; a 32k vocabulary gets 128 positions per chunk
    assert losses.rows_per_chunk(32_768, positions=100_000, device="cuda", free_bytes=gib) == 2**22 // 32_768
    # never more than a MIN_CHUNKS-th of the positions, never less than one row
    assert losses.rows_per_chunk(32_768, positions=80, device="cuda", free_bytes=gib) == 80 // losses.MIN_CHUNKS
    assert losses.rows_per_chunk(10 * high, positions=4096, device="cuda", free_bytes=141 * gib) == 1


def test_cuda_chunks_read_the_free_memory_of_the_gpu(monkeypatch):
    """Without free_bytes, a CUDA chunk asks the device: the driver's free bytes plus what torch's
    allocator keeps unused."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *device: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *device: 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *device: 2**29)
    assert losses.cuda_free_bytes() == 3 * 2**30 + 2**29
    assert losses.rows_per_chunk(1000, positions=10**6, device="cuda") == losses.cuda_chunk_elements(3.5 * 2**30) // 1000


@pytest.mark.parametrize("rows", [1, 4, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature, ce_weight, kd_weight", [(1.0, 0.5, 0.5), (2.0, 0.3, 0.9), (1.0, 0.0, 1.0)])
def test_ce_and_word_kd_in_one_pass_equal_their_weighted_sum(rows, dtype, temperature, ce_weight, kd_weight):
    """label_smoothed_ce_and_word_kd: its weighted sum and gradient are ce_weight * fairseq's CE +
    kd_weight * word KD, each computed by autograd through the unchunked reference; its parts are the
    two losses' values."""
    logits, target = batch(dtype, seed=2)
    teacher = (3 * torch.randn(logits.shape)).to(dtype)
    mask = target.ne(PAD)
    student = logits.clone().requires_grad_()
    combined, ce, nll, kd = losses.label_smoothed_ce_and_word_kd(student, teacher, target, mask, 0.1, temperature,
                                                                 ce_weight, kd_weight, rows=rows)
    (1.7 * combined).backward()

    reference_logits = logits.double().requires_grad_()
    reference_ce, reference_nll = fairseq_reference(reference_logits, target, 0.1)
    teacher_lp = torch.log_softmax(teacher.double() / temperature, -1)
    student_lp = torch.log_softmax(reference_logits / temperature, -1)
    reference_kd = temperature**2 * (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1)[mask].sum()
    (1.7 * (ce_weight * reference_ce + kd_weight * reference_kd)).backward()
    for value, reference in ((ce, reference_ce), (nll, reference_nll), (kd, reference_kd),
                             (combined, ce_weight * reference_ce + kd_weight * reference_kd)):
        torch.testing.assert_close(value.double(), reference.detach(), rtol=1e-6, atol=1e-5)
    assert not (ce.requires_grad or nll.requires_grad or kd.requires_grad)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    assert student.grad.dtype == dtype and (student.grad[~mask] == 0).all()
    torch.testing.assert_close(student.grad.double(), reference_logits.grad, rtol=tolerance, atol=tolerance)


# ------------------------------------------------------------------ the projected hidden-state MSE

def projected_inputs(dtype, shared, bias, seed=0):
    """Student states (3 + 1 layers, d_S 5) and teacher states (4 + 1, d_T 7) of 3 sentences of 6
    positions, two of them padded at the end; 4 layer pairs, one map per pair or one for all."""
    torch.manual_seed(seed)
    student = torch.randn(4, 3, 6, 5).to(dtype)
    teacher = (2 * torch.randn(5, 3, 6, 7)).to(dtype)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, 4:] = True
    padding[2, 1:] = True
    maps = 1 if shared else 4
    weight = (0.5 * torch.randn(maps, 5, 7)).to(dtype)
    offsets = torch.randn(maps, 7).to(dtype) if bias else None
    student_layers, teacher_layers = torch.tensor([1, 2, 2, 3]), torch.tensor([1, 2, 3, 4])
    return student, teacher, padding, weight, offsets, student_layers, teacher_layers


def slow_projected_mse(student, teacher, padding, weight, bias, student_layers, teacher_layers, pair_weight):
    """Pair by pair and position by position, in float64."""
    total = 0.0
    for pair, (s, t) in enumerate(zip(student_layers.tolist(), teacher_layers.tolist())):
        index = 0 if weight.size(0) == 1 else pair
        for b in range(padding.size(0)):
            for position in range(padding.size(1)):
                if padding[b, position]:
                    continue
                mapped = student[s, b, position] @ weight[index]
                if bias is not None:
                    mapped = mapped + bias[index]
                total = total + pair_weight[pair] * ((mapped - teacher[t, b, position]) ** 2).mean()
    return total


@pytest.mark.parametrize("rows", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared, bias", [(False, True), (True, True), (True, False)])
def test_projected_mse_in_chunks_equals_the_per_position_reference(rows, dtype, shared, bias):
    student, teacher, padding, weight, offsets, student_layers, teacher_layers = projected_inputs(dtype, shared, bias)
    pair_weight = torch.tensor([0.5, 0.5, 1.0, 2.0])
    leaves = [student.clone().requires_grad_(), weight.clone().requires_grad_()]
    if bias:
        leaves.append(offsets.clone().requires_grad_())
    loss = losses.projected_mse_sum(leaves[0], student_layers, leaves[1], leaves[2] if bias else None, teacher,
                                    teacher_layers, padding, pair_weight, rows=rows)
    (3.5 * loss).backward()

    reference_leaves = [leaf.detach().double().requires_grad_() for leaf in leaves]
    reference = slow_projected_mse(reference_leaves[0], teacher.double(), padding, reference_leaves[1],
                                   reference_leaves[2] if bias else None, student_layers, teacher_layers,
                                   pair_weight.double())
    (3.5 * reference).backward()
    assert loss.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(loss.double(), reference.detach(), rtol=tolerance, atol=tolerance)
    for leaf, reference_leaf in zip(leaves, reference_leaves):
        assert leaf.grad.dtype == dtype
        # in bfloat16 the products are rounded to 8 bits, so a gradient summed over positions and pairs
        # is compared at its own scale
        scale = reference_leaf.grad.abs().max().item() if dtype != torch.float32 else 1.0
        torch.testing.assert_close(leaf.grad.double(), reference_leaf.grad, rtol=tolerance, atol=tolerance * scale)
    assert (leaves[0].grad[:, padding] == 0).all()


def test_projected_mse_ignores_padding_and_forms_no_gradient_under_no_grad(monkeypatch):
    """Other values at padded positions, on either side, change neither the value nor the gradient;
    without autograd (validation) the value is the same and no gradient buffer is formed, though
    the map's parameters require gradients."""
    student, teacher, padding, weight, offsets, student_layers, teacher_layers = projected_inputs(torch.float32, False, True)

    def run(student, teacher):
        leaves = [student.clone().requires_grad_(), weight.clone().requires_grad_(), offsets.clone().requires_grad_()]
        loss = losses.projected_mse_sum(leaves[0], student_layers, leaves[1], leaves[2], teacher, teacher_layers,
                                        padding, rows=2)
        loss.backward()
        return loss, [leaf.grad for leaf in leaves]

    loss, grads = run(student, teacher)
    scrambled_student, scrambled_teacher = student.clone(), teacher.clone()
    scrambled_student[:, padding] = 1e3
    scrambled_teacher[:, padding] = -1e3
    scrambled_loss, scrambled_grads = run(scrambled_student, scrambled_teacher)
    assert scrambled_loss.item() == loss.item()
    for grad, scrambled in zip(grads, scrambled_grads):
        torch.testing.assert_close(grad, scrambled, rtol=0, atol=0)

    asked = []
    apply = losses._ProjectedMSE.apply
    monkeypatch.setattr(losses._ProjectedMSE, "apply", lambda *args: asked.append(args[-1]) or apply(*args))
    with torch.no_grad():
        quiet = losses.projected_mse_sum(student, student_layers, weight.requires_grad_(), offsets, teacher,
                                         teacher_layers, padding, rows=2)
    assert asked == [False] and quiet.item() == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_projected_mse_is_unchanged_under_autocast(dtype):
    """fairseq's --amp runs the criterion under autocast; the function keeps its own dtypes there."""
    student, teacher, padding, weight, offsets, student_layers, teacher_layers = projected_inputs(torch.float32, True, True)
    results = []
    for autocast in (False, True):
        leaves = [student.clone().requires_grad_(), weight.clone().requires_grad_(), offsets.clone().requires_grad_()]
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            loss = losses.projected_mse_sum(leaves[0], student_layers, leaves[1], leaves[2], teacher, teacher_layers,
                                            padding, rows=3)
        loss.backward()
        results.append([loss] + [leaf.grad for leaf in leaves])
    for plain, autocast in zip(*results):
        assert autocast.dtype == torch.float32
        torch.testing.assert_close(autocast, plain, rtol=0, atol=0)
