"""fairseq-kd-seqkd --engine ctranslate2: the teacher converted to CTranslate2 decodes the same
batches as fairseq's SequenceGenerator, into the same resumable shards, manifest and binaries.

The reference is the fairseq engine itself (tests/test_seqkd.py checks it against fairseq-generate):
in float32 the CTranslate2 engine must give its tokens exactly with beam 1, and on nearly every
sentence with beam 5.
"""
import filecmp
import json
import shutil
import signal
import subprocess
import time

import pytest
from conftest import BIN, QUIET_ENV, run_cli, run_cli_here
from conftest import seqkd_config as config

pytest.importorskip("ctranslate2")

import fairseq_kd  # noqa: E402
from fairseq.data import indexed_dataset  # noqa: E402
from fairseq_kd import deploy  # noqa: E402
from fairseq_kd.teacher_pass import seqkd  # noqa: E402
from fairseq_kd.deploy import export_ctranslate2 as export_module  # noqa: E402

fairseq_kd.register()


SENTENCES = 400
EOS = 2  # fairseq's </s>
TARGET_FILES = ("train.src-tgt.tgt.bin", "train.src-tgt.tgt.idx")
SOURCE_FILES = ("train.src-tgt.src.bin", "train.src-tgt.src.idx")


def quiet(_line):
    pass


def read_targets(folder):
    data = indexed_dataset.MMapIndexedDataset(str(folder / "train.src-tgt.tgt"))
    return [data[i].tolist() for i in range(len(data))]


def manifest_of(folder):
    return json.loads((folder / seqkd.MANIFEST_NAME).read_text())


@pytest.fixture(scope="module")
def runs(tiny_data_bin, tiny_teacher, seqkd_fairseq_runs, tmp_path_factory):
    """Finished outputs, in process: {(engine, beam): folder} (the fairseq engine's: conftest's)."""
    root = tmp_path_factory.mktemp("seqkd_ct2")
    folders = {("fairseq", beam): folder for beam, folder in seqkd_fairseq_runs.items()}
    for engine in ("ctranslate2",):
        for beam in (1, 5):
            folders[engine, beam] = root / f"{engine}_beam{beam}"
            result = seqkd.run(config(tiny_data_bin, tiny_teacher, folders[engine, beam], engine=engine, beam=beam),
                               log=quiet)
            assert result.status == "complete" and result.sentences == SENTENCES
    return folders


# ------------------------------------------------------------------------ same output as fairseq
def test_float32_greedy_is_fairseqs_output_byte_for_byte(runs):
    fairseq, ct2 = runs["fairseq", 1], runs["ctranslate2", 1]
    for name in TARGET_FILES + SOURCE_FILES:
        assert filecmp.cmp(fairseq / name, ct2 / name, shallow=False), name
    assert not (ct2 / seqkd.WORK_DIR_NAME).exists()  # the converted teacher went with the shards
    manifest = manifest_of(ct2)
    assert manifest["status"] == "complete" and manifest["sentences"] == SENTENCES
    assert manifest["parameters"]["engine"] == "ctranslate2"
    assert manifest["parameters"]["ct2_quantization"] == "float32"
    import ctranslate2

    decoding = manifest["decoding"]
    assert (decoding["engine"], decoding["ct2_quantization"], decoding["ctranslate2_version"]) == (
        "ctranslate2", "float32", ctranslate2.__version__)
    fairseq_manifest = manifest_of(fairseq)
    assert fairseq_manifest["parameters"]["engine"] == "fairseq"
    assert "ct2_quantization" not in fairseq_manifest["parameters"]
    assert fairseq_manifest["decoding"]["engine"] == "fairseq"
    assert "ctranslate2_version" not in fairseq_manifest["decoding"]


def test_float32_beam_search_agrees_with_fairseq_on_nearly_every_sentence(runs):
    fairseq, ct2 = read_targets(runs["fairseq", 5]), read_targets(runs["ctranslate2", 5])
    assert len(fairseq) == len(ct2) == SENTENCES
    assert all(t[-1] == EOS and EOS not in t[:-1] for t in ct2)
    same = sum(a == b for a, b in zip(fairseq, ct2))
    # measured: 394 of 400 identical; the rest are near-ties of the two beam searches' stopping rules
    # and hypotheses cut by the length limit (fairseq lets the forced </s> compete, CTranslate2 stops)
    assert same >= 0.9 * SENTENCES, f"{same}/{SENTENCES} hypotheses identical"
    for name in SOURCE_FILES:
        assert filecmp.cmp(runs["fairseq", 5] / name, runs["ctranslate2", 5] / name, shallow=False)


def test_int8_quantization_decodes_every_sentence(tiny_data_bin, tiny_teacher, tmp_path):
    output = tmp_path / "int8"
    result = seqkd.run(config(tiny_data_bin, tiny_teacher, output, engine="ctranslate2",
                              ct2_quantization="int8"), log=quiet)
    assert result.status == "complete"
    targets = read_targets(output)
    assert len(targets) == SENTENCES and all(len(t) >= 2 and t[-1] == EOS for t in targets)
    manifest = manifest_of(output)
    assert manifest["parameters"]["ct2_quantization"] == "int8" == manifest["decoding"]["ct2_quantization"]


# ------------------------------------------------------------------------ split over workers
def test_two_workers_of_a_job_array_write_one_process_output(tiny_data_bin, tiny_teacher, runs, tmp_path,
                                                             monkeypatch):
    """--num-shards 2 --shard-id 0, then 1 (tests/test_teacher_pass_sharding.py runs workers at
    once): each converts its own teacher, the second to finish binarises one process's bytes."""
    for name in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    output = tmp_path / "array"
    lines = []
    first = seqkd.run(config(tiny_data_bin, tiny_teacher, output, engine="ctranslate2", beam=1, num_shards=2,
                             shard_id=0), log=lines.append)
    assert first.status == "worker_done" and first.decoded_now == 208
    assert lines[-1] == ("worker 0 of 2 (job array): 3 of 7 shards remain (2, 4, 6); the worker that writes the "
                         "last one merges (or re-run without --num-shards)")
    work = output / seqkd.WORK_DIR_NAME
    assert (work / f"{seqkd.CT2_TEACHER_DIR}_worker0" / "model.bin").is_file()
    second = seqkd.run(config(tiny_data_bin, tiny_teacher, output, engine="ctranslate2", beam=1, num_shards=2,
                              shard_id=1), log=quiet)
    assert second.status == "complete" and second.decoded_now == 192 and not work.exists()
    for name in TARGET_FILES + SOURCE_FILES:
        assert filecmp.cmp(output / name, runs["ctranslate2", 1] / name, shallow=False), name


# ------------------------------------------------------------------------ resuming
def test_killed_ctranslate2_run_resumes_byte_identically(tiny_data_bin, tiny_teacher, tmp_path):
    # one-sentence batches in shards of 8 sentences: 50 shards, slow enough to be killed in the middle
    flags = ["--data", tiny_data_bin, "--teacher-checkpoint", tiny_teacher, "--max-len-a", "1.2", "--max-len-b",
             "10", "--shard-size", "8", "--batch-size", "1", "--threads", "1", "--engine", "ctranslate2"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([str(BIN / "fairseq-kd-seqkd"), *map(str, flags), "--output", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=QUIET_ENV)
    work = killed / seqkd.WORK_DIR_NAME
    deadline = time.time() + 300
    while not any(work.glob("shard*.pt")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(work.glob("shard*.pt")))
    assert 1 <= done < 50 and not (killed / TARGET_FILES[0]).exists(), f"not killed mid-way ({done} shards)"
    assert (work / seqkd.CT2_TEACHER_DIR / "model.bin").is_file()
    resumed = run_cli("fairseq-kd-seqkd", *flags, "--output", killed, warm=True)
    assert f"resuming: {done} of 50 shards already decoded" in resumed.stdout
    straight = tmp_path / "straight"
    run_cli("fairseq-kd-seqkd", *flags, "--output", straight, warm=True)
    for name in TARGET_FILES + SOURCE_FILES:
        assert filecmp.cmp(killed / name, straight / name, shallow=False), name


def test_converted_teacher_is_reused_on_resume_and_remade_when_its_record_differs(
        tiny_data_bin, tiny_teacher, tmp_path, monkeypatch):
    exports = []
    real_export = export_module.export_ctranslate2

    def counted(*args, **kwargs):
        exports.append(kwargs.get("quantization"))
        return real_export(*args, **kwargs)

    monkeypatch.setattr(export_module, "export_ctranslate2", counted)
    output = tmp_path / "out"
    settings = config(tiny_data_bin, tiny_teacher, output, engine="ctranslate2", max_shards=1)
    assert seqkd.run(settings, log=quiet).status == "partial" and exports == ["float32"]
    assert seqkd.run(settings, log=quiet).decoded_now == 64 and exports == ["float32"]  # reused
    record_path = output / seqkd.WORK_DIR_NAME / seqkd.CT2_TEACHER_DIR / export_module.RECORD_NAME
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps({**record, "checkpoint_sha256": "0" * 64}))  # another teacher's
    assert seqkd.run(settings, log=quiet).decoded_now == 64 and exports == ["float32", "float32"]  # re-made
    assert json.loads(record_path.read_text())["checkpoint_sha256"] == record["checkpoint_sha256"]


# ------------------------------------------------------------------------ refusals
def test_resume_with_another_engine_is_refused_naming_engine(tiny_data_bin, tiny_teacher, runs, tmp_path):
    with pytest.raises(seqkd.SeqKDError, match=r"other settings \(differing: ct2_quantization, engine;"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, runs["ctranslate2", 1], engine="fairseq", beam=1), log=quiet)
    with pytest.raises(seqkd.SeqKDError, match=r"other settings \(differing: ct2_quantization, engine;"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, runs["fairseq", 1], engine="ctranslate2", beam=1), log=quiet)
    with pytest.raises(seqkd.SeqKDError, match=r"other settings \(differing: ct2_quantization;"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, runs["ctranslate2", 1], engine="ctranslate2", beam=1,
                         ct2_quantization="int8"), log=quiet)
    # a record without "engine" (as written before engines existed) is a record of other settings,
    # named, for every engine: no older format is read as today's
    old = tmp_path / "old"
    shutil.copytree(runs["fairseq", 1], old)
    manifest = manifest_of(old)
    del manifest["parameters"]["engine"]
    (old / seqkd.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(seqkd.SeqKDError, match=r"other settings \(differing: ct2_quantization, engine;"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, old, engine="ctranslate2", beam=1), log=quiet)
    with pytest.raises(seqkd.SeqKDError, match=r"other settings \(differing: engine;.*--engine fairseq here, unset in "
                                               r"the record"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, old, beam=1), log=quiet)
    assert manifest_of(old) == manifest  # nothing rewritten


def test_bad_engine_flags_are_refused_in_one_line(tiny_data_bin, tiny_teacher, tmp_path):
    output = tmp_path / "out"
    cases = ((["--engine", "nope"], "--engine 'nope': choose one of auto, fairseq, ctranslate2, transformers"),
             (["--engine", "ctranslate2", "--fp16"], "--ct2-quantization float16 or int8_float16 on CUDA"))
    for flags, message in cases:
        proc = run_cli_here("fairseq-kd-seqkd", "--data", tiny_data_bin, "--teacher-checkpoint", tiny_teacher,
                            "--output", output, *flags)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("fairseq-kd-seqkd: error:")
        assert "Traceback" not in proc.stderr
    for overrides, flag in ((dict(engine="ctranslate2", ct2_quantization="int4"), "--ct2-quantization 'int4'"),
                            (dict(engine="ctranslate2", threads=-1), "--threads")):
        with pytest.raises(seqkd.SeqKDError, match=flag):
            seqkd.run(config(tiny_data_bin, tiny_teacher, output, **overrides), log=quiet)
    assert not output.exists()


def test_missing_ctranslate2_or_a_refused_conversion_leaves_no_output(tiny_data_bin, tiny_teacher, tmp_path,
                                                                      monkeypatch, capsys):
    output = tmp_path / "out"

    def missing():
        raise deploy.CTranslate2MissingError(f"CTranslate2 cannot be imported; {deploy.CTRANSLATE2_FIX}")

    with monkeypatch.context() as patch:
        patch.setattr(deploy, "import_ctranslate2", missing)
        with pytest.raises(deploy.CTranslate2MissingError, match="pip install"):
            seqkd.run(config(tiny_data_bin, tiny_teacher, output, engine="ctranslate2"), log=quiet)
    assert not output.exists()

    def refused(*args, **kwargs):
        raise export_module.CTranslate2ExportError("'teacher.pt' cannot be expressed in CTranslate2: something")

    monkeypatch.setattr(export_module, "export_ctranslate2", refused)
    with pytest.raises(export_module.CTranslate2ExportError, match="cannot be expressed"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, output, engine="ctranslate2"), log=quiet)
    assert not output.exists()
    # the command says it in one line
    from fairseq_kd.cli.seqkd_decode import cli_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--data", str(tiny_data_bin), "--teacher-checkpoint", str(tiny_teacher), "--output", str(output),
                  "--engine", "ctranslate2"])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: 'teacher.pt' cannot be expressed in CTranslate2" in stderr
    assert not output.exists()
    # the fairseq engine can then use the folder as if nothing happened
    assert seqkd.run(config(tiny_data_bin, tiny_teacher, output, max_shards=1), log=quiet).status == "partial"
