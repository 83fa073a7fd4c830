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

import functools
import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

from fairseq.tasks import register_task
from omegaconf import II
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
    # the precision and device flags, read to refuse --fp16/--bf16 on a machine without a GPU
    fp16: bool = II("common.fp16")
    bf16: bool = II("common.bf16")
    cpu: bool = II("common.cpu")


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
        self.best_selection: Optional[dict] = None  # what selects checkpoint_best.pt in this run
        self.resumed_selection: Optional[dict] = None  # ... and in the run resumed
        check_precision_device(cfg)
        if cfg.teacher_checkpoint:
            self.teacher = FrozenTeacher.load(cfg.teacher_checkpoint, self)
            self.check_teacher_positions()
        self.teacher_cache = None
        if cfg.teacher_cache:
            from ..data.teacher_cache import TeacherCache

            self.teacher_cache = TeacherCache.open(
                cfg.teacher_cache, self, teacher_sha256=self.teacher.sha256 if self.teacher is not None else None)

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
        if self.teacher is not None:
            teacher_sha256, teacher_path = self.teacher.sha256, self.teacher.path
        elif self.teacher_cache is not None:  # distilled from the teacher the cache records
            teacher_sha256, teacher_path = self.teacher_cache.teacher_sha256, self.teacher_cache.manifest.get("teacher_path")
        else:
            teacher_sha256 = teacher_path = None
        return {
            "format": BINDING_FORMAT,
            "teacher_sha256": teacher_sha256,
            "teacher_path": teacher_path,
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

    def reduce_metrics(self, logging_outputs, criterion):
        # fairseq's criterion hook is a classmethod; the instance sees the pooled outputs here.
        super().reduce_metrics(logging_outputs, criterion)
        if self.kd_criterion is not None:
            self.kd_criterion.reduce_worker_logs(logging_outputs)

    # fairseq persists this dict in the checkpoint's extra_state under the task's class name and
    # hands it back on resume (checkpoint_utils.save_checkpoint / load_checkpoint). Criterion state
    # that is not a parameter (e.g. selective KD's queue) travels this way, because the trainer
    # saves the criterion's state_dict only when the criterion has parameters.
    # The run's binding (teacher and dictionary hashes) travels the same way and is checked first.
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



# --------------------------------------------------------------------------- precision and device
def _flag_value(cfg, name: str) -> bool:
    try:
        return getattr(cfg, name, False) is True
    except Exception:  # noqa: BLE001 - an unresolved interpolation (a config built by hand): unset
        return False


def check_precision_device(cfg) -> None:
    """``--fp16`` / ``--bf16`` train in half precision on a GPU; refuse them where training would
    run on the CPU (``--cpu``, or no CUDA device), before the teacher or any data is loaded."""
    import torch

    for flag in ("fp16", "bf16"):
        if not _flag_value(cfg, flag):
            continue
        if _flag_value(cfg, "cpu"):
            raise ValueError(f"--{flag} with --cpu: half-precision training needs a GPU; drop --{flag} "
                             "to train on the CPU in float32.")
        if not torch.cuda.is_available():
            raise ValueError(f"--{flag}: this machine has no GPU that torch can use (torch.cuda.is_available() "
                             f"is False), so training would run on the CPU; drop --{flag} and pass --cpu to "
                             "train in float32 on the CPU, or run on a machine with a GPU.")


# --------------------------------------------------------------------------- best checkpoint and resume
# Validation metrics that mean the same whatever the training criterion (the plain NLL of the
# references, its perplexity, BLEU); ``loss`` and the criterion's own terms do not.
CRITERION_INDEPENDENT_METRICS = frozenset({"nll_loss", "ppl", "bleu"})


def _get(container, key, default=None):
    if container is None:
        return default
    if isinstance(container, dict):
        return container.get(key, default)
    try:
        return container.get(key, default)
    except Exception:  # noqa: BLE001
        return getattr(container, key, default)


def selection_of(checkpoint_cfg, criterion_name) -> dict:
    return {
        "metric": str(_get(checkpoint_cfg, "best_checkpoint_metric", "loss")),
        "maximize": bool(_get(checkpoint_cfg, "maximize_best_checkpoint_metric", False)),
        "criterion": str(criterion_name) if criterion_name else None,
    }


def recorded_selection(state: dict) -> Optional[dict]:
    """What selected a checkpoint as best: the task's record, else the saved run's config."""
    task_state = _get(_get(state, "extra_state"), TranslationKDTask.__name__)
    if _get(task_state, "best_selection"):
        return dict(task_state["best_selection"])
    cfg = _get(state, "cfg")
    if cfg is None:
        return None
    return selection_of(_get(cfg, "checkpoint"), _get(_get(cfg, "criterion"), "_name"))


def same_selection(a: dict, b: dict) -> bool:
    if a["metric"] != b["metric"] or bool(a["maximize"]) != bool(b["maximize"]):
        return False
    return a["metric"] in CRITERION_INDEPENDENT_METRICS or a.get("criterion") == b.get("criterion")


def describe_selection(selection: dict) -> str:
    order = "higher" if selection["maximize"] else "lower"
    tied = ("" if selection["metric"] in CRITERION_INDEPENDENT_METRICS
            else f" of criterion {selection.get('criterion')}")
    return f"valid {selection['metric']}{tied} ({order} is better)"


def _peek(path: str) -> dict:
    """A checkpoint's contents without reading its tensors into memory (data only)."""
    from ..checkpoint_safety import weights_only_load

    try:
        return weights_only_load(path, map_location="cpu", mmap=True)
    except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
        return weights_only_load(path, map_location="cpu")


def _option_differences(saved_cfg, current_cfg) -> list:
    """``--flag: X in the checkpoint, Y in this run`` for every criterion option that differs."""
    saved = {k: v for k, v in dict(saved_cfg or {}).items()}
    try:
        from omegaconf import OmegaConf

        current = OmegaConf.to_container(current_cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(current_cfg) else dict(current_cfg or {})
        if OmegaConf.is_config(saved_cfg):
            saved = OmegaConf.to_container(saved_cfg, resolve=True, enum_to_str=True)
    except Exception:  # noqa: BLE001
        current = dict(current_cfg or {})
    differences = []
    if saved.get("_name") != current.get("_name"):
        differences.append(f"--criterion: {saved.get('_name')!r} in the checkpoint, {current.get('_name')!r} in this run")
    for key in sorted(set(saved) | set(current)):
        if key.startswith("_") or key in ("seed",) or key not in saved or key not in current:
            continue
        if str(saved[key]) != str(current[key]):
            differences.append(f"--{key.replace('_', '-')}: {saved[key]!r} in the checkpoint, {current[key]!r} in this run")
    return differences


def check_criterion_state_fits(state: dict, criterion, current_criterion_cfg, path: str) -> None:
    """Refuse, naming the criterion options that differ, a checkpoint whose criterion parameters
    (e.g. A2D's alignment modules) do not fit this run's criterion; fairseq would otherwise stop
    with its generic 'please ensure that the architectures match'."""
    from fairseq import utils

    if not utils.has_parameters(criterion):
        return
    current = criterion.state_dict()
    saved = state.get("criterion")
    problems = []
    if not saved:
        problems.append("the checkpoint holds no criterion parameters")
    else:
        missing = sorted(set(current) - set(saved))
        unexpected = sorted(set(saved) - set(current))
        if missing:
            problems.append(f"this run's criterion has {', '.join(missing)} that the checkpoint lacks")
        if unexpected:
            problems.append(f"the checkpoint has {', '.join(unexpected)} that this run's criterion lacks")
        for key in sorted(set(current) & set(saved)):
            mine, theirs = current[key], saved[key]
            if hasattr(mine, "shape") and hasattr(theirs, "shape"):
                if tuple(mine.shape) != tuple(theirs.shape):
                    problems.append(f"{key} is {tuple(theirs.shape)} in the checkpoint, {tuple(mine.shape)} in this run")
            elif key.endswith("_extra_state") and mine != theirs:
                problems.append(f"{key} is {theirs} in the checkpoint, {mine} in this run")
    if not problems:
        return
    differences = _option_differences(_get(_get(state, "cfg"), "criterion"), current_criterion_cfg)
    # A criterion can name the cause itself (e.g. an option whose default changed, absent from an
    # older checkpoint's config, so that the comparison above cannot see it).
    hint = getattr(criterion, "checkpoint_state_hint", lambda saved_state: None)(saved or {})
    options = (hint if hint else
               "the criterion options that differ: " + "; ".join(differences) if differences else
               "no criterion option differs, so the student architecture or the teacher does")
    raise ResumeMismatchError(
        f"resume refused: the criterion state in {path} does not fit this run's criterion "
        f"({'; '.join(problems)}); {options}. Resume with the checkpoint's options, or start a new run "
        "(another --save-dir)."
    )


def _guarded_load_checkpoint(original, cfg, trainer, **kwargs):
    """fairseq's ``checkpoint_utils.load_checkpoint`` for a ``translation_kd`` run: says which
    metric selects checkpoint_best.pt, refuses to replace a best checkpoint chosen on another
    metric, checks the criterion state before fairseq loads it, and never compares the best-so-far
    of another metric."""
    from fairseq import checkpoint_utils

    task = trainer.task
    criterion_cfg = trainer.cfg.criterion
    selection = selection_of(cfg, _get(criterion_cfg, "_name"))
    task.best_selection = selection
    writes_best = not (cfg.no_save or getattr(cfg, "no_best_checkpoints", False)
                       or trainer.cfg.dataset.disable_validation)
    best_path = os.path.join(cfg.save_dir, f"checkpoint_best{getattr(trainer, 'checkpoint_suffix', '')}.pt")
    if writes_best:
        logger.info(f"checkpoint_best.pt is selected by {describe_selection(selection)} "
                    "(--best-checkpoint-metric, --maximize-best-checkpoint-metric)")
    else:
        logger.info("no checkpoint_best.pt is written (validation or saving is off)")
    best_file_selection, best_file_value = None, None
    if writes_best and os.path.isfile(best_path):
        peeked = _peek(best_path)
        best_file_selection = recorded_selection(peeked)
        best_file_value = _get(_get(peeked, "extra_state"), "best")
        del peeked
        if best_file_selection is not None and not same_selection(best_file_selection, selection):
            raise ResumeMismatchError(
                f"{best_path} was selected by {describe_selection(best_file_selection)}, but this run "
                f"selects by {describe_selection(selection)}: the values are not comparable and the old "
                f"best would be overwritten. Keep it under another name first (mv {best_path} "
                f"{best_path[:-3]}.{best_file_selection.get('criterion')}-{best_file_selection['metric']}.pt), "
                "use another --save-dir, or select by a metric both runs share (--best-checkpoint-metric "
                "nll_loss)."
            )

    real_loader = checkpoint_utils.load_checkpoint_to_cpu
    fallback = {}

    def loader_checking_criterion_state(path, *args, **kw):
        state = real_loader(path, *args, **kw)
        check_criterion_state_fits(state, trainer.get_criterion(), criterion_cfg, path)
        fallback["selection"] = recorded_selection(state)
        return state

    task.resumed_selection = None
    checkpoint_utils.load_checkpoint_to_cpu = loader_checking_criterion_state
    try:
        result = original(cfg, trainer, **kwargs)
    finally:
        checkpoint_utils.load_checkpoint_to_cpu = real_loader
    resumed = task.resumed_selection or fallback.get("selection")
    save = checkpoint_utils.save_checkpoint
    if resumed is not None and not same_selection(resumed, selection) and hasattr(save, "best"):
        logger.warning(f"the resumed run selected its best checkpoint by {describe_selection(resumed)}; "
                       f"its best-so-far ({save.best}) is dropped: this run compares {describe_selection(selection)}")
        del save.best
    if (not hasattr(save, "best") and best_file_value is not None and best_file_selection is not None
            and same_selection(best_file_selection, selection)):
        save.best = best_file_value
        logger.info(f"{best_path} (valid {selection['metric']} {best_file_value}) is replaced only by a better one")
    return result


def _install_load_checkpoint_guard() -> None:
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_checkpoint
    if getattr(original, "_fairseq_kd_guard", False):
        return

    @functools.wraps(original)
    def load_checkpoint(cfg, trainer, **kwargs):
        if isinstance(getattr(trainer, "task", None), TranslationKDTask):
            return _guarded_load_checkpoint(original, cfg, trainer, **kwargs)
        return original(cfg, trainer, **kwargs)

    load_checkpoint._fairseq_kd_guard = True
    # fairseq_cli.train calls checkpoint_utils.load_checkpoint by attribute at call time
    checkpoint_utils.load_checkpoint = load_checkpoint


_install_load_checkpoint_guard()
