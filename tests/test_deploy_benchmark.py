"""fairseq-kd-deploy-benchmark on the tiny corpus: the teacher and a smaller student under fairseq,
the student under CTranslate2 (float32, int8); every row and column written, the float32
CTranslate2 row scoring like the fairseq student, a re-run reusing every decode, refusals in one
line naming the flag. (Timings are only checked for being there, never for their values.)"""
import json
from pathlib import Path

import pytest

from conftest import COMMON_TRAIN_ARGS, USER_DIR, run_cli
from fairseq_kd_recipes import deploy_benchmark

pytest.importorskip("ctranslate2")

STUDENT_ARGS = [
    "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]
COLUMNS = ["system", "engine", "weights", "BLEU", "95% CI", "Δ", "p", "chrF", "chrF++", "size MB", "sent/s T=1 B=16",
           "tok/s T=1 B=16", "speed-up T=1 B=16", "peak MB T=1 B=16"]


@pytest.fixture(scope="module")
def tiny_plain_student(tiny_data_bin, tmp_path_factory) -> Path:
    """A 1+1-layer model trained for 40 updates: a third of the teacher's size, and (unlike a 20-update
    TINY_STUDENT_ARGS model, which says one word) output long enough for BLEU above 0."""
    save = tmp_path_factory.mktemp("deploy_student")
    run_cli("fairseq-train", tiny_data_bin, "--task", "translation", *STUDENT_ARGS,
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            *COMMON_TRAIN_ARGS, "--lr", "0.005", "--max-update", "40", "--save-dir", save, "--user-dir", USER_DIR,
            warm=True)
    return save / "checkpoint_last.pt"


def _argv(data, teacher, student, out: Path, *extra):
    return ["--data", str(data), "--teacher", str(teacher), "--student", f"small={student}",
            "--quantizations", "float32,int8", "--threads", "1", "--batch-sizes", "16", "--bootstrap", "100", "--ar-trials", "100",
            "--workdir", str(out / "work"), "--output-md", str(out / "bench.md"),
            "--output-json", str(out / "bench.json"), *extra]


@pytest.fixture(scope="module")
def first_run(tiny_data_bin, tiny_teacher, tiny_plain_student, tmp_path_factory):
    out = tmp_path_factory.mktemp("deploy_bench")
    argv = _argv(tiny_data_bin, tiny_teacher, tiny_plain_student, out)
    assert deploy_benchmark.run(argv) == 0
    return out, argv


def test_tables_hold_every_row_and_column(first_run):
    out, _ = first_run
    report = json.loads((out / "bench.json").read_text())
    ids = [row["id"] for row in report["rows"]]
    assert ids == ["teacher/fairseq/float32", "small/fairseq/float32", "small/ctranslate2/float32",
                   "small/ctranslate2/int8"]
    assert report["decodes"] == {"run": 4, "reused": 0}
    rows = {row["id"]: row for row in report["rows"]}
    for row in report["rows"]:
        (m,) = row["measurements"]
        assert m["threads"] == 1 and m["batch_size"] == 16 and m["sentences"] == 40
        assert m["sentences_per_s"] > 0 and m["tokens_per_s"] > 0 and m["peak_rss_bytes"] > 10 * 2**20
        assert m["speedup_vs_teacher"] > 0 and row["size_bytes"] > 0 and row["ci"] is not None
        assert row["outputs_identical"]["across_threads"] is True
    assert rows["teacher/fairseq/float32"]["measurements"][0]["speedup_vs_teacher"] == 1.0
    assert rows["teacher/fairseq/float32"]["baseline"] == "small/fairseq/float32"
    assert rows["small/fairseq/float32"]["p_bootstrap"] is None
    ct2 = rows["small/ctranslate2/float32"]
    fairseq_student = rows["small/fairseq/float32"]
    assert ct2["baseline"] == "small/fairseq/float32" and ct2["p_bootstrap"] is not None
    assert ct2["p_randomization"] is not None
    assert fairseq_student["bleu"] > 0 and abs(ct2["bleu"] - fairseq_student["bleu"]) <= 1.0
    # chrF and chrF++ beside BLEU: sacreBLEU's CHRF (word_order 0 and 2) of the scored text
    from sacrebleu.metrics.chrf import CHRF
    from fairseq_kd.scoring.detok import read_generate_output

    scored = read_generate_output(Path(ct2["scored_output"]))  # no detokenisation flags here
    for key, order in (("chrf", 0), ("chrfpp", 2)):
        assert ct2[key] == CHRF(word_order=order).corpus_score(scored.hypotheses, [scored.references]).score
    # float32 CTranslate2 gives fairseq's tokens (beam search may part on a rare tie)
    ct2_hyps = deploy_benchmark.hypotheses_by_id(Path(ct2["scored_output"]))
    fairseq_hyps = deploy_benchmark.hypotheses_by_id(Path(fairseq_student["scored_output"]))
    assert len(ct2_hyps) == len(fairseq_hyps) == 40
    differing = sum(ct2_hyps[i] != fairseq_hyps[i] for i in fairseq_hyps)
    assert differing <= 4 and ct2["paired"]["sentences_differing"] == differing
    assert ct2["delta"] == pytest.approx(ct2["bleu"] - fairseq_student["bleu"])
    # the student is smaller than the teacher on disk; int8 is smaller than float32
    assert fairseq_student["size_bytes"] < rows["teacher/fairseq/float32"]["size_bytes"]
    assert rows["small/ctranslate2/int8"]["size_bytes"] < ct2["size_bytes"]

    markdown = (out / "bench.md").read_text()
    lines = markdown.splitlines()
    assert lines[0].startswith("## Deploy benchmark: bin test")
    assert any(line.startswith("Machine: ") and "torch 2" in line and "fairseq 0" in line for line in lines)
    assert any(line.startswith("Command: `fairseq-kd-deploy-benchmark --data") for line in lines)
    header = next(line for line in lines if line.startswith("| system"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == COLUMNS
    table = [line for line in lines if line.startswith("| ") and line is not header]
    assert len(table) == 4 and all(len(line.strip("|").split("|")) == len(COLUMNS) for line in table)
    assert table[2].startswith("| small | CTranslate2 | float32 | ")
    if differing == 0:  # no difference to test: said, not given sacreBLEU's smallest p
        assert "| identical |" in table[2] and "- identical: the output equals its baseline's" in markdown
    assert "whole process" in markdown
    # the int8 path: the CPU's int8 dot product, the kernel pins, the int8 weights' bits (7 by default)
    assert report["machine"]["int8_dot_product"] in ("VNNI", "AVX2") and "kernel_pins" in report["machine"]
    assert report["settings"]["int8_weight_bits"] == 7
    assert any(line.startswith("CPU kernels: int8 dot product ") and "int8 rows: 7-bit weights" in line
               for line in lines)


def test_other_int8_weight_bits_decode_the_int8_row_again_and_only_it(first_run):
    """The bits of the int8 weights are part of what a decode is keyed by: a run with 8-bit weights
    exports and decodes the int8 row anew and reuses the three others."""
    out, argv = first_run
    argv = [*argv, "--int8-weight-bits", "8", "--overwrite"]
    argv[argv.index("--output-json") + 1] = str(out / "bits8.json")
    argv[argv.index("--output-md") + 1] = str(out / "bits8.md")
    assert deploy_benchmark.run(argv) == 0
    report = json.loads((out / "bits8.json").read_text())
    assert report["decodes"] == {"run": 1, "reused": 3} and report["settings"]["int8_weight_bits"] == 8
    record = json.loads((Path(report["rows"][3]["model"]) / "fairseq_kd_export.json").read_text())
    assert record["int8_weight_bits"] == 8


def test_rerun_reuses_every_export_and_decode(first_run):
    out, argv = first_run
    before = json.loads((out / "bench.json").read_text())
    records = sorted((out / "work" / "decode").glob("*/measure.json"))
    exports = sorted((out / "work" / "exports").iterdir())
    stamps = [path.stat().st_mtime_ns for path in records + exports]
    assert deploy_benchmark.run([*argv, "--overwrite"]) == 0
    after = json.loads((out / "bench.json").read_text())
    assert after["decodes"] == {"run": 0, "reused": 4}
    assert after["rows"] == before["rows"]
    assert sorted((out / "work" / "decode").glob("*/measure.json")) == records
    assert [path.stat().st_mtime_ns for path in records + exports] == stamps


@pytest.mark.parametrize("change, flag", [
    ({"--teacher": "missing.pt"}, "--teacher"),
    ({"--quantizations": "int3"}, "--quantizations"),
    ({}, "--output-md"),  # the first run's outputs exist and there is no --overwrite
    ({"--threads": "0"}, "--threads"),
    ({"--teacher": "FOLDER"}, "--teacher"),
    ({"--quantizations": "float32", "--int8-weight-bits": "8"}, "--int8-weight-bits"),  # no int8 row
])
def test_refusals_name_the_flag(first_run, change, flag, capsys):
    out, argv = first_run
    argv = list(argv)
    for key, value in change.items():
        if key not in argv:
            argv += [key, value]
        else:
            argv[argv.index(key) + 1] = str(out) if value == "FOLDER" else value
    if change:  # outputs elsewhere, so only the changed flag is wrong
        argv[argv.index("--output-md") + 1] = str(out / "other.md")
        argv[argv.index("--output-json") + 1] = str(out / "other.json")
    with pytest.raises(SystemExit) as exit_info:
        deploy_benchmark.cli_main(argv)
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors and errors[0].startswith(f"fairseq-kd-deploy-benchmark: error: {flag}")
    if change:
        assert len(errors) == 1
    assert not (out / "other.md").exists()


def test_output_comparison_across_settings(tmp_path):
    def output(name, texts):
        path = tmp_path / name
        path.write_text("".join(f"S-{i}\tx\nH-{i}\t-0.5\t{t}\nD-{i}\t-0.5\t{t}\n" for i, t in enumerate(texts)))
        return str(path)

    row = deploy_benchmark.Row("s", "student", "ctranslate2", "int8", Path("x.pt"))
    row.measurements = [{"threads": 1, "batch_size": 8, "output": output("a", ["A B", "C"])},
                        {"threads": 2, "batch_size": 8, "output": output("b", ["A B", "C"])},
                        {"threads": 1, "batch_size": 16, "output": output("c", ["A B", "D"])}]
    same = deploy_benchmark.identical_outputs(row)
    assert same["across_threads"] is True and same["across_batch_sizes"] is False
    assert same["differing"] == [{"threads": 1, "batch_size": 16}]


@pytest.mark.parametrize("extra, message", [
    (["--fairseq-weights", "float16"], "--fairseq-weights float16: fairseq decodes in half precision on CUDA only"),
    (["--fairseq-weights", "float8"], "--fairseq-weights: 'float8'; choose from float32, float16, bfloat16"),
    (["--device", "cuda"], "--threads: applies to --device cpu"),
])
def test_device_refusals(first_run, extra, message, capsys):
    out, argv = first_run
    argv = [*argv, "--output-md", str(out / "other.md"), "--output-json", str(out / "other.json"), *extra]
    with pytest.raises(SystemExit) as exit_info:
        deploy_benchmark.cli_main(argv)
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0].startswith(f"fairseq-kd-deploy-benchmark: error: {message}")
    if extra[0] == "--device" and not torch_cuda():
        assert any("--device cuda: torch sees no CUDA device here" in line for line in errors)
    assert not (out / "other.md").exists()


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_gpu_rows_and_commands():
    """--device cuda --fairseq-weights float32,float16: a teacher row per precision against the first
    student at that precision, the student's float16 row against its float32 row, CTranslate2 rows
    against the float32 one; fairseq-generate without --cpu, with --fp16 for float16 rows."""
    rows = deploy_benchmark.build_rows("t.pt", [("a", "a.pt"), ("b", "b.pt")], ["int8_float16"],
                                       ["float32", "float16"])
    assert [(row.id, row.baseline) for row in rows] == [
        ("teacher/fairseq/float32", "a/fairseq/float32"), ("teacher/fairseq/float16", "a/fairseq/float16"),
        ("a/fairseq/float32", None), ("a/fairseq/float16", "a/fairseq/float32"),
        ("a/ctranslate2/int8_float16", "a/fairseq/float32"),
        ("b/fairseq/float32", None), ("b/fairseq/float16", "b/fairseq/float32"),
        ("b/ctranslate2/int8_float16", "b/fairseq/float32")]
    args = deploy_benchmark.argparse.Namespace(data=".", gen_subset="test", beam=5, lenpen=1.0, max_len_a=0.0,
                                               max_len_b=200, langs=("de", "en"), device="cuda")
    for row in rows:
        row.model = Path("model")
    fp32, fp16, ct2 = (deploy_benchmark.decode_command(rows[i], args, 1, 32, Path("out")) for i in (0, 1, 4))
    assert "--cpu" not in fp32 + fp16 and "--fp16" not in fp32 and "--fp16" in fp16
    assert ct2[ct2.index("--device") + 1] == "cuda"
    args.device = "cpu"
    assert "--cpu" in deploy_benchmark.decode_command(rows[0], args, 1, 32, Path("out"))
