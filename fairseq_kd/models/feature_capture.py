"""Capture hidden states and per-head attention maps from stock fairseq Transformers.

One mechanism serves every criterion, for teacher and student alike. It works on unmodified
``fairseq.models.transformer.TransformerModel`` instances through forward hooks that exist only
inside a ``with FeatureCapture(...)`` block, so inference and criterions that ask for nothing pay
nothing.

Hidden states
    The encoder is asked for ``return_all_hiddens`` and its ``encoder_states`` are kept; the
    decoder already returns ``inner_states``. Both lists start with the embedding output (h^0),
    followed by the output of every layer (h^1..h^n), exactly as fairseq defines them.

Attention maps
    fairseq's ``MultiheadAttention`` takes PyTorch's fused path for self-attention in training,
    which returns at most head-averaged, post-dropout weights (measured with fairseq 0.12.3).
    When only the probability maps are asked for, the capture has the modules of the requested
    kinds take fairseq's own explicit path inside the ``with`` block (``need_head_weights`` and
    ``skip_embed_dim_check``, which routes around the fused call) and keeps the per-head,
    pre-dropout float32 maps that path returns: the maps the module used, computed once and
    differentiable with respect to the student's parameters. Cross attention takes that path in
    fairseq anyway. When the pre-softmax scores (TinyBERT) or the value vectors (MiniLM) are asked
    for too, the fused path stays and the capture records each module's inputs (query, key, masks)
    and recomputes ``q k^T / sqrt(d_head)`` afterwards with the module's own projection weights,
    for all layers of a kind in one batched tensor operation.

All tensors are batch-first. Padding masks are ``True`` at padded positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

ENCODER_SELF = "encoder_self"
DECODER_SELF = "decoder_self"
DECODER_CROSS = "decoder_cross"
ATTENTION_KINDS = (ENCODER_SELF, DECODER_SELF, DECODER_CROSS)


class NotATransformerError(TypeError):
    """The model lacks the encoder/decoder layer structure of a fairseq Transformer."""


@dataclass(frozen=True)
class CaptureRequest:
    """What a criterion needs from one forward pass.

    ``attention_kinds`` names the kinds from ``ATTENTION_KINDS`` whose per-head probability maps
    are wanted; ``attention_scores`` adds the pre-softmax logits (TinyBERT) and
    ``attention_values`` the per-head value vectors (MiniLM) for those kinds.
    ``last_layer_attention_only`` computes the maps of the top layer of each kind only (MiniLM),
    so the returned tensors have a layer axis of size 1.
    """

    encoder_hidden: bool = False
    decoder_hidden: bool = False
    attention_kinds: Tuple[str, ...] = ()
    attention_scores: bool = False
    attention_values: bool = False
    last_layer_attention_only: bool = False

    def __post_init__(self):
        unknown = set(self.attention_kinds) - set(ATTENTION_KINDS)
        if unknown:
            raise ValueError(f"unknown attention kind(s) {sorted(unknown)}; valid: {ATTENTION_KINDS}")
        # A canonical order makes requests comparable and hashable regardless of how they were built.
        object.__setattr__(
            self, "attention_kinds", tuple(k for k in ATTENTION_KINDS if k in self.attention_kinds)
        )

    @property
    def is_empty(self) -> bool:
        return not (self.encoder_hidden or self.decoder_hidden or self.attention_kinds)


@dataclass
class AttentionMaps:
    """Per-head attention of every layer of one kind, stacked.

    probs:  ``(layers, batch, heads, query_len, key_len)``, float32, rows sum to 1 over the keys a
            query may attend to (padded keys and, for decoder self-attention, future keys get 0).
    scores: same shape, pre-softmax logits ``q k^T / sqrt(d_head)`` without masking (or None).
    values: ``(layers, batch, heads, key_len, head_dim)`` (or None).
    query_padding_mask: ``(batch, query_len)``, True at padded queries.
    key_padding_mask: ``(batch, key_len)``, True at padded keys.
    attendable: ``(batch, 1, query_len, key_len)`` bool, True where an entry takes part in a loss:
            the query is real and the key is one that query may attend to.
    """

    probs: Tensor
    query_padding_mask: Tensor
    key_padding_mask: Tensor
    attendable: Tensor
    scores: Optional[Tensor] = None
    values: Optional[Tensor] = None

    @property
    def num_layers(self) -> int:
        return self.probs.size(0)

    @property
    def num_heads(self) -> int:
        return self.probs.size(2)


@dataclass
class CapturedFeatures:
    """What one forward pass exposed. Unrequested fields stay None / absent.

    encoder_hidden: ``(encoder_layers + 1, batch, src_len, dim)``, index 0 = embedding output.
    decoder_hidden: ``(decoder_layers + 1, batch, tgt_len, dim)``, index 0 = embedding output.
    """

    source_padding_mask: Optional[Tensor] = None
    target_padding_mask: Optional[Tensor] = None
    encoder_hidden: Optional[Tensor] = None
    decoder_hidden: Optional[Tensor] = None
    attention: Dict[str, AttentionMaps] = field(default_factory=dict)

    def hidden(self, side: str) -> Tensor:
        """Hidden states of ``"encoder"`` or ``"decoder"``: ``(layers + 1, batch, len, dim)``."""
        states = {"encoder": self.encoder_hidden, "decoder": self.decoder_hidden}[side]
        if states is None:
            raise RuntimeError(f"{side} hidden states were not requested in the CaptureRequest")
        return states

    def padding_mask(self, side: str) -> Tensor:
        """``(batch, len)`` True at padded positions of the ``"encoder"`` or ``"decoder"`` side."""
        return {"encoder": self.source_padding_mask, "decoder": self.target_padding_mask}[side]


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / fairseq ModuleProxyWrapper layers to reach the module that owns the layers."""
    while hasattr(model, "module") and isinstance(getattr(model, "module"), nn.Module):
        model = model.module
    return model


def attention_modules(model: nn.Module, kind: str) -> List[nn.Module]:
    """The ``MultiheadAttention`` module of every layer for one attention kind, bottom-up."""
    model = unwrap_model(model)
    try:
        if kind == ENCODER_SELF:
            return [layer.self_attn for layer in model.encoder.layers]
        if kind == DECODER_SELF:
            return [layer.self_attn for layer in model.decoder.layers]
        if kind == DECODER_CROSS:
            modules = [layer.encoder_attn for layer in model.decoder.layers]
            if any(m is None for m in modules):
                raise NotATransformerError("decoder layers have no encoder attention")
            return modules
    except AttributeError as err:
        raise NotATransformerError(
            f"{type(model).__name__} does not have the layout of a fairseq encoder-decoder "
            f"Transformer (encoder.layers[i].self_attn, decoder.layers[i].self_attn/encoder_attn): {err}"
        ) from err
    raise ValueError(f"unknown attention kind {kind!r}")


class FeatureCapture:
    """Context manager that records the requested features of one forward pass of ``model``.

    >>> with FeatureCapture(model, CaptureRequest(encoder_hidden=True)) as capture:
    ...     net_output = model(**sample["net_input"])
    >>> features = capture.features()

    An empty request installs no hook at all.
    """

    def __init__(self, model: nn.Module, request: CaptureRequest):
        self.model = unwrap_model(model)
        self.request = request
        self._handles: list = []
        self._attention_inputs: Dict[str, List[dict]] = {}
        self._encoder_out: Optional[dict] = None
        self._decoder_inner_states: Optional[List[Tensor]] = None
        self._source_padding_mask: Optional[Tensor] = None
        self._prev_output_tokens: Optional[Tensor] = None
        self._padding_idx: Optional[int] = None
        # maps straight from fairseq's explicit attention path (see the module docstring)
        self._direct_maps = bool(request.attention_kinds) and not (
            request.attention_scores or request.attention_values)
        self._skip_embed_dim_check: Dict[nn.Module, bool] = {}

    # ------------------------------------------------------------------ hooks
    def __enter__(self) -> "FeatureCapture":
        if self.request.is_empty:
            return self
        model = self.model
        for kind in self.request.attention_kinds:
            records: List[dict] = []
            self._attention_inputs[kind] = records
            for module in attention_modules(model, kind):
                if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
                    raise NotATransformerError(
                        "attention capture does not support add_bias_kv / add_zero_attn attention"
                    )
                self._handles.append(
                    module.register_forward_pre_hook(
                        self._make_attention_hook(records, self._direct_maps), with_kwargs=True)
                )
                if self._direct_maps:
                    self._handles.append(module.register_forward_hook(self._make_map_hook(records)))
                    self._skip_embed_dim_check.setdefault(module, module.skip_embed_dim_check)
                    module.skip_embed_dim_check = True
        self._handles.append(
            model.encoder.register_forward_pre_hook(self._encoder_pre_hook, with_kwargs=True)
        )
        self._handles.append(model.encoder.register_forward_hook(self._encoder_hook))
        self._handles.append(
            model.decoder.register_forward_pre_hook(self._decoder_pre_hook, with_kwargs=True)
        )
        if self.request.decoder_hidden:
            self._handles.append(model.decoder.register_forward_hook(self._decoder_hook))
        self._padding_idx = model.decoder.padding_idx if hasattr(model.decoder, "padding_idx") else None
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, value in self._skip_embed_dim_check.items():
            module.skip_embed_dim_check = value
        self._skip_embed_dim_check.clear()

    @staticmethod
    def _make_attention_hook(records: List[dict], direct_maps: bool):
        def hook(module, args, kwargs):
            names = ("query", "key", "value", "key_padding_mask")
            call = dict(zip(names, args))
            call.update(kwargs)
            if call.get("incremental_state") is not None:
                # Incremental decoding (generation) is never distilled; recording it would be wrong.
                return None
            records.append(
                {"module": module, "query": call["query"], "key": call.get("key"),
                 "attn_mask": call.get("attn_mask")}
            )
            if direct_maps:
                return args, dict(kwargs, need_weights=True, need_head_weights=True)
            return None

        return hook

    @staticmethod
    def _make_map_hook(records: List[dict]):
        def hook(module, args, output):
            if records and records[-1]["module"] is module and "probs" not in records[-1]:
                weights = output[1] if isinstance(output, tuple) else None
                if weights is not None:
                    records[-1]["probs"] = weights  # (heads, batch, query_len, key_len), float32

        return hook

    def _encoder_pre_hook(self, module, args, kwargs):
        if self.request.encoder_hidden:
            return args, dict(kwargs, return_all_hiddens=True)
        return None

    def _encoder_hook(self, module, args, output):
        self._encoder_out = output
        masks = output.get("encoder_padding_mask") or []
        if masks:
            self._source_padding_mask = masks[0]

    def _decoder_pre_hook(self, module, args, kwargs):
        self._prev_output_tokens = args[0] if args else kwargs.get("prev_output_tokens")
        return None

    def _decoder_hook(self, module, args, output):
        extra = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if isinstance(extra, dict):
            self._decoder_inner_states = extra.get("inner_states")

    # --------------------------------------------------------------- results
    def features(self) -> CapturedFeatures:
        """Assemble the captured tensors. Call after the forward pass, inside or after the block."""
        features = CapturedFeatures()
        if self.request.is_empty:
            return features
        if self._encoder_out is None or self._prev_output_tokens is None:
            raise RuntimeError("FeatureCapture.features() called before a forward pass of the model")
        features.source_padding_mask = self._source_padding_mask
        features.target_padding_mask = self._prev_output_tokens.eq(self._padding_idx)
        if self.request.encoder_hidden:
            states = self._encoder_out.get("encoder_states") or []
            if not states:
                raise RuntimeError("the encoder returned no encoder_states although they were requested")
            features.encoder_hidden = torch.stack(states, 0).transpose(1, 2)
        if self.request.decoder_hidden:
            if not self._decoder_inner_states:
                raise RuntimeError("the decoder returned no inner_states although they were requested")
            features.decoder_hidden = torch.stack(self._decoder_inner_states, 0).transpose(1, 2)
        for kind, records in self._attention_inputs.items():
            if self.request.last_layer_attention_only:
                records = records[-1:]
            features.attention[kind] = self._attention_maps(kind, records, features)
        return features

    def _attention_maps(self, kind: str, records: List[dict], features: CapturedFeatures) -> AttentionMaps:
        if not records:
            raise RuntimeError(f"no {kind} attention call was recorded during the forward pass")
        modules = [r["module"] for r in records]
        direct = self._direct_maps and all("probs" in r for r in records)
        # (L, Tq, B, C); the explicit path's maps need only its sizes
        query = records[0]["query"].unsqueeze(0) if direct else torch.stack([r["query"] for r in records], 0)
        if kind == DECODER_CROSS:
            key = records[0]["key"]  # encoder output, shared by all layers
            key_padding_mask = features.source_padding_mask
            query_padding_mask = features.target_padding_mask
        else:
            key = None  # self-attention: key = query of the same layer
            if kind == ENCODER_SELF:
                key_padding_mask = query_padding_mask = features.source_padding_mask
            else:
                key_padding_mask = query_padding_mask = features.target_padding_mask
        tq, bsz = query.size(1), query.size(2)
        tk = tq if key is None else key.size(0)
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(bsz, tk, dtype=torch.bool, device=query.device)
        if query_padding_mask is None:
            query_padding_mask = torch.zeros(bsz, tq, dtype=torch.bool, device=query.device)
        attn_mask = records[0]["attn_mask"]
        if direct:
            scores = values = None
        else:
            scores, values = stacked_attention_logits(
                modules, query, key, need_values=self.request.attention_values
            )
        # blocked: (B or 1, 1, Tq, Tk) True where a query may not look.
        blocked = key_padding_mask[:, None, None, :]
        if attn_mask is not None:
            future = attn_mask.bool() if attn_mask.dtype == torch.bool else torch.isinf(attn_mask) & (attn_mask < 0)
            blocked = blocked | future[None, None, :tq, :tk]
        if direct:
            probs = torch.stack([r["probs"] for r in records], 0).transpose(1, 2).float()
        else:
            probs = torch.softmax(scores.float().masked_fill(blocked.unsqueeze(0), float("-inf")), dim=-1)
        attendable = ~blocked & ~query_padding_mask[:, None, :, None]
        return AttentionMaps(
            probs=probs,
            query_padding_mask=query_padding_mask,
            key_padding_mask=key_padding_mask,
            attendable=attendable,
            scores=scores if self.request.attention_scores else None,
            values=values,
        )


def stacked_attention_logits(
    modules: List[nn.Module], query: Tensor, key: Optional[Tensor], need_values: bool = False
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-head attention logits of several ``MultiheadAttention`` layers at once.

    query: ``(L, Tq, B, C)`` (one input per layer); key: ``(Tk, B, C)`` shared by all layers, or
    None for self-attention (each layer's key is its query). Returns logits
    ``(L, B, H, Tq, Tk)`` = ``(W_q x + b_q) * d_head^-0.5 . (W_k y + b_k)`` as fairseq computes them,
    and, when asked, values ``(L, B, H, Tk, d_head)``.
    """
    first = modules[0]
    num_heads, head_dim = first.num_heads, first.head_dim
    if any(m.num_heads != num_heads or m.head_dim != head_dim for m in modules):
        raise NotATransformerError("attention layers of one kind differ in head count or size")
    num_layers, tq, bsz, _ = query.shape
    w_q = torch.stack([m.q_proj.weight for m in modules])  # (L, D, C)
    w_k = torch.stack([m.k_proj.weight for m in modules])
    b_q = _stacked_bias(modules, "q_proj", w_q)
    b_k = _stacked_bias(modules, "k_proj", w_k)
    keys_in = query if key is None else key.unsqueeze(0).expand(num_layers, -1, -1, -1)
    tk = keys_in.size(1)
    # One batched matmul over layers: (L, T*B, C) x (L, C, D).
    q = torch.baddbmm(b_q, query.reshape(num_layers, tq * bsz, -1), w_q.transpose(1, 2))
    k = torch.baddbmm(b_k, keys_in.reshape(num_layers, tk * bsz, -1), w_k.transpose(1, 2))
    q = q.view(num_layers, tq, bsz, num_heads, head_dim).permute(0, 2, 3, 1, 4)
    k = k.view(num_layers, tk, bsz, num_heads, head_dim).permute(0, 2, 3, 1, 4)
    scores = torch.matmul(q * (head_dim ** -0.5), k.transpose(-1, -2))
    values = None
    if need_values:
        w_v = torch.stack([m.v_proj.weight for m in modules])
        b_v = _stacked_bias(modules, "v_proj", w_v)
        v = torch.baddbmm(b_v, keys_in.reshape(num_layers, tk * bsz, -1), w_v.transpose(1, 2))
        values = v.view(num_layers, tk, bsz, num_heads, head_dim).permute(0, 2, 3, 1, 4)
    return scores, values


def _stacked_bias(modules: List[nn.Module], name: str, weight: Tensor) -> Tensor:
    biases = [getattr(m, name).bias for m in modules]
    if any(b is None for b in biases):
        bias = torch.zeros(weight.shape[:2], dtype=weight.dtype, device=weight.device)
    else:
        bias = torch.stack(biases)
    return bias.unsqueeze(1)  # (L, 1, D) broadcasts over T*B rows


__all__ = [
    "ATTENTION_KINDS",
    "AttentionMaps",
    "CaptureRequest",
    "CapturedFeatures",
    "DECODER_CROSS",
    "DECODER_SELF",
    "ENCODER_SELF",
    "FeatureCapture",
    "NotATransformerError",
    "attention_modules",
    "stacked_attention_logits",
    "unwrap_model",
]
