"""Safe loading of fairseq checkpoints on PyTorch >= 2.6.

PyTorch 2.6 made ``torch.load`` default to ``weights_only=True``: only tensors, containers and
primitive types are unpickled, plus classes explicitly allow-listed. fairseq stores its legacy
configuration as an ``argparse.Namespace`` inside ``cfg``/``args``, so stock fairseq cannot read
its own checkpoints any more. This module allow-lists exactly the classes fairseq checkpoints
contain (``ALLOWED_CHECKPOINT_GLOBALS``) when the plugin is imported, and turns the refusal of any
other class into an error that names the file and the class instead of advising to switch the
protection off. Nothing is ever loaded with ``weights_only=False``.
"""
from __future__ import annotations

import argparse
import functools
import pickle
import re

import torch

# Every class found in checkpoints written by fairseq-train (translation task, legacy and
# dataclass architectures, fp16, resume state): the legacy argument namespace only.
ALLOWED_CHECKPOINT_GLOBALS = (argparse.Namespace,)


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


def refusal_message(path, err: Exception) -> str:
    found = re.findall(r"GLOBAL ([\w.]+)", str(err))
    what = f"the class {found[0]}" if found else "an object that is not plain data"
    allowed = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in ALLOWED_CHECKPOINT_GLOBALS)
    return (
        f"refusing to load checkpoint {path}: it contains {what}, which is not on fairseq-kd's "
        f"allow-list for safe loading (weights_only=True; allowed: {allowed}). Unpickling it could "
        "run arbitrary code, so it was not loaded. Re-save the checkpoint with fairseq (tensors and "
        "plain configuration only), or, if you wrote and trust it, convert it yourself."
    )


def safe_load(path, map_location="cpu"):
    """``torch.load`` with ``weights_only=True`` and the same clear refusal."""
    install_checkpoint_allow_list()
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(refusal_message(path, err)) from None
