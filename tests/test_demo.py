"""The demo (scripts/demo.sh) in a short version, run twice into two folders: the same BLEU, the
same intervals and p-values, the same trained weights (its promise: same numbers from the same
commit), and every output it names at the end."""
import json
import os
import subprocess

import torch

from conftest import REPO

SHORT = {"TRAIN_SIZE": "200", "EVAL_SIZE": "20", "TEACHER_UPDATES": "8", "STUDENT_UPDATES": "4", "MAX_LEN": "10"}


def run_demo(folder):
    env = {**os.environ, **SHORT, "DEMO_DIR": str(folder), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_short_demo_twice_gives_the_same_numbers_and_every_output(tmp_path):
    first, second = tmp_path / "one", tmp_path / "two"
    printed = run_demo(first)
    run_demo(second)
    reports = [json.loads((folder / "report.json").read_text()) for folder in (first, second)]
    assert [row["system"] for row in reports[0]["systems"]] == ["teacher", "no_kd", "word_kd", "a2d_kd", "seq_kd"]
    assert reports[0]["systems"] == reports[1]["systems"]  # BLEU, mu +- CI, p-values, parameter counts
    assert all(row["sents_per_sec"] is None for row in reports[0]["systems"])  # no speed column
    for name in ("teacher", "a2d_kd"):
        weights = [torch.load(folder / "models" / f"{name}.pt", weights_only=True)["model"] for folder in (first, second)]
        assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    for figure in ("validation_nll.png", "a2d_kd_training_curves.png", "a2d_kd_alignment.png"):
        assert (first / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure in printed
    assert "report.md" in printed
