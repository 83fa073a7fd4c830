"""The ``translation_kd`` task: fairseq's translation task plus a frozen teacher.

Everything the translation task does (data loading, BLEU validation, generation) is unchanged. On
top of it the task loads the teacher given by ``--teacher-checkpoint`` at start-up (before any data
or model work, so a bad path or mismatched dictionaries fail at once), records the student's shape
when the model is built so distillation criterions can size their modules, and tells the
criterion when an epoch begins (epoch-dependent weights and schedules are pure functions of the
epoch, so a resumed run continues with the same values).
"""

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


@register_task("translation_kd", dataclass=TranslationKDConfig)
class TranslationKDTask(TranslationTask):
    cfg: TranslationKDConfig

    def __init__(self, cfg: TranslationKDConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self.teacher: Optional[FrozenTeacher] = None
        self.student_shape: Optional[TransformerShape] = None
        self.student_shape_error: Optional[str] = None
        self.kd_criterion = None
        if cfg.teacher_checkpoint:
            self.teacher = FrozenTeacher.load(cfg.teacher_checkpoint, self)

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
        from ..criterions.base import KDCriterionBase

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
    def get_checkpoint_dict(self):
        if self.kd_criterion is None:
            return {}
        return {type(self).__name__: {"criterion": self.kd_criterion.checkpoint_state()}}

    def set_checkpoint_dict(self, state):
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

