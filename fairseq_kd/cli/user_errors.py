"""One line, ``PROG: error: MESSAGE``, not a traceback, for every :class:`fairseq_kd.errors.UserError`:
in the plugin's commands (:func:`exits_on_user_error`, exit status 2 as argparse's) and, through
``--user-dir``, in fairseq's own (:func:`install_for_fairseq_command`). Anything else keeps its traceback.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Optional

from ..errors import UserError, message_of


def exits_on_user_error(prog: str):
    def decorate(main):
        @functools.wraps(main)
        def wrapped(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except UserError as error:
                sys.stderr.write(f"{prog}: error: {message_of(error)}\n")
                sys.exit(2)
            except KeyboardInterrupt:
                sys.stderr.write(f"{prog}: interrupted\n")
                sys.exit(130)
        return wrapped
    return decorate


#: set to 1 to keep Python's traceback for the plugin's user errors under fairseq's commands
TRACEBACK_VARIABLE = "FAIRSEQ_KD_TRACEBACK"


def _is_plugin_user_error(error: BaseException, traceback=None) -> bool:
    return isinstance(error, UserError)


def one_line(prog: str, error: BaseException) -> str:
    return f"{prog}: error: {message_of(error)} [{TRACEBACK_VARIABLE}=1 shows the traceback]\n"


def fairseq_command_name(argv0: str) -> Optional[str]:
    """``fairseq-train`` for ``.../bin/fairseq-train`` or ``.../fairseq_cli/train.py``; None for
    any other program (the plugin's own commands word their errors themselves)."""
    path = Path(argv0)
    if path.name.startswith("fairseq-") and not path.name.startswith("fairseq-kd"):
        return path.name
    if path.parent.name == "fairseq_cli" and path.suffix == ".py":
        return "fairseq-" + path.stem.replace("_", "-")
    return None


def install_for_fairseq_command(argv0: Optional[str] = None) -> bool:
    """Under a fairseq command (and without ``FAIRSEQ_KD_TRACEBACK=1``), print the plugin's user errors
    as one line on stderr (exit status 1, as for any uncaught error); returns whether it was installed."""
    prog = fairseq_command_name(sys.argv[0] if argv0 is None else argv0)
    if prog is None or os.environ.get(TRACEBACK_VARIABLE) == "1":
        return False
    previous = sys.excepthook

    def one_line_for_user_errors(kind, error, traceback):
        if not _is_plugin_user_error(error, traceback):
            return previous(kind, error, traceback)
        sys.stdout.flush()
        sys.stderr.write(one_line(prog, error))
        sys.stderr.flush()

    sys.excepthook = one_line_for_user_errors
    return True
