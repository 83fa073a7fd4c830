"""The ``translation_kd`` task: fairseq's translation task plus a frozen teacher.

The teacher of ``--teacher-checkpoint`` is loaded at start-up, before any data or model work; the
student's shape is recorded when the model is built, and the criterion is told when an epoch
begins. Every checkpoint records the teacher binding, which metric selected ``checkpoint_best.pt``
and the criterion's state; :mod:`fairseq_kd.checkpoints` checks all three on resume.
"""

from dataclasses import dataclass, field
from typing import Optional

from fairseq.tasks import register_task
from omegaconf import II
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from .. import checkpoints
from ..errors import InputError
from ..models.feature_capture import NotATransformerError
from ..models.shape import TransformerShape
from ..models.teacher import FrozenTeacher
from ..models.teachers import load_teacher


@dataclass
class TranslationKDConfig(TranslationConfig):
    teacher_checkpoint: Optional[str] = field(
        default=None,
        metadata={
            "help": "path of the teacher: any fairseq Transformer translation checkpoint trained on "
            "the same source/target dictionaries, or a Hugging Face save_pretrained folder (MarianMT, "
            "M2M100, NLLB; every criterion; data binarised by fairseq-kd-hf-data). Required by "
            "every distillation criterion; without it the task behaves like 'translation'."
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
    teacher_cache: Optional[str] = field(
        default=None,
        metadata={
            "help": "folder written by fairseq-kd-teacher-cache: word_kd and selective_kd read the "
            "teacher's top-k log-probabilities of every training token from it instead of running the "
            "teacher (exact where the teacher's mass lies within its top k). Refused if made by another "
            "teacher (--teacher-checkpoint, when given too), for other training data or dictionaries. "
            "Validation then reports CE and nll without KD terms."
        },
    )
    # the precision and device flags, read to refuse half precision where it would not run as asked
    fp16: bool = II("common.fp16")
    bf16: bool = II("common.bf16")
    cpu: bool = II("common.cpu")


@register_task("translation_kd", dataclass=TranslationKDConfig)
class TranslationKDTask(TranslationTask):
    cfg: TranslationKDConfig
    #: fairseq's load_checkpoint checks best-checkpoint selection and criterion state for this task
    checkpoint_guard = True

    def __init__(self, cfg: TranslationKDConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self.teacher: Optional[FrozenTeacher] = None
        self.student_shape: Optional[TransformerShape] = None
        self.student_shape_error: Optional[str] = None
        self.kd_criterion = None
        self.teacher_changes = []  # earlier bindings replaced with --allow-teacher-change
        self.best_selection: Optional[dict] = None  # what selects checkpoint_best.pt in this run
        self.resumed_selection: Optional[dict] = None  # ... and in the run resumed
        check_precision_device(cfg)
        if cfg.teacher_checkpoint:
            self.teacher = load_teacher(cfg.teacher_checkpoint, self)
            self.check_teacher_positions()
        self.teacher_cache = None
        if cfg.teacher_cache:
            from ..data.teacher_cache_reader import TeacherCache

            self.teacher_cache = TeacherCache.open(
                cfg.teacher_cache, self, teacher_sha256=self.teacher.sha256 if self.teacher is not None else None)

    def check_teacher_positions(self) -> None:
        """The teacher must read every sentence the task lets through."""
        teacher_source, teacher_target = self.teacher.model.max_positions()
        for side, flag, task_limit, teacher_limit in (
            ("source", "--max-source-positions", self.cfg.max_source_positions, teacher_source),
            ("target", "--max-target-positions", self.cfg.max_target_positions, teacher_target),
        ):
            if teacher_limit is not None and task_limit is not None and teacher_limit < task_limit:
                raise InputError(
                    f"--teacher-checkpoint {self.cfg.teacher_checkpoint!r} reads at most {teacher_limit} "
                    f"{side} positions, but the task allows {side} sentences of up to {task_limit} tokens "
                    f"({flag} {task_limit}). Pass {flag} {teacher_limit} (longer training sentences are "
                    "then skipped) or use a teacher trained with longer positions."
                )

    def run_binding(self) -> dict:
        """What this run distils from, as recorded in every checkpoint it writes."""
        if self.teacher is not None:
            teacher_sha256, teacher_path = self.teacher.sha256, self.teacher.path
        elif self.teacher_cache is not None:  # distilled from the teacher the cache records
            teacher_sha256, teacher_path = self.teacher_cache.teacher_sha256, self.teacher_cache.manifest.get("teacher_path")
        else:
            teacher_sha256 = teacher_path = None
        return checkpoints.run_binding(teacher_sha256, teacher_path, self.source_dictionary,
                                       self.target_dictionary, self.teacher_changes)

    def check_resumed_binding(self, recorded: Optional[dict]) -> None:
        """Refuse to resume a checkpoint trained with another teacher or other dictionaries."""
        changes = checkpoints.check_resumed_binding(recorded, self.run_binding(), self.cfg.allow_teacher_change)
        if changes is not None:
            self.teacher_changes = changes

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        try:
            self.student_shape = TransformerShape.from_model(model)
            self.student_shape_error = None
        except NotATransformerError as err:  # feature-based criterions say so when they are built
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

    def get_batch_iterator(self, dataset, *args, epoch=1, **kwargs):
        # fairseq after 0.12.2 (fairseq-fixed) breaks length ties with seed + the epoch the iterator
        # is built in: epoch 1 in a run, reused after, but epoch k in a run resumed at epoch k, so
        # that run trained on other batches. Building it as at epoch 1 gives it the run's batches.
        fresh = (epoch > 1 and self.can_reuse_epoch_itr(dataset) and dataset not in self.dataset_to_epoch_iter
                 and not kwargs.get("disable_iterator_cache") and not kwargs.get("update_epoch_batch_itr")
                 and not getattr(self.cfg, "rebuild_batches", False))
        iterator = super().get_batch_iterator(dataset, *args, epoch=1 if fresh else epoch, **kwargs)
        if fresh:
            iterator.epoch = epoch
            dataset.set_epoch(epoch)
        return iterator

    def begin_epoch(self, epoch, model):
        super().begin_epoch(epoch, model)
        if self.kd_criterion is not None:
            self.kd_criterion.begin_epoch(epoch)

    def reduce_metrics(self, logging_outputs, criterion):
        # fairseq's criterion hook is a classmethod; the instance sees the pooled outputs here.
        super().reduce_metrics(logging_outputs, criterion)
        if self.kd_criterion is not None:
            self.kd_criterion.reduce_worker_logs(logging_outputs)

    # fairseq keeps this dict in the checkpoint's extra_state and hands it back on resume: the binding,
    # and criterion state that is not a parameter (the trainer saves the criterion's state_dict only
    # when it has parameters)
    def get_checkpoint_dict(self):
        state = {"binding": self.run_binding()}
        if self.best_selection is not None:
            state["best_selection"] = dict(self.best_selection)
        if self.kd_criterion is not None:
            state["criterion"] = self.kd_criterion.checkpoint_state()
        return {type(self).__name__: state}

    def set_checkpoint_dict(self, state):
        self.check_resumed_binding(state.get("binding"))
        if state.get("best_selection"):
            self.resumed_selection = dict(state["best_selection"])
        if self.kd_criterion is not None and "criterion" in state:
            self.kd_criterion.load_checkpoint_state(state["criterion"])

    def require_teacher(self, criterion_name: str) -> FrozenTeacher:
        from fairseq.criterions import CRITERION_REGISTRY

        if self.teacher is None:
            raise InputError(
                f"criterion {criterion_name!r} distils from a teacher: pass --teacher-checkpoint PATH "
                "(a trained fairseq Transformer translation checkpoint)."
            )
        # word_kd and selective_kd read only the teacher's output distribution
        reads_output_only = getattr(CRITERION_REGISTRY.get(criterion_name), "reads_output_only", lambda: False)
        if self.teacher.shape is None and not reads_output_only():
            raise InputError(
                f"criterion {criterion_name!r} distils the teacher's attention maps or hidden states, which the "
                f"Hugging Face teacher --teacher-checkpoint {self.teacher.path!r} cannot provide "
                f"({self.teacher.feature_problem}): use --criterion word_kd or selective_kd with it, or a "
                "Marian, M2M100 or NLLB teacher."
            )
        return self.teacher

    def require_student_shape(self, criterion_name: str) -> TransformerShape:
        if self.student_shape is None:
            reason = f" ({self.student_shape_error})" if self.student_shape_error else ""
            raise InputError(
                f"criterion {criterion_name!r} needs an encoder-decoder Transformer student "
                "(a --arch of fairseq's transformer family with at least one encoder and one decoder "
                f"layer, see --encoder-layers / --decoder-layers); the model built has another layout{reason}."
            )
        return self.student_shape


# --------------------------------------------------------------------------- precision and device
def _flag_value(cfg, name: str) -> bool:
    try:
        return getattr(cfg, name, False) is True
    except Exception:  # noqa: BLE001 - an unresolved interpolation (a config built by hand): unset
        return False


def check_precision_device(cfg) -> None:
    """Refuse half precision where it would not run as asked: ``--fp16`` on the CPU, and ``--bf16``
    without ``--cpu`` on a machine without CUDA (``--bf16 --cpu`` trains in bfloat16 on the CPU)."""
    import torch

    if _flag_value(cfg, "fp16") and _flag_value(cfg, "cpu"):
        raise InputError("--fp16 with --cpu: float16 training needs a GPU; drop --fp16 to train on the CPU in "
                         "float32, or use --bf16 to train in bfloat16 on the CPU.")
    if _flag_value(cfg, "cpu") or torch.cuda.is_available():
        return
    for flag in ("fp16", "bf16"):
        if _flag_value(cfg, flag):
            cpu_alternative = ("pass --cpu to train in bfloat16 on the CPU" if flag == "bf16" else
                               "drop --fp16 and pass --cpu to train in float32 on the CPU")
            raise InputError(f"--{flag}: this machine has no GPU that torch can use (torch.cuda.is_available() "
                             f"is False), so training would run on the CPU; {cpu_alternative}, or run on a "
                             "machine with a GPU.")
