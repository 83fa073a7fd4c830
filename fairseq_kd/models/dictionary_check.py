"""Whether a teacher uses the data's dictionaries, symbol for symbol: a fairseq checkpoint's
(:func:`check_dictionaries`, which says where it finds them) and a Hugging Face folder's vocabulary
(:func:`check_data_dictionaries`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional, Tuple

from fairseq.data import Dictionary

from ..checkpoints import task_state
from ..errors import FOLDER, FileAccessError, InputError, message_of, path_problem, undecodable_text_message
from ..fingerprint import dictionary_sha256
from .hf_vocabulary import VocabularyMap, first_difference

FLAG = "--teacher-checkpoint"
TEACHER_DATA_FLAG = "--teacher-data"


class TeacherCheckpointError(InputError):
    """The teacher cannot be used with this data or this plugin."""


class TeacherFileError(TeacherCheckpointError, FileAccessError):
    """A file of the teacher cannot be read (the system's reason)."""


class _Unverifiable(Exception):
    """Internal: this source cannot say which dictionaries the teacher used."""


#: what every refusal of a teacher whose dictionaries differ from the data's advises
HOW_TO_FIX = ("The teacher and the student must share dictionaries: binarise the student's data with "
              "the teacher's (fairseq-preprocess --srcdict TEACHER_DATA/dict.SRC.txt --tgtdict "
              "TEACHER_DATA/dict.TGT.txt).")


def check_dictionaries(path: str, state: dict, src_dict: Dictionary, tgt_dict: Dictionary, cfg,
                       teacher_data: Optional[str] = None,
                       data_langs: Tuple[Optional[str], Optional[str]] = (None, None)) -> str:
    """The teacher must use the data's source and target dictionaries, symbol for symbol.

    The embedding sizes are checked, then the symbols compared with the first source that exists:
    ``--teacher-data DIR``; the dictionary hashes a ``translation_kd`` checkpoint records; the
    teacher's own data folder (``cfg.task.data``). With none the teacher is refused. Returns how the
    dictionaries were verified.
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
    raise TeacherCheckpointError(
        f"{FLAG} {path!r}: cannot verify that the teacher uses the data's dictionaries: {reason}, and "
        "the checkpoint carries no dictionaries (equal sizes are not proof: a reordered dictionary has "
        f"the same size). Pass {TEACHER_DATA_FLAG} DIR, the folder holding the teacher's dict.SRC.txt "
        "and dict.TGT.txt (its fairseq-preprocess --destdir; the student's data folder if it was "
        "binarised with them).")


def _check_embedding_sizes(path: str, state: dict, dictionaries: Dict[str, Dictionary]) -> None:
    for side, prefix in (("source", "encoder"), ("target", "decoder")):
        weight = state["model"].get(f"{prefix}.embed_tokens.weight")
        rows = None if weight is None else weight.size(0)
        if rows is not None and rows != len(dictionaries[side]):
            raise TeacherCheckpointError(
                f"{FLAG} {path!r}: the teacher's {side} embedding has {rows} symbols but the data's "
                f"{side} dictionary has {len(dictionaries[side])}. {HOW_TO_FIX}")


def _compare_dictionary_files(path: str, folder: str, origin: str, dictionaries: Dict[str, Dictionary],
                              teacher_langs, data_langs) -> str:
    """Compare the data's dictionaries with ``folder``'s ``dict.LANG.txt``, named by the teacher's
    languages (else the data's, else those of ``folder``'s files)."""
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
            raise TeacherFileError(f"{FLAG} {path!r}: {message_of(err)}") from None
        except Exception as err:  # noqa: BLE001 - fairseq's "Incorrect dictionary format" and "Incorrect encoding"
            cause = err if isinstance(err, UnicodeDecodeError) else err.__context__
            problem = (undecodable_text_message(cause, files[side]) if isinstance(cause, UnicodeDecodeError)
                       else f"{files[side]} is not a fairseq dictionary ({' '.join(str(err).split())})")
            raise TeacherCheckpointError(f"{FLAG} {path!r}: {problem}") from None
        if teacher_dict.symbols != dictionary.symbols:
            raise TeacherCheckpointError(
                f"{FLAG} {path!r}: the teacher's {side} dictionary ({files[side]}, {origin}) differs "
                f"from the data's ({len(teacher_dict)} vs {len(dictionary)} symbols, first difference "
                f"at index {first_difference(teacher_dict.symbols, dictionary.symbols)}). {HOW_TO_FIX}")
    return f"compared symbol for symbol with {origin} {folder}"


def _compare_with_teacher_data(path: str, teacher_data: str, dictionaries: Dict[str, Dictionary],
                               teacher_langs, data_langs) -> str:
    """Source 1: the folder ``--teacher-data`` names, which must hold the teacher's dictionaries."""
    problem = path_problem(teacher_data, FOLDER)
    if problem is not None:
        raise TeacherCheckpointError(f"{TEACHER_DATA_FLAG} {teacher_data!r}: {problem}. Pass the folder holding the "
                                     "teacher's dict.SRC.txt and dict.TGT.txt (its fairseq-preprocess --destdir).")
    try:
        return _compare_dictionary_files(path, teacher_data, TEACHER_DATA_FLAG, dictionaries, teacher_langs,
                                         data_langs)
    except _Unverifiable as err:
        raise TeacherCheckpointError(
            f"{TEACHER_DATA_FLAG}: {err}; pass the folder holding the teacher's dictionaries "
            "(its fairseq-preprocess --destdir).") from None


def _compare_with_recorded_hashes(path: str, binding: dict, dictionaries: Dict[str, Dictionary]) -> str:
    """Source 2: the dictionaries' SHA-256 a ``translation_kd`` checkpoint records."""
    for side, dictionary in dictionaries.items():
        recorded = binding[f"{side}_dictionary_sha256"]
        if recorded != dictionary_sha256(dictionary):
            raise TeacherCheckpointError(
                f"{FLAG} {path!r}: the teacher's {side} dictionary (sha256 {recorded[:12]}, recorded in "
                f"the checkpoint) differs from the data's (sha256 {dictionary_sha256(dictionary)[:12]}). "
                f"{HOW_TO_FIX}")
    return "compared with the dictionary hashes the checkpoint records"


def _compare_with_teacher_data_folder(path: str, task_cfg, dictionaries: Dict[str, Dictionary],
                                      teacher_langs, data_langs) -> str:
    """Source 3: the teacher's own data folder as its checkpoint records it."""
    teacher_data_dir = getattr(task_cfg, "data", None) if task_cfg is not None else None
    if not teacher_data_dir:
        raise _Unverifiable("the checkpoint records no data folder")
    first_dir = str(teacher_data_dir).split(os.pathsep)[0]
    if not os.path.isdir(first_dir):
        raise _Unverifiable(f"its data folder {first_dir!r} (recorded in the checkpoint) is not on this machine "
                            f"(working directory {os.getcwd()!r})")
    return _compare_dictionary_files(path, first_dir, "the teacher's data folder", dictionaries, teacher_langs,
                                     data_langs)


def check_data_dictionaries(path, vocabulary: VocabularyMap, source_dictionary, target_dictionary,
                            source_vocabulary: VocabularyMap) -> None:
    """The data's target dictionary is ``vocabulary`` and its source one ``source_vocabulary``, index for index."""
    separate = source_vocabulary is not vocabulary
    for side, dictionary, side_vocabulary in (("source", source_dictionary, source_vocabulary),
                                              ("target", target_dictionary, vocabulary)):
        problem = side_vocabulary.mismatch(dictionary.symbols)
        if problem is not None:
            raise TeacherCheckpointError(f"{FLAG} {str(path)!r}: the data's {side} dictionary is not the teacher's {f'{side} ' if separate else ''}"
                         f"vocabulary ({problem}); binarise the data with fairseq-kd-hf-data --teacher {path}")
