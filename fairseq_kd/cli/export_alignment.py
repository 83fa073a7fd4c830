"""Write the Attention Alignment Module weights of an Align-to-Distill checkpoint as JSON.

    python -m fairseq_kd.cli.export_alignment --checkpoint checkpoints/a2d/checkpoint_best.pt \\
        --output figs/aam_weights.json
    fairseq-kd-plot alignment --input figs/aam_weights.json --output figs/aam.png

The checkpoint must come from ``fairseq-train --criterion a2d_kd``: fairseq stores the criterion's
parameters (the AAMs) in its ``criterion`` entry, never in the student model. The JSON holds, per
attention kind, ``weights`` (rows = student maps, columns = teacher maps, both layer-major) and
the layer and head counts, the format of ``fairseq_kd.scoring.plots.plot_alignment_heatmaps``
(Jin et al. 2024, Figure 2). The checkpoint is read with ``weights_only=True``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Optional

from fairseq_kd.checkpoint_safety import UnsafeCheckpointError, safe_load
from fairseq_kd.modules.attention_alignment import AlignmentShapeError, alignment_weights_from_state
from fairseq_kd.cli.user_errors import exits_on_user_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_kd.cli.export_alignment",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a fairseq checkpoint trained with --criterion a2d_kd")
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    return parser


def export_alignment(checkpoint: Path) -> dict:
    """``{kind: {"weights": ..., sizes...}}`` from an a2d_kd checkpoint; clear errors otherwise."""
    if not checkpoint.is_file():
        raise FileNotFoundError(f"--checkpoint {str(checkpoint)!r}: no such file")
    state = safe_load(checkpoint)
    criterion_state = state.get("criterion") if isinstance(state, dict) else None
    if not criterion_state:
        raise ValueError(
            f"--checkpoint {str(checkpoint)!r} has no criterion parameters; alignment weights exist only "
            "in checkpoints written by fairseq-train --criterion a2d_kd (with --a2d-lambda > 0), not "
            "in exported students or teachers"
        )
    try:
        return alignment_weights_from_state(criterion_state)
    except AlignmentShapeError as err:
        raise ValueError(f"--checkpoint {str(checkpoint)!r}: {err}") from None


@exits_on_user_error("python -m fairseq_kd.cli.export_alignment")
def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output.exists() and not args.overwrite:
        parser.error(f"--output {str(args.output)!r} exists; pass --overwrite to replace it")
    try:
        weights = export_alignment(args.checkpoint)
    except (FileNotFoundError, ValueError, UnsafeCheckpointError) as err:
        parser.error(str(err))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(weights, handle)
    kinds = ", ".join(f"{kind} {len(entry['weights'])}x{len(entry['weights'][0])}" for kind, entry in weights.items())
    print(f"wrote {args.output} ({kinds})")


if __name__ == "__main__":
    cli_main()
