"""Registered teacher and student architectures of the papers' setups.

All are variants of fairseq's own ``transformer`` model (plain ``TransformerModel`` checkpoints);
each sets only the fields it changes and chains to fairseq's ``base_architecture``.

Low-resource setup (IWSLT'14 De-En, IWSLT'17 En-Zh, WMT'22 De-Dsb; Align-to-Distill Sec. 4.1 and
CKD Sec. 4): teacher 6+6 layers, 4 heads, d=512, FFN 1024; students 3+3 (4 or 8 heads) and 2+2.
High-resource setup (WMT'14 En-De): teacher 12+12 at transformer-base widths, student 4+4.
The ``tiny`` pair is for the demo and the tests.
"""
from fairseq.models import register_model_architecture
from fairseq.models.transformer import base_architecture

#: name: (layers on each side, heads, model dimension, FFN dimension, decoder input and output
#: embeddings shared)
ARCHITECTURES = {
    "transformer_kd_iwslt_teacher": (6, 4, 512, 1024, False),  # as fairseq's transformer_iwslt_de_en
    "transformer_kd_iwslt_student_3l": (3, 4, 512, 1024, False),  # A2D's "4 heads" student (Table 1)
    "transformer_kd_iwslt_student_3l_8h": (3, 8, 512, 1024, False),  # A2D's "8 heads" student (Table 1)
    "transformer_kd_iwslt_student_2l": (2, 4, 512, 1024, False),  # the CKD comparison student (6-to-2)
    "transformer_kd_wmt_teacher": (12, 8, 512, 2048, False),  # A2D's WMT'14 teacher, transformer-base widths
    "transformer_kd_wmt_student_4l": (4, 8, 512, 2048, False),  # A2D's WMT'14 student
    "transformer_kd_tiny_teacher": (4, 4, 128, 256, True),  # the demo's teacher (minutes on 2 cores)
    "transformer_kd_tiny_student": (2, 2, 64, 128, True),  # the demo's student
}


def _architecture(layers: int, heads: int, dim: int, ffn: int, shared_embeddings: bool):
    defaults = dict(encoder_embed_dim=dim, encoder_ffn_embed_dim=ffn, decoder_embed_dim=dim,
                    decoder_ffn_embed_dim=ffn, encoder_layers=layers, decoder_layers=layers,
                    encoder_attention_heads=heads, decoder_attention_heads=heads)
    if shared_embeddings:
        defaults["share_decoder_input_output_embed"] = True

    def architecture(args):
        for name, value in defaults.items():
            setattr(args, name, getattr(args, name, value))
        base_architecture(args)

    return architecture


for _name, _shape in ARCHITECTURES.items():
    register_model_architecture("transformer", _name)(_architecture(*_shape))
