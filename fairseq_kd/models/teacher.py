"""Loading and running the frozen teacher.

The teacher is a plain fairseq Transformer translation checkpoint (``--arch transformer`` or any
architecture of that model family). It lives on the task, never inside the student or the
criterion, so it is not in the optimizer and not written into student checkpoints; it stays in
eval mode, has ``requires_grad=False`` everywhere, runs under ``torch.no_grad()``, and follows the
student's device and dtype (fp16 and bf16 included) on the first forward pass after a change.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from fairseq.data import Dictionary
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from torch import nn

from ..checkpoints import UnsafeCheckpointError, task_state
from ..errors import FOLDER, FileAccessError, InputError, message_of, path_problem, undecodable_text_message
from ..fingerprint import dictionary_sha256, file_sha256
from .feature_capture import CapturedFeatures, CaptureRequest, FeatureCapture, NotATransformerError
from .from_checkpoint import (
    ModelConfigError,
    NoModelError,
    NotATransformerCheckpointError,
    WeightsMismatchError,
    build_checkpoint_model,
    checkpoint_file_problem,
    read_transformer_checkpoint,
)
from .shape import TransformerShape

FLAG = "--teacher-checkpoint"
TEACHER_DATA_FLAG = "--teacher-data"
logger = logging.getLogger(__name__)


class TeacherCheckpointError(InputError):
    """The teacher checkpoint cannot be used with this data or this plugin."""


#: the file that makes a folder a Hugging Face teacher (``save_pretrained``'s config)
HF_CONFIG_FILE = "config.json"


def is_hugging_face_folder(path) -> bool:
    """Whether ``path`` is a folder with a ``config.json``: a Hugging Face teacher
    (:mod:`.hf_teacher`) rather than a fairseq checkpoint file."""
    return bool(path) and os.path.isdir(path) and os.path.isfile(os.path.join(path, HF_CONFIG_FILE))


def teacher_file_problem(path) -> Optional[str]:
    """Why ``path`` cannot be read as a fairseq teacher checkpoint, in words for a message after the
    flag (``--teacher-checkpoint 'PATH': ...``), None when it can: the one check of training's and
    both teacher passes' --teacher-checkpoint (a Hugging Face folder is read by training and the
    teacher passes, through :mod:`.hf_teacher`, never by this class)."""
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
    """A module's first input made contiguous before the module runs.

    fairseq's models transpose between (batch, time) and (time, batch), so the decoder's output
    projection and each side's first Transformer layer receive non-contiguous inputs. With a
    weight that requires grad, ``torch.matmul`` copies such an input and runs one matrix product;
    with a frozen weight it runs a batched product against the weight expanded over the batch
    instead, about 2.3x slower on CPU for the teacher's output projection (d 512, 8,000 types,
    2,048 tokens: 287 ms against 123 ms). The first layer's q/k/v projections run inside
    ``F.multi_head_attention_forward``, not as modules, so the layer's input is made contiguous
    (once for all three). The copy costs one (tokens, width) tensor.
    """
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def _modules_given_transposed_views(model: nn.Module) -> List[nn.Module]:
    """The modules of a fairseq Transformer that fairseq calls on a transposed view: its encoder
    and decoder layers (the first of each gets the embeddings' (batch, time) -> (time, batch)
    view; the hook is a no-op on the others) and the decoder's output projections (a (time, batch)
    -> (batch, time) view). Only these are hooked: a hook sends every call of its module through
    torch's slower hooked path, which beam search's many small steps would pay for in every
    linear layer."""
    modules = [module for module in model.modules()
               if isinstance(module, (TransformerEncoderLayerBase, TransformerDecoderLayerBase))]
    decoder = getattr(model, "decoder", None)
    for name in ("project_out_dim", "output_projection"):
        projection = getattr(decoder, name, None)
        if isinstance(projection, nn.Linear):
            modules.append(projection)
    return modules


class FrozenTeacher:
    """A frozen fairseq Transformer used as the source of distillation signals."""

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
        self.shape = TransformerShape.from_model(model)

    @classmethod
    def load(cls, path: str, task, teacher_data: Optional[str] = None,
             sha256: Optional[str] = None) -> "FrozenTeacher":
        """Load ``path`` for ``task`` (whose dictionaries the teacher must share), or fail clearly.

        ``teacher_data`` (``--teacher-data``) is read from the task's config when not given; a task
        without that option (stock ``translation``) must be given it by its caller, and a teacher
        whose dictionaries cannot be verified is refused either way. ``sha256``: the checkpoint's
        SHA-256 when the caller has just taken its fingerprint (:mod:`fairseq_kd.fingerprint`),
        so that it is not read twice; hashed here otherwise.
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
            data_langs=(getattr(task_cfg, "source_lang", None), getattr(task_cfg, "target_lang", None)),
        )
        logger.info(f"{FLAG} {path}: dictionaries {verified}")
        try:
            model = build_checkpoint_model(state, task)
        except WeightsMismatchError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: weights do not fit its own config: {err}") from err
        except ModelConfigError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {err}") from err
        try:
            return cls(model, path, sha256 or file_sha256(path))
        except NotATransformerError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {err}") from err

    @property
    def sha256(self) -> Optional[str]:
        """Content hash of the checkpoint file (what binds a student's run to this teacher);
        None for a teacher built in memory without a file."""
        if self._sha256 is None and self.path and os.path.isfile(self.path):
            self._sha256 = readable(file_sha256, self.path)
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


def readable(read, path, *args):
    """``read(path, *args)``, an OSError of the system (a file of the teacher that cannot be read)
    said in one line naming the flag and the file."""
    try:
        return read(path, *args)
    except OSError as err:
        raise FileAccessError(f"{FLAG} {str(path)!r}: {message_of(err)}") from None


def _read_teacher_checkpoint(path: str) -> dict:
    """The teacher's checkpoint state (:func:`.from_checkpoint.read_transformer_checkpoint`), its
    errors worded for ``--teacher-checkpoint``."""
    try:
        return read_transformer_checkpoint(path)
    except UnsafeCheckpointError as err:
        raise TeacherCheckpointError(f"{FLAG} {path!r}: {err}") from None
    except NoModelError as err:
        raise TeacherCheckpointError(
            f"{FLAG} {path!r} has no fairseq model configuration/weights (keys: {err.keys})"
        ) from None
    except NotATransformerCheckpointError as err:
        raise TeacherCheckpointError(
            f"{FLAG} {path!r} holds a {err.model_type!r} model, not an encoder-decoder Transformer "
            "(fairseq's transformer family); distillation needs a Transformer teacher."
        ) from None
    except Exception as err:  # noqa: BLE001 - every failure here means "not a usable checkpoint"
        kind = FileAccessError if isinstance(err, OSError) else TeacherCheckpointError
        raise kind(
            f"{FLAG} {path!r} is not a readable fairseq checkpoint: {type(err).__name__}: {err}"
        ) from err


def _embedding_rows(state_dict: dict, prefix: str) -> Optional[int]:
    weight = state_dict.get(f"{prefix}.embed_tokens.weight")
    return None if weight is None else weight.size(0)


class _Unverifiable(Exception):
    """Internal: this source cannot say which dictionaries the teacher used."""


#: what every refusal of a teacher whose dictionaries differ from the data's advises
HOW_TO_FIX = (
    "The teacher and the student must share dictionaries: binarise the student's data with "
    "the teacher's (fairseq-preprocess --srcdict TEACHER_DATA/dict.SRC.txt --tgtdict "
    "TEACHER_DATA/dict.TGT.txt)."
)


def check_dictionaries(path: str, state: dict, src_dict: Dictionary, tgt_dict: Dictionary, cfg,
                       teacher_data: Optional[str] = None, data_langs: Tuple[Optional[str], Optional[str]] = (None, None),
                       refuse_unverifiable: bool = True) -> str:
    """The teacher must use the data's source and target dictionaries, symbol for symbol.

    A fairseq checkpoint stores no dictionary, and equal sizes are no proof (a reordered
    dictionary has the same size), so the embedding tables are checked against the data's sizes
    (always) and then the symbols are compared with the first of these that exists:

    1. ``--teacher-data DIR`` (``teacher_data``): the teacher's ``dict.SRC.txt`` / ``dict.TGT.txt``
       in ``DIR``, named by the teacher's languages (or the data's when it recorded none);
    2. what the checkpoint carries: a checkpoint written by a ``translation_kd`` run records its
       dictionaries' SHA-256 (``extra_state["TranslationKDTask"]["binding"]``);
    3. the teacher's own data folder as recorded in it (``cfg.task.data``), when it is on disk.

    With none of them the teacher is refused (``refuse_unverifiable``; otherwise a warning is
    logged), naming ``--teacher-data``. Returns how the dictionaries were verified.
    """
    dictionaries = {"source": src_dict, "target": tgt_dict}
    _check_embedding_sizes(path, state, dictionaries)
    task_cfg = cfg.get("task") if hasattr(cfg, "get") else getattr(cfg, "task", None)
    teacher_langs = (getattr(task_cfg, "source_lang", None), getattr(task_cfg, "target_lang", None))
    if teacher_data:
        return _compare_with_teacher_data(path, teacher_data, dictionaries, teacher_langs, data_langs)
    binding = task_state(state).get("binding") or {}
    if binding.get("source_dictionary_sha256") and binding.get("target_dictionary_sha256"):
        return _compare_with_recorded_hashes(path, binding, dictionaries)
    try:
        return _compare_with_teacher_data_folder(path, task_cfg, dictionaries, teacher_langs, data_langs)
    except _Unverifiable as err:
        reason = str(err)
    message = (
        f"{FLAG} {path!r}: cannot verify that the teacher uses the data's dictionaries: {reason}, and "
        "the checkpoint carries no dictionaries (equal sizes are not proof: a reordered dictionary has "
        f"the same size). Pass {TEACHER_DATA_FLAG} DIR, the folder holding the teacher's dict.SRC.txt "
        "and dict.TGT.txt (its fairseq-preprocess --destdir; the student's data folder if it was "
        "binarised with them)."
    )
    if refuse_unverifiable:
        raise TeacherCheckpointError(message)
    logger.warning(message)
    return "not verified"


def _check_embedding_sizes(path: str, state: dict, dictionaries: Dict[str, Dictionary]) -> None:
    """The teacher's embedding tables have as many rows as the data's dictionaries have symbols."""
    for side, prefix in (("source", "encoder"), ("target", "decoder")):
        rows = _embedding_rows(state["model"], prefix)
        if rows is not None and rows != len(dictionaries[side]):
            raise TeacherCheckpointError(
                f"{FLAG} {path!r}: the teacher's {side} embedding has {rows} symbols but the data's "
                f"{side} dictionary has {len(dictionaries[side])}. {HOW_TO_FIX}"
            )


def _compare_dictionary_files(path: str, folder: str, origin: str, dictionaries: Dict[str, Dictionary],
                              teacher_langs, data_langs) -> str:
    """Compare the data's dictionaries symbol for symbol with ``folder``'s ``dict.LANG.txt``,
    named by the teacher's languages (else the data's, else those of ``folder``'s files)."""
    src_lang, tgt_lang = teacher_langs
    if not src_lang or not tgt_lang:
        src_lang, tgt_lang = data_langs
    if (not src_lang or not tgt_lang) and os.path.isdir(folder):
        # trained without --source-lang/--target-lang: fairseq inferred them from the file names
        from fairseq.data.data_utils import infer_language_pair

        src_lang, tgt_lang = infer_language_pair(folder)
    if not src_lang or not tgt_lang:
        raise _Unverifiable(f"the languages of {origin} {folder!r} are unknown")
    files = {side: Path(folder) / f"dict.{lang}.txt" for side, lang in (("source", src_lang), ("target", tgt_lang))}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise _Unverifiable(f"{origin} {folder!r} has no {' and no '.join(missing)}")
    for side, dictionary in dictionaries.items():
        try:
            teacher_dict = Dictionary.load(str(files[side]))
        except OSError as err:
            raise FileAccessError(f"{FLAG} {path!r}: {message_of(err)}") from None
        except UnicodeDecodeError as err:
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {undecodable_text_message(err, files[side])}") from None
        except ValueError as err:  # fairseq's "Incorrect dictionary format" and the like
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {files[side]} is not a fairseq dictionary ({err})") from None
        if teacher_dict.symbols != dictionary.symbols:
            raise TeacherCheckpointError(
                f"{FLAG} {path!r}: the teacher's {side} dictionary ({files[side]}, {origin}) differs "
                f"from the data's ({len(teacher_dict)} vs {len(dictionary)} symbols, first difference "
                f"at index {_first_difference(teacher_dict.symbols, dictionary.symbols)}). {HOW_TO_FIX}"
            )
    return f"compared symbol for symbol with {origin} {folder}"


def _compare_with_teacher_data(path: str, teacher_data: str, dictionaries: Dict[str, Dictionary],
                               teacher_langs, data_langs) -> str:
    """Source 1: the folder ``--teacher-data`` names, which must hold the teacher's dictionaries."""
    problem = path_problem(teacher_data, FOLDER)
    if problem is not None:
        raise TeacherCheckpointError(
            f"{TEACHER_DATA_FLAG} {teacher_data!r}: {problem}. Pass the folder holding the "
            "teacher's dict.SRC.txt and dict.TGT.txt (its fairseq-preprocess --destdir)."
        )
    try:
        return _compare_dictionary_files(path, teacher_data, TEACHER_DATA_FLAG, dictionaries, teacher_langs,
                                         data_langs)
    except _Unverifiable as err:
        raise TeacherCheckpointError(
            f"{TEACHER_DATA_FLAG}: {err}; pass the folder holding the teacher's dictionaries "
            "(its fairseq-preprocess --destdir)."
        ) from None


def _compare_with_recorded_hashes(path: str, binding: dict, dictionaries: Dict[str, Dictionary]) -> str:
    """Source 2: the dictionaries' SHA-256 a ``translation_kd`` checkpoint records."""
    for side, dictionary in dictionaries.items():
        recorded = binding[f"{side}_dictionary_sha256"]
        if recorded != dictionary_sha256(dictionary):
            raise TeacherCheckpointError(
                f"{FLAG} {path!r}: the teacher's {side} dictionary (sha256 {recorded[:12]}, recorded in "
                f"the checkpoint) differs from the data's (sha256 {dictionary_sha256(dictionary)[:12]}). "
                f"{HOW_TO_FIX}"
            )
    return "compared with the dictionary hashes the checkpoint records"


def _compare_with_teacher_data_folder(path: str, task_cfg, dictionaries: Dict[str, Dictionary],
                                      teacher_langs, data_langs) -> str:
    """Source 3: the teacher's own data folder as its checkpoint records it; raises
    :class:`_Unverifiable` saying why when it cannot be used."""
    teacher_data_dir = getattr(task_cfg, "data", None) if task_cfg is not None else None
    if not teacher_data_dir:
        raise _Unverifiable("the checkpoint records no data folder")
    first_dir = str(teacher_data_dir).split(os.pathsep)[0]
    if not os.path.isdir(first_dir):
        raise _Unverifiable(f"its data folder {first_dir!r} (recorded in the checkpoint) is not on this machine "
                            f"(working directory {os.getcwd()!r})")
    return _compare_dictionary_files(path, first_dir, "the teacher's data folder", dictionaries, teacher_langs,
                                     data_langs)


def _first_difference(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
