"""Teacher data beyond the 1-best (issue 43): fairseq-kd-seqkd --nbest/--select/--filter-*/
--keep-hypotheses/--mix-original.

References written here, not the module's code: sacreBLEU's corpus-level scores of one sentence
per candidate and a brute-force arg-max for the selections, a pair-by-pair count for the share kept,
fairseq-generate's own n-best lists (``H-``/``P-`` lines: its positional scores, in base 2) for the
decoded hypotheses and their cross-entropy, and the teacher run one sentence at a time for the
teacher-forced cross-entropy.
"""
import filecmp
import json
import math
import random

import pytest
import sacrebleu
import torch
from conftest import USER_DIR, run_cli

import fairseq_kd
from fairseq.data import Dictionary, indexed_dataset
from fairseq_kd.teacher_pass import seqkd
from fairseq_kd.teacher_pass.selection import kept_by_cross_entropy, ranking, teacher_cross_entropy, utilities

fairseq_kd.register()
SENTENCES = 400  # the tiny corpus's training split
FILES = ("train.src-tgt.src.bin", "train.src-tgt.src.idx", "train.src-tgt.tgt.bin", "train.src-tgt.tgt.idx")
NBEST = dict(nbest=4, select="chrf", remove_bpe="none", keep_hypotheses=2, filter_keep_share=0.8)


def quiet(_line):
    pass


def config(data, teacher, output, **overrides):
    """tests/test_seqkd.py's settings: short length limits keep the tiny teacher fast; 7 shards of 64."""
    values = dict(data=str(data), teacher_checkpoint=str(teacher), output=str(output), max_len_a=1.2,
                  max_len_b=10, shard_size=64)
    values.update(overrides)
    return seqkd.SeqKDConfig(**values)


def read_split(folder, lang):
    data = indexed_dataset.MMapIndexedDataset(str(folder / f"train.src-tgt.{lang}"))
    return [data[i].tolist() for i in range(len(data))]


# ------------------------------------------------------------------------ the pure functions
def slow_choice(scores):
    """The first index of the highest score, by a plain scan."""
    best = 0
    for i, score in enumerate(scores):
        if score > scores[best]:
            best = i
    return best


def random_sentences(rng, count):
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "home", "."]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 7))) for _ in range(count)]


@pytest.mark.parametrize("select", ["chrf", "bleu", "mbr"])
def test_each_selection_picks_the_brute_force_arg_max_ties_by_teacher_rank(select):
    rng = random.Random(select)
    bleu = sacrebleu.BLEU(effective_order=True)
    for _ in range(60):
        hypotheses = random_sentences(rng, rng.randint(2, 5))
        hypotheses.insert(rng.randint(0, len(hypotheses)), rng.choice(hypotheses))  # an exact tie
        reference = random_sentences(rng, 1)[0]
        if select == "chrf":
            scores = [sacrebleu.corpus_chrf([h], [[reference]]).score for h in hypotheses]
        elif select == "bleu":
            scores = [bleu.corpus_score([h], [[reference]]).score for h in hypotheses]
        else:
            scores = [sum(sacrebleu.corpus_chrf([h], [[o]]).score for j, o in enumerate(hypotheses) if j != i)
                      / (len(hypotheses) - 1) for i, h in enumerate(hypotheses)]
        values = utilities(select, hypotheses, None if select == "mbr" else reference)
        assert values == pytest.approx(scores, abs=1e-9)
        order = ranking(values)
        assert order[0] == slow_choice(scores)
        assert sorted(order) == list(range(len(hypotheses)))
        assert all(values[a] > values[b] or (values[a] == values[b] and a < b) for a, b in zip(order, order[1:]))
    assert ranking(utilities("best", ["b", "a", "c"], "a")) == [0, 1, 2]


def test_the_texts_compared_are_the_dictionary_strings_without_subwords():
    """--remove-bpe subword_nmt: 'the ca@@ t' is the reference 'the cat'; none: 'the cats' is closer."""
    from types import SimpleNamespace

    from fairseq_kd.teacher_pass.selection import choose

    dictionary = Dictionary()
    ids = {symbol: dictionary.add_symbol(symbol) for symbol in ("the", "cats", "ca@@", "t", "cat", "a")}

    def tokens(*symbols):
        return torch.tensor([ids[symbol] for symbol in symbols] + [dictionary.eos()])

    scored = [(tokens("a", "cat"), 0.5), (tokens("the", "ca@@", "t"), 0.25), (tokens("the", "cats"), 0.75)]
    reference = tokens("the", "cat")
    for scheme, expected in (("subword_nmt", [1, 2]), ("none", [2, 1])):
        settings = SimpleNamespace(select="chrf", remove_bpe=scheme, keep_hypotheses=2)
        chosen = choose(settings, dictionary, scored, reference)
        assert [rank for rank, _, _ in chosen] == expected
        assert all(torch.equal(t, scored[rank][0]) and ce == scored[rank][1] for rank, t, ce in chosen)
    best = choose(SimpleNamespace(select="best", remove_bpe=None, keep_hypotheses=3), dictionary, scored, None)
    assert [rank for rank, _, _ in best] == [0, 1, 2]


def test_the_filter_keeps_under_the_threshold_or_the_share_of_lowest_cross_entropy():
    rng = random.Random(0)
    for _ in range(50):
        ce = [round(rng.uniform(0, 3), 1) for _ in range(rng.randint(1, 30))]  # rounded: ties
        threshold = rng.choice(ce)
        assert kept_by_cross_entropy(ce, max_ce=threshold) == [value <= threshold for value in ce]
        share = rng.choice([0.05, 0.5, 0.8, 0.95, 1.0])
        target = int(share * len(ce) + 0.5)
        # a pair is kept when fewer than `target` pairs come before it (lower, or equal and earlier)
        slow = [sum(ce[j] < ce[i] or (ce[j] == ce[i] and j < i) for j in range(len(ce))) < target
                for i in range(len(ce))]
        assert kept_by_cross_entropy(ce, keep_share=share) == slow
    assert kept_by_cross_entropy([2.0, 1.0]) == [True, True]


def test_teacher_forced_cross_entropy_is_the_teachers_log_probability_per_token(tiny_data_bin, tiny_teacher):
    """Batched and padded, K hypotheses per source: the same as the teacher on one unpadded
    hypothesis at a time, and as fairseq's own positional scores of the same beam search."""
    from fairseq.dataclass.configs import GenerationConfig
    from fairseq_kd.teacher_pass.common import load_split, load_teacher, translation_task

    task = translation_task(tiny_data_bin, "src", "tgt", "train")
    dataset = load_split(task, "train")
    model = load_teacher(task, tiny_teacher, None, None).model.eval()
    generator = task.build_generator([model], GenerationConfig(beam=4, nbest=3, max_len_b=10, max_len_a=1.2))
    sample = dataset.collater([dataset[i] for i in range(12)])
    nbest = task.inference_step(generator, [model], sample)
    hypotheses = [h["tokens"] for sentence in nbest for h in sentence[:3]]
    ce = teacher_cross_entropy(model, sample, hypotheses, 3, task.target_dictionary.pad(), task.target_dictionary.eos())
    generated = torch.tensor([-float(h["positional_scores"].mean()) for sentence in nbest for h in sentence[:3]])
    slow = []
    with torch.no_grad():
        for row, sentence_id in enumerate(sample["id"].tolist()):
            source = dataset[sentence_id]["source"].unsqueeze(0)
            for tokens in hypotheses[row * 3:row * 3 + 3]:
                previous = torch.cat([tokens[-1:], tokens[:-1]]).unsqueeze(0)  # </s> first
                logits = model(source, torch.tensor([source.size(1)]), previous)[0][0]
                slow.append(-sum(float(torch.log_softmax(logits[t], -1)[tokens[t]]) for t in range(len(tokens)))
                            / len(tokens))
    assert ce.tolist() == pytest.approx(slow, abs=1e-5)
    assert ce.tolist() == pytest.approx(generated.tolist(), abs=1e-4)


# ------------------------------------------------------------------------ end to end, fairseq engine
@pytest.fixture(scope="module")
def nbest_reference(tiny_data_bin, tiny_teacher):
    """fairseq-generate's 4-best of every training sentence: {id: [(token ids, cross-entropy in nats)]}."""
    proc = run_cli("fairseq-generate", tiny_data_bin, "--gen-subset", "train", "--path", tiny_teacher,
                   "--beam", "4", "--nbest", "4", "--max-len-a", "1.2", "--max-len-b", "10", "--max-tokens", "4096",
                   "--required-batch-size-multiple", "1", "--user-dir", USER_DIR, warm=True)
    dictionary = Dictionary.load(str(tiny_data_bin / "dict.tgt.txt"))
    hypotheses, pending = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("H-"):
            name, _score, text = line.split("\t")
            pending = (int(name[2:]), dictionary.encode_line(text, add_if_not_exist=False).tolist())
        elif line.startswith("P-"):
            positional = [float(value) for value in line.split("\t")[1].split()]
            ce = -sum(positional) / len(positional) * math.log(2)  # fairseq-generate prints base 2
            hypotheses.setdefault(pending[0], []).append((pending[1], ce))
    assert sorted(hypotheses) == list(range(SENTENCES)) and {len(h) for h in hypotheses.values()} == {4}
    return hypotheses


@pytest.fixture(scope="module")
def runs(tiny_data_bin, tiny_teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("seqkd_nbest")
    folders = {"default": root / "default", "best4": root / "best4", "nbest": root / "nbest"}
    seqkd.run(config(tiny_data_bin, tiny_teacher, folders["default"], beam=4), log=quiet)
    seqkd.run(config(tiny_data_bin, tiny_teacher, folders["best4"], beam=4, nbest=4), log=quiet)
    folders["result"] = seqkd.run(config(tiny_data_bin, tiny_teacher, folders["nbest"], beam=4, mix_original=True,
                                         **NBEST), log=quiet)
    return folders


def test_nbest_with_the_teachers_order_is_the_1_best_byte_for_byte(runs):
    for name in FILES:
        assert filecmp.cmp(runs["default"] / name, runs["best4"] / name, shallow=False), name
    summary = json.loads((runs["best4"] / seqkd.MANIFEST_NAME).read_text())["summary"]
    assert summary == {"pairs": SENTENCES, "distilled_pairs": SENTENCES, "filtered_pairs": 0, "original_pairs": 0,
                       "mean_chosen_rank": 1.0}


def test_chrf_selection_keep_two_filter_and_mix_are_the_reference_pairs(tiny_data_bin, runs, nbest_reference):
    """Per source the 2 best of fairseq-generate's 4-best by sentence chrF against the reference,
    then 80% of those pairs, the lowest cross-entropy ones; then the 400 original pairs."""
    dictionary = Dictionary.load(str(tiny_data_bin / "dict.tgt.txt"))
    references = read_split(tiny_data_bin, "tgt")
    sources = read_split(tiny_data_bin, "src")
    candidates = []  # (sentence id, teacher rank, tokens, ce) in output order before the filter
    for sentence_id in range(SENTENCES):
        nbest = nbest_reference[sentence_id]
        reference = dictionary.string(torch.tensor(references[sentence_id]))
        scores = [sacrebleu.corpus_chrf([dictionary.string(torch.tensor(t))], [[reference]]).score for t, _ in nbest]
        first = slow_choice(scores)
        rest = [i for i in range(4) if i != first]
        second = rest[slow_choice([scores[i] for i in rest])]
        candidates += [(sentence_id, rank, nbest[rank][0], nbest[rank][1]) for rank in (first, second)]
    kept_count = int(0.8 * len(candidates) + 0.5)
    out_sources, out_targets = read_split(runs["nbest"], "src"), read_split(runs["nbest"], "tgt")
    assert len(out_targets) == kept_count + SENTENCES
    assert out_sources[kept_count:] == sources and out_targets[kept_count:] == references  # --mix-original
    # the kept pairs, in order, are the candidates less the highest cross-entropy ones (a near-tie
    # at the cut, within the two computations' rounding, may go either way)
    kept, position = [], 0
    for candidate in candidates:
        if position < kept_count and out_targets[position] == candidate[2] and (
                out_sources[position] == sources[candidate[0]]):
            kept.append(candidate)
            position += 1
    assert len(kept) == kept_count
    removed = [c for c in candidates if c not in kept]
    assert max(c[3] for c in kept) <= min(c[3] for c in removed) + 1e-4
    summary = runs["result"].summary
    assert summary["distilled_pairs"] == kept_count and summary["filtered_pairs"] == len(candidates) - kept_count
    assert summary["original_pairs"] == SENTENCES and summary["pairs"] == kept_count + SENTENCES
    assert summary["mean_chosen_rank"] == pytest.approx(1 + sum(c[1] for c in candidates[::2]) / SENTENCES)


def test_threshold_filter_removes_the_pairs_above_it(tiny_data_bin, tiny_teacher, nbest_reference, tmp_path):
    ce = sorted(hypotheses[0][1] for hypotheses in nbest_reference.values())
    threshold = (ce[300] + ce[301]) / 2
    if ce[301] - ce[300] < 1e-3:
        pytest.skip("no gap between the 301st and 302nd cross-entropy")  # not with this corpus and teacher
    output = tmp_path / "threshold"
    result = seqkd.run(config(tiny_data_bin, tiny_teacher, output, beam=4, nbest=4, filter_max_ce=threshold),
                       log=quiet)
    expected = [hypotheses[0][0] for _, hypotheses in sorted(nbest_reference.items()) if hypotheses[0][1] <= threshold]
    assert read_split(output, "tgt") == expected
    assert result.summary["filtered_pairs"] == SENTENCES - 301
    assert result.summary["kept_cross_entropy"]["max"] <= threshold


def test_the_record_holds_every_choice_and_a_rerun_with_another_is_refused_naming_it(tiny_data_bin, tiny_teacher,
                                                                                     runs):
    output = runs["nbest"]
    manifest = json.loads((output / seqkd.MANIFEST_NAME).read_text())
    assert manifest["format"] == seqkd.FORMAT_VERSION
    assert {k: manifest["parameters"][k] for k in (*NBEST, "mix_original", "filter_max_ce")} == {
        **NBEST, "mix_original": True, "filter_max_ce": None}
    assert manifest["summary"] == runs["result"].summary
    again = seqkd.run(config(tiny_data_bin, tiny_teacher, output, beam=4, mix_original=True, **NBEST), log=quiet)
    assert again.status == "up_to_date" and again.summary == runs["result"].summary
    before = {path.name: path.stat().st_mtime_ns for path in output.iterdir()}
    for flag, change in (("--select", dict(select="bleu")), ("--filter-keep-share", dict(filter_keep_share=0.9)),
                         ("--keep-hypotheses", dict(keep_hypotheses=1)), ("--mix-original", dict(mix_original=False)),
                         ("--remove-bpe", dict(remove_bpe="subword_nmt"))):
        settings = {**NBEST, "mix_original": True, **change}
        with pytest.raises(seqkd.SeqKDError, match=f"other settings .*{flag} ") as refused:
            seqkd.run(config(tiny_data_bin, tiny_teacher, output, beam=4, **settings), log=quiet)
        assert "\n" not in str(refused.value)
    assert {path.name: path.stat().st_mtime_ns for path in output.iterdir()} == before
    # a record of the format before n-best (no such settings) is one of other settings
    old = {**manifest, "parameters": {k: v for k, v in manifest["parameters"].items()
                                      if k not in ("nbest", "select", "remove_bpe", "keep_hypotheses")}}
    (output / seqkd.MANIFEST_NAME).write_text(json.dumps(old))
    with pytest.raises(seqkd.SeqKDError, match="--nbest 4 here, unset in the record"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, output, beam=4, mix_original=True, **NBEST), log=quiet)
    (output / seqkd.MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("overrides, message", [
    (dict(nbest=6), r"--nbest must be between 1 and --beam \(5\), got 6"),
    (dict(nbest=3, select="chrf"), "--select chrf compares text: give --remove-bpe"),
    (dict(select="mbr", remove_bpe="none"), "--select mbr chooses among the n-best: give --nbest 2"),
    (dict(select="comet"), "--select 'comet': choose one of best, chrf, bleu, mbr"),
    (dict(nbest=3, select="bleu", remove_bpe="moses"), "give --remove-bpe, one of none"),
    (dict(nbest=2, keep_hypotheses=3), r"--keep-hypotheses must be between 1 and --nbest \(2\)"),
    (dict(filter_max_ce=2.0, filter_keep_share=0.9), "--filter-max-ce or --filter-keep-share, not both"),
    (dict(filter_keep_share=0.0), r"--filter-keep-share must be in \(0, 1\]"),
    (dict(filter_max_ce=-1.0), "--filter-max-ce must be a cross-entropy >= 0"),
])
def test_bad_selection_flags_are_refused_in_one_line_before_any_work(tiny_data_bin, tiny_teacher, tmp_path,
                                                                     overrides, message):
    with pytest.raises(seqkd.SeqKDError, match=message) as refused:
        seqkd.run(config(tiny_data_bin, tiny_teacher, tmp_path / "out", **overrides), log=quiet)
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()


def test_resumed_and_job_array_runs_write_the_straight_runs_bytes(tiny_data_bin, tiny_teacher, runs, tmp_path,
                                                                  monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    settings = dict(beam=4, mix_original=True, **NBEST)
    resumed = tmp_path / "resumed"
    assert seqkd.run(config(tiny_data_bin, tiny_teacher, resumed, max_shards=3, **settings), log=quiet).status == (
        "partial")
    assert seqkd.run(config(tiny_data_bin, tiny_teacher, resumed, **settings), log=quiet).decoded_now == 400 - 3 * 64
    array = tmp_path / "array"
    for shard_id in (0, 1):
        result = seqkd.run(config(tiny_data_bin, tiny_teacher, array, num_shards=2, shard_id=shard_id, **settings),
                           log=quiet)
    assert result.status == "complete" and result.summary == runs["result"].summary
    for name in FILES:
        assert filecmp.cmp(resumed / name, runs["nbest"] / name, shallow=False), name
        assert filecmp.cmp(array / name, runs["nbest"] / name, shallow=False), name


# ------------------------------------------------------------------------ the other engines
def test_ctranslate2_and_transformers_engines_give_their_nbest_with_a_cross_entropy(tiny_data_bin, tiny_teacher,
                                                                                     tmp_path):
    """Each engine's n-best, kept whole in the teacher's order: every source's first hypothesis is
    the engine's 1-best, and the filter's teacher-forced cross-entropy is computed for every pair."""
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    from fairseq_kd.cli import export_student

    hf_teacher = tmp_path / "teacher_hf"
    export_student.cli_main([str(tiny_teacher), str(hf_teacher), "--format", "hf"])
    for engine, teacher in (("ctranslate2", tiny_teacher), ("transformers", hf_teacher)):
        seqkd.run(config(tiny_data_bin, teacher, tmp_path / f"{engine}1", engine=engine, beam=2), log=quiet)
        nbest = seqkd.run(config(tiny_data_bin, teacher, tmp_path / f"{engine}2", engine=engine, beam=2, nbest=2,
                                 keep_hypotheses=2, filter_max_ce=1e9), log=quiet)
        targets = read_split(tmp_path / f"{engine}2", "tgt")
        assert len(targets) == 2 * SENTENCES and targets[::2] == read_split(tmp_path / f"{engine}1", "tgt")
        assert read_split(tmp_path / f"{engine}2", "src")[::2] == read_split(tiny_data_bin, "src")
        assert all(a != b for a, b in zip(targets[::2], targets[1::2]))  # two hypotheses, not one twice
        assert nbest.summary["filtered_pairs"] == 0 and nbest.summary["mean_chosen_rank"] == 1.0
        assert 0 < nbest.summary["kept_cross_entropy"]["mean"] <= nbest.summary["kept_cross_entropy"]["max"] < 50


# ------------------------------------------------------------------------ the recipe's rows
def test_each_recipe_row_runs_its_own_teacher_pass_with_the_rows_settings(tmp_path):
    """fairseq-kd-recipe --methods seq_kd,seq_kd_nbest,seq_kd_mbr: three passes, each a command
    fairseq-kd-seqkd accepts (the n-best of the profile's whole beam, the pair's subword scheme),
    each student on its own pass's folder."""
    from fairseq_kd.cli.seqkd_decode import build_parser
    from fairseq_kd.teacher_pass.selection import selection_problem
    from fairseq_kd_recipes.plan import RecipeOptions, build_plan

    plan = build_plan(RecipeOptions(pair="iwslt14_de_en", methods=["seq_kd", "seq_kd_nbest", "seq_kd_mbr"],
                                    profile="smoke", workdir=tmp_path / "work"), device_count=lambda: 0)
    expected = {"seq_kd": ("seqkd", 1, "best", None), "seq_kd_nbest": ("seqkd-nbest", 2, "chrf", "subword_nmt"),
                "seq_kd_mbr": ("seqkd-mbr", 2, "mbr", "subword_nmt")}
    for method, (kind, nbest, select, scheme) in expected.items():
        command = plan.step(f"{kind}-data").commands[0]
        assert command[1:3] == ["-m", "fairseq_kd.cli.seqkd_decode"]
        args = build_parser().parse_args(command[3:])
        assert (args.beam, args.nbest, args.select, args.remove_bpe) == (2, nbest, select, scheme)
        assert args.filter_keep_share == (None if method == "seq_kd" else 0.95) and args.output.endswith(f"data-{kind}")
        assert selection_problem(args) is None
        train = plan.step(f"train-{method}").commands[0]
        assert str(tmp_path / "work" / f"data-{kind}") in train
