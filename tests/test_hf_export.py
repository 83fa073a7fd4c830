"""fairseq-kd-export --format hf (issue 30): a fairseq transformer as a Hugging Face folder.

A post-norm model (fairseq's default transformer, untied embeddings) becomes MarianMT and a
pre-norm one with shared embeddings M2M100: the folder's logits equal the fairseq model's on a
padded batch, greedy generate decodes fairseq's greedy output token for token, AutoModelForSeq2SeqLM
reads it offline, and CTranslate2's transformers converter decodes the same from the M2M100 folder.
Nothing is downloaded; the models are the suite's tiny ones.
"""
import json

import pytest
import torch

pytest.importorskip("transformers")

from conftest import COMMON_TRAIN_ARGS, TINY_TEACHER_ARGS, USER_DIR, build_tiny_student, run_cli  # noqa: E402
from fairseq.data import Dictionary, LanguagePairDataset, data_utils  # noqa: E402
from test_safety import gadget  # noqa: E402,F401 - a checkpoint carrying a pickle gadget (fixture)

PRE_NORM_ARGS = ["--encoder-normalize-before", "--decoder-normalize-before", "--share-all-embeddings",
                 "--activation-fn", "gelu"]


@pytest.fixture(scope="module")
def pre_norm_model(tiny_data_bin, tmp_path_factory):
    """A pre-norm, shared-embedding, GELU 3+3 d 32 model trained like the tiny teacher."""
    save = tmp_path_factory.mktemp("pre_norm")
    run_cli("fairseq-train", tiny_data_bin, "--task", "translation", *TINY_TEACHER_ARGS, *PRE_NORM_ARGS,
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", *COMMON_TRAIN_ARGS,
            "--max-update", "40", "--save-dir", save, "--user-dir", USER_DIR, warm=True)
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def models(tiny_teacher, pre_norm_model):
    return {"marian": tiny_teacher, "m2m_100": pre_norm_model}


def export(checkpoint, output, *flags):
    from fairseq_kd.cli import export_student

    export_student.cli_main([str(checkpoint), str(output), "--format", "hf", *map(str, flags)])
    return output


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_exports")
    return {family: export(checkpoint, root / family) for family, checkpoint in models.items()}


def fairseq_model(checkpoint, data_bin):
    from fairseq_kd.deploy.export_ctranslate2 import load_transformer

    return load_transformer(str(checkpoint), str(data_bin))


def split_batch(data_bin, dictionary):
    prefix = str(data_bin / "test.src-tgt.")
    src = data_utils.load_indexed_dataset(prefix + "src", dictionary)
    tgt = data_utils.load_indexed_dataset(prefix + "tgt", dictionary)
    dataset = LanguagePairDataset(src, src.sizes, dictionary, tgt, tgt.sizes, dictionary)
    return dataset.collater([dataset[i] for i in range(len(dataset))])


def right_padded(tokens, pad):
    """fairseq's left-padded source rows, padded on the right (Hugging Face's convention)."""
    rows = [row[row.ne(pad)] for row in tokens]
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def load_hf(folder):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(str(folder), local_files_only=True).eval()


@pytest.mark.parametrize("family", ["marian", "m2m_100"])
def test_logits_equal_the_fairseq_models(family, models, exported, tiny_data_bin):
    """Teacher-forced logits on the whole test split (padded source and target) equal fairseq's."""
    loaded = fairseq_model(models[family], tiny_data_bin)
    hf = load_hf(exported[family])
    assert type(hf).__name__ == {"marian": "MarianMTModel", "m2m_100": "M2M100ForConditionalGeneration"}[family]
    dictionary = loaded.target_dictionary
    batch = split_batch(tiny_data_bin, dictionary)
    net_input = batch["net_input"]
    assert net_input["src_tokens"][:, 0].eq(dictionary.pad()).any()  # left padding in the batch
    source = right_padded(net_input["src_tokens"], dictionary.pad())
    with torch.no_grad():
        expected = loaded.model(**net_input)[0]
        logits = hf(input_ids=source, attention_mask=source.ne(dictionary.pad()),
                    decoder_input_ids=net_input["prev_output_tokens"]).logits
    real = batch["target"].ne(dictionary.pad())
    assert real.sum() > 100
    torch.testing.assert_close(logits[real], expected[real], atol=2e-5, rtol=1e-5)
    record = json.loads((exported[family] / "fairseq_kd_export.json").read_text())
    assert record["family"] == family and record["max_logit_difference"] < 1e-4
    config = json.loads((exported[family] / "config.json").read_text())
    assert (config["pad_token_id"], config["eos_token_id"], config["bos_token_id"],
            config["decoder_start_token_id"]) == (1, 2, 0, 2)


#: the length limit of both decoders (fairseq: --max-len-a 0 --max-len-b MAX_LEN; Hugging Face:
#: max_new_tokens): fairseq forces </s> after MAX_LEN tokens, Hugging Face stops there
MAX_LEN = 25


def fairseq_greedy(loaded, batch):
    """fairseq's greedy output per sentence id, </s> included; a hypothesis the length limit cut
    (fairseq then forces </s>) ends with ``None`` in place of that </s>."""
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([loaded.model], loaded.target_dictionary, beam_size=1, max_len_a=0,
                                  max_len_b=MAX_LEN)
    with torch.no_grad():
        hypotheses = generator.generate([loaded.model], batch)
    out = {}
    for i, hyps in zip(batch["id"], hypotheses):
        tokens = hyps[0]["tokens"].tolist()
        out[int(i)] = tokens[:-1] + [None] if len(tokens) == MAX_LEN + 1 else tokens
    return out


def hf_greedy(hf, source, pad):
    with torch.no_grad():
        out = hf.generate(input_ids=source, attention_mask=source.ne(pad), num_beams=1, do_sample=False,
                          max_new_tokens=MAX_LEN)
    rows = []
    for row in out[:, 1:].tolist():  # the decoder start token first
        rows.append(row[:row.index(2) + 1] if 2 in row else row + [None])
    return rows


@pytest.mark.parametrize("family", ["marian", "m2m_100"])
def test_greedy_generate_is_fairseqs_greedy_output(family, models, exported, tiny_data_bin):
    loaded = fairseq_model(models[family], tiny_data_bin)
    dictionary = loaded.target_dictionary
    batch = split_batch(tiny_data_bin, dictionary)
    expected = fairseq_greedy(loaded, batch)
    source = right_padded(batch["net_input"]["src_tokens"], dictionary.pad())
    got = dict(zip(batch["id"].tolist(), hf_greedy(load_hf(exported[family]), source, dictionary.pad())))
    assert len(got) == 40
    assert got == expected  # token for token, every sentence, </s> included
    assert len({tuple(t) for t in got.values()}) > 10  # the model translates, not one fixed string
    assert sum(t[-1] == 2 for t in got.values()) >= 30  # most sentences end before the limit


def test_tokenizer_of_pre_tokenised_text(exported, tiny_data_bin):
    """Without SentencePiece the tokenizer maps whitespace-split tokens to the dictionary's indices and
    appends </s>, as fairseq's binarisation does."""
    from transformers import AutoTokenizer

    dictionary = Dictionary.load(str(tiny_data_bin / "dict.src.txt"))
    tokenizer = AutoTokenizer.from_pretrained(str(exported["marian"]), local_files_only=True)
    line = "w1 w2 w29 unseen"
    assert tokenizer(line)["input_ids"] == dictionary.encode_line(line, add_if_not_exist=False).tolist()
    assert tokenizer.convert_ids_to_tokens(tokenizer(line)["input_ids"]) == ["w1", "w2", "w29", "<unk>", "</s>"]


def test_ctranslate2_converts_the_m2m100_folder(models, exported, tiny_data_bin, tmp_path):
    """CTranslate2's transformers converter reads the M2M100 export and decodes fairseq's greedy output."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    loaded = fairseq_model(models["m2m_100"], tiny_data_bin)
    dictionary = loaded.target_dictionary
    batch = split_batch(tiny_data_bin, dictionary)
    expected = fairseq_greedy(loaded, batch)
    ctranslate2.converters.TransformersConverter(str(exported["m2m_100"])).convert(str(tmp_path / "ct2"))
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    sources = [[dictionary[i] for i in row[row.ne(dictionary.pad())].tolist()]
               for row in batch["net_input"]["src_tokens"]]
    results = translator.translate_batch(sources, beam_size=1, max_decoding_length=MAX_LEN)
    got = {int(i): [dictionary.index(t) for t in r.hypotheses[0]] for i, r in zip(batch["id"], results)}
    got = {i: t + [None if len(t) == MAX_LEN else dictionary.eos()] for i, t in got.items()}
    assert got == expected


def test_ctranslate2_cannot_read_the_marian_folder(exported, tmp_path):
    """What the README and the export's summary say: CTranslate2's Marian loader drops the last
    vocabulary row (Marian's <pad>), so it refuses a fairseq vocabulary; --format ctranslate2 is the way."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    with pytest.raises(ValueError, match="vocabulary"):
        ctranslate2.converters.TransformersConverter(str(exported["marian"])).convert(str(tmp_path / "ct2"))


# ------------------------------------------------------------------------------------ refusals
def differences(kd_task, target_dictionary=None, **overrides):
    from fairseq_kd.deploy.export_ctranslate2 import LoadedTransformer
    from fairseq_kd.deploy.export_hf import family_and_differences

    model = build_tiny_student(kd_task, **overrides)
    loaded = LoadedTransformer(model, kd_task.source_dictionary, target_dictionary or kd_task.target_dictionary,
                               "src", "tgt", "",
                               overrides.get("activation_fn", "relu"), 0)
    return family_and_differences(loaded)


def test_families_by_layout(kd_task):
    assert differences(kd_task) == ("marian", [])
    assert differences(kd_task, encoder_normalize_before=True, decoder_normalize_before=True) == ("m2m_100", [])


def test_every_difference_is_named(kd_task):
    family, found = differences(kd_task, encoder_learned_pos=True, layernorm_embedding=True,
                                encoder_normalize_before=True, activation_fn="relu_squared")
    text = "; ".join(found)
    assert family is None
    for expected in ("--encoder-normalize-before and --decoder-normalize-before differ", "--layernorm-embedding",
                     "learned positions (--encoder-learned-pos)", "--activation-fn relu_squared"):
        assert expected in text, text
    _, found = differences(kd_task, encoder_normalize_before=True, decoder_normalize_before=True,
                           no_decoder_final_norm=True)
    assert any("without a final layer norm" in f for f in found), found
    reordered = Dictionary()
    for symbol in reversed(kd_task.target_dictionary.symbols[4:]):
        reordered.add_symbol(symbol)
    _, found = differences(kd_task, target_dictionary=reordered)
    assert any("separate source and target dictionaries" in f for f in found), found


def test_refusal_writes_nothing_and_names_the_differences(tiny_teacher, tmp_path, capsys):
    """A checkpoint with learned decoder positions is refused in one line naming them."""
    from fairseq_kd.cli import export_student

    plain = tmp_path / "plain.pt"
    export_student.cli_main([str(tiny_teacher), str(plain)])
    capsys.readouterr()
    state = torch.load(plain, weights_only=True)
    plain.unlink()
    state["cfg"]["model"]["decoder_learned_pos"] = True
    max_positions = state["cfg"]["model"]["max_target_positions"]
    dim = state["model"]["decoder.embed_tokens.weight"].size(1)
    state["model"]["decoder.embed_positions.weight"] = torch.zeros(max_positions + 2, dim)
    state["model"].pop("decoder.embed_positions._float_tensor", None)
    bad = tmp_path / "learned.pt"
    torch.save(state, bad)
    with pytest.raises(SystemExit) as exit_info:
        export(bad, tmp_path / "out")
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines
    assert error.startswith("fairseq-kd-export: error: ") and "learned positions (--decoder-learned-pos)" in error
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["learned.pt"]


def test_overwrite_only_with_the_flag_and_only_an_export(tiny_teacher, exported, tmp_path, capsys):
    import shutil

    folder = tmp_path / "again"
    shutil.copytree(exported["marian"], folder)
    with pytest.raises(SystemExit):
        export(tiny_teacher, folder)
    assert "pass --overwrite" in capsys.readouterr().err
    export(tiny_teacher, folder, "--overwrite")  # an unchanged earlier export: replaced
    record = json.loads((folder / "fairseq_kd_export.json").read_text())
    assert sorted(record["files"]) == sorted(p.name for p in folder.iterdir() if p.name != "fairseq_kd_export.json")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "marian"
    # issue 41: a user's file beside an export, an edited export file, a folder of other files, a
    # CTranslate2 export (its record is of another format), an output that is a link to an export
    mine = tmp_path / "mine"
    shutil.copytree(folder, mine)
    (mine / "mine.txt").write_text("x\n")
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    (edited / "config.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    ct2 = tmp_path / "ct2"
    ct2.mkdir()
    (ct2 / "fairseq_kd_export.json").write_text(json.dumps({"format": "fairseq-kd-ctranslate2/1", "files": {}}))
    (tmp_path / "link").symlink_to(folder)
    snapshot = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for output, named in ((mine, "'mine.txt'"), (edited, "'config.json'"), (other, "fairseq_kd_export.json"),
                          (ct2, "fairseq-kd-ctranslate2/1"), (tmp_path / "link", "symbolic link")):
        with pytest.raises(SystemExit):
            export(tiny_teacher, output, "--overwrite")
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("fairseq-kd-export: error: ") and repr(str(output)) in line and named in line, line
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == snapshot
    assert (tmp_path / "link").is_symlink()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging folder left
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for flags, message in (((a_file / "out",), f"{str(a_file)!r} is a file, not a folder"),
                           ((tmp_path / "new", "--spm-model", tmp_path / "none.model"), "--spm-model")):
        with pytest.raises(SystemExit):
            export(tiny_teacher, *flags)
        assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------ SentencePiece data
@pytest.fixture(scope="module")
def spm_checkpoint(tiny_data_bin, tiny_teacher, tmp_path_factory):
    """A checkpoint on SentencePiece data: the tiny corpus encoded with a SentencePiece model trained
    on it, binarised with the model in the data folder; the tiny teacher's weights with embeddings
    of that dictionary's size (the tokenizer is what is tested)."""
    spm = pytest.importorskip("sentencepiece")
    import io

    from fairseq_kd.cli import export_student

    root = tmp_path_factory.mktemp("spm_data")
    raw = tiny_data_bin.parent / "raw"
    lines = [line for side in ("src", "tgt") for line in (raw / f"train.{side}").read_text().splitlines()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=60,
                                   model_type="unigram", hard_vocab_limit=False, minloglevel=2, num_threads=1)
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    for split in ("train", "valid", "test"):
        for side in ("src", "tgt"):
            text = (raw / f"{split}.{side}").read_text().splitlines()
            (root / f"{split}.{side}").write_text("".join(" ".join(processor.encode(t, out_type=str)) + "\n"
                                                          for t in text))
    data = root / "bin"
    run_cli("fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", root / "train",
            "--validpref", root / "valid", "--testpref", root / "test", "--destdir", data, "--joined-dictionary",
            "--workers", "1", warm=True)
    (data / "spm.model").write_bytes(model.getvalue())
    plain = root / "plain.pt"
    export_student.cli_main([str(tiny_teacher), str(plain)])
    state = torch.load(plain, weights_only=True)
    size = len(Dictionary.load(str(data / "dict.src.txt")))
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.output_projection.weight"):
        state["model"][name] = torch.randn(size, state["model"][name].size(1)) * 0.1
    state["cfg"]["task"]["data"] = str(data)
    torch.save(state, plain)
    return plain, data, processor


def test_sentencepiece_data_gives_a_tokenizer_of_raw_text(spm_checkpoint, tiny_data_bin, tmp_path, capsys):
    """The SentencePiece model in the data folder becomes a MarianTokenizer: raw text in, the ids
    fairseq's binarised data holds (pieces through the dictionary, </s> last), text back out."""
    from transformers import AutoTokenizer

    checkpoint, data, processor = spm_checkpoint
    folder = export(checkpoint, tmp_path / "spm_hf")
    assert "raw text (SentencePiece model spm.model)" in capsys.readouterr().err
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert type(tokenizer).__name__ == "MarianTokenizer"
    dictionary = Dictionary.load(str(data / "dict.src.txt"))
    lines = (tiny_data_bin.parent / "raw" / "test.src").read_text().splitlines()
    for line in lines:
        pieces = " ".join(processor.encode(line, out_type=str))
        ids = tokenizer(line)["input_ids"]
        assert ids == dictionary.encode_line(pieces, add_if_not_exist=False).tolist()
        assert tokenizer.decode(ids, skip_special_tokens=True) == line
    logits = load_hf(folder)(**tokenizer(lines[:4], return_tensors="pt", padding=True),
                             decoder_input_ids=torch.full((4, 1), 2)).logits
    assert logits.shape[-1] == len(dictionary)


def test_a_pickle_gadget_is_refused_and_never_runs(gadget, tiny_data_bin, tmp_path):
    """The checkpoint is read with weights_only=True, explicitly: a gadget in it is refused naming it
    even with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, in one line, and nothing is written."""
    from test_safety import BIN, _refused, _run

    evil, marker = gadget
    proc = _run([BIN / "fairseq-kd-export", evil, tmp_path / "out", "--format", "hf", "--data", tiny_data_bin])
    _refused(proc, marker, "error:")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_pre_norm_with_untied_embeddings(tiny_teacher, tiny_data_bin, tmp_path):
    """M2M100 with tie_word_embeddings False carries fairseq's three separate matrices: the tiny
    teacher's weights made pre-norm (final layer norms added), exported, give fairseq's logits."""
    from fairseq_kd.cli import export_student

    plain = tmp_path / "plain.pt"
    export_student.cli_main([str(tiny_teacher), str(plain)])
    state = torch.load(plain, weights_only=True)
    state["cfg"]["model"].update(encoder_normalize_before=True, decoder_normalize_before=True)
    dim = state["model"]["encoder.embed_tokens.weight"].size(1)
    for side in ("encoder", "decoder"):
        state["model"][f"{side}.layer_norm.weight"] = 1 + 0.1 * torch.randn(dim)
        state["model"][f"{side}.layer_norm.bias"] = 0.1 * torch.randn(dim)
    torch.save(state, plain)
    folder = export(plain, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "m2m_100" and config["tie_word_embeddings"] is False
    loaded = fairseq_model(plain, tiny_data_bin)
    dictionary = loaded.target_dictionary
    batch = split_batch(tiny_data_bin, dictionary)
    source = right_padded(batch["net_input"]["src_tokens"], dictionary.pad())
    with torch.no_grad():
        expected = loaded.model(**batch["net_input"])[0]
        logits = load_hf(folder)(input_ids=source, attention_mask=source.ne(dictionary.pad()),
                                 decoder_input_ids=batch["net_input"]["prev_output_tokens"]).logits
    real = batch["target"].ne(dictionary.pad())
    torch.testing.assert_close(logits[real], expected[real], atol=2e-5, rtol=1e-5)
