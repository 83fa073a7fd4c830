"""One line, not a traceback, for every user error of the plugin's command-line tools.

``@exits_on_user_error("fairseq-kd-score")`` around a ``cli_main``: an error a user can fix (a
missing, unreadable or undecodable file, a folder where a file is expected, a bad value, an unsafe
checkpoint) is printed as ``PROG: error: MESSAGE`` on stderr and the command exits with status 2,
as argparse does for a bad flag. Programming errors keep their traceback.
"""
from __future__ import annotations

import functools
import sys

# ValueError and OSError, plus fairseq_kd.checkpoints.UnsafeCheckpointError (a RuntimeError),
# matched by name so that the scoring commands import neither torch nor fairseq.
USER_ERRORS = (ValueError, OSError)
USER_RUNTIME_ERRORS = ("UnsafeCheckpointError",)
# A missing optional dependency is the user's to install: the error names the fix.
USER_IMPORT_ERRORS = ("CTranslate2MissingError", "FairseqMissingError")


def message_of(error: BaseException) -> str:
    if isinstance(error, UnicodeDecodeError):
        return (f"a file is not valid UTF-8 (byte 0x{error.object[error.start]:02x}); convert it to "
                "UTF-8 (e.g. iconv -f latin1 -t utf-8)")
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error) or type(error).__name__


def exits_on_user_error(prog: str):
    def decorate(main):
        @functools.wraps(main)
        def wrapped(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except USER_ERRORS as error:
                sys.stderr.write(f"{prog}: error: {message_of(error)}\n")
                sys.exit(2)
            except (RuntimeError, ImportError) as error:
                if type(error).__name__ not in USER_RUNTIME_ERRORS + USER_IMPORT_ERRORS:
                    raise
                sys.stderr.write(f"{prog}: error: {message_of(error)}\n")
                sys.exit(2)
            except KeyboardInterrupt:
                sys.stderr.write(f"{prog}: interrupted\n")
                sys.exit(130)
        return wrapped
    return decorate
