"""Average the parameters of the last N checkpoints of a training run (Vaswani et al. 2017, Sec. 6.1:
"averaging the last 5 checkpoints").

    fairseq-kd-average checkpoints/teacher --last 5 --output checkpoints/teacher/checkpoint_avg.pt

What fairseq's ``scripts/average_checkpoints.py`` does: the element-wise mean of every model
parameter, the rest of the newest checkpoint kept; ``docs/design/commands.md``.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import List, Optional

from fairseq_kd.cli.flags import add_overwrite_flag
from fairseq_kd.cli.user_errors import exits_on_user_error
from fairseq_kd.errors import FOLDER, OUTPUT_FILE, FileAccessError, InputError, message_of, require_path

PATTERNS = {"epoch": re.compile(r"^checkpoint(\d+)\.pt$"), "update": re.compile(r"^checkpoint_\d+_(\d+)\.pt$")}


def last_checkpoints(save_dir: Path, kind: str, count: int) -> List[Path]:
    """The ``count`` checkpoints of ``kind`` with the highest numbers, oldest first."""
    if count < 1:
        raise InputError(f"--last must be at least 1, got {count}")
    require_path(save_dir, "checkpoint folder", FOLDER)
    numbered = sorted((int(match.group(1)), path) for path in save_dir.iterdir()
                      if (match := PATTERNS[kind].match(path.name)))
    if len(numbered) < count:
        flag = "--keep-last-epochs" if kind == "epoch" else "--save-interval-updates/--keep-interval-updates"
        raise InputError(
            f"{str(save_dir)!r} holds {len(numbered)} {kind} checkpoint(s) "
            f"({', '.join(path.name for _, path in numbered) or 'none'}); averaging the last {count} needs "
            f"{count}: train with fairseq's {flag} {count}, or pass a smaller --last")
    return [path for _, path in numbered[-count:]]


def average_checkpoints(paths: List[Path]) -> dict:
    """The newest checkpoint's state with every model parameter replaced by the mean over ``paths``."""
    from fairseq_kd.checkpoints import load_fairseq_checkpoint

    sums, newest = None, None
    for path in paths:
        state = load_fairseq_checkpoint(path)  # weights_only=True, explicitly
        if "model" not in state:
            raise InputError(f"{path}: not a fairseq checkpoint (no model parameters)")
        params = state["model"]
        if sums is None:
            sums = {name: value.double().clone() if value.is_floating_point() else value.clone()
                    for name, value in params.items()}
        else:
            if set(params) != set(sums):
                raise InputError(f"{path}: its parameters differ from {paths[0]}'s; not checkpoints of one run")
            for name, value in params.items():
                if value.shape != sums[name].shape:
                    raise InputError(f"{path}: parameter {name} has shape {tuple(value.shape)}, not "
                                       f"{tuple(sums[name].shape)} as in {paths[0]}")
                if value.is_floating_point():
                    sums[name] += value.double()
        newest = state
    averaged = {}
    for name, value in newest["model"].items():
        averaged[name] = (sums[name] / len(paths)).to(value.dtype) if value.is_floating_point() else value
    newest["model"] = averaged
    newest["last_optimizer_state"] = None
    from omegaconf import OmegaConf

    if OmegaConf.is_config(newest.get("cfg")):  # plain containers, as fairseq saves it
        newest["cfg"] = OmegaConf.to_container(newest["cfg"], resolve=True, enum_to_str=True)
    newest.setdefault("extra_state", {})
    if isinstance(newest["extra_state"], dict):
        newest["extra_state"]["averaged_checkpoints"] = [path.name for path in paths]
    return newest


@exits_on_user_error("fairseq-kd-average")
def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="fairseq-kd-average", description=__doc__.split("\n\n")[0])
    parser.add_argument("save_dir", type=Path, help="the run's --save-dir")
    parser.add_argument("--last", type=int, default=5, metavar="N", help="how many checkpoints (default: %(default)s)")
    parser.add_argument("--kind", choices=sorted(PATTERNS), default="epoch",
                        help="epoch checkpoints (checkpointE.pt) or update checkpoints (checkpoint_E_U.pt) "
                        "(default: %(default)s)")
    parser.add_argument("--output", type=Path, required=True, help="the averaged checkpoint (.pt)")
    add_overwrite_flag(parser, "an existing --output")
    args = parser.parse_args(argv)
    try:
        require_path(args.output, "--output", OUTPUT_FILE)
        if args.output.exists() and not args.overwrite:
            raise InputError(f"--output {str(args.output)!r} already exists; choose another path or pass --overwrite")
        paths = last_checkpoints(args.save_dir, args.kind, args.last)
        if any(args.output.resolve() == path.resolve() for path in paths):
            raise InputError(f"--output {str(args.output)!r} is one of the checkpoints to average; choose another path")
        import fairseq_kd

        fairseq_kd.register()
        from fairseq_kd.checkpoints import UnsafeCheckpointError

        try:
            state = average_checkpoints(paths)
        except UnsafeCheckpointError as error:
            raise InputError(str(error)) from None
    except InputError as error:
        parser.error(str(error))
    import torch

    from fairseq_kd.teacher_pass.common import replace_atomically

    try:  # written whole (a temporary file renamed over it), or not at all
        args.output.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(args.output, lambda handle: torch.save(state, handle))
    except OSError as error:  # --output cannot be written
        raise FileAccessError(message_of(error)) from None
    print(f"averaged {len(paths)} checkpoints ({', '.join(path.name for path in paths)}) into {args.output}")


if __name__ == "__main__":
    cli_main()
