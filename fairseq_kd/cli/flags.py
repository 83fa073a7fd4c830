"""List the flags of the ``translation_kd`` task and of a distillation criterion, with their help.

``fairseq-train --help`` cannot: fairseq prints its help before it adds the flags of the chosen
task, criterion and architecture (``fairseq.options.parse_args_and_arch`` parses once with
``--help`` still active), so ``fairseq-train --help --user-dir fairseq_kd --criterion NAME`` lists
only the generic flags. This prints what it leaves out:

    python -m fairseq_kd.cli.flags --criterion a2d_kd
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from fairseq_kd.cli.user_errors import exits_on_user_error


@exits_on_user_error("python -m fairseq_kd.cli.flags")
def cli_main(argv: Optional[List[str]] = None) -> None:
    import fairseq_kd

    fairseq_kd.register()
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.tasks import TASK_REGISTRY

    from fairseq_kd.criterions.base import KDCriterionBase

    names = sorted(n for n, c in CRITERION_REGISTRY.items() if isinstance(c, type) and issubclass(c, KDCriterionBase))
    parser = argparse.ArgumentParser(prog="python -m fairseq_kd.cli.flags", description=__doc__.split("\n")[0])
    parser.add_argument("--criterion", choices=names, help="the criterion whose flags to list (default: "
                        "only the task's flags)")
    args = parser.parse_args(argv)
    shown = argparse.ArgumentParser(
        prog=f"fairseq-train DATA --user-dir fairseq_kd --task translation_kd"
             + (f" --criterion {args.criterion}" if args.criterion else ""),
        add_help=False, usage=argparse.SUPPRESS, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    TASK_REGISTRY["translation_kd"].add_args(shown)
    if args.criterion:
        CRITERION_REGISTRY[args.criterion].add_args(shown)
    shown.print_help()


if __name__ == "__main__":
    cli_main()
