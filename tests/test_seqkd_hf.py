"""Sequence-level KD and test-set decoding from a Hugging Face teacher (issue 30): the folder's own
``generate`` under fairseq-generate's rules (``fairseq_kd.deploy.hf_engine``).

Two references, neither of them the engine's code: fairseq's own ``SequenceGenerator`` (the
``fairseq`` engine, itself checked against fairseq-generate in tests/test_seqkd.py) on a fairseq
teacher, against the same teacher exported with ``fairseq-kd-export --format hf``; and Hugging
Face's ``generate`` called on the raw text through the teacher's own tokenizer, one sentence at a
time, for a multilingual teacher whose target-language tag every hypothesis must start with.
"""
import filecmp
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from conftest import USER_DIR, run_cli, run_cli_here, train_student  # noqa: E402
from conftest import seqkd_config as config  # noqa: E402
import fairseq_kd  # noqa: E402
from fairseq.data import Dictionary, indexed_dataset  # noqa: E402
from fairseq_kd.deploy.hf_engine import HuggingFaceDecodingError, first_target_symbol  # noqa: E402
from fairseq_kd.teacher_pass import seqkd  # noqa: E402
from test_hf_teacher import SRC, STUDENT_ARGS, TGT  # noqa: E402

fairseq_kd.register()

SENTENCES = 400  # the tiny corpus's training split
TARGET_FILES = ("train.src-tgt.tgt.bin", "train.src-tgt.tgt.idx")
SOURCE_FILES = ("train.src-tgt.src.bin", "train.src-tgt.src.idx")


def quiet(_line):
    pass


def read_split(folder, name):
    data = indexed_dataset.MMapIndexedDataset(str(folder / name))
    return [data[i].tolist() for i in range(len(data))]


@pytest.fixture(scope="module")
def exported_teacher(tiny_teacher, tmp_path_factory):
    """The tiny fairseq teacher (post-norm) as a Hugging Face MarianMT folder."""
    from fairseq_kd.cli import export_student

    folder = tmp_path_factory.mktemp("seqkd_hf") / "teacher_hf"
    export_student.cli_main([str(tiny_teacher), str(folder), "--format", "hf"])
    return folder


@pytest.fixture(scope="module")
def runs(tiny_data_bin, exported_teacher, seqkd_fairseq_runs, tmp_path_factory):
    """{(engine, beam): finished output}: the fairseq engine on the checkpoint (conftest's), the
    default engine on the exported folder (which must choose transformers)."""
    root = tmp_path_factory.mktemp("seqkd_hf_runs")
    folders = {("fairseq", beam): folder for beam, folder in seqkd_fairseq_runs.items()}
    for engine, teacher in (("transformers", exported_teacher),):
        for beam in (1, 5):
            folders[engine, beam] = root / f"{engine}_beam{beam}"
            result = seqkd.run(config(tiny_data_bin, teacher, folders[engine, beam], beam=beam), log=quiet)
            assert result.status == "complete" and result.sentences == SENTENCES
    return folders


def test_greedy_is_the_fairseq_engines_output_byte_for_byte(runs):
    fairseq, hf = runs["fairseq", 1], runs["transformers", 1]
    for name in TARGET_FILES + SOURCE_FILES:
        assert filecmp.cmp(fairseq / name, hf / name, shallow=False), name
    manifest = json.loads((hf / seqkd.MANIFEST_NAME).read_text())
    assert manifest["parameters"]["engine"] == "transformers"  # what --engine auto chose for a folder
    assert manifest["inputs"]["teacher"]["kind"] == "dir" and len(manifest["inputs"]["teacher"]["sha256"]) == 64
    import transformers

    assert manifest["decoding"]["transformers_version"] == transformers.__version__
    assert "ct2_quantization" not in manifest["decoding"]


def test_beam_search_differs_only_at_the_length_limit(runs, tiny_data_bin):
    """Beam 5: the hypotheses agree except where one engine's reaches fairseq's length limit (fairseq
    lets a hypothesis forced to end there compete in the beam; Hugging Face's search, like
    CTranslate2's, stops once ``beam`` hypotheses have finished)."""
    fairseq = read_split(runs["fairseq", 5], "train.src-tgt.tgt")
    hf = read_split(runs["transformers", 5], "train.src-tgt.tgt")
    sources = read_split(tiny_data_bin, "train.src-tgt.src")
    differing = [i for i in range(SENTENCES) if fairseq[i] != hf[i]]
    assert len(differing) <= SENTENCES // 50, differing
    for i in differing:
        # the batch's longest source sets the limit, so a sentence's own length gives a lower bound
        own_limit = int(1.2 * len(sources[i]) + 10)
        assert max(len(fairseq[i]), len(hf[i])) - 1 >= own_limit, (i, fairseq[i], hf[i])


def test_resumes_to_the_same_output(tiny_data_bin, exported_teacher, runs, tmp_path):
    out = tmp_path / "resumed"
    first = seqkd.run(config(tiny_data_bin, exported_teacher, out, beam=5, max_shards=3), log=quiet)
    assert first.status == "partial" and first.decoded_now == 3 * 64
    second = seqkd.run(config(tiny_data_bin, exported_teacher, out, beam=5), log=quiet)
    assert second.status == "complete" and second.decoded_now == SENTENCES - 3 * 64
    for name in TARGET_FILES:
        assert filecmp.cmp(out / name, runs["transformers", 5] / name, shallow=False), name
    again = seqkd.run(config(tiny_data_bin, exported_teacher, out, beam=5), log=quiet)
    assert again.status == "up_to_date"


def test_translate_prints_fairseq_generates_hypotheses(tiny_data_bin, tiny_teacher, exported_teacher, tmp_path):
    """fairseq-kd-translate --model HF_DIR writes what fairseq-generate writes for the checkpoint
    (greedy: the same hypotheses), in the format the scorer reads."""
    run_cli("fairseq-generate", tiny_data_bin, "--path", tiny_teacher, "--gen-subset", "test", "--beam", "1",
            "--batch-size", "16", "--cpu", "--results-path", tmp_path / "fairseq", "--user-dir", USER_DIR, warm=True)
    run_cli_here("fairseq-kd-translate", tiny_data_bin, "--model", exported_teacher, "--gen-subset", "test",
                 "--beam", "1", "--batch-size", "16", "--results-path", tmp_path / "hf")

    def hypotheses(path):
        lines = (path / "generate-test.txt").read_text().splitlines()
        return {line.split("\t")[0]: line.split("\t")[2] for line in lines if line.startswith("H-")}

    expected, got = hypotheses(tmp_path / "fairseq"), hypotheses(tmp_path / "hf")
    assert len(expected) == 40 and got == expected
    assert "Hugging Face model" in (tmp_path / "hf" / "generate-test.txt").read_text().splitlines()[-1]


def test_refusals_are_one_line(tiny_data_bin, tiny_teacher, exported_teacher, tmp_path):
    def refusal(**overrides):
        with pytest.raises(seqkd.SeqKDError) as caught:
            seqkd.plan(config(tiny_data_bin, overrides.pop("teacher"), tmp_path / "out", **overrides))
        message = str(caught.value)
        assert "\n" not in message
        return message

    assert "--engine transformers" in refusal(teacher=exported_teacher, engine="fairseq")
    assert "--engine transformers" in refusal(teacher=exported_teacher, engine="ctranslate2")
    assert "for a fairseq checkpoint use --engine fairseq" in refusal(teacher=tiny_teacher, engine="transformers")
    assert "--fp16 needs a CUDA device" in refusal(teacher=exported_teacher, fp16=True, cpu=True)
    assert not (tmp_path / "out").exists()

    refused = run_cli_here("fairseq-kd-translate", tiny_data_bin, "--model", exported_teacher, "--compute-type", "int8")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "--compute-type int8: a Hugging Face --model decodes in float32" in refused.stderr


# ------------------------------------------- a multilingual teacher, and one with two vocabularies
@pytest.fixture(scope="module")
def hf_teachers(tiny_hf_teachers):
    """Tiny M2M100 and separate-vocabulary Marian teachers (SentencePiece on the synthetic corpus)
    and their data, binarised by fairseq-kd-hf-data in each one's vocabulary (M2M100: every target
    sentence starts with ``__en__``; conftest's tiny_hf_teachers)."""
    made = tiny_hf_teachers(("m2m_100", "marian_separate"), seed=3, sizes=(48, 8, 8))
    return {family: SimpleNamespace(raw=made.raw, teacher=folder, data=made.data[family])
            for family, folder in made.teachers.items()}


@pytest.mark.parametrize("family", ("m2m_100", "marian_separate"))
def test_teacher_decodes_as_its_own_generate(family, hf_teachers, tmp_path):
    """Each hypothesis equals Hugging Face's greedy generate on the raw sentence through the
    tokenizer (the same length limit: the model's 64 positions cap fairseq's max_len_b 200 at 63
    tokens before </s>; M2M100: the target-language tag forced first, as every hypothesis must
    start with it; Marian with separate vocabularies: source ids and hypotheses in their own
    vocabularies), and a student distils from the folder on those hypotheses."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    case = hf_teachers[family]
    out = tmp_path / "seqkd"
    result = seqkd.run(seqkd.SeqKDConfig(data=str(case.data), teacher_checkpoint=str(case.teacher),
                                         output=str(out), beam=1, shard_size=16), log=quiet)
    assert result.status == "complete" and result.sentences == 48
    dictionary = Dictionary.load(str(case.data / f"dict.{TGT}.txt"))
    got = [dictionary.string(torch.tensor(h)).split() for h in read_split(out, f"train.{SRC}-{TGT}.{TGT}")]

    languages = dict(src_lang="de", tgt_lang="en") if family == "m2m_100" else {}
    tokenizer = AutoTokenizer.from_pretrained(str(case.teacher), local_files_only=True, **languages)
    model = AutoModelForSeq2SeqLM.from_pretrained(str(case.teacher), local_files_only=True).eval()
    forced = dict(forced_bos_token_id=tokenizer.convert_tokens_to_ids("__en__")) if family == "m2m_100" else {}
    target_tokens = ({i: t for t, i in tokenizer.target_encoder.items()} if family == "marian_separate"
                     else None)  # transformers' convert_ids_to_tokens reads the target vocabulary
    sources = (case.raw / f"train.{SRC}").read_text().splitlines()
    for sentence, hypothesis in zip(sources, got):
        encoded = tokenizer(sentence, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**encoded, num_beams=1, do_sample=False, max_new_tokens=64, min_new_tokens=1,
                                 forced_eos_token_id=model.config.eos_token_id,
                                 suppress_tokens=[model.config.pad_token_id], **forced)[0].tolist()
        ids = ids[1:]  # without the decoder start token
        tokens = [target_tokens[i] for i in ids] if target_tokens else tokenizer.convert_ids_to_tokens(ids)
        tokens = tokens[:tokens.index("</s>")] if "</s>" in tokens else tokens  # fairseq's string() drops </s>
        assert hypothesis == tokens
        if family == "m2m_100":
            assert hypothesis[0] == "__en__"

    if family == "marian_separate":  # a student trains on the teacher's hypotheses, distilling from the folder
        train_student(out, case.teacher, tmp_path / "student", ["--criterion", "word_kd"], student_args=STUDENT_ARGS,
                      max_update=2)
        assert (tmp_path / "student" / "checkpoint_last.pt").is_file()


def test_the_target_tag_must_start_every_target(hf_teachers):
    m2m100 = hf_teachers["m2m_100"]
    dictionary = Dictionary.load(str(m2m100.data / f"dict.{TGT}.txt"))
    tag, word = dictionary.index("__en__"), dictionary.index("__de__")
    same = SimpleNamespace(tgt=[torch.tensor([tag, 9, 2]), torch.tensor([tag, 2])])
    assert first_target_symbol(m2m100.teacher, same, dictionary, "--model") == tag
    for dataset in (SimpleNamespace(tgt=[torch.tensor([tag, 2]), torch.tensor([word, 2])]),  # two tags
                    SimpleNamespace(tgt=[torch.tensor([9, 2])]),  # no tag
                    SimpleNamespace(tgt=None)):  # no target side
        with pytest.raises(HuggingFaceDecodingError) as caught:
            first_target_symbol(m2m100.teacher, dataset, dictionary, "--model")
        assert "fairseq-kd-hf-data --teacher-target-lang" in str(caught.value) and "\n" not in str(caught.value)
