"""Feature capture on stock fairseq Transformers: the maps equal fairseq's own, the scores its projections', the
student's gradients flow, wrappers are seen through, requests are checked. The contract every teacher
meets (shapes, masks, zero cost when idle, layer selections) is tests/test_capture_contract.py."""
import pytest
import torch

from conftest import build_tiny_student
from test_capture_contract import EVERYTHING, MAPS_ONLY
from fairseq_kd.models.feature_capture import (
    ATTENTION_KINDS,
    DECODER_SELF,
    ENCODER_SELF,
    CaptureRequest,
    FeatureCapture,
    attention_modules,
)

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


def test_equal_selections_make_equal_requests():
    a = CaptureRequest(attention_kinds=(DECODER_SELF, ENCODER_SELF), attention_layers={ENCODER_SELF: [2, 1, 2]})
    b = CaptureRequest(attention_kinds=(ENCODER_SELF, DECODER_SELF), attention_layers=((ENCODER_SELF, (1, 2)),))
    assert a == b and hash(a) == hash(b)


