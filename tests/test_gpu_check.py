"""The GPU check (fairseq_kd_recipes.gpu_check, scripts/gpu_check.sh): its CPU dry run end to end on
tiny models, and what its GPU run would start (every row of the method table in fp16 and bf16, the
commands fairseq-train's parser accepts), so that the check cannot rot between GPU leases."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BIN, REPO, run_cli, run_warm, write_reverse_corpus
from fairseq_kd_recipes import gpu_check
from fairseq_kd_recipes.methods import METHODS


@pytest.fixture(scope="module")
def fr_en_data_bin(tmp_path_factory) -> Path:
    """The suite's tiny reordering corpus, binarised as the check's pair (fr-en, joined dictionary)."""
    root = tmp_path_factory.mktemp("gpu_check_data")
    raw = write_reverse_corpus(root / "raw")
    for split in ("train", "valid", "test"):
        (raw / f"{split}.src").rename(raw / f"{split}.fr")
        (raw / f"{split}.tgt").rename(raw / f"{split}.en")
    run_cli("fairseq-preprocess", "-s", "fr", "-t", "en", "--trainpref", raw / "train", "--validpref", raw / "valid",
            "--testpref", raw / "test", "--destdir", root / "bin", "--joined-dictionary", "--workers", "1", warm=True)
    return root / "bin"


DRY_RUN_METHODS = ["a2d_kd", "word_kd_cached"]


def _console_script_of(module: str):
    from importlib.metadata import entry_points

    for entry in entry_points(group="console_scripts"):
        if entry.value == f"{module}:cli_main" and (BIN / entry.name).is_file():
            return BIN / entry.name
    return None


@pytest.fixture(scope="module")
def dry_run(fr_en_data_bin, tmp_path_factory):
    """The check's CPU dry run (its default 4 updates, bf16), no benchmark rows (test_benchmark runs
    them in bf16). The teacher runs through the check's own child (a new process that records its
    peak memory); the trainings' fairseq-train and the teacher passes' commands run in children of
    the warm interpreter (the same command lines, environment and logs, without each new process's
    seconds of imports), with a stand-in peak."""
    original = gpu_check.run_logged

    def run_warm_where_possible(command, log, env, timeout):
        command = [str(part) for part in command]
        module = command[2] if command[:2] == [sys.executable, "-m"] else None
        if module == "fairseq_kd_recipes.gpu_check" and "teacher" not in Path(command[4]).parts:
            warm, peak = [str(BIN / "fairseq-train"), *command[command.index("--child-train") + 1:]], Path(command[4])
        elif module is not None and _console_script_of(module) is not None:
            warm, peak = [str(_console_script_of(module)), *command[3:]], None
        else:
            return original(command, log, env, timeout)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        status = run_warm(warm, env, log, log, timeout=timeout)
        if status is None:
            return original(command, log, env, timeout)
        if peak is not None and status == 0:
            peak.write_text(json.dumps({"peak_mb": 1.0, "peak_kind": "not measured (warm test child)"}))
        return None if status == 0 else f"exit {status}: {log.read_text()[-300:]}"

    patch = pytest.MonkeyPatch()
    patch.setattr(gpu_check, "run_logged", run_warm_where_possible)
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    try:
        gpu_check.cli_main([str(out), "--cpu", "--data", str(fr_en_data_bin), "--methods", *DRY_RUN_METHODS,
                            "--benchmark-rows"])
    finally:
        patch.undo()
    return out


def test_the_dry_run_trains_resumes_and_reports_every_row(dry_run):
    """Each method trains in bf16 on the CPU with finite loss terms on every update, its resume from
    the half-way checkpoint repeats the uninterrupted run exactly (same logged losses and final
    parameters: the CPU is deterministic), and the report holds every row, the teacher passes and
    the benchmark's rows in the same precision."""
    report = json.loads((dry_run / "gpu_check.json").read_text())
    assert report["header"]["device"] == "cpu" and "commit" in report["header"]  # None outside a git checkout
    assert {step["name"].split(" ")[0]: step["status"] for step in report["steps"]} == {
        "teacher": "ok", "teacher-cache": "ok"}  # no seq_kd row: no seq-KD pass
    rows = {(row["method"], row["precision"]): row["result"] for row in report["trainings"]}
    assert set(rows) == {(method, "bf16") for method in DRY_RUN_METHODS}
    for (method, _), result in rows.items():
        assert result["status"] == "ok", (method, result)
        assert result["updates_logged"] == report["updates"] and result["finite"] and result["resume_finite"]
        assert result["overflows"] == 0 and result["final_loss_scale"] is None  # bf16: no loss scaling
        assert result["target_tokens_per_s"] > 0 and result["peak_mb"] > 0
        resume = result["resume"]
        assert resume["identical"], (method, resume)
        assert resume["compared_updates"] == report["updates"] // 2 and resume["max_param_diff"] == 0.0
    teacher_peak = json.loads((dry_run / "work" / "train" / "teacher" / "peak.json").read_text())
    assert teacher_peak["peak_kind"] == "max_rss" and teacher_peak["peak_mb"] > 50  # torch alone is more
    assert report["benchmark"] == {}
    markdown = (dry_run / "gpu_check.md").read_text()
    for method in DRY_RUN_METHODS:
        assert f"| {method} | bf16 | ok |" in markdown
    assert markdown.startswith(f"Covered (commit {report['header']['commit']}): 2 of 2 trainings ok, 2 of them "
                               "resumed bit-identically, 0 failed or unfinished, 0 not run;")
    # every log directly in OUT: the device tool returns no deeply nested folder
    for name in ("log_teacher", "log_teacher-cache", *(f"{m}-bf16-{run}" for m in DRY_RUN_METHODS
                                                       for run in ("first", "resumed"))):
        assert (dry_run / f"{name}.log").stat().st_size > 0, name


def test_the_resume_starts_half_way_and_the_methods_own_terms_are_logged(dry_run):
    log = (dry_run / "work" / "train" / "a2d_kd" / "bf16" / "resumed" / "run.log").read_text()
    assert "Loaded checkpoint" in log and "(epoch" in log
    first = gpu_check.per_update(dry_run / "work" / "train" / "a2d_kd" / "bf16" / "first" / "run.log")
    resumed = gpu_check.per_update(dry_run / "work" / "train" / "a2d_kd" / "bf16" / "resumed" / "run.log")
    assert sorted(first) == list(range(1, 5)) and sorted(resumed) == [3, 4]
    assert any(key.startswith("a2d") or "attn" in key for key in first[1]), first[1]  # the method's own terms


def test_the_gpu_run_trains_every_row_in_fp16_and_bf16_with_commands_fairseq_accepts(tmp_path):
    """What the check starts on a GPU (planned here without one): one training per row of the method
    table and precision, each the recipe's fairseq-train command with the check's budget, half-way
    checkpoint and nll selection, on the GPU (no --cpu) in its precision; fairseq-train's parser
    takes every one, and --bf16 does not turn into --tpu."""
    from fairseq import options

    import fairseq_kd

    data = tmp_path / "data-bin"
    planner, teacher_args, passes, trainings = gpu_check.plan_trainings(
        data, tmp_path / "work", list(METHODS), ["fp16", "bf16"], 200, cpu=False)
    assert [(t.method, t.precision) for t in trainings] == [(m, p) for m in METHODS for p in ("fp16", "bf16")]
    assert "--fp16" in passes["teacher-cache"] and "--fp16" in passes["seqkd-data"]
    fairseq_kd.register()
    for training in trainings:
        args = training.args
        assert "--cpu" not in args and f"--{training.precision}" in args
        assert "--eval-bleu" not in args and "--max-epoch" not in args
        value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
        assert value("--max-update") == "200" and value("--save-interval-updates") == "100"
        assert value("--best-checkpoint-metric") == "nll_loss" and value("--log-interval") == "1"
        assert args.count("--max-update") == 1 and args.count("--save-dir") == 1
        if METHODS[training.method].teacher_cache:
            assert value("--teacher-cache") == str(planner.teacher_cache)
        if METHODS[training.method].data == "seqkd":
            assert args[0] == str(planner.seqkd_data)
        parsed = options.parse_args_and_arch(options.get_training_parser(), args)
        assert parsed.criterion == METHODS[training.method].criterion
        assert bool(parsed.fp16) == (training.precision == "fp16") and bool(parsed.bf16) == (training.precision == "bf16")
        assert not parsed.tpu
    assert "--fp16" not in teacher_args and teacher_args[teacher_args.index("--task") + 1] == "translation"


def test_the_log_reading_finds_non_finite_terms_overflows_and_the_loss_scale(tmp_path):
    prefix = "2026-11-28 10:00:00 | INFO | train_inner | "
    lines = [
        prefix + json.dumps({"epoch": 1, "update": 0.1, "loss": "9.1", "a2d_loss": "1.5", "wps": "1000",
                             "loss_scale": "128", "num_updates": "1"}),
        "2026-11-28 10:00:01 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, "
        "setting loss scale to: 64.0",
        prefix + json.dumps({"epoch": 1, "update": 0.2, "loss": "8.9", "a2d_loss": "nan", "wps": "3000",
                             "loss_scale": "64", "num_updates": "2"}),
        "2026-11-28 10:00:02 | INFO | valid | " + json.dumps({"epoch": 1, "valid_loss": "inf", "valid_num_updates": "2"}),
    ]
    (tmp_path / "run.log").write_text("\n".join(lines) + "\n")
    found = gpu_check.log_findings(tmp_path / "run.log")
    assert found["updates_logged"] == 2 and not found["finite"]
    assert found["nonfinite"] == ["train_inner a2d_loss at update 2", "valid loss at update 2"]
    assert found["overflows"] == 1 and found["final_loss_scale"] == 64.0
    assert found["target_tokens_per_s"] == 3000.0


def test_the_benchmark_rows_run_in_each_precision_through_the_benchmarks_own_command(tmp_path, monkeypatch):
    """run_benchmark's command is one the benchmark's command line takes (its run stubbed here; the
    benchmark's bf16 step itself: tests/test_benchmark.py), and its report lands in the check's."""
    from fairseq_kd_recipes import benchmark

    asked = {}

    def fake_run(configs, methods, steps, warmup, repeats, workdir, top_ops=0, paired=False, shuffle_seed=None,
                 precision="fp32"):
        asked.update(configs=configs, methods=methods, repeats=repeats, precision=precision)
        return {"small": {"config": benchmark.CONFIGS["small"], "precision": precision, "methods": {},
                          "decoding": {"teacher": 1.0, "student": 2.0, "student_speedup": 2.0}}}

    def in_process(command, log, env, timeout):
        assert command[:3] == [sys.executable, "-m", "fairseq_kd_recipes.benchmark"]
        benchmark.cli_main(command[3:])
        return None

    monkeypatch.setattr(benchmark, "run", fake_run)
    monkeypatch.setattr(gpu_check, "run_logged", in_process)
    report = gpu_check.Report(tmp_path / "out", {"device": "x"}, "gpu", 200, 6, [])
    gpu_check.run_benchmark(report, "bf16", gpu_check.BENCHMARK_ROWS, False, tmp_path, tmp_path / "out", {},
                            deadline=float("inf"))
    assert asked == {"configs": ["small"], "methods": ["plain", "limit", "word_kd", "a2d_kd", "word_kd_on_policy"],
                     "repeats": 1,
                     "precision": "bf16"}
    entry = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["benchmark"]["bf16"]
    assert entry["status"] == "ok" and entry["report"]["small"]["precision"] == "bf16"
    assert "## Benchmark rows, bf16" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_gpu_check_sh_refuses_a_missing_kit_in_one_line(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "GPU_KIT": str(tmp_path / "kit")})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu_check.sh: no kit in {tmp_path / 'kit'}: run bash scripts/gpu_kit.sh first"]
    for script in ("gpu_check.sh", "gpu_kit.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / "scripts" / script)]).returncode == 0


def test_the_rows_no_earlier_gpu_check_saw_ok_run_first(tmp_path):
    """A row counts as checked when an earlier report has it ok with an identical resume (not when it
    failed, was cut or its resume was); unchecked rows keep the table's order, those reading no
    teacher pass before those that wait for one."""
    earlier = [("no_kd", "fp16", "ok", True), ("word_kd", "bf16", "ok", False), ("tie_kd", "fp16", "not run: x", None),
               ("seq_kd", "bf16", "ok", True)]
    (tmp_path / "gpu_check_x_2026-01-01.json").write_text(json.dumps({"trainings": [
        {"method": m, "precision": p, "result": {"status": st, **({"resume": {"identical": same}} if same is not None
                                                                 else {})}} for m, p, st, same in earlier]}))
    (tmp_path / "gpu_check_broken.json").write_text("{")
    seen = gpu_check.checked_before(tmp_path)
    assert seen == {("no_kd", "fp16"), ("seq_kd", "bf16")}
    rows = [gpu_check.Training(m, p, [], tmp_path) for m in ("no_kd", "seq_kd", "word_kd", "tie_kd") for p in ("fp16", "bf16")]
    names = [t.name for t in gpu_check.in_order(rows, seen)]
    assert names == ["no_kd/bf16", "word_kd/fp16", "word_kd/bf16", "tie_kd/fp16", "tie_kd/bf16", "seq_kd/fp16",
                     "no_kd/fp16", "seq_kd/bf16"]


def test_the_pass_subset_is_the_first_pairs_with_the_other_splits_and_dictionaries_as_they_were(fr_en_data_bin, tmp_path):
    from fairseq.data import data_utils, Dictionary

    subset = gpu_check.subset_data(fr_en_data_bin, tmp_path / "subset", 3)
    for lang in ("fr", "en"):
        dictionary = Dictionary.load(str(fr_en_data_bin / f"dict.{lang}.txt"))
        full = data_utils.load_indexed_dataset(str(fr_en_data_bin / f"train.fr-en.{lang}"), dictionary)
        cut = data_utils.load_indexed_dataset(str(subset / f"train.fr-en.{lang}"), dictionary)
        assert len(full) > 3 and len(cut) == 3
        assert [cut[i].tolist() for i in range(3)] == [full[i].tolist() for i in range(3)]
    others = sorted(p.name for p in fr_en_data_bin.iterdir() if not p.name.startswith("train."))
    assert sorted(p.name for p in subset.iterdir() if not p.name.startswith("train.")) == others
    for name in others:
        assert (subset / name).read_bytes() == (fr_en_data_bin / name).read_bytes()


def test_the_plan_estimate_counts_waves_of_jobs():
    rate = gpu_check.ESTIMATE
    phases = gpu_check.estimate(trainings=31, jobs=16, updates=40, teacher_updates=200, passes=1, benchmarks=2)
    per_training = rate["startup"] + rate["update"] * (40 + 20)  # the first run and its resume's 20
    assert phases["passes_and_trainings"] == round(2 * per_training + rate["pass"])  # 32 slots: two waves
    assert phases["teacher"] == round(rate["startup"] / 2 + 200 * rate["teacher_update"])
    assert phases["benchmark"] == round(2 * rate["benchmark"])
