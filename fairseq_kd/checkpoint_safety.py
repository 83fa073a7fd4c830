"""Safe loading of fairseq checkpoints on PyTorch >= 2.6.

PyTorch 2.6 made ``torch.load`` default to ``weights_only=True``: only tensors, containers and
primitive types are unpickled, plus classes explicitly allow-listed. fairseq stores its legacy
configuration as an ``argparse.Namespace`` inside ``cfg``/``args``, so stock fairseq cannot read
its own checkpoints any more. This module allow-lists exactly the classes fairseq checkpoints
contain (``ALLOWED_CHECKPOINT_GLOBALS``) when the plugin is imported, and turns the refusal of any
other class into an error that names the file and the class instead of advising to switch the
protection off. Nothing is ever loaded with ``weights_only=False``.

``weights_only=True`` is always passed *explicitly*: many fairseq users set
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` to read old checkpoints, and torch then unpickles anything
(running whatever code a crafted checkpoint carries) in every ``torch.load`` call that leaves the
argument out, as fairseq's own loader does. An explicit value wins over that variable, so once the
plugin is imported (``--user-dir fairseq_kd`` or ``fairseq_kd.register()``), the ``torch`` that
``fairseq.checkpoint_utils`` calls is replaced by :class:`_WeightsOnlyTorch`, whose ``load``
always passes ``weights_only=True``. That covers ``fairseq-train --restore-file`` / resume,
``fairseq-generate --path`` and every plugin command, whichever name they reach the loader by.
"""
from __future__ import annotations

import argparse
import functools
import os
import pickle
import re
import types

import numpy as np
import torch

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


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint needs a class outside the allow-list; it was not loaded."""


_installed = False


def install_checkpoint_allow_list() -> None:
    """Register the allow-list with torch and wrap fairseq's loader for clear refusals.

    Idempotent; called when ``fairseq_kd`` is imported (so ``--user-dir fairseq_kd`` enables it for
    fairseq-train, fairseq-generate and every other fairseq command).
    """
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
        return torch.load(f, *args, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(refusal_message(getattr(f, "name", f), err)) from None


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
    install_checkpoint_allow_list()
    from fairseq import checkpoint_utils

    if not fairseq_loader_is_safe():  # someone replaced it after us: put the safe one back
        checkpoint_utils.torch = _WeightsOnlyTorch()
    return checkpoint_utils.load_checkpoint_to_cpu(str(path), arg_overrides)


def refusal_message(path, err: Exception) -> str:
    found = re.findall(r"GLOBAL ([\w.]+)", str(err))
    what = f"the class {found[0]}" if found else "an object that is not plain data"
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
    install_checkpoint_allow_list()
    return weights_only_load(path, map_location=map_location)
