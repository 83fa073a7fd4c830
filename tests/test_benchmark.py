"""The speed benchmark's bookkeeping: the limit row (plain step + teacher forward) is measured with
the teacher's forward and every other row without; ratios and round spreads are computed from the
rounds as documented. (Timings themselves are measured by running the benchmark, never in tests.)"""
import json

import pytest

from fairseq_kd_recipes import benchmark


def test_ratios_against_plain_and_limit_and_round_spread():
    rows = {"plain": {"step_ms": 100.0, "peak_mb": 50.0}, "limit": {"step_ms": 160.0, "peak_mb": 80.0},
            "a2d_kd": {"step_ms": 200.0, "peak_mb": 100.0}, "broken": {"error": "boom"}}
    rounds = {"plain": [100.0, 130.0], "limit": [160.0], "a2d_kd": [250.0, 200.0]}
    benchmark.add_ratios(rows, rounds)
    a2d = rows["a2d_kd"]
    assert a2d["time_ratio"] == pytest.approx(2.0) and a2d["time_ratio_vs_limit"] == pytest.approx(1.25)
    assert a2d["memory_ratio"] == pytest.approx(2.0) and a2d["memory_ratio_vs_limit"] == pytest.approx(1.25)
    assert a2d["spread"] == pytest.approx(1.25) and rows["plain"]["spread"] == pytest.approx(1.3)
    assert rows["limit"]["time_ratio_vs_limit"] == 1.0 and rows["broken"] == {"error": "boom"}
    markdown = benchmark.to_markdown({"tiny": {"config": benchmark.CONFIGS["tiny"], "methods": rows,
                                               "decoding": {"teacher": 1.0, "student": 2.0, "student_speedup": 2.0}}})
    assert "| a2d_kd | 200.0 | 2.00x | 1.25x | 1.25 | 100.0 | 2.00x | 1.25x |" in markdown
    assert "| broken | failed: boom |" in markdown


@pytest.fixture()
def child_calls(monkeypatch):
    """Child training runs stubbed: records (method, teacher_forward) per call."""
    calls = []

    def fake_child(flags, steps, warmup, teacher_forward=False, epoch=1, top_ops=0, paired_limit=None,
                   shuffle_seed=None):
        call = (flags[0], teacher_forward) if epoch == 1 else (flags[0], teacher_forward, epoch)
        call += (("shuffle seed", shuffle_seed),) if shuffle_seed is not None else ()
        calls.append(call + (("paired with", paired_limit[0]),) if paired_limit else call)
        result = {"step_ms": 30.0 if teacher_forward else 20.0, "peak_mb": 1.0}
        if paired_limit:
            # per-batch ratios differing by round, to show they are pooled over rounds
            result.update(limit_step_ms=30.0, paired_ratios=[1.0 + 0.1 * len(calls), 1.05])
        return result

    monkeypatch.setattr(benchmark, "prepare_config", lambda name, workdir: {})
    monkeypatch.setattr(benchmark, "training_flags", lambda name, paths, method, precision="fp32": [method])
    monkeypatch.setattr(benchmark, "config_shapes", lambda name, paths: {})
    monkeypatch.setattr(benchmark, "_train_in_child", fake_child)
    monkeypatch.setattr(benchmark, "measure_decoding",
                        lambda *args, **kwargs: {"teacher": 1.0, "student": 2.0, "student_speedup": 2.0})
    return calls


def test_only_the_limit_row_runs_the_teacher_forward(child_calls):
    report = benchmark.run(["tiny"], ["plain", "limit", "word_kd"], steps=1, warmup=0, repeats=1, workdir=None)
    assert child_calls == [("plain", False), ("limit", True), ("word_kd", False)]
    assert report["tiny"]["methods"]["word_kd"]["time_ratio_vs_limit"] == pytest.approx(20.0 / 30.0)


def test_a_row_is_timed_in_the_epoch_its_method_names(child_calls):
    """A2D from the cache is timed after its attention epochs (--a2d-attention-epochs 1: epoch 2),
    when no teacher runs; every other row in epoch 1."""
    assert "--a2d-attention-epochs" in benchmark.METHODS["a2d_kd_cached"]
    benchmark.run(["tiny"], ["plain", "limit", "a2d_kd", "a2d_kd_cached"], steps=1, warmup=0, repeats=1,
                  workdir=None)
    assert child_calls == [("plain", False), ("limit", True), ("a2d_kd", False), ("a2d_kd_cached", False, 2)]


def test_plain_and_limit_are_always_measured(child_calls, tmp_path):
    benchmark.cli_main(["--methods", "word_kd", "limit", "--configs", "tiny", "--repeats", "1",
                        "--output-dir", str(tmp_path)])
    assert child_calls == [("plain", False), ("limit", True), ("word_kd", False)]
    assert "| limit |" in (tmp_path / "benchmark.md").read_text()


def test_on_policy_rows_are_measured_with_word_kd_and_reported_against_it(child_calls, tmp_path):
    """An on-policy row (word KD's flags, every batch generated) brings word_kd into the same run,
    and the report gives its step time and memory as multiples of word_kd's."""
    row = benchmark.METHODS["word_kd_on_policy"]
    assert row[:len(benchmark.METHODS["word_kd"])] == benchmark.METHODS["word_kd"]
    assert row[len(benchmark.METHODS["word_kd"]):] == ["--on-policy-rate", "1"]
    benchmark.cli_main(["--methods", "word_kd_on_policy", "--configs", "tiny", "--repeats", "1",
                        "--output-dir", str(tmp_path)])
    assert child_calls == [("plain", False), ("limit", True), ("word_kd", False), ("word_kd_on_policy", False)]
    rows = {"word_kd": {"step_ms": 20.0, "peak_mb": 4.0}, "word_kd_on_policy": {"step_ms": 50.0, "peak_mb": 5.0},
            "a2d_kd": {"step_ms": 30.0, "peak_mb": 1.0}}
    benchmark.add_ratios(rows, {})
    assert rows["word_kd_on_policy"]["time_ratio_vs_word_kd"] == pytest.approx(2.5)
    assert rows["word_kd_on_policy"]["memory_ratio_vs_word_kd"] == pytest.approx(1.25)
    assert "time_ratio_vs_word_kd" not in rows["a2d_kd"]
    markdown = benchmark.to_markdown({"tiny": {"config": benchmark.CONFIGS["tiny"], "methods": rows,
                                               "decoding": {"teacher": 1.0, "student": 2.0, "student_speedup": 2.0}}})
    assert "word_kd_on_policy (every batch on-policy, generation included) against word_kd in the same rounds: " \
           "2.50x its step time, 1.25x its peak memory." in markdown


def test_paired_rows_time_against_the_limit_in_their_own_process(child_calls):
    """--paired: the limit row runs alone (its own memory and step time); every other row's child
    also builds the limit, and its time against the limit is the median of its per-batch ratios
    pooled over all rounds, with an interval around it; memory still compares separate children."""
    report = benchmark.run(["tiny"], ["plain", "limit", "word_kd"], steps=2, warmup=0, repeats=2, workdir=None,
                           paired=True)
    paired = ("paired with", "limit")
    assert child_calls == [("plain", False, paired), ("limit", True), ("word_kd", False, paired)] * 2
    word_kd = report["tiny"]["methods"]["word_kd"]
    # word_kd's children were calls 3 and 6: ratios 1.3, 1.05, 1.6, 1.05 -> median 1.175
    assert sorted(word_kd["paired_ratios"]) == pytest.approx([1.05, 1.05, 1.3, 1.6])
    assert word_kd["time_ratio_vs_limit"] == pytest.approx(1.175)
    low, high = word_kd["time_ratio_vs_limit_interval"]
    assert 1.05 <= low <= 1.175 <= high <= 1.6
    assert word_kd["memory_ratio_vs_limit"] == pytest.approx(1.0) and word_kd["time_ratio"] == pytest.approx(1.0)
    assert "time_ratio_vs_limit_interval" not in report["tiny"]["methods"]["limit"]
    markdown = benchmark.to_markdown(report)
    assert "| word_kd | 20.0 | 1.00x | 1.18x ({:.2f}-{:.2f}) |".format(low, high) in markdown
    assert "paired, the median over batches" in markdown


def test_every_row_times_the_batches_the_report_names(child_calls, tmp_path):
    """--shuffle-seed reaches every child (the limit's too) and the report and its table say which
    batches were timed; without it, fairseq's length-sorted order."""
    benchmark.cli_main(["--methods", "word_kd", "--configs", "tiny", "--repeats", "1", "--steps", "4",
                        "--warmup", "1", "--shuffle-seed", "7", "--output-dir", str(tmp_path)])
    seed = ("shuffle seed", 7)
    assert child_calls == [("plain", False, seed), ("limit", True, seed), ("word_kd", False, seed)]
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["tiny"]["timed_batches"] == {"order": "shuffled (seed 7)", "warmup": 1, "steps": 4}
    assert "Timed batches: 4 after 1 untimed, from the start of the epoch in shuffled (seed 7) order" in (
        (tmp_path / "benchmark.md").read_text())
    report = benchmark.run(["tiny"], ["plain", "limit"], steps=2, warmup=0, repeats=1, workdir=None)
    assert report["tiny"]["timed_batches"]["order"] == "length-sorted"
    assert child_calls[-1] == ("limit", True)


def test_median_interval_is_seeded_and_covers_the_median():
    """The bootstrap interval of a median: repeatable, equal to the value for constant data, and
    around the median of spread data (never outside the data's range)."""
    assert benchmark.median_with_interval([1.1] * 9) == (1.1, 1.1, 1.1)
    values = [0.9, 1.0, 1.02, 1.03, 1.05, 1.06, 1.08, 1.2, 1.5, 0.95, 1.04]
    median, low, high = benchmark.median_with_interval(values)
    assert median == 1.04 and min(values) <= low < median < high <= max(values)
    assert benchmark.median_with_interval(values) == (median, low, high)
    # twice the data, same spread: the interval does not widen
    _, low2, high2 = benchmark.median_with_interval(values * 2)
    assert high2 - low2 <= high - low


def test_cpu_step_peak_counts_the_bytes_a_step_holds_at_once():
    """Two 4 MB tensors alive together, then a third after both are freed: the peak is 8 MB (plus
    the few bytes torch allocates on its own), and a tensor made before the step and freed inside
    it does not lower the count."""
    import torch

    before = torch.empty(2**20)  # 4 MB from before the measured step
    megabyte_floats = 2**18

    def step():
        nonlocal before
        before = None
        first = torch.ones(4 * megabyte_floats)
        second = first * 2
        del first, second
        third = torch.zeros(4 * megabyte_floats)
        return third.sum()

    assert benchmark.cpu_step_peak_mb(step) == pytest.approx(8.0, abs=0.01)


def test_a_real_vocabulary_configuration_runs_a_step_and_records_its_shapes(tmp_path, monkeypatch):
    """d64_8k on a smaller corpus: the dictionary padded to 8,000 types (data, teacher and student
    all at that vocabulary), one word_kd training step measured in-process with its top operators."""
    monkeypatch.setitem(benchmark.CONFIGS, "d64_8k", {**benchmark.CONFIGS["d64_8k"], "corpus_train": 300})
    paths = benchmark.prepare_config("d64_8k", tmp_path)
    shapes = benchmark.config_shapes("d64_8k", paths)
    assert shapes["vocab"] == 8000 and shapes["max_tokens"] == 1024 and shapes["mean_tgt_len"] > 1
    result = benchmark.measure_training(benchmark.training_flags("d64_8k", paths, "word_kd"), steps=1, warmup=0,
                                        top_ops=3)
    assert result["step_ms"] > 0 and result["peak_mb"] > 0
    assert len(result["top_ops"]) == 3 and all(op["self_ms"] >= 0 for op in result["top_ops"])
    # --precision bf16 (the GPU check's rows): the same step with the student in bfloat16 (--cpu here)
    flags = benchmark.training_flags("d64_8k", paths, "word_kd", "bf16")
    assert flags[-2:] == ["--bf16", "--cpu"] and benchmark.training_flags("d64_8k", paths, "word_kd")[-1] != "--cpu"
    assert benchmark.measure_training(flags, steps=1, warmup=0)["step_ms"] > 0
    # an on-policy step (the student generates, then word KD on its outputs) runs through the trainer
    on_policy = benchmark.training_flags("d64_8k", paths, "word_kd_on_policy")
    assert benchmark.measure_training(on_policy, steps=1, warmup=0)["step_ms"] > 0
    # --paired: the row and the limit (plain step + teacher forward) built in one process, two
    # batches each, one ratio per batch
    paired = benchmark.measure_paired(benchmark.training_flags("d64_8k", paths, "word_kd"),
                                      benchmark.training_flags("d64_8k", paths, "limit"), steps=2, warmup=0)
    assert len(paired["paired_ratios"]) == 2 and all(r > 0 for r in paired["paired_ratios"])
    assert paired["step_ms"] > 0 and paired["limit_step_ms"] > 0 and paired["peak_mb"] > 0
    # more steps than the corpus has batches: one line naming the flags, before any step
    built = []
    monkeypatch.setattr(benchmark._TrainingRun, "step", lambda self, sample: built.append("step"))
    with pytest.raises(SystemExit, match=r"--steps 100000 --warmup 0: the configuration's corpus has only \d+ batches"):
        benchmark.measure_paired(benchmark.training_flags("d64_8k", paths, "word_kd"),
                                 benchmark.training_flags("d64_8k", paths, "limit"), steps=100_000, warmup=0)
    assert built == []
    # --shuffle-seed: every sentence once, in batches no longer in length order; the same batches for
    # the same seed (every row of a run times the same ones)
    run = benchmark._TrainingRun(benchmark.training_flags("d64_8k", paths, "word_kd"), shuffle_seed=3)

    def batches(iterator):
        return [(tuple(sample["id"].tolist()), sample["target"].size(1)) for sample in iterator]

    in_order, shuffled = batches(run.epoch_batches()), batches(run.batches)
    assert sorted(i for ids, _ in shuffled for i in ids) == sorted(i for ids, _ in in_order for i in ids)
    lengths = [length for _, length in in_order]
    assert lengths == sorted(lengths) and [length for _, length in shuffled] != sorted(lengths)
    assert batches(run.epoch_batches(3)) == shuffled and batches(run.epoch_batches(4)) != shuffled
    with pytest.raises(ValueError, match="more than the configuration's vocab"):
        benchmark.write_padded_dictionary(tmp_path / "d64_8k" / "corpus-dict" / "dict.src.txt", tmp_path / "x", 10)


def test_longer_lines_join_consecutive_pairs_in_order(tmp_path):
    """d64_8k_long's corpus: every split's pairs, in order, joined into lines of a geometric number of
    pairs (mean 2.25): no sentence lost, source and target still parallel, target lines about 24
    tokens on average (IWSLT'14's), with a long tail."""
    from fairseq_kd.data.synthetic import write_corpus

    write_corpus(tmp_path / "raw", seed=7, train_size=3000, valid_size=10, test_size=10)
    benchmark.join_sentence_pairs(tmp_path / "raw", tmp_path / "joined", 2.25, seed=7)
    for split in ("train", "valid", "test"):
        for lang in ("src", "tgt"):
            original = (tmp_path / "raw" / f"{split}.{lang}").read_text().split()
            assert (tmp_path / "joined" / f"{split}.{lang}").read_text().split() == original
    lines = {lang: (tmp_path / "joined" / f"train.{lang}").read_text().splitlines() for lang in ("src", "tgt")}
    assert len(lines["src"]) == len(lines["tgt"])
    assert 3000 / 2.6 < len(lines["tgt"]) < 3000 / 1.9
    lengths = [len(line.split()) + 1 for line in lines["tgt"]]
    assert 20 < sum(lengths) / len(lengths) < 28 and max(lengths) > 60
