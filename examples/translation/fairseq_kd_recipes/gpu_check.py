"""The GPU check: every row of the method table trained in fp16 and in bf16 on a real corpus, then the
benchmark's IWSLT-shaped rows, in one command that fits a short GPU lease::

    python -m fairseq_kd_recipes.gpu_check OUT --data DATA_BIN        # scripts/gpu_check.sh: kit + this
    python -m fairseq_kd_recipes.gpu_check OUT --data DATA_BIN --cpu  # the same code, tiny models

Each training is the recipe's own ``fairseq-train`` command for its method on the pair's corpus
(Multi30k Fr-En), with a budget of ``--updates``, a checkpoint half-way and validation by nll; it
runs again from that checkpoint, and both halves must agree. Per method and precision it records
whether every logged loss term was finite, the fp16 loss-scale overflows, target tokens per second,
peak memory (CUDA: ``torch.cuda.max_memory_allocated``; CPU: peak resident set) and the resume's
differences. ``--jobs`` trainings share the device, so their tokens per second are shared-device
figures; the benchmark rows run alone. ``OUT/gpu_check.md`` and ``.json`` are rewritten as each
step ends, and a line is printed, so a run cut by its time limit keeps what it finished. ``--cpu``
trains the smoke profile's tiny models for a handful of updates (the suite runs it). To fit 540 s
(docs/DEVELOPING.md "The GPU check" has the first lease's timings): 40 updates resumed from 20 (enough
for fp16 overflows, finiteness and a bit-identical resume), 16 trainings at a time with one thread
each (CPU-bound), seq-KD passes on the first ``--pass-sentences`` training pairs only, and the rows no
earlier ``docs/results/gpu_check_*.json`` saw ok first, so that a cut run still adds coverage.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from fairseq_kd.teacher_pass.common import replace_atomically

from .benchmark import PRECISIONS as PRECISION_FLAGS
from .benchmark import _quiet_env
from .execute import console_script, python_module
from .methods import METHODS, SEQKD_DATA, TEACHER
from .plan import RecipeOptions, step_planner, with_placement

PAIR = "multi30k_fr_en"
#: the benchmark's rows measured after the trainings, per precision
BENCHMARK_ROWS = ("plain", "limit", "word_kd", "a2d_kd", "word_kd_on_policy")
#: seconds per training's two start-ups, per update with 16 at a time, per teacher update, per teacher
#: pass and per benchmark precision: the plan's estimate, from the first H200 lease's rates
ESTIMATE = {"startup": 20.0, "update": 0.5, "teacher_update": 0.18, "pass": 45.0, "benchmark": 45.0}
#: statistics of a log line that time the run instead of computing the model (not compared on resume)
TIMING_KEYS = frozenset({"wps", "ups", "train_wall", "gb_free", "wall"})
#: seconds a step started before the limit may run past it before it is stopped
GRACE = 15.0
OVERFLOW_MARK = "overflow detected"
REPORT_NAME = "gpu_check"


@dataclass
class Training:
    """One method at one precision: the first run, its resume from the middle, what was found."""

    method: str
    precision: str
    args: List[str]
    save_dir: Path
    result: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.method}/{self.precision}"


def machine_header(cpu: bool, commit: Optional[str]) -> dict:
    """Device, driver, CUDA, torch, fairseq, Python and the commit, as the table's header states them."""
    import fairseq
    import torch

    header = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "python": platform.python_version(),
              "torch": torch.__version__, "fairseq": fairseq.__version__, "cuda": torch.version.cuda,
              "commit": commit or git_commit(), "host_cpu": platform.processor() or platform.machine()}
    if cpu or not torch.cuda.is_available():
        header["device"] = "cpu"
        return header
    header["device"] = torch.cuda.get_device_name(0)
    header["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        header["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        header["driver"] = None
    return header


def git_commit() -> Optional[str]:
    """The checkout's commit, marked ``+changes`` when its tracked files differ from it."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


# ----------------------------------------------------------------------------- commands


def _without(args: List[str], flags_with_value: Sequence[str], switches: Sequence[str]) -> List[str]:
    out, i = [], 0
    while i < len(args):
        if args[i] in flags_with_value:
            i += 2
            continue
        if args[i] not in switches:
            out.append(args[i])
        i += 1
    return out


def _fairseq_train_args(command: List[str]) -> List[str]:
    """fairseq-train's arguments of a recipe command (without the console script or ``python -m``)."""
    script = console_script("fairseq-train", "fairseq_cli.train")
    if command[:len(script)] != script:
        raise RuntimeError(f"not a fairseq-train command: {command[:3]}")
    return command[len(script):]


def check_flags(args: List[str], save_dir: Path, updates: int, placement: List[str]) -> List[str]:
    """A recipe's training arguments for the check: ``updates`` updates, a checkpoint half-way (kept),
    every update logged, checkpoints selected by validation nll (no BLEU decoding), ``placement``."""
    args = _without(args, ["--eval-bleu-args", "--eval-bleu-remove-bpe", "--eval-bleu-detok",
                           "--eval-bleu-detok-args", "--max-epoch", "--keep-last-epochs", "--patience"],
                    ["--eval-bleu", "--maximize-best-checkpoint-metric"])
    return with_placement(args, [
        "--max-update", str(updates), "--save-interval-updates", str(max(1, updates // 2)),
        "--keep-interval-updates", "-1", "--no-epoch-checkpoints", "--best-checkpoint-metric", "nll_loss",
        "--log-interval", "1", "--log-format", "json", "--save-dir", str(save_dir),
        "--log-file", str(save_dir / "train.log"), *placement])


def placement(planner, distils: bool, precision: str, cpu: bool) -> List[str]:
    """The recipe's batch placement (tokens per GPU, accumulation) with the check's device and precision."""
    recipe = _without(planner.placement_flags(distils), [], ["--fp16", "--cpu"])
    return recipe + (["--cpu"] if cpu else []) + PRECISION_FLAGS[precision]


def plan_trainings(data: Path, workdir: Path, methods: Sequence[str], precisions: Sequence[str], updates: int,
                   cpu: bool):
    """(the planner, the teacher's arguments, the cache and seq-KD pass commands, the trainings)."""
    options = RecipeOptions(pair=PAIR, profile="smoke" if cpu else "gpu", workdir=workdir, data=data,
                            max_update=updates, gpus=None if cpu else 1)
    planner = step_planner(options, gpus=0 if cpu else 1)
    planner.add_teacher()
    teacher_args = _fairseq_train_args(planner.steps[-1].settings["commands"][0])
    passes = {}
    planner.add_teacher_cache()
    passes["teacher-cache"] = planner.steps[-1].commands[0]
    for kind in SEQKD_DATA:
        planner.add_seqkd(kind)
        passes[planner.steps[-1].name] = planner.steps[-1].commands[0]
    trainings = []
    for method_name in methods:
        method = METHODS[method_name]
        planner.add_student(method)
        step = next(step for step in reversed(planner.steps) if step.name == f"train-{method_name}")
        recipe_args = _fairseq_train_args(step.settings["commands"][0])
        for precision in precisions:
            save_dir = workdir / "train" / method_name / precision
            args = check_flags(recipe_args, save_dir, updates, placement(planner, method.uses_teacher, precision, cpu))
            trainings.append(Training(method_name, precision, args, save_dir))
    return planner, teacher_args, passes, trainings


# ----------------------------------------------------------------------------- running


def child_environment(cpu: bool) -> dict:
    # Many trainings share the machine's cores; each is bound by its one Python thread's dispatch.
    return {**_quiet_env(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def subset_data(data: Path, dest: Path, sentences: int) -> Path:
    """``data`` with its training split cut to the first ``sentences`` pairs (the teacher passes'
    input: they are checked for running on the device, not for the corpus they make)."""
    from fairseq.data import indexed_dataset

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for path in data.iterdir():
        if path.is_file() and not path.name.startswith("train."):
            shutil.copyfile(path, dest / path.name)
    for idx in sorted(data.glob("train.*.idx")):
        prefix = str(idx.with_suffix(""))
        source = indexed_dataset.MMapIndexedDataset(prefix)
        builder = indexed_dataset.MMapIndexedDatasetBuilder(str(dest / (idx.stem + ".bin")), dtype=source._index.dtype)
        for i in range(min(sentences, len(source))):
            builder.add_item(source[i])
        builder.finalize(str(dest / idx.name))
    return dest


def checked_before(results: Path) -> set:
    """(method, precision) of the rows an earlier GPU check's report shows ok with an identical resume."""
    done = set()
    for path in sorted(results.glob("gpu_check_*.json")):
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))["trainings"]
        except (OSError, ValueError, KeyError):
            continue
        done |= {(row["method"], row["precision"]) for row in rows if row["result"].get("status") == "ok"
                 and (row["result"].get("resume") or {}).get("identical")}
    return done


def in_order(trainings: List[Training], seen: set) -> List[Training]:
    """Rows no earlier GPU check saw ok first; within each group, those reading no teacher pass before
    those waiting for one (a cut run then still adds coverage; otherwise the table's order)."""
    return sorted(trainings, key=lambda t: ((t.method, t.precision) in seen, teacher_pass_read(t.method) is not None))


def estimate(trainings: int, jobs: int, updates: int, teacher_updates: int, passes: int, benchmarks: int) -> dict:
    """Seconds of each phase on the GPU at the first lease's rates (ESTIMATE)."""
    per_training = ESTIMATE["startup"] + ESTIMATE["update"] * (updates + updates - max(1, updates // 2))
    waves = -(-(trainings + passes) // jobs)
    return {"teacher": round(ESTIMATE["startup"] / 2 + ESTIMATE["teacher_update"] * teacher_updates),
            "passes_and_trainings": round(waves * per_training + (ESTIMATE["pass"] if passes else 0)),
            "benchmark": round(ESTIMATE["benchmark"] * benchmarks)}


def run_logged(command: List[str], log: Path, env: dict, timeout: Optional[float]) -> Optional[str]:
    """Run ``command`` with its output in ``log``; None, or why it failed (its last line)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return "stopped at the time limit"
    if code == 0:
        return None
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return f"exit {code}: {lines[-1][-300:] if lines else ''}"


def train_command(args: List[str], peak_file: Path) -> List[str]:
    return [*python_module("fairseq_kd_recipes.gpu_check"), "--child-peak", str(peak_file), "--child-train", *args]


def child_train(args: List[str], peak_file: Path) -> None:
    """fairseq-train's own ``cli_main`` in this process, then its peak memory into ``peak_file``."""
    import resource

    import torch

    import fairseq_kd
    from fairseq_cli.train import cli_main

    fairseq_kd.register()  # imported here before fairseq's --user-dir import, which then does nothing
    if "--log-file" in args:  # fairseq opens it before it makes the save folder
        Path(args[args.index("--log-file") + 1]).parent.mkdir(parents=True, exist_ok=True)
    sys.argv = ["fairseq-train", *args]
    cli_main()
    if torch.cuda.is_available() and "--cpu" not in args:
        peak = {"peak_mb": torch.cuda.max_memory_allocated() / 2**20, "peak_kind": "cuda_max_allocated"}
    else:
        peak = {"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak_kind": "max_rss"}
    peak_file.write_text(json.dumps(peak))


def log_findings(log: Path) -> dict:
    """What a training's output says: updates logged, non-finite statistics, overflows, the last
    loss scale and the median target tokens per second (after the first tenth of the updates)."""
    from fairseq_kd.figures.training_log import parse_fairseq_log

    text = log.read_text(encoding="utf-8", errors="replace").splitlines() if log.is_file() else []
    records = parse_fairseq_log(text)
    inner = [record for record in records if record.split == "train_inner"]
    nonfinite = [f"{record.split} {key} at update {int(record.num_updates or 0)}"
                 for record in records for key in record.nonfinite]
    speeds = sorted(record.values["wps"] for record in inner[len(inner) // 10:] if "wps" in record.values)
    scales = [record.values["loss_scale"] for record in inner if "loss_scale" in record.values]
    return {"updates_logged": len(inner), "nonfinite": nonfinite[:5], "finite": not nonfinite and bool(inner),
            "overflows": sum(OVERFLOW_MARK in line for line in text), "final_loss_scale": scales[-1] if scales else None,
            "target_tokens_per_s": speeds[len(speeds) // 2] if speeds else None}


def per_update(log: Path) -> Dict[int, Dict[str, float]]:
    from fairseq_kd.figures.training_log import parse_fairseq_log

    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return {int(record.num_updates): {key: value for key, value in record.values.items() if key not in TIMING_KEYS}
            for record in parse_fairseq_log(lines) if record.split == "train_inner" and record.num_updates}


def compare_resume(first: Path, resumed: Path) -> dict:
    """The resumed run against the first over the updates both logged, and their final parameters."""
    import torch

    from fairseq_kd.checkpoints import safe_load

    a, b = per_update(first / "run.log"), per_update(resumed / "run.log")
    common = sorted(set(a) & set(b))
    loss_diff = max((abs(a[u][k] - b[u][k]) for u in common for k in a[u] if k in b[u] and "loss" in k), default=None)
    same_logs = bool(common) and all(a[u] == b[u] for u in common)
    params_a = safe_load(first / "checkpoint_last.pt")["model"]
    params_b = safe_load(resumed / "checkpoint_last.pt")["model"]
    if params_a.keys() != params_b.keys():
        return {"identical": False, "compared_updates": len(common), "max_loss_diff": loss_diff,
                "max_param_diff": None, "note": "the checkpoints hold different parameters"}
    param_diff = max((float((params_a[k].float() - params_b[k].float()).abs().max()) for k in params_a
                      if torch.is_tensor(params_a[k]) and params_a[k].numel()), default=0.0)
    return {"identical": same_logs and param_diff == 0.0, "compared_updates": len(common),
            "max_loss_diff": loss_diff, "max_param_diff": param_diff}


def keep_log(source: Path, logs: Optional[Path], name: str) -> None:
    """A copy of a log in ``logs`` itself (the device tool returns no deeply nested folder)."""
    if logs is not None and source.is_file():
        logs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, logs / f"{name.replace('/', '-')}.log")


def run_training(training: Training, updates: int, env: dict, deadline: float, logs: Optional[Path] = None) -> dict:
    """The first run, then the resume from its half-way checkpoint into a second folder."""
    if time.monotonic() > deadline:
        return {"status": "not run: time limit"}
    started = time.monotonic()
    first, resumed = training.save_dir / "first", training.save_dir / "resumed"
    shutil.rmtree(training.save_dir, ignore_errors=True)
    first_args = with_placement(training.args, ["--save-dir", str(first), "--log-file", str(first / "train.log")])
    failure = run_logged(train_command(first_args, first / "peak.json"), first / "run.log", env,
                         max(1.0, deadline - time.monotonic()) + GRACE)
    keep_log(first / "run.log", logs, f"{training.name}-first")
    result = {"status": "ok", **log_findings(first / "run.log")}
    if failure:
        return {**result, "status": f"failed: {failure}", "seconds": round(time.monotonic() - started, 1)}
    result.update(json.loads((first / "peak.json").read_text()))
    middle = sorted(first.glob(f"checkpoint_*_{max(1, updates // 2)}.pt"))
    if not middle:
        result["resume"] = {"identical": False, "note": f"no checkpoint at update {max(1, updates // 2)}"}
    else:
        resumed.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(middle[0], resumed / "checkpoint_last.pt")
        resume_args = with_placement(training.args, ["--save-dir", str(resumed),
                                                     "--log-file", str(resumed / "train.log")])
        failure = run_logged(train_command(resume_args, resumed / "peak.json"), resumed / "run.log", env,
                             max(1.0, deadline - time.monotonic()) + GRACE)
        keep_log(resumed / "run.log", logs, f"{training.name}-resumed")
        result["resume"] = ({"identical": False, "note": f"resume failed: {failure}"} if failure
                            else compare_resume(first, resumed))
        result["resume_finite"] = log_findings(resumed / "run.log")["finite"]
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


# ----------------------------------------------------------------------------- report


def _number(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def resume_text(resume: Optional[dict]) -> str:
    if not resume:
        return "-"
    if resume.get("note"):
        return resume["note"]
    if resume["identical"]:
        return f"identical ({resume['compared_updates']} updates)"
    return f"differs: loss {resume['max_loss_diff']:.3g}, parameters {resume['max_param_diff']:.3g}"


def coverage(report: dict) -> str:
    """The preface: the commit and what the run covered, counted from its rows and steps."""
    rows = [row["result"] for row in report["trainings"]]
    ok = [r for r in rows if r.get("status") == "ok"]
    same = sum(bool((r.get("resume") or {}).get("identical")) for r in ok)
    unrun = sum(str(r.get("status", "not run")).startswith("not run") for r in rows)
    steps = ", ".join(f"{step['name']} {step['status']}" for step in report["steps"]) or "none"
    bench = ", ".join(f"{p} {b.get('status')}" for p, b in report["benchmark"].items()) or "not reached"
    return (f"Covered (commit {report['header'].get('commit')}): {len(ok)} of {len(rows)} trainings ok, "
            f"{same} of them resumed bit-identically, {len(rows) - len(ok) - unrun} failed or unfinished, {unrun} not run; "
            f"steps: {steps}; benchmark: {bench}.")


def to_markdown(report: dict) -> str:
    header = report["header"]
    lines = [coverage(report), "", f"# GPU check: {header.get('device')}", "",
             "; ".join(f"{key} {value}" for key, value in header.items()), "",
             f"Trainings: the recipe's commands for {PAIR} ({report['profile']} profile), {report['updates']} updates, "
             f"resumed from update {max(1, report['updates'] // 2)}; {report['jobs']} at a time on the device; "
             f"teacher passes on {report.get('pass_sentences') or 'all'} training pairs.", "",
             "| method | precision | status | updates logged | loss terms finite | overflows (last scale) | "
             "target tok/s | peak MB | resume | s |",
             "|---|---|---|---:|---|---:|---:|---:|---|---:|"]
    for row in report["trainings"]:
        r = row["result"]
        finite = "-" if "finite" not in r else ("yes" if r["finite"] and r.get("resume_finite", True)
                                                else "NO: " + "; ".join(r.get("nonfinite") or ["resume"]))
        overflows = "-" if "overflows" not in r else (
            f"{r['overflows']} ({_number(r['final_loss_scale'], 0)})" if r.get("final_loss_scale") else str(r["overflows"]))
        lines.append(f"| {row['method']} | {row['precision']} | {r.get('status', 'pending')} | "
                     f"{r.get('updates_logged', '-')} | {finite} | {overflows} | {_number(r.get('target_tokens_per_s'))} | "
                     f"{_number(r.get('peak_mb'))} | {resume_text(r.get('resume'))} | {r.get('seconds', '-')} |")
    lines.append("")
    lines += [f"- {step['name']}: {step['status']} ({step['seconds']} s)" for step in report["steps"]]
    for precision, bench in report["benchmark"].items():
        lines += ["", f"## Benchmark rows, {precision}", "", bench.get("markdown") or bench.get("status", "")]
    return "\n".join(lines) + "\n"


class Report:
    """The check's JSON and Markdown, rewritten whole after every step (a cut run keeps what ended)."""

    def __init__(self, out: Path, header: dict, profile: str, updates: int, jobs: int, trainings: List[Training],
                 pass_sentences: Optional[int] = None):
        self.out, self._lock = out, threading.Lock()
        self.data = {"header": header, "profile": profile, "updates": updates, "jobs": jobs, "steps": [],
                     "pass_sentences": pass_sentences,
                     "trainings": [{"method": t.method, "precision": t.precision, "result": t.result}
                                   for t in trainings], "benchmark": {}}

    def write(self) -> None:
        with self._lock:
            self.out.mkdir(parents=True, exist_ok=True)
            for suffix, text in (("json", json.dumps(self.data, indent=2, default=str)), ("md", to_markdown(self.data))):
                replace_atomically(self.out / f"{REPORT_NAME}.{suffix}", lambda handle: handle.write(text.encode()))


def say(line: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {line}", flush=True)


def teacher_pass_read(method_name: str) -> Optional[str]:
    """The offline teacher pass a method's training reads (its cache or its distilled corpus), if any."""
    method = METHODS[method_name]
    return "teacher-cache" if method.teacher_cache else None if method.data == "original" else (
        method.data.replace("_", "-") + "-data")


def run_step(report: Report, name: str, command: List[str], log: Path, env: dict, deadline: float) -> bool:
    started = time.monotonic()
    failure = ("not run: time limit" if time.monotonic() > deadline
               else run_logged(command, log, env, max(1.0, deadline - time.monotonic()) + GRACE))
    status = failure or "ok"
    report.data["steps"].append({"name": name, "status": status, "seconds": round(time.monotonic() - started, 1),
                                 "log": str(log)})
    report.write()
    say(f"{name}: {status} ({time.monotonic() - started:.0f} s)")
    return failure is None


def run_benchmark(report: Report, precision: str, rows: Sequence[str], cpu: bool, workdir: Path, out: Path,
                  env: dict, deadline: float) -> None:
    config = "tiny" if cpu else "small"
    bench_out = workdir / f"benchmark-{precision}"
    steps = ["--steps", "2", "--warmup", "1"] if cpu else ["--steps", "20", "--warmup", "5"]
    command = [*python_module("fairseq_kd_recipes.benchmark"), "--configs", config, "--methods", *rows,
               "--precision", precision, "--repeats", "1", *steps, "--workdir", str(workdir / "benchmark"),
               "--output-dir", str(bench_out)]
    started = time.monotonic()
    failure = ("not run: time limit" if time.monotonic() > deadline
               else run_logged(command, out / f"log_benchmark-{precision}.log", env,
                                max(1.0, deadline - time.monotonic()) + GRACE))
    entry = {"config": config, "status": failure or "ok", "seconds": round(time.monotonic() - started, 1)}
    if failure is None:
        entry["markdown"] = (bench_out / "benchmark.md").read_text(encoding="utf-8")
        entry["report"] = json.loads((bench_out / "benchmark.json").read_text(encoding="utf-8"))
    report.data["benchmark"][precision] = entry
    report.write()
    say(f"benchmark {config} {precision}: {entry['status']} ({entry['seconds']} s)")


def check(out: Path, data: Path, workdir: Path, methods: Sequence[str], precisions: Sequence[str], updates: int,
          teacher_updates: int, jobs: int, cpu: bool, time_limit: float, benchmark_reserve: float,
          benchmark_rows: Sequence[str] = BENCHMARK_ROWS, commit: Optional[str] = None,
          pass_sentences: Optional[int] = None, results: Optional[Path] = None) -> dict:
    started = time.monotonic()
    deadline = started + time_limit
    training_deadline = deadline - benchmark_reserve
    env = child_environment(cpu)
    planner, teacher_args, passes, trainings = plan_trainings(data.resolve(), workdir.resolve(), methods, precisions,
                                                              updates, cpu)
    logs = out.resolve()  # logs flat in OUT: the device tool returns no deeply nested folder
    report = Report(out, machine_header(cpu, commit), "smoke" if cpu else "gpu", updates, jobs, trainings,
                    pass_sentences)  # the table in the method table's order, run in in_order's
    seen = checked_before(results) if results is not None else set()
    trainings = in_order(trainings, seen)
    report.write()
    needed = {teacher_pass_read(t.method) for t in trainings} - {None}
    phases = estimate(len(trainings), jobs, updates, teacher_updates, len(needed),
                      len(precisions) if benchmark_rows else 0)
    say(f"{len(trainings)} trainings ({len(methods)} methods x {', '.join(precisions)}), {jobs} at a time, "
        f"{len(trainings) - sum((t.method, t.precision) in seen for t in trainings)} never checked on a GPU first; "
        f"report in {out}/{REPORT_NAME}.md")
    say(f"estimate on a GPU at the first lease's rates: {phases} = {sum(phases.values())} s of {time_limit:.0f} s "
        f"(benchmark reserve {benchmark_reserve:.0f} s); rows still waiting at the limit are reported 'not run: "
        f"time limit'")

    teacher_dir = planner.save_dir(TEACHER)
    shutil.rmtree(teacher_dir, ignore_errors=True)
    teacher_precision = [] if cpu else PRECISION_FLAGS["fp16"]
    teacher = check_flags(teacher_args, teacher_dir, teacher_updates,
                          placement(planner, False, "fp32", cpu) + teacher_precision)
    if not run_step(report, f"teacher ({teacher_updates} updates)", train_command(teacher, teacher_dir / "peak.json"),
                    logs / "log_teacher.log", env, training_deadline):
        return report.data
    # The teacher passes run beside the trainings that do not read them; those that do wait for theirs
    # (submitted after both passes, so a pass has always started when one waits for it).
    outputs = {"teacher-cache": planner.teacher_cache,
               **{kind.replace("_", "-") + "-data": planner.seqkd_folder(kind) for kind in SEQKD_DATA}}

    pass_data = None
    if pass_sentences and needed - {"teacher-cache"}:  # the cache must cover the corpus its rows train on
        pass_data = subset_data(planner.data, workdir.resolve() / "data-pass-subset", pass_sentences)

    def teacher_pass(name: str) -> bool:
        shutil.rmtree(outputs[name], ignore_errors=True)
        command = list(passes[name])
        if pass_data is not None and name != "teacher-cache":
            command[command.index("--data") + 1] = str(pass_data)
        return run_step(report, name, command, logs / f"log_{name}.log", env, training_deadline)

    def one(training: Training, needs=None) -> Training:
        if needs is not None and not needs.result():
            training.result["status"] = "not run: its teacher pass failed"
        else:
            training.result.update(run_training(training, updates, env, training_deadline, logs))
        return training

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        pending = {name: pool.submit(teacher_pass, name) for name in outputs
                   if any(teacher_pass_read(t.method) == name for t in trainings)}
        futures = [pool.submit(one, t, pending.get(teacher_pass_read(t.method))) for t in trainings]
        for done, future in enumerate(futures, 1):
            training = future.result()
            r = training.result
            report.write()
            detail = (f"{r.get('updates_logged')} updates, finite {r.get('finite')}, overflows {r.get('overflows')}, "
                      f"{_number(r.get('target_tokens_per_s'))} tok/s, {_number(r.get('peak_mb'))} MB, "
                      f"resume {resume_text(r.get('resume'))}" if r.get("status") == "ok" else "")
            say(f"[{done}/{len(trainings)}] {training.name}: {r.get('status')} {detail}")
    for precision in precisions if benchmark_rows else ():
        run_benchmark(report, precision, benchmark_rows, cpu, workdir, out, env, deadline)
    say(f"done in {time.monotonic() - started:.0f} s: {out}/{REPORT_NAME}.md")
    return report.data


def cli_main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, nargs="?", help="where gpu_check.md and gpu_check.json are written")
    parser.add_argument("--data", type=Path, help=f"the binarised {PAIR} corpus (python -m "
                        f"fairseq_kd_recipes.prepare.scripts.{PAIR}, or the kit's data-bin)")
    parser.add_argument("--workdir", type=Path, help="checkpoints and logs (default: OUTPUT_DIR/work)")
    parser.add_argument("--cpu", action="store_true",
                        help="the same check on the CPU with the smoke profile's tiny models (a dry run)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), metavar="METHOD",
                        help="rows of the method table (default: all)")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISION_FLAGS),
                        help="default: fp16 bf16 (--cpu: bf16)")
    parser.add_argument("--updates", type=int, help="updates per training (default: 40; --cpu: 4)")
    parser.add_argument("--teacher-updates", type=int, help="updates of the teacher (default: 200; --cpu: 4)")
    parser.add_argument("--jobs", type=int, help="trainings at once (default: 16, one CPU core each on a 16-core "
                        "GPU machine; --cpu: 1)")
    parser.add_argument("--pass-sentences", type=int, help="training pairs the seq-KD passes decode, the first "
                        "ones (default: 2000; --cpu: all); the top-k cache always covers the whole split")
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[3] / "docs" / "results",
                        help="earlier gpu_check_*.json reports: the rows none saw ok run first (default: %(default)s)")
    parser.add_argument("--time-limit", type=float, default=510.0,
                        help="seconds for the whole check; nothing starts after it (default: %(default)s)")
    parser.add_argument("--benchmark-reserve", type=float, help="seconds of the limit kept for the benchmark rows "
                        "(default: 90; --cpu: 0)")
    parser.add_argument("--benchmark-rows", nargs="*", default=list(BENCHMARK_ROWS), metavar="ROW",
                        help="rows of fairseq_kd_recipes.benchmark timed after the trainings, per precision, at "
                             "the IWSLT shape (--cpu: the tiny one); none: no benchmark (default: %(default)s)")
    parser.add_argument("--commit", help="the commit checked, where the folder is no git checkout")
    parser.add_argument("--child-train", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--child-peak", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_train is not None:
        child_train(args.child_train, args.child_peak)
        return
    if args.output_dir is None or args.data is None:
        parser.error("give the output folder and --data")
    from .plan import check_prepared_data
    from .pairs import PAIRS

    check_prepared_data(PAIRS[PAIR], args.data)
    cpu = args.cpu
    updates = args.updates or (4 if cpu else 40)
    for flag, value in (("--updates", updates), ("--jobs", args.jobs or 1), ("--pass-sentences", args.pass_sentences or 1),
                        ("--teacher-updates", args.teacher_updates or 1), ("--time-limit", args.time_limit)):
        if value <= 0:
            parser.error(f"{flag} must be positive, got {value}")
    if not cpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("no GPU that torch can use (torch.cuda.is_available() is False); add --cpu for the dry run")
    check(args.output_dir, args.data, args.workdir or args.output_dir / "work", args.methods or list(METHODS),
          args.precisions or (["bf16"] if cpu else ["fp16", "bf16"]), updates,
          args.teacher_updates or (4 if cpu else 200), args.jobs or (1 if cpu else 16), cpu, args.time_limit,
          args.benchmark_reserve if args.benchmark_reserve is not None else (0.0 if cpu else 90.0),
          args.benchmark_rows, args.commit, args.pass_sentences or (None if cpu else 2000), args.results)


if __name__ == "__main__":
    cli_main()
