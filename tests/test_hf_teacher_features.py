"""Feature methods from a Hugging Face teacher (issue 30): the adapter's attention maps and hidden
states are the Hugging Face model's own, in the student's batch layout, under the capture contract
of a fairseq teacher; every feature method runs with such a teacher; a2d_kd and pkd train through
fairseq-train from a Marian teacher and resume.

Nothing is downloaded: tiny Marian (with one vocabulary, and with separate source and target
vocabularies) and M2M100 models (3+3 layers, 2 heads, d 16) are built from configs with the
fixtures of test_hf_teacher.py.
"""
import math
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from conftest import build_tiny_student, kd_criterions, train_student  # noqa: E402
from hidden_kd_support import COMMON, build_criterion  # noqa: E402
from test_hf_teacher import (  # noqa: E402
    SRC,
    STUDENT_ARGS,
    TGT,
    data_task,
    split_batch,
)
from test_capture_contract import EVERYTHING, right_padded  # noqa: E402
from fairseq_kd.models.feature_capture import (  # noqa: E402
    ATTENTION_KINDS,
    DECODER_CROSS,
    DECODER_SELF,
    ENCODER_SELF,
    CaptureRequest,
)
from fairseq_kd.models.hf_teacher import HuggingFaceTeacher  # noqa: E402
from fairseq_kd.tasks.translation_kd import TranslationKDTask  # noqa: E402

#: post-norm without, and pre-norm with, final layer norms; marian_separate: a source and a target vocabulary
FAMILIES = ("marian", "marian_separate", "m2m_100")
SIZES = dict(encoder_layers=3, decoder_layers=3)


@pytest.fixture(scope="module")
def hf(tiny_hf_teachers):
    """The teachers and data of tests/test_capture_contract.py (conftest's tiny_hf_teachers)."""
    return tiny_hf_teachers(FAMILIES, seed=5, sizes=(120, 12, 12), **SIZES)


@pytest.fixture(scope="module")
def corpus(hf):
    return hf.raw


def own_outputs(teacher, source, target):
    """The Hugging Face model's own outputs on one unpadded sentence (eager attention, so that it
    returns its attention weights), with the adapter's id mapping."""
    model = teacher.model
    hf = model.hf_model
    previous = hf.config._attn_implementation
    hf.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            return hf(input_ids=model.to_hf_ids(source, source=True)[None],
                      decoder_input_ids=model.decoder_inputs(target[None]),
                      output_attentions=True, output_hidden_states=True, use_cache=False)
    finally:
        hf.config._attn_implementation = previous


@pytest.mark.parametrize("family", FAMILIES)
def test_features_are_the_models_own_in_the_students_positions(family, teachers, data_bins):
    """On a validation batch with the source padded on the left (fairseq's default) and on the
    right: at every real position the captured attention probabilities (encoder self, decoder
    self, cross), hidden states, scores and values equal the model's own outputs on that sentence
    alone, so padding changes nothing there; the top state is the last layer's output before
    M2M100's final layer norm. (The padded entries follow the capture contract,
    tests/test_capture_contract.py.)"""
    task = data_task(data_bins[family])
    teacher = HuggingFaceTeacher.load(str(teachers[family]), task)
    pad = task.source_dictionary.pad()
    batch = split_batch(data_bins[family], task)
    net_input = batch["net_input"]
    assert net_input["src_tokens"][:, 0].eq(pad).any()  # left padding
    hf = teacher.model.hf_model
    implementation = hf.config._attn_implementation
    captured = {}
    for side, src_tokens in (("left", net_input["src_tokens"]), ("right", right_padded(net_input["src_tokens"], pad))):
        output, features = teacher.forward({**net_input, "src_tokens": src_tokens}, EVERYTHING)
        captured[side] = (src_tokens, output[0], features)
    assert hf.config._attn_implementation == implementation  # eager only inside the capture
    plain_logits = teacher.forward(net_input, CaptureRequest())[0][0]
    real_targets = net_input["prev_output_tokens"].ne(pad)  # (masking padded keys changes padded rows only)
    torch.testing.assert_close(captured["left"][1][real_targets], plain_logits[real_targets], atol=1e-5, rtol=1e-5)

    encoder, decoder = teacher.model.layer_stacks()
    prev = net_input["prev_output_tokens"]
    for src_tokens, _, features in captured.values():
        # (masks, shapes, zeros and sums, scores against maps: tests/test_capture_contract.py, both paddings)
        for row in range(len(src_tokens)):
            source_positions = src_tokens[row].ne(pad).nonzero().flatten()
            target_length = int(prev[row].ne(pad).sum())
            source = src_tokens[row, source_positions]
            own = own_outputs(teacher, source, prev[row, :target_length])
            s, t = source_positions, slice(0, target_length)
            close = dict(atol=1e-5, rtol=1e-4)
            states = features.encoder_hidden[:, row, s]
            torch.testing.assert_close(states[:-1], torch.stack(own.encoder_hidden_states[:-1])[:, 0], **close)
            torch.testing.assert_close(features.decoder_hidden[:-1, row, t],
                                       torch.stack(own.decoder_hidden_states[:-1])[:, 0], **close)
            for side, stack, mine, theirs in (("encoder", encoder, states[-1], own.encoder_hidden_states[-1][0]),
                                              ("decoder", decoder, features.decoder_hidden[-1, row, t],
                                               own.decoder_hidden_states[-1][0])):
                final_norm = getattr(stack, "layer_norm", None)
                assert (final_norm is not None) == (family == "m2m_100")
                # the top state is the last layer's output; Hugging Face's has the final layer norm applied
                torch.testing.assert_close(final_norm(mine) if final_norm is not None else mine, theirs, **close)
                if final_norm is not None:
                    assert not torch.allclose(mine, theirs, atol=1e-3)
            attention = features.attention
            torch.testing.assert_close(attention[ENCODER_SELF].probs[:, row][:, :, s][..., s],
                                       torch.stack(own.encoder_attentions)[:, 0], **close)
            torch.testing.assert_close(attention[DECODER_SELF].probs[:, row, :, t, t],
                                       torch.stack(own.decoder_attentions)[:, 0], **close)
            torch.testing.assert_close(attention[DECODER_CROSS].probs[:, row, :, t][..., s],
                                       torch.stack(own.cross_attentions)[:, 0], **close)
            # values: each layer's v_proj of what its attention reads (pre-norm: the normalised input)
            for index, layer in enumerate(encoder.layers):
                reads = own.encoder_hidden_states[index][0]
                if family == "m2m_100":
                    reads = layer.self_attn_layer_norm(reads)
                expected = layer.self_attn.v_proj(reads).view(len(s), 2, -1).transpose(0, 1)
                torch.testing.assert_close(attention[ENCODER_SELF].values[index, row][:, s], expected, **close)
            memory = own.encoder_last_hidden_state[0]
            for index, layer in enumerate(decoder.layers):
                expected = layer.encoder_attn.v_proj(memory).view(len(s), 2, -1).transpose(0, 1)
                torch.testing.assert_close(attention[DECODER_CROSS].values[index, row][:, s], expected, **close)


def fairseq_model_like(teacher, task):
    """A fairseq Transformer of the teacher's shape over the data's dictionaries (untrained)."""
    from argparse import Namespace
    from types import SimpleNamespace

    from fairseq.models.transformer import TransformerModel, base_architecture

    shape = teacher.shape
    args = Namespace(arch="transformer", _name="transformer", encoder_layers=shape.encoder_layers,
                     decoder_layers=shape.decoder_layers, encoder_embed_dim=shape.encoder_embed_dim,
                     decoder_embed_dim=shape.decoder_embed_dim, encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32,
                     encoder_attention_heads=shape.encoder_heads, decoder_attention_heads=shape.decoder_heads,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, max_source_positions=64,
                     max_target_positions=64)
    base_architecture(args)
    dictionaries = SimpleNamespace(source_dictionary=task.source_dictionary, target_dictionary=task.target_dictionary)
    return TransformerModel.build_model(args, dictionaries).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_conventions_are_a_fairseq_teachers(family, teachers, data_bins):
    """On the same left-padded batch, a fairseq Transformer of the teacher's shape and the adapter
    capture tensors of the same shapes and dtypes, the same masks and attendable entries, zero
    probabilities (and zeroed scores) at exactly the same entries, and the embedding output zero at
    the same positions."""
    from fairseq_kd.models.feature_capture import FeatureCapture

    task = data_task(data_bins[family])
    teacher = HuggingFaceTeacher.load(str(teachers[family]), task)
    net_input = split_batch(data_bins[family], task)["net_input"]
    _, mine = teacher.forward(net_input, EVERYTHING)
    reference = fairseq_model_like(teacher, task)
    with torch.no_grad(), FeatureCapture(reference, EVERYTHING) as capture:
        reference(**net_input)
    theirs = capture.features()
    assert torch.equal(mine.source_padding_mask, theirs.source_padding_mask)
    assert torch.equal(mine.target_padding_mask, theirs.target_padding_mask)
    for side in ("encoder", "decoder"):
        assert mine.hidden(side).shape == theirs.hidden(side).shape
        assert mine.hidden(side).dtype == theirs.hidden(side).dtype
        assert torch.equal(mine.hidden(side)[0].eq(0).all(-1), theirs.hidden(side)[0].eq(0).all(-1))
    for kind in ATTENTION_KINDS:
        a, b = mine.attention[kind], theirs.attention[kind]
        for name in ("probs", "scores", "values"):
            assert getattr(a, name).shape == getattr(b, name).shape, (kind, name)
            assert getattr(a, name).dtype == getattr(b, name).dtype, (kind, name)
        for name in ("query_padding_mask", "key_padding_mask", "attendable"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (kind, name)
        assert torch.equal(a.probs.eq(0), b.probs.eq(0)), kind
        assert torch.equal(a.scores.eq(0), b.scores.eq(0)), kind


def test_teacher_exposes_the_shape_feature_methods_read(teachers, data_bins):
    """Layer counts, heads and widths as TransformerShape reads a fairseq teacher's; the output-only
    methods ask the model for nothing more, and hidden states alone keep the fast (sdpa) attention
    path. (Top-layer requests and layer selections: tests/test_capture_contract.py.)"""
    task = data_task(data_bins["marian"])
    teacher = HuggingFaceTeacher.load(str(teachers["marian"]), task)
    shape = teacher.shape
    assert (shape.encoder_layers, shape.decoder_layers, shape.encoder_heads, shape.decoder_heads, shape.cross_heads,
            shape.encoder_embed_dim, shape.decoder_embed_dim) == (3, 3, 2, 2, 2, 16, 16)
    batch = split_batch(data_bins["marian"], task)
    hf = teacher.model.hf_model
    calls = []
    handle = hf.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((hf.config._attn_implementation, dict(kwargs))), with_kwargs=True)
    try:
        teacher.forward(batch["net_input"], CaptureRequest())
        teacher.forward(batch["net_input"], CaptureRequest(encoder_hidden=True))
    finally:
        handle.remove()
    (plain_path, plain), (hidden_path, hidden) = calls
    assert plain_path == hidden_path == "sdpa"
    assert not {"output_attentions", "output_hidden_states", "decoder_attention_mask"} & set(plain)
    assert hidden.get("output_hidden_states") and "output_attentions" not in hidden


def hf_task(data_bin, teacher):
    import fairseq_kd
    from fairseq_kd.tasks.translation_kd import TranslationKDConfig

    fairseq_kd.register()
    cfg = TranslationKDConfig(data=str(data_bin), source_lang=SRC, target_lang=TGT, teacher_checkpoint=str(teacher),
                              max_source_positions=64, max_target_positions=64)
    return TranslationKDTask.setup_task(cfg)


#: options a criterion needs beyond its dataclass defaults outside fairseq-train (the seed fairseq fills in)
CRITERION_OPTIONS = {"rail_kd": {"seed": 1}}


def test_every_method_runs_with_a_hugging_face_teacher(teachers, data_bins):
    """Every registered distillation criterion builds with an M2M100 teacher (its start-up checks
    read the teacher's shape and capture) and gives a finite loss on a training batch, every term of
    non-zero weight finite and non-zero (A2D's three attention terms, MiniLM's, TinyBERT's scores,
    hidden and embedding terms, internal KD's, each layer term), with gradients for the student."""
    task = hf_task(data_bins["m2m_100"], teachers["m2m_100"])
    assert isinstance(task.teacher, HuggingFaceTeacher)
    batch = split_batch(data_bins["m2m_100"], task)
    for name, criterion_class in kd_criterions().items():
        torch.manual_seed(0)
        student = build_tiny_student(task, max_source_positions=64, max_target_positions=64)
        student.train()
        criterion = build_criterion(criterion_class, task, **{**COMMON, **CRITERION_OPTIONS.get(name, {})})
        criterion.train()
        loss, _, logs = criterion(student, batch)
        assert torch.isfinite(loss), name
        loss.backward()
        assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in student.parameters()), name
        terms = {key: float(value) for key, value in logs.items() if key.endswith("_loss") and key[:-5]
                 in criterion.TERM_NAMES}
        weights = criterion.loss_weights()
        live = {key: value for key, value in terms.items() if weights[key[:-5]] != 0}
        assert live and all(math.isfinite(v) for v in live.values()), (name, terms)
        assert all(v != 0 for v in live.values()), (name, terms)


def test_a2d_and_pkd_train_from_a_marian_teacher_and_resume(teachers, data_bins, tmp_path):
    """fairseq-train --criterion a2d_kd and pkd with the Marian folder as --teacher-checkpoint: 2
    updates, then resumed to 4; the attention (A2D) and layer (PKD) terms are logged and finite."""
    data, teacher = data_bins["marian"], teachers["marian"]
    extra = ["-s", SRC, "-t", TGT, "--cpu"]
    student = STUDENT_ARGS[:2] + ["--encoder-layers", "2", "--decoder-layers", "2"] + STUDENT_ARGS[6:]
    for criterion, terms in ((["--criterion", "a2d_kd"], ("enc_self_att", "dec_self_att", "dec_cross_att")),
                             (["--criterion", "pkd"], ("pkd",))):
        save = tmp_path / criterion[1]
        first = train_student(data, teacher, save, criterion, student, max_update=2, extra=extra)
        resumed = train_student(data, teacher, save, criterion, student, max_update=4, extra=extra)
        log = resumed.stdout + resumed.stderr
        assert "@ 2 updates)" in log and "num_updates=4" in log, log[-2000:]
        for run in (first, resumed):
            for term in terms:
                values = re.findall(rf"\b{term}_loss=([^\s,|]+)", run.stdout + run.stderr)
                assert values and all(math.isfinite(float(v)) and float(v) != 0 for v in values), (term, values)
