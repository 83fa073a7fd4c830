"""Deprecated: use ``fairseq-kd-plot alp --checkpoint CKPT --output FIG.png --weights-output
alp_weights.json``, which reads the same weights through the same code and draws them.

Kept as an alias (``--checkpoint CKPT --output alp_weights.json [--overwrite]``, JSON only) while
the recipes and tests still call it; see :mod:`fairseq_kd.cli.plot`.
"""
from typing import List, Optional

from fairseq_kd.cli.export_alignment import export_weights_main
from fairseq_kd.cli.user_errors import exits_on_user_error


@exits_on_user_error("python -m fairseq_kd.cli.alp_weights")
def cli_main(argv: Optional[List[str]] = None) -> None:
    export_weights_main("alp", "python -m fairseq_kd.cli.alp_weights", argv)


if __name__ == "__main__":
    cli_main()
