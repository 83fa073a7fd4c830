"""Hidden states and per-head attention maps of one forward pass, for teacher and student alike.

:class:`FeatureCapture` works on stock fairseq Transformers through hooks that exist only inside its
``with`` block (a request for nothing installs none): the encoder's ``encoder_states`` and the
decoder's ``inner_states`` (index 0 the embedding output), and, from fairseq's explicit attention
path, the per-head, pre-dropout float32 probabilities, the pre-softmax scores ``q k^T / sqrt(d_head)``
and the values, when asked. A model that satisfies the contract itself (the Hugging Face teacher,
:mod:`.hf_teacher`) defines ``feature_capture(request)``, to which :class:`FeatureCapture` delegates;
both assemble their maps with :func:`attention_maps`. All tensors are batch-first; padding masks are
True at padded positions. Why fairseq's fused path is avoided and how the scores are taken:
``docs/design/teachers.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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

    ``attention_kinds`` names the kinds from ``ATTENTION_KINDS`` whose per-head probability maps
    are wanted; ``attention_scores`` adds the pre-softmax logits (TinyBERT) and
    ``attention_values`` the per-head value vectors (MiniLM) for those kinds.
    ``last_layer_attention_only`` computes the maps of the top layer of each kind only (MiniLM),
    so the returned tensors have a layer axis of size 1. ``attention_layers`` names, per kind, the
    1-based layers whose maps are computed (a mapping such as ``{"encoder_self": (2, 4)}``, e.g. a
    teacher's layers that a layer mapping pairs with the student's, TinyBERT); a kind it does not
    name gets every layer. An attention module outside the selection is not hooked at all, so it
    keeps fairseq's fused path. :attr:`AttentionMaps.layers` says which layers a stack holds.
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
        # A canonical order makes requests comparable and hashable regardless of how they were built.
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
        """0-based indices of the layers of ``kind``, of a model with ``num_layers`` of them,
        whose maps this request computes."""
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
    layers: the 1-based layer number of each entry of the layer axis, ascending (every layer of
            the kind unless the request selected some, see :class:`CaptureRequest`).
    """

    probs: Tensor
    query_padding_mask: Tensor
    key_padding_mask: Tensor
    attendable: Tensor
    scores: Optional[Tensor] = None
    values: Optional[Tensor] = None
    layers: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if self.layers is None:
            self.layers = tuple(range(1, self.probs.size(0) + 1))
        elif len(self.layers) != self.probs.size(0):
            raise ValueError(f"{len(self.layers)} layer numbers for a stack of {self.probs.size(0)} maps")

    def of_layers(self, tensor: Tensor, layers: Sequence[int]) -> Tensor:
        """The entries of ``tensor`` (``probs``, ``scores`` or ``values``) of the 1-based
        ``layers``, in that order; the stack itself, not a copy, when it holds exactly those."""
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


def attention_maps(kind: str, probs: Tensor, features: CapturedFeatures, future: Optional[Tensor] = None,
                   scores: Optional[Tensor] = None, values: Optional[Tensor] = None,
                   layers: Optional[Tuple[int, ...]] = None) -> AttentionMaps:
    """The :class:`AttentionMaps` of one kind from a capture's ``(layers, batch, heads, query, key)``
    ``probs`` (and ``scores``, zeroed here in place outside ``attendable``), in fairseq's positions:
    the masks of the kind's sides from ``features``, and ``future`` (``(query, key)``, True at keys
    a query may not see yet) for decoder self-attention. Every capture assembles its maps here."""
    _, bsz, _, tq, tk = probs.shape
    source_queries, source_keys = kind == ENCODER_SELF, kind in (ENCODER_SELF, DECODER_CROSS)
    key_padding_mask = features.source_padding_mask if source_keys else features.target_padding_mask
    query_padding_mask = features.source_padding_mask if source_queries else features.target_padding_mask
    if key_padding_mask is None:
        key_padding_mask = torch.zeros(bsz, tk, dtype=torch.bool, device=probs.device)
    if query_padding_mask is None:
        query_padding_mask = torch.zeros(bsz, tq, dtype=torch.bool, device=probs.device)
    blocked = key_padding_mask[:, None, None, :]  # (batch or 1, 1, query, key): True where a query may not look
    if future is not None:
        blocked = blocked | future[None, None, :tq, :tk]
    attendable = ~blocked & ~query_padding_mask[:, None, :, None]
    if scores is not None:
        # in place on the capture's own stacked copy (stack's backward does not need it): no -inf is
        # left for a loss to turn into a NaN gradient
        scores.masked_fill_(~attendable.unsqueeze(0), 0.0)
    return AttentionMaps(probs=probs, query_padding_mask=query_padding_mask, key_padding_mask=key_padding_mask,
                         attendable=attendable, scores=scores, values=values, layers=layers)


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
            f"Transformer (encoder.layers[i].self_attn, decoder.layers[i].self_attn/encoder_attn): {err}") from err
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
        self._attention_records: Dict[str, List[dict]] = {}
        self._captured_layers: Dict[str, Tuple[int, ...]] = {}  # kind -> 1-based layers hooked
        self._encoder_out: Optional[dict] = None
        self._decoder_inner_states: Optional[List[Tensor]] = None
        self._source_padding_mask: Optional[Tensor] = None
        self._prev_output_tokens: Optional[Tensor] = None
        self._padding_idx: Optional[int] = None
        # each module's skip_embed_dim_check before the block (docs/design/teachers.md)
        self._skip_embed_dim_check: Dict[nn.Module, bool] = {}
        self._wrapped_score_modules: List[nn.Module] = []
        # the model's own capture, for a model that defines feature_capture (docs/design/teachers.md)
        self._delegate = None

    # ------------------------------------------------------------------ hooks
    def __enter__(self) -> "FeatureCapture":
        try:
            return self._install()
        except BaseException:
            self.__exit__(None, None, None)  # no hook of a refused request stays on the model
            raise

    def _install(self) -> "FeatureCapture":
        if self.request.is_empty:
            return self
        model = self.model
        own_capture = getattr(model, "feature_capture", None)
        if callable(own_capture):
            self._delegate = own_capture(self.request)
            self._delegate.__enter__()
            return self
        for kind in self.request.attention_kinds:
            records: List[dict] = []
            self._attention_records[kind] = records
            modules = attention_modules(model, kind)
            indices = self.request.layer_indices(kind, len(modules))
            self._captured_layers[kind] = tuple(index + 1 for index in indices)
            for module in (modules[index] for index in indices):
                if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
                    raise NotATransformerError(
                        "attention capture does not support add_bias_kv / add_zero_attn attention")
                self._handles.append(
                    module.register_forward_pre_hook(self._make_attention_hook(records), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._make_map_hook(records)))
                if self.request.attention_values:
                    self._handles.append(module.v_proj.register_forward_hook(
                        self._make_value_hook(records, module)))
                if self.request.attention_scores and "apply_sparse_mask" not in vars(module):
                    module.apply_sparse_mask = self._make_score_recorder(records, module)
                    self._wrapped_score_modules.append(module)
                self._skip_embed_dim_check.setdefault(module, module.skip_embed_dim_check)
                module.skip_embed_dim_check = True
        self._handles.append(model.encoder.register_forward_pre_hook(self._encoder_pre_hook, with_kwargs=True))
        self._handles.append(model.encoder.register_forward_hook(self._encoder_hook))
        self._handles.append(model.decoder.register_forward_pre_hook(self._decoder_pre_hook, with_kwargs=True))
        if self.request.decoder_hidden:
            self._handles.append(model.decoder.register_forward_hook(self._decoder_hook))
        self._padding_idx = model.decoder.padding_idx if hasattr(model.decoder, "padding_idx") else None
        return self

    def __exit__(self, *exc) -> None:
        if self._delegate is not None:
            self._delegate.__exit__(*exc)  # its features() stay readable after the block
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, value in self._skip_embed_dim_check.items():
            module.skip_embed_dim_check = value
        self._skip_embed_dim_check.clear()
        for module in self._wrapped_score_modules:
            del module.apply_sparse_mask  # the class's method again
        self._wrapped_score_modules.clear()

    @staticmethod
    def _make_attention_hook(records: List[dict]):
        def hook(module, args, kwargs):
            names = ("query", "key", "value", "key_padding_mask")
            call = dict(zip(names, args))
            call.update(kwargs)
            if call.get("incremental_state") is not None:
                # Incremental decoding (generation) is never distilled; recording it would be wrong.
                return None
            records.append({"module": module, "attn_mask": call.get("attn_mask")})
            return args, dict(kwargs, need_weights=True, need_head_weights=True)

        return hook

    @staticmethod
    def _make_map_hook(records: List[dict]):
        def hook(module, args, output):
            if records and records[-1]["module"] is module and "probs" not in records[-1]:
                weights = output[1] if isinstance(output, tuple) else None
                if weights is not None:
                    records[-1]["probs"] = weights  # (heads, batch, query_len, key_len), float32

        return hook

    @staticmethod
    def _make_value_hook(records: List[dict], attention: nn.Module):
        def hook(projection, args, output):
            if records and records[-1]["module"] is attention and "probs" not in records[-1]:
                records[-1]["v"] = output  # (len, batch, embed_dim); fairseq only reshapes it

        return hook

    @staticmethod
    def _make_score_recorder(records: List[dict], attention: nn.Module):
        apply_sparse_mask = attention.apply_sparse_mask  # the class's (bound) method

        def record(attn_weights, tgt_len: int, src_len: int, bsz: int):
            attn_weights = apply_sparse_mask(attn_weights, tgt_len, src_len, bsz)
            if records and records[-1]["module"] is attention and "probs" not in records[-1]:
                # (batch * heads, tgt, src). fairseq then adds a causal attn_mask in place (-inf at
                # future keys); _attention_maps zeroes every entry outside ``attendable``.
                records[-1]["scores"] = attn_weights
            return attn_weights

        return record

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
        if self._delegate is not None:
            return self._delegate.features()
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
        for kind, records in self._attention_records.items():
            # (only the selected layers' modules are hooked, see CaptureRequest.layer_indices)
            features.attention[kind] = self._attention_maps(kind, records, features)
        return features

    def _attention_maps(self, kind: str, records: List[dict], features: CapturedFeatures) -> AttentionMaps:
        if not records:
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
        return attention_maps(kind, probs, features, future, scores, values, self._captured_layers[kind])
