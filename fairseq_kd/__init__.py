"""fairseq-kd: knowledge distillation for fairseq encoder-decoder Transformers.

A fairseq plugin: ``fairseq-train DATA --user-dir fairseq_kd --task translation_kd
--teacher-checkpoint TEACHER.pt --criterion word_kd ...`` (fairseq imports it after itself, and
it registers itself); code outside a fairseq command calls :func:`register`. Importing only the
fairseq-free parts (``fairseq_kd.scoring``, the corpus generator) loads neither torch nor fairseq.
"""
import itertools
import sys

from .errors import MissingDependencyError

__version__ = "0.1.0"

#: oldest fairseq whose Transformer, task and criterion interfaces the plugin is written against
MIN_FAIRSEQ_VERSION = (0, 12)
FAIRSEQ_FIX = (
    "install fairseq >= 0.12 into this environment; on Python >= 3.11 (where stock fairseq 0.12.2 "
    "does not build) use: pip install 'cython<3.2' 'numpy<2.3' hydra-core==1.3.2 omegaconf==2.3.0 "
    "bitarray regex cffi scikit-learn packaging && pip install fairseq-fixed==0.12.3.1 "
    "--no-build-isolation --no-deps (--no-deps: its metadata asks for torchaudio, which would "
    "replace torch), or run scripts/setup_env.sh, which does this in .venv")


class FairseqMissingError(MissingDependencyError):
    """fairseq is not installed, or is older than :data:`MIN_FAIRSEQ_VERSION`."""


def _version_tuple(version: str) -> tuple:
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def check_fairseq() -> str:
    """The installed fairseq's version; raises :class:`FairseqMissingError` naming the fix when
    fairseq is missing or too old. The plugin declares no fairseq dependency (see pyproject.toml),
    so this is where a missing one is reported."""
    try:
        import fairseq
    except ImportError as error:
        raise FairseqMissingError(f"fairseq-kd needs fairseq, which cannot be imported ({error}); "
                                  f"{FAIRSEQ_FIX}") from error
    version = str(getattr(fairseq, "__version__", "0"))
    if _version_tuple(version)[:2] < MIN_FAIRSEQ_VERSION:
        raise FairseqMissingError(
            f"fairseq-kd needs fairseq >= {'.'.join(map(str, MIN_FAIRSEQ_VERSION))}, found {version} "
            f"({getattr(fairseq, '__file__', '?')}); {FAIRSEQ_FIX}")
    return version


def register() -> None:
    """Register the task, architectures and criterions with fairseq and install every change the
    plugin makes to it (:func:`fairseq_kd.fairseq_patches.install`); idempotent. For entry points
    only, never library code. Raises :class:`FairseqMissingError` when fairseq is missing or too old."""
    check_fairseq()
    from . import fairseq_patches

    fairseq_patches.install()
    from . import criterions, models, tasks  # noqa: F401  (registration side effects)


if "fairseq" in sys.modules:
    register()
    # fairseq-train --user-dir fairseq_kd: the plugin's user errors in one line, as in its own commands
    from .cli.user_errors import install_for_fairseq_command

    install_for_fairseq_command()
