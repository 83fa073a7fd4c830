"""A Hugging Face seq2seq model as the teacher (issue 30, part A): MarianMT (with one vocabulary,
and with separate source and target vocabularies), M2M100 and NLLB.

Nothing is downloaded: tiny models are built from configs with a SentencePiece model trained here
on the synthetic corpus (and on real text from ../shared/data when present), saved with
save_pretrained, and read back through the plugin offline.
"""
import gzip
import os
import io
import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import List, Tuple

import pytest
import torch

pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

from conftest import SHARED_DATA, train_student  # noqa: E402
from fairseq.data import Dictionary, LanguagePairDataset, data_utils  # noqa: E402
from fairseq_kd.cli import hf_data  # noqa: E402
from fairseq_kd.models.feature_capture import CaptureRequest  # noqa: E402
from fairseq_kd.models.hf_teacher import (  # noqa: E402
    HuggingFaceTeacher,
    HuggingFaceTeacherModel,
    folder_sha256,
    load_tokenizer,
    read_config,
    vocabulary_map,
    vocabulary_maps,
)
from fairseq_kd.models.hf_vocabulary import NO_ID  # noqa: E402
from fairseq_kd.models.teacher import FrozenTeacher, TeacherCheckpointError  # noqa: E402
from fairseq_kd.tasks.translation_kd import TranslationKDTask, load_teacher  # noqa: E402

#: nllb: the NLLB tokenizer with an M2M100 model, as NLLB ships; marian_separate: a Marian model whose
#: source and target vocabularies differ (two SentencePiece models, vocab.json and target_vocab.json)
FAMILIES = ("marian", "marian_separate", "m2m_100", "nllb")
SRC, TGT = "de", "en"  # wmt21's M2M100 language codes include both
#: each multilingual family's language codes for SRC and TGT (what --teacher-*-lang takes), and its tags
LANGUAGE_CODES = {"m2m_100": ("de", "en"), "nllb": ("deu_Latn", "eng_Latn")}
LANGUAGE_TAGS = {"m2m_100": ("__de__", "__en__"), "nllb": ("deu_Latn", "eng_Latn")}
TINY = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64)
STUDENT_ARGS = [
    "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
    "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--max-source-positions", "64", "--max-target-positions", "64",
]


def train_sentencepiece(lines, vocab_size=120) -> Tuple[List[str], bytes]:
    """SentencePiece pieces (no control or unknown pieces) and the model's bytes."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                   model_type="unigram", hard_vocab_limit=False, character_coverage=1.0,
                                   minloglevel=2, num_threads=1)
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())
              if not processor.is_control(i) and not processor.is_unknown(i)]
    return pieces, model.getvalue()


def marian_vocabulary(pieces) -> dict:
    """Marian's layout: </s> 0, <unk> 1, pieces, <pad> last; no <s>."""
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    vocab["<pad>"] = len(vocab)
    return vocab


def save_teacher(family: str, lines, folder: Path, seed: int = 0, target_lines=None, **sizes) -> Path:
    """A tiny ``family`` model and its tokenizer, written by save_pretrained into ``folder``;
    ``sizes`` replace entries of ``TINY`` (layers, heads, widths). The SentencePiece model is
    trained on ``lines``; for ``marian_separate`` ``lines`` are the source side's and
    ``target_lines`` the target side's, each with its own SentencePiece model and vocabulary."""
    import transformers

    tiny = {**TINY, **sizes}

    work = folder.parent / f"{folder.name}_files"
    work.mkdir(parents=True)
    if family == "marian_separate":
        # the source vocabulary is the larger: Marian's encoder embedding takes the config's
        # pad_token_id (a target id, <pad> last) as its padding row
        vocabs = {}
        for side, side_lines, size in (("source", lines, 150), ("target", target_lines, 70)):
            pieces, model_bytes = train_sentencepiece(side_lines, vocab_size=size)
            (work / f"{side}.model").write_bytes(model_bytes)
            vocabs[side] = marian_vocabulary(pieces)
        assert len(vocabs["target"]) < len(vocabs["source"]), {side: len(v) for side, v in vocabs.items()}
        (work / "vocab.json").write_text(json.dumps(vocabs["source"]))
        (work / "target_vocab.json").write_text(json.dumps(vocabs["target"]))
        tokenizer = transformers.MarianTokenizer(str(work / "source.model"), str(work / "target.model"),
                                                 str(work / "vocab.json"), separate_vocabs=True,
                                                 target_vocab_file=str(work / "target_vocab.json"))
        target_pad = vocabs["target"]["<pad>"]
        config = transformers.MarianConfig(vocab_size=len(vocabs["source"]), decoder_vocab_size=len(vocabs["target"]),
                                           share_encoder_decoder_embeddings=False, pad_token_id=target_pad,
                                           eos_token_id=0, decoder_start_token_id=target_pad, forced_eos_token_id=0,
                                           **tiny)
        torch.manual_seed(seed)
        transformers.MarianMTModel(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder
    pieces, model_bytes = train_sentencepiece(lines)
    (work / "sp.model").write_bytes(model_bytes)
    if family == "marian":
        vocab = marian_vocabulary(pieces)
        (work / "vocab.json").write_text(json.dumps(vocab))
        tokenizer = transformers.MarianTokenizer(str(work / "sp.model"), str(work / "sp.model"), str(work / "vocab.json"))
        config = transformers.MarianConfig(vocab_size=len(vocab), pad_token_id=vocab["<pad>"], eos_token_id=0,
                                           decoder_start_token_id=vocab["<pad>"], forced_eos_token_id=0, **tiny)
        model_class = transformers.MarianMTModel
    elif family == "nllb":  # NLLB's tokenizers-backed BPE: <s> <pad> </s> <unk>, symbols, added language codes
        symbols = sorted({c for line in lines for c in line.replace(" ", "\u2581")} | {"\u2581"})
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(symbols)}}
        tokenizer = transformers.NllbTokenizer(vocab=vocab, merges=[], src_lang="deu_Latn", tgt_lang="eng_Latn")
        config = transformers.M2M100Config(vocab_size=len(tokenizer), **tiny)
        model_class = transformers.M2M100ForConditionalGeneration
    else:  # M2M100's layout: <s> <pad> </s> <unk>, pieces, then the language tags
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{p: i + 4 for i, p in enumerate(pieces)}}
        (work / "vocab.json").write_text(json.dumps(vocab))
        tokenizer = transformers.M2M100Tokenizer(str(work / "vocab.json"), str(work / "sp.model"), src_lang=SRC,
                                                 tgt_lang=TGT, language_codes="wmt21", num_madeup_words=0)
        config = transformers.M2M100Config(vocab_size=max(tokenizer.lang_token_to_id.values()) + 1, **tiny)
        model_class = transformers.M2M100ForConditionalGeneration
    torch.manual_seed(seed)
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf(tiny_hf_teachers):
    """The corpus, teachers and data of this file (conftest's tiny_hf_teachers)."""
    return tiny_hf_teachers(FAMILIES, seed=3, sizes=(160, 16, 16))


@pytest.fixture(scope="module")
def raw_corpus(hf) -> Path:
    return hf.raw


def save_teachers(families, raw: Path, root: Path, **sizes) -> dict:
    """``save_teacher`` of each family on the training text in ``raw``: one SentencePiece model on
    both sides' lines, or for ``marian_separate`` one on each side's."""
    sides = {lang: (raw / f"train.{lang}").read_text().splitlines() for lang in (SRC, TGT)}
    teachers = {}
    for family in families:
        if family == "marian_separate":
            teachers[family] = save_teacher(family, sides[SRC], root / family, target_lines=sides[TGT], **sizes)
        else:
            teachers[family] = save_teacher(family, sides[SRC] + sides[TGT], root / family, **sizes)
    return teachers


def data_task(data_bin: Path):
    """What the teacher reads of a task: its dictionaries and config."""
    return SimpleNamespace(source_dictionary=Dictionary.load(str(data_bin / f"dict.{SRC}.txt")),
                           target_dictionary=Dictionary.load(str(data_bin / f"dict.{TGT}.txt")),
                           cfg=SimpleNamespace(left_pad_target=False))


def split_batch(data_bin: Path, task, split="valid") -> dict:
    """A fairseq batch of ``split`` exactly as training collates it (source left-padded)."""
    prefix = str(data_bin / f"{split}.{SRC}-{TGT}.")
    src = data_utils.load_indexed_dataset(prefix + SRC, task.source_dictionary)
    tgt = data_utils.load_indexed_dataset(prefix + TGT, task.target_dictionary)
    dataset = LanguagePairDataset(src, src.sizes, task.source_dictionary, tgt, tgt.sizes, task.target_dictionary)
    return dataset.collater([dataset[i] for i in range(len(dataset))])


# ------------------------------------------------------------------------ the adapter's numbers
def own_tokenizer(folder: Path, family: str):
    """The folder's tokenizer, set to the test's languages when it is multilingual."""
    tokenizer = load_tokenizer(folder)
    if family in LANGUAGE_CODES:
        tokenizer.src_lang, tokenizer.tgt_lang = LANGUAGE_CODES[family]
    return tokenizer


@pytest.mark.parametrize("family", FAMILIES)
def test_log_probabilities_equal_the_models_own(family, teachers, data_bins, raw_corpus):
    """The adapter's log-probabilities over the fairseq dictionary, read through the target index
    map, equal the Hugging Face model's own on each unpadded sentence, fed the ids its own tokenizer
    makes of the raw source and target lines (teacher forcing with the model's decoder start token);
    the binarised batch is those ids through the source map (source) and the target map (target);
    a symbol the teacher lacks has 0."""
    task = data_task(data_bins[family])
    teacher = HuggingFaceTeacher.load(str(teachers[family]), task)
    tokenizer = own_tokenizer(teachers[family], family)
    lines = {lang: (raw_corpus / f"valid.{lang}").read_text(encoding="utf-8").splitlines() for lang in (SRC, TGT)}
    batch = split_batch(data_bins[family], task)
    assert batch["net_input"]["src_tokens"][:, 0].eq(task.source_dictionary.pad()).any()  # left padding tested
    output, features = teacher.forward(batch["net_input"], CaptureRequest())
    log_probs = output[0].float().log_softmax(-1)
    vocabulary, source_vocabulary = teacher.model.vocabulary, teacher.model.source_vocabulary
    assert (source_vocabulary is vocabulary) == (family != "marian_separate")
    mapped = torch.tensor([i for i, h in enumerate(vocabulary.hf_id_of_fairseq) if h != NO_ID])
    hf_ids = torch.tensor(vocabulary.hf_id_of_fairseq)[mapped]
    hf_model = teacher.model.hf_model
    if family == "marian_separate":  # logits over the target vocabulary, the smaller one
        rows = hf_model.get_output_embeddings().out_features
        assert rows == vocabulary.hf_vocab_size < source_vocabulary.hf_vocab_size
    for row, sentence_id in enumerate(batch["id"].tolist()):
        target = batch["target"][row]
        length = int(target.ne(task.target_dictionary.pad()).sum())
        labels = tokenizer(text_target=[lines[TGT][sentence_id]])["input_ids"]
        assert vocabulary.to_hf(target[:length].tolist()) == labels[0]
        source = batch["net_input"]["src_tokens"][row]
        input_ids = tokenizer([lines[SRC][sentence_id]])["input_ids"]
        assert source_vocabulary.to_hf(source[source.ne(task.source_dictionary.pad())].tolist()) == input_ids[0]
        with torch.no_grad():
            reference = hf_model(input_ids=torch.tensor(input_ids), labels=torch.tensor(labels)).logits
        reference = reference.log_softmax(-1)[0]
        torch.testing.assert_close(log_probs[row, :length][:, mapped], reference[:, hf_ids], atol=1e-5, rtol=1e-5)
    missing = [i for i, h in enumerate(vocabulary.hf_id_of_fairseq) if h == NO_ID]
    assert missing == ([0] if family.startswith("marian") else [])  # Marian has no <s>
    if missing:
        assert float(log_probs[..., missing].exp().max()) == 0.0
    assert not features.attention and features.encoder_hidden is None and features.decoder_hidden is None


# ------------------------------------------------------------------------ vocabulary and data
@pytest.mark.parametrize("family", FAMILIES)
def test_index_maps_are_inverse(family, teachers):
    """Hugging Face ids -> fairseq -> Hugging Face is the identity on each side's whole vocabulary,
    fairseq's specials map by role (Marian: </s> 0, <unk> 1, <pad> last, no <s>) and fairseq 4..
    are the side's other tokens in id order. One map serves both sides, except for
    marian_separate: the source map is vocab.json's, the target map target_vocab.json's (which
    differ in size and in the ids of the pieces they share), and the config's pad and decoder start
    are target ids."""
    folder = teachers[family]
    tokenizer, config = load_tokenizer(folder), read_config(folder)
    source, target = vocabulary_maps(folder, tokenizer, config)
    assert vocabulary_map(folder, tokenizer, config) == target
    files = {side: json.loads((folder / name).read_text()) for side, name in
             (("source", "vocab.json"), ("target", "target_vocab.json")) if (folder / name).is_file()}
    if family == "marian_separate":
        assert source is not target and source != target
        assert (source.hf_vocab_size, target.hf_vocab_size) == (len(files["source"]), len(files["target"]))
        assert len(files["source"]) != len(files["target"])
        shared_pieces = set(files["source"]) & set(files["target"])
        assert any(files["source"][piece] != files["target"][piece] for piece in shared_pieces)
        assert config["pad_token_id"] == config["decoder_start_token_id"] == files["target"]["<pad>"]
        assert tokenizer.pad_token_id == files["source"]["<pad>"] != files["target"]["<pad>"]  # a source id
    else:
        assert source is target
        files["target"] = files.get("source")
    for side, vocabulary in (("source", source), ("target", target)):
        every_id = list(range(vocabulary.hf_vocab_size))
        assert vocabulary.to_hf(vocabulary.to_fairseq(every_id)) == every_id
        specials, others = vocabulary.hf_id_of_fairseq[:4], vocabulary.fairseq_symbols[4:]
        if family.startswith("marian"):
            vocab = files[side]
            assert specials == (NO_ID, vocab["<pad>"], vocab["</s>"], vocab["<unk>"]) == (NO_ID, len(vocab) - 1, 0, 1)
            assert others == tuple(token for token, _ in sorted(vocab.items(), key=lambda item: item[1])
                                   if token not in ("<pad>", "</s>", "<unk>"))
        else:  # M2M100, NLLB
            assert specials == (0, 1, 2, 3)
            assert others == tuple(tokenizer.convert_ids_to_tokens(list(vocabulary.hf_id_of_fairseq[4:])))
    if family in LANGUAGE_TAGS:  # language tags are symbols (M2M100's: transformers 5 leaves them out of get_vocab)
        assert set(LANGUAGE_TAGS[family]) <= set(target.fairseq_symbols)


def source_decoder(teacher: Path, tokenizer):
    """What decodes source ids as the teacher's tokenizer means them: the tokenizer itself, or for
    separate vocabularies a one-vocabulary Marian tokenizer over the folder's source files
    (transformers' MarianTokenizer decodes every id through its target vocabulary)."""
    if not getattr(tokenizer, "separate_vocabs", False):
        return tokenizer
    import transformers

    return transformers.MarianTokenizer(str(teacher / "source.spm"), str(teacher / "source.spm"),
                                        str(teacher / "vocab.json"))


def assert_text_round_trip(tokenizer, vocabularies, data_bin: Path, split: str, raw_prefix: Path, decoders):
    """Every binarised sentence is the tokenizer's own ids through its side's map (``vocabularies``:
    source, target), fairseq's </s> closing it, and decodes to the text that side's ``decoders``
    (source, target) make of the tokenizer's own ids."""
    task = data_task(data_bin)
    for lang, target, vocabulary, decoder in ((SRC, False, vocabularies[0], decoders[0]),
                                              (TGT, True, vocabularies[1], decoders[1])):
        dictionary = task.source_dictionary if not target else task.target_dictionary
        assert vocabulary.mismatch(dictionary.symbols) is None
        binarised = data_utils.load_indexed_dataset(str(data_bin / f"{split}.{SRC}-{TGT}.{lang}"), dictionary)
        lines = (raw_prefix.parent / f"{raw_prefix.name}.{lang}").read_text(encoding="utf-8").splitlines()
        assert len(binarised) == len(lines)
        own = tokenizer(text_target=lines) if target else tokenizer(lines)
        for index, (line, hf_ids) in enumerate(zip(lines, own["input_ids"])):
            fairseq_ids = binarised[index].tolist()
            assert vocabulary.to_hf(fairseq_ids) == hf_ids
            decoded = hf_data.decode_fairseq_ids(tokenizer, vocabulary, fairseq_ids, source=not target)
            assert decoded == decoder.decode(hf_ids, skip_special_tokens=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_binarised_data_is_the_tokenizers_own(family, teachers, data_bins, raw_corpus):
    """fairseq-kd-hf-data writes each side's vocabulary as its dictionary (symbol for symbol) and
    the tokenizer's own ids through that side's map: M2M100's language tags open every source and
    target sentence; marian_separate's dictionaries differ (dict.SRC.txt is vocab.json's,
    dict.TGT.txt target_vocab.json's)."""
    tokenizer = own_tokenizer(teachers[family], family)
    vocabularies = vocabulary_maps(teachers[family], tokenizer, read_config(teachers[family]))
    task = data_task(data_bins[family])
    assert (task.source_dictionary.symbols == task.target_dictionary.symbols) == (family != "marian_separate")
    if family in LANGUAGE_CODES:
        batch = split_batch(data_bins[family], task, "train")
        source_tag, target_tag = (task.source_dictionary.index(tag) for tag in LANGUAGE_TAGS[family])
        assert set(batch["target"][:, 0].tolist()) == {target_tag}
        first_real = batch["net_input"]["src_tokens"].ne(task.source_dictionary.pad()).int().argmax(1)
        assert set(batch["net_input"]["src_tokens"].gather(1, first_real[:, None]).flatten().tolist()) == {source_tag}
    decoders = (source_decoder(teachers[family], tokenizer), tokenizer)
    for split in ("train", "valid"):
        assert_text_round_trip(tokenizer, vocabularies, data_bins[family], split, raw_corpus / split, decoders)
    for lang, dictionary in ((SRC, task.source_dictionary), (TGT, task.target_dictionary)):  # each side's counts
        train = data_utils.load_indexed_dataset(str(data_bins[family] / f"train.{SRC}-{TGT}.{lang}"), dictionary)
        counted = Counter(i for sentence in train for i in sentence[:-1].tolist())
        assert dictionary.count[4:] == [counted[i] for i in range(4, len(dictionary))]


def real_lines(count=300):
    """Real French and English sentences from ../shared/data (Multi30k), or a skip."""
    folder = SHARED_DATA / "multi30k-fr-en"
    if not (folder / "train.fr.gz").is_file():
        pytest.skip(f"real text not found ({folder}/train.fr.gz)")
    texts = {}
    for lang in ("fr", "en"):
        with gzip.open(folder / f"train.{lang}.gz", "rt", encoding="utf-8") as handle:
            texts[lang] = [next(handle).rstrip("\n") for _ in range(count)]
    return texts


@pytest.mark.parametrize("family", ("marian", "marian_separate"))
def test_round_trip_on_real_text(family, tmp_path):
    """Real text (Multi30k fr-en) through a Marian teacher's own SentencePiece model(s): binarised
    ids are the tokenizer's, decoding gives the tokenizer's text back, on each side."""
    texts = real_lines()
    raw = tmp_path / "raw"
    raw.mkdir()
    for lang, name in (("fr", SRC), ("en", TGT)):  # file names in the test's languages
        (raw / f"train.{name}").write_text("\n".join(texts[lang][:250]) + "\n", encoding="utf-8")
        (raw / f"valid.{name}").write_text("\n".join(texts[lang][250:]) + "\n", encoding="utf-8")
    teacher = save_teachers([family], raw, tmp_path)[family]
    hf_data.cli_main(["--teacher", str(teacher), "-s", SRC, "-t", TGT, "--trainpref", str(raw / "train"),
                      "--validpref", str(raw / "valid"), "--destdir", str(tmp_path / "bin")])
    tokenizer = load_tokenizer(teacher)
    vocabularies = vocabulary_maps(teacher, tokenizer, read_config(teacher))
    decoders = (source_decoder(teacher, tokenizer), tokenizer)
    assert_text_round_trip(tokenizer, vocabularies, tmp_path / "bin", "valid", raw / "valid", decoders)
    for side, (lang, target) in enumerate((("fr", False), ("en", True))):  # training sentences: every piece is known
        hf_ids = (tokenizer(text_target=texts[lang][0]) if target else tokenizer(texts[lang][0])).input_ids
        fairseq_ids = vocabularies[side].to_fairseq(hf_ids)
        decoded = hf_data.decode_fairseq_ids(tokenizer, vocabularies[side], fairseq_ids, source=not target)
        assert decoded == texts[lang][0]


# ------------------------------------------------------------------------ training
def test_word_kd_trains_from_a_marian_teacher_and_resumes(teachers, data_bins, tmp_path):
    """fairseq-train --criterion word_kd with the Marian folder as --teacher-checkpoint, 2 updates,
    then resumed to 4: the checkpoint binds the folder's content hash."""
    data, teacher, save = data_bins["marian"], teachers["marian"], tmp_path / "student"
    extra = ["-s", SRC, "-t", TGT, "--cpu"]
    first = train_student(data, teacher, save, ["--criterion", "word_kd"], STUDENT_ARGS, max_update=2, extra=extra)
    assert "word_kd_loss=" in first.stdout + first.stderr
    resumed = train_student(data, teacher, save, ["--criterion", "word_kd"], STUDENT_ARGS, max_update=4, extra=extra)
    log = resumed.stdout + resumed.stderr
    assert "checkpoint_last.pt (epoch" in log and "@ 2 updates)" in log, log[-2000:]
    assert "num_updates=4" in log
    from fairseq_kd.checkpoints import task_state
    from fairseq_kd.models.from_checkpoint import read_transformer_checkpoint

    binding = task_state(read_transformer_checkpoint(str(save / "checkpoint_last.pt")))["binding"]
    assert binding["teacher_sha256"] == folder_sha256(teacher)


def test_word_kd_trains_from_a_teacher_with_separate_vocabularies(teachers, data_bins, tmp_path):
    """fairseq-train --criterion word_kd from the Marian folder with separate source and target
    vocabularies (the student's dictionaries differ too, so nothing is shared): 3 updates, every
    word_kd term finite and positive, the teacher read with both vocabularies."""
    import math
    import re

    data, teacher = data_bins["marian_separate"], teachers["marian_separate"]
    task = data_task(data)
    assert len(task.source_dictionary) != len(task.target_dictionary)
    run = train_student(data, teacher, tmp_path / "student", ["--criterion", "word_kd"], STUDENT_ARGS, max_update=3,
                        extra=["-s", SRC, "-t", TGT, "--cpu"])
    log = run.stdout + run.stderr
    assert "num_updates=3" in log, log[-2000:]
    assert f"{len(task.source_dictionary)} source and {len(task.target_dictionary)} target symbols" in log, log[-2000:]
    values = [float(v) for v in re.findall(r"\bword_kd_loss=([^\s,|]+)", log)]
    assert len(values) >= 3 and all(math.isfinite(v) and v > 0 for v in values), values


# ------------------------------------------------------------------------ refusals
def one_line_refusal(call) -> str:
    with pytest.raises((TeacherCheckpointError, ValueError)) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_refusals_are_one_line(teachers, data_bins, tmp_path):
    """A missing folder, a corrupt config.json, an unsupported model type, data in another
    vocabulary, a feature method from a model without fairseq's layer layout and a teacher pass:
    each one line naming what to change."""
    marian_task = data_task(data_bins["marian"])
    message = one_line_refusal(lambda: load_teacher(str(tmp_path / "absent"), marian_task))
    assert "--teacher-checkpoint" in message and "save_pretrained folder" in message

    corrupt = tmp_path / "corrupt"
    shutil.copytree(teachers["marian"], corrupt)
    (corrupt / "config.json").write_text("{not json")
    message = one_line_refusal(lambda: load_teacher(str(corrupt), marian_task))
    assert "--teacher-checkpoint" in message and "config.json is not readable JSON" in message

    unsupported = tmp_path / "bert"
    shutil.copytree(teachers["marian"], unsupported)
    (unsupported / "config.json").write_text(json.dumps({**read_config(teachers["marian"]), "model_type": "bert"}))
    message = one_line_refusal(lambda: load_teacher(str(unsupported), marian_task))
    assert "model type 'bert' is not supported" in message

    message = one_line_refusal(lambda: load_teacher(str(teachers["marian"]), data_task(data_bins["m2m_100"])))
    assert "the data's source dictionary is not the teacher's vocabulary" in message
    assert "fairseq-kd-hf-data" in message

    message = one_line_refusal(lambda: HuggingFaceTeacher.load(str(teachers["marian"]), marian_task,
                                                               teacher_data=str(data_bins["marian"])))
    assert "drop --teacher-data" in message

    no_weights = tmp_path / "no_weights"
    shutil.copytree(teachers["marian"], no_weights)
    (no_weights / "model.safetensors").unlink()
    assert "holds no weights" in one_line_refusal(lambda: load_teacher(str(no_weights), marian_task))

    teacher = load_teacher(str(teachers["marian"]), marian_task)
    task = SimpleNamespace(teacher=teacher)
    assert TranslationKDTask.require_teacher(task, "pkd") is teacher  # feature methods: Marian has the layout
    # a seq2seq model without fairseq's layer layout serves the output-distribution methods only
    task.teacher = HuggingFaceTeacher(HuggingFaceTeacherModel(_WithoutLayers(), teacher.model.vocabulary),
                                      str(teachers["marian"]))
    message = one_line_refusal(lambda: TranslationKDTask.require_teacher(task, "pkd"))
    assert "criterion 'pkd'" in message and "word_kd or selective_kd" in message and ".layers" in message
    assert TranslationKDTask.require_teacher(task, "selective_kd") is task.teacher

    message = one_line_refusal(lambda: FrozenTeacher.load(str(teachers["marian"]), marian_task))
    assert "is a Hugging Face model folder" in message and "Pass a fairseq checkpoint file here" in message


def test_separate_vocabularies_refusals(teachers, data_bins, tmp_path):
    """A teacher with separate vocabularies refuses, in one line naming the side and what to do:
    data binarised for a one-vocabulary teacher (its source side), data whose source and target
    dictionaries are swapped (each side is compared with its own vocabulary), a target vocabulary
    without <pad>, and a model whose encoder has fewer rows than the source vocabulary."""
    teacher = teachers["marian_separate"]
    message = one_line_refusal(lambda: load_teacher(str(teacher), data_task(data_bins["marian"])))
    assert "the data's source dictionary is not the teacher's source vocabulary" in message
    assert "fairseq-kd-hf-data --teacher" in message

    swapped = data_task(data_bins["marian_separate"])
    swapped.target_dictionary = swapped.source_dictionary
    message = one_line_refusal(lambda: load_teacher(str(teacher), swapped))
    assert "the data's target dictionary is not the teacher's target vocabulary" in message

    no_pad = tmp_path / "no_pad"
    shutil.copytree(teacher, no_pad)
    target_vocab = json.loads((no_pad / "target_vocab.json").read_text())
    del target_vocab["<pad>"]
    (no_pad / "target_vocab.json").write_text(json.dumps(target_vocab))
    message = one_line_refusal(lambda: load_teacher(str(no_pad), data_task(data_bins["marian_separate"])))
    assert "--teacher-checkpoint" in message and "target vocabulary (target_vocab.json)" in message
    assert "no pad token '<pad>'" in message

    from fairseq_kd.models.hf_teacher import check_model_fits

    task = data_task(data_bins["marian_separate"])
    model = load_teacher(str(teacher), task).model
    hf_model = model.hf_model
    hf_model.model.encoder.embed_tokens = torch.nn.Embedding(len(task.target_dictionary), 16)
    message = one_line_refusal(lambda: check_model_fits(str(teacher), hf_model, model.vocabulary,
                                                        source_vocabulary=model.source_vocabulary))
    assert "input embeddings but its tokenizer source vocabulary" in message


class _WithoutLayers(torch.nn.Module):
    """A seq2seq model whose encoder and decoder have no ``layers``."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(decoder_start_token_id=0)
        self.stack = torch.nn.Linear(1, 1)

    def get_encoder(self):
        return self.stack

    get_decoder = get_encoder


def test_data_command_refusals(teachers, raw_corpus, tmp_path, capsys):
    """fairseq-kd-hf-data: an output folder it would overwrite, and a language code the teacher's
    tokenizer does not know, are one-line errors (exit 2)."""
    args = ["--teacher", str(teachers["m2m_100"]), "-s", SRC, "-t", TGT, "--trainpref", str(raw_corpus / "train"),
            "--destdir", str(tmp_path / "bin")]
    hf_data.cli_main(args)
    capsys.readouterr()
    for extra, expected in (([], "pass --overwrite"), (["--overwrite", "--teacher-target-lang", "xx"],
                                                      "--teacher-target-lang 'xx'"),
                            (["--overwrite", "--validpref", str(raw_corpus / "absent")], "--validpref")):
        with pytest.raises(SystemExit) as exit_info:
            hf_data.cli_main(args + extra)
        error = capsys.readouterr().err
        assert exit_info.value.code == 2 and expected in error and error.count("\n") == 1, error
    # a folder the teacher loader refuses is named by this command's flag
    broken = tmp_path / "broken"
    shutil.copytree(teachers["m2m_100"], broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(SystemExit):
        hf_data.cli_main(["--teacher", str(broken), *args[2:], "--overwrite"])
    error = capsys.readouterr().err
    assert f"--teacher {str(broken)!r}: config.json is not readable JSON" in error and "--teacher-checkpoint" not in error


class _MakesMarkerWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickled_weights_are_read_weights_only(teachers, data_bins, tmp_path, monkeypatch):
    """A folder with pytorch_model.bin only: plain tensors load (the same numbers as the
    safetensors folder); a pickle gadget beside them is refused in one line and never runs, with
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 set."""
    from safetensors.torch import load_file

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    task = data_task(data_bins["marian"])
    weights = load_file(str(teachers["marian"] / "model.safetensors"))
    pickled = tmp_path / "pickled"
    shutil.copytree(teachers["marian"], pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(weights, pickled / "pytorch_model.bin")
    batch = split_batch(data_bins["marian"], task)
    logits = {name: load_teacher(str(folder), task).forward(batch["net_input"], CaptureRequest())[0][0]
              for name, folder in (("safetensors", teachers["marian"]), ("pickle", pickled))}
    torch.testing.assert_close(logits["pickle"], logits["safetensors"])

    marker = tmp_path / "gadget_ran"
    torch.save({**weights, "payload": _MakesMarkerWhenUnpickled(marker)}, pickled / "pytorch_model.bin")
    message = one_line_refusal(lambda: load_teacher(str(pickled), task))
    assert "refusing to load its pickled weights" in message and "mkdir" in message, message
    assert "weights_only=False" not in message and not marker.exists()


def test_teacher_follows_the_students_dtype(teachers, data_bins):
    """In bfloat16 (the student's dtype after --bf16) the teacher's weights follow, its logits come
    in bfloat16, close to float32's, and Marian's missing <s> keeps probability 0."""
    task = data_task(data_bins["marian"])
    teacher = HuggingFaceTeacher.load(str(teachers["marian"]), task)
    batch = split_batch(data_bins["marian"], task)
    full = teacher.forward(batch["net_input"], CaptureRequest())[0][0].log_softmax(-1)
    teacher.follow(torch.zeros(1, dtype=torch.bfloat16))
    assert next(teacher.model.parameters()).dtype == torch.bfloat16 and not teacher.model.training
    half = teacher.forward(batch["net_input"], CaptureRequest())[0][0]
    assert half.dtype == torch.bfloat16
    half = half.float().log_softmax(-1)
    assert float(half[..., 0].exp().max()) == 0.0
    real = batch["target"].ne(task.target_dictionary.pad())
    assert float((half - full).exp().sub(1).abs()[real][:, 1:].max()) < 0.2  # within bfloat16's precision


def test_loading_leaves_the_random_state(teachers, data_bins):
    """As a fairseq teacher's loading (tests/test_teacher_loading.py): the student's initial weights do
    not depend on whether its teacher is a fairseq checkpoint or a Hugging Face folder."""
    for family in FAMILIES:
        task = data_task(data_bins[family])
        torch.manual_seed(5)
        untouched = torch.rand(8)
        torch.manual_seed(5)
        load_teacher(str(teachers[family]), task)
        assert torch.equal(torch.rand(8), untouched), family


@pytest.mark.parametrize("family", ("marian", "marian_separate"))
def test_teacher_cache_from_a_hugging_face_teacher(family, teachers, data_bins, tmp_path):
    """fairseq-kd-teacher-cache reads a Hugging Face folder (with one vocabulary, or separate source
    and target vocabularies: ids over the target dictionary): the cached top-k are the adapter's own
    top log-probabilities at every target token, and a training run with the same folder as its
    teacher accepts the cache (the binding digest is the folder's)."""
    from fairseq_kd.teacher_pass.common import translation_task
    from fairseq_kd.teacher_pass.teacher_cache import CacheConfig, TeacherCache, build_cache

    output = tmp_path / "cache"
    build_cache(CacheConfig(data=data_bins[family], teacher_checkpoint=teachers[family], output=output, k=4,
                            cpu=True), log=lambda _: None)
    task = translation_task(data_bins[family], SRC, TGT, "train")
    teacher = load_teacher(str(teachers[family]), task)
    cache = TeacherCache.open(str(output), task, teacher_sha256=teacher.sha256)
    batch = split_batch(data_bins[family], task, split="train")
    mask = batch["target"].ne(task.target_dictionary.pad())
    cached_values, cached_ids = cache.lookup(batch["id"], mask)
    with torch.no_grad():
        values, ids = teacher.model(**batch["net_input"])[0].float().log_softmax(-1).topk(4, dim=-1)
    torch.testing.assert_close(cached_values[mask], values[mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(cached_ids[mask].long(), ids[mask])
