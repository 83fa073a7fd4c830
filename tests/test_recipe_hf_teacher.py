"""A recipe that distils from a Hugging Face teacher (``fairseq-kd-recipe PAIR --teacher DIR``), and
scoring with that teacher's tokenizer (``fairseq-kd-score --detok-hf DIR``).

Tiny teachers are built from configs by tests/test_hf_teacher.py's ``save_teacher`` (nothing is
downloaded), their SentencePiece models trained on the text of the IWSLT'14 archive the recipe
test builds (real segments of ../shared/data when present, synthetic text otherwise).
"""
from __future__ import annotations

import json
import re
import shutil
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from fairseq_kd.scoring.detok import HuggingFaceDetokenizer  # noqa: E402
from fairseq_kd_recipes import recipe as recipe_cli  # noqa: E402
from fairseq_kd_recipes.execute import describe_plan, run_plan  # noqa: E402
from fairseq_kd_recipes.hf_teacher import HuggingFaceTeacher, method_problems  # noqa: E402
from fairseq_kd_recipes.methods import BASELINE, METHODS, TEACHER  # noqa: E402
from fairseq_kd_recipes.plan import RecipeOptions, build_plan  # noqa: E402
from test_hf_teacher import save_teacher  # noqa: E402
from prepare_fixtures import synthetic_parallel  # noqa: E402
from test_recipe import build_de_en_archive, parse_training_command, two_gpus  # noqa: E402

PAIR = "iwslt14_de_en"
#: the tiny teachers' own: positions of the tests' teachers (64) would cut real test sentences
POSITIONS = 1024


def archive_lines(archive: Path, lang: str) -> list[str]:
    """The text of every ``lang`` file of a WIT3 archive, tags and metadata lines removed."""
    lines = []
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.isfile() and re.search(rf"\.{lang}(\.xml)?$", member.name):
                text = tar.extractfile(member).read().decode("utf-8")
                lines += [line for line in (re.sub(r"<[^>]+>", " ", raw).strip() for raw in text.splitlines()) if line]
    return lines


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The IWSLT'14 archive and tiny teachers whose tokenizers were trained on its text."""
    root = tmp_path_factory.mktemp("recipe_hf")
    archive, _ = build_de_en_archive(root / "archives")
    sides = {lang: archive_lines(archive, lang) for lang in ("de", "en")}
    # The separate target vocabulary is small (70 tokens): fewer characters than real text has.
    separate = synthetic_parallel(200, "de", "en", seed=5)
    teachers = {
        "m2m_100": save_teacher("m2m_100", sides["de"] + sides["en"], root / "m2m_100",
                                max_position_embeddings=POSITIONS),
        "marian": save_teacher("marian", sides["de"] + sides["en"], root / "marian"),
        "marian_separate": save_teacher("marian_separate", separate[0], root / "marian_separate",
                                        target_lines=separate[1]),
        "m2m_100_64": save_teacher("m2m_100", sides["de"] + sides["en"], root / "m2m_100_64"),
    }
    texts = {family: (separate[1] if family == "marian_separate" else sides["en"])[:40] for family in teachers}
    return {"archive": archive, "teachers": teachers, "texts": texts}


def one_line_error(capsys) -> str:
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0, error
    return error


# ----------------------------------------------------------------------------- detokenisation


@pytest.mark.parametrize("family", ["m2m_100", "marian", "marian_separate"])
def test_detok_hf_is_the_tokenizers_own_decode(corpus, family):
    """fairseq-generate's H- lines (the target's tokens without </s>) become the text the teacher's
    tokenizer decodes from the ids it made of the references: M2M100's language tag dropped
    (transformers 5's decode keeps it), Marian's pieces joined, a separate-vocabulary Marian
    target read in its target vocabulary and decoded with its target SentencePiece model."""
    import transformers

    folder = corpus["teachers"][family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    texts = corpus["texts"][family]
    encoded = tokenizer(text_target=texts)["input_ids"]
    tokenizer._switch_to_target_mode()  # the target vocabulary's tokens, as the data holds them
    lines = [" ".join(tokenizer.convert_ids_to_tokens(ids[:-1])) for ids in encoded]  # fairseq strips </s>
    tokenizer._switch_to_input_mode()
    decoded = HuggingFaceDetokenizer(folder)(lines)
    if family == "m2m_100":
        assert all(line.startswith("__en__ ") for line in lines)
        own = [tokenizer.decode(ids[1:], skip_special_tokens=True) for ids in encoded]
        assert all("__en__" in tokenizer.decode(ids, skip_special_tokens=True) for ids in encoded)
    else:
        own = [tokenizer.decode(ids, skip_special_tokens=True) for ids in encoded]
    assert decoded == own
    assert not any("\u2581" in text or "__en__" in text or "</s>" in text for text in decoded)
    # the pieces are joined into words: the text itself, up to SentencePiece's normalisation
    assert sum(text == original for text, original in zip(decoded, texts)) > len(texts) // 2
    with pytest.raises(ValueError, match="--detok-hf .*'inten@@' is not a token of its tokenizer"):
        HuggingFaceDetokenizer(folder)(["inten@@ se"])


# ----------------------------------------------------------------------------- the plan


def plan_for(tmp_path, teacher, methods=("no_kd", "word_kd"), pair=PAIR, **options):
    return build_plan(RecipeOptions(pair=pair, methods=list(methods), profile="gpu", workdir=tmp_path / "work",
                                    teacher=teacher, print_only=True, **options), device_count=two_gpus)


def test_the_plan_binarises_the_prepared_text_and_distils_from_the_folder(corpus, tmp_path, capsys):
    teacher = corpus["teachers"]["m2m_100_64"]
    methods = ("no_kd", "word_kd", "word_kd_cached", "seq_kd", "a2d_kd_4h")
    plan = plan_for(tmp_path, teacher, methods)
    names = [step.name for step in plan.steps]
    assert names[:2] == ["prepare", "hf-data"] and f"train-{TEACHER}" not in names and f"export-{TEACHER}" not in names
    assert f"curves-{TEACHER}" not in names and "report-tokenized" not in names
    work = plan.workdir
    assert plan.data == work / "data-hf"
    hf_data = plan.step("hf-data").commands[0]
    assert hf_data[1:3] == ["-m", "fairseq_kd.cli.hf_data"]
    flags = {hf_data[i]: hf_data[i + 1] for i in range(3, len(hf_data) - 1) if hf_data[i].startswith("-")}
    # the untokenised, cased text the preparation keeps, not its Moses-tokenised, lowercased BPE
    assert flags["--trainpref"] == str(work / "prepare" / "raw" / "train") and flags["--destdir"] == str(plan.data)
    assert (flags["--teacher"], flags["-s"], flags["-t"]) == (str(teacher), "de", "en")
    assert (flags["--teacher-source-lang"], flags["--teacher-target-lang"]) == ("de", "en")
    assert work / "prepare" / "raw" / "test.en" in plan.step("hf-data").inputs

    for method in methods:
        args = parse_training_command(plan.step(f"train-{method}").commands[0])
        assert args.data == str(plan.data if method != "seq_kd" else work / "data-seqkd")
        assert args.teacher_checkpoint == (str(teacher) if METHODS[method].uses_teacher else None)
        assert args.teacher_data is None
        # bound to the teacher even where it is not queried: another teacher's run is refused
        assert teacher in plan.step(f"train-{method}").inputs
        # fairseq's --eval-bleu cannot undo the teacher's tokenizer: the references' nll selects
        assert args.best_checkpoint_metric == "nll_loss" and not args.eval_bleu
        # the tiny teacher reads 64 positions: longer sentences are skipped
        assert args.max_source_positions == args.max_target_positions == 64 and args.skip_invalid_size_inputs_valid_test
    for step in ("seqkd-data", "teacher-cache"):
        command = plan.step(step).commands[0]
        assert command[command.index("--teacher-checkpoint") + 1] == str(teacher) and "--teacher-data" not in command
        assert command[command.index("--data") + 1] == str(plan.data)
    generate = plan.step(f"generate-{TEACHER}").commands[0]
    assert generate[1:4] == ["-m", "fairseq_kd.cli.translate", str(plan.data)]
    assert generate[generate.index("--model") + 1] == str(teacher)
    assert generate[generate.index("--device") + 1] == "cuda"
    for system in (TEACHER, *methods):
        score = plan.step(f"score-{system}").commands[0]
        assert score[score.index("--detok-hf") + 1] == str(teacher)
        assert "--remove-bpe" not in score and "--detok-moses" not in score and "--lowercase" not in score
        assert score[score.index("--ref") + 1] == str(work / "data-bin" / "raw" / "test.en")
    systems = plan.step("systems").commands[0]
    assert systems[systems.index("--system") + 1:][:2] == [TEACHER, str(teacher)]
    # --dry-run and --print-commands show it
    assert "hf-data" in describe_plan(plan)
    assert recipe_cli.cli_main([PAIR, "--teacher", str(teacher), "--methods", "no_kd,word_kd", "--print-commands",
                                "--gpus-per-node", "2", "--workdir", str(tmp_path / "printed")]) == 0
    assert "fairseq_kd.cli.hf_data" in capsys.readouterr().out


def test_all_embeddings_are_shared_only_with_one_vocabulary(corpus, tmp_path):
    """WMT'14 shares all embeddings; a Marian teacher with separate vocabularies gives the data two
    dictionaries, so only the decoder's input and output embeddings are shared."""
    def model_flags(family):
        plan = plan_for(tmp_path / family, corpus["teachers"][family], ("no_kd",), pair="wmt14_en_de")
        command = plan.step("train-no_kd").commands[0]
        return "--share-all-embeddings" in command, "--share-decoder-input-output-embed" in command

    assert model_flags("m2m_100") == (True, False)
    assert model_flags("marian") == (True, False)
    assert model_flags("marian_separate") == (False, True)


def test_hf_teacher_refusals_are_one_line_before_any_work(corpus, tmp_path, capsys):
    teachers = corpus["teachers"]
    work = tmp_path / "work"
    common = [PAIR, "--workdir", str(work), "--profile", "smoke"]

    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    (not_a_model / "weights.bin").write_bytes(b"x")
    assert recipe_cli.cli_main([*common, "--teacher", str(not_a_model)]) == 2
    assert "not a Hugging Face model folder (no config.json" in one_line_error(capsys)
    # TinyBERT compares heads one by one: the 4-head students against the 2-head teacher
    assert recipe_cli.cli_main([*common, "--teacher", str(teachers["m2m_100"]), "--methods", "no_kd,tinybert"]) == 2
    error = one_line_error(capsys)
    assert "tinybert compares attention head by head" in error and "4+4" in error and "2+2" in error
    assert recipe_cli.cli_main([*common, "--teacher", str(teachers["m2m_100"]), "--teacher-source-lang", "xx"]) == 2
    assert "--teacher-source-lang 'xx'" in one_line_error(capsys)
    assert recipe_cli.cli_main([*common, "--teacher", str(teachers["marian"]), "--teacher-target-lang", "en"]) == 2
    assert "takes no language codes" in one_line_error(capsys)
    assert recipe_cli.cli_main([*common, "--teacher-source-lang", "de"]) == 2
    assert "--teacher-source-lang name a multilingual Hugging Face teacher's" in one_line_error(capsys)
    assert recipe_cli.cli_main([*common, "--teacher", str(teachers["m2m_100"]), "--data", str(tmp_path)]) == 2
    assert "holds no training text: leave --data out" in one_line_error(capsys)
    assert not work.exists()

    # The feature methods read attention and hidden states through the adapter, of the tested model types.
    bart = HuggingFaceTeacher(folder=tmp_path, model_type="bart", source_lang=None, target_lang=None,
                              separate_vocabularies=False, encoder_heads=4, decoder_heads=4, max_positions=None)
    methods = [METHODS[name] for name in ("no_kd", "word_kd", "word_kd_cached", "seq_kd", "selective_kd", "a2d_kd_4h")]
    (problem,) = method_problems(bart, methods, {"student": [], "student_4h": []})
    assert problem.startswith("a2d_kd_4h reads the teacher's attention maps")


# ----------------------------------------------------------------------------- end to end


def h_lines(generate_output: Path) -> dict[int, str]:
    lines = {}
    for line in generate_output.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^H-(\d+)\t[^\t]*\t(.*)$", line)
        if match:
            lines[int(match.group(1))] = match.group(2)
    return lines


def test_recipe_distils_from_a_hugging_face_teacher_end_to_end(corpus, tmp_path, monkeypatch, capsys,
                                                               warm_recipe_children):
    """IWSLT'14 De-En, smoke profile, an M2M100 teacher: the prepared text binarised in its
    vocabulary (language tags first), no_kd and word_kd trained on it (word_kd from the folder),
    the teacher decoded by its own generate, every system scored after its tokenizer, the report
    written; a second run skips every step, and a run with another teacher is refused before any.
    (fairseq-train and fairseq-generate run as children of the warm interpreter,
    conftest.warm_recipe_children.)"""
    import sacrebleu
    import torch
    import transformers
    from fairseq.data import Dictionary, data_utils
    from fairseq_kd.models.hf_vocabulary import VocabularyMap

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    teacher, work = corpus["teachers"]["m2m_100"], tmp_path / "recipe"
    methods = [BASELINE, "word_kd"]
    argv = [PAIR, "--profile", "smoke", "--methods", ",".join(methods), "--archives", str(corpus["archive"].parent),
            "--workdir", str(work), "--workers", "1", "--teacher", str(teacher)]
    status = recipe_cli.cli_main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.err[-3000:]

    # The data: the teacher's vocabulary, symbol for symbol, M2M100's language tag first.
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(teacher), local_files_only=True)
    config = json.loads((teacher / "config.json").read_text())
    vocabulary = VocabularyMap.from_tokenizer(tokenizer, config["vocab_size"])
    data = work / "data-hf"
    for lang, tag in (("de", "__de__"), ("en", "__en__")):
        dictionary = Dictionary.load(str(data / f"dict.{lang}.txt"))
        assert tuple(dictionary.symbols) == vocabulary.fairseq_symbols
        test = data_utils.load_indexed_dataset(str(data / f"test.de-en.{lang}"), dictionary)
        assert {dictionary[int(sentence[0])] for sentence in test} == {tag}
    # Each student trained on it; word_kd distilled from the folder.
    for method in methods:
        state = torch.load(work / "train" / method / "checkpoint_last.pt", map_location="cpu", weights_only=False)
        assert state["cfg"]["task"]["data"] == str(data)
        assert state["cfg"]["task"]["teacher_checkpoint"] == (str(teacher) if method == "word_kd" else None)

    # The report: every system, scored on the tokenizer's text against the untouched references.
    report = json.loads((work / "report" / "results.json").read_text())
    rows = {row["system"]: row for row in report["systems"]}
    references = (work / "data-bin" / "raw" / "test.en").read_text(encoding="utf-8").splitlines()
    assert list(rows) == [TEACHER, *methods] and report["n_sentences"] == len(references)
    assert "Hugging Face teacher m2m_100" in report["title"] and "case:mixed" in report["signature"]
    assert (work / "report" / "results.md").read_text() in captured.out
    assert rows[TEACHER]["params"] == sum(p.numel() for p in transformers.AutoModelForSeq2SeqLM.from_pretrained(
        str(teacher)).parameters())
    for system in [TEACHER, *methods]:
        pieces = h_lines(work / "generate" / system / "generate-test.txt")
        own = []  # the tokenizer's own decode of the ids of the H- line's tokens, the language tag left out
        for sentence in range(len(references)):
            tokens = [token for token in pieces[sentence].split() if token not in tokenizer.lang_token_to_id]
            own.append(tokenizer.decode(tokenizer.convert_tokens_to_ids(tokens), skip_special_tokens=True))
        record = json.loads((work / "scores" / f"{system}.json").read_text())
        assert record["hypotheses"] == own and record["references"] == references
        assert rows[system]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(own, [references]).score, abs=1e-9)
    teacher_pieces = h_lines(work / "generate" / TEACHER / "generate-test.txt")
    assert all(line.startswith("__en__") for line in teacher_pieces.values())

    # Again: every step skipped, nothing rewritten.
    outputs = {path: path.stat().st_mtime_ns for path in work.rglob("*") if path.is_file() and "logs" not in path.parts}
    options = RecipeOptions(pair=PAIR, methods=methods, profile="smoke", archives=corpus["archive"].parent,
                            workdir=work, workers=1, teacher=teacher)
    result = run_plan(build_plan(options))
    assert result.executed == []

    # Another teacher in the same working folder: refused before any step, naming a training folder.
    other = shutil.copytree(teacher, tmp_path / "other_teacher")
    assert recipe_cli.cli_main([*argv[:-1], str(other)]) == 2
    error = capsys.readouterr().err
    assert "never overwrites a checkpoint" in error and str(work / "train") in error
    assert {path: path.stat().st_mtime_ns for path in outputs} == outputs
