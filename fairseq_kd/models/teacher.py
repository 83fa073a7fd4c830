"""Loading and running the frozen teacher: a fairseq Transformer translation checkpoint.

It lives on the task (not in the optimizer, not in student checkpoints), stays in eval mode without
gradients, and follows the student's device and dtype on the first forward pass after a change.
"""
from __future__ import annotations

import logging
import os
from typing import List, Optional, Tuple

import torch
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from torch import nn

from ..checkpoints import UnsafeCheckpointError
from ..errors import message_of
from ..fingerprint import file_sha256
from .dictionary_check import FLAG, TeacherCheckpointError, TeacherFileError, check_dictionaries
from .feature_capture import CapturedFeatures, CaptureRequest, FeatureCapture, NotATransformerError
from .from_checkpoint import (ModelConfigError, NoModelError, NotATransformerCheckpointError,
                              UnreadableCheckpointError, WeightsMismatchError, build_checkpoint_model,
                              checkpoint_file_problem, read_transformer_checkpoint)
from .shape import TransformerShape

logger = logging.getLogger(__name__)

#: the file that makes a folder a Hugging Face teacher (``save_pretrained``'s config)
HF_CONFIG_FILE = "config.json"


def is_hugging_face_folder(path) -> bool:
    """Whether ``path`` is a folder with a ``config.json`` (a Hugging Face teacher)."""
    return bool(path) and os.path.isdir(path) and os.path.isfile(os.path.join(path, HF_CONFIG_FILE))


def teacher_file_problem(path) -> Optional[str]:
    """Why ``path`` cannot be read as a fairseq teacher checkpoint, in words for a message after the
    flag (``--teacher-checkpoint 'PATH': ...``), None when it can."""
    if is_hugging_face_folder(path):
        return ("is a Hugging Face model folder, which is read as a teacher by fairseq-train --task translation_kd, "
                "fairseq-kd-teacher-cache, fairseq-kd-seqkd and fairseq-kd-translate, not here. Pass a fairseq "
                "checkpoint file here.")
    problem = checkpoint_file_problem(path)
    if problem is None:
        return None
    if os.path.isdir(path or ""):
        return f"{problem} (or a Hugging Face save_pretrained folder, which holds {HF_CONFIG_FILE})"
    if os.path.exists(path or ""):
        return problem
    return (f"{problem}. Pass the path of a trained fairseq translation checkpoint (e.g. "
            "checkpoints/teacher/checkpoint_best.pt) or of a Hugging Face save_pretrained folder.")


def _contiguous_input(module: nn.Module, args: tuple) -> Optional[tuple]:
    """The module's first input made contiguous (a frozen weight on a transposed view runs a slower
    product: ``docs/design/teachers.md``)."""
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def _modules_given_transposed_views(model: nn.Module) -> List[nn.Module]:
    """The modules fairseq calls on a transposed view: the encoder and decoder layers (the first of
    each) and the decoder's output projections."""
    modules = [module for module in model.modules()
               if isinstance(module, (TransformerEncoderLayerBase, TransformerDecoderLayerBase))]
    decoder = getattr(model, "decoder", None)
    for name in ("project_out_dim", "output_projection"):
        projection = getattr(decoder, name, None)
        if isinstance(projection, nn.Linear):
            modules.append(projection)
    return modules


class FrozenTeacher:
    """A frozen teacher: a fairseq Transformer here, a Hugging Face model in
    :class:`.hf_teacher.HuggingFaceTeacher`. ``shape`` sizes the feature methods' modules (None, with
    ``feature_problem`` saying why, when the features cannot be read)."""

    feature_problem: Optional[str] = None

    def __init__(self, model: nn.Module, path: str, sha256: Optional[str] = None):
        self.path = path
        self._sha256 = sha256
        self.model = model
        self.model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        for module in _modules_given_transposed_views(self.model):
            # (a copy of a teacher, deepcopy included, already has the hook)
            if _contiguous_input not in module._forward_pre_hooks.values():
                module.register_forward_pre_hook(_contiguous_input)
        self.shape: Optional[TransformerShape] = self.read_shape()

    def read_shape(self) -> Optional[TransformerShape]:
        return TransformerShape.from_model(self.model)

    @classmethod
    def load(cls, path: str, task, teacher_data: Optional[str] = None,
             sha256: Optional[str] = None) -> "FrozenTeacher":
        """Load ``path`` for ``task`` (whose dictionaries the teacher must share), or fail clearly.

        ``teacher_data``: ``--teacher-data``, the task's when not given; ``sha256``: the checkpoint's
        SHA-256 when the caller has just taken it, hashed here otherwise.
        """
        problem = teacher_file_problem(path)
        if problem is not None:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {problem}")
        state = _read_teacher_checkpoint(path)
        cfg = state["cfg"]
        task_cfg = getattr(task, "cfg", None)
        verified = check_dictionaries(
            path, state, task.source_dictionary, task.target_dictionary, cfg,
            teacher_data=teacher_data if teacher_data is not None else getattr(task_cfg, "teacher_data", None),
            data_langs=(getattr(task_cfg, "source_lang", None), getattr(task_cfg, "target_lang", None)))
        logger.info(f"{FLAG} {path}: dictionaries {verified}")
        try:
            model = build_checkpoint_model(state, task)
        except WeightsMismatchError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: weights do not fit its own config: {err}") from err
        except ModelConfigError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {err}") from err
        try:
            return cls(model, path, sha256 or readable(file_sha256, path))
        except NotATransformerError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {err}") from err

    @property
    def sha256(self) -> Optional[str]:
        """SHA-256 of the checkpoint file (what binds a student's run to this teacher), None without one."""
        if self._sha256 is None and self.path and os.path.isfile(self.path):
            self._sha256 = readable(file_sha256, self.path)
        return self._sha256

    def follow(self, reference: torch.Tensor) -> None:
        """Move the teacher to ``reference``'s device and floating dtype, and back to eval mode."""
        param = next(self.model.parameters())
        if param.device != reference.device or param.dtype != reference.dtype:
            self.model.to(device=reference.device, dtype=reference.dtype)
        if self.model.training:
            self.model.eval()

    def forward(self, net_input: dict, request: CaptureRequest) -> Tuple[tuple, CapturedFeatures]:
        """Teacher net output and the requested features, computed without autograd."""
        with torch.no_grad():
            with FeatureCapture(self.model, request) as capture:
                net_output = self.model(**net_input)
            return net_output, capture.features()


def readable(read, path, *args):
    """``read(path, *args)``, an OSError said in one line naming the flag and the file."""
    try:
        return read(path, *args)
    except OSError as err:
        raise TeacherFileError(f"{FLAG} {str(path)!r}: {message_of(err)}") from None


def _read_teacher_checkpoint(path: str) -> dict:
    """:func:`.from_checkpoint.read_transformer_checkpoint`, its errors worded for ``--teacher-checkpoint``."""
    try:
        return read_transformer_checkpoint(path)
    except UnsafeCheckpointError as err:
        raise TeacherCheckpointError(f"{FLAG} {path!r}: {err}") from None
    except NoModelError as err:
        raise TeacherCheckpointError(f"{FLAG} {path!r} has no fairseq model configuration/weights (keys: {err.keys})"
        ) from None
    except NotATransformerCheckpointError as err:
        raise TeacherCheckpointError(
            f"{FLAG} {path!r} holds a {err.model_type!r} model, not an encoder-decoder Transformer "
            "(fairseq's transformer family); distillation needs a Transformer teacher.") from None
    except UnreadableCheckpointError as err:
        raise TeacherCheckpointError(f"{FLAG} {path!r} is not a readable fairseq checkpoint: {err.reason}") from err
    except OSError as err:  # the system's, reading a file that passed teacher_file_problem
        raise TeacherFileError(f"{FLAG} {path!r} is not a readable fairseq checkpoint: {type(err).__name__}: {err}") from err
