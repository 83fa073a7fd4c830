"""Run a recipe's plan: each step's command lines into its log file, every step through the
step runner of :mod:`.prepare.pipeline`, which stamps it with the fingerprints of its inputs and
outputs and its settings: re-running the recipe skips every finished step, and a changed input
re-runs exactly what depends on it.

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import shlex
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from fairseq_kd.errors import UserError
from fairseq_kd.figures.training_log import parse_fairseq_log
from fairseq_kd.fingerprint import content, fingerprint, read_json
from fairseq_kd.progress import child_progress, progress_bar

from .prepare.errors import PrepareError
from .prepare.pipeline import Step, StepRunner

if TYPE_CHECKING:
    from .plan import RecipePlan, RecipeStep

MANIFEST_NAME = "recipe.json"
#: the results tables (Markdown) of the last run, one file name a line, in report/
TABLES_NAME = "tables.txt"
TRAIN_RECORD_NAME = "recipe_train.json"
#: version of recipe_train.json: a record of another format is one that does not match
TRAIN_RECORD_FORMAT = 2
MANIFEST_FORMAT = 1
#: this project's commands that run inside the recipe's process (CPU-only, no model run)
IN_PROCESS_MODULES = frozenset({
    "fairseq_kd.cli.export_student", "fairseq_kd.cli.score", "fairseq_kd.cli.report",
    "fairseq_kd.cli.plot", "fairseq_kd.cli.hf_data",
})


class RecipeError(UserError):
    """Bad input or a failed step; the message says what and what to do."""


@dataclass
class RecipeResult:
    executed: list[str]
    skipped: list[str]
    #: the results tables, the main one first
    report_markdowns: list[Path]


# ----------------------------------------------------------------------------- commands


def console_script(name: str, module: str) -> list[str]:
    """fairseq's console script next to the running interpreter, else ``python -m module``."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.is_file() else [sys.executable, "-m", module]


def python_module(module: str) -> list[str]:
    return [sys.executable, "-m", module]


class CommandExecutor:
    """Runs one command line, appending its output to a log file; raises RecipeError on failure.
    :data:`IN_PROCESS_MODULES` run through their ``cli_main`` in this process."""

    def __call__(self, command: Sequence[str], log_path: Path) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"$ {shlex.join(command)}\n")
            log.flush()
            if len(command) > 2 and list(command[:2]) == [sys.executable, "-m"] and command[2] in IN_PROCESS_MODULES:
                status = self._run_module(command[2], list(command[3:]), log)
            else:
                status = self._run_child(list(command), log, log_path.stem)
        if status != 0:
            raise RecipeError(
                f"command failed with exit status {status}: {shlex.join(command)}\n"
                f"--- last lines of {log_path} ---\n{tail(log_path)}"
            )

    @staticmethod
    def _run_child(command: list[str], log, step: str) -> int:
        """The child's output into ``log``; on a terminal, its bars on it, and a training step's
        updates read from its output into a bar of ours."""
        with child_progress() as (env, terminal):
            training = TrainingProgress.of(command, step) if terminal else None
            if training is None:
                return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      pass_fds=terminal).returncode
            with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                  pass_fds=terminal, text=True, encoding="utf-8", errors="replace") as child, training:
                for line in child.stdout:
                    log.write(line)
                    log.flush()
                    training.feed(line)
                return child.wait()

    @staticmethod
    def _run_module(module: str, argv: list[str], log) -> int:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), logging_into(log):
            try:
                status = importlib.import_module(module).cli_main(argv)
            except SystemExit as exit_:
                status = exit_.code
            except Exception:  # noqa: BLE001  (reported like a failing child process)
                traceback.print_exc(file=log)
                status = 1
        if status is None:
            return 0
        return status if isinstance(status, int) else 1


@contextlib.contextmanager
def logging_into(log):
    """Every INFO (and higher) log record of an in-process command into its step's log instead of
    the root logger's handlers; the plugin's own progress loggers keep theirs (the terminal) too."""
    handler = logging.StreamHandler(log)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s"))
    root = logging.getLogger()
    own = [logger for logger in (logging.getLogger(name) for name in ("fairseq_kd", "fairseq_kd_recipes"))
           if logger.handlers and not logger.propagate]
    set_aside, root.handlers = root.handlers, [handler]
    for logger in own:
        logger.addHandler(handler)
    try:
        yield
    finally:
        root.handlers = set_aside
        for logger in own:
            logger.removeHandler(handler)


def _flag_value(command: Sequence[str], flag: str) -> Optional[str]:
    """The value of ``flag`` in a command line (its last occurrence, as argparse takes it)."""
    values = [command[i + 1] for i, item in enumerate(command[:-1]) if item == flag]
    return values[-1] if values else None


class TrainingProgress:
    """A bar of a fairseq-train child's updates (of ``--max-update``, or of those ``--max-epoch``
    takes, estimated), its epoch, training loss and validation nll, read from its statistics lines."""

    def __init__(self, desc: str, max_update: Optional[int], max_epoch: Optional[int]) -> None:
        self.desc, self.max_update, self.max_epoch = desc, max_update, max_epoch
        self.bar = None
        self.shown: dict[str, str] = {}

    @classmethod
    def of(cls, command: Sequence[str], desc: str) -> Optional["TrainingProgress"]:
        """The bar of ``command`` if it is a fairseq-train run, else None."""
        trains = Path(command[0]).name == "fairseq-train" or list(command[1:3]) == ["-m", "fairseq_cli.train"]
        if not trains:
            return None
        limits = [_flag_value(command, flag) for flag in ("--max-update", "--max-epoch")]
        max_update, max_epoch = (int(value) if value and value.isdigit() and int(value) > 0 else None
                                 for value in limits)
        return cls(desc, max_update, max_epoch)

    def total(self, updates: float, epochs_done: Optional[float]) -> Optional[int]:
        estimate = None
        if self.max_epoch and epochs_done:
            estimate = round(updates * self.max_epoch / epochs_done)
        candidates = [value for value in (self.max_update, estimate) if value]
        return min(candidates) if candidates else None

    def feed(self, line: str) -> None:
        for record in parse_fairseq_log([line]):
            if record.split == "train_inner" and record.num_updates is not None:
                self._advance(record)
            elif record.split not in ("train", "train_inner") and "nll_loss" in record.values:
                self.shown[f"{record.split}_nll"] = f"{record.values['nll_loss']:.3f}"
                self._show()

    def _advance(self, record) -> None:
        updates = int(record.num_updates)
        total = self.total(record.num_updates, record.epochs_done)
        if self.bar is None:
            self.bar = progress_bar(total=total, desc=self.desc, unit="upd", initial=updates)
        else:
            self.bar.total = total if total is not None else self.bar.total
            self.bar.update(updates - self.bar.n)
        if record.epoch is not None:
            self.shown["epoch"] = str(record.epoch)
        if "loss" in record.values:
            self.shown["loss"] = f"{record.values['loss']:.3f}"
        self._show()

    def _show(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(", ".join(f"{key} {value}" for key, value in self.shown.items()))

    def __enter__(self) -> "TrainingProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text[-lines:])


# ----------------------------------------------------------------------------- checkpoints


def training_record(settings: Mapping, inputs: Sequence[Path], previous: Optional[Mapping] = None) -> dict:
    """What identifies one training run: its settings and its inputs' fingerprints (the scheme of
    every resumable step, :mod:`fairseq_kd.fingerprint`; None for an input not there yet). A
    ``previous`` record of this format spares re-hashing files whose size and time are unchanged."""
    recorded = previous.get("inputs") or {} if previous and previous.get("format") == TRAIN_RECORD_FORMAT else {}
    return {"format": TRAIN_RECORD_FORMAT, "settings": json.loads(json.dumps(dict(settings))),
            "inputs": {str(path): fingerprint(Path(path), recorded.get(str(path))) if Path(path).exists() else None
                       for path in inputs}}


def same_training(previous: Mapping, record: Mapping) -> bool:
    """Whether ``previous`` (a save folder's record) describes the training ``record`` describes:
    the same format and settings, and inputs of the same content."""
    if (previous.get("format"), previous.get("settings")) != (TRAIN_RECORD_FORMAT, record["settings"]):
        return False

    def inputs(record: Mapping) -> dict:
        return {path: None if recorded is None else content(recorded) for path, recorded in record["inputs"].items()}

    return inputs(previous) == inputs(record)


def checkpoints_in(save_dir: Path) -> list[str]:
    return sorted(path.name for path in save_dir.glob("checkpoint*.pt")) if save_dir.is_dir() else []


def check_checkpoint_folder(save_dir: Path, settings: Mapping, inputs: Sequence[Path]) -> dict:
    """The record to write into ``save_dir`` before training; refuses a save folder whose
    checkpoints come from another training run (docs/design/recipes.md, ``execute.py``)."""
    previous = read_json(save_dir / TRAIN_RECORD_NAME)
    record = training_record(settings, inputs, previous)
    checkpoints = checkpoints_in(save_dir)
    if not checkpoints or (previous is not None and same_training(previous, record)):
        return record  # nothing to protect, or an interrupted run of this very training: fairseq resumes it
    why = ("no record of how they were trained" if previous is None else
           "they were trained with other settings" if previous.get("settings") != record["settings"] else
           "their inputs (corpus or teacher) have changed since")
    raise RecipeError(
        f"{save_dir} holds checkpoints ({', '.join(checkpoints)}) that this recipe would have to replace: {why}. "
        "The recipe never overwrites a checkpoint: move or delete that folder (and the steps that used it "
        "re-run), or choose another --workdir"
    )


# ----------------------------------------------------------------------------- running


def _as_step(step: RecipeStep, execute: Callable[[Sequence[str], Path], None]) -> Step:
    def run_commands() -> None:
        for command in step.commands:
            execute(command, step.log)

    def run_action() -> None:
        """An in-process action, its libraries' log lines in the step's log (not on the terminal)."""
        step.log.parent.mkdir(parents=True, exist_ok=True)
        with open(step.log, "a", encoding="utf-8") as log, logging_into(log):
            step.action()

    return Step(step.name, run_action if step.action else run_commands, inputs=step.inputs, outputs=step.outputs,
                params=step.settings)


def describe_plan(plan: RecipePlan) -> str:
    """The steps with their state and command lines (what ``--dry-run`` prints)."""
    lines = [f"recipe {plan.pair.name} ({plan.pair.title}), profile {plan.profile.name}"
             + (f", {plan.world_size} GPU(s)" if plan.profile.device == "cuda" else ""),
             f"working folder {plan.workdir}", ""]
    runner = StepRunner(plan.workdir / "stamps")
    for step in plan.steps:
        done = runner.is_done(_as_step(step, lambda *_: None))
        lines.append(f"[{'done' if done else 'to run'}] {step.name}: {step.description}")
        lines += [f"    {shlex.join(command)}" for command in step.commands]
    return "\n".join(lines) + "\n"


def preflight(plan: RecipePlan) -> None:
    """Refuse, before any step runs, a training step that would have to replace checkpoints."""
    runner = StepRunner(plan.workdir / "stamps")
    for step in plan.steps:
        if step.save_dir and checkpoints_in(step.save_dir) and not runner.is_done(_as_step(step, lambda *_: None)):
            check_checkpoint_folder(step.save_dir, step.settings, step.inputs)


def write_manifest(plan: RecipePlan) -> None:
    plan.workdir.mkdir(parents=True, exist_ok=True)
    manifest = plan.workdir / MANIFEST_NAME
    if not manifest.exists():
        manifest.write_text(json.dumps({"format": MANIFEST_FORMAT, "pair": plan.pair.name,
                                        "profile": plan.profile.name}, indent=1) + "\n", encoding="utf-8")


def run_plan(plan: RecipePlan) -> RecipeResult:
    """Run every step that is not done; return which ran and which were skipped."""
    preflight(plan)
    write_manifest(plan)
    runner = StepRunner(plan.workdir / "stamps")
    for step in plan.steps:
        try:
            runner.run(_as_step(step, plan.execute))
        except PrepareError as error:  # the step runner's own checks (missing inputs or outputs)
            raise RecipeError(f"step {step.name}: {error} (log: {step.log})") from None
        except RecipeError as error:
            raise RecipeError(f"step {step.name} failed: {error}") from None
    # The tables this plan wrote, in step order: a working folder re-run with other --methods or
    # --student-seeds still holds an earlier plan's tables, which scripts/quality_benchmark.sh must not copy.
    report = plan.workdir / "report"
    tables = [path.name for step in plan.steps for path in step.outputs if path.parent == report and path.suffix == ".md"]
    listing, index = "".join(name + "\n" for name in tables), report / TABLES_NAME
    if not index.is_file() or index.read_text(encoding="utf-8") != listing:  # a run that skips everything writes nothing
        report.mkdir(parents=True, exist_ok=True)
        index.write_text(listing, encoding="utf-8")
    return RecipeResult(executed=list(runner.executed), skipped=list(runner.skipped),
                        report_markdowns=[prefix.with_name(prefix.name + ".md") for prefix in plan.report_prefixes])
