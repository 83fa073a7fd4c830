"""The offline teacher (fairseq-kd-teacher-cache, --teacher-cache): the top-k loss against the
full-vocabulary loss, the cache's rows against the teacher run on each sentence alone, training
through the real fairseq-train CLI equal to live-teacher training when k covers the vocabulary,
resuming a build interrupted or killed at any moment byte for byte, every damaged cache refused by
name before training, and every refusal."""
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import (COMMON_TRAIN_ARGS, QUIET_ENV, TINY_STUDENT_ARGS, USER_DIR, build_tiny_student,
                      run_cli, run_fairseq_train_here)
from fairseq_kd.criterions.losses import topk_word_level_kd, word_level_kd


# ----------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_loss_equals_full_loss_when_the_teacher_mass_is_in_its_top_k(temperature):
    torch.manual_seed(0)
    batch, length, vocab, k = 3, 5, 40, 6
    student = torch.randn(batch, length, vocab)
    teacher = torch.full((batch, length, vocab), -1e4)  # no mass outside k tokens per position
    support = torch.rand(batch, length, vocab).argsort(-1)[..., :k]
    teacher.scatter_(-1, support, torch.randn(batch, length, k) * 2)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, 3:] = False
    values, ids = torch.log_softmax(teacher, -1).topk(k, -1)
    full = word_level_kd(student, teacher, mask, temperature)
    cached = topk_word_level_kd(student, values, ids, mask, temperature)
    assert cached.item() == pytest.approx(full.item(), rel=1e-5)
    # a slow reference, position by position
    expected = 0.0
    for b in range(batch):
        for t in range(length):
            if mask[b, t]:
                q = torch.softmax(values[b, t] / temperature, -1)
                p = torch.log_softmax(student[b, t] / temperature, -1)[ids[b, t]]
                expected += float((q * (q.log() - p)).sum()) * temperature**2
    assert cached.item() == pytest.approx(expected, rel=1e-5)
    # with mass outside the top k, the top-k loss is an approximation, not the full loss
    spread = torch.randn(batch, length, vocab)
    values, ids = torch.log_softmax(spread, -1).topk(k, -1)
    assert abs(topk_word_level_kd(student, values, ids, mask).item() - word_level_kd(student, spread, mask).item()) > 1e-2


# ----------------------------------------------------------------------------- the cache


class Stop(Exception):
    pass


def stop_after_two_shards(message):
    if message.startswith("shard 2/"):
        raise Stop()


def _task(data):
    """What TeacherCache.open reads of a training task, for ``data``'s train split."""
    from fairseq.data import Dictionary

    return SimpleNamespace(
        cfg=SimpleNamespace(train_subset="train", data=str(data), source_lang="src", target_lang="tgt"),
        source_dictionary=Dictionary.load(str(data / "dict.src.txt")),
        target_dictionary=Dictionary.load(str(data / "dict.tgt.txt")))


def build(data, teacher, output, *extra, check=True):
    """fairseq-kd-teacher-cache in a child of the warm interpreter (the command line, output and exit
    status of a new process); a new ``python -m`` process is _killed_build's."""
    return run_cli("fairseq-kd-teacher-cache", "--data", data, "--teacher-checkpoint", teacher,
                   "--output", output, "--cpu", *extra, check=check, warm=True)


def test_cache_rows_equal_the_teacher_on_each_sentence(tiny_data_bin, tiny_teacher, tmp_path):
    output = tmp_path / "cache"
    build(tiny_data_bin, tiny_teacher, output, "--k", "4", "--shard-size", "150", "--max-tokens", "300")
    manifest = json.loads((output / "cache.json").read_text())
    assert manifest["k"] == 4 and manifest["n_sentences"] == 400
    offsets = np.load(output / "offsets.npy")
    logprobs, ids = np.load(output / "topk_logprobs.npy"), np.load(output / "topk_ids.npy")
    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    from fairseq_kd.models.teacher import FrozenTeacher

    task = TranslationTask.setup_task(TranslationConfig(data=str(tiny_data_bin), source_lang="src", target_lang="tgt",
                                                        dataset_impl=None, required_seq_len_multiple=1))
    task.load_dataset("train")
    dataset = task.dataset("train")
    assert np.array_equal(np.diff(offsets), dataset.tgt_sizes) and offsets[-1] == len(logprobs)
    teacher = FrozenTeacher.load(str(tiny_teacher), task, teacher_data=str(tiny_data_bin)).model
    for index in (0, 7, 399):
        sample = dataset.collater([dataset[index]])
        with torch.no_grad():
            lp = torch.log_softmax(teacher(**sample["net_input"])[0].float(), -1)[0]
        values, top = lp.topk(4, -1)
        rows = slice(offsets[index], offsets[index + 1])
        np.testing.assert_allclose(logprobs[rows], values.numpy(), atol=1e-4)
        assert np.array_equal(ids[rows], top.numpy())
    # finished: a re-run with the same flags does nothing; one with another batching is refused by name
    flags = ("--k", "4", "--shard-size", "150", "--max-tokens", "300")
    assert "already complete" in build(tiny_data_bin, tiny_teacher, output, *flags).stdout
    other = build(tiny_data_bin, tiny_teacher, output, *flags[:4], check=False)
    assert other.returncode == 2 and "--max-tokens 8192 here, 300 in the record" in other.stderr


ARRAY_NAMES = ("offsets.npy", "topk_logprobs.npy", "topk_ids.npy")


def assert_same_cache(folder, reference):
    """The arrays byte for byte, and cache.json but for the arrays' modification times."""
    for name in ARRAY_NAMES:
        assert (folder / name).read_bytes() == (reference / name).read_bytes(), name

    def without_times(path):
        manifest = json.loads((path / "cache.json").read_text())
        for record in manifest["arrays"].values():
            del record["fingerprint"]["mtime_ns"]
        return manifest

    assert without_times(folder) == without_times(reference)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in reference.iterdir())


def test_an_interrupted_build_resumes_to_the_same_bytes(tiny_data_bin, tiny_teacher, tmp_path):
    from fairseq_kd.teacher_pass.teacher_cache import CacheConfig, build_cache

    whole = tmp_path / "whole"
    build_cache(CacheConfig(data=tiny_data_bin, teacher_checkpoint=tiny_teacher, output=whole, k=3, shard_size=100,
                            cpu=True), log=lambda _: None)
    cut = tmp_path / "cut"
    config = CacheConfig(data=tiny_data_bin, teacher_checkpoint=tiny_teacher, output=cut, k=3, shard_size=100, cpu=True)
    with pytest.raises(Stop):
        build_cache(config, log=stop_after_two_shards)
    assert not (cut / "cache.json").exists() and "parameters" in json.loads((cut / "progress.json").read_text())
    assert sorted(p.name for p in (cut / "shards").iterdir()) == ["shard000000.json", "shard000000.npz",
                                                                  "shard000001.json", "shard000001.npz"]
    build_cache(config, log=lambda _: None)
    assert_same_cache(cut, whole)


def _killed_build(data, teacher, output, until):
    """fairseq-kd-teacher-cache as :data:`KILL_SETTINGS` says, SIGKILLed as soon as ``until(output)`` holds."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in KILL_SETTINGS.items()]
    cmd = [sys.executable, "-m", "fairseq_kd.cli.teacher_cache", "--data", str(data), "--teacher-checkpoint",
           str(teacher), "--output", str(output), "--cpu", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=QUIET_ENV)
    deadline = time.time() + 300
    while not until(output) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


#: one-sentence batches (--max-tokens 12) in shards of 50: a shard takes a fraction of a second
KILL_SETTINGS = dict(k=3, shard_size=50, max_tokens=12)


@pytest.fixture(scope="module")
def uninterrupted(tiny_data_bin, tiny_teacher, tmp_path_factory):
    from fairseq_kd.teacher_pass.teacher_cache import CacheConfig, build_cache

    folder = tmp_path_factory.mktemp("uninterrupted") / "cache"
    build_cache(CacheConfig(data=tiny_data_bin, teacher_checkpoint=tiny_teacher, output=folder, cpu=True,
                            **KILL_SETTINGS), log=lambda _: None)
    return folder


@pytest.mark.parametrize("moment", ["first shard", "later shard"])
def test_a_build_killed_at_any_moment_resumes_to_the_same_bytes(tiny_data_bin, tiny_teacher, uninterrupted, tmp_path,
                                                                moment):
    """SIGKILL while the teacher computes the first shard (only progress.json written: the folder
    must not read as someone else's) or a later one; the re-run finishes the same cache."""
    from fairseq_kd.teacher_pass.teacher_cache import CacheConfig, build_cache

    killed = tmp_path / "killed"
    if moment == "first shard":
        _killed_build(tiny_data_bin, tiny_teacher, killed, until=lambda out: (out / "progress.json").is_file())
        assert not list(killed.glob("shards/shard*.npz"))
    else:
        _killed_build(tiny_data_bin, tiny_teacher, killed,
                      until=lambda out: (out / "shards" / "shard000000.npz").is_file())
        assert 1 <= len(list(killed.glob("shards/shard*.npz"))) < 8
    assert (killed / "progress.json").is_file() and not (killed / "cache.json").exists()
    build_cache(CacheConfig(data=tiny_data_bin, teacher_checkpoint=tiny_teacher, output=killed, cpu=True,
                            **KILL_SETTINGS), log=lambda _: None)
    assert_same_cache(killed, uninterrupted)


def test_opening_a_cache_hashes_the_data_only_when_its_files_changed(tiny_data_bin, tiny_teacher, tmp_path,
                                                                    hashed_files):
    from fairseq_kd.teacher_pass import teacher_cache

    data = tmp_path / "data"
    shutil.copytree(tiny_data_bin, data)  # sizes and modification times kept, as by a move or cp -p
    build(data, tiny_teacher, tmp_path / "cache", "--k", "2")
    hashed = hashed_files
    task = _task(data)

    def open_cache():
        return teacher_cache.TeacherCache.open(str(tmp_path / "cache"), task)

    assert open_cache().k == 2 and hashed == []  # the files recorded at build time: nothing read
    target_bin = data / "train.src-tgt.tgt.bin"
    stat = target_bin.stat()
    os.utime(target_bin, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, as after a plain cp
    assert open_cache().k == 2 and hashed == ["train.src-tgt.tgt.bin"]  # only the file whose time changed
    changed = bytearray(target_bin.read_bytes())
    changed[-1] ^= 1  # same size, other data
    target_bin.write_bytes(bytes(changed))
    with pytest.raises(teacher_cache.TeacherCacheError, match="other train data"):
        open_cache()
    assert len(hashed) == 2
    target_bin.write_bytes(bytes(changed) + b"\0")  # another size: refused without reading the files
    with pytest.raises(teacher_cache.TeacherCacheError, match="other train data"):
        open_cache()
    assert len(hashed) == 2


def test_a_max_tokens_below_the_longest_sentence_is_refused_before_the_teacher_runs(tiny_data_bin, tiny_teacher,
                                                                                    tmp_path):
    proc = build(tiny_data_bin, tiny_teacher, tmp_path / "cache", "--max-tokens", "3", check=False)
    assert proc.returncode == 2 and "--max-tokens 3 is smaller than sentence" in proc.stderr
    assert not (tmp_path / "cache" / "topk_logprobs.npy").exists()


def word_kd_losses(stdout: str):
    return [float(v) for v in re.findall(r"word_kd_loss=([\d.]+)", stdout)]


def _full_vocabulary_cache(data, teacher, folder):
    vocab = sum(1 for _ in open(data / "dict.tgt.txt")) + 4  # the symbols plus bos/pad/eos/unk
    build(data, teacher, folder, "--k", str(vocab))
    return folder


@pytest.fixture(scope="module")
def full_vocabulary_cache(tiny_data_bin, tiny_teacher, tmp_path_factory):
    """One full-vocabulary cache of the tiny teacher for the tests that train or read from it (none
    writes to it)."""
    return _full_vocabulary_cache(tiny_data_bin, tiny_teacher, tmp_path_factory.mktemp("full_vocabulary") / "cache")


def test_training_from_a_full_vocabulary_cache_equals_the_live_teacher(tiny_data_bin, tiny_teacher,
                                                                       full_vocabulary_cache, tmp_path):
    cache = full_vocabulary_cache
    common = ["--user-dir", USER_DIR, "--task", "translation_kd", *TINY_STUDENT_ARGS, "--criterion", "word_kd",
              *COMMON_TRAIN_ARGS, "--max-update", "3", "--dropout", "0"]
    live = run_cli("fairseq-train", tiny_data_bin, *common, "--teacher-checkpoint", tiny_teacher,
                   "--save-dir", tmp_path / "live", warm=True)
    # The teacher checkpoint given too (verified against the cache, never run): loading it draws from
    # the random generator as in the live run, so both students start from the same weights.
    cached = run_cli("fairseq-train", tiny_data_bin, *common, "--teacher-cache", cache, "--teacher-checkpoint",
                     tiny_teacher, "--save-dir", tmp_path / "cached", warm=True)
    live_losses, cached_losses = word_kd_losses(live.stdout + live.stderr), word_kd_losses(cached.stdout + cached.stderr)
    assert len(live_losses) == 3 and live_losses == pytest.approx(cached_losses, abs=2e-3)
    # Without the checkpoint: no teacher is loaded at all, and the cache alone serves the KD term.
    alone = run_cli("fairseq-train", tiny_data_bin, *common, "--teacher-cache", cache, "--save-dir", tmp_path / "alone",
                    warm=True)
    assert len(word_kd_losses(alone.stdout + alone.stderr)) == 3 and "dictionaries compared" not in alone.stderr
    # the student's checkpoint names the teacher the cache was made by
    from fairseq_kd.checkpoints import safe_load

    binding = safe_load(tmp_path / "alone" / "checkpoint_last.pt")["extra_state"]
    teacher_sha = json.loads((cache / "cache.json").read_text())["inputs"]["teacher"]["sha256"]
    assert teacher_sha in json.dumps(binding, default=str)


def test_refusals(tiny_data_bin, tiny_teacher, tmp_path):
    cache = tmp_path / "cache"
    build(tiny_data_bin, tiny_teacher, cache, "--k", "2")
    common = ["--user-dir", USER_DIR, "--task", "translation_kd", *TINY_STUDENT_ARGS, *COMMON_TRAIN_ARGS,
              "--max-update", "1", "--save-dir", tmp_path / "save"]

    def refused(*args):
        proc = run_fairseq_train_here(tiny_data_bin, *common, *args)
        assert proc.returncode != 0
        return proc.stdout + proc.stderr

    # a criterion that needs the teacher's features
    assert "--teacher-cache does not hold" in refused("--criterion", "a2d_kd", "--teacher-cache", cache)
    # another teacher than the one given
    other_teacher = tmp_path / "other.pt"  # the same model in another file: another sha256
    state = torch.load(tiny_teacher, map_location="cpu", weights_only=True)
    state["model"] = {name: value + 1e-3 if value.is_floating_point() else value
                      for name, value in state["model"].items()}
    torch.save(state, other_teacher)
    message = refused("--criterion", "word_kd", "--teacher-cache", cache, "--teacher-checkpoint", other_teacher)
    assert "was made by teacher sha256" in message and "not by --teacher-checkpoint" in message
    # a folder that is no finished cache
    (tmp_path / "empty").mkdir()
    assert "no finished cache" in refused("--criterion", "word_kd", "--teacher-cache", tmp_path / "empty")
    # a damaged cache, before the first update
    damaged = tmp_path / "damaged"
    shutil.copytree(cache, damaged)
    values = np.load(damaged / "topk_logprobs.npy")
    values[11, 0] = np.nan
    np.save(damaged / "topk_logprobs.npy", values)
    message = refused("--criterion", "word_kd", "--teacher-cache", damaged)
    assert f"--teacher-cache {damaged}: topk_logprobs.npy holds nan at row 11" in message
    assert "num_updates" not in message and not (tmp_path / "save" / "checkpoint_last.pt").exists()
    # other training data (a corpus of another seed, same dictionary size or not)
    proc = build(tiny_data_bin, tiny_teacher, cache, "--k", "3", check=False)
    assert proc.returncode == 2 and "holds a cache made with other settings or inputs: --k 3 here, 2 in the record" \
        in proc.stderr


# ----------------------------------------------------------------------------- damaged caches


@pytest.fixture(scope="module")
def sound_cache(tiny_data_bin, tiny_teacher, tmp_path_factory):
    from fairseq_kd.teacher_pass.teacher_cache import CacheConfig, build_cache

    folder = tmp_path_factory.mktemp("sound") / "cache"
    build_cache(CacheConfig(data=tiny_data_bin, teacher_checkpoint=tiny_teacher, output=folder, k=2, shard_size=100,
                            cpu=True), log=lambda _: None)
    return folder


def _edit_manifest(change):
    def damage(folder):
        manifest = json.loads((folder / "cache.json").read_text())
        change(manifest)
        (folder / "cache.json").write_text(json.dumps(manifest))
    return damage


def _edit_array(name, change):
    def damage(folder):
        np.save(folder / name, change(np.load(folder / name)))
    return damage


def _set(array, index, value):
    array[index] = value
    return array


def _write_bytes(name, data):
    def damage(folder):
        (folder / name).write_bytes(data(folder / name))
    return damage


# each damage and the start of what --teacher-cache DIR: ... must say about it
DAMAGED = {
    "k not matching the arrays": (_edit_manifest(lambda m: m.update(k=3)),
                                  r"topk_logprobs.npy has shape \(2504, 2\) but cache.json .* makes it \(2504, 3\)"),
    "truncated offsets": (_edit_array("offsets.npy", lambda a: a[:-5]), r"offsets.npy has shape \(396,\)"),
    "offsets file cut short": (_write_bytes("offsets.npy", lambda path: path.read_bytes()[:-40]),
                               r"offsets.npy is 3296 bytes where its header announces 3336: truncated"),
    "shifted offsets": (_edit_array("offsets.npy", lambda a: a + 1), r"offsets.npy starts at 1, not 0"),
    "offsets not ending at n_tokens": (_edit_array("offsets.npy", lambda a: _set(a, -1, 2500)),
                                       r"offsets.npy ends at 2500, not at n_tokens 2504"),
    "offsets out of order": (_edit_array("offsets.npy", lambda a: _set(a, 200, a[201] + 1)),
                             r"offsets.npy decreases after sentence 200"),
    "negative offsets": (_edit_array("offsets.npy", lambda a: _set(a, 10, -4)),
                         r"offsets.npy holds a negative offset \(-4, sentence 10\)"),
    "ids out of range": (_edit_array("topk_ids.npy", lambda a: _set(a, (5, 1), 64)),
                         r"topk_ids.npy holds token id 64 at row 5, outside the target dictionary \(0..63\)"),
    "negative ids": (_edit_array("topk_ids.npy", lambda a: _set(a, (9, 0), -1)), r"topk_ids.npy holds token id -1"),
    "NaN log-probabilities": (_edit_array("topk_logprobs.npy", lambda a: _set(a, (7, 1), np.nan)),
                              r"topk_logprobs.npy holds nan at row 7 \(not a finite number\)"),
    "positive log-probabilities": (_edit_array("topk_logprobs.npy", lambda a: _set(a, (3, 0), 50.0)),
                                   r"topk_logprobs.npy holds 50 at row 3 \(a log-probability above 0\)"),
    "token ids stored as float64": (_edit_array("topk_ids.npy", lambda a: a.astype(np.float64)),
                                    r"topk_ids.npy holds float64 values where a cache holds int32"),
    "a pickled object array": (_edit_array("topk_ids.npy", lambda a: np.array([object()] * 3, dtype=object)),
                               r"topk_ids.npy holds Python objects \(a pickle\), not numbers"),
    "a pickle, not a .npy": (_write_bytes("topk_logprobs.npy", lambda path: pickle.dumps({"rows": [1.0]})),
                             r"topk_logprobs.npy is not a plain .npy array"),
    "a missing array": (lambda folder: (folder / "topk_ids.npy").unlink(), r"topk_ids.npy missing"),
    "an array changed within range": (_edit_array("topk_logprobs.npy", lambda a: a - 0.5),
                                      r"topk_logprobs.npy is not the file the cache was built with"),
    "missing key 'split'": (_edit_manifest(lambda m: m.pop("split")), r"cache.json lacks the key 'split'"),
    "k that is no number": (_edit_manifest(lambda m: m.update(k="2")), r"cache.json holds k '2', not a whole number"),
    "no array records": (_edit_manifest(lambda m: m["arrays"].pop("offsets.npy")),
                         r"cache.json lacks the record of offsets.npy"),
    "bad JSON": (_write_bytes("cache.json", lambda path: path.read_bytes()[:-30]), r"cache.json is not valid JSON"),
    # a record of an older format is one that fails today's checks: format 2 lacked these settings
    "a cache of format 2": (_edit_manifest(lambda m: [m.update(format="fairseq-kd-teacher-cache/2")]
                                           + [m.pop(key) for key in ("max_tokens", "shard_size", "fp16", "device")]),
                            r"cache.json lacks the keys 'max_tokens', 'shard_size', 'fp16', 'device'"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_cache_is_refused_by_name_at_start_up(tiny_data_bin, sound_cache, tmp_path, case):
    from fairseq_kd.teacher_pass.teacher_cache import TeacherCache, TeacherCacheError

    damage, expected = DAMAGED[case]
    folder = tmp_path / "cache"
    shutil.copytree(sound_cache, folder)  # times kept: only the damage is seen
    TeacherCache.open(str(folder), _task(tiny_data_bin))  # sound before
    damage(folder)
    with pytest.raises(TeacherCacheError) as refused:
        TeacherCache.open(str(folder), _task(tiny_data_bin))
    message = str(refused.value)
    assert re.match(rf"--teacher-cache {re.escape(str(folder))}: {expected}", message), message
    assert "\n" not in message and "allow_pickle" not in message


def test_the_checks_read_large_arrays_in_chunks(tiny_data_bin, sound_cache, tmp_path, monkeypatch):
    """A bad value past the first chunk is found, and named by its row in the whole array."""
    from fairseq_kd.data import teacher_cache_reader
    from fairseq_kd.teacher_pass import teacher_cache

    monkeypatch.setattr(teacher_cache_reader, "CHECK_ROWS", 100)
    folder = tmp_path / "cache"
    shutil.copytree(sound_cache, folder)
    _edit_array("topk_logprobs.npy", lambda a: _set(a, (2345, 1), np.inf))(folder)
    with pytest.raises(teacher_cache.TeacherCacheError, match=r"topk_logprobs.npy holds inf at row 2345"):
        teacher_cache.TeacherCache.open(str(folder), _task(tiny_data_bin))


# ----------------------------------------------------------------------------- the records' fingerprints


def _old_sha256_of_files(paths):
    """How fairseq-kd-teacher-cache/1 recorded the split: one digest over names and bytes."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _format_1_parameters(parameters, data, teacher):
    """A format-2 cache's parameters as a fairseq-kd-teacher-cache/1 record held them."""
    split = sorted(p for p in data.glob("train.src-tgt.*") if p.suffix in (".bin", ".idx"))
    settings = {k: v for k, v in parameters.items()
                if k not in ("inputs", "n_sentences", "n_tokens", "teacher_path", "arrays")}
    return {**settings, "format": "fairseq-kd-teacher-cache/1", "data_sha256": _old_sha256_of_files(split),
            "teacher_sha256": hashlib.sha256(teacher.read_bytes()).hexdigest()}


def test_a_format_1_cache_fails_the_checks_in_one_line(tiny_data_bin, tiny_teacher, tmp_path):
    """A record of an older format is one that fails today's checks, by training and by the build."""
    from fairseq_kd.teacher_pass.teacher_cache import CacheConfig, TeacherCache, TeacherCacheError, build_cache

    def config(output):
        return CacheConfig(data=tiny_data_bin, teacher_checkpoint=tiny_teacher, output=output, k=2, shard_size=100,
                           cpu=True)

    refusal = r"cache.json lacks the keys 'inputs', 'arrays'"
    # a finished cache
    cache = tmp_path / "cache"
    build_cache(config(cache), log=lambda _: None)
    manifest = json.loads((cache / "cache.json").read_text())
    split = sorted(p for p in tiny_data_bin.glob("train.src-tgt.*") if p.suffix in (".bin", ".idx"))
    legacy = {**_format_1_parameters(manifest, tiny_data_bin, tiny_teacher), "n_sentences": manifest["n_sentences"],
              "n_tokens": manifest["n_tokens"], "teacher_path": manifest["teacher_path"],
              "data_files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in split}}
    (cache / "cache.json").write_text(json.dumps(legacy, indent=2, sort_keys=True) + "\n")
    with pytest.raises(TeacherCacheError, match=refusal) as refused:  # by training
        TeacherCache.open(str(cache), _task(tiny_data_bin), teacher_sha256=legacy["teacher_sha256"])
    assert "\n" not in str(refused.value)
    with pytest.raises(TeacherCacheError, match=refusal):  # by the build
        build_cache(config(cache), log=lambda _: None)
    assert json.loads((cache / "cache.json").read_text()) == legacy
    # an interrupted build whose progress.json is of format 1
    cut = tmp_path / "cut"
    with pytest.raises(Stop):
        build_cache(config(cut), log=stop_after_two_shards)
    progress = json.loads((cut / "progress.json").read_text())
    (cut / "progress.json").write_text(json.dumps(
        {"parameters": _format_1_parameters(progress["parameters"], tiny_data_bin, tiny_teacher),
         "done_shards": [0, 1]}, indent=2, sort_keys=True) + "\n")
    with pytest.raises(TeacherCacheError, match=r"holds an interrupted cache made with other settings or inputs: .*"
                       r"the format fairseq-kd-teacher-cache/4 here, fairseq-kd-teacher-cache/1 in the record") as refused:
        build_cache(config(cut), log=lambda _: None)
    assert "\n" not in str(refused.value)
    assert not (cut / "cache.json").exists()


def test_a_rerun_reads_only_the_inputs_whose_size_or_time_changed(tiny_data_bin, tiny_teacher, tmp_path,
                                                                  hashed_files):
    from fairseq_kd.checkpoints import safe_load
    from fairseq_kd.teacher_pass.teacher_cache import CacheConfig, TeacherCacheError, build_cache

    data, teacher = tmp_path / "data", tmp_path / "teacher.pt"
    shutil.copytree(tiny_data_bin, data)
    shutil.copy2(tiny_teacher, teacher)
    config = CacheConfig(data=data, teacher_checkpoint=teacher, output=tmp_path / "cache", k=2, shard_size=100,
                         cpu=True)
    with pytest.raises(Stop):
        build_cache(config, log=stop_after_two_shards)
    hashed = hashed_files
    hashed.clear()
    logs = []
    build_cache(config, log=logs.append)  # resumed: the teacher runs; only shards and the new arrays are hashed
    # the two shards skipped as done, then every shard merged, checked against their records
    shards = [f"shard{index:06d}.npz" for index in range(4)]
    assert logs[0].startswith("shard 3/4") and hashed == shards[:2] + shards + list(ARRAY_NAMES)
    hashed.clear()
    build_cache(config, log=logs.append)  # finished: checked, nothing hashed
    assert "already complete" in logs[-1] and hashed == []
    # a touched teacher is read once, then its new time is recorded
    stat = teacher.stat()
    os.utime(teacher, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    build_cache(config, log=logs.append)
    assert "already complete" in logs[-1] and hashed == ["teacher.pt"]
    build_cache(config, log=logs.append)
    assert "already complete" in logs[-1] and hashed == ["teacher.pt"]
    # so is a touched array, and a damaged one is refused by the build as by training
    logprobs = tmp_path / "cache" / "topk_logprobs.npy"
    stat = logprobs.stat()
    os.utime(logprobs, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    build_cache(config, log=logs.append)
    assert "already complete" in logs[-1] and hashed == ["teacher.pt", "topk_logprobs.npy"]
    values = np.load(logprobs)
    values[0, 0] = np.nan
    np.save(logprobs, values)
    with pytest.raises(TeacherCacheError, match=r"^--output .*cache: topk_logprobs.npy holds nan at row 0"):
        build_cache(config, log=logs.append)
    # another teacher is refused as before
    state = safe_load(teacher)
    state["note"] = "another checkpoint"
    torch.save(state, teacher)
    with pytest.raises(TeacherCacheError, match="holds a cache made with other settings or inputs: "
                                                "--teacher-checkpoint: other content here than in the record"):
        build_cache(config, log=logs.append)


# ----------------------------------------------------------------------------- A2D after its attention epochs


def test_a2d_runs_the_teacher_until_its_attention_epochs_end_and_reads_the_cache_after(
        tiny_data_bin, tiny_teacher, full_vocabulary_cache):
    """With --a2d-attention-epochs 1 and a full-vocabulary cache: epoch 1 runs the teacher (attention
    terms and word KD), epoch 2 runs no teacher and captures nothing, and its word-KD term equals a
    slow per-position KL against the teacher run by hand; the alignment modules still get a (zero)
    gradient, as DistributedDataParallel needs."""
    import math

    import fairseq_kd
    from fairseq_kd.criterions.a2d_kd import A2DConfig, AlignToDistillCriterion
    from fairseq_kd.tasks.translation_kd import TranslationKDConfig, TranslationKDTask

    fairseq_kd.register()
    cache = full_vocabulary_cache
    task = TranslationKDTask.setup_task(TranslationKDConfig(
        data=str(tiny_data_bin), source_lang="src", target_lang="tgt", teacher_checkpoint=str(tiny_teacher),
        teacher_cache=str(cache), train_subset="train", dataset_impl=None, required_seq_len_multiple=1))
    student = build_tiny_student(task)
    task.load_dataset("train")
    dataset = task.dataset("train")
    sample = dataset.collater([dataset[i] for i in range(5)])
    criterion = AlignToDistillCriterion.build_criterion(
        A2DConfig(sentence_avg=False, a2d_attention_epochs=1), task)
    teacher_runs = []
    original_forward = criterion.teacher.forward
    criterion.teacher.forward = lambda *args: teacher_runs.append(args[1]) or original_forward(*args)
    student.train()

    criterion.begin_epoch(1)
    _, _, first = criterion(student, sample)
    assert len(teacher_runs) == 1 and teacher_runs[0].attention_kinds
    assert all(first[f"{term}_loss"] > 0 for term in ("enc_self_att", "dec_self_att", "dec_cross_att", "word_kd"))

    criterion.begin_epoch(2)
    assert criterion.loss_weights()["enc_self_att"] == 0.0
    loss, sample_size, second = criterion(student, sample)
    assert len(teacher_runs) == 1, "the teacher ran after the attention epochs although the cache serves word KD"
    assert all(second[f"{term}_loss"] == 0 for term in ("enc_self_att", "dec_self_att", "dec_cross_att"))

    with torch.no_grad():
        student_logits = student(**sample["net_input"])[0]
        teacher_logits = original_forward(sample["net_input"], criterion.teacher_request)[0][0]
    pad = task.target_dictionary.pad()
    reference = 0.0
    for b, row in enumerate(sample["target"].tolist()):
        for t, token in enumerate(row):
            if token != pad:
                log_p = torch.log_softmax(teacher_logits[b, t].double(), -1)
                log_q = torch.log_softmax(student_logits[b, t].double(), -1)
                reference += float((log_p.exp() * (log_p - log_q)).sum())
    assert float(second["word_kd_loss"]) == pytest.approx(reference, rel=1e-4)
    assert math.isclose(loss.item(), float(second["ce_loss"]) + float(second["word_kd_loss"]), rel_tol=1e-5)

    loss.backward()
    alignment_grads = [p.grad for p in criterion.alignments.parameters()]
    assert alignment_grads and all(g is not None and (g == 0).all() for g in alignment_grads)


def test_a2d_with_the_cache_after_its_attention_epochs_trains_like_the_live_teacher(
        tiny_data_bin, tiny_teacher, full_vocabulary_cache, tmp_path):
    """Through fairseq-train, two epochs with --a2d-attention-epochs 1: reading a full-vocabulary
    cache in epoch 2 gives the live teacher's losses step for step."""
    cache = full_vocabulary_cache
    common = ["--user-dir", USER_DIR, "--task", "translation_kd", *TINY_STUDENT_ARGS, "--criterion", "a2d_kd",
              "--a2d-attention-epochs", "1", *COMMON_TRAIN_ARGS, "--max-epoch", "2", "--dropout", "0",
              "--teacher-checkpoint", tiny_teacher]
    live = run_cli("fairseq-train", tiny_data_bin, *common, "--save-dir", tmp_path / "live", warm=True)
    cached = run_cli("fairseq-train", tiny_data_bin, *common, "--teacher-cache", cache, "--save-dir", tmp_path / "cached",
                     warm=True)

    def per_step(stdout, key):
        return [(int(m.group(1)), float(m.group(2)))
                for m in re.finditer(r"epoch (\d+):.*?" + key + r"=([\d.]+)", stdout)]

    live_log, cached_log = live.stdout + live.stderr, cached.stdout + cached.stderr
    live_kd, cached_kd = per_step(live_log, "word_kd_loss"), per_step(cached_log, "word_kd_loss")
    assert {epoch for epoch, _ in live_kd} == {1, 2} and len(live_kd) == len(cached_kd)
    assert [e for e, _ in live_kd] == [e for e, _ in cached_kd]
    assert [v for _, v in live_kd] == pytest.approx([v for _, v in cached_kd], abs=2e-3)
    # the attention term is on in epoch 1 only
    attention = per_step(cached_log, "enc_self_att_loss")
    assert any(v > 0 for e, v in attention if e == 1) and all(v == 0 for e, v in attention if e == 2)


def test_a2d_reads_a_cache_only_after_its_attention_epochs_and_with_the_teacher(tiny_data_bin, tiny_teacher,
                                                                                sound_cache, tmp_path):
    cache = sound_cache  # k 2
    common = ["--user-dir", USER_DIR, "--task", "translation_kd", *TINY_STUDENT_ARGS, *COMMON_TRAIN_ARGS,
              "--max-update", "1", "--save-dir", tmp_path / "save", "--criterion", "a2d_kd", "--teacher-cache", cache]

    def refused(*args):
        proc = run_fairseq_train_here(tiny_data_bin, *common, *args)
        assert proc.returncode != 0
        return proc.stdout + proc.stderr

    assert "--a2d-attention-epochs" in refused("--teacher-checkpoint", tiny_teacher)
    assert "pass --teacher-checkpoint PATH as well" in refused("--a2d-attention-epochs", "2")
    assert "--a2d-attention-epochs must be >= 1" in refused("--a2d-attention-epochs", "0",
                                                            "--teacher-checkpoint", tiny_teacher)
    assert not (tmp_path / "save").exists() or not any((tmp_path / "save").iterdir())


def test_training_reads_a_cache_without_importing_the_offline_pass():
    """The reader (TeacherCache) lives outside teacher_pass: the plugin and the reader load none of it."""
    code = ("import sys, fairseq_kd; fairseq_kd.register(); from fairseq_kd.data.teacher_cache_reader import "
            "TeacherCache; loaded = [m for m in sys.modules if m.startswith('fairseq_kd.teacher_pass')]; "
            "print(loaded); sys.exit(1 if loaded else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=QUIET_ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_the_systems_refusal_to_read_the_cache_is_one_line_naming_the_flag(tiny_data_bin, sound_cache, monkeypatch):
    """An OS error reading a cache's file (permissions, a disk error) is a user error naming
    --teacher-cache and the file, not a traceback."""
    import errno

    from fairseq_kd.data import teacher_cache_reader
    from fairseq_kd.errors import FileAccessError

    unreadable = sound_cache / "topk_ids.npy"

    def refused(path, *_args):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(unreadable))

    monkeypatch.setattr(teacher_cache_reader, "fingerprint", refused)
    with pytest.raises(FileAccessError) as error:
        teacher_cache_reader.TeacherCache.open(str(sound_cache), _task(tiny_data_bin))
    assert str(error.value) == f"--teacher-cache {sound_cache}: {unreadable}: {os.strerror(errno.EACCES)}"
