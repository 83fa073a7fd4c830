"""The one teacher loader of training (``--task translation_kd``) and the offline teacher passes."""
from __future__ import annotations

from typing import Optional

import torch

from .hf_teacher import HuggingFaceTeacher
from .teacher import FrozenTeacher, is_hugging_face_folder


def load_teacher(path: str, task, teacher_data: Optional[str] = None, sha256: Optional[str] = None) -> FrozenTeacher:
    """The teacher ``path`` names, for training and the offline passes alike: a Hugging Face
    ``save_pretrained`` folder (:class:`.hf_teacher.HuggingFaceTeacher`) or a fairseq checkpoint
    file (:meth:`.teacher.FrozenTeacher.load`, whose arguments these are).

    Loading leaves torch's random state where it was: building a fairseq teacher initialises its
    parameters randomly before its weights are read, and fairseq-train builds the student after the
    task, so without this the student's initial weights would depend on the teacher's format."""
    with torch.random.fork_rng(devices=[]):  # the CPU generator: teachers are built on the CPU
        if is_hugging_face_folder(path):
            return HuggingFaceTeacher.load(path, task, teacher_data=teacher_data, sha256=sha256)
        return FrozenTeacher.load(path, task, teacher_data=teacher_data, sha256=sha256)
