"""Hidden states and per-head attention maps of one forward pass, for teacher and student alike.

:class:`CaptureRequest` says which signals a criterion needs, :class:`CapturedFeatures` and
:class:`AttentionMaps` their layouts (batch-first; padding masks True at padded positions; index 0
of the hidden states the embedding output). ``FeatureCapture(model, request)`` records them inside
its ``with`` block through hooks that exist only there; each kind of model (:class:`FairseqFeatureCapture`,
:class:`.hf_teacher.HuggingFaceFeatureCapture`) only says how its modules are read.
The contract and how fairseq's fused attention path is avoided: ``docs/design/teachers.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..errors import InputError

ENCODER_SELF = "encoder_self"
DECODER_SELF = "decoder_self"
DECODER_CROSS = "decoder_cross"
ATTENTION_KINDS = (ENCODER_SELF, DECODER_SELF, DECODER_CROSS)


class NotATransformerError(InputError, TypeError):
    """The model (a user's checkpoint, folder or ``--arch``) lacks the encoder/decoder layer
    structure of a fairseq Transformer."""


@dataclass(frozen=True)
class CaptureRequest:
    """What a criterion needs from one forward pass.

    ``attention_kinds``: the kinds (of ``ATTENTION_KINDS``) whose per-head probability maps are
    wanted; ``attention_scores`` adds their pre-softmax logits (TinyBERT), ``attention_values`` their
    per-head values (MiniLM). ``last_layer_attention_only``: the top layer of each kind only;
    ``attention_layers``: per kind, the 1-based layers computed (e.g. ``{"encoder_self": (2, 4)}``),
    every layer for a kind it does not name. Unselected attention modules are not hooked.
    """

    encoder_hidden: bool = False
    decoder_hidden: bool = False
    attention_kinds: Tuple[str, ...] = ()
    attention_scores: bool = False
    attention_values: bool = False
    last_layer_attention_only: bool = False
    #: stored as ``((kind, (layer, ...)), ...)`` in canonical order, so the request stays hashable
    attention_layers: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()

    def __post_init__(self):
        unknown = set(self.attention_kinds) - set(ATTENTION_KINDS)
        if unknown:
            raise ValueError(f"unknown attention kind(s) {sorted(unknown)}; valid: {ATTENTION_KINDS}")
        object.__setattr__(self, "attention_kinds", tuple(k for k in ATTENTION_KINDS if k in self.attention_kinds))
        selection = dict(self.attention_layers)
        if selection and self.last_layer_attention_only:
            raise ValueError("give attention_layers or last_layer_attention_only, not both")
        not_requested = set(selection) - set(self.attention_kinds)
        if not_requested:
            raise ValueError(f"attention_layers names kind(s) {sorted(not_requested)} that attention_kinds "
                             f"does not request ({self.attention_kinds})")
        canonical = []
        for kind in self.attention_kinds:
            if kind in selection:
                layers = tuple(sorted(set(int(layer) for layer in selection[kind])))
                if not layers or layers[0] < 1:
                    raise ValueError(f"attention_layers[{kind!r}] must name 1-based layers, got {selection[kind]}")
                canonical.append((kind, layers))
        object.__setattr__(self, "attention_layers", tuple(canonical))

    def layer_indices(self, kind: str, num_layers: int) -> Tuple[int, ...]:
        """0-based indices of the layers of ``kind`` (of ``num_layers``) whose maps are computed."""
        if self.last_layer_attention_only:
            return (num_layers - 1,)
        layers = dict(self.attention_layers).get(kind)
        if layers is None:
            return tuple(range(num_layers))
        if layers[-1] > num_layers:
            raise ValueError(f"{kind} attention of layer {layers[-1]} requested, but the model has "
                             f"{num_layers} such layers")
        return tuple(layer - 1 for layer in layers)

    @property
    def is_empty(self) -> bool:
        return not (self.encoder_hidden or self.decoder_hidden or self.attention_kinds)


@dataclass
class AttentionMaps:
    """Per-head attention of every layer of one kind, stacked.

    probs:  ``(layers, batch, heads, query_len, key_len)``, float32, rows sum to 1 over the keys a
            query may attend to (padded keys and, for decoder self-attention, future keys get 0).
    scores: same shape, pre-softmax logits ``q k^T / sqrt(d_head)`` where ``attendable`` is True,
            0 elsewhere (or None).
    values: ``(layers, batch, heads, key_len, head_dim)`` (or None).
    query_padding_mask: ``(batch, query_len)``, True at padded queries.
    key_padding_mask: ``(batch, key_len)``, True at padded keys.
    attendable: ``(batch, 1, query_len, key_len)`` bool, True where an entry takes part in a loss:
            the query is real and the key is one that query may attend to.
    layers: the 1-based layer number of each entry of the layer axis, ascending.
    """

    probs: Tensor
    query_padding_mask: Tensor
    key_padding_mask: Tensor
    attendable: Tensor
    layers: Tuple[int, ...]
    scores: Optional[Tensor] = None
    values: Optional[Tensor] = None

    def of_layers(self, tensor: Tensor, layers: Sequence[int]) -> Tensor:
        """The entries of ``tensor`` (``probs``, ``scores`` or ``values``) of the 1-based ``layers``,
        in that order; the stack itself when it holds exactly those."""
        layers = tuple(layers)
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise ValueError(f"layer(s) {missing} were not captured (the maps hold layers {self.layers})")
        if layers == self.layers:
            return tensor
        return tensor[[self.layers.index(layer) for layer in layers]]

    @property
    def num_layers(self) -> int:
        return self.probs.size(0)

    @property
    def num_heads(self) -> int:
        return self.probs.size(2)


@dataclass
class CapturedFeatures:
    """What one forward pass exposed; unrequested fields stay None / absent.

    encoder_hidden: ``(encoder_layers + 1, batch, src_len, dim)``, index 0 = embedding output.
    decoder_hidden: ``(decoder_layers + 1, batch, tgt_len, dim)``, index 0 = embedding output.
    """

    source_padding_mask: Optional[Tensor] = None
    target_padding_mask: Optional[Tensor] = None
    encoder_hidden: Optional[Tensor] = None
    decoder_hidden: Optional[Tensor] = None
    attention: Dict[str, AttentionMaps] = field(default_factory=dict)

    def hidden(self, side: str) -> Tensor:
        states = {"encoder": self.encoder_hidden, "decoder": self.decoder_hidden}[side]
        if states is None:
            raise RuntimeError(f"{side} hidden states were not requested in the CaptureRequest")
        return states

    def padding_mask(self, side: str) -> Tensor:
        """``(batch, len)`` True at padded positions of the ``"encoder"`` or ``"decoder"`` side."""
        return {"encoder": self.source_padding_mask, "decoder": self.target_padding_mask}[side]


def attention_maps(kind: str, probs: Tensor, features: CapturedFeatures, future: Optional[Tensor],
                   scores: Optional[Tensor], values: Optional[Tensor], layers: Tuple[int, ...]) -> AttentionMaps:
    """The :class:`AttentionMaps` of one kind (``scores`` zeroed in place outside ``attendable``);
    ``future``: ``(query, key)``, True at keys a query may not see yet (decoder self-attention)."""
    if probs.size(0) != len(layers):  # a capture subclass's _maps gives one stack entry per layer index
        raise ValueError(f"{kind}: {probs.size(0)} attention maps captured for layers {layers}")
    _, bsz, _, tq, tk = probs.shape
    source_queries, source_keys = kind == ENCODER_SELF, kind in (ENCODER_SELF, DECODER_CROSS)
    key_padding_mask = features.source_padding_mask if source_keys else features.target_padding_mask
    query_padding_mask = features.source_padding_mask if source_queries else features.target_padding_mask
    if key_padding_mask is None:
        key_padding_mask = torch.zeros(bsz, tk, dtype=torch.bool, device=probs.device)
    if query_padding_mask is None:
        query_padding_mask = torch.zeros(bsz, tq, dtype=torch.bool, device=probs.device)
    blocked = key_padding_mask[:, None, None, :]  # True where a query may not look
    if future is not None:
        blocked = blocked | future[None, None, :tq, :tk]
    attendable = ~blocked & ~query_padding_mask[:, None, :, None]
    if scores is not None:
        # in place on the capture's stacked copy: no -inf is left for a loss to turn into a NaN gradient
        scores.masked_fill_(~attendable.unsqueeze(0), 0.0)
    return AttentionMaps(probs=probs, query_padding_mask=query_padding_mask, key_padding_mask=key_padding_mask,
                         attendable=attendable, scores=scores, values=values, layers=layers)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / fairseq ModuleProxyWrapper layers to reach the module that owns the layers."""
    while hasattr(model, "module") and isinstance(getattr(model, "module"), nn.Module):
        model = model.module
    return model


def attention_modules(model: nn.Module, kind: str) -> List[nn.Module]:
    """The attention module of every layer of one kind, bottom-up (of ``model.layer_stacks()`` where
    the model defines it, of ``model.encoder`` / ``model.decoder`` otherwise)."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {kind!r}")
    model = unwrap_model(model)
    try:
        encoder, decoder = model.layer_stacks() if hasattr(model, "layer_stacks") else (model.encoder, model.decoder)
        layers = (encoder if kind == ENCODER_SELF else decoder).layers
        modules = [layer.encoder_attn if kind == DECODER_CROSS else layer.self_attn for layer in layers]
    except AttributeError as err:
        raise NotATransformerError(
            f"{type(model).__name__} does not have the layout of a fairseq encoder-decoder "
            f"Transformer (encoder.layers[i].self_attn, decoder.layers[i].self_attn/encoder_attn): {err}") from err
    if any(module is None for module in modules):
        raise NotATransformerError("decoder layers have no encoder attention")
    return modules


class FeatureCapture:
    """Context manager that records the requested features of one forward pass of ``model``.

    >>> with FeatureCapture(model, CaptureRequest(encoder_hidden=True)) as capture:
    ...     net_output = model(**sample["net_input"])
    >>> features = capture.features()

    ``FeatureCapture(model, request)`` builds the model's ``capture_class`` or
    :class:`FairseqFeatureCapture`. A subclass implements ``_hook_attention(kind, index, module)``
    (0-based layer), ``_install()``, and after the forward pass ``_masks()`` (None before one),
    ``_hidden(side, features)`` and ``_maps(kind, indices, features)`` (``(probs, future, scores,
    values)`` as :func:`attention_maps` takes them); docs/design/teachers.md.
    """

    def __new__(cls, model: nn.Module, request: CaptureRequest):
        if cls is FeatureCapture:
            cls = getattr(unwrap_model(model), "capture_class", FairseqFeatureCapture)
        return super().__new__(cls)

    def __init__(self, model: nn.Module, request: CaptureRequest):
        self.model = unwrap_model(model)
        self.request = request
        self._undo: list = []  # what __exit__ undoes, last first
        self._layers: Dict[str, Tuple[int, ...]] = {}  # kind -> 0-based layers whose maps are computed
        self._records: Dict[Tuple[str, int], dict] = {}  # (kind, 0-based layer) -> what its call left

    def __enter__(self) -> "FeatureCapture":
        if self.request.is_empty:
            return self
        try:
            for kind in self.request.attention_kinds:
                modules = attention_modules(self.model, kind)
                self._layers[kind] = self.request.layer_indices(kind, len(modules))
                for index in self._layers[kind]:
                    self._hook_attention(kind, index, modules[index])
            self._install()
        except BaseException:
            self.__exit__(None, None, None)  # no hook of a refused request stays on the model
            raise
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    def hook(self, module: nn.Module, hook, pre: bool = False) -> None:
        """``hook`` on ``module`` inside the block: a forward pre-hook with kwargs when ``pre``."""
        handle = module.register_forward_pre_hook(hook, with_kwargs=True) if pre else module.register_forward_hook(hook)
        self._undo.append(handle.remove)

    def assign(self, owner, name: str, value) -> None:
        """``owner.name = value`` inside the block."""
        self._undo.append(partial(setattr, owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def features(self) -> CapturedFeatures:
        """The captured tensors; call after the forward pass, inside or after the block."""
        if self.request.is_empty:
            return CapturedFeatures()
        features = self._masks()
        if features is None:
            raise RuntimeError(f"{type(self).__name__}.features() called before a forward pass of the model")
        if self.request.encoder_hidden:
            features.encoder_hidden = self._hidden("encoder", features)
        if self.request.decoder_hidden:
            features.decoder_hidden = self._hidden("decoder", features)
        for kind, indices in self._layers.items():
            probs, future, scores, values = self._maps(kind, indices, features)
            features.attention[kind] = attention_maps(kind, probs, features, future, scores, values,
                                                      tuple(index + 1 for index in indices))
        return features


class FairseqFeatureCapture(FeatureCapture):
    """The capture of a stock fairseq Transformer (docs/design/teachers.md)."""

    def __init__(self, model: nn.Module, request: CaptureRequest):
        super().__init__(model, request)
        self._open: Dict[nn.Module, dict] = {}  # attention module -> the record of its call in progress
        self._encoder_out: Optional[dict] = None
        self._decoder_inner_states: Optional[List[Tensor]] = None
        self._prev_output_tokens: Optional[Tensor] = None

    def _hook_attention(self, kind: str, index: int, module: nn.Module) -> None:
        if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
            raise NotATransformerError("attention capture does not support add_bias_kv / add_zero_attn attention")

        def before(module, args, kwargs):
            call = dict(zip(("query", "key", "value", "key_padding_mask"), args))
            call.update(kwargs)
            if call.get("incremental_state") is not None:  # generation is never distilled
                return None
            self._open[module] = self._records[kind, index] = {"attn_mask": call.get("attn_mask")}
            return args, dict(kwargs, need_weights=True, need_head_weights=True)

        def after(module, args, output):
            record = self._open.pop(module, None)
            if record is not None and isinstance(output, tuple) and output[1] is not None:
                record["probs"] = output[1]  # (heads, batch, query_len, key_len), float32

        self.hook(module, before, pre=True)
        self.hook(module, after)
        if self.request.attention_values:  # (len, batch, embed_dim); fairseq only reshapes it
            self.hook(module.v_proj, lambda projection, args, output: self._note(module, "v", output))
        if self.request.attention_scores and "apply_sparse_mask" not in vars(module):
            module.apply_sparse_mask = self._score_recorder(module)
            self._undo.append(partial(delattr, module, "apply_sparse_mask"))  # the class's method again
        self.assign(module, "skip_embed_dim_check", True)  # (docs/design/teachers.md)

    def _note(self, module: nn.Module, key: str, tensor: Tensor) -> None:
        record = self._open.get(module)
        if record is not None:
            record[key] = tensor

    def _score_recorder(self, module: nn.Module):
        apply_sparse_mask = module.apply_sparse_mask  # the class's (bound) method

        def record(attn_weights, tgt_len: int, src_len: int, bsz: int):
            attn_weights = apply_sparse_mask(attn_weights, tgt_len, src_len, bsz)
            # (batch * heads, tgt, src). fairseq then adds a causal attn_mask in place (-inf at
            # future keys); attention_maps zeroes every entry outside ``attendable``.
            self._note(module, "scores", attn_weights)
            return attn_weights

        return record

    def _install(self) -> None:
        encoder, decoder = self.model.encoder, self.model.decoder
        if self.request.encoder_hidden:
            self.hook(encoder, lambda module, args, kwargs: (args, dict(kwargs, return_all_hiddens=True)), pre=True)
        self.hook(encoder, self._encoder_hook)
        self.hook(decoder, self._decoder_pre_hook, pre=True)
        if self.request.decoder_hidden:
            self.hook(decoder, self._decoder_hook)

    def _encoder_hook(self, module, args, output):
        self._encoder_out = output

    def _decoder_pre_hook(self, module, args, kwargs):
        self._prev_output_tokens = args[0] if args else kwargs.get("prev_output_tokens")

    def _decoder_hook(self, module, args, output):
        extra = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if isinstance(extra, dict):
            self._decoder_inner_states = extra.get("inner_states")

    def _masks(self) -> Optional[CapturedFeatures]:
        if self._encoder_out is None or self._prev_output_tokens is None:
            return None
        source_masks = self._encoder_out.get("encoder_padding_mask") or []
        padding_idx = getattr(self.model.decoder, "padding_idx", None)
        return CapturedFeatures(source_padding_mask=source_masks[0] if source_masks else None,
                                target_padding_mask=self._prev_output_tokens.eq(padding_idx))

    def _hidden(self, side: str, features: CapturedFeatures) -> Tensor:
        name, states = (("encoder_states", self._encoder_out.get("encoder_states")) if side == "encoder"
                        else ("inner_states", self._decoder_inner_states))
        if not states:
            raise RuntimeError(f"the {side} returned no {name} although they were requested")
        return torch.stack(states, 0).transpose(1, 2)

    def _maps(self, kind: str, indices: Tuple[int, ...], features: CapturedFeatures) -> tuple:
        records = [self._records.get((kind, index)) for index in indices]
        if not all(records):
            raise RuntimeError(f"no {kind} attention call was recorded during the forward pass")
        if not all("probs" in r for r in records):
            raise RuntimeError(f"{kind} attention did not return per-head weights: it did not take "
                               "fairseq's explicit attention path")
        # fairseq: (heads, batch, tgt, src) per layer -> (layers, batch, heads, tgt, src)
        probs = torch.stack([r["probs"] for r in records], 0).transpose(1, 2).float()
        num_layers, bsz, num_heads, tq, tk = probs.shape
        attn_mask, future = records[0]["attn_mask"], None
        if attn_mask is not None:
            future = attn_mask.bool() if attn_mask.dtype == torch.bool else torch.isinf(attn_mask) & (attn_mask < 0)
        scores = values = None
        if self.request.attention_scores:
            if not all("scores" in r for r in records):
                raise RuntimeError(f"{kind} attention did not pass its scores through apply_sparse_mask")
            # (a stacked copy: the modules' tensors stay as fairseq made them)
            scores = torch.stack([r["scores"] for r in records], 0).view(num_layers, bsz, num_heads, tq, tk)
        if self.request.attention_values:
            # (layers, len, batch, C) -> (layers, batch, heads, len, d_head)
            stacked = torch.stack([r["v"] for r in records], 0)
            values = stacked.view(num_layers, stacked.size(1), bsz, num_heads, -1).permute(0, 2, 3, 1, 4)
        return probs, future, scores, values
