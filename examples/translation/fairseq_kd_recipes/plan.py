"""The recipe engine: prepare a corpus, train the teacher and every student, decode, score, report.

A recipe is a list of steps, each a command line of the project's entry points or of fairseq's own
(``fairseq-train``, ``fairseq-generate``); the steps and the design: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import fairseq_kd
from fairseq_kd.fingerprint import write_json

from .cluster import DEFAULT_PORT, Launch, resolve_launch
from .execute import (MANIFEST_NAME, TRAIN_RECORD_NAME, CommandExecutor, RecipeError, check_checkpoint_folder,
                      console_script, python_module)
from .hf_teacher import RAW_TEXT, HuggingFaceTeacher, method_problems, read_teacher
from .methods import BASELINE, METHODS, SEQKD_DATA, TEACHER, Method, baseline_of
from .pairs import BEAM, EVAL_BLEU_ARGS, LABEL_SMOOTHING, MAX_LEN_A, MAX_LEN_B, PAIRS, PairRecipe
from .profiles import PROFILES, Profile
from .systems import SystemDecoding, write_systems_sidecar

#: the plugin's folder, fairseq-train's --user-dir
USER_DIR = Path(fairseq_kd.__file__).resolve().parent
DEFAULT_PREPARE_WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass
class RecipeOptions:
    """What ``fairseq-kd-recipe`` was asked to do (its ``--help`` says what each field means)."""

    pair: str
    methods: Optional[Sequence[str]] = None
    profile: str = "auto"
    workdir: Optional[Path] = None
    archives: Optional[Path] = None
    data: Optional[Path] = None
    gpus: Optional[int] = None
    nodes: int = 1
    launcher: Optional[str] = None
    master_port: int = DEFAULT_PORT
    max_update: Optional[int] = None
    prepare_args: Sequence[str] = ()
    train_args: Sequence[str] = ()
    workers: int = DEFAULT_PREPARE_WORKERS
    seed: int = 1
    student_seeds: Sequence[int] = ()
    teacher: Optional[Path] = None
    teacher_source_lang: Optional[str] = None
    teacher_target_lang: Optional[str] = None
    #: the plan is printed or written as batch scripts, not run here: ``gpus`` names the GPUs of each
    #: node of the machines that will run it, which this one need not have
    print_only: bool = False


@dataclass
class RecipeStep:
    """One step. ``settings`` is what its stamp records (the commands without the placement flags);
    ``save_dir`` marks a training step, whose checkpoints are protected."""

    name: str
    commands: list[list[str]]
    inputs: list[Path]
    outputs: list[Path]
    settings: dict
    log: Path
    action: Optional[Callable[[], None]] = None
    description: str = ""
    save_dir: Optional[Path] = None
    #: a teacher pass's command for one GPU; a job array's task adds its shard (:func:`~.cluster.array_command`)
    array_command: Optional[list[str]] = None


# ----------------------------------------------------------------------------- checking the request


def select_methods(pair: PairRecipe, names: Optional[Sequence[str]]) -> list[Method]:
    """The methods named (all of the pair's when ``names`` is empty or ``["all"]``), in table order."""
    available = {method.name: method for method in pair.methods()}
    names = [name.strip() for name in (names or []) if name.strip()]
    if not names or names == ["all"]:
        return list(available.values())
    valid = ", ".join(available)
    unknown = [name for name in names if name not in available]
    if unknown:
        message = f"--methods: unknown method(s) for {pair.name}: {', '.join(unknown)}. Valid names: {valid} (or all)"
        if TEACHER in unknown:
            message += f". The {TEACHER} is always trained"
        elsewhere = [name for name in unknown if name in METHODS and METHODS[name].in_recipes]
        if elsewhere:
            message += (f". {', '.join(elsewhere)} would train the same model as another method of "
                        f"{pair.name} or need(s) a student it does not define")
        raise RecipeError(message)
    chosen = set(names)
    return [method for method in available.values() if method.name in chosen]


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def resolve_profile(name: str, gpus: Optional[int], device_count: Callable[[], int],
                    print_only: bool = False) -> tuple[Profile, int]:
    """The profile (``auto``: gpu when GPUs are named or a CUDA device is visible, else cpu) and
    the GPUs per node (0 on the CPU). A plan that is only printed takes ``gpus`` as named, without
    looking for devices (a cluster's login node has none)."""
    if name == "auto":
        name = "gpu" if gpus is not None or device_count() > 0 else "cpu"
    if name not in PROFILES:
        raise RecipeError(f"--profile {name}: choose one of auto, {', '.join(PROFILES)}")
    profile = PROFILES[name]
    if profile.device != "cuda":
        if gpus is not None:
            raise RecipeError(f"--gpus applies to the gpu profile only (this run uses --profile {name})")
        return profile, 0
    if print_only and gpus is not None:
        if gpus < 1:
            raise RecipeError(f"--gpus-per-node must be >= 1, got {gpus}")
        return profile, gpus
    available = device_count()
    if available == 0:
        raise RecipeError("--profile gpu: no CUDA device is visible (torch.cuda.device_count() is 0); use --profile "
                          "cpu or auto, or name the GPUs to print the commands for: --print-commands (or --dry-run, "
                          "--sbatch DIR) --gpus-per-node N [--nodes M]")
    if gpus is None:
        return profile, available
    if not 1 <= gpus <= available:
        raise RecipeError(f"--gpus {gpus}: between 1 and the {available} visible CUDA device(s) (to print the "
                          "commands for other machines, add --print-commands, --dry-run or --sbatch DIR)")
    return profile, gpus


def check_archives(pair: PairRecipe, archives: Optional[Path]) -> None:
    if archives is None:
        return
    if not archives.is_dir():
        raise RecipeError(f"--archives {archives}: no such folder. It must hold {', '.join(pair.archive_files)} "
                          f"(see examples/translation/README.md), or leave --archives out to download them")
    missing = [name for name in pair.archive_files if not (archives / name).is_file()]
    if missing:
        raise RecipeError(f"--archives {archives} lacks {', '.join(missing)} for {pair.name}; it must hold "
                          f"{', '.join(pair.archive_files)} (names as in examples/translation/README.md)")


def check_prepared_data(pair: PairRecipe, data: Path) -> None:
    expected = [data / f"dict.{lang}.txt" for lang in (pair.source, pair.target)] + [
        data / f"{split}.{pair.source}-{pair.target}.{lang}.bin"
        for split in ("train", "valid", "test") for lang in (pair.source, pair.target)
    ]
    missing = [str(path) for path in expected if not path.is_file()]
    if missing:
        raise RecipeError(f"--data {data} is not a binarised {pair.source}-{pair.target} corpus: "
                          f"{', '.join(missing)} missing (prepare it with python -m {pair.prepare_module}, or "
                          f"{pair.prepare_script} in a checkout, or leave --data out)")


def check_teacher(options: RecipeOptions, pair: PairRecipe) -> Optional[HuggingFaceTeacher]:
    """``--teacher``: a fairseq checkpoint file, or a Hugging Face model folder (returned, checked
    by :func:`.hf_teacher.read_teacher`), whose data the recipe binarises from the prepared text."""
    teacher = options.teacher
    codes = [flag for flag, code in (("--teacher-source-lang", options.teacher_source_lang),
                                     ("--teacher-target-lang", options.teacher_target_lang)) if code is not None]
    if teacher is None or teacher.is_file():
        if codes:
            raise RecipeError(f"{'/'.join(codes)} name a multilingual Hugging Face teacher's language codes: give "
                              "its save_pretrained folder as --teacher DIR, or drop them")
        return None
    if not teacher.is_dir():
        raise RecipeError(f"--teacher {teacher}: no such checkpoint file or Hugging Face model folder")
    if options.data is not None:
        # A prepared --dest keeps only the held-out references as text (raw/valid, raw/test).
        raise RecipeError(f"--teacher {teacher} is a Hugging Face model folder, whose data the recipe binarises from "
                          f"the untokenised text its preparation keeps (WORKDIR/{RAW_TEXT}); --data {options.data} "
                          "holds no training text: leave --data out")
    return read_teacher(teacher, pair.source, pair.target, options.teacher_source_lang, options.teacher_target_lang)


def check_workdir(workdir: Path, pair: PairRecipe, profile: Profile) -> None:
    """The working folder is new, empty, or an earlier run of the same pair and profile."""
    if workdir.exists() and not workdir.is_dir():
        raise RecipeError(f"--workdir {workdir} exists and is not a folder")
    manifest = workdir / MANIFEST_NAME
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise RecipeError(f"--workdir {workdir}: its {MANIFEST_NAME} cannot be read ({error}); it is damaged: "
                              "move the folder away and choose another --workdir") from None
        if not isinstance(recorded, dict):
            recorded = {}
        if (recorded.get("pair"), recorded.get("profile")) != (pair.name, profile.name):
            raise RecipeError(
                f"--workdir {workdir} holds a recipe of pair {recorded.get('pair')} with profile "
                f"{recorded.get('profile')}, not {pair.name} with {profile.name}; choose another --workdir"
            )
    elif workdir.is_dir() and any(workdir.iterdir()):
        raise RecipeError(f"--workdir {workdir} is not empty and holds no {MANIFEST_NAME}: it is not a recipe's "
                          "working folder. Choose a new or empty folder")


# ----------------------------------------------------------------------------- the plan


class RecipePlan:
    """One recipe run: what it was asked, and its steps (laid out by :meth:`add_steps`, touching no file)."""

    def __init__(self, options: RecipeOptions, pair: PairRecipe, profile: Profile, launch: Launch,
                 methods: list[Method], workdir: Path, executor: Callable[[Sequence[str], Path], None],
                 hf_teacher: Optional[HuggingFaceTeacher] = None):
        self.options, self.pair, self.profile, self.launch = options, pair, profile, launch
        self.methods, self.workdir, self.execute, self.hf_teacher = methods, workdir, executor, hf_teacher
        #: the prepared corpus (its untouched references in raw/)
        self.corpus = options.data.resolve() if options.data is not None else workdir / "data-bin"
        self.test_reference = self.corpus / "raw" / f"test.{pair.target}"
        #: what every model trains on and is decoded from: the corpus, or its text in a Hugging Face
        #: teacher's vocabulary
        self.data = workdir / "data-hf" if hf_teacher is not None else self.corpus
        self.seqkd_data = self.seqkd_folder("seqkd")
        self.teacher_cache = workdir / "teacher-cache"
        self.sidecar = workdir / "report" / "systems.json"
        self.steps: list[RecipeStep] = []
        #: the papers' fairseq-train values, the profile's replacements, the pair's values for this profile
        self.training_values = {**pair.training(), **profile.training_overrides,
                                **pair.profile_training.get(profile.name, {})}
        self.schedule = (["--max-update", str(options.max_update)] if options.max_update is not None else
                         list(pair.profile_schedules.get(profile.name) or profile.schedule or pair.schedule))
        self.beam = profile.beam or pair.beam
        self.lenpen = ["--lenpen", str(pair.lenpen)] if pair.lenpen != 1.0 else []
        self.decoding = f"beam {self.beam}" + (f", length penalty {pair.lenpen}" if self.lenpen else "")
        limit_a, limit_b = profile.length_limit or (MAX_LEN_A, MAX_LEN_B)
        self.test_length_flags = ["--max-len-a", f"{limit_a:g}", "--max-len-b", str(limit_b)]
        self.teacher_pass_length_flags = self.test_length_flags if profile.length_limit else []
        self.decoding += f", at most {limit_a:g} x source + {limit_b} tokens"
        #: where a teacher pass or a test decoding runs (not part of its settings)
        self.device_flags = ["--fp16"] if profile.device == "cuda" else ["--cpu"]
        # the tokenised-BLEU table reads BPE-segmented, lowercased T- lines: not a Hugging Face teacher's data
        self.tokenized_bleu = pair.tokenized_bleu and hf_teacher is None
        if hf_teacher is not None:
            # cased text, in the teacher's tokens: its tokenizer makes them text again
            self.scoring = ["--detok-hf", str(hf_teacher.folder), "--tokenize", pair.sacrebleu_tokenize]
        else:
            self.scoring = ["--remove-bpe", pair.remove_bpe, "--tokenize", pair.sacrebleu_tokenize]
            if pair.lowercased:
                self.scoring += ["--lowercase"]
            if pair.detok_moses:
                self.scoring += ["--detok-moses", pair.detok_moses]

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def report_prefixes(self) -> list[Path]:
        """The results tables (without the .md/.csv/.json ending), the main one first."""
        return [self.workdir / "report" / f"results{suffix}" for suffix, *_ in self.report_groups()]

    def step(self, name: str) -> RecipeStep:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(name)

    # paths
    def save_dir(self, system: str) -> Path:
        return self.workdir / "train" / system

    def trained_checkpoint(self, system: str) -> Path:
        return self.save_dir(system) / "checkpoint_best.pt"

    def checkpoint(self, system: str) -> Path:
        """The checkpoint that is decoded and distilled from: the given, the selected or the average."""
        if system == TEACHER and self.options.teacher is not None:
            return self.options.teacher.resolve()
        return self.save_dir(system) / "checkpoint_avg.pt" if self.pair.average_last else self.trained_checkpoint(system)

    def model(self, system: str) -> Path:
        return self.workdir / "models" / f"{system}.pt"

    def generate_output(self, system: str) -> Path:
        return self.workdir / "generate" / system / "generate-test.txt"

    def score(self, system: str, tokenized: bool = False) -> Path:
        return self.workdir / ("scores-tokenized" if tokenized else "scores") / f"{system}.json"

    def log(self, step: str) -> Path:
        return self.workdir / "logs" / f"{step}.log"

    # steps
    def add(self, name: str, command: list[str], inputs, outputs, description: str, placement: Sequence[str] = (),
            launch: Callable[[Sequence[str]], list[str]] = list, settings=None, **fields) -> RecipeStep:
        """A step of one command line, started by ``launch``; the stamp records the command without
        ``placement`` (placement and launcher are where a step runs, not what it makes)."""
        step = RecipeStep(name=name, commands=[launch(with_placement(command, placement))],
                          inputs=[Path(p) for p in inputs], outputs=[Path(p) for p in outputs],
                          settings=settings if settings is not None else {"commands": [command]},
                          log=self.log(name), description=description, **fields)
        self.steps.append(step)
        return step

    def add_steps(self) -> None:
        if self.options.data is None:
            self.add_prepare()
        if self.hf_teacher is not None:
            self.add_hf_data()
        if self.options.teacher is None:
            self.add_teacher()
        self.add_evaluation(TEACHER)
        for kind in dict.fromkeys(method.data for method in self.methods if method.data != "original"):
            self.add_seqkd(kind)
        if any(method.teacher_cache for method in self.methods):
            self.add_teacher_cache()
        for method in self.methods:
            self.add_student(method)
            self.add_evaluation(method.name)
            if method.figure is not None:
                weights = self.workdir / "plots" / f"{method.name}-{method.figure}.json"
                figure, checkpoint = weights.with_suffix(".png"), self.checkpoint(method.name)
                self.add(f"figure-{method.name}",
                         [*python_module("fairseq_kd.cli.plot"), method.figure, "--checkpoint", str(checkpoint),
                          "--weights-output", str(weights), "--output", str(figure), "--overwrite"],
                         [checkpoint], [weights, figure], f"{method.figure} weights figure")
        for seed in self.more_seeds():
            for method in self.methods:
                self.add_student(method, seed)
                self.add_evaluation(seeded(method.name, seed))
        self.add_validation_comparison()
        self.add_systems()
        for suffix, systems, baseline, seed in self.report_groups():
            self.add_report(suffix, systems, baseline, seed, tokenized=False)
            if self.tokenized_bleu:
                self.add_report(suffix, systems, baseline, seed, tokenized=True)
        if self.more_seeds() and BASELINE in {method.name for method in self.methods}:
            self.add_seed_summary()

    def more_seeds(self) -> list[int]:
        """The students' seeds besides ``--seed`` (whose students keep their plain names)."""
        return [seed for seed in dict.fromkeys(self.options.student_seeds) if seed != self.options.seed]

    def add_prepare(self) -> None:
        args = [*self.pair.prepare_args]
        if self.profile.use_smoke_prepare_args:
            args += self.pair.smoke_prepare_args
        command = [*python_module(self.pair.prepare_module), *args, *self.options.prepare_args,
                   "--workdir", str(self.workdir / "prepare"), "--dest", str(self.corpus)]
        # not settings of the corpus: changing them does not re-run the preparation
        placement = ["--workers", str(self.options.workers)]
        if self.options.archives is not None:
            placement += ["--archives", str(self.options.archives.resolve())]
        self.add("prepare", command, [], [self.corpus], f"prepare {self.pair.title} into {self.corpus}", placement)

    def add_hf_data(self) -> None:
        """The prepared text (untokenised, cased: what the teacher's tokenizer reads) binarised in the
        Hugging Face teacher's vocabulary. The preparation keeps it in its working folder."""
        teacher, raw = self.hf_teacher, self.workdir / RAW_TEXT
        source, target = self.pair.source, self.pair.target
        command = [*python_module("fairseq_kd.cli.hf_data"), "--teacher", str(teacher.folder), "-s", source,
                   "-t", target, "--trainpref", str(raw / "train"), "--validpref", str(raw / "valid"),
                   "--testpref", str(raw / "test"), "--destdir", str(self.data), *teacher.language_flags(),
                   "--overwrite"]
        texts = [raw / f"{split}.{lang}" for split in ("train", "valid", "test") for lang in (source, target)]
        self.add("hf-data", command, [*texts, teacher.folder], [self.data],
                 f"the prepared text in the vocabulary of the teacher {teacher.folder.name}")

    # training
    def selection_flags(self) -> list[str]:
        """How fairseq picks checkpoint_best.pt: never by a KD criterion's total loss, whose terms
        change weight per epoch (pairs.py), but by the references' nll or by BLEU."""
        flags = ["--patience", str(self.pair.patience)] if self.pair.patience else []
        # fairseq's --eval-bleu undoes BPE or SentencePiece, not a Hugging Face tokenizer
        if self.pair.selection == "nll" or self.hf_teacher is not None:
            return flags + ["--best-checkpoint-metric", "nll_loss"]
        remove_bpe = "@@ " if self.pair.remove_bpe == "subword_nmt" else self.pair.remove_bpe
        flags += ["--eval-bleu", "--eval-bleu-args", EVAL_BLEU_ARGS, "--eval-bleu-remove-bpe", remove_bpe]
        if self.pair.detok_moses:
            flags += ["--eval-bleu-detok", "moses", "--eval-bleu-detok-args",
                      json.dumps({"target_lang": self.pair.detok_moses})]
        return flags + ["--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric"]

    def checkpoint_flags(self) -> tuple[str, list[str]]:
        """(kind of the N checkpoints averaged, fairseq-train's checkpoint flags): epoch checkpoints on
        an epoch schedule; on one of M updates, one every min(pair's interval, M / N) updates, so that
        N exist at the end of any budget."""
        if not self.pair.average_last:
            return "", ["--no-epoch-checkpoints"]
        keep = str(self.pair.average_last)
        if "--max-epoch" in self.schedule:
            return "epoch", ["--keep-last-epochs", keep]
        max_update = int(self.schedule[self.schedule.index("--max-update") + 1])
        interval = max(1, min(self.pair.save_interval_updates, max_update // self.pair.average_last))
        flags = ["--no-epoch-checkpoints", "--save-interval-updates", str(interval), "--keep-interval-updates", keep]
        return "update", flags

    def placement_flags(self, distils: bool) -> list[str]:
        if self.profile.device == "cuda":
            flags = ["--fp16", *self.launch.distributed_flags()]
            if self.launch.world_size > 1 and distils:
                # a criterion's learnable modules may sit out some steps (internal KD's projections)
                flags.append("--find-unused-parameters")
        else:
            flags = ["--cpu"]
        if self.profile.match_tokens_per_update:
            max_tokens = int(self.training_values["--max-tokens"])
            per_gpu, update_freq = batch_split(self.pair.tokens_per_update, max_tokens, self.launch.world_size)
            if per_gpu != max_tokens:
                flags += ["--max-tokens", str(per_gpu)]
            if update_freq > 1:
                flags += ["--update-freq", str(update_freq)]
        return flags

    def architecture(self, role: str) -> list[str]:
        if self.profile.architectures is not None:
            return list(self.profile.architectures[role])
        return list(self.pair.teacher if role == TEACHER else self.pair.students[role])

    def model_args(self) -> list[str]:
        """The pair's model flags; on a Hugging Face teacher's data, sized to the sentences it reads."""
        args = list(self.pair.model_args)
        teacher = self.hf_teacher
        if teacher is None:
            return args
        if teacher.separate_vocabularies and "--share-all-embeddings" in args:
            # separate source and target dictionaries (a Marian teacher's), which --share-all-embeddings refuses
            args[args.index("--share-all-embeddings")] = "--share-decoder-input-output-embed"
        if teacher.max_positions is not None and teacher.max_positions < DEFAULT_MAX_POSITIONS:
            # the teacher reads no longer sentences: longer training and validation pairs are skipped
            limit = str(teacher.max_positions)
            args += ["--max-source-positions", limit, "--max-target-positions", limit,
                     "--skip-invalid-size-inputs-valid-test"]
        return args

    def add_training(self, system: str, data: Path, task_args: list[str], role: str, criterion: str,
                     criterion_args: Sequence[str], inputs: list[Path], distils: bool, description: str,
                     seed: Optional[int] = None) -> None:
        """fairseq-train (its checkpoints protected: :func:`.execute.check_checkpoint_folder`), then
        the average of its last checkpoints when the pair decodes one."""
        save_dir = self.save_dir(system)
        kind, checkpoint_flags = self.checkpoint_flags()
        args = [
            *console_script("fairseq-train", "fairseq_cli.train"), str(data),
            "--user-dir", str(USER_DIR), *task_args,
            *self.architecture(role), *self.model_args(),
            "--criterion", criterion, "--label-smoothing", LABEL_SMOOTHING, *criterion_args,
            *[item for flag_value in self.training_values.items() for item in flag_value],
            *self.schedule, *self.selection_flags(),
            "--seed", str(self.options.seed if seed is None else seed),
            "--save-dir", str(save_dir), *checkpoint_flags,
            "--log-format", "json", "--log-interval", str(self.profile.log_interval),
            "--log-file", str(save_dir / "train.log"),
            *self.options.train_args,
        ]

        def action() -> None:
            write_json(save_dir / TRAIN_RECORD_NAME, check_checkpoint_folder(save_dir, step.settings, step.inputs))
            self.execute(step.commands[0], step.log)

        step = self.add(f"train-{system}", args, inputs, [self.trained_checkpoint(system), save_dir / "train.log"],
                        description, self.placement_flags(distils), self.launch.training,
                        save_dir=save_dir, action=action)
        if self.pair.average_last:
            self.add(f"average-{system}",
                     [*python_module("fairseq_kd.cli.average_checkpoints"), str(save_dir),
                      "--last", str(self.pair.average_last), "--kind", kind,
                      "--output", str(self.checkpoint(system)), "--overwrite"],
                     [self.trained_checkpoint(system)], [self.checkpoint(system)],
                     f"average the last {self.pair.average_last} {kind} checkpoints")

    def add_teacher(self) -> None:
        self.add_training(TEACHER, self.data, ["--task", "translation"], TEACHER, "label_smoothed_cross_entropy", (),
                          [self.data], False, "train the teacher")

    def add_student(self, method: Method, seed: Optional[int] = None) -> None:
        data = self.data if method.data == "original" else self.seqkd_folder(method.data)
        task_args = ["--task", "translation_kd"]
        inputs = [data]
        if method.uses_teacher:
            task_args += ["--teacher-checkpoint", str(self.checkpoint(TEACHER)), *self.teacher_data()]
            inputs.append(self.checkpoint(TEACHER))
        elif self.hf_teacher is not None:
            # its data is in the teacher's vocabulary: checkpoints of a run with another teacher are
            # refused before any step (the hf-data step, which rewrites the data, comes later)
            inputs.append(self.checkpoint(TEACHER))
        if method.teacher_cache:
            task_args += ["--teacher-cache", str(self.teacher_cache)]
            inputs.append(self.teacher_cache)
        self.add_training(seeded(method.name, seed), data, task_args, method.student, method.criterion,
                          self.pair.criterion_args(method), inputs, method.uses_teacher,
                          method.description + ("" if seed is None else f" (seed {seed})"), seed)

    def teacher_data(self) -> list[str]:
        """A teacher given with --teacher was trained on this data (--teacher's help): its
        dictionaries are the data's, wherever its own data folder was."""
        return ["--teacher-data", str(self.data)] if self.options.teacher is not None and self.hf_teacher is None else []

    def add_teacher_pass(self, name: str, module: str, output: Path, args: list[str], description: str) -> None:
        command = [*python_module(module), "--data", str(self.data), "--teacher-checkpoint",
                   str(self.checkpoint(TEACHER)), "--output", str(output), *args]
        self.add(name, command, [self.data, self.checkpoint(TEACHER)], [output], description, self.device_flags,
                 self.launch.teacher_pass, array_command=with_placement(command, self.device_flags))

    def seqkd_folder(self, kind: str) -> Path:
        return self.workdir / ("data-" + kind.replace("_", "-"))

    def add_seqkd(self, kind: str) -> None:
        beam, flags = str(self.profile.beam or BEAM), list(SEQKD_DATA[kind])
        if "--select" in flags:  # the n-best of the whole beam, compared as text without subwords
            scheme = "sentencepiece" if self.hf_teacher is not None else self.pair.remove_bpe
            flags += ["--nbest", beam, "--remove-bpe", scheme]
        self.add_teacher_pass(f"{kind.replace('_', '-')}-data", "fairseq_kd.cli.seqkd_decode", self.seqkd_folder(kind),
                              ["--beam", beam, *self.teacher_pass_length_flags, *flags],
                              "decode the training set with the teacher (sequence-level KD"
                              + (f", {kind})" if flags else ")"))

    def add_teacher_cache(self) -> None:
        self.add_teacher_pass("teacher-cache", "fairseq_kd.cli.teacher_cache", self.teacher_cache,
                              ["--k", str(TEACHER_CACHE_K), *self.teacher_data()],
                              f"the teacher's top-{TEACHER_CACHE_K} log-probabilities of every training token")

    # evaluation
    def add_evaluation(self, system: str) -> None:
        """Decode the test set (a Hugging Face teacher with its own generate, under fairseq-generate's
        rules and in its output format), score it and plot the training curves."""
        output = self.generate_output(system)
        decoding = ["--gen-subset", "test", "--beam", str(self.beam), *self.lenpen, *self.test_length_flags,
                    "--max-tokens", self.training_values["--max-tokens"]]
        if system == TEACHER and self.hf_teacher is not None:
            folder = self.hf_teacher.folder
            command = [*python_module("fairseq_kd.cli.translate"), str(self.data), "--model", str(folder), *decoding,
                       "--results-path", str(output.parent), "--overwrite"]
            placement = ["--device", "cuda", "--compute-type", "float16"] if self.profile.device == "cuda" else [
                "--device", "cpu"]
            self.add(f"generate-{TEACHER}", command, [self.data, folder], [output],
                     f"decode the test set with the teacher's own generate, {self.decoding}", placement)
        else:
            model = self.model(system)
            self.add(f"export-{system}",
                     [*python_module("fairseq_kd.cli.export_student"), str(self.checkpoint(system)), str(model),
                      "--overwrite"], [self.checkpoint(system)], [model], "export the model as a stock checkpoint")
            command = [
                *console_script("fairseq-generate", "fairseq_cli.generate"), str(self.data),
                "--user-dir", str(USER_DIR), "--task", "translation", "--gen-subset", "test",
                "--path", str(model), *decoding[2:],
                # else fairseq drops sentences that do not fill a multiple of 8: every one must be decoded
                "--required-batch-size-multiple", "1",
                "--seed", str(self.options.seed), "--results-path", str(output.parent),
            ]
            self.add(f"generate-{system}", command, [self.data, model], [output],
                     f"decode the test set, {self.decoding}", self.device_flags)
        score = [*python_module("fairseq_kd.cli.score"), "--generate-output", str(output), "--system", system]
        self.add(f"score-{system}",
                 [*score, *self.scoring, "--ref", str(self.test_reference), "--ref-is-plain",
                  "--output-json", str(self.score(system)), "--overwrite"],
                 [output, self.test_reference], [self.score(system)],
                 "detokenised sacreBLEU with 95% CI against the untouched references, every test sentence present")
        if self.tokenized_bleu:
            self.add(f"score-tokenized-{system}",
                     [*score, "--remove-bpe", self.pair.remove_bpe, "--expected-from", str(self.test_reference),
                      "--output-json", str(self.score(system, tokenized=True)), "--overwrite"],
                     [output, self.test_reference], [self.score(system, tokenized=True)],
                     "the paper's BLEU: sacreBLEU on the tokenised, lowercased T- lines")
        log = self.checkpoint(system).parent / "train.log"
        given_teacher = system == TEACHER and self.options.teacher is not None
        if given_teacher and (self.hf_teacher is not None or not log.is_file()):
            return  # a teacher trained elsewhere, without its fairseq log beside it: no curves
        curves = self.workdir / "plots" / f"{system}-curves.png"
        self.add(f"curves-{system}", [*python_module("fairseq_kd.cli.plot"), "curves", "--log", str(log), "--output",
                                      str(curves), "--overwrite"],
                 [log], [curves], "training curves of every loss term")

    def add_validation_comparison(self) -> None:
        """Every student's validation nll on one axis (and the teacher's when trained here)."""
        systems = ([TEACHER] if self.options.teacher is None else []) + [method.name for method in self.methods]
        logs = [self.save_dir(system) / "train.log" for system in systems]
        figure = self.workdir / "plots" / "validation-nll.png"
        command = [*python_module("fairseq_kd.cli.plot"), "compare"]
        for system, log in zip(systems, logs):
            command += ["--log", f"{system}={log}"]
        self.add("validation-curves", command + ["--output", str(figure), "--overwrite"], logs, [figure],
                 "validation nll of every model against updates, on one axis")

    def add_systems(self) -> None:
        systems = [TEACHER] + [seeded(method.name, seed) for seed in [None, *self.more_seeds()]
                               for method in self.methods]
        decodings = {system: SystemDecoding(
            self.hf_teacher.folder if system == TEACHER and self.hf_teacher is not None else self.model(system),
            self.generate_output(system), self.log(f"generate-{system}")) for system in systems}
        data, sidecar = self.data, self.sidecar
        test_prefix = f"test.{self.pair.source}-{self.pair.target}.{self.pair.target}"
        # In-process when the recipe runs it; the command is what a printed plan or batch script runs.
        command = [*python_module("fairseq_kd_recipes.systems"), "--data", str(data), "--test-prefix", test_prefix,
                   "--output", str(sidecar)]
        for system, decoding in decodings.items():
            command += ["--system", system, str(decoding.model), str(decoding.output), str(decoding.log)]
        self.add("systems", command, [path for d in decodings.values() for path in (d.model, d.output)], [sidecar],
                 "parameter counts of the exported models, decoding speeds", settings={"systems": systems},
                 action=lambda: write_systems_sidecar(decodings, data, test_prefix, sidecar))

    def report_groups(self) -> list[tuple[str, list[str], str, Optional[int]]]:
        """(file suffix, systems, baseline, further seed or None) of each results table: the teacher
        and the main-shape students against no_kd, then one table per other student shape whose no-KD
        system the recipe trains (CKD's 2+2 students against no_kd_2l), then the same for each further
        seed's students. A shape without its baseline stays in the main table."""
        planned = {method.name for method in self.methods}
        groups: dict[str, list[str]] = {BASELINE: [TEACHER]}
        for method in self.methods:
            baseline = baseline_of(method)
            groups.setdefault(baseline if baseline in planned else BASELINE, []).append(method.name)
        tables = []
        for baseline, systems in groups.items():
            if baseline in systems:  # the baseline's row first, as no_kd's in the main table
                systems = [name for name in systems if name == TEACHER] + [baseline] + [
                    name for name in systems if name not in (TEACHER, baseline)]
            prefix = BASELINE + "_"  # removed as str.removeprefix (Python >= 3.9) would
            named = baseline[len(prefix):] if baseline.startswith(prefix) else baseline
            suffix = "" if baseline == BASELINE else "_" + named
            tables.append((suffix, systems, baseline, None))
        # each further seed's students in tables of their own, beside the same teacher
        tables += [(f"{suffix}_seed{seed}", [name if name == TEACHER else seeded(name, seed) for name in systems],
                    seeded(baseline, seed), seed) for seed in self.more_seeds() for suffix, systems, baseline, _ in tables]
        return tables

    def add_report(self, suffix: str, systems: list[str], baseline: str, seed: Optional[int], tokenized: bool) -> None:
        prefix = self.workdir / "report" / (("results_tokenized" if tokenized else "results") + suffix)
        command = [*python_module("fairseq_kd.cli.report")]
        for system in systems:
            command += ["--system", f"{system}={self.score(system, tokenized)}"]
        if baseline in systems:
            command += ["--baseline", baseline]
            if TEACHER in systems:
                command += ["--teacher", TEACHER]
        if tokenized:
            title = (f"{self.pair.title}: the paper's BLEU, sacreBLEU (13a) on the tokenised, lowercased text "
                     "with BPE removed and the T- lines as references (what fairseq-generate --scoring sacrebleu "
                     "prints; the A2D authors' IWSLT'14 protocol). Not comparable with detokenised BLEU.")
            scoring = ["--remove-bpe", self.pair.remove_bpe]
        else:
            title = (f"{self.pair.title}: detokenised sacreBLEU against the untouched test references "
                     f"(raw/test.{self.pair.target})")
            if self.hf_teacher is not None:
                title += (f"; every model reads and writes the Hugging Face teacher {self.hf_teacher.folder.name}'s "
                          "tokens (cased text), made text by its tokenizer")
            elif self.pair.lowercased:
                title += ", case-insensitive (the corpus is lowercased)"
            scoring = self.scoring
        shape = suffix[:-len(f"_seed{seed}")] if seed is not None else suffix
        if shape:
            title += f"; students of the {baseline} shape against {baseline}"
        if seed is not None:
            title += f"; the students trained with seed {seed}"
        command += ["--sidecar", str(self.sidecar), *scoring, "--title", title, "--out-prefix", str(prefix),
                    "--overwrite"]
        self.add(("report-tokenized" if tokenized else "report") + suffix.replace("_", "-"), command,
                 [self.score(system, tokenized) for system in systems] + [self.sidecar],
                 [prefix.with_name(prefix.name + ending) for ending in (".md", ".csv", ".json")],
                 "results table" + (" (the paper's tokenised BLEU)" if tokenized else "")
                 + (f" of the {baseline} shape" if shape else "") + (f", seed {seed}" if seed is not None else ""))

    def add_seed_summary(self) -> None:
        """What holds on every seed of the main table (:mod:`.demo_summary`): who beats no KD on
        each, the order at the top, each system's BLEU and best validation nll over the seeds."""
        # the main-shape table of each seed (None: --seed's), as report_groups names it
        tables = {seed: self.workdir / "report" / f"results{suffix}.json"
                  for suffix, _, baseline, seed in self.report_groups() if baseline == seeded(BASELINE, seed)}
        label = lambda seed: self.options.seed if seed is None else seed
        command = [*python_module("fairseq_kd_recipes.demo_summary"), "--plain-names"]
        for seed, report in tables.items():
            command += ["--report", f"{label(seed)}={report}"]
        logs = [(method.name, label(seed), self.save_dir(seeded(method.name, seed)) / "train.log")
                for method in self.methods if baseline_of(method) == BASELINE for seed in tables]
        command += [item for name, seed, log in logs for item in ("--log", f"{name}/{seed}={log}")]
        prefix = self.workdir / "report" / "seeds"
        self.add("report-seeds", command + ["--out-prefix", str(prefix)],
                 [*tables.values(), *(log for _, _, log in logs)], [prefix.with_suffix(".md"), prefix.with_suffix(".json")],
                 f"what holds on each of the {len(tables)} seeds: who beats no KD, the order at the top")


#: log-probabilities per token in a recipe's teacher cache (the top 8, as Tan et al. 2019)
TEACHER_CACHE_K = 8
#: fairseq's translation task's default --max-source-positions / --max-target-positions
DEFAULT_MAX_POSITIONS = 1024


def batch_split(tokens_per_update: int, max_tokens: int, world_size: int) -> tuple[int, int]:
    """(``--max-tokens`` per GPU, ``--update-freq``) that make ``tokens_per_update`` on ``world_size``
    GPUs (rounded up), never more than ``max_tokens`` per GPU (README, "Batch arithmetic")."""
    if min(tokens_per_update, max_tokens, world_size) < 1:
        raise ValueError(f"tokens per update, --max-tokens and the GPU count must be >= 1, got "
                         f"{tokens_per_update}, {max_tokens}, {world_size}")
    update_freq = math.ceil(tokens_per_update / (max_tokens * world_size))
    return math.ceil(tokens_per_update / (world_size * update_freq)), update_freq


def seeded(system: str, seed: Optional[int]) -> str:
    """The name of ``system`` trained with a further ``seed`` (None: the run's own seed, the plain name)."""
    return system if seed is None else f"{system}-seed{seed}"


def with_placement(args: Sequence[str], placement: Sequence[str]) -> list[str]:
    """``args`` followed by ``placement``, where a placement flag that ``args`` already has (the
    per-GPU ``--max-tokens``) replaces that flag's value in place instead of repeating the flag."""
    merged, extra, i = list(args), [], 0
    placement = list(placement)
    while i < len(placement):
        flag = placement[i]
        has_value = i + 1 < len(placement) and not placement[i + 1].startswith("--")
        if has_value and flag in merged:
            merged[merged.index(flag) + 1] = placement[i + 1]
        else:
            extra += placement[i:i + 1 + has_value]
        i += 1 + has_value
    return merged + extra


def step_planner(options: RecipeOptions, gpus: int) -> RecipePlan:
    """An empty plan on one node with ``gpus`` GPUs (0: the CPU), without :func:`build_plan`'s checks
    of the request: for a tool that adds single steps and runs them its own way (:mod:`.gpu_check`)."""
    launch = resolve_launch(1, gpus, None, options.master_port)
    return RecipePlan(options, PAIRS[options.pair], PROFILES[options.profile], launch, [],
                      Path(options.workdir).resolve(), CommandExecutor())


def build_plan(options: RecipeOptions, executor: Optional[Callable[[Sequence[str], Path], None]] = None,
               device_count: Callable[[], int] = cuda_device_count) -> RecipePlan:
    """Check the request and lay out the steps; raises RecipeError before anything is written."""
    if options.pair not in PAIRS:
        raise RecipeError(f"unknown pair {options.pair!r}; choose one of {', '.join(PAIRS)}")
    pair = PAIRS[options.pair]
    methods = select_methods(pair, options.methods)
    if not options.print_only and options.nodes > 1:
        raise RecipeError(f"--nodes {options.nodes}: a recipe runs its steps from one node; add --print-commands to "
                          f"print each step's commands for {options.nodes} nodes, or --sbatch DIR to write them as "
                          "SLURM batch scripts")
    profile, gpus_per_node = resolve_profile(options.profile, options.gpus, device_count, options.print_only)
    launch = resolve_launch(options.nodes, gpus_per_node, options.launcher, options.master_port)
    if options.max_update is not None and options.max_update < 1:
        raise RecipeError(f"--max-update must be >= 1, got {options.max_update}")
    if options.workers < 1:
        raise RecipeError(f"--workers must be >= 1, got {options.workers}")
    hf_teacher = check_teacher(options, pair)
    if options.data is not None:
        if options.archives is not None:
            raise RecipeError("--data uses an already prepared corpus: --archives would not be read; give one of them")
        check_prepared_data(pair, options.data)
    check_archives(pair, options.archives)
    try:  # the plugin declares no fairseq dependency: a missing one is refused here, not in a step's log
        fairseq_kd.check_fairseq()
    except fairseq_kd.FairseqMissingError as error:
        raise RecipeError(str(error)) from None
    workdir = (options.workdir or Path("work_dirs") / "recipes" / pair.name / profile.name).resolve()
    check_workdir(workdir, pair, profile)
    plan = RecipePlan(options, pair, profile, launch, methods, workdir, executor or CommandExecutor(), hf_teacher)
    if hf_teacher is not None:
        problems = method_problems(hf_teacher, methods, {method.student: plan.architecture(method.student)
                                                      for method in methods})
        if problems:
            raise RecipeError(f"--teacher {hf_teacher.folder}: {'; '.join(problems)}. Leave these methods out of "
                              "--methods (the methods that read only the teacher's output distribution run with any "
                              "Hugging Face teacher: word_kd, word_kd_cached, selective_kd, seq_kd)")
    plan.add_steps()
    return plan
