"""ALP-KD (--criterion alp_kd): the attention over teacher layers and the loss against a slow
reference, weights that sum to 1 over each bucket, the per-layer weight read-out for the plot,
padding, identity, weight 0, start-up errors, and a fairseq-train run."""
import json
import re

import pytest
import torch

from conftest import build_tiny_student, criterion_factory, run_module, train_student
from fairseq_kd.criterions.alp_kd import ALPKDCriterion
from fairseq_kd.figures.alp_weights import layer_weights_from_checkpoint
from fairseq_kd.models.feature_capture import CaptureRequest
from fairseq_kd.modules.layer_mapping import LayerMappingError
from fairseq_kd.figures.draw import plot_alp_weights
from hidden_kd_support import (
    build_criterion,
    COMMON,
    checkpoint,
    distillation_batch,
    real_positions,
    teacher_copy,
)

# 3 teacher layers, 2 student layers.
TINY_BUCKETS = {"all": ((1, 2, 3), (1, 2, 3)), "no": ((1,), (2, 3)), "po": ((1, 2), (2, 3))}


def assert_same_weights(actual, expected):
    assert set(actual) == set(expected)
    for side in expected:
        torch.testing.assert_close(torch.tensor(actual[side]), torch.tensor(expected[side]))


@criterion_factory("alp_kd")
def make_alp(task, **overrides):
    args = dict(COMMON, kd_weight=0.1, layer_weight=0.7, layer_sides="both", alp_buckets="all", alp_bucket_map=None)
    args.update(overrides)
    return build_criterion(ALPKDCriterion, task, **args)


@torch.no_grad()
def slow_alp(criterion, batch, buckets):
    """Eq. 5-7 for every student layer j, sentence and real position, with explicit loops over the
    bucket's teacher layers."""
    total = 0.0
    for side in ("encoder", "decoder"):
        student, teacher = batch.student.hidden(side), batch.teacher.hidden(side)
        projection = criterion.projections[side]
        for j, bucket in enumerate(buckets, start=1):
            for b, t in real_positions(batch.student.padding_mask(side)):
                s = projection.weight @ student[j, b, t] + projection.bias
                scores = [float(s @ teacher[k, b, t]) for k in bucket]
                top = max(scores)
                exps = [pow(2.718281828459045, x - top) for x in scores]
                alphas = [e / sum(exps) for e in exps]
                combined = sum(a * teacher[k, b, t] for a, k in zip(alphas, bucket))
                total += float(((s - combined) ** 2).mean())
    return total


@pytest.mark.parametrize("buckets", ["all", "no", "po"])
def test_alp_term_matches_a_slow_reference(kd_task, tiny_batch, buckets):
    student = build_tiny_student(kd_task)
    criterion = make_alp(kd_task, alp_buckets=buckets)
    # Hidden states of the distilled sides, no attention maps.
    assert criterion.student_request == criterion.teacher_request == CaptureRequest(encoder_hidden=True, decoder_hidden=True)
    assert criterion.buckets == {"encoder": TINY_BUCKETS[buckets], "decoder": TINY_BUCKETS[buckets]}
    batch = distillation_batch(criterion, student, tiny_batch)
    terms = criterion.distillation_terms(batch)
    assert terms["alp"].item() == pytest.approx(slow_alp(criterion, batch, TINY_BUCKETS[buckets]), rel=1e-5)
    loss, _, log = criterion(student, tiny_batch)
    expected = 0.2 * log["ce_loss"] + 0.1 * log["word_kd_loss"] + 0.7 * log["alp_loss"]
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("buckets, explicit", [("all", None), ("no", None), ("po", None), ("all", "3|1,3")])
def test_alp_weights_sum_to_one_over_each_bucket(kd_task, tiny_batch, buckets, explicit):
    """The mean weights the criterion records in a training step: 1 over each bucket, 0 outside."""
    student = build_tiny_student(kd_task)
    criterion = make_alp(kd_task, alp_buckets=buckets, alp_bucket_map=explicit)
    expected = ((3,), (1, 3)) if explicit else TINY_BUCKETS[buckets]
    criterion.begin_epoch(1)
    criterion(student, tiny_batch)
    for side, weights in criterion.layer_weights().items():
        for j, bucket in enumerate(expected):
            assert sum(weights[j]) == pytest.approx(1.0)
            assert all((weights[j][k] > 0) == (k + 1 in bucket) for k in range(3))


@torch.no_grad()
def slow_alphas(criterion, batch, side, buckets):
    """alpha_jk of Eq. 5 at each real position, by loops: ``[j][index in bucket] -> [per position]``."""
    student, teacher = batch.student.hidden(side), batch.teacher.hidden(side)
    projection = criterion.projections[side]
    alphas = []
    for j, bucket in enumerate(buckets, start=1):
        rows = [[] for _ in bucket]
        for b, t in real_positions(batch.student.padding_mask(side)):
            s = projection.weight @ student[j, b, t] + projection.bias
            scores = [float(s @ teacher[k, b, t]) for k in bucket]
            exps = [pow(2.718281828459045, x - max(scores)) for x in scores]
            for row, e in zip(rows, exps):
                row.append(e / sum(exps))
        alphas.append(rows)
    return alphas


def test_alp_layer_weights_are_the_mean_over_real_positions_for_the_plot(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    criterion = make_alp(kd_task, alp_buckets="po")
    criterion.begin_epoch(1)
    batch = distillation_batch(criterion, student, tiny_batch)
    criterion.eval()
    criterion(student, tiny_batch)  # validation batches are not recorded
    criterion.train()
    criterion.is_dummy_batch = True
    criterion(student, tiny_batch)  # nor a data-parallel worker's dummy batch
    criterion.is_dummy_batch = False
    with pytest.raises(RuntimeError, match="no layer weights yet"):
        criterion.layer_weights()
    criterion(student, tiny_batch)
    criterion(student, tiny_batch)
    weights = criterion.layer_weights()
    assert set(weights) == {"encoder", "decoder"}
    for side in ("encoder", "decoder"):
        alphas = slow_alphas(criterion, batch, side, TINY_BUCKETS["po"])
        for j, bucket in enumerate(TINY_BUCKETS["po"]):
            for row, k in zip(alphas[j], bucket):
                assert weights[side][j][k - 1] == pytest.approx(sum(row) / len(row), abs=1e-6)
            assert sum(weights[side][j]) == pytest.approx(1.0)
        assert weights[side][0][2] == 0.0 and weights[side][1][0] == 0.0  # outside the PO buckets

    assert json.loads(json.dumps(weights)) == weights  # plain JSON, as fairseq-kd-plot alp reads it
    plot_alp_weights(json.loads(json.dumps(weights)))  # the plot command's reader accepts it

    state = criterion.checkpoint_state()
    criterion.begin_epoch(1)  # the same epoch again (a mid-epoch resume) keeps the sums
    assert criterion.layer_weights() == weights
    resumed = make_alp(kd_task, alp_buckets="po")
    resumed.load_checkpoint_state(state)
    resumed.begin_epoch(1)
    assert_same_weights(resumed.layer_weights(), weights)
    resumed.begin_epoch(2)  # a new epoch starts a new average
    with pytest.raises(RuntimeError):
        resumed.layer_weights()


def test_alp_is_zero_for_a_student_identical_to_its_teacher_with_one_layer_buckets(kd_task, tiny_batch):
    student = teacher_copy(kd_task)
    criterion = make_alp(kd_task, alp_buckets="no")  # 3 into 3: {1}, {2}, {3}
    assert criterion.buckets["encoder"] == ((1,), (2,), (3,))
    terms = criterion.distillation_terms(distillation_batch(criterion, student, tiny_batch))
    assert terms["alp"].item() < 1e-8


def test_alp_start_up_errors(kd_task):
    build_tiny_student(kd_task, encoder_layers=4)
    # Attending over all layers works for any depths; buckets cannot be empty.
    assert make_alp(kd_task, layer_sides="encoder").buckets["encoder"] == ((1, 2, 3),) * 4
    with pytest.raises(LayerMappingError, match=r"--alp-buckets no \[encoder\].*valid student depths are 1\.\.3"):
        make_alp(kd_task, alp_buckets="no")
    build_tiny_student(kd_task)
    with pytest.raises(LayerMappingError, match=r"--alp-bucket-map \[encoder\] '1\|\|2': group 2 \(student layer 2\) is empty"):
        make_alp(kd_task, alp_bucket_map="1||2")
    with pytest.raises(LayerMappingError, match=r"valid teacher layers are 1\.\.3"):
        make_alp(kd_task, alp_bucket_map="1,2|3,4")


def test_alp_trains_with_fairseq_train_and_saves_its_weights(tiny_data_bin, tiny_teacher, kd_task, tmp_path):
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path, ["--criterion", "alp_kd", "--layer-sides", "both"], max_update=3)
    assert re.search(r"\| train \| epoch 001 .*word_kd_loss [\d.]+ \| alp_loss [\d.]+", proc.stdout)
    state = checkpoint(tmp_path / "checkpoint_last.pt")
    assert set(state["criterion"]) == {f"projections.{side}.{name}" for side in ("encoder", "decoder") for name in ("weight", "bias")}
    assert not [key for key in state["model"] if "projections" in key]
    build_tiny_student(kd_task)
    make_alp(kd_task).load_state_dict(state["criterion"], strict=True)

    weights = layer_weights_from_checkpoint(tmp_path / "checkpoint_last.pt")
    assert set(weights) == {"encoder", "decoder"}
    for rows in weights.values():
        assert len(rows) == 2 and all(len(row) == 3 and sum(row) == pytest.approx(1.0) for row in rows)
    output = tmp_path / "alp_weights.json"
    figure = tmp_path / "alp_weights.png"
    run_module("fairseq_kd.cli.plot", "alp", "--checkpoint", tmp_path / "checkpoint_last.pt", "--weights-output", output,
               "--output", figure)
    assert_same_weights(json.loads(output.read_text()), weights)
    assert figure.stat().st_size > 0
    refused = run_module("fairseq_kd.cli.plot", "alp", "--checkpoint", tmp_path / "checkpoint_last.pt",
                         "--weights-output", output, "--output", tmp_path / "other.png", check=False)
    assert refused.returncode != 0 and "--overwrite" in refused.stderr


def autograd_alp(student_states, weight, bias, teacher_states, padding_mask, member):
    """Eq. 5 and 7 for all positions at once, differentiated by autograd (float64)."""
    student = student_states[1:]
    if weight is not None:
        student = student @ weight + bias
    teacher = teacher_states[1:]
    scores = torch.einsum("jbtd,kbtd->jkbt", student, teacher).masked_fill(~member[:, :, None, None], float("-inf"))
    alpha = torch.softmax(scores, dim=1)
    combined = torch.einsum("jkbt,kbtd->jbtd", alpha, teacher)
    per_position = ((student - combined) ** 2).mean(-1).masked_fill(padding_mask, 0.0)
    return per_position.sum(), (alpha * (~padding_mask)).sum((2, 3))


@pytest.mark.parametrize("rows", [1, 3, None, 10_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("projected", [True, False])
def test_alp_layer_mse_in_chunks_equals_autograd_over_all_positions(rows, dtype, projected):
    """Value, layer-weight sums and gradients (student states, P's weight and bias) of the chunked
    term equal autograd through the unchunked equations, with padding and a partial bucket."""
    from fairseq_kd.criterions.alp_kd import alp_layer_mse

    torch.manual_seed(0)
    width = 6
    student = (0.5 * torch.randn(3, 2, 5, 4 if projected else width)).to(dtype).requires_grad_()
    teacher = (0.5 * torch.randn(4, 2, 5, width)).to(dtype)
    weight = (0.5 * torch.randn(4, width)).to(dtype).requires_grad_() if projected else None
    bias = (0.1 * torch.randn(width)).to(dtype).requires_grad_() if projected else None
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, 2:] = True
    member = torch.tensor([[True, True, True], [False, True, True]])
    loss, alpha_sum, positions = alp_layer_mse(student, weight, bias, teacher, padding, member, rows=rows)
    (2.5 * loss).backward()
    leaves = [leaf for leaf in (student, weight, bias) if leaf is not None]
    references = [leaf.detach().double().requires_grad_() for leaf in leaves]
    reference, reference_alpha = autograd_alp(references[0], references[1] if projected else None,
                                              references[2] if projected else None, teacher.double(), padding, member)
    (2.5 * reference).backward()
    assert positions == 7 and loss.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(loss.double(), reference.detach(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(alpha_sum, reference_alpha.detach(), rtol=tolerance, atol=tolerance)
    assert (alpha_sum[1, 0] == 0).all()
    for leaf, reference_leaf in zip(leaves, references):
        assert leaf.grad.dtype == dtype
        scale = 1.0 if dtype == torch.float32 else reference_leaf.grad.abs().max().item()
        torch.testing.assert_close(leaf.grad.double(), reference_leaf.grad, rtol=tolerance, atol=tolerance * scale)
    assert (student.grad[:, padding] == 0).all() and (student.grad[0] == 0).all()


def test_alp_layer_mse_is_unchanged_under_autocast():
    """fairseq's --amp runs the criterion under autocast; the term keeps its own dtypes there."""
    from fairseq_kd.criterions.alp_kd import alp_layer_mse

    torch.manual_seed(0)
    student, teacher = torch.randn(3, 2, 5, 4), torch.randn(4, 2, 5, 6)
    weight, bias = torch.randn(4, 6), torch.randn(6)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, 3:] = True
    member = torch.ones(2, 3, dtype=torch.bool)
    results = []
    for autocast in (False, True):
        leaves = [tensor.clone().requires_grad_() for tensor in (student, weight, bias)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, alpha_sum, _ = alp_layer_mse(*leaves, teacher, padding, member, rows=2)
        loss.backward()
        results.append([loss, alpha_sum] + [leaf.grad for leaf in leaves])
    for plain, autocast in zip(*results):
        torch.testing.assert_close(autocast, plain, rtol=0, atol=0)
