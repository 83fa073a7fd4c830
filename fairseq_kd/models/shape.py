"""The dimensions of a Transformer that distillation modules are sized from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from torch import nn

from .feature_capture import DECODER_CROSS, DECODER_SELF, ENCODER_SELF, NotATransformerError, unwrap_model


@dataclass(frozen=True)
class TransformerShape:
    """Layer counts, head counts and widths of one encoder-decoder Transformer, read from the built model."""

    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    cross_heads: int
    encoder_embed_dim: int
    decoder_embed_dim: int

    @classmethod
    def from_model(cls, model: nn.Module) -> "TransformerShape":
        model = unwrap_model(model)
        try:
            enc_layers, dec_layers = model.encoder.layers, model.decoder.layers
            if len(enc_layers) == 0 or len(dec_layers) == 0:
                raise NotATransformerError("the model has an empty encoder or decoder")
            enc_attn = enc_layers[0].self_attn
            dec_attn = dec_layers[0].self_attn
            cross = dec_layers[0].encoder_attn
            if cross is None:
                raise NotATransformerError("the decoder has no encoder-decoder attention")
            return cls(encoder_layers=len(enc_layers), decoder_layers=len(dec_layers),
                       encoder_heads=enc_attn.num_heads, decoder_heads=dec_attn.num_heads,
                       cross_heads=cross.num_heads, encoder_embed_dim=enc_attn.embed_dim,
                       decoder_embed_dim=dec_attn.embed_dim)
        except AttributeError as err:
            raise NotATransformerError(f"{type(model).__name__} is not a fairseq encoder-decoder Transformer "
                                       f"(expected encoder.layers / decoder.layers with attention modules): {err}"
            ) from err

    def layers(self, side: str) -> int:
        return {"encoder": self.encoder_layers, "decoder": self.decoder_layers}[side]

    def embed_dim(self, side: str) -> int:
        return {"encoder": self.encoder_embed_dim, "decoder": self.decoder_embed_dim}[side]

    def kind_size(self, kind: str) -> Tuple[int, int]:
        """``(layers, heads)`` of one attention kind (cross-attention lives in the decoder's layers)."""
        return {ENCODER_SELF: (self.encoder_layers, self.encoder_heads),
                DECODER_SELF: (self.decoder_layers, self.decoder_heads),
                DECODER_CROSS: (self.decoder_layers, self.cross_heads)}[kind]
