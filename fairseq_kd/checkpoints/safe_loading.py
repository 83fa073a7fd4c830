"""Safe loading of checkpoints: nothing is unpickled beyond plain data, whatever
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says. Every load passes ``weights_only=True`` explicitly
(:func:`weights_only_load`, :func:`safe_load`); the classes fairseq checkpoints hold are
allow-listed (:data:`ALLOWED_CHECKPOINT_GLOBALS`); a refusal names the file and the class, read
from the pickle's opcodes without running them (:func:`refused_globals`). :func:`install` (made
by :func:`fairseq_kd.fairseq_patches.install`) routes fairseq's own loader through the same load.
Why: ``docs/design/checkpoints.md``.
"""
from __future__ import annotations

import argparse
import functools
import io
import os
import pickle
import re
import struct
import types
import warnings

import numpy as np
import torch

from ..errors import UserError

try:  # the name numpy pickles arrays with (numpy >= 2; numpy.core before)
    from numpy._core.multiarray import _reconstruct as np_reconstruct
except ImportError:  # pragma: no cover - numpy < 2
    from numpy.core.multiarray import _reconstruct as np_reconstruct

# Every class found in checkpoints written by fairseq-train: the legacy argument namespace, and
# numpy arrays (fairseq keeps --eval-bleu's n-gram counts as arrays), rebuilt from their dtype and
# raw bytes; an array of Python objects would need its elements' classes, which stay refused.
NUMERIC_DTYPE_CLASSES = tuple(dict.fromkeys(type(np.dtype(code)) for code in "?bhilqBHILQefd"))
ALLOWED_CHECKPOINT_GLOBALS = (argparse.Namespace, np.ndarray, np.dtype, np_reconstruct, *NUMERIC_DTYPE_CLASSES)
FORCE_NO_WEIGHTS_ONLY_VARIABLE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
#: What ``torch.load`` raises for bytes that are no checkpoint: a damaged or foreign file, not a bug
#: of its caller (docs/design/checkpoints.md); its OSError is left to the callers.
UNREADABLE_FILE_ERRORS = (pickle.UnpicklingError, UnicodeDecodeError, EOFError, RuntimeError, ValueError, LookupError,
                          struct.error, AssertionError)


class UnsafeCheckpointError(UserError, RuntimeError):
    """A checkpoint needs a class outside the allow-list; it was not loaded."""


def install() -> None:
    """Register the allow-list with torch, and make fairseq's ``checkpoint_utils`` load through
    :func:`weights_only_load` with refusals that name the file. Idempotent; a replacement of
    fairseq's attributes made after it is undone by the next call."""
    torch.serialization.add_safe_globals(list(ALLOWED_CHECKPOINT_GLOBALS))
    from fairseq import checkpoint_utils

    if not fairseq_loader_is_safe():
        checkpoint_utils.torch = _WeightsOnlyTorch()
    original = checkpoint_utils.load_checkpoint_to_cpu
    if getattr(original, "_fairseq_kd_refusals", False):
        return

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return original(path, *args, **kwargs)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(refusal_message(path, err)) from None

    load_checkpoint_to_cpu._fairseq_kd_refusals = True
    # fairseq looks the function up as a module attribute at call time (trainer, generate,
    # load_model_ensemble), so replacing the attribute covers every fairseq entry point.
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu


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
    """fairseq's ``load_checkpoint_to_cpu`` (config upgrade included) through
    :func:`weights_only_load`, with :func:`install` made first (library code need not call
    :func:`fairseq_kd.register`)."""
    install()
    from fairseq import checkpoint_utils

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
    own and whatever a caller added with ``add_safe_globals``."""
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
    return weights_only_load(path, map_location=map_location)
