"""The one teacher loader of training (``--task translation_kd``) and the offline teacher passes."""
from __future__ import annotations

from typing import Optional

import torch

from .hf_teacher import HuggingFaceTeacher
from .teacher import FrozenTeacher, is_hugging_face_folder


def load_teacher(path: str, task, teacher_data: Optional[str] = None, sha256: Optional[str] = None) -> FrozenTeacher:
    """The teacher ``path`` names (a Hugging Face folder or a fairseq checkpoint file), loaded without
    moving torch's random state (docs/design/teachers.md)."""
    with torch.random.fork_rng(devices=[]):  # the CPU generator: teachers are built on the CPU
        if is_hugging_face_folder(path):
            return HuggingFaceTeacher.load(path, task, teacher_data=teacher_data, sha256=sha256)
        return FrozenTeacher.load(path, task, teacher_data=teacher_data, sha256=sha256)
