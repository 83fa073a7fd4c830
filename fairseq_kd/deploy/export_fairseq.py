"""Export a distilled student as a plain fairseq ``transformer`` checkpoint.

The result is what stock fairseq would have saved for ``--arch transformer --task translation``
with the student's sizes written out explicitly, minus everything that only served training:

* no teacher, criterion (projections, alignment modules), optimizer or data-loader state;
* no distillation options in the config (task ``translation``, criterion
  ``label_smoothed_cross_entropy``);
* the config stored as plain containers, never as ``argparse.Namespace``, so stock fairseq on
  PyTorch >= 2.6 loads it with ``weights_only=True`` without this plugin (``fairseq-generate``
  without ``--user-dir``).
"""
import argparse
import hashlib
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ..checkpoints import safe_load
from ..errors import OUTPUT_FILE, FileAccessError, InputError, message_of, path_problem
from ..models.from_checkpoint import NoModelError, checkpoint_file_problem, read_model_checkpoint
from .model_folder import parent_folders

# Config groups a stock fairseq loader reads; the rest of the training config is dropped.
_KEPT_GROUPS = ("common", "common_eval", "distributed_training", "dataset", "optimization",
                "checkpoint", "bmuf", "generation", "eval_lm", "interactive", "ema")
# Groups fairseq's hub interface (TransformerModel.from_pretrained) reads even when they are unset
# (None: no tokenizer, no BPE, default scorer); kept as the training run had them.
_HUB_GROUPS = ("tokenizer", "bpe", "scoring")


class ExportError(InputError):
    """The input is not a student checkpoint that can be exported."""


def _plain(node):
    """A config node as plain dicts/lists/scalars (Namespaces included, recursively)."""
    if isinstance(node, argparse.Namespace):
        return {k: _plain(v) for k, v in vars(node).items()}
    if isinstance(node, DictConfig):
        return _plain(OmegaConf.to_container(node, resolve=True, enum_to_str=True))
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    return node


#: buffers fairseq Transformers keep in their state dicts next to the parameters
FAIRSEQ_BUFFER_SUFFIXES = (".version", "._float_tensor")


def count_parameters(state_dict: dict) -> int:
    """Parameters of a model state, each tensor storage counted once (tied embeddings and output
    projections share one), fairseq's bookkeeping buffers excluded."""
    seen, total = set(), 0
    for name, tensor in state_dict.items():
        if not torch.is_floating_point(tensor) or name.endswith(FAIRSEQ_BUFFER_SUFFIXES):
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel()
    return total


def export_student(checkpoint: str, output: str, overwrite: bool = False) -> dict:
    """Write ``output`` from the training checkpoint ``checkpoint``; return a summary.

    An ``output`` that is an existing folder, or ends with a path separator, receives a file named
    like the input checkpoint inside it (``export/`` -> ``export/checkpoint_best.pt``)."""
    problem = checkpoint_file_problem(checkpoint)
    if problem is not None:
        raise ExportError(f"checkpoint {checkpoint!r}: {problem}")
    output = _output_path(checkpoint, str(output), overwrite)
    try:
        state = read_model_checkpoint(checkpoint)
    except NoModelError:
        raise ExportError(f"{checkpoint!r} is not a fairseq training checkpoint (no cfg/model)") from None
    cfg = state["cfg"]
    model_cfg = _stock_transformer_config(checkpoint, cfg.model)
    history = state.get("optimizer_history") or [{}]
    num_updates = history[-1].get("num_updates", 0)
    weights = dict(state["model"])
    exported = {
        "cfg": _stock_config(cfg, model_cfg),
        "args": None,
        "model": weights,
        "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion",
                               "optimizer_name": history[-1].get("optimizer_name", "FairseqAdam"),
                               "lr_scheduler_state": {"best": None}, "num_updates": num_updates}],
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0}},
        "last_optimizer_state": None,
    }
    try:
        _save_loadable(exported, output)
    except OSError as err:  # the output's folder or file cannot be written
        raise FileAccessError(message_of(err)) from None
    return {"output": output, "parameters": count_parameters(weights), "num_updates": num_updates,
            "encoder_layers": model_cfg.get("encoder_layers"), "decoder_layers": model_cfg.get("decoder_layers"),
            "sha256": hashlib.sha256(Path(output).read_bytes()).hexdigest()}


def _output_path(checkpoint: str, output: str, overwrite: bool) -> str:
    """The file to write (a folder receives the checkpoint's file name), never the input and
    never an existing file without ``overwrite``."""
    if os.path.isdir(output) or output.endswith(("/", os.sep)):
        output = os.path.join(output, os.path.basename(checkpoint))
    if os.path.islink(output):
        raise ExportError(f"output {output!r} is a symbolic link (to {os.readlink(output)!r}); give a real file "
                          "path: the export neither writes through a link nor replaces it")
    if os.path.isdir(output):
        raise ExportError(f"output {output!r} is a folder; give a file path for the exported checkpoint")
    problem = path_problem(output, OUTPUT_FILE)
    if problem is not None:
        raise ExportError(f"output {output!r}: {problem}")
    if os.path.abspath(output) == os.path.abspath(checkpoint) or (
            os.path.exists(output) and os.path.samefile(output, checkpoint)):
        raise ExportError(f"the output path {output!r} is the input checkpoint; choose another path "
                          "(the export never replaces its input)")
    if os.path.exists(output) and not overwrite:
        raise ExportError(f"output {output!r} already exists; choose another path or pass --overwrite")
    if os.path.exists(output) and not os.path.isfile(output):
        raise ExportError(f"output {output!r} is not a regular file; --overwrite replaces only a file")
    return output


def _stock_transformer_config(checkpoint: str, model_config) -> dict:
    """The student's model config as plain containers with every size written out, naming the
    stock ``transformer`` architecture; refuses a model that is not a Transformer."""
    model_cfg = _plain(model_config)
    if not isinstance(model_cfg, dict):
        raise ExportError(f"{checkpoint!r}: unexpected model config of type {type(model_config).__name__}")
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
    from fairseq.models.transformer import TransformerModelBase

    arch = model_cfg.get("arch") or model_cfg.get("_name")
    model_class = ARCH_MODEL_REGISTRY.get(arch)
    if model_class is None or not issubclass(model_class, TransformerModelBase):
        raise ExportError(f"{checkpoint!r} holds a {arch!r} model; only Transformer students can be exported")
    # Apply the (possibly plugin-registered) architecture so every size is explicit, then name
    # the stock architecture, whose defaults then change nothing.
    resolved = argparse.Namespace(**model_cfg)
    ARCH_CONFIG_REGISTRY[arch](resolved)
    model_cfg = _plain(resolved)
    model_cfg.update(arch="transformer", _name="transformer")
    return model_cfg


def _stock_config(cfg, model_cfg: dict) -> dict:
    """The whole config a stock fairseq loader reads: the kept groups, task ``translation``
    without the teacher, criterion ``label_smoothed_cross_entropy``."""
    task_cfg = _plain(cfg.task)
    task_cfg.pop("teacher_checkpoint", None)
    task_cfg["_name"] = "translation"
    plain_cfg = {group: _plain(cfg[group]) for group in _KEPT_GROUPS if group in cfg and cfg[group] is not None}
    plain_cfg.update({group: _plain(cfg[group]) if group in cfg else None for group in _HUB_GROUPS})
    plain_cfg.update(model=model_cfg, task=task_cfg,
                     criterion={"_name": "label_smoothed_cross_entropy", "label_smoothing": 0.1,
                                "report_accuracy": False, "ignore_prefix_size": 0, "sentence_avg": False})
    return plain_cfg


def _save_loadable(exported: dict, output: str) -> None:
    """Write ``exported`` to ``output`` through a temporary file of this process that must load
    safely first; a failure leaves nothing behind (nor the folders made for ``output``)."""
    from ..teacher_pass.common import replace_atomically

    def write(handle) -> None:
        torch.save(exported, handle)
        handle.flush()
        safe_load(handle.name)  # refuse to leave behind anything stock fairseq could not load safely

    with parent_folders(Path(output)):
        replace_atomically(Path(output), write)
