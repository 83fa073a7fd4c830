"""Shipping the student: fairseq-kd-export --format ctranslate2 and fairseq-kd-translate against
fairseq-generate, the export's refusals, and the plain export through TransformerModel.from_pretrained."""
import json
import re
import subprocess
import sys

import pytest

from conftest import COMMON_TRAIN_ARGS, QUIET_ENV, TINY_TEACHER_ARGS, USER_DIR, run_cli, run_cli_here, run_module

pytest.importorskip("ctranslate2")


def _lines(text: str, kind: str):
    """{sentence id: hypothesis} of a fairseq-generate style output's ``kind`` lines."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(rf"^{kind}-(\d+)\t\S+\t(.*)$", text, re.M)}


@pytest.fixture(scope="module")
def trained(tiny_data_bin, tmp_path_factory):
    """A 3+3-layer, d 32 model trained for 150 updates: it translates the reversal task well enough
    (about 25 BLEU) that decoding differences would show."""
    save = tmp_path_factory.mktemp("ct2_model")
    run_cli("fairseq-train", tiny_data_bin, "--task", "translation", *TINY_TEACHER_ARGS,
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", *COMMON_TRAIN_ARGS,
            "--max-update", "150", "--save-dir", save, "--user-dir", USER_DIR)
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("ct2_exports")
    folders = {}
    for quantization in ("float32", "int8"):
        folder = root / quantization
        summary = json.loads(run_cli("fairseq-kd-export", trained, folder, "--format", "ctranslate2",
                                     "--quantization", quantization).stdout)
        assert summary["quantization"] == quantization and summary["parameters"] > 0
        folders[quantization] = folder
    return folders


def _generate(data, model, *flags):
    return run_cli("fairseq-generate", data, "--task", "translation", "--path", model, "--gen-subset", "test",
                   "--batch-size", "16", "--required-batch-size-multiple", "1", "--user-dir", USER_DIR, *flags).stdout


def _translate(data, folder, out, *flags):
    run_cli("fairseq-kd-translate", data, "--model", folder, "--gen-subset", "test", "--batch-size", "16",
            "--threads", "1", "--results-path", out, *flags)
    return (out / "generate-test.txt").read_text()


@pytest.mark.parametrize("beam", ["1", "5"])
def test_float32_decodes_what_fairseq_generate_decodes(tiny_data_bin, trained, exported, tmp_path, beam):
    fairseq = _generate(tiny_data_bin, trained, "--beam", beam)
    ct2 = _translate(tiny_data_bin, exported["float32"], tmp_path / "out", "--beam", beam)
    assert len(_lines(fairseq, "D")) == 40
    assert _lines(ct2, "D") == _lines(fairseq, "D")  # token for token, every sentence
    # the references and sources are printed exactly as fairseq-generate prints them
    for kind in ("S", "T"):
        assert (dict(re.findall(rf"^{kind}-(\d+)\t(.*)$", ct2, re.M))
                == dict(re.findall(rf"^{kind}-(\d+)\t(.*)$", fairseq, re.M)))


def test_the_scorer_reads_the_output_like_fairseq_generates(tiny_data_bin, exported, tmp_path):
    ct2 = tmp_path / "ct2"
    _translate(tiny_data_bin, exported["float32"], ct2, "--beam", "5")
    run_module("fairseq_kd.cli.score", "--generate-output", ct2 / "generate-test.txt", "--system", "ct2",
               "--output-json", tmp_path / "s.json")
    score = json.loads((tmp_path / "s.json").read_text())
    assert score["n_sentences"] == 40 and score["bleu"] > 10, score
    assert re.search(r"Translated 40 sentences \(\d+ tokens\) in [\d.]+s \([\d.]+ sentences/s",
                     (ct2 / "generate-test.txt").read_text())


def test_a_length_limit_that_cuts_hypotheses_is_the_one_named_difference(tiny_data_bin, trained, exported, tmp_path):
    """fairseq forces </s> after max_len tokens and lets that hypothesis compete in the beam;
    CTranslate2 stops there. Greedy search is unaffected; beam search differs only on sentences the
    limit cuts (with max_len_b 3, most of them)."""
    limit = ("--max-len-a", "0", "--max-len-b", "3")
    greedy = _generate(tiny_data_bin, trained, "--beam", "1", *limit)
    assert _lines(_translate(tiny_data_bin, exported["float32"], tmp_path / "g", "--beam", "1", *limit), "D") == \
        _lines(greedy, "D")
    fairseq = _lines(_generate(tiny_data_bin, trained, "--beam", "5", *limit), "D")
    ct2 = _lines(_translate(tiny_data_bin, exported["float32"], tmp_path / "b", "--beam", "5", *limit), "D")
    assert all(len(h.split()) <= 3 for h in ct2.values())
    differing = [i for i in fairseq if fairseq[i] != ct2[i]]
    assert all(len(fairseq[i].split()) == 3 for i in differing)  # only where the limit cut the hypothesis


def test_int8_is_within_one_bleu_of_float32(tiny_data_bin, exported, tmp_path):
    import sacrebleu

    outputs = {q: _translate(tiny_data_bin, exported[q], tmp_path / q, "--beam", "5") for q in ("float32", "int8")}
    references = {int(i): ref for i, ref in re.findall(r"^T-(\d+)\t(.*)$", outputs["float32"], re.M)}
    ids = sorted(references)
    bleu = {q: sacrebleu.corpus_bleu([_lines(text, "D")[i] for i in ids], [[references[i] for i in ids]]).score
            for q, text in outputs.items()}
    assert bleu["float32"] > 10, bleu  # the model has learnt something, so the bound means something
    assert abs(bleu["int8"] - bleu["float32"]) <= 1.0, bleu
    sizes = {q: sum(p.stat().st_size for p in exported[q].iterdir()) for q in exported}
    assert sizes["int8"] < 0.7 * sizes["float32"]


def test_the_plain_export_loads_with_from_pretrained(trained, tiny_data_bin, tmp_path):
    plain = tmp_path / "plain.pt"
    run_cli("fairseq-kd-export", trained, plain)
    code = (
        "import sys\n"
        "from fairseq.models.transformer import TransformerModel\n"
        f"hub = TransformerModel.from_pretrained({str(tmp_path)!r}, checkpoint_file='plain.pt', "
        f"data_name_or_path={str(tiny_data_bin)!r})\n"
        "print('HYP', hub.translate('w1 w2 w3 w4', beam=5))\n"
    )
    # a fresh interpreter without the plugin: stock fairseq reads the export
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=QUIET_ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    hypothesis = re.search(r"^HYP (.*)$", out.stdout, re.M).group(1)
    assert hypothesis.split() and all(word.isupper() for word in hypothesis.split())


def _refusal(*args):
    proc = run_cli_here("fairseq-kd-export", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-kd-export: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_export_refusals(trained, exported, tiny_data_bin, tmp_path):
    ct2 = ("--format", "ctranslate2")
    assert "is a folder" in _refusal(trained.parent, tmp_path / "a", *ct2)
    assert "already exists" in _refusal(trained, exported["int8"], *ct2)
    (tmp_path / "file").write_text("x")
    assert "is a file" in _refusal(trained, tmp_path / "file", *ct2)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert "not a CTranslate2 model" in _refusal(trained, tmp_path / "mine", *ct2, "--overwrite")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert "--data" in _refusal(trained, tmp_path / "b", *ct2, "--data", tmp_path / "nowhere")
    assert "--quantization" in _refusal(trained, tmp_path / "c", "--quantization", "int8")  # fairseq format


def test_overwrite_replaces_a_model_folder_whole(trained, tmp_path):
    folder = tmp_path / "model"
    run_cli("fairseq-kd-export", trained, folder, "--format", "ctranslate2", "--quantization", "float32")
    first = (folder / "model.bin").stat().st_size
    run_cli("fairseq-kd-export", trained, folder, "--format", "ctranslate2", "--quantization", "int8", "--overwrite")
    assert (folder / "model.bin").stat().st_size < first
    assert json.loads((folder / "fairseq_kd_export.json").read_text())["quantization"] == "int8"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_an_architecture_ctranslate2_cannot_express_is_refused_naming_it(tiny_data_bin, tmp_path):
    save = tmp_path / "mixed_norm"
    run_cli("fairseq-train", tiny_data_bin, "--task", "translation", *TINY_TEACHER_ARGS, "--encoder-normalize-before",
            "--activation-fn", "tanh", "--criterion", "label_smoothed_cross_entropy", *COMMON_TRAIN_ARGS,
            "--max-update", "1", "--save-dir", save, "--user-dir", USER_DIR)
    line = _refusal(save / "checkpoint_last.pt", tmp_path / "out", "--format", "ctranslate2")
    assert "cannot be expressed in CTranslate2" in line
    assert "--activation-fn tanh" in line and "normalize-before" in line
    assert not (tmp_path / "out").exists()


def test_translate_refuses_data_with_other_dictionaries(exported, tiny_data_bin, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for path in tiny_data_bin.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    dictionary = (other / "dict.src.txt").read_text().splitlines()
    (other / "dict.src.txt").write_text("\n".join([dictionary[1], dictionary[0], *dictionary[2:]]) + "\n")
    proc = run_cli_here("fairseq-kd-translate", other, "--model", exported["int8"])
    assert proc.returncode == 2 and "differs from the data's source dictionary" in proc.stderr, proc.stderr
    proc = run_cli_here("fairseq-kd-translate", tiny_data_bin, "--model", tmp_path / "missing")
    assert proc.returncode == 2 and "--model" in proc.stderr and "Traceback" not in proc.stderr


def test_a_missing_ctranslate2_is_one_line_naming_the_fix(trained, tmp_path):
    code = ("import sys; sys.modules['ctranslate2'] = None\n"
            "from fairseq_kd.cli.export_student import cli_main\n"
            f"cli_main([{str(trained)!r}, {str(tmp_path / 'out')!r}, '--format', 'ctranslate2'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=QUIET_ENV, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "fairseq-kd[deploy]" in proc.stderr and "Traceback" not in proc.stderr
