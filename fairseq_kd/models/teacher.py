"""Loading and running the frozen teacher.

The teacher is a plain fairseq Transformer translation checkpoint (``--arch transformer`` or any
architecture of that model family). It lives on the task, never inside the student or the
criterion, so it is not in the optimizer and not written into student checkpoints; it stays in
eval mode, has ``requires_grad=False`` everywhere, runs under ``torch.no_grad()``, and follows the
student's device and dtype (fp16 and bf16 included) on the first forward pass after a change.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional, Tuple

import torch
from fairseq.data import Dictionary
from torch import nn

from .feature_capture import CapturedFeatures, CaptureRequest, FeatureCapture, NotATransformerError
from .shape import TransformerShape

FLAG = "--teacher-checkpoint"


class TeacherCheckpointError(ValueError):
    """The teacher checkpoint cannot be used with this data or this plugin."""


class FrozenTeacher:
    """A frozen fairseq Transformer used as the source of distillation signals."""

    def __init__(self, model: nn.Module, path: str, sha256: Optional[str] = None):
        self.path = path
        self._sha256 = sha256
        self.model = model
        self.model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.shape = TransformerShape.from_model(model)

    @classmethod
    def load(cls, path: str, task) -> "FrozenTeacher":
        """Load ``path`` for ``task`` (whose dictionaries the teacher must share), or fail clearly."""
        from fairseq import models
        from fairseq.models.transformer import TransformerModelBase

        from ..checkpoint_safety import UnsafeCheckpointError, load_fairseq_checkpoint

        if not path or not os.path.isfile(path):
            raise TeacherCheckpointError(
                f"{FLAG} {path!r}: no such file. Pass the path of a trained fairseq translation "
                "checkpoint (e.g. checkpoints/teacher/checkpoint_best.pt)."
            )
        if not os.access(path, os.R_OK):
            raise TeacherCheckpointError(f"{FLAG} {path!r}: the file is not readable (permissions).")
        try:
            state = load_fairseq_checkpoint(path)  # weights_only=True, explicitly
        except UnsafeCheckpointError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {err}") from None
        except Exception as err:  # noqa: BLE001 - every failure here means "not a usable checkpoint"
            raise TeacherCheckpointError(
                f"{FLAG} {path!r} is not a readable fairseq checkpoint: {type(err).__name__}: {err}"
            ) from err
        cfg = state.get("cfg")
        if cfg is None or "model" not in state:
            raise TeacherCheckpointError(
                f"{FLAG} {path!r} has no fairseq model configuration/weights (keys: {sorted(state)})"
            )
        model_type = getattr(cfg.model, "_name", None) or getattr(cfg.model, "arch", None)
        model_class = models.ARCH_MODEL_REGISTRY.get(model_type) or models.MODEL_REGISTRY.get(model_type)
        if model_class is None or not issubclass(model_class, TransformerModelBase):
            raise TeacherCheckpointError(
                f"{FLAG} {path!r} holds a {model_type!r} model, not an encoder-decoder Transformer "
                "(fairseq's transformer family); distillation needs a Transformer teacher."
            )
        check_dictionaries(path, state, task.source_dictionary, task.target_dictionary, cfg)
        model = models.build_model(cfg.model, task, from_checkpoint=True)
        try:
            model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
        except RuntimeError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: weights do not fit its own config: {err}") from err
        try:
            return cls(model, path, file_sha256(path))
        except NotATransformerError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {err}") from err

    @property
    def sha256(self) -> Optional[str]:
        """Content hash of the checkpoint file (what binds a student's run to this teacher);
        None for a teacher built in memory without a file."""
        if self._sha256 is None and self.path and os.path.isfile(self.path):
            self._sha256 = file_sha256(self.path)
        return self._sha256

    def follow(self, reference: torch.Tensor) -> None:
        """Move the teacher to ``reference``'s device and floating dtype if it is elsewhere."""
        param = next(self.model.parameters())
        if param.device != reference.device or param.dtype != reference.dtype:
            self.model.to(device=reference.device, dtype=reference.dtype)
        # The trainer never touches the teacher, but a user's code might; eval mode is invariant.
        if self.model.training:
            self.model.eval()

    def forward(self, net_input: dict, request: CaptureRequest) -> Tuple[tuple, CapturedFeatures]:
        """Teacher net output and the requested features, computed without autograd."""
        with torch.no_grad():
            with FeatureCapture(self.model, request) as capture:
                net_output = self.model(**net_input)
            return net_output, capture.features()


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _embedding_rows(state_dict: dict, prefix: str) -> Optional[int]:
    weight = state_dict.get(f"{prefix}.embed_tokens.weight")
    return None if weight is None else weight.size(0)


def check_dictionaries(path: str, state: dict, src_dict: Dictionary, tgt_dict: Dictionary, cfg) -> None:
    """The teacher must use the data's source and target dictionaries, symbol for symbol.

    The checkpoint stores no dictionary, so two checks are made: the embedding tables must have
    one row per symbol of the data's dictionaries (always), and where the teacher's own data folder
    is still on disk, its dictionary files must equal the data's exactly.
    """
    how_to_fix = (
        "The teacher and the student must share dictionaries: binarise the student's data with "
        "the teacher's (fairseq-preprocess --srcdict TEACHER_DATA/dict.SRC.txt --tgtdict "
        "TEACHER_DATA/dict.TGT.txt)."
    )
    for side, prefix, dictionary in (("source", "encoder", src_dict), ("target", "decoder", tgt_dict)):
        rows = _embedding_rows(state["model"], prefix)
        if rows is not None and rows != len(dictionary):
            raise TeacherCheckpointError(
                f"{FLAG} {path!r}: the teacher's {side} embedding has {rows} symbols but the data's "
                f"{side} dictionary has {len(dictionary)}. {how_to_fix}"
            )
    teacher_data = getattr(cfg.task, "data", None) if cfg.get("task") is not None else None
    if not teacher_data:
        return
    first_dir = str(teacher_data).split(os.pathsep)[0]
    src_lang = getattr(cfg.task, "source_lang", None)
    tgt_lang = getattr(cfg.task, "target_lang", None)
    if (not src_lang or not tgt_lang) and os.path.isdir(first_dir):
        # trained without --source-lang/--target-lang: fairseq inferred them from the file names
        from fairseq.data.data_utils import infer_language_pair

        src_lang, tgt_lang = infer_language_pair(first_dir)
    if not src_lang or not tgt_lang:
        return
    for side, lang, dictionary in (("source", src_lang, src_dict), ("target", tgt_lang, tgt_dict)):
        dict_file = Path(first_dir) / f"dict.{lang}.txt"
        if not dict_file.is_file():
            continue
        teacher_dict = Dictionary.load(str(dict_file))
        if teacher_dict.symbols != dictionary.symbols:
            raise TeacherCheckpointError(
                f"{FLAG} {path!r}: the teacher's {side} dictionary ({dict_file}) differs from the "
                f"data's ({len(teacher_dict)} vs {len(dictionary)} symbols, first difference at "
                f"index {_first_difference(teacher_dict.symbols, dictionary.symbols)}). {how_to_fix}"
            )


def _first_difference(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
