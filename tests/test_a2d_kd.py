"""Align-to-Distill (a2d_kd): the Attention Alignment Module and the A2D loss against slow
references written here, masking, the lambda schedule, fp16 safety, start-up errors, checkpointing
of the AAMs, their export for the Figure 2 heatmap, and real fairseq-train runs."""
import copy
import json
import math

import pytest
import torch
from conftest import TINY_STUDENT_ARGS, build_tiny_student, make_batch, run_module, train_student
from hidden_kd_support import allowed_entries, assert_invariant_to_batch_padding
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

from fairseq_kd.checkpoints import safe_load
from fairseq_kd.cli.plot import figure_weights_from_checkpoint
from fairseq_kd.criterions.a2d_kd import A2DConfig, AlignToDistillCriterion, alignment_kl, resolve_map_reduction
from fairseq_kd.models.feature_capture import ATTENTION_KINDS, CaptureRequest, FeatureCapture
from fairseq_kd.models.teacher import FrozenTeacher
from fairseq_kd.modules.attention_alignment import (
    AlignmentShapeError,
    AttentionAlignment,
    alignment_weights_from_state,
)
from fairseq_kd.figures.draw import plot_alignment_heatmaps
from fairseq_kd.figures.training_log import parse_fairseq_log

TERM_OF_KIND = {"encoder_self": "enc_self_att", "decoder_self": "dec_self_att", "decoder_cross": "dec_cross_att"}
#: tests/test_multirank.py's runs of this criterion (2 CPU ranks equal 1 rank with --update-freq 2):
#: run name -> flags after --criterion NAME
MULTI_RANK_RUNS = {"a2d_kd": []}


def build_a2d(task, **overrides):
    """The criterion as fairseq builds it from its dataclass config."""
    cfg = A2DConfig(sentence_avg=False, **overrides)
    return AlignToDistillCriterion.build_criterion(cfg, task)


def randomize_alignments(criterion, seed=3):
    """Signed, non-uniform AAM weights so the references exercise the full Eq. 9."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in criterion.alignments.values():
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 2.0)
            if module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator))


def slow_coefficients(module):
    """The AAM's (weight, bias) as plain lists; a mixture's weights softmaxed by explicit loops."""
    weight = module.weight.tolist()
    if module.bias is None:
        mixed = []
        for row in weight:
            top = max(row)
            exps = [math.exp(value - top) for value in row]
            mixed.append([value / sum(exps) for value in exps])
        return mixed, [0.0] * len(weight)
    return weight, module.bias.tolist()


# ------------------------------------------------------------------ slow, independent references
def slow_aam(weight, bias, maps, heads):
    """Eq. 9 with explicit loops: maps[l][b][h][q][k] -> out[c][b][q][k]."""
    layers, batch, tq, tk = len(maps), len(maps[0]), len(maps[0][0][0]), len(maps[0][0][0][0])
    out = []
    for c in range(len(weight)):
        per_batch = []
        for b in range(batch):
            rows = []
            for q in range(tq):
                row = []
                for k in range(tk):
                    value = bias[c]
                    for layer in range(layers):
                        for head in range(heads):
                            value += weight[c][layer * heads + head] * maps[layer][b][head][q][k]
                    row.append(value)
                rows.append(row)
            per_batch.append(rows)
        out.append(per_batch)
    return out


def head_average(maps):
    """[l][b][h][q][k] -> [l][b][1][q][k], by loops."""
    out = []
    for layer in maps:
        per_batch = []
        for per_head in layer:
            heads = len(per_head)
            avg = [[sum(per_head[h][q][k] for h in range(heads)) / heads for k in range(len(per_head[0][0]))]
                   for q in range(len(per_head[0]))]
            per_batch.append([avg])
        out.append(per_batch)
    return out


def slow_a2d_kind(student_maps, teacher_maps, weight, bias, may_attend, kind, layerwise, normalization):
    """sum_c KL(A_T^c || normalise(H^I_c)) with explicit loops over maps, sentences, queries, keys."""
    if layerwise:
        student_maps, teacher_maps = head_average(student_maps), head_average(teacher_maps)
    student_heads, teacher_heads = len(student_maps[0][0]), len(teacher_maps[0][0])
    intermediate = slow_aam(weight, bias, student_maps, student_heads)
    batch, tq, tk = len(intermediate[0]), len(intermediate[0][0]), len(intermediate[0][0][0])
    total = 0.0

    def kl_of_logits(logits_p, logits_q):
        """KL(softmax(logits_p) || softmax(logits_q)) by loops."""
        norm_p = math.log(sum(math.exp(v) for v in logits_p))
        norm_q = math.log(sum(math.exp(v) for v in logits_q))
        return sum(math.exp(lp - norm_p) * ((lp - norm_p) - (lq - norm_q)) for lp, lq in zip(logits_p, logits_q))

    for c in range(len(intermediate)):
        layer, head = divmod(c, teacher_heads)
        teacher = teacher_maps[layer]
        for b in range(batch):
            if normalization == "authors":  # every entry of the map, no mask
                entries = [(q, k) for q in range(tq) for k in range(tk)]
            else:
                entries = [(q, k) for q in range(tq) for k in range(tk) if may_attend(kind, b, q, k)]
            if normalization in ("flat", "authors"):
                total += kl_of_logits([teacher[b][head][q][k] for q, k in entries],
                                      [intermediate[c][b][q][k] for q, k in entries])
                continue
            for q in range(tq):
                keys = [k for k in range(tk) if (q, k) in entries]
                if not keys:
                    continue
                if normalization == "row":
                    total += kl_of_logits([teacher[b][head][q][k] for k in keys],
                                          [intermediate[c][b][q][k] for k in keys])
                else:  # mixture: both rows are distributions already
                    for k in keys:
                        p = teacher[b][head][q][k]
                        if p > 0:
                            total += p * (math.log(p) - math.log(intermediate[c][b][q][k]))
    return total


def slow_word_kd(student_logits, teacher_logits, target, pad):
    total = 0.0
    for b, row in enumerate(target.tolist()):
        for t, token in enumerate(row):
            if token == pad:
                continue
            log_p = torch.log_softmax(teacher_logits[b, t].double(), -1).tolist()
            log_q = torch.log_softmax(student_logits[b, t].double(), -1).tolist()
            total += sum(math.exp(lp) * (lp - lq) for lp, lq in zip(log_p, log_q))
    return total


# ----------------------------------------------------------------------------------- the module
@pytest.mark.parametrize("student,teacher", [((3, 8), (6, 4)), ((2, 2), (3, 4)), ((1, 12), (2, 4))])
def test_aam_matches_loops_for_unequal_layers_and_heads(student, teacher):
    module = AttentionAlignment(student[0], student[1], teacher[0], teacher[1])
    assert module.weight.shape == (teacher[0] * teacher[1], student[0] * student[1])
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    maps = torch.rand(student[0], 2, student[1], 3, 4)
    out = module(maps)
    assert out.shape == (teacher[0] * teacher[1], 2, 3, 4) and out.dtype == torch.float32
    expected = slow_aam(module.weight.tolist(), module.bias.tolist(), maps.tolist(), student[1])
    assert torch.allclose(out, torch.tensor(expected), atol=1e-5)


def test_aam_initial_maps_are_the_mean_of_the_student_maps():
    module = AttentionAlignment(3, 8, 6, 4)
    maps = torch.softmax(torch.randn(3, 2, 8, 5, 5), -1)
    expected = maps.mean(dim=(0, 2))
    assert torch.allclose(module(maps), expected.expand(24, -1, -1, -1), atol=1e-6)
    # the mean of distributions is a distribution: rows still sum to 1
    assert torch.allclose(module(maps).sum(-1), torch.ones(24, 2, 5), atol=1e-5)


def test_aam_rejects_maps_of_another_shape_and_checks_sizes_on_load():
    module = AttentionAlignment(2, 4, 3, 4)
    with pytest.raises(AlignmentShapeError, match="2 student layers x 4 heads"):
        module(torch.rand(2, 1, 8, 3, 3))
    other = AttentionAlignment(2, 8, 3, 4)
    state = module.state_dict()
    assert state["_extra_state"] == {"student_layers": 2, "student_heads": 4, "teacher_layers": 3, "teacher_heads": 4,
                                     "combination": "signed"}
    with pytest.raises((AlignmentShapeError, RuntimeError), match="student 2 layers x 4 heads|size mismatch"):
        other.load_state_dict(state)


# -------------------------------------------------------------------------- the loss, in-process
A2D_CASES = [
    pytest.param({}, "head", "row", id="2x2-student-head-row"),
    pytest.param({"encoder_attention_heads": 8, "decoder_attention_heads": 8}, "head", "row", id="8-heads-head-row"),
    pytest.param({"encoder_attention_heads": 8, "decoder_attention_heads": 8}, "layer", "row", id="8-heads-layer-row"),
    pytest.param({"encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
                  "decoder_attention_heads": 4}, "layer", "row", id="1-layer-layer-row"),
    pytest.param({}, "head", "flat", id="2x2-student-head-flat"),
    pytest.param({}, "head", "mixture", id="2x2-student-head-mixture"),
    pytest.param({"encoder_attention_heads": 8, "decoder_attention_heads": 8}, "layer", "mixture",
                 id="8-heads-layer-mixture"),
    pytest.param({}, "head", "authors", id="2x2-student-head-authors"),
]


@pytest.mark.parametrize("student_overrides,granularity,normalization", A2D_CASES)
def test_a2d_loss_matches_slow_reference(kd_task, tiny_batch, student_overrides, granularity, normalization):
    student = build_tiny_student(kd_task, **student_overrides)
    criterion = build_a2d(kd_task, a2d_granularity=granularity, a2d_normalization=normalization)
    randomize_alignments(criterion)
    loss, sample_size, log = criterion(student, tiny_batch)

    request = CaptureRequest(attention_kinds=ATTENTION_KINDS)
    with torch.no_grad(), FeatureCapture(student, request) as capture:
        student_out = student(**tiny_batch["net_input"])
    teacher_out, teacher_features = kd_task.teacher.forward(tiny_batch["net_input"], request)
    student_features = capture.features()
    may_attend = allowed_entries(tiny_batch, kd_task.source_dictionary.pad())
    expected = {}
    for kind, term in TERM_OF_KIND.items():
        module = criterion.alignments[kind]
        expected[term] = slow_a2d_kind(
            student_features.attention[kind].probs.tolist(), teacher_features.attention[kind].probs.tolist(),
            *slow_coefficients(module), may_attend, kind, granularity == "layer", normalization,
        )
        if normalization == "authors":  # the authors' summed KL against CE averaged over B x T positions
            expected[term] *= tiny_batch["target"].numel()
        else:  # the default map reduction (auto) averages Eq. 10's sum over the teacher's maps
            layers, _, heads = teacher_features.attention[kind].probs.shape[:3]
            expected[term] /= layers * (1 if granularity == "layer" else heads)
        assert log[f"{term}_loss"].item() == pytest.approx(expected[term], rel=1e-4, abs=1e-4), term
    expected["word_kd"] = slow_word_kd(student_out[0], teacher_out[0], tiny_batch["target"], criterion.padding_idx)
    assert log["word_kd_loss"].item() == pytest.approx(expected["word_kd"], rel=1e-4)
    # Eq. 11-12 at epoch 1: L_CE + 1 * (enc + (dec_self + dec_cross) / 2) + 1 * L_KD; the authors'
    # code weighs CE and KD by 1 - alpha and alpha (0.5 each).
    ce_weight, kd_weight = (0.5, 0.5) if normalization == "authors" else (1.0, 1.0)
    total = (ce_weight * log["ce_loss"].item() + expected["enc_self_att"]
             + 0.5 * (expected["dec_self_att"] + expected["dec_cross_att"]) + kd_weight * expected["word_kd"])
    assert loss.item() == pytest.approx(total, rel=1e-4)
    assert sample_size == tiny_batch["ntokens"]


def test_map_reduction_default_is_mean_but_authors_sums():
    """auto: mean for the plugin's normalisations; the authors' code sums over maps, and asking it
    to average is refused rather than silently changed."""
    for normalization in ("mixture", "row", "flat"):
        assert resolve_map_reduction("auto", normalization) == "mean"
        assert resolve_map_reduction("sum", normalization) == "sum"
    assert resolve_map_reduction("auto", "authors") == "sum"
    assert resolve_map_reduction("sum", "authors") == "sum"
    with pytest.raises(ValueError, match="--a2d-map-reduction mean cannot be combined with --a2d-normalization authors"):
        resolve_map_reduction("mean", "authors")


def test_authors_mode_refuses_map_mean_at_build(kd_task):
    with pytest.raises(ValueError, match="--a2d-map-reduction mean"):
        build_a2d(kd_task, a2d_normalization="authors", a2d_map_reduction="mean")
    assert build_a2d(kd_task, a2d_normalization="authors").map_reduction == "sum"
    assert build_a2d(kd_task).map_reduction == "mean"


@pytest.mark.parametrize("granularity,teacher_maps", [("head", 12), ("layer", 3)])
def test_map_mean_divides_each_kind_by_its_number_of_teacher_maps(kd_task, tiny_batch, granularity, teacher_maps):
    """--a2d-map-reduction mean: the tiny teacher has 3 layers x 4 heads, so 12 maps per kind head-wise
    and 3 layer-wise; lambda then weighs one map's KL."""
    student = build_tiny_student(kd_task)
    logs = {}
    for reduction in ("sum", "mean"):
        criterion = build_a2d(kd_task, a2d_granularity=granularity, a2d_map_reduction=reduction)
        randomize_alignments(criterion)
        _, _, logs[reduction] = criterion(student, tiny_batch)
    for term in TERM_OF_KIND.values():
        assert logs["sum"][f"{term}_loss"].item() > 0
        assert logs["mean"][f"{term}_loss"].item() * teacher_maps == pytest.approx(
            logs["sum"][f"{term}_loss"].item(), rel=1e-5), term
    assert logs["mean"]["ce_loss"].item() == pytest.approx(logs["sum"]["ce_loss"].item(), rel=1e-6)


def test_aam_sizes_follow_the_models(kd_task):
    build_tiny_student(kd_task, encoder_layers=1, encoder_attention_heads=8, decoder_layers=2, decoder_attention_heads=4)
    criterion = build_a2d(kd_task)
    sizes = {kind: tuple(module.weight.shape) for kind, module in criterion.alignments.items()}
    assert sizes == {"encoder_self": (12, 8), "decoder_self": (12, 8), "decoder_cross": (12, 8)}
    layerwise = build_a2d(kd_task, a2d_granularity="layer")
    assert {kind: tuple(m.weight.shape) for kind, m in layerwise.alignments.items()} == {
        "encoder_self": (3, 1), "decoder_self": (3, 2), "decoder_cross": (3, 2)}


def test_gradients_reach_student_and_aam(kd_task, tiny_batch):
    student = build_tiny_student(kd_task, encoder_attention_heads=8, decoder_attention_heads=8)
    criterion = build_a2d(kd_task, a2d_mu=0.0)
    loss, _, _ = criterion(student, tiny_batch)
    loss.backward()
    for kind, module in criterion.alignments.items():
        assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0, kind
        assert module.bias is None or module.bias.grad is not None
    q_proj = student.encoder.layers[0].self_attn.q_proj.weight
    assert q_proj.grad is not None and q_proj.grad.abs().sum() > 0


# ------------------------------------------------------------------------------- the optimum
def student_identical_to_teacher(task):
    """A student with the teacher's shape and weights (eval mode, so no dropout)."""
    student = build_tiny_student(task, encoder_layers=3, decoder_layers=3, encoder_embed_dim=32, decoder_embed_dim=32,
                                 encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64,
                                 encoder_attention_heads=4, decoder_attention_heads=4)
    student.load_state_dict(task.teacher.model.state_dict())
    return student.eval()


def set_identity_alignment(criterion):
    """Intermediate map c = student map c: identity weights and no bias (a mixture's logits put
    all but e^-80 of the mass on the diagonal)."""
    with torch.no_grad():
        for module in criterion.alignments.values():
            assert module.weight.shape[0] == module.weight.shape[1]
            eye = torch.eye(module.weight.shape[0])
            module.weight.copy_(eye * 80.0 if module.bias is None else eye)
            if module.bias is not None:
                module.bias.zero_()


@pytest.mark.parametrize("granularity", ["head", "layer"])
@pytest.mark.parametrize("normalization", ["mixture", "row", "flat", "authors"])
def test_identical_student_with_identity_alignment_is_the_minimum(kd_task, normalization, granularity):
    """Every normalisation has its minimum, 0, where the intermediate maps equal the teacher's, for
    every kind (padded sources and targets of different lengths, causal decoder self-attention),
    and the loss grows as the student's maps move away from the teacher's."""
    batch = make_batch(kd_task, ["w1 w2 w3", "w4 w5 w6 w7 w8 w9 w10", "w11"],
                       ["W3 W2 W1 W9", "W9 W8 W7 W6 W5 W4", "W11"])
    student = student_identical_to_teacher(kd_task)
    criterion = build_a2d(kd_task, a2d_normalization=normalization, a2d_granularity=granularity)
    set_identity_alignment(criterion)
    with torch.no_grad():
        _, _, log = criterion(student, batch)
    for term in TERM_OF_KIND.values():
        assert abs(log[f"{term}_loss"].item()) < 1e-4, (term, log[f"{term}_loss"].item())
    assert abs(log["word_kd_loss"].item()) < 1e-5

    direction = {name: torch.randn_like(param) for name, param in student.named_parameters()
                 if "q_proj.weight" in name or "k_proj.weight" in name}
    previous = {term: 0.0 for term in TERM_OF_KIND.values()}
    for scale in (0.05, 0.2, 0.8):  # near the minimum the loss grows along any ray
        moved = student_identical_to_teacher(kd_task)
        with torch.no_grad():
            for name, param in moved.named_parameters():
                if name in direction:
                    param.add_(scale * direction[name])
            _, _, log = criterion(moved, batch)
        for term in TERM_OF_KIND.values():
            value = log[f"{term}_loss"].item()
            assert value > previous[term] + 1e-6, (term, scale, value, previous[term])
            previous[term] = value


# --------------------------------------------------------------------------------------- masking
def random_problem(seed=0, maps=6, batch=2, tq=4, tk=5):
    generator = torch.Generator().manual_seed(seed)
    attendable = torch.rand(batch, tq, tk, generator=generator) > 0.3
    attendable[:, :, 0] = True  # every real query has a key
    attendable[1, -1, :] = False  # a padded query
    teacher = torch.softmax(torch.randn(maps, batch, tq, tk, generator=generator).masked_fill(~attendable, -math.inf), -1)
    teacher = teacher.nan_to_num(0.0)
    intermediate = torch.randn(maps, batch, tq, tk, generator=generator) * 3
    return intermediate, teacher, attendable


@pytest.mark.parametrize("normalization", ["mixture", "row", "flat"])
def test_masked_entries_contribute_nothing(normalization):
    intermediate, teacher, attendable = random_problem()
    reference = alignment_kl(intermediate, teacher, attendable, normalization)
    garbage_i, garbage_t = intermediate.clone(), teacher.clone()
    masked = ~attendable.unsqueeze(0).expand_as(intermediate)
    garbage_i[masked] = torch.randn(int(masked.sum())) * 1e4
    garbage_t[masked] = torch.rand(int(masked.sum())) * 50
    changed = alignment_kl(garbage_i, garbage_t, attendable, normalization)
    assert torch.isfinite(reference)
    assert changed.item() == pytest.approx(reference.item(), rel=1e-6)
    garbage_i[masked], garbage_t[masked] = float("nan"), float("nan")
    assert alignment_kl(garbage_i, garbage_t, attendable, normalization).item() == pytest.approx(reference.item(), rel=1e-6)


def test_a2d_loss_is_invariant_to_batch_padding(kd_task):
    """Each sentence alone (no padding) gives the same terms as inside a padded batch."""
    student = build_tiny_student(kd_task, encoder_attention_heads=8, decoder_attention_heads=8)
    criterion = build_a2d(kd_task)
    randomize_alignments(criterion)
    assert_invariant_to_batch_padding(criterion, student, kd_task)


# ----------------------------------------------------------------------------------- weights
def test_lambda_decays_per_epoch_as_a_pure_function_of_the_epoch(kd_task):
    build_tiny_student(kd_task)
    criterion = build_a2d(kd_task)
    for epoch in (1, 2, 5, 3):  # any order: a resumed run only calls begin_epoch(its epoch)
        criterion.begin_epoch(epoch)
        weights = criterion.loss_weights()
        lam = 0.9 ** (epoch - 1)
        assert weights == pytest.approx({"ce": 1.0, "enc_self_att": lam, "dec_self_att": lam / 2,
                                         "dec_cross_att": lam / 2, "word_kd": 1.0})
        fresh = build_a2d(kd_task)  # what a resumed process builds
        fresh.begin_epoch(epoch)
        assert fresh.loss_weights() == weights
    wmt = build_a2d(kd_task, a2d_preset="wmt")
    wmt.begin_epoch(3)
    assert wmt.attention_weight() == pytest.approx(0.1 * 0.81)
    custom = build_a2d(kd_task, a2d_preset="wmt", a2d_lambda=0.5, a2d_lambda_decay=1.0, a2d_mu=0.0)
    custom.begin_epoch(7)
    assert custom.loss_weights()["enc_self_att"] == 0.5 and custom.loss_weights()["word_kd"] == 0.0


@pytest.mark.parametrize("kinds,expected", [
    ("all", {"encoder_self": 1.0, "decoder_self": 0.5, "decoder_cross": 0.5}),
    ("enc_self", {"encoder_self": 1.0}),
    ("dec_all", {"decoder_self": 0.5, "decoder_cross": 0.5}),
    ("dec_self", {"decoder_self": 1.0}),
    ("dec_cross", {"decoder_cross": 1.0}),
])
def test_attention_kinds_select_weights_modules_and_capture(kd_task, tiny_batch, kinds, expected):
    student = build_tiny_student(kd_task)
    criterion = build_a2d(kd_task, a2d_attention_kinds=kinds)
    weights = criterion.loss_weights()
    assert {kind: weights[TERM_OF_KIND[kind]] for kind in ATTENTION_KINDS if weights[TERM_OF_KIND[kind]]} == expected
    assert set(criterion.alignments) == set(expected)
    assert set(criterion.student_request.attention_kinds) == set(expected)
    assert set(criterion.teacher_request.attention_kinds) == set(expected)
    _, _, log = criterion(student, tiny_batch)
    for kind, term in TERM_OF_KIND.items():
        value = log[f"{term}_loss"]
        assert (float(value) > 0) == (kind in expected), term


def test_zero_weights_reduce_to_label_smoothed_cross_entropy(kd_task, tiny_batch, monkeypatch):
    student = build_tiny_student(kd_task)
    criterion = build_a2d(kd_task, a2d_lambda=0.0, a2d_mu=0.0)
    assert len(list(criterion.parameters())) == 0 and criterion.student_request.is_empty
    monkeypatch.setattr(kd_task.teacher, "forward",
                        lambda *a, **k: pytest.fail("the teacher must not run when every KD weight is 0"))
    loss, sample_size, log = criterion(student, tiny_batch)
    reference = LabelSmoothedCrossEntropyCriterion(kd_task, False, 0.1)
    ref_loss, ref_size, ref_log = reference(student, tiny_batch)
    assert loss.item() == ref_loss.item() and sample_size == ref_size
    assert log["nll_loss"].item() == ref_log["nll_loss"].item()


# ------------------------------------------------------------------------------ fp16 and extremes
def test_alignment_kl_is_finite_with_half_maps_and_extreme_teachers():
    intermediate, teacher, attendable = random_problem(seed=1)
    one_hot = torch.zeros_like(teacher)
    one_hot[..., 0] = 1.0  # key 0 is always attendable
    tiny = torch.where(attendable.unsqueeze(0), torch.full_like(teacher, 1e-30), 0.0)
    tiny[..., 0] = 1.0 - 1e-25
    for target in (teacher, one_hot, tiny):
        for dtype in (torch.float16, torch.bfloat16):
            for normalization in ("mixture", "row", "flat", "authors"):
                inter = (intermediate * 1e3).to(dtype).requires_grad_(True)  # large logits, no overflow
                value = alignment_kl(inter, target.to(dtype), attendable, normalization)
                value.backward()
                assert value.dtype == torch.float32 and torch.isfinite(value), (dtype, normalization)
                assert torch.isfinite(inter.grad).all()
    # all-zero student maps through the (initial) AAM: no log of zero anywhere
    module = AttentionAlignment(2, 2, 3, 2)
    zero_maps = torch.zeros(2, 2, 2, 4, 5, dtype=torch.float16)
    value = alignment_kl(module(zero_maps), one_hot, attendable, "row")
    assert torch.isfinite(value) and value > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_whole_criterion_is_finite_in_low_precision(kd_task, tiny_batch, dtype):
    student = build_tiny_student(kd_task, encoder_attention_heads=8, decoder_attention_heads=8).to(dtype)
    task = copy.copy(kd_task)  # a private teacher: following the student's dtype must not round the shared one
    task.teacher = FrozenTeacher(copy.deepcopy(kd_task.teacher.model), kd_task.teacher.path)
    criterion = build_a2d(task).to(dtype)  # fairseq's trainer halves the criterion with --fp16
    try:
        loss, _, log = criterion(student, tiny_batch)
        loss.backward()
    except RuntimeError as err:  # an op without a CPU kernel for this dtype
        pytest.skip(f"{dtype} not supported on this CPU build: {err}")
    assert next(task.teacher.model.parameters()).dtype == dtype
    assert torch.isfinite(loss)
    for term in criterion.TERM_NAMES:
        assert math.isfinite(float(log[f"{term}_loss"])), term
    for module in criterion.alignments.values():
        assert torch.isfinite(module.weight.grad).all()


# ------------------------------------------------------------------------------- start-up errors
@pytest.mark.parametrize("overrides,message", [
    ({"a2d_lambda": -1.0}, "--a2d-lambda must be >= 0"),
    ({"a2d_lambda_decay": 0.0}, "--a2d-lambda-decay must be in"),
    ({"a2d_lambda_decay": 1.5}, "--a2d-lambda-decay must be in"),
    ({"a2d_mu": -0.5}, r"--a2d-mu \(alias of --kd-weight\) must be >= 0"),
    ({"kd_weight": -0.5}, "--kd-weight must be >= 0"),
    ({"kd_temperature": 0.0}, "--kd-temperature must be > 0"),
])
def test_inconsistent_options_fail_at_start(kd_task, overrides, message):
    build_tiny_student(kd_task)
    with pytest.raises(ValueError, match=message):
        build_a2d(kd_task, **overrides)


def test_teacher_without_capturable_attention_fails_at_start(kd_task):
    build_tiny_student(kd_task)
    model = copy.deepcopy(kd_task.teacher.model)
    model.decoder.layers[1].encoder_attn.add_zero_attn = True
    task = copy.copy(kd_task)
    task.teacher = FrozenTeacher(model, "odd_teacher.pt")
    with pytest.raises(ValueError, match=r"--teacher-checkpoint 'odd_teacher.pt'.*add_zero_attn"):
        build_a2d(task)
    # the kinds not in use are not checked: encoder self-attention alone is fine
    assert set(build_a2d(task, a2d_attention_kinds="enc_self").alignments) == {"encoder_self"}


def test_student_without_layers_of_a_kind_fails_at_start(kd_task):
    build_tiny_student(kd_task, encoder_layers=0)
    with pytest.raises(ValueError, match="--encoder-layers"):
        build_a2d(kd_task)
    build_tiny_student(kd_task)


# ------------------------------------------------------------------------------ export / heatmap
def test_alignment_weights_export_in_the_heatmap_format(kd_task):
    build_tiny_student(kd_task, encoder_attention_heads=8, decoder_attention_heads=8)
    criterion = build_a2d(kd_task)
    randomize_alignments(criterion)
    exported = alignment_weights_from_state(criterion.state_dict())  # what fairseq-kd-plot reads
    entry = exported["encoder_self"]
    assert {k: entry[k] for k in ("student_layers", "student_heads", "teacher_layers", "teacher_heads")} == {
        "student_layers": 2, "student_heads": 8, "teacher_layers": 3, "teacher_heads": 4}
    weight = criterion.alignments["encoder_self"].coefficients()  # the default mixture: softmaxed weights
    assert torch.allclose(weight.sum(1), torch.ones(12))
    # row = student map (l, k) at (l-1)*heads + k-1, column = teacher map
    assert len(entry["weights"]) == 16 and len(entry["weights"][0]) == 12
    assert entry["weights"][9][5] == pytest.approx(weight[5, 9].item())
    assert json.loads(json.dumps(exported)) == exported
    figure = plot_alignment_heatmaps(json.loads(json.dumps(exported)))
    assert len(figure.axes[0].images) == 1 and len([a for a in figure.axes if a.images]) == 3


# ------------------------------------------------------------------------------ fairseq-train
EIGHT_HEAD_STUDENT = list(TINY_STUDENT_ARGS)
EIGHT_HEAD_STUDENT[EIGHT_HEAD_STUDENT.index("--encoder-attention-heads") + 1] = "8"
EIGHT_HEAD_STUDENT[EIGHT_HEAD_STUDENT.index("--decoder-attention-heads") + 1] = "8"
LR = 0.003  # COMMON_TRAIN_ARGS


def inner_records(stdout):
    return [r for r in parse_fairseq_log(stdout.splitlines()) if r.split == "train_inner"]


def check_decayed_total(record):
    """loss = ce + 0.9^(epoch-1) * (enc + (dec_self + dec_cross)/2) + kd, from the logged (rounded) terms."""
    v = record.values
    att = v["enc_self_att_loss"] + 0.5 * (v["dec_self_att_loss"] + v["dec_cross_att_loss"])
    lam = 0.9 ** (record.epoch - 1)
    assert v["loss"] == pytest.approx(v["ce_loss"] + lam * att + v["word_kd_loss"], abs=0.006), record
    # the undecayed weight would not fit (guards against a schedule that ignores the epoch)
    if record.epoch > 1:
        assert abs(v["loss"] - (v["ce_loss"] + att + v["word_kd_loss"])) > 0.02


def test_a2d_fairseq_train_with_more_student_heads_resume_and_export(tiny_data_bin, tiny_teacher, tmp_path):
    """An 8-head student learns from the 4-head, deeper teacher; the AAMs are trained, saved with the
    criterion (not the model), restored on resume; lambda decays across epochs and across resume."""
    run = lambda save, updates: train_student(  # noqa: E731
        tiny_data_bin, tiny_teacher, tmp_path / save, ["--criterion", "a2d_kd"],
        student_args=EIGHT_HEAD_STUDENT, max_update=updates)
    first = run("resumed", 4)
    assert "enc_self_att_loss" in first.stdout and "dec_cross_att_loss" in first.stdout
    records = inner_records(first.stdout)
    assert {r.epoch for r in records} == {1, 2}, "the run must cross an epoch boundary"
    for record in records:
        check_decayed_total(record)
    at_four = safe_load(tmp_path / "resumed" / "checkpoint_last.pt")
    resumed = run("resumed", 5)
    resumed_records = inner_records(resumed.stdout)
    assert [r.num_updates for r in resumed_records] == [5] and resumed_records[0].epoch == 2
    check_decayed_total(resumed_records[0])  # a fresh process continues at lambda_2 = 0.9

    final = safe_load(tmp_path / "resumed" / "checkpoint_last.pt")
    assert not [key for key in final["model"] if "align" in key]
    for kind in ATTENTION_KINDS:
        key = f"alignments.{kind}.weight"
        init = torch.zeros_like(final["criterion"][key])  # the default mixture starts at uniform logits
        four, five = at_four["criterion"][key].float(), final["criterion"][key].float()
        assert five.shape == (12, 16)
        assert (four - init).abs().max() > 3 * LR, "the AAM did not train"
        # One Adam step (at most ~1.01 lr in the first updates) from the restored weights; from a
        # re-initialised module the step would have to cover |four - init| > 3 lr.
        assert (five - four).abs().max() < 1.5 * LR

    out = tmp_path / "aam.json"
    run_module("fairseq_kd.cli.plot", "alignment", "--checkpoint", tmp_path / "resumed" / "checkpoint_last.pt",
               "--weights-output", out, "--output", tmp_path / "aam.png")
    assert (tmp_path / "aam.png").stat().st_size > 0
    exported = json.loads(out.read_text())
    assert set(exported) == set(ATTENTION_KINDS)
    # The figure shows the mixture coefficients the module applies (softmax over student maps).
    coefficients = torch.softmax(final["criterion"]["alignments.decoder_cross.weight"].float(), dim=1)
    assert torch.allclose(torch.tensor(exported["decoder_cross"]["weights"]), coefficients.t(), atol=1e-6)
    figure = plot_alignment_heatmaps(exported)
    assert len([axes for axes in figure.axes if axes.images]) == 3
    with pytest.raises(ValueError, match="--criterion a2d_kd"):
        figure_weights_from_checkpoint("alignment", tiny_teacher)  # a checkpoint without criterion parameters

    from fairseq_kd.deploy.export_fairseq import export_student

    export_student(str(tmp_path / "resumed" / "checkpoint_last.pt"), str(tmp_path / "student.pt"))
    shipped = safe_load(tmp_path / "student.pt")
    assert not shipped.get("criterion") and not [key for key in shipped["model"] if "align" in key]


@pytest.mark.parametrize("normalization", ["row", "authors"])
def test_a2d_fairseq_train_layerwise_decoder_only(tiny_data_bin, tiny_teacher, tmp_path, normalization):
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path / "layer",
                         ["--criterion", "a2d_kd", "--a2d-granularity", "layer", "--a2d-attention-kinds",
                          "dec_self", "--a2d-preset", "wmt", "--a2d-mu", "0", "--a2d-normalization", normalization],
                         max_update=3)
    record = inner_records(proc.stdout)[-1]
    assert record.values["dec_self_att_loss"] > 0 and record.values["enc_self_att_loss"] == 0
    # row: L_CE + lambda L_att (mu = 0); authors: 0.5 CE + 0.5 KD + lambda L_att (their alpha = 0.5)
    expected = record.values["ce_loss"] + 0.1 * record.values["dec_self_att_loss"]
    if normalization == "authors":
        expected = (0.5 * record.values["ce_loss"] + 0.5 * record.values["word_kd_loss"]
                    + 0.1 * record.values["dec_self_att_loss"])
    assert record.values["loss"] == pytest.approx(expected, abs=0.003 * max(1.0, expected / 10))
    state = safe_load(tmp_path / "layer" / "checkpoint_last.pt")["criterion"]
    assert set(state) == {"alignments.decoder_self.weight", "alignments.decoder_self.bias",
                          "alignments.decoder_self._extra_state"}
    assert state["alignments.decoder_self.weight"].shape == (3, 2)  # teacher layers x student layers
