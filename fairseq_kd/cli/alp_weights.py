"""Write the ALP-KD layer weights saved in a checkpoint as JSON for ``fairseq-kd-plot alp``.

    python -m fairseq_kd.cli.alp_weights --checkpoint checkpoints/alp_kd/checkpoint_best.pt \\
        --output alp_weights.json
    fairseq-kd-plot alp --input alp_weights.json --output figs/alp_weights.png

The weights are the mean attention ``alpha_jk`` of every student layer ``j`` over teacher layers
``k`` (Passban et al. 2021, Eq. 5-6) over the real positions trained on in the checkpoint's last
epoch: ``{"encoder": [[...] per student layer], "decoder": ...}`` for the distilled sides.
"""
import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from fairseq_kd.cli.user_errors import exits_on_user_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_kd.cli.alp_weights", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--checkpoint", type=Path, required=True,
        help="checkpoint of a fairseq-train --task translation_kd --criterion alp_kd run",
    )
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    return parser


@exits_on_user_error("python -m fairseq_kd.cli.alp_weights")
def cli_main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    if not args.checkpoint.is_file():
        sys.exit(f"error: --checkpoint {args.checkpoint}: no such file")
    if args.output.exists() and not args.overwrite:
        sys.exit(f"error: --output {args.output} exists; pass --overwrite to replace it")
    from fairseq_kd.checkpoint_safety import UnsafeCheckpointError
    from fairseq_kd.criterions.alp_kd import layer_weights_from_checkpoint

    try:
        weights = layer_weights_from_checkpoint(args.checkpoint)
    except (ValueError, UnsafeCheckpointError) as error:
        sys.exit(f"error: --checkpoint {error}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(weights, indent=1) + "\n")
    print(f"wrote {args.output} ({', '.join(f'{side}: {len(rows)} student layers' for side, rows in weights.items())})")


if __name__ == "__main__":
    cli_main()
