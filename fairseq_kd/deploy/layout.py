"""What an export's target layout cannot express, checked once for every export (after
CTranslate2's ``ConfigurationChecker``): an export states each condition its layout refuses on a
:class:`LayoutChecker`, which keeps every one that holds and then refuses them all in one line,
before anything is written. The conditions both exports share are here too."""
from __future__ import annotations

from typing import Iterable, List, Type


class LayoutChecker:
    """The problems found so far, in the order the export checked them."""

    def __init__(self, problems: Iterable[str] = ()) -> None:
        self.problems: List[str] = list(problems)

    def __call__(self, holds, problem: str) -> None:
        """Note ``problem`` (what the model has, in words) when ``holds``."""
        if holds:
            self.problems.append(problem)

    def refuse(self, error: Type[Exception], what: str) -> None:
        """``error``: ``WHAT: PROBLEM; PROBLEM; ...`` when any problem was noted."""
        if self.problems:
            raise error(f"{what}: {'; '.join(self.problems)}")


def check_positions_decoder_and_widths(check: LayoutChecker, encoder, decoder) -> None:
    """What neither CTranslate2's spec nor the Hugging Face families express of a fairseq
    Transformer's positions, decoder and widths."""
    check(encoder.embed_positions is None or decoder.embed_positions is None, "--no-token-positional-embeddings")
    check(getattr(decoder, "adaptive_softmax", None) is not None, "an adaptive softmax (--adaptive-softmax-cutoff)")
    check(getattr(decoder, "project_in_dim", None) is not None or getattr(decoder, "project_out_dim", None) is not None,
          "decoder input/output dimensions other than its embedding dimension")
    check(getattr(decoder, "cross_self_attention", False), "--cross-self-attention")
    check(encoder.embed_tokens.embedding_dim != decoder.embed_tokens.embedding_dim,
          f"encoder width {encoder.embed_tokens.embedding_dim} differs from decoder width "
          f"{decoder.embed_tokens.embedding_dim}")


def normformer_modules(layers) -> List[str]:
    """The NormFormer modules (``--scale-attn/--scale-fc/--scale-heads/--scale-resids``) the layers hold."""
    return sorted({name for layer in layers for name in ("attn_ln", "ffn_layernorm", "c_attn", "w_resid")
                   if getattr(layer, name, None) is not None})
