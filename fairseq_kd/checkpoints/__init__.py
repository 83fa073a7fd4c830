"""What the plugin does with checkpoints: safe loading (:mod:`.safe_loading`) and the checks of a
resumed run (:mod:`.resume_checks`), named here too for their importers. Their patches of fairseq
are installed by :func:`fairseq_kd.fairseq_patches.install`.
"""
from .resume_checks import ResumeMismatchError, check_resumed_binding, run_binding, task_state  # noqa: F401
from .safe_loading import (UNREADABLE_FILE_ERRORS, UnsafeCheckpointError, load_fairseq_checkpoint,  # noqa: F401
                           refused_globals, safe_load, weights_only_load)
