"""Registered teacher and student architectures of the papers' setups.

All are variants of fairseq's own ``transformer`` model, so their checkpoints are plain
``TransformerModel`` checkpoints. Each function sets only the fields it changes and chains to
fairseq's ``base_architecture`` for the rest, as fairseq's ``transformer_legacy.py`` does.

Low-resource setup (IWSLT'14 De-En, IWSLT'17 En-Zh, WMT'22 De-Dsb; Align-to-Distill Sec. 4.1 and
CKD Sec. 4): teacher 6+6 layers, 4 heads, d=512, FFN 1024; students 3+3 (4 or 8 heads) and 2+2.
High-resource setup (WMT'14 En-De): teacher 12+12 at transformer-base widths, student 4+4.
The ``tiny`` pair is for the demo and the tests.
"""
from fairseq.models import register_model_architecture
from fairseq.models.transformer import base_architecture


def _set(args, **defaults):
    for name, value in defaults.items():
        setattr(args, name, getattr(args, name, value))


def _iwslt_widths(args, layers: int, heads: int):
    _set(
        args,
        encoder_embed_dim=512, encoder_ffn_embed_dim=1024, decoder_embed_dim=512,
        decoder_ffn_embed_dim=1024, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads,
    )
    base_architecture(args)


@register_model_architecture("transformer", "transformer_kd_iwslt_teacher")
def transformer_kd_iwslt_teacher(args):
    """6+6 layers, 4 heads, d=512, FFN 1024 (same as fairseq's transformer_iwslt_de_en)."""
    _iwslt_widths(args, layers=6, heads=4)


@register_model_architecture("transformer", "transformer_kd_iwslt_student_3l")
def transformer_kd_iwslt_student_3l(args):
    """3+3 layers, 4 heads: A2D's "4 heads" student (Table 1)."""
    _iwslt_widths(args, layers=3, heads=4)


@register_model_architecture("transformer", "transformer_kd_iwslt_student_3l_8h")
def transformer_kd_iwslt_student_3l_8h(args):
    """3+3 layers, 8 heads: A2D's "8 heads" student (Table 1)."""
    _iwslt_widths(args, layers=3, heads=8)


@register_model_architecture("transformer", "transformer_kd_iwslt_student_2l")
def transformer_kd_iwslt_student_2l(args):
    """2+2 layers, 4 heads: the CKD comparison student (6-to-2 mappings)."""
    _iwslt_widths(args, layers=2, heads=4)


def _wmt_widths(args, layers: int):
    _set(
        args,
        encoder_embed_dim=512, encoder_ffn_embed_dim=2048, decoder_embed_dim=512,
        decoder_ffn_embed_dim=2048, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=8, decoder_attention_heads=8,
    )
    base_architecture(args)


@register_model_architecture("transformer", "transformer_kd_wmt_teacher")
def transformer_kd_wmt_teacher(args):
    """12+12 layers at transformer-base widths (A2D's WMT'14 teacher)."""
    _wmt_widths(args, layers=12)


@register_model_architecture("transformer", "transformer_kd_wmt_student_4l")
def transformer_kd_wmt_student_4l(args):
    """4+4 layers at transformer-base widths (A2D's WMT'14 student)."""
    _wmt_widths(args, layers=4)


def _tiny_widths(args, layers: int, dim: int, ffn: int, heads: int):
    _set(
        args,
        encoder_embed_dim=dim, encoder_ffn_embed_dim=ffn, decoder_embed_dim=dim,
        decoder_ffn_embed_dim=ffn, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads,
        share_decoder_input_output_embed=True,
    )
    base_architecture(args)


@register_model_architecture("transformer", "transformer_kd_tiny_teacher")
def transformer_kd_tiny_teacher(args):
    """4+4 layers, 4 heads, d=128, FFN 256: the demo's teacher (trains in minutes on 2 cores)."""
    _tiny_widths(args, layers=4, dim=128, ffn=256, heads=4)


@register_model_architecture("transformer", "transformer_kd_tiny_student")
def transformer_kd_tiny_student(args):
    """2+2 layers, 2 heads, d=64, FFN 128: the demo's student."""
    _tiny_widths(args, layers=2, dim=64, ffn=128, heads=2)
