"""Feature capture on stock fairseq Transformers: shapes, masks, exactness, zero cost when idle."""
import pytest
import torch

from conftest import build_tiny_student
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

EVERYTHING = CaptureRequest(encoder_hidden=True, decoder_hidden=True, attention_kinds=ATTENTION_KINDS,
                            attention_scores=True, attention_values=True)


def _capture(model, batch, request=EVERYTHING):
    with FeatureCapture(model, request) as capture:
        out = model(**batch["net_input"])
    return out, capture.features()


def _fairseq_per_head_weights(model, batch):
    """Reference: fairseq's own slow attention path asked for per-head weights of every layer."""
    recorded = {kind: [] for kind in ATTENTION_KINDS}
    handles = []
    for kind in ATTENTION_KINDS:
        for module in attention_modules(model, kind):
            module.skip_embed_dim_check = True  # disables PyTorch's fused path for this module
            handles.append(module.register_forward_pre_hook(
                lambda m, a, kw: (a, dict(kw, need_weights=True, need_head_weights=True)), with_kwargs=True))
            handles.append(module.register_forward_hook(
                lambda m, a, out, kind=kind: recorded[kind].append(out[1])))
    try:
        model(**batch["net_input"])
    finally:
        for handle in handles:
            handle.remove()
        for kind in ATTENTION_KINDS:
            for module in attention_modules(model, kind):
                module.skip_embed_dim_check = False
    # fairseq: (heads, batch, tgt, src) per layer -> (layers, batch, heads, tgt, src)
    return {kind: torch.stack(maps).transpose(1, 2) for kind, maps in recorded.items()}


def test_shapes_and_masks(kd_task, tiny_batch):
    model = kd_task.teacher.model
    _, feats = _capture(model, tiny_batch)
    src, tgt = tiny_batch["net_input"]["src_tokens"], tiny_batch["target"]
    bsz, src_len, tgt_len = src.size(0), src.size(1), tgt.size(1)
    shape = kd_task.teacher.shape
    assert feats.encoder_hidden.shape == (shape.encoder_layers + 1, bsz, src_len, shape.encoder_embed_dim)
    assert feats.decoder_hidden.shape == (shape.decoder_layers + 1, bsz, tgt_len, shape.decoder_embed_dim)
    pad = kd_task.source_dictionary.pad()
    assert torch.equal(feats.source_padding_mask, src.eq(pad))
    assert torch.equal(feats.target_padding_mask, tgt.eq(pad))
    expected = {
        ENCODER_SELF: (shape.encoder_layers, bsz, shape.encoder_heads, src_len, src_len),
        DECODER_SELF: (shape.decoder_layers, bsz, shape.decoder_heads, tgt_len, tgt_len),
        DECODER_CROSS: (shape.decoder_layers, bsz, shape.cross_heads, tgt_len, src_len),
    }
    for kind, maps in feats.attention.items():
        assert maps.probs.shape == expected[kind]
        assert maps.scores.shape == expected[kind]
        assert maps.values.shape[:4] == expected[kind][:3] + (expected[kind][4],)


def test_rows_sum_to_one_and_masked_entries_are_zero(kd_task, tiny_batch):
    _, feats = _capture(kd_task.teacher.model, tiny_batch)
    for kind, maps in feats.attention.items():
        attendable = maps.attendable.unsqueeze(0).expand_as(maps.probs)
        real_rows = ~maps.query_padding_mask[None, :, None, :].expand(maps.probs.shape[:-1])
        sums = maps.probs.sum(-1)
        assert torch.allclose(sums[real_rows], torch.ones_like(sums[real_rows]), atol=1e-5), kind
        # padded keys (and future keys for decoder self-attention) get exactly zero probability
        blocked_real = (~attendable) & real_rows.unsqueeze(-1)
        assert maps.probs[blocked_real].abs().max() == 0, kind
    causal = feats.attention[DECODER_SELF].probs
    upper = torch.triu(torch.ones(causal.shape[-2:], dtype=torch.bool), diagonal=1)
    assert causal[..., upper].abs().max() == 0


MAPS_ONLY = CaptureRequest(attention_kinds=ATTENTION_KINDS)


@pytest.mark.parametrize("request_", [EVERYTHING, MAPS_ONLY], ids=["everything", "maps_only"])
@pytest.mark.parametrize("training", [False, True])
def test_probabilities_equal_fairseqs_own_per_head_weights(kd_task, tiny_batch, training, request_):
    model = build_tiny_student(kd_task, encoder_attention_heads=4, decoder_attention_heads=4)
    model.train(training)  # dropout is 0 in the tiny student, so both passes see the same inputs
    _, feats = _capture(model, tiny_batch, request_)
    reference = _fairseq_per_head_weights(model, tiny_batch)
    for kind in ATTENTION_KINDS:
        got = feats.attention[kind].probs
        mask = feats.attention[kind].attendable.unsqueeze(0).expand_as(got)
        assert torch.allclose(got[mask], reference[kind][mask].float(), atol=1e-5), kind


def test_scores_and_values_are_consistent_with_the_module(kd_task, tiny_batch):
    model = kd_task.teacher.model
    _, feats = _capture(model, tiny_batch)
    maps = feats.attention[ENCODER_SELF]
    blocked = ~maps.attendable.unsqueeze(0) | maps.query_padding_mask[None, :, None, :, None]
    recomputed = torch.softmax(maps.scores.masked_fill(~maps.attendable.unsqueeze(0), float("-inf")), -1)
    assert torch.allclose(recomputed.masked_fill(blocked, 0), maps.probs.masked_fill(blocked, 0), atol=1e-6)
    # values of layer 1 = v_proj(h^0) split into heads
    layer = model.encoder.layers[0]
    h0 = feats.encoder_hidden[0]  # (B, S, C) = input of layer 1 (post-norm transformer)
    v = layer.self_attn.v_proj(h0)
    bsz, length, _ = v.shape
    heads = layer.self_attn.num_heads
    expected = v.view(bsz, length, heads, -1).transpose(1, 2)
    assert torch.allclose(maps.values[0], expected, atol=1e-5)


def test_scores_are_q_k_over_sqrt_d_at_attendable_entries_and_zero_elsewhere(kd_task, tiny_batch):
    """Every kind's scores, recomputed here from the module's own projections of the layer inputs
    (hooked separately), equal ``q k^T / sqrt(d_head)`` where a real query may look and are 0
    elsewhere (fairseq adds -inf to the decoder's future keys in place: none may leak out); a loss
    on them backpropagates finitely; the modules' ``apply_sparse_mask`` is the class's again after."""
    model = build_tiny_student(kd_task)
    model.train()
    inputs = {kind: [] for kind in ATTENTION_KINDS}
    handles = [module.register_forward_pre_hook(
        lambda m, a, kw, kind=kind: inputs[kind].append((m, kw.get("query", a[0] if a else None),
                                                         kw.get("key", a[1] if len(a) > 1 else None))),
        with_kwargs=True) for kind in ATTENTION_KINDS for module in attention_modules(model, kind)]
    try:
        _, feats = _capture(model, tiny_batch)
    finally:
        for handle in handles:
            handle.remove()
    for kind in ATTENTION_KINDS:
        maps = feats.attention[kind]
        expected = []
        for module, query, key in inputs[kind]:
            heads = module.num_heads
            q = module.q_proj(query) * module.head_dim ** -0.5  # (Tq, B, C)
            k = module.k_proj(key)
            q = q.view(q.size(0), q.size(1), heads, -1).permute(1, 2, 0, 3)
            k = k.view(k.size(0), k.size(1), heads, -1).permute(1, 2, 0, 3)
            expected.append(q @ k.transpose(-1, -2))
        expected = torch.stack(expected)
        attendable = maps.attendable.unsqueeze(0).expand_as(expected)
        assert attendable.any() and (~attendable).any(), kind
        assert torch.allclose(maps.scores[attendable], expected[attendable], atol=1e-5), kind
        assert (maps.scores[~attendable] == 0).all(), kind
    feats.attention[DECODER_SELF].scores.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert not any("apply_sparse_mask" in vars(module)
                   for kind in ATTENTION_KINDS for module in attention_modules(model, kind))


def test_nothing_requested_installs_no_hook_and_changes_nothing(kd_task, tiny_batch):
    model = kd_task.teacher.model
    modules = [model.encoder, model.decoder] + [m for kind in ATTENTION_KINDS for m in attention_modules(model, kind)]
    plain = model(**tiny_batch["net_input"])[0]
    with FeatureCapture(model, CaptureRequest()) as capture:
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in modules)
        out = model(**tiny_batch["net_input"])[0]
    assert torch.equal(out, plain)
    assert capture.features().encoder_hidden is None and capture.features().attention == {}
    # and a full capture leaves no hook behind
    _capture(model, tiny_batch)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in modules)


def test_only_requested_kinds_are_computed(kd_task, tiny_batch):
    request = CaptureRequest(attention_kinds=(DECODER_CROSS,))
    _, feats = _capture(kd_task.teacher.model, tiny_batch, request)
    assert set(feats.attention) == {DECODER_CROSS}
    assert feats.encoder_hidden is None and feats.decoder_hidden is None
    assert feats.attention[DECODER_CROSS].scores is None and feats.attention[DECODER_CROSS].values is None


def test_student_maps_carry_gradients_to_the_student(kd_task, tiny_batch):
    model = build_tiny_student(kd_task)
    model.train()
    _, feats = _capture(model, tiny_batch, CaptureRequest(attention_kinds=(ENCODER_SELF,)))
    feats.attention[ENCODER_SELF].probs[..., 0].sum().backward()
    assert model.encoder.layers[0].self_attn.q_proj.weight.grad is not None
    assert model.encoder.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_capture_sees_through_a_ddp_style_wrapper(kd_task, tiny_batch):
    model = build_tiny_student(kd_task)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    _, feats = _capture(Wrapper(model), tiny_batch, CaptureRequest(encoder_hidden=True))
    assert feats.encoder_hidden.size(0) == len(model.encoder.layers) + 1


def test_unknown_attention_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown attention kind"):
        CaptureRequest(attention_kinds=("encoder_cross",))


def test_last_layer_only_equals_the_top_layer_of_a_full_capture(kd_task, tiny_batch):
    model = kd_task.teacher.model
    _, full = _capture(model, tiny_batch)
    top_only = CaptureRequest(attention_kinds=ATTENTION_KINDS, attention_scores=True, attention_values=True,
                              last_layer_attention_only=True)
    _, top = _capture(model, tiny_batch, top_only)
    for kind in ATTENTION_KINDS:
        assert top.attention[kind].num_layers == 1
        for field in ("probs", "scores", "values"):
            # the layers below take fairseq's fused attention here, the explicit one in the full
            # capture: the same sums in other orders (float_bounds)
            wanted = getattr(full.attention[kind], field)[-1]
            assert torch.allclose(getattr(top.attention[kind], field)[0], wanted, rtol=0,
                                  atol=float32_reordering_tolerance(wanted)), (kind, field)


def test_a_layer_selection_equals_those_layers_of_a_full_capture_and_hooks_no_other_module(kd_task, tiny_batch):
    model = kd_task.teacher.model  # 3 layers of each kind
    _, full = _capture(model, tiny_batch)
    selection = {ENCODER_SELF: (3, 1), DECODER_CROSS: (2,)}  # any order; DECODER_SELF not named: every layer
    request = CaptureRequest(attention_kinds=ATTENTION_KINDS, attention_scores=True, attention_values=True,
                             attention_layers=selection)
    hooked = []
    with FeatureCapture(model, request) as capture:
        for kind in ATTENTION_KINDS:
            hooked.append([bool(module._forward_pre_hooks) for module in attention_modules(model, kind)])
        model(**tiny_batch["net_input"])
    assert hooked == [[True, False, True], [True, True, True], [False, True, False]]
    part = capture.features()
    assert part.attention[ENCODER_SELF].layers == (1, 3)
    assert part.attention[DECODER_SELF].layers == (1, 2, 3)
    assert part.attention[DECODER_CROSS].layers == (2,)
    for kind in ATTENTION_KINDS:
        maps, every = part.attention[kind], full.attention[kind]
        for field in ("probs", "scores", "values"):
            wanted = every.of_layers(getattr(every, field), maps.layers)
            # unselected layers take the fused attention path: their sums in another order
            assert torch.allclose(getattr(maps, field), wanted, rtol=0,
                                  atol=float32_reordering_tolerance(wanted)), (kind, field)
            # and a selection's own layers, in any order, come back as asked
            reversed_layers = maps.layers[::-1]
            assert torch.equal(maps.of_layers(getattr(maps, field), reversed_layers),
                               getattr(maps, field).flip(0)), (kind, field)
    assert part.attention[DECODER_SELF].of_layers(part.attention[DECODER_SELF].probs, (1, 2, 3)) is (
        part.attention[DECODER_SELF].probs)  # the whole stack is not copied
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\] were not captured"):
        part.attention[DECODER_CROSS].of_layers(part.attention[DECODER_CROSS].probs, (1, 2))


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(attention_kinds=(ENCODER_SELF,), attention_layers={DECODER_SELF: (1,)}), "does not request"),
    (dict(attention_kinds=(ENCODER_SELF,), attention_layers={ENCODER_SELF: (0, 1)}), "1-based"),
    (dict(attention_kinds=(ENCODER_SELF,), attention_layers={ENCODER_SELF: ()}), "1-based"),
    (dict(attention_kinds=(ENCODER_SELF,), attention_layers={ENCODER_SELF: (1,)}, last_layer_attention_only=True),
     "not both"),
])
def test_a_malformed_layer_selection_is_refused(request_kwargs, message):
    with pytest.raises(ValueError, match=message):
        CaptureRequest(**request_kwargs)


def test_a_selection_beyond_the_model_is_refused_before_any_forward_pass(kd_task):
    model = kd_task.teacher.model
    request = CaptureRequest(attention_kinds=(ENCODER_SELF, DECODER_CROSS), attention_layers={DECODER_CROSS: (2, 4)})
    with pytest.raises(ValueError, match="layer 4 requested, but the model has 3"):
        with FeatureCapture(model, request):
            pass
    # the encoder's modules, hooked before the refusal, are left as they were
    for kind in (ENCODER_SELF, DECODER_CROSS):
        for module in attention_modules(model, kind):
            assert not module._forward_pre_hooks and not module._forward_hooks, kind
            assert not module.skip_embed_dim_check, kind


def test_equal_selections_make_equal_requests():
    a = CaptureRequest(attention_kinds=(DECODER_SELF, ENCODER_SELF), attention_layers={ENCODER_SELF: [2, 1, 2]})
    b = CaptureRequest(attention_kinds=(ENCODER_SELF, DECODER_SELF), attention_layers=((ENCODER_SELF, (1, 2)),))
    assert a == b and hash(a) == hash(b)


def test_maps_only_capture_leaves_the_output_and_the_modules_as_they_were(kd_task, tiny_batch):
    """Taking fairseq's explicit attention path inside the block changes the forward pass only by
    float rounding, and the modules get their fused path back afterwards."""
    model = kd_task.teacher.model
    modules = [m for kind in ATTENTION_KINDS for m in attention_modules(model, kind)]
    plain = model(**tiny_batch["net_input"])[0]
    with FeatureCapture(model, MAPS_ONLY) as capture:
        assert all(m.skip_embed_dim_check for m in modules)
        out = model(**tiny_batch["net_input"])[0]
    assert torch.allclose(out, plain, atol=1e-5)
    assert not any(m.skip_embed_dim_check for m in modules)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in modules)
    maps = capture.features().attention
    assert all(maps[kind].scores is None and maps[kind].values is None for kind in ATTENTION_KINDS)
    _, recomputed = _capture(model, tiny_batch)
    for kind in ATTENTION_KINDS:
        mask = maps[kind].attendable.unsqueeze(0).expand_as(maps[kind].probs)
        assert torch.allclose(maps[kind].probs[mask], recomputed.attention[kind].probs[mask], atol=1e-5), kind

