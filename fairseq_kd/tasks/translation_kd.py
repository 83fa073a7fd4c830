"""The ``translation_kd`` task: fairseq's translation task plus a frozen teacher.

Everything the translation task does (data loading, BLEU validation, generation) is unchanged. On
top of it the task loads the teacher given by ``--teacher-checkpoint`` at start-up (before any data
or model work, so a bad path or mismatched dictionaries fail at once), records the student's shape
when the model is built so distillation criterions can size their modules, and tells the
criterion when an epoch begins (epoch-dependent weights and schedules are pure functions of the
epoch, so a resumed run continues with the same values).

Every checkpoint of a ``translation_kd`` run records what the student was distilled from
(:meth:`TranslationKDTask.run_binding`: the teacher file's SHA-256 and the dictionaries' hashes).
On resume the recorded binding must match this run's: another teacher is refused (a run would
otherwise mix two teachers) unless ``--allow-teacher-change``; other dictionaries are always
refused (the student's embeddings index the old symbols).
"""

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Optional

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..models.feature_capture import NotATransformerError
from ..models.shape import TransformerShape
from ..models.teacher import FrozenTeacher


@dataclass
class TranslationKDConfig(TranslationConfig):
    teacher_checkpoint: Optional[str] = field(
        default=None,
        metadata={
            "help": "path of the teacher: any fairseq Transformer translation checkpoint trained on "
            "the same source/target dictionaries. Required by every distillation criterion; without "
            "it the task behaves like 'translation'."
        },
    )
    allow_teacher_change: bool = field(
        default=False,
        metadata={
            "help": "resume a student's checkpoint with another --teacher-checkpoint (a file of other "
            "content) than the one it was trained with, or with a teacher where it had none; without "
            "it such a resume is refused. The checkpoints written afterwards record the new teacher "
            "and the change."
        },
    )
    teacher_data: Optional[str] = field(
        default=None,
        metadata={
            "help": "folder holding the teacher's dictionaries (dict.SRC.txt, dict.TGT.txt: its "
            "fairseq-preprocess --destdir), compared symbol for symbol with the data's. Needed when "
            "the teacher's own data folder (recorded in its checkpoint) is not on this machine and "
            "the checkpoint records no dictionary hashes; without either the teacher is refused."
        },
    )


logger = logging.getLogger(__name__)

BINDING_FORMAT = "fairseq-kd-binding/1"


class ResumeMismatchError(ValueError):
    """A checkpoint is resumed with another teacher or other dictionaries than it was trained with."""


def dictionary_sha256(dictionary) -> str:
    """SHA-256 of a fairseq dictionary's symbols in index order (counts are irrelevant to a model)."""
    return hashlib.sha256("\n".join(dictionary.symbols).encode("utf-8")).hexdigest()


def _short(sha: Optional[str]) -> str:
    return "none" if sha is None else sha[:12]


@register_task("translation_kd", dataclass=TranslationKDConfig)
class TranslationKDTask(TranslationTask):
    cfg: TranslationKDConfig

    def __init__(self, cfg: TranslationKDConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self.teacher: Optional[FrozenTeacher] = None
        self.student_shape: Optional[TransformerShape] = None
        self.student_shape_error: Optional[str] = None
        self.kd_criterion = None
        self.teacher_changes = []  # earlier bindings replaced with --allow-teacher-change
        if cfg.teacher_checkpoint:
            self.teacher = FrozenTeacher.load(cfg.teacher_checkpoint, self)
            self.check_teacher_positions()

    def check_teacher_positions(self) -> None:
        """The teacher must read every sentence the task lets through (longer ones would hit its
        position embeddings with an IndexError at the first update, not here)."""
        teacher_source, teacher_target = self.teacher.model.max_positions()
        for side, flag, task_limit, teacher_limit in (
            ("source", "--max-source-positions", self.cfg.max_source_positions, teacher_source),
            ("target", "--max-target-positions", self.cfg.max_target_positions, teacher_target),
        ):
            if teacher_limit is not None and task_limit is not None and teacher_limit < task_limit:
                raise ValueError(
                    f"--teacher-checkpoint {self.cfg.teacher_checkpoint!r} reads at most {teacher_limit} "
                    f"{side} positions, but the task allows {side} sentences of up to {task_limit} tokens "
                    f"({flag} {task_limit}). Pass {flag} {teacher_limit} (longer training sentences are "
                    "then skipped) or use a teacher trained with longer positions."
                )

    def run_binding(self) -> dict:
        """What this run distils from, as recorded in every checkpoint it writes."""
        return {
            "format": BINDING_FORMAT,
            "teacher_sha256": self.teacher.sha256 if self.teacher is not None else None,
            "teacher_path": self.teacher.path if self.teacher is not None else None,
            "source_dictionary_sha256": dictionary_sha256(self.source_dictionary),
            "target_dictionary_sha256": dictionary_sha256(self.target_dictionary),
            "dictionary_sizes": [len(self.source_dictionary), len(self.target_dictionary)],
            "teacher_changes": list(self.teacher_changes),
        }

    def check_resumed_binding(self, recorded: Optional[dict]) -> None:
        """Refuse to resume a checkpoint trained with another teacher or other dictionaries."""
        if not recorded:
            logger.warning(
                "the checkpoint being resumed records no teacher or dictionaries (written before "
                "fairseq-kd recorded them); the teacher cannot be verified"
            )
            return
        current = self.run_binding()
        for side in ("source", "target"):
            key = f"{side}_dictionary_sha256"
            if recorded.get(key) != current[key]:
                raise ResumeMismatchError(
                    f"resume refused: the data's {side} dictionary (sha256 {_short(current[key])}, "
                    f"{current['dictionary_sizes'][side == 'target']} symbols) is not the one the checkpoint "
                    f"was trained with (sha256 {_short(recorded.get(key))}, "
                    f"{(recorded.get('dictionary_sizes') or ['?', '?'])[side == 'target']} symbols): the "
                    "student's embeddings index the old symbols. Resume with the original data folder "
                    "or start a new run (another --save-dir)."
                )
        if recorded.get("teacher_sha256") == current["teacher_sha256"]:
            self.teacher_changes = list(recorded.get("teacher_changes") or [])
            return
        was = (f"{recorded.get('teacher_path')!r} (sha256 {_short(recorded.get('teacher_sha256'))})"
               if recorded.get("teacher_sha256") else "no teacher")
        now = (f"{current['teacher_path']!r} (sha256 {_short(current['teacher_sha256'])})"
               if current["teacher_sha256"] else "no teacher")
        if not self.cfg.allow_teacher_change:
            raise ResumeMismatchError(
                f"resume refused: the checkpoint was trained with teacher {was}, but this run's "
                f"--teacher-checkpoint is {now}; continuing would mix two teachers in one run. Pass "
                "the original teacher, start a new run (another --save-dir), or pass "
                "--allow-teacher-change to switch teachers on purpose."
            )
        logger.warning(f"--allow-teacher-change: resuming a run trained with teacher {was} with teacher {now}")
        self.teacher_changes = list(recorded.get("teacher_changes") or []) + [
            {"teacher_sha256": recorded.get("teacher_sha256"), "teacher_path": recorded.get("teacher_path")}
        ]

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        try:
            self.student_shape = TransformerShape.from_model(model)
            self.student_shape_error = None
        except NotATransformerError as err:
            # Only feature-based criterions need the shape; they say so when they are built.
            self.student_shape = None
            self.student_shape_error = str(err)
        return model

    def build_criterion(self, cfg):
        from ..criterions.base import KDCriterionBase, check_numeric_options

        # every weight/temperature/rate, finite and in range, before the criterion exists
        check_numeric_options(cfg, getattr(cfg, "_name", None) or "")
        criterion = super().build_criterion(cfg)
        if isinstance(criterion, KDCriterionBase):
            self.kd_criterion = criterion
        return criterion

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        if self.kd_criterion is not None:
            self.kd_criterion.is_dummy_batch = ignore_grad
        try:
            return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)
        finally:
            if self.kd_criterion is not None:
                self.kd_criterion.is_dummy_batch = False

    def begin_epoch(self, epoch, model):
        super().begin_epoch(epoch, model)
        if self.kd_criterion is not None:
            self.kd_criterion.begin_epoch(epoch)

    # fairseq persists this dict in the checkpoint's extra_state under the task's class name and
    # hands it back on resume (checkpoint_utils.save_checkpoint / load_checkpoint). Criterion state
    # that is not a parameter (e.g. selective KD's queue) travels this way, because the trainer
    # saves the criterion's state_dict only when the criterion has parameters.
    # The run's binding (teacher and dictionary hashes) travels the same way and is checked first.
    def get_checkpoint_dict(self):
        state = {"binding": self.run_binding()}
        if self.kd_criterion is not None:
            state["criterion"] = self.kd_criterion.checkpoint_state()
        return {type(self).__name__: state}

    def set_checkpoint_dict(self, state):
        self.check_resumed_binding(state.get("binding"))
        if self.kd_criterion is not None and "criterion" in state:
            self.kd_criterion.load_checkpoint_state(state["criterion"])

    def require_teacher(self, criterion_name: str) -> FrozenTeacher:
        if self.teacher is None:
            raise ValueError(
                f"criterion {criterion_name!r} distils from a teacher: pass --teacher-checkpoint PATH "
                "(a trained fairseq Transformer translation checkpoint)."
            )
        return self.teacher

    def require_student_shape(self, criterion_name: str) -> TransformerShape:
        if self.student_shape is None:
            reason = f" ({self.student_shape_error})" if self.student_shape_error else ""
            raise ValueError(
                f"criterion {criterion_name!r} needs an encoder-decoder Transformer student "
                "(a --arch of fairseq's transformer family with at least one encoder and one decoder "
                f"layer, see --encoder-layers / --decoder-layers); the model built has another layout{reason}."
            )
        return self.student_shape

