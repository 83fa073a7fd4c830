"""fairseq-kd: knowledge distillation for fairseq encoder-decoder Transformers.

Use as a fairseq plugin: ``fairseq-train DATA --user-dir fairseq_kd --task translation_kd
--teacher-checkpoint TEACHER.pt --criterion word_kd ...``. Importing the package registers the
task, the architectures and every criterion, and enables safe checkpoint loading.
"""
from .checkpoint_safety import install_checkpoint_allow_list

install_checkpoint_allow_list()

from . import criterions, models, tasks  # noqa: E402,F401  (registration side effects)

__version__ = "0.1.0"
