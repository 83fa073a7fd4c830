"""What a resumed ``translation_kd`` run is checked against, in the checkpoint it resumes from:
the teacher binding (:func:`run_binding`, :func:`check_resumed_binding`), the metric that selected
``checkpoint_best.pt`` and the criterion's parameters (:func:`check_criterion_state_fits`).
:func:`install` (made by :func:`fairseq_kd.fairseq_patches.install`) wraps fairseq's
``checkpoint_utils.load_checkpoint`` for the tasks that set ``checkpoint_guard = True``. Why:
``docs/design/checkpoints.md``.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

from ..errors import InputError
from ..fingerprint import dictionary_sha256
from .safe_loading import weights_only_load

logger = logging.getLogger(__name__)

#: the key of ``extra_state`` under which fairseq keeps a ``translation_kd`` task's checkpoint
#: dict (the task's class name)
TASK_STATE_KEY = "TranslationKDTask"
BINDING_FORMAT = "fairseq-kd-binding/1"


class ResumeMismatchError(InputError):
    """A checkpoint is resumed with another teacher, other dictionaries, another best-checkpoint
    metric or another criterion than it was trained with."""


def install() -> None:
    """Wrap ``checkpoint_utils.load_checkpoint`` for the tasks whose class sets
    ``checkpoint_guard = True``. Idempotent."""
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_checkpoint
    if getattr(original, "_fairseq_kd_guard", False):
        return

    @functools.wraps(original)
    def load_checkpoint(cfg, trainer, **kwargs):
        if getattr(getattr(trainer, "task", None), "checkpoint_guard", False):
            return _guarded_load_checkpoint(original, cfg, trainer, **kwargs)
        return original(cfg, trainer, **kwargs)

    load_checkpoint._fairseq_kd_guard = True
    # fairseq_cli.train calls checkpoint_utils.load_checkpoint by attribute at call time
    checkpoint_utils.load_checkpoint = load_checkpoint


def task_state(state: dict) -> dict:
    """What a ``translation_kd`` run keeps in a checkpoint (``extra_state[TASK_STATE_KEY]``:
    ``binding``, ``best_selection``, ``criterion``); empty for a checkpoint of another task."""
    return _get(_get(state, "extra_state"), TASK_STATE_KEY) or {}


# --------------------------------------------------------------------------- the teacher binding
def _short(sha: Optional[str]) -> str:
    return "none" if sha is None else sha[:12]


def run_binding(teacher_sha256: Optional[str], teacher_path: Optional[str], source_dictionary, target_dictionary,
                teacher_changes: list) -> dict:
    """What a run distils from, as recorded in every checkpoint it writes."""
    return {"format": BINDING_FORMAT, "teacher_sha256": teacher_sha256, "teacher_path": teacher_path,
            "source_dictionary_sha256": dictionary_sha256(source_dictionary),
            "target_dictionary_sha256": dictionary_sha256(target_dictionary),
            "dictionary_sizes": [len(source_dictionary), len(target_dictionary)],
            "teacher_changes": list(teacher_changes)}


def check_resumed_binding(recorded: Optional[dict], current: dict, allow_teacher_change: bool) -> Optional[list]:
    """Refuse to resume a checkpoint (binding ``recorded``) trained with another teacher or other
    dictionaries than this run's binding ``current``. Returns the teacher changes the resumed run
    carries on (with the change made now under ``allow_teacher_change``), or None when the
    checkpoint records no binding."""
    if not recorded:
        logger.warning("the checkpoint being resumed records no teacher or dictionaries (written before "
                       "fairseq-kd recorded them); the teacher cannot be verified")
        return None
    for side in ("source", "target"):
        key = f"{side}_dictionary_sha256"
        if recorded.get(key) != current[key]:
            raise ResumeMismatchError(
                f"resume refused: the data's {side} dictionary (sha256 {_short(current[key])}, "
                f"{current['dictionary_sizes'][side == 'target']} symbols) is not the one the checkpoint "
                f"was trained with (sha256 {_short(recorded.get(key))}, "
                f"{(recorded.get('dictionary_sizes') or ['?', '?'])[side == 'target']} symbols): the "
                "student's embeddings index the old symbols. Resume with the original data folder "
                "or start a new run (another --save-dir).")
    if recorded.get("teacher_sha256") == current["teacher_sha256"]:
        return list(recorded.get("teacher_changes") or [])
    was = (f"{recorded.get('teacher_path')!r} (sha256 {_short(recorded.get('teacher_sha256'))})"
           if recorded.get("teacher_sha256") else "no teacher")
    now = (f"{current['teacher_path']!r} (sha256 {_short(current['teacher_sha256'])})"
           if current["teacher_sha256"] else "no teacher")
    if not allow_teacher_change:
        raise ResumeMismatchError(
            f"resume refused: the checkpoint was trained with teacher {was}, but this run's "
            f"--teacher-checkpoint is {now}; continuing would mix two teachers in one run. Pass "
            "the original teacher, start a new run (another --save-dir), or pass "
            "--allow-teacher-change to switch teachers on purpose.")
    logger.warning(f"--allow-teacher-change: resuming a run trained with teacher {was} with teacher {now}")
    return list(recorded.get("teacher_changes") or []) + [
        {"teacher_sha256": recorded.get("teacher_sha256"), "teacher_path": recorded.get("teacher_path")}]


# --------------------------------------------------------------------------- best checkpoint and resume
# Validation metrics that mean the same whatever the training criterion (the plain NLL of the
# references, its perplexity, BLEU); ``loss`` and the criterion's own terms do not.
CRITERION_INDEPENDENT_METRICS = frozenset({"nll_loss", "ppl", "bleu"})


def _get(container, key, default=None):
    if container is None:
        return default
    try:
        return container.get(key, default)
    except (AttributeError, TypeError):  # a Namespace (no get), or another get
        return getattr(container, key, default)


def selection_of(checkpoint_cfg, criterion_name) -> dict:
    return {"metric": str(_get(checkpoint_cfg, "best_checkpoint_metric", "loss")),
            "maximize": bool(_get(checkpoint_cfg, "maximize_best_checkpoint_metric", False)),
            "criterion": str(criterion_name) if criterion_name else None}


def recorded_selection(state: dict) -> Optional[dict]:
    """What selected a checkpoint as best: the task's record, else the saved run's config."""
    recorded = _get(task_state(state), "best_selection")
    if recorded:
        return dict(recorded)
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
    try:
        return weights_only_load(path, map_location="cpu", mmap=True)
    except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
        return weights_only_load(path, map_location="cpu")


def _option_differences(saved_cfg, current_cfg) -> list:
    """``--flag: X in the checkpoint, Y in this run`` for every criterion option that differs."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    saved = dict(saved_cfg or {})
    try:
        current = (OmegaConf.to_container(current_cfg, resolve=True, enum_to_str=True)
                   if OmegaConf.is_config(current_cfg) else dict(current_cfg or {}))
        if OmegaConf.is_config(saved_cfg):
            saved = OmegaConf.to_container(saved_cfg, resolve=True, enum_to_str=True)
    except OmegaConfBaseException:  # a ${...} that does not resolve in a config saved apart from its root
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
        "(another --save-dir).")


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
                "nll_loss).")

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
