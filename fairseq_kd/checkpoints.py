"""Everything the plugin does to fairseq's checkpoint loading and saving, installed by one call:
:func:`install` (made by :func:`fairseq_kd.register`, so by ``--user-dir fairseq_kd`` and every
plugin command). Four parts:

1. **Safe loading.** PyTorch 2.6 made ``torch.load`` default to ``weights_only=True``: only
   tensors, containers and primitive types are unpickled, plus classes explicitly allow-listed.
   fairseq stores its legacy configuration as an ``argparse.Namespace`` inside ``cfg``/``args``,
   so stock fairseq cannot read its own checkpoints any more. The classes fairseq checkpoints
   contain are allow-listed (``ALLOWED_CHECKPOINT_GLOBALS``), and the refusal of any other class
   becomes an error that names the file and the class instead of advising to switch the
   protection off. Nothing is ever loaded with ``weights_only=False``. ``weights_only=True`` is
   always passed *explicitly*: many fairseq users set ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` to
   read old checkpoints, and torch then unpickles anything (running whatever code a crafted
   checkpoint carries) in every ``torch.load`` call that leaves the argument out, as fairseq's own
   loader does. An explicit value wins over that variable, so the ``torch`` that
   ``fairseq.checkpoint_utils`` calls is replaced by :class:`_WeightsOnlyTorch`, whose ``load``
   always passes ``weights_only=True``. That covers ``fairseq-train --restore-file`` / resume,
   ``fairseq-generate --path`` and every plugin command, whichever name they reach the loader by.
2. **The teacher binding.** Every checkpoint of a ``translation_kd`` run records what the student
   was distilled from (:func:`run_binding`: the teacher file's SHA-256 and the dictionaries'
   hashes). On resume the recorded binding must match this run's (:func:`check_resumed_binding`):
   another teacher is refused (a run would otherwise mix two teachers) unless
   ``--allow-teacher-change``; other dictionaries are always refused (the student's embeddings
   index the old symbols).
3. **Best-checkpoint selection.** The metric that selects ``checkpoint_best.pt`` is recorded; a
   resumed run that selects by another metric does not overwrite a best checkpoint chosen on it,
   nor compares the best-so-far of another metric.
4. **Criterion-state checks on resume.** A checkpoint whose criterion parameters do not fit this
   run's criterion is refused naming the options that differ.

Parts 3 and 4 wrap fairseq's ``checkpoint_utils.load_checkpoint`` for the tasks that ask for it
(``checkpoint_guard = True``: ``translation_kd``); other tasks load as fairseq does.
"""
from __future__ import annotations

import argparse
import functools
import io
import logging
import os
import pickle
import re
import types
import warnings
from typing import Optional

import numpy as np
import torch

from .fingerprint import dictionary_sha256

try:  # the name numpy pickles arrays with (numpy >= 2; numpy.core before)
    from numpy._core.multiarray import _reconstruct as np_reconstruct
except ImportError:  # pragma: no cover - numpy < 2
    from numpy.core.multiarray import _reconstruct as np_reconstruct

# Every class found in checkpoints written by fairseq-train (translation task, legacy and
# dataclass architectures, fp16, resume state): the legacy argument namespace; and, with
# --eval-bleu, numpy arrays: fairseq keeps the BLEU n-gram counts of its validation metrics as
# numpy arrays in the checkpoint. An array is rebuilt from its dtype and raw bytes; an array of
# Python objects would need its elements' classes, which stay refused.
NUMERIC_DTYPE_CLASSES = tuple(dict.fromkeys(type(np.dtype(code)) for code in "?bhilqBHILQefd"))
ALLOWED_CHECKPOINT_GLOBALS = (argparse.Namespace, np.ndarray, np.dtype, np_reconstruct, *NUMERIC_DTYPE_CLASSES)


logger = logging.getLogger(__name__)

#: the key of ``extra_state`` under which fairseq keeps a ``translation_kd`` task's checkpoint
#: dict (the task's class name)
TASK_STATE_KEY = "TranslationKDTask"
BINDING_FORMAT = "fairseq-kd-binding/1"


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint needs a class outside the allow-list; it was not loaded."""


class ResumeMismatchError(ValueError):
    """A checkpoint is resumed with another teacher, other dictionaries, another best-checkpoint
    metric or another criterion than it was trained with."""


def install() -> None:
    """The single install point of this module: safe loading and the load-checkpoint guard.
    Idempotent; made by :func:`fairseq_kd.register` (so ``--user-dir fairseq_kd`` enables it for
    fairseq-train, fairseq-generate and every other fairseq command)."""
    install_checkpoint_allow_list()
    _install_load_checkpoint_guard()


_installed = False


def install_checkpoint_allow_list() -> None:
    """Register the allow-list with torch and wrap fairseq's loader for clear refusals (part 1 of
    :func:`install`). Idempotent."""
    global _installed
    if _installed:
        return
    torch.serialization.add_safe_globals(list(ALLOWED_CHECKPOINT_GLOBALS))
    from fairseq import checkpoint_utils

    # fairseq calls ``torch.load(f, map_location=...)`` without weights_only; route it through a
    # loader that always passes weights_only=True (so TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD cannot
    # switch the protection off).
    checkpoint_utils.torch = _WeightsOnlyTorch()
    original = checkpoint_utils.load_checkpoint_to_cpu

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return original(path, *args, **kwargs)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(refusal_message(path, err)) from None

    # fairseq looks the function up as a module attribute at call time (trainer, generate,
    # load_model_ensemble), so replacing the attribute covers every fairseq entry point.
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    _installed = True


FORCE_NO_WEIGHTS_ONLY_VARIABLE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def weights_only_load(f, *args, **kwargs):
    """``torch.load`` with ``weights_only=True`` passed explicitly, whatever the caller asked for
    and whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says; refusals name the file."""
    kwargs.pop("weights_only", None)
    kwargs.pop("pickle_module", None)  # torch refuses a custom unpickler with weights_only=True
    # Registered again at every load: torch's ``safe_globals`` context manager (in a user's code or
    # a test) restores torch's list when it exits, dropping what was added before it.
    torch.serialization.add_safe_globals(list(ALLOWED_CHECKPOINT_GLOBALS))
    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol other than its own precedes a refusal
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(f, *args, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        path = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", f)  # a Path has .name too
        raise UnsafeCheckpointError(refusal_message(path, err)) from None


class _WeightsOnlyTorch(types.ModuleType):
    """The ``torch`` module as ``fairseq.checkpoint_utils`` sees it: everything is torch's own,
    except ``load``, which is :func:`weights_only_load`."""

    def __init__(self):
        super().__init__("torch", "torch, with load() always weights_only=True (fairseq-kd)")

    def __getattr__(self, name):
        return getattr(torch, name)

    load = staticmethod(weights_only_load)


def fairseq_loader_is_safe() -> bool:
    """Whether fairseq's checkpoint loader currently goes through :func:`weights_only_load`."""
    from fairseq import checkpoint_utils

    return isinstance(getattr(checkpoint_utils, "torch", None), _WeightsOnlyTorch)


def load_fairseq_checkpoint(path, arg_overrides=None):
    """fairseq's ``load_checkpoint_to_cpu`` (config upgrade included) with ``weights_only=True``
    explicit; every checkpoint-reading path of the plugin uses this or :func:`safe_load`."""
    install()
    from fairseq import checkpoint_utils

    if not fairseq_loader_is_safe():  # someone replaced it after us: put the safe one back
        checkpoint_utils.torch = _WeightsOnlyTorch()
    return checkpoint_utils.load_checkpoint_to_cpu(str(path), arg_overrides)


# Opcodes that push a string a following STACK_GLOBAL may take as module or name.
_STRING_OPCODES = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING",
                             "BINSTRING", "SHORT_BINSTRING"})
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _globals_of_pickle(opcodes) -> list:
    """``module.name`` of every GLOBAL / STACK_GLOBAL of one pickle program (``pickletools.genops``
    output), following the two strings STACK_GLOBAL takes from the stack, memoised ones included."""
    found, strings, memo, memoised = [], [], {}, 0
    top = None  # the string the last opcode pushed, if it pushed one
    for opcode, argument, _ in opcodes:
        name, pushed = opcode.name, None
        if name in ("GLOBAL", "INST"):
            found.append(str(argument).replace(" ", "."))
        elif name == "STACK_GLOBAL" and len(strings) >= 2:
            found.append(f"{strings[-2]}.{strings[-1]}")
        elif name in _STRING_OPCODES:
            pushed = str(argument)
        elif name == "MEMOIZE":
            memo[memoised], memoised = top, memoised + 1
            pushed = top
        elif name in _MEMO_PUTS:
            memo[argument] = top
            pushed = top
        elif name in _MEMO_GETS:
            pushed = memo.get(argument)
        if pushed is not None and name not in ("MEMOIZE", *_MEMO_PUTS):
            strings.append(pushed)
        top = pushed
    return found


def pickled_globals(path) -> list:
    """The classes and functions a checkpoint file references (``module.name``, in order, each
    once), read from its pickle opcodes with :mod:`pickletools` without unpickling anything: the
    ``*.pkl`` members of a zip checkpoint (torch's format), else the pickles one after another from
    the start of the file (torch's legacy format, or a raw pickle). Empty when it cannot be read."""
    import pickletools
    import zipfile

    programs = []
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                programs = [archive.read(name) for name in archive.namelist() if name.endswith(".pkl")]
        else:
            with open(path, "rb") as handle:
                data = handle.read(64 << 20)  # the pickles come first; tensors' bytes follow them
            programs = [data]
    except (OSError, zipfile.BadZipFile, RuntimeError):
        return []
    found = []
    for program in programs:
        stream = io.BytesIO(program)
        for _ in range(8):  # the legacy format: magic number, protocol, system info, the object, keys
            opcodes = []
            try:
                for item in pickletools.genops(stream):
                    opcodes.append(item)
            except Exception:  # noqa: BLE001 - raw tensor bytes, or a damaged file: stop reading
                found += _globals_of_pickle(opcodes)
                break
            found += _globals_of_pickle(opcodes)
            if stream.tell() >= len(program):
                break
    return list(dict.fromkeys(found))


def _allowed_global_names() -> set:
    """``module.name`` of what ``weights_only=True`` unpickles: this module's allow-list, torch's
    own (tensors, storages, OrderedDict...) and whatever a caller added with
    ``add_safe_globals``."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in ALLOWED_CHECKPOINT_GLOBALS}
    names.add("numpy.core.multiarray._reconstruct")  # how numpy < 2 pickled the same function
    for entry in torch.serialization.get_safe_globals():
        item = entry[0] if isinstance(entry, tuple) else entry
        names.add(f"{getattr(item, '__module__', '')}.{getattr(item, '__qualname__', item)}")
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        names.update(_get_allowed_globals())
    except (ImportError, AttributeError):  # pragma: no cover - another torch: its own list unknown
        names.add("collections.OrderedDict")
        names.add("torch.*")
    return names


def refused_globals(path) -> list:
    """What a checkpoint references outside what safe loading unpickles (see :func:`pickled_globals`)."""
    allowed = _allowed_global_names()
    return [name for name in pickled_globals(path)
            if name not in allowed and not ("torch.*" in allowed and name.startswith("torch."))]


def refusal_message(path, err: Exception) -> str:
    named = re.findall(r"GLOBAL ([\w.]+)", str(err))
    if not named and isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        named = refused_globals(path)
    classes = f"the class or function {', '.join(named[:5])}" if named else ""
    if "ObjectDType" in str(err):  # numpy's object arrays hold pickled Python objects
        what = "a numpy array of Python objects (dtype object)" + (f" holding {classes}" if classes else "")
    else:
        what = classes or "an object that is not plain data"
    allowed = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in ALLOWED_CHECKPOINT_GLOBALS)
    return (
        f"refusing to load checkpoint {path}: it contains {what}, which is not on fairseq-kd's "
        f"allow-list for safe loading (weights_only=True; allowed: {allowed}). Unpickling it could "
        "run arbitrary code, so it was not loaded. Re-save the checkpoint with fairseq (tensors and "
        "plain configuration only), or, if you wrote and trust it, convert it yourself."
        + (f" ({FORCE_NO_WEIGHTS_ONLY_VARIABLE} is set in this environment; fairseq-kd ignores it: "
           "it would let a checkpoint run code when loaded.)"
           if os.getenv(FORCE_NO_WEIGHTS_ONLY_VARIABLE, "0").lower() in ("1", "y", "yes", "true") else "")
    )


def safe_load(path, map_location="cpu"):
    """``torch.load`` with ``weights_only=True`` (explicit) and the same clear refusal."""
    install()
    return weights_only_load(path, map_location=map_location)


def task_state(state: dict) -> dict:
    """What a ``translation_kd`` run keeps in a checkpoint (``extra_state[TASK_STATE_KEY]``:
    ``binding``, ``best_selection``, ``criterion``); empty for a checkpoint of another task."""
    return _get(_get(state, "extra_state"), TASK_STATE_KEY) or {}


# --------------------------------------------------------------------------- the teacher binding
def _short(sha: Optional[str]) -> str:
    return "none" if sha is None else sha[:12]


def run_binding(teacher_sha256: Optional[str], teacher_path: Optional[str], source_dictionary, target_dictionary,
                teacher_changes: list) -> dict:
    """What a run distils from, as recorded in every checkpoint it writes."""
    return {
        "format": BINDING_FORMAT,
        "teacher_sha256": teacher_sha256,
        "teacher_path": teacher_path,
        "source_dictionary_sha256": dictionary_sha256(source_dictionary),
        "target_dictionary_sha256": dictionary_sha256(target_dictionary),
        "dictionary_sizes": [len(source_dictionary), len(target_dictionary)],
        "teacher_changes": list(teacher_changes),
    }


def check_resumed_binding(recorded: Optional[dict], current: dict, allow_teacher_change: bool) -> Optional[list]:
    """Refuse to resume a checkpoint (binding ``recorded``) trained with another teacher or other
    dictionaries than this run's binding ``current``. Returns the teacher changes the resumed run
    carries on (with the change made now under ``allow_teacher_change``), or None when the
    checkpoint records no binding."""
    if not recorded:
        logger.warning(
            "the checkpoint being resumed records no teacher or dictionaries (written before "
            "fairseq-kd recorded them); the teacher cannot be verified"
        )
        return None
    for side in ("source", "target"):
        key = f"{side}_dictionary_sha256"
        if recorded.get(key) != current[key]:
            raise ResumeMismatchError(
                f"resume refused: the data's {side} dictionary (sha256 {_short(current[key])}, "
                f"{current['dictionary_sizes'][side == 'target']} symbols) is not the one the checkpoint "
                f"was trained with (sha256 {_short(recorded.get(key))}, "
                f"{(recorded.get('dictionary_sizes') or ['?', '?'])[side == 'target']} symbols): the "
                "student's embeddings index the old symbols. Resume with the original data folder "
                "or start a new run (another --save-dir)."
            )
    if recorded.get("teacher_sha256") == current["teacher_sha256"]:
        return list(recorded.get("teacher_changes") or [])
    was = (f"{recorded.get('teacher_path')!r} (sha256 {_short(recorded.get('teacher_sha256'))})"
           if recorded.get("teacher_sha256") else "no teacher")
    now = (f"{current['teacher_path']!r} (sha256 {_short(current['teacher_sha256'])})"
           if current["teacher_sha256"] else "no teacher")
    if not allow_teacher_change:
        raise ResumeMismatchError(
            f"resume refused: the checkpoint was trained with teacher {was}, but this run's "
            f"--teacher-checkpoint is {now}; continuing would mix two teachers in one run. Pass "
            "the original teacher, start a new run (another --save-dir), or pass "
            "--allow-teacher-change to switch teachers on purpose."
        )
    logger.warning(f"--allow-teacher-change: resuming a run trained with teacher {was} with teacher {now}")
    return list(recorded.get("teacher_changes") or []) + [
        {"teacher_sha256": recorded.get("teacher_sha256"), "teacher_path": recorded.get("teacher_path")}
    ]


# --------------------------------------------------------------------------- best checkpoint and resume
# Validation metrics that mean the same whatever the training criterion (the plain NLL of the
# references, its perplexity, BLEU); ``loss`` and the criterion's own terms do not.
CRITERION_INDEPENDENT_METRICS = frozenset({"nll_loss", "ppl", "bleu"})


def _get(container, key, default=None):
    if container is None:
        return default
    if isinstance(container, dict):
        return container.get(key, default)
    try:
        return container.get(key, default)
    except Exception:  # noqa: BLE001
        return getattr(container, key, default)


def selection_of(checkpoint_cfg, criterion_name) -> dict:
    return {
        "metric": str(_get(checkpoint_cfg, "best_checkpoint_metric", "loss")),
        "maximize": bool(_get(checkpoint_cfg, "maximize_best_checkpoint_metric", False)),
        "criterion": str(criterion_name) if criterion_name else None,
    }


def recorded_selection(state: dict) -> Optional[dict]:
    """What selected a checkpoint as best: the task's record, else the saved run's config."""
    recorded = _get(task_state(state), "best_selection")
    if recorded:
        return dict(recorded)
    cfg = _get(state, "cfg")
    if cfg is None:
        return None
    return selection_of(_get(cfg, "checkpoint"), _get(_get(cfg, "criterion"), "_name"))


def same_selection(a: dict, b: dict) -> bool:
    if a["metric"] != b["metric"] or bool(a["maximize"]) != bool(b["maximize"]):
        return False
    return a["metric"] in CRITERION_INDEPENDENT_METRICS or a.get("criterion") == b.get("criterion")


def describe_selection(selection: dict) -> str:
    order = "higher" if selection["maximize"] else "lower"
    tied = ("" if selection["metric"] in CRITERION_INDEPENDENT_METRICS
            else f" of criterion {selection.get('criterion')}")
    return f"valid {selection['metric']}{tied} ({order} is better)"


def _peek(path: str) -> dict:
    """A checkpoint's contents without reading its tensors into memory (data only)."""
    try:
        return weights_only_load(path, map_location="cpu", mmap=True)
    except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
        return weights_only_load(path, map_location="cpu")


def _option_differences(saved_cfg, current_cfg) -> list:
    """``--flag: X in the checkpoint, Y in this run`` for every criterion option that differs."""
    saved = {k: v for k, v in dict(saved_cfg or {}).items()}
    try:
        from omegaconf import OmegaConf

        current = OmegaConf.to_container(current_cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(current_cfg) else dict(current_cfg or {})
        if OmegaConf.is_config(saved_cfg):
            saved = OmegaConf.to_container(saved_cfg, resolve=True, enum_to_str=True)
    except Exception:  # noqa: BLE001
        current = dict(current_cfg or {})
    differences = []
    if saved.get("_name") != current.get("_name"):
        differences.append(f"--criterion: {saved.get('_name')!r} in the checkpoint, {current.get('_name')!r} in this run")
    for key in sorted(set(saved) | set(current)):
        if key.startswith("_") or key in ("seed",) or key not in saved or key not in current:
            continue
        if str(saved[key]) != str(current[key]):
            differences.append(f"--{key.replace('_', '-')}: {saved[key]!r} in the checkpoint, {current[key]!r} in this run")
    return differences


def check_criterion_state_fits(state: dict, criterion, current_criterion_cfg, path: str) -> None:
    """Refuse, naming the criterion options that differ, a checkpoint whose criterion parameters
    (e.g. A2D's alignment modules) do not fit this run's criterion; fairseq would otherwise stop
    with its generic 'please ensure that the architectures match'."""
    from fairseq import utils

    if not utils.has_parameters(criterion):
        return
    current = criterion.state_dict()
    saved = state.get("criterion")
    problems = []
    if not saved:
        problems.append("the checkpoint holds no criterion parameters")
    else:
        missing = sorted(set(current) - set(saved))
        unexpected = sorted(set(saved) - set(current))
        if missing:
            problems.append(f"this run's criterion has {', '.join(missing)} that the checkpoint lacks")
        if unexpected:
            problems.append(f"the checkpoint has {', '.join(unexpected)} that this run's criterion lacks")
        for key in sorted(set(current) & set(saved)):
            mine, theirs = current[key], saved[key]
            if hasattr(mine, "shape") and hasattr(theirs, "shape"):
                if tuple(mine.shape) != tuple(theirs.shape):
                    problems.append(f"{key} is {tuple(theirs.shape)} in the checkpoint, {tuple(mine.shape)} in this run")
            elif key.endswith("_extra_state") and mine != theirs:
                problems.append(f"{key} is {theirs} in the checkpoint, {mine} in this run")
    if not problems:
        return
    differences = _option_differences(_get(_get(state, "cfg"), "criterion"), current_criterion_cfg)
    # A criterion can name the cause itself (e.g. an option whose default changed, absent from an
    # older checkpoint's config, so that the comparison above cannot see it).
    hint = getattr(criterion, "checkpoint_state_hint", lambda saved_state: None)(saved or {})
    options = (hint if hint else
               "the criterion options that differ: " + "; ".join(differences) if differences else
               "no criterion option differs, so the student architecture or the teacher does")
    raise ResumeMismatchError(
        f"resume refused: the criterion state in {path} does not fit this run's criterion "
        f"({'; '.join(problems)}); {options}. Resume with the checkpoint's options, or start a new run "
        "(another --save-dir)."
    )


def _guarded_load_checkpoint(original, cfg, trainer, **kwargs):
    """fairseq's ``checkpoint_utils.load_checkpoint`` for a ``translation_kd`` run: says which
    metric selects checkpoint_best.pt, refuses to replace a best checkpoint chosen on another
    metric, checks the criterion state before fairseq loads it, and never compares the best-so-far
    of another metric."""
    from fairseq import checkpoint_utils

    task = trainer.task
    criterion_cfg = trainer.cfg.criterion
    selection = selection_of(cfg, _get(criterion_cfg, "_name"))
    task.best_selection = selection
    writes_best = not (cfg.no_save or getattr(cfg, "no_best_checkpoints", False)
                       or trainer.cfg.dataset.disable_validation)
    best_path = os.path.join(cfg.save_dir, f"checkpoint_best{getattr(trainer, 'checkpoint_suffix', '')}.pt")
    if writes_best:
        logger.info(f"checkpoint_best.pt is selected by {describe_selection(selection)} "
                    "(--best-checkpoint-metric, --maximize-best-checkpoint-metric)")
    else:
        logger.info("no checkpoint_best.pt is written (validation or saving is off)")
    best_file_selection, best_file_value = None, None
    if writes_best and os.path.isfile(best_path):
        peeked = _peek(best_path)
        best_file_selection = recorded_selection(peeked)
        best_file_value = _get(_get(peeked, "extra_state"), "best")
        del peeked
        if best_file_selection is not None and not same_selection(best_file_selection, selection):
            raise ResumeMismatchError(
                f"{best_path} was selected by {describe_selection(best_file_selection)}, but this run "
                f"selects by {describe_selection(selection)}: the values are not comparable and the old "
                f"best would be overwritten. Keep it under another name first (mv {best_path} "
                f"{best_path[:-3]}.{best_file_selection.get('criterion')}-{best_file_selection['metric']}.pt), "
                "use another --save-dir, or select by a metric both runs share (--best-checkpoint-metric "
                "nll_loss)."
            )

    real_loader = checkpoint_utils.load_checkpoint_to_cpu
    fallback = {}

    def loader_checking_criterion_state(path, *args, **kw):
        state = real_loader(path, *args, **kw)
        check_criterion_state_fits(state, trainer.get_criterion(), criterion_cfg, path)
        fallback["selection"] = recorded_selection(state)
        return state

    task.resumed_selection = None
    checkpoint_utils.load_checkpoint_to_cpu = loader_checking_criterion_state
    try:
        result = original(cfg, trainer, **kwargs)
    finally:
        checkpoint_utils.load_checkpoint_to_cpu = real_loader
    resumed = task.resumed_selection or fallback.get("selection")
    save = checkpoint_utils.save_checkpoint
    if resumed is not None and not same_selection(resumed, selection) and hasattr(save, "best"):
        logger.warning(f"the resumed run selected its best checkpoint by {describe_selection(resumed)}; "
                       f"its best-so-far ({save.best}) is dropped: this run compares {describe_selection(selection)}")
        del save.best
    if (not hasattr(save, "best") and best_file_value is not None and best_file_selection is not None
            and same_selection(best_file_selection, selection)):
        save.best = best_file_value
        logger.info(f"{best_path} (valid {selection['metric']} {best_file_value}) is replaced only by a better one")
    return result


def _install_load_checkpoint_guard() -> None:
    """Parts 3 and 4 of :func:`install`: wrap ``checkpoint_utils.load_checkpoint`` for the tasks
    whose class sets ``checkpoint_guard = True``. Idempotent."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_checkpoint
    if getattr(original, "_fairseq_kd_guard", False):
        return

    @functools.wraps(original)
    def load_checkpoint(cfg, trainer, **kwargs):
        if getattr(getattr(trainer, "task", None), "checkpoint_guard", False):
            return _guarded_load_checkpoint(original, cfg, trainer, **kwargs)
        return original(cfg, trainer, **kwargs)

    load_checkpoint._fairseq_kd_guard = True
    # fairseq_cli.train calls checkpoint_utils.load_checkpoint by attribute at call time
    checkpoint_utils.load_checkpoint = load_checkpoint
