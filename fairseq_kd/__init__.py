"""fairseq-kd: knowledge distillation for fairseq encoder-decoder Transformers.

Use as a fairseq plugin: ``fairseq-train DATA --user-dir fairseq_kd --task translation_kd
--teacher-checkpoint TEACHER.pt --criterion word_kd ...``. fairseq imports the user directory
after itself, and the package then registers the task, the architectures and every criterion and
enables safe checkpoint loading. Python code that uses the plugin without a fairseq command calls
:func:`register` (idempotent). Importing only the fairseq-free parts (``fairseq_kd.scoring``, the
corpus generator) loads neither torch nor fairseq.
"""
import sys

__version__ = "0.1.0"


def register() -> None:
    """Register the task, architectures and criterions with fairseq and install the checkpoint
    allow-list. Safe to call more than once."""
    from .checkpoint_safety import install_checkpoint_allow_list

    install_checkpoint_allow_list()
    from . import criterions, models, tasks  # noqa: F401  (registration side effects)


if "fairseq" in sys.modules:
    register()
