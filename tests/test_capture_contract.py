"""The capture contract (fairseq_kd/models/feature_capture.py), one set of tests run against every
kind of teacher: a fairseq Transformer (the tiny teacher) and tiny Hugging Face teachers built from
configs (Marian with one vocabulary and with separate source and target vocabularies, M2M100; 3+3
layers, 2 heads, d 16; nothing downloaded). A new teacher or signal is added here once.

What is particular to one kind stays with it: fairseq's own per-head weights and the student's
gradients in test_feature_capture.py; the Hugging Face model's own outputs, its attention paths and
every method trained from it in test_hf_teacher_features.py.
"""
import math
from dataclasses import dataclass

import pytest
import torch

from conftest import make_batch
from float_bounds import float32_reordering_tolerance
from fairseq_kd.models.feature_capture import (
    ATTENTION_KINDS,
    DECODER_CROSS,
    DECODER_SELF,
    ENCODER_SELF,
    CaptureRequest,
    FeatureCapture,
    attention_modules,
)

TEACHERS = ("fairseq", "marian", "marian_separate", "m2m_100")
HF_FAMILIES = TEACHERS[1:]
EVERYTHING = CaptureRequest(encoder_hidden=True, decoder_hidden=True, attention_kinds=ATTENTION_KINDS,
                            attention_scores=True, attention_values=True)
MAPS_ONLY = CaptureRequest(attention_kinds=ATTENTION_KINDS)


@pytest.fixture(scope="module")
def hf_setup(tiny_hf_teachers):
    """{family: (teacher folder, data-bin)} of the Hugging Face teachers, binarised by fairseq-kd-hf-data
    (conftest's tiny_hf_teachers)."""
    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    made = tiny_hf_teachers(HF_FAMILIES, seed=5, sizes=(120, 12, 12), encoder_layers=3, decoder_layers=3)
    return {family: (made.teachers[family], made.data[family]) for family in HF_FAMILIES}


_HF_TEACHERS = {}


@dataclass
class Case:
    """One teacher under the contract, with what the tests read of its kind."""

    name: str
    teacher: object
    batch: dict
    pad: int

    @property
    def net_input(self) -> dict:
        return self.batch["net_input"]

    @property
    def hugging_face(self) -> bool:
        return self.name != "fairseq"

    def capture(self, request, net_input=None):
        return self.teacher.forward(net_input or self.net_input, request)

    def attention(self, kind):
        """The attention module of every layer of ``kind``."""
        return attention_modules(self.teacher.model, kind)

    def hooked(self, kind):
        """Per layer of ``kind``: whether the capture hooked its attention (fairseq: the module;
        Hugging Face: its projections, which give the scores and values)."""
        if not self.hugging_face:
            return [bool(module._forward_pre_hooks) for module in self.attention(kind)]
        return [bool(module.q_proj._forward_hooks or module.v_proj._forward_hooks) for module in self.attention(kind)]

    def watched(self):
        """Modules no capture may leave a hook on (the teacher's own contiguity hooks are elsewhere)."""
        model = self.teacher.model
        if self.hugging_face:
            return [module for module in model.hf_model.modules()]
        return [model.encoder, model.decoder] + [m for kind in ATTENTION_KINDS for m in self.attention(kind)]

    def unhooked(self) -> bool:
        """No watched module has a hook but transformers' own (it keeps one on each layer and
        attention module once a forward pass asked for their outputs)."""
        def ours(hooks):
            return [hook for hook in hooks.values() if "output_capturing_hook" not in hook.__qualname__]

        return all(not ours(m._forward_pre_hooks) and not ours(m._forward_hooks) for m in self.watched())

    def explicit_path(self) -> bool:
        """Whether the attention takes the explicit path that returns per-head maps (fairseq:
        ``skip_embed_dim_check`` on every attention module; Hugging Face: the eager implementation)."""
        if self.hugging_face:
            return self.teacher.model.hf_model.config._attn_implementation == "eager"
        return all(m.skip_embed_dim_check for kind in ATTENTION_KINDS for m in self.attention(kind))

    def assert_untouched(self):
        """The model is as it was before any capture: no hook, fairseq's fused or Hugging Face's
        default attention path, no wrapped method, no active capture."""
        assert self.unhooked(), self.name
        if self.hugging_face:
            assert self.teacher.model.active_capture is None
            assert self.teacher.model.hf_model.config._attn_implementation == "sdpa"
        else:
            for kind in ATTENTION_KINDS:
                for module in self.attention(kind):
                    assert not module.skip_embed_dim_check, kind
                    assert "apply_sparse_mask" not in vars(module), kind

    def assert_close(self, actual, expected, what=None):
        """Two captures of the same maps: within float32 reordering for fairseq (its fused and
        explicit paths add in other orders), torch's float32 defaults for Hugging Face."""
        if self.hugging_face:
            torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")
        else:
            assert torch.allclose(actual, expected, rtol=0, atol=float32_reordering_tolerance(expected)), what


@pytest.fixture(params=TEACHERS)
def case(request, kd_task) -> Case:
    if request.param == "fairseq":
        batch = make_batch(kd_task, ["w1 w2 w3", "w4 w5 w6 w7 w8 w9", "w10 w11"],
                           ["W3 W2 W1", "W9 W8 W7 W6 W5 W4", "W11 W10"])
        return Case("fairseq", kd_task.teacher, batch, kd_task.source_dictionary.pad())
    from test_hf_teacher import data_task, split_batch

    from fairseq_kd.models.hf_teacher import HuggingFaceTeacher

    folder, data_bin = request.getfixturevalue("hf_setup")[request.param]
    if request.param not in _HF_TEACHERS:
        task = data_task(data_bin)
        _HF_TEACHERS[request.param] = (HuggingFaceTeacher.load(str(folder), task), split_batch(data_bin, task),
                                       task.source_dictionary.pad())
    return Case(request.param, *_HF_TEACHERS[request.param])


def right_padded(src_tokens: torch.Tensor, pad: int) -> torch.Tensor:
    """The same sentences padded on the right (fairseq's --left-pad-source False)."""
    out = src_tokens.new_full(src_tokens.shape, pad)
    for i, row in enumerate(src_tokens):
        real = row[row.ne(pad)]
        out[i, : len(real)] = real
    return out


def padded_input(case: Case, padding: str) -> dict:
    net_input = case.net_input
    if padding == "left":
        assert net_input["src_tokens"][:, 0].eq(case.pad).any()  # fairseq's default
        return net_input
    return {**net_input, "src_tokens": right_padded(net_input["src_tokens"], case.pad)}


@pytest.mark.parametrize("padding", ["left", "right"])
def test_shapes_and_masks(case, padding):
    """Hidden states ``(layers + 1, batch, len, width)``, maps ``(layers, batch, heads, query, key)``
    in float32, values ``(layers, batch, heads, key, d_head)``; the masks are the student's (padding
    of ``src_tokens`` and ``prev_output_tokens``); the embedding output is 0 at padded positions."""
    net_input = padded_input(case, padding)
    _, feats = case.capture(EVERYTHING, net_input)
    src, prev, tgt = net_input["src_tokens"], net_input["prev_output_tokens"], case.batch["target"]
    bsz, src_len, tgt_len = src.size(0), src.size(1), tgt.size(1)
    shape = case.teacher.shape
    assert feats.encoder_hidden.shape == (shape.encoder_layers + 1, bsz, src_len, shape.encoder_embed_dim)
    assert feats.decoder_hidden.shape == (shape.decoder_layers + 1, bsz, tgt_len, shape.decoder_embed_dim)
    assert torch.equal(feats.source_padding_mask, src.eq(case.pad))
    assert torch.equal(feats.target_padding_mask, tgt.eq(case.pad))
    assert torch.equal(feats.target_padding_mask, prev.eq(case.pad))
    assert float(feats.encoder_hidden[0][feats.source_padding_mask].abs().max()) == 0.0
    assert float(feats.decoder_hidden[0][feats.target_padding_mask].abs().max()) == 0.0
    expected = {
        ENCODER_SELF: (shape.encoder_layers, bsz, shape.encoder_heads, src_len, src_len),
        DECODER_SELF: (shape.decoder_layers, bsz, shape.decoder_heads, tgt_len, tgt_len),
        DECODER_CROSS: (shape.decoder_layers, bsz, shape.cross_heads, tgt_len, src_len),
    }
    for kind, maps in feats.attention.items():
        assert maps.probs.dtype == torch.float32, kind
        assert maps.probs.shape == expected[kind]
        assert maps.scores.shape == expected[kind]
        assert maps.values.shape[:4] == expected[kind][:3] + (expected[kind][4],)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_rows_sum_to_one_and_masked_entries_are_zero(case, padding):
    """Every row, padded queries included, is a distribution over the keys it may reach: padded
    keys (and, for decoder self-attention, future keys) get exactly zero probability; the entries
    that take part in a loss (``attendable``) are exactly a real query's reachable keys, and the
    scores are zero outside them."""
    _, feats = case.capture(EVERYTHING, padded_input(case, padding))
    for kind, maps in feats.attention.items():
        attendable = maps.attendable.unsqueeze(0).expand_as(maps.probs)
        real_rows = ~maps.query_padding_mask[None, :, None, :].expand(maps.probs.shape[:-1])
        sums = maps.probs.sum(-1)
        assert torch.allclose(sums[real_rows], torch.ones_like(sums[real_rows]), atol=1e-5), kind
        blocked_real = (~attendable) & real_rows.unsqueeze(-1)
        assert maps.probs[blocked_real].abs().max() == 0, kind
        reachable = ~maps.key_padding_mask[:, None, None, :].expand_as(maps.attendable).clone()
        if kind == DECODER_SELF:
            reachable &= torch.ones(maps.probs.shape[-2:], dtype=torch.bool).tril()
        assert float(maps.probs.masked_fill(reachable[None], 0).abs().max()) == 0.0, kind
        # attendable: a real query and a key it may reach; the scores are 0 everywhere else
        assert torch.equal(maps.attendable, reachable & ~maps.query_padding_mask[:, None, :, None]), kind
        assert float(maps.scores.masked_fill(maps.attendable[None], 0).abs().max()) == 0.0, kind
        torch.testing.assert_close(sums, torch.ones_like(sums))
    causal = feats.attention[DECODER_SELF].probs
    upper = torch.triu(torch.ones(causal.shape[-2:], dtype=torch.bool), diagonal=1)
    assert causal[..., upper].abs().max() == 0


@pytest.mark.parametrize("padding", ["left", "right"])
def test_scores_and_values_are_consistent_with_the_maps_and_the_module(case, padding):
    """The softmax of the scores over the attendable keys gives the probabilities; layer 1's values
    are its ``v_proj`` of the embedding output (normalised first in a pre-norm model), split into heads."""
    net_input = padded_input(case, padding)
    _, feats = case.capture(EVERYTHING, net_input)
    for kind, maps in feats.attention.items():
        from_scores = maps.scores.float().masked_fill(~maps.attendable[None], -math.inf).softmax(-1)
        real_rows = maps.attendable.any(-1, keepdim=True)[None].expand_as(from_scores)
        torch.testing.assert_close(from_scores[real_rows], maps.probs[real_rows], atol=1e-5, rtol=1e-5)
    maps = feats.attention[ENCODER_SELF]
    if not case.hugging_face:
        blocked = ~maps.attendable.unsqueeze(0) | maps.query_padding_mask[None, :, None, :, None]
        recomputed = torch.softmax(maps.scores.masked_fill(~maps.attendable.unsqueeze(0), float("-inf")), -1)
        assert torch.allclose(recomputed.masked_fill(blocked, 0), maps.probs.masked_fill(blocked, 0), atol=1e-6)
    layer_norm = getattr(case.teacher.model.hf_model.get_encoder().layers[0], "self_attn_layer_norm", None) \
        if case.name == "m2m_100" else None
    h0 = feats.encoder_hidden[0]  # (B, S, C): the input of layer 1
    attention = case.attention(ENCODER_SELF)[0]
    with torch.no_grad():
        v = attention.v_proj(layer_norm(h0) if layer_norm is not None else h0)
    bsz, length, _ = v.shape
    expected = v.view(bsz, length, attention.num_heads, -1).transpose(1, 2)
    real = ~feats.source_padding_mask if case.hugging_face else torch.ones_like(feats.source_padding_mask)
    # (Hugging Face: at real positions; its padded slots read the model's own, unzeroed, embedding)
    assert torch.allclose(maps.values[0].transpose(1, 2)[real], expected.transpose(1, 2)[real], atol=1e-5)


def test_nothing_requested_installs_no_hook_and_changes_nothing(case):
    model = case.teacher.model
    with torch.no_grad():
        plain = model(**case.net_input)[0]
    with torch.no_grad(), FeatureCapture(model, CaptureRequest()) as capture:
        assert case.unhooked()
        out = model(**case.net_input)[0]
    assert torch.equal(out, plain)
    assert capture.features().encoder_hidden is None and capture.features().attention == {}
    # and a full capture leaves nothing behind
    case.capture(EVERYTHING)
    case.assert_untouched()


def test_only_requested_kinds_are_computed(case):
    _, feats = case.capture(CaptureRequest(attention_kinds=(DECODER_CROSS,)))
    assert set(feats.attention) == {DECODER_CROSS}
    assert feats.encoder_hidden is None and feats.decoder_hidden is None
    assert feats.attention[DECODER_CROSS].scores is None and feats.attention[DECODER_CROSS].values is None


def test_last_layer_only_equals_the_top_layer_of_a_full_capture(case):
    _, full = case.capture(EVERYTHING)
    top_only = CaptureRequest(attention_kinds=ATTENTION_KINDS, attention_scores=True, attention_values=True,
                              last_layer_attention_only=True)
    _, top = case.capture(top_only)
    for kind in ATTENTION_KINDS:
        assert top.attention[kind].num_layers == 1
        assert top.attention[kind].layers == (full.attention[kind].num_layers,)
        for field in ("probs", "scores", "values"):
            # fairseq: the layers below take its fused attention here, the explicit one in the full
            # capture: the same sums in other orders (float_bounds)
            case.assert_close(getattr(top.attention[kind], field)[0], getattr(full.attention[kind], field)[-1],
                              (kind, field))


def test_a_layer_selection_equals_those_layers_of_a_full_capture_and_hooks_no_other_module(case):
    """A selection (TinyBERT's mapped teacher layers) computes those layers only, in any order given,
    and hooks only their modules."""
    _, full = case.capture(EVERYTHING)
    selection = {ENCODER_SELF: (3, 1), DECODER_CROSS: (2,)}  # any order; DECODER_SELF not named: every layer
    request = CaptureRequest(attention_kinds=ATTENTION_KINDS, attention_scores=True, attention_values=True,
                             attention_layers=selection)
    hooked = []
    with torch.no_grad(), FeatureCapture(case.teacher.model, request) as capture:
        for kind in ATTENTION_KINDS:
            hooked.append(case.hooked(kind))
        case.teacher.model(**case.net_input)
    assert hooked == [[True, False, True], [True, True, True], [False, True, False]]
    case.assert_untouched()
    part = capture.features()
    assert part.attention[ENCODER_SELF].layers == (1, 3)
    assert part.attention[DECODER_SELF].layers == (1, 2, 3)
    assert part.attention[DECODER_CROSS].layers == (2,)
    for kind in ATTENTION_KINDS:
        maps, every = part.attention[kind], full.attention[kind]
        for field in ("probs", "scores", "values"):
            # fairseq: unselected layers take the fused attention path, their sums in another order
            case.assert_close(getattr(maps, field), every.of_layers(getattr(every, field), maps.layers), (kind, field))
            # and a selection's own layers, in any order, come back as asked
            reversed_layers = maps.layers[::-1]
            assert torch.equal(maps.of_layers(getattr(maps, field), reversed_layers),
                               getattr(maps, field).flip(0)), (kind, field)
    assert part.attention[DECODER_SELF].of_layers(part.attention[DECODER_SELF].probs, (1, 2, 3)) is (
        part.attention[DECODER_SELF].probs)  # the whole stack is not copied
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\] were not captured"):
        part.attention[DECODER_CROSS].of_layers(part.attention[DECODER_CROSS].probs, (1, 2))


def test_a_selection_beyond_the_model_is_refused_before_any_forward_pass(case):
    request = CaptureRequest(attention_kinds=(ENCODER_SELF, DECODER_CROSS), attention_layers={DECODER_CROSS: (2, 4)})
    with pytest.raises(ValueError, match="layer 4 requested, but the model has 3"):
        with FeatureCapture(case.teacher.model, request):
            pass
    # what was set up before the refusal is undone
    case.assert_untouched()


def test_maps_only_capture_leaves_the_output_and_the_modules_as_they_were(case):
    """The explicit attention path is taken inside the block only: it changes the output by float
    rounding at most (Hugging Face: at real target positions; the decoder's padded keys are masked
    there as fairseq masks them, which changes only padded rows), and the model gets its own path back."""
    model = case.teacher.model
    with torch.no_grad():
        plain = model(**case.net_input)[0]
    with torch.no_grad(), FeatureCapture(model, MAPS_ONLY) as capture:
        out = model(**case.net_input)[0]
        assert case.explicit_path()
    real_targets = case.net_input["prev_output_tokens"].ne(case.pad)
    torch.testing.assert_close(out[real_targets], plain[real_targets], atol=1e-5, rtol=1e-5)
    if not case.hugging_face:
        assert torch.allclose(out, plain, atol=1e-5)
    case.assert_untouched()
    maps = capture.features().attention
    assert all(maps[kind].scores is None and maps[kind].values is None for kind in ATTENTION_KINDS)
    _, recomputed = case.capture(EVERYTHING)
    for kind in ATTENTION_KINDS:
        mask = maps[kind].attendable.unsqueeze(0).expand_as(maps[kind].probs)
        assert torch.allclose(maps[kind].probs[mask], recomputed.attention[kind].probs[mask], atol=1e-5), kind
