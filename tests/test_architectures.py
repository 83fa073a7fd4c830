"""The registered architectures have the papers' sizes and build as stock fairseq Transformers."""
from argparse import Namespace

import pytest

import fairseq_kd

fairseq_kd.register()
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY  # noqa: E402
from fairseq.models.transformer import TransformerModel  # noqa: E402

EXPECTED = {
    # name: (layers, heads, embed dim, ffn dim)
    "transformer_kd_iwslt_teacher": (6, 4, 512, 1024),
    "transformer_kd_iwslt_student_3l": (3, 4, 512, 1024),
    "transformer_kd_iwslt_student_3l_8h": (3, 8, 512, 1024),
    "transformer_kd_iwslt_student_2l": (2, 4, 512, 1024),
    "transformer_kd_wmt_teacher": (12, 8, 512, 2048),
    "transformer_kd_wmt_student_4l": (4, 8, 512, 2048),
    "transformer_kd_tiny_teacher": (4, 4, 128, 256),
    "transformer_kd_tiny_student": (2, 2, 64, 128),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_architecture_sizes(name):
    assert ARCH_MODEL_REGISTRY[name] is TransformerModel  # plain fairseq checkpoints
    args = Namespace()
    ARCH_CONFIG_REGISTRY[name](args)
    layers, heads, dim, ffn = EXPECTED[name]
    for side in ("encoder", "decoder"):
        assert getattr(args, f"{side}_layers") == layers
        assert getattr(args, f"{side}_attention_heads") == heads
        assert getattr(args, f"{side}_embed_dim") == dim
        assert getattr(args, f"{side}_ffn_embed_dim") == ffn


def test_command_line_flags_override_the_architecture_defaults():
    args = Namespace(encoder_layers=5)
    ARCH_CONFIG_REGISTRY["transformer_kd_iwslt_student_3l"](args)
    assert args.encoder_layers == 5 and args.decoder_layers == 3


def test_student_and_teacher_build_with_the_task(kd_task):
    from fairseq_kd.models.shape import TransformerShape

    args = Namespace(arch="transformer_kd_iwslt_student_3l_8h", _name="transformer")
    ARCH_CONFIG_REGISTRY[args.arch](args)
    shape = TransformerShape.from_model(kd_task.build_model(args))
    assert (shape.encoder_layers, shape.decoder_heads, shape.cross_heads, shape.encoder_embed_dim) == (3, 8, 8, 512)
