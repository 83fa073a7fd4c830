"""A fairseq Transformer translation model read from its training checkpoint, in the steps the
frozen teacher and the exports share: :func:`read_model_checkpoint` (weights-only),
:func:`check_transformer`, :func:`build_checkpoint_model` (config values checked, weights loaded
strictly). Each step raises its own :class:`CheckpointModelError`; callers word it with their flag.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional

from omegaconf.errors import OmegaConfBaseException
from torch import nn

from ..checkpoints import UNREADABLE_FILE_ERRORS, load_fairseq_checkpoint
from ..errors import FILE, InputError, UserError, path_problem


def checkpoint_file_problem(path) -> Optional[str]:
    """Why ``path`` is not a readable checkpoint file, in words for a message after the flag, None
    when it is one; a folder (fairseq's ``--save-dir``) is said as such, with the checkpoints it holds."""
    if not path:
        return "no checkpoint file given"
    problem = path_problem(path, FILE)
    if problem is None or not Path(path).is_dir():
        return problem
    held = sorted(child.name for child in Path(path).glob("*.pt") if child.is_file())
    example = Path(path) / (held[0] if len(held) == 1 else "checkpoint_best.pt")
    listed = f" (it holds {', '.join(held[:4])}{', ...' if len(held) > 4 else ''})" if held else ""
    return f"{problem}{listed}; give the checkpoint file, e.g. {example}"


class CheckpointModelError(InputError):
    """A checkpoint that cannot give a fairseq Transformer model."""


class NoModelError(CheckpointModelError):
    """The checkpoint holds no fairseq model configuration or no weights; ``keys``: what it holds."""

    def __init__(self, keys: List[str]):
        super().__init__(f"no fairseq model configuration/weights (keys: {keys})")
        self.keys = keys


class NotATransformerCheckpointError(CheckpointModelError):
    """The checkpoint's model is not an encoder-decoder Transformer; ``model_type``: what it names."""

    def __init__(self, model_type: Optional[str]):
        super().__init__(f"holds a {model_type!r} model, not an encoder-decoder Transformer")
        self.model_type = model_type


class WeightsMismatchError(CheckpointModelError):
    """The checkpoint's weights do not fit the model its own configuration builds (the message is
    ``load_state_dict``'s)."""


class ModelConfigError(CheckpointModelError):
    """A value of the checkpoint's model config cannot build the model (``encoder_layers: "three"``)."""


class UnreadableCheckpointError(CheckpointModelError):
    """The file is not one torch and fairseq can read as a checkpoint; ``reason``: the error's type and first line."""

    def __init__(self, path, err: Exception):
        self.reason = f"{type(err).__name__}: {err}".splitlines()[0]
        super().__init__(f"{str(path)!r} is not a readable fairseq checkpoint: {self.reason}")


def read_model_checkpoint(path: str) -> dict:
    """The checkpoint's state (read weights-only), which holds ``cfg`` and ``model``."""
    try:
        state = load_fairseq_checkpoint(path)
    except UserError:
        raise
    # torch's errors for bytes that are no checkpoint, and fairseq's upgrade of old checkpoints given
    # another program's dict or list (KeyError, IndexError, TypeError, AttributeError, ValueError)
    except UNREADABLE_FILE_ERRORS + (TypeError, AttributeError) as err:
        raise UnreadableCheckpointError(path, err) from None
    if state.get("cfg") is None or "model" not in state or "model" not in state["cfg"]:
        raise NoModelError(sorted(state))
    return state


def check_transformer(model_cfg) -> str:
    """The model type ``model_cfg`` names (``_name``, else ``arch``): one of fairseq's Transformer family."""
    from fairseq import models
    from fairseq.models.transformer import TransformerModelBase

    model_type = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)
    model_class = models.ARCH_MODEL_REGISTRY.get(model_type) or models.MODEL_REGISTRY.get(model_type)
    if model_class is None or not issubclass(model_class, TransformerModelBase):
        raise NotATransformerCheckpointError(model_type)
    return model_type


def read_transformer_checkpoint(path: str) -> dict:
    """:func:`read_model_checkpoint` of a checkpoint whose model passes :func:`check_transformer`."""
    state = read_model_checkpoint(path)
    try:
        check_transformer(state["cfg"].model)
    except OmegaConfBaseException as err:  # omegaconf's own: a ${...} in the cfg that does not resolve
        raise UnreadableCheckpointError(path, err) from None
    return state


def check_config_values(model_cfg) -> None:
    """Each value of ``model_cfg`` that its architecture gives a number or a flag is one (None is left to fairseq)."""
    from argparse import Namespace

    from fairseq import models

    model_type = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)
    architecture = models.ARCH_CONFIG_REGISTRY.get(model_type)
    if architecture is None:
        return
    defaults = Namespace()
    architecture(defaults)  # fairseq's architectures fill in what a Namespace lacks
    for key, default in sorted(vars(defaults).items()):
        value = getattr(model_cfg, key, None)
        if value is None or default is None or isinstance(default, str):
            continue
        numeric = isinstance(value, (int, float))
        if (numeric if isinstance(default, bool) else numeric and not isinstance(value, bool)):
            continue
        wanted = "true or false" if isinstance(default, bool) else "a number"
        raise ModelConfigError(f"its model config's {key} is {value!r}, not {wanted}: the checkpoint is damaged "
                               "or was not written by fairseq")


def build_checkpoint_model(state: dict, task) -> nn.Module:
    """The model of ``state``'s configuration built by fairseq for ``task``'s dictionaries, its
    weights loaded strictly."""
    from fairseq import models

    cfg = state["cfg"]
    check_config_values(cfg.model)
    try:
        model = models.build_model(cfg.model, task, from_checkpoint=True)
    except (TypeError, ValueError) as err:  # another value of the config that fairseq cannot build from
        raise ModelConfigError(f"its model config cannot build a model ({type(err).__name__}: "
                               f"{' '.join(str(err).split())})") from err
    try:
        model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
    except RuntimeError as err:
        raise WeightsMismatchError(summarize_load_error(str(err))) from err
    return model


def summarize_load_error(message: str) -> str:
    """torch's ``load_state_dict`` report in one line: how many of each kind of fault, and the first."""
    parts = []
    for label, what in (("Missing key(s)", "missing"), ("Unexpected key(s)", "unexpected")):
        match = re.search(re.escape(label) + r" in state_dict: (.*)", message)
        if match:
            keys = re.findall(r'"([^"]+)"', match.group(1))
            parts.append(f"{len(keys)} {what} tensor{'s' * (len(keys) != 1)} (first: {keys[0] if keys else '?'})")
    shapes = re.findall(r"size mismatch for ([^:]+): copying a param with shape (torch.Size\(\[[^]]*\]\)) from "
                        r"checkpoint, the shape in current model is (torch.Size\(\[[^]]*\]\))", message)
    if shapes:
        name, saved, current = shapes[0]
        parts.append(f"{len(shapes)} of another shape (first: {name}: {saved[11:-1]} in the checkpoint, "
                     f"{current[11:-1]} in the model)")
    return "; ".join(parts) if parts else " ".join(message.split())
