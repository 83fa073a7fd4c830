"""A Hugging Face teacher is the model its folder holds, or is refused (issue 41, items 2 and 4).

Every parameter of the model comes from the folder's weights (no missing, unexpected or mismatched
tensor; tied weights are the model's own and legitimately absent), in floating point, with finite
values; the config's sizes agree with the weights' shapes and its special token ids lie in the
vocabulary, checked from the weights' headers before anything is allocated. Otherwise: one line
naming the folder and what differs, in every command that reads a teacher folder.
"""
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from conftest import run_cli_here, train_student  # noqa: E402
from fairseq_kd.cli import hf_data  # noqa: E402
from fairseq_kd.data.synthetic import write_corpus  # noqa: E402
from fairseq_kd.models import hf_teacher  # noqa: E402
from fairseq_kd.models.feature_capture import CaptureRequest  # noqa: E402
from fairseq_kd.models.teacher import TeacherCheckpointError  # noqa: E402
from fairseq_kd.tasks.translation_kd import load_teacher  # noqa: E402
from test_hf_teacher import SRC, STUDENT_ARGS, TGT, data_task, save_teachers, split_batch  # noqa: E402

safetensors_torch = pytest.importorskip("safetensors.torch")

#: the decoder has two layers, so that one of them can be missing
LAYERS = dict(decoder_layers=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_weights")
    write_corpus(root / "raw", seed=3, train_size=48, valid_size=8, test_size=8, source_lang=SRC, target_lang=TGT)
    return root


@pytest.fixture(scope="module")
def teachers(corpus) -> dict:
    return save_teachers(("marian", "m2m_100"), corpus / "raw", corpus / "teachers", **LAYERS)


@pytest.fixture(scope="module")
def marian_data(corpus, teachers) -> Path:
    raw = corpus / "raw"
    hf_data.cli_main(["--teacher", str(teachers["marian"]), "-s", SRC, "-t", TGT, "--trainpref", str(raw / "train"),
                      "--validpref", str(raw / "valid"), "--testpref", str(raw / "test"),
                      "--destdir", str(corpus / "marian_bin")])
    return corpus / "marian_bin"


def copy_with(source: Path, folder: Path, tensors=None, config=None, pickled=False) -> Path:
    """A copy of the teacher folder ``source`` whose weights are ``tensors(weights)`` and whose
    config.json is updated with ``config`` (a dict) or ``config(dict)``; ``pickled``: the weights
    as pytorch_model.bin instead of model.safetensors."""
    shutil.copytree(source, folder)
    weights = safetensors_torch.load_file(str(folder / "model.safetensors"))
    if tensors is not None:
        weights = tensors(weights)
    if pickled:
        (folder / "model.safetensors").unlink()
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        safetensors_torch.save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"),
                                    metadata={"format": "pt"})
    if config is not None:
        values = json.loads((folder / "config.json").read_text())
        if callable(config):
            config(values)
        else:
            values.update(config)
        (folder / "config.json").write_text(json.dumps(values))
    return folder


def without(*fragments):
    return lambda weights: {name: t for name, t in weights.items() if not any(f in name for f in fragments)}


def replaced(name, make):
    return lambda weights: {**weights, name: make(weights[name])}


def dictionaries_task(folder: Path):
    """What the teacher reads of a task: dictionaries in the teacher's own vocabulary."""
    tokenizer = hf_teacher.load_tokenizer(folder)
    source, target = hf_teacher.vocabulary_maps(folder, tokenizer, hf_teacher.read_config(folder))
    return SimpleNamespace(source_dictionary=source.dictionary(), target_dictionary=target.dictionary(),
                           cfg=SimpleNamespace(left_pad_target=False))


def refusal(folder: Path, task=None) -> str:
    """The one-line refusal of loading ``folder`` as training's teacher."""
    with pytest.raises(TeacherCheckpointError) as caught:
        load_teacher(str(folder), task if task is not None else dictionaries_task(folder))
    message = str(caught.value)
    assert "\n" not in message and f"--teacher-checkpoint {str(folder)!r}: " in message, message
    return message


MARIAN_TO_M2M = {"model_type": "m2m_100", "architectures": ["M2M100ForConditionalGeneration"], "pad_token_id": 1}
M2M_TO_MARIAN = {"model_type": "marian", "architectures": ["MarianMTModel"], "decoder_start_token_id": 2}
DECODER_LAYER_TENSORS = 26  # q, k, v, out (weight and bias) twice, fc1, fc2 and three layer norms
#: (case, family, weights edit, config edit, pickled, what the refusal says)
WEIGHT_CASES = [
    ("only_an_unrelated_tensor", "marian", lambda w: {"rogue": torch.zeros(3)}, None, False,
     "does not fit the weights"),
    ("only_an_unrelated_large_tensor", "marian", lambda w: {"rogue": torch.zeros(256, 256)}, {"decoder_layers": 1},
     False, "unexpected 1 tensor, first: rogue"),
    ("the_last_layer_missing", "marian", without("decoder.layers.1."), None, False,
     "decoder_layers 2 does not fit the weights: the weights hold 1 decoder layer"),
    ("the_first_layer_missing", "marian", without("decoder.layers.0."), None, False,
     f"missing {DECODER_LAYER_TENSORS} tensors, first: model.decoder.layers.0."),
    ("one_tensor_missing", "m2m_100", without("encoder.layers.0.fc2.weight"), None, False,
     "missing 1 tensor, first: model.encoder.layers.0.fc2.weight"),
    ("a_final_layer_norm_missing", "m2m_100", without("model.decoder.layer_norm.weight"), None, False,
     "missing 1 tensor, first: model.decoder.layer_norm.weight"),
    ("the_embeddings_missing", "marian", without("model.shared.weight"), None, False, "missing"),
    ("an_unexpected_tensor", "marian", lambda w: {**w, "model.encoder.extra.weight": torch.zeros(4)}, None, False,
     "unexpected 1 tensor, first: model.encoder.extra.weight"),
    ("a_tensor_of_another_shape", "marian", replaced("model.encoder.layers.0.fc1.bias", lambda t: torch.zeros(33)),
     None, False, "1 tensor of another shape, first: model.encoder.layers.0.fc1.bias ([33] in the weights"),
    ("a_layer_norm_of_another_shape", "m2m_100", replaced("model.encoder.layer_norm.bias", lambda t: torch.zeros(17)),
     None, False, "1 tensor of another shape, first: model.encoder.layer_norm.bias"),
    ("marian_weights_named_m2m_100", "marian", None, MARIAN_TO_M2M, False,
     "missing 4 tensors, first: model.decoder.layer_norm.bias; unexpected 1 tensor, first: final_logits_bias"),
    ("m2m_100_weights_named_marian", "m2m_100", None, M2M_TO_MARIAN, False,
     "unexpected 4 tensors, first: model.decoder.layer_norm.bias"),
    ("integer_weights", "marian", lambda w: {k: (v * 10).long() for k, v in w.items()}, None, False,
     "tensors of its weights are not floating point"),
    ("one_integer_tensor", "m2m_100", replaced("model.encoder.layers.0.fc1.weight", lambda t: t.to(torch.int8)),
     None, False, "1 tensor of its weights is not floating point, first: model.encoder.layers.0.fc1.weight (I8"),
    ("pickled_integer_weights", "marian", lambda w: {k: v.long() for k, v in w.items()}, None, True,
     "not floating point, first: final_logits_bias (int64 in pytorch_model.bin)"),
    ("a_nan", "marian", replaced("model.encoder.layers.0.fc1.weight", lambda t: t.index_fill(0, torch.tensor([3]),
                                                                                             float("nan"))),
     None, False, "not finite (NaN or infinity), first in model.encoder.layers.0.fc1.weight"),
    ("an_infinity", "m2m_100", replaced("model.shared.weight", lambda t: t.index_fill(0, torch.tensor([5]),
                                                                                       float("inf"))),
     None, False, "not finite (NaN or infinity), first in "),
    ("untied_head_missing", "marian", None, {"tie_word_embeddings": False}, False,
     "missing 3 tensors, first: lm_head.weight"),
]


@pytest.mark.parametrize("case,family,tensors,config,pickled,expected", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_weights_that_are_not_the_configs_model_are_refused(case, family, tensors, config, pickled, expected,
                                                           teachers, tmp_path):
    """Weights missing, unexpected, of another shape, of another family, not floating point or not
    finite: one line naming the folder and the first tensor that differs."""
    task = dictionaries_task(teachers[family])
    folder = copy_with(teachers[family], tmp_path / case, tensors, config, pickled)
    message = refusal(folder, task)
    assert expected in message, message


def test_a_missing_shard_is_refused(teachers, tmp_path):
    folder = copy_with(teachers["marian"], tmp_path / "sharded")
    names = sorted(safetensors_torch.load_file(str(folder / "model.safetensors")))
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {name: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert "lists the shard 'model-00002-of-00002.safetensors', which is not a file" in refusal(folder)


@pytest.mark.parametrize("family", ("marian", "m2m_100"))
def test_tied_weights_come_from_the_folder(family, teachers, tmp_path):
    """save_pretrained writes one copy of tied weights (the shared embedding, not the encoder's,
    decoder's or output's): such a folder loads. Writing every copy loads the same model; an output
    matrix that differs from the embedding it is tied to is the model's, read from the folder."""
    folder = teachers[family]
    written = safetensors_torch.load_file(str(folder / "model.safetensors"))
    assert "model.shared.weight" in written and "lm_head.weight" not in written
    task = dictionaries_task(folder)
    model = load_teacher(str(folder), task).model.hf_model
    assert torch.equal(model.lm_head.weight, written["model.shared.weight"])

    shared = written["model.shared.weight"]
    every_copy = copy_with(folder, tmp_path / "every_copy", lambda w: {
        **w, "lm_head.weight": shared.clone(), "model.encoder.embed_tokens.weight": shared.clone(),
        "model.decoder.embed_tokens.weight": shared.clone()})
    again = load_teacher(str(every_copy), task).model.hf_model
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name

    head = torch.randn_like(shared)
    own_head = copy_with(folder, tmp_path / "own_head", lambda w: {**w, "lm_head.weight": head})
    assert torch.equal(load_teacher(str(own_head), task).model.hf_model.lm_head.weight, head)


#: (family, config key, value, what the refusal says besides the key and value)
CONFIG_CASES = [
    ("marian", "vocab_size", 10 ** 10, "rows"),
    ("m2m_100", "vocab_size", 10 ** 10, "rows"),
    ("marian", "vocab_size", 7, "rows"),
    ("marian", "d_model", 10 ** 6, "columns"),
    ("marian", "encoder_layers", 10 ** 6, "1 encoder layer"),
    ("m2m_100", "decoder_layers", 3, "2 decoder layers"),
    ("marian", "encoder_layers", 0, "not a positive integer"),
    ("marian", "encoder_ffn_dim", 10 ** 9, "rows"),
    ("m2m_100", "decoder_ffn_dim", 64, "rows"),
    ("marian", "encoder_attention_heads", 10 ** 6, "not a multiple"),
    ("marian", "decoder_attention_heads", 3, "not a multiple"),
    ("marian", "max_position_embeddings", 10 ** 9, "16384"),
    ("m2m_100", "max_position_embeddings", 10 ** 9, "16384"),
    ("marian", "decoder_start_token_id", 10 ** 6, "not a token id"),
    ("m2m_100", "decoder_start_token_id", 10 ** 6, "not a token id"),
    ("marian", "pad_token_id", -1, "not a token id"),
    ("marian", "eos_token_id", 10 ** 6, "not a token id"),
    ("m2m_100", "bos_token_id", 10 ** 6, "not a token id"),
    ("marian", "forced_eos_token_id", 10 ** 6, "not a token id"),
    ("m2m_100", "forced_bos_token_id", 10 ** 6, "not a token id"),
    ("marian", "unk_token_id", 10 ** 6, "not a token id"),
    ("marian", "decoder_start_token_id", "x", "not a valid marian config"),
]


@pytest.mark.parametrize("family,key,value,expected", CONFIG_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CONFIG_CASES])
def test_an_absurd_config_is_refused_before_work(family, key, value, expected, teachers, tmp_path, monkeypatch):
    """A config.json whose sizes disagree with the weights' shapes, or whose special token ids lie
    outside the vocabulary: one line naming the folder, the key and the value, in well under a
    second, before the tokenizer is read or anything is allocated."""
    folder = copy_with(teachers[family], tmp_path / "absurd", config={key: value})

    def no_work(*args, **kwargs):
        raise AssertionError("the tokenizer was read before the config was checked")

    monkeypatch.setattr(hf_teacher, "load_tokenizer", no_work)
    started = time.monotonic()
    message = refusal(folder, task=object())
    assert time.monotonic() - started < 5
    assert f"{key} {value!r}" in message or key in message, message
    assert expected in message, message


def test_the_fixture_teachers_pass(teachers, marian_data):
    """What the cases above damage is a teacher that loads and answers."""
    task = data_task(marian_data)
    teacher = load_teacher(str(teachers["marian"]), task)
    logits = teacher.forward(split_batch(marian_data, task)["net_input"], CaptureRequest())[0][0]
    assert bool(torch.isfinite(logits).all())


# ------------------------------------------------------------------ every command that reads one
def damaged_folders(teachers, root: Path) -> dict:
    return {
        "vocab_size": copy_with(teachers["marian"], root / "vocab_size", config={"vocab_size": 10 ** 10}),
        "decoder_start_token_id": copy_with(teachers["marian"], root / "decoder_start",
                                            config={"decoder_start_token_id": 10 ** 6}),
        "missing": copy_with(teachers["marian"], root / "missing", without("decoder.layers.0.")),
    }


def one_line(proc, *expected: str):
    """The command failed with one line naming what is wrong (after argparse's usage, where the
    command prints it), and nothing else on stderr: no traceback, report or progress bar."""
    assert proc.returncode in (1, 2), (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    usage = [line for line in lines[:-1] if line.startswith("usage: ") or line.startswith(" ")]
    assert len(usage) == len(lines) - 1 and all(fragment in lines[-1] for fragment in expected), proc.stderr


@pytest.mark.parametrize("damage", ("vocab_size", "decoder_start_token_id", "missing"))
def test_every_command_refuses_a_damaged_teacher(damage, teachers, marian_data, tmp_path):
    """fairseq-train's teacher, fairseq-kd-teacher-cache, fairseq-kd-seqkd, fairseq-kd-translate and
    (for what it reads: the config against the weights' header) fairseq-kd-hf-data refuse in one
    line naming the folder, before any work."""
    folder = damaged_folders(teachers, tmp_path)[damage]
    expected = {"vocab_size": "config.json's vocab_size 10000000000", "missing": "missing 26 tensors",
                "decoder_start_token_id": "config.json's decoder_start_token_id 1000000"}[damage]
    named = (f"--teacher-checkpoint {str(folder)!r}: ", expected)
    trained = train_student(marian_data, folder, tmp_path / "student", ["--criterion", "word_kd"],
                            student_args=STUDENT_ARGS, refused=True)
    one_line(trained, *named)
    assert not list((tmp_path / "student").glob("*.pt"))
    one_line(run_cli_here("fairseq-kd-teacher-cache", "--data", marian_data, "--teacher-checkpoint", folder,
                          "--output", tmp_path / "cache", "--cpu"), *named)
    one_line(run_cli_here("fairseq-kd-seqkd", "--data", marian_data, "--teacher-checkpoint", folder,
                          "--output", tmp_path / "seqkd", "--cpu", "--split", "valid"), *named)
    one_line(run_cli_here("fairseq-kd-translate", marian_data, "--model", folder, "--gen-subset", "test",
                          "--results-path", tmp_path / "translated"), f"{str(folder)!r}: ", expected)
    assert not any((tmp_path / name).exists() for name in ("cache", "seqkd", "translated"))
    if damage != "missing":  # fairseq-kd-hf-data reads the config and the tokenizer, never the weights' values
        args = ["--teacher", folder, "-s", SRC, "-t", TGT, "--trainpref", marian_data.parent / "raw" / "train",
                "--destdir", tmp_path / "bin"]
        proc = run_cli_here("fairseq-kd-hf-data", *args)
        one_line(proc, f"--teacher {str(folder)!r}: {expected}")
        assert not (tmp_path / "bin").exists()


def test_a_token_id_past_the_models_rows_is_refused_before_work(teachers, corpus, tmp_path):
    """A Marian tokenizer whose vocabulary holds an id past the model's rows (10**10) is refused in one
    line, in well under a second, by the teacher's loader and by fairseq-kd-hf-data, whose
    vocabulary map would otherwise be built up to that id."""
    folder = copy_with(teachers["marian"], tmp_path / "far_id")
    vocabulary = json.loads((folder / "vocab.json").read_text())
    vocabulary[sorted(vocabulary)[-1]] = 10 ** 10
    (folder / "vocab.json").write_text(json.dumps(vocabulary))
    started = time.monotonic()
    message = refusal(folder, task=object())
    assert "has the id 10000000000, which is not one of the model's" in message, message
    proc = run_cli_here("fairseq-kd-hf-data", "--teacher", folder, "-s", SRC, "-t", TGT, "--trainpref",
                        corpus / "raw" / "train", "--destdir", tmp_path / "bin")
    assert time.monotonic() - started < 10
    one_line(proc, f"--teacher {str(folder)!r}: ", "10000000000")
