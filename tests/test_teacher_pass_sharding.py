"""Teacher passes split over workers (fairseq-kd-seqkd, fairseq-kd-teacher-cache): two workers of a
job array (--num-shards 2 --shard-id 0/1, run at once) and torchrun's two ranks each write, into one
folder, the output of one process byte for byte; one worker merges (the merge lock, taken over
from a merge killed on this host); a merge killed midway is finished by the next run; bad
combinations are refused in one line naming the flag, before any work. Each shard is checked
against its record (SHA-256, the pass's identity) when merged or skipped as done; workers whose
settings or --num-shards differ from the pass's records are refused by name. CPU only, tiny teacher."""
import io
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import BIN, QUIET_ENV

from fairseq_kd.teacher_pass import common, seqkd, teacher_cache
from fairseq_kd.teacher_pass.teacher_cache import CacheConfig, TeacherCacheError, build_cache

SEQKD = ("fairseq_kd.cli.seqkd_decode", ["--max-len-a", "1.2", "--max-len-b", "10", "--shard-size", "64", "--cpu"])
CACHE = ("fairseq_kd.cli.teacher_cache", ["--k", "3", "--shard-size", "100", "--cpu"])
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_NUM_TASKS",
                      "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_ID",
                      "SLURM_STEP_ID")


def quiet(_line):
    pass


def seqkd_config(data, teacher, output, **overrides):
    return seqkd.SeqKDConfig(**{**dict(data=str(data), teacher_checkpoint=str(teacher), output=str(output),
                                       max_len_a=1.2, max_len_b=10, shard_size=64, cpu=True), **overrides})


def cache_config(data, teacher, output, **overrides):
    return CacheConfig(**{**dict(data=data, teacher_checkpoint=teacher, output=output, k=3, shard_size=100,
                                 cpu=True), **overrides})


@pytest.fixture(scope="module")
def one_process(tiny_data_bin, tiny_teacher, tmp_path_factory):
    """The seq-KD data and the cache as one process writes them."""
    root = tmp_path_factory.mktemp("one_process")
    seqkd.run(seqkd_config(tiny_data_bin, tiny_teacher, root / "seqkd"), log=quiet)
    build_cache(cache_config(tiny_data_bin, tiny_teacher, root / "cache"), log=quiet)
    return {SEQKD[0]: root / "seqkd", CACHE[0]: root / "cache"}


def comparable(path):
    """A file's bytes; a manifest's content less what names the folder or the files' times."""
    if path.name == seqkd.MANIFEST_NAME:
        manifest = json.loads(path.read_text())
        del manifest["decoding"]["output"]
        for record in manifest["files"]["files"].values():
            del record["mtime_ns"]
        return manifest
    if path.name == teacher_cache.MANIFEST:
        manifest = json.loads(path.read_text())
        for record in manifest["arrays"].values():
            del record["fingerprint"]["mtime_ns"]
        return manifest
    return path.read_bytes()


def assert_same_output(folder, reference):
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == names
    for name in names:
        assert comparable(folder / name) == comparable(reference / name), name


def command(module, flags, data, teacher, output):
    return ["-m", module, "--data", str(data), "--teacher-checkpoint", str(teacher), "--output", str(output), *flags]


@pytest.mark.parametrize("pass_", [SEQKD, CACHE], ids=["seqkd", "teacher-cache"])
def test_two_workers_of_a_job_array_write_one_process_output(tiny_data_bin, tiny_teacher, one_process, tmp_path,
                                                             pass_):
    module, flags = pass_
    output = tmp_path / "out"
    workers = [subprocess.Popen([sys.executable, *command(module, flags, tiny_data_bin, tiny_teacher, output),
                                 "--num-shards", "2", "--shard-id", str(index)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=QUIET_ENV)
               for index in (0, 1)]
    logs = [worker.communicate(timeout=600) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], logs
    assert_same_output(output, one_process[module])
    said = [stdout for stdout, _ in logs]
    assert "worker 0 of 2 (job array): shard 1/" in said[0] and "worker 1 of 2 (job array): shard 2/" in said[1]
    merged = [(f"{output}: top-3" in stdout or "wrote 400 sentence pairs" in stdout) for stdout in said]
    assert sum(merged) == 1, said  # one worker merged; the other said why not
    other = said[merged.index(False)]
    assert "shards remain" in other or "another worker merges" in other or "has merged" in other, other


@pytest.mark.parametrize("pass_", [SEQKD, CACHE], ids=["seqkd", "teacher-cache"])
def test_two_torchrun_ranks_write_one_process_output(tiny_data_bin, tiny_teacher, one_process, tmp_path, pass_):
    module, flags = pass_
    output = tmp_path / "out"
    proc = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                           *command(module, flags, tiny_data_bin, tiny_teacher, output)],
                          capture_output=True, text=True, env=QUIET_ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert_same_output(output, one_process[module])
    assert "rank 0 of 2 (torchrun): shard 1/" in proc.stdout  # rank 0 reports; rank 1 prints nothing
    assert "rank 1 of 2" not in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- merging once
class Killed(Exception):
    pass


def gone_pid() -> int:
    """The pid of a process that has ended."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    return ended.pid


def leave_stale_lock(folder):
    """What a merge killed on this host leaves: the lock of a process that is gone."""
    (folder / common.MERGE_LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": gone_pid(),
                                                        "since": "earlier"}))


def test_a_cache_merge_killed_midway_is_finished_once_by_the_next_run(tiny_data_bin, tiny_teacher, one_process,
                                                                      tmp_path, monkeypatch):
    output = tmp_path / "cache"
    config = cache_config(tiny_data_bin, tiny_teacher, output)
    real_write = teacher_cache.write_json

    def killed_before_the_manifest(path, record):
        if path.name == teacher_cache.MANIFEST:
            raise Killed()
        real_write(path, record)

    with monkeypatch.context() as patch:
        patch.setattr(teacher_cache, "write_json", killed_before_the_manifest)
        with pytest.raises(Killed):
            build_cache(config, log=quiet)
    assert (output / "topk_ids.npy").is_file() and not (output / teacher_cache.MANIFEST).exists()
    leave_stale_lock(output)
    # while another live worker holds the lock, a worker with every shard done leaves the merge to it
    with common.merge_lock(output) as holder:
        assert holder is None  # the stale lock taken over
        lines = []
        build_cache(config, log=lines.append)
        assert f"another worker merges (pid {os.getpid()} on {socket.gethostname()}" in lines[-1]
        assert not (output / teacher_cache.MANIFEST).exists()
    lines = []
    build_cache(config, log=lines.append)
    assert "top-3 teacher log-probabilities of 2504 target tokens" in lines[-1]
    assert_same_output(output, one_process[CACHE[0]])


def test_a_seqkd_merge_killed_midway_is_finished_by_the_next_run(tiny_data_bin, tiny_teacher, one_process, tmp_path,
                                                                 monkeypatch):
    output = tmp_path / "seqkd"
    config = seqkd_config(tiny_data_bin, tiny_teacher, output)
    real_write = seqkd.write_json

    def killed_before_complete(path, record):
        if record.get("status") == "complete":
            raise Killed()
        real_write(path, record)

    with monkeypatch.context() as patch:
        patch.setattr(seqkd, "write_json", killed_before_complete)
        with pytest.raises(Killed):
            seqkd.run(config, log=quiet)
    leave_stale_lock(output / seqkd.WORK_DIR_NAME)
    result = seqkd.run(config, log=quiet)
    assert result.status == "complete" and result.decoded_now == 0
    assert_same_output(output, one_process[SEQKD[0]])


def test_the_merge_lock_names_its_holder_and_is_taken_over_only_from_a_gone_process_of_this_host(tmp_path):
    with common.merge_lock(tmp_path) as first:
        assert first is None
        with common.merge_lock(tmp_path) as second:  # another holder (its own open file) is refused
            assert f"pid {os.getpid()} on {socket.gethostname()}" in second
    assert not (tmp_path / common.MERGE_LOCK).exists()
    leave_stale_lock(tmp_path)
    with common.merge_lock(tmp_path) as taken_over:
        assert taken_over is None
        assert json.loads((tmp_path / common.MERGE_LOCK).read_text())["pid"] == os.getpid()
    elsewhere = {"host": "another-node", "pid": 1, "since": "earlier"}
    (tmp_path / common.MERGE_LOCK).write_text(json.dumps(elsewhere))
    with common.merge_lock(tmp_path) as held:
        assert "pid 1 on another-node" in held and f"delete {tmp_path / common.MERGE_LOCK}" in held
    assert json.loads((tmp_path / common.MERGE_LOCK).read_text()) == elsewhere


# ----------------------------------------------------------------------------- who is a worker
def test_the_launchers_environment_tells_the_ranks():
    def workers(environ, num_shards=None, shard_id=None):
        return common.workers_for(num_shards, shard_id, ValueError, environ)

    assert workers({}) == common.Workers() and common.Workers().label == ""
    array = workers({}, 4, 3)
    assert (array.index, array.count, array.launcher, array.ranks) == (3, 4, "job array", False)
    assert array.owned(range(10)) == [3, 7] and array.reports
    assert workers({}, 1, 0) == common.Workers()
    torchrun = workers({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"})
    assert (torchrun.index, torchrun.count, torchrun.local_rank, torchrun.init_method) == (1, 2, 1, "env://")
    assert torchrun.ranks and not torchrun.reports and torchrun.label == "rank 1 of 2 (torchrun): "
    assert workers({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}) == common.Workers()
    # a batch script of a job of 4 tasks, not started by srun, is one process
    assert workers({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "77"}) == \
        common.Workers()
    step = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "1",
            "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2", "SLURM_NTASKS": "4"}
    srun = workers(step)
    assert (srun.index, srun.count, srun.local_rank, srun.launcher) == (3, 4, 1, "srun")
    assert srun.init_method == f"tcp://127.0.0.1:{20000 + (77 * 16 + 2) % 40000}"
    assert workers({**step, "MASTER_ADDR": "node7", "MASTER_PORT": "29400"}).init_method == "tcp://node7:29400"
    # torchrun inside a SLURM job: torchrun's ranks
    assert workers({**step, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}).launcher == "torchrun"


@pytest.mark.parametrize("flags, environ, message", [
    (dict(shard_id=1), {}, r"--shard-id 1 needs --num-shards N"),
    (dict(num_shards=2), {}, r"--num-shards 2 needs --shard-id I, 0 <= I < 2"),
    (dict(num_shards=2, shard_id=2), {}, r"--shard-id 2 is outside 0\.\.1 \(--num-shards 2\)"),
    (dict(num_shards=2, shard_id=-1), {}, r"--shard-id -1 is outside 0\.\.1"),
    (dict(num_shards=0, shard_id=0), {}, r"--num-shards must be >= 1, got 0"),
    (dict(num_shards=2, shard_id=0), {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
     r"--num-shards/--shard-id split a job array, but this process is rank 0 of 2 started by torchrun"),
    (dict(), {"RANK": "one", "WORLD_SIZE": "2"}, r"RANK='one' in the environment is not a whole number"),
    (dict(), {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0", "SLURM_STEP_NUM_NODES": "2"},
     r"srun started the ranks on several nodes: export MASTER_ADDR"),
], ids=["id without count", "count without id", "id too large", "negative id", "no workers", "with torchrun",
        "bad RANK", "srun over nodes"])
def test_bad_worker_settings_are_refused_in_one_line_before_any_work(tiny_data_bin, tiny_teacher, tmp_path,
                                                                     monkeypatch, flags, environ, message):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(seqkd.SeqKDError, match=f"^{message}") as refused:
        seqkd.run(seqkd_config(tiny_data_bin, tiny_teacher, tmp_path / "seqkd", **flags), log=quiet)
    assert "\n" not in str(refused.value)
    with pytest.raises(TeacherCacheError, match=f"^{message}"):
        build_cache(cache_config(tiny_data_bin, tiny_teacher, tmp_path / "cache", **flags), log=quiet)
    assert not (tmp_path / "seqkd").exists() and not (tmp_path / "cache").exists()


def test_force_with_several_workers_and_the_commands_refuse_in_one_line(tiny_data_bin, tiny_teacher, tmp_path,
                                                                        monkeypatch, capsys):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(seqkd.SeqKDError, match=r"^--force with 2 workers \(job array\): each would delete"):
        seqkd.run(seqkd_config(tiny_data_bin, tiny_teacher, tmp_path / "seqkd", force=True, num_shards=2,
                               shard_id=0), log=quiet)
    from fairseq_kd.cli import seqkd_decode
    from fairseq_kd.cli import teacher_cache as teacher_cache_cli

    for prog, main in (("fairseq-kd-seqkd", seqkd_decode.cli_main), ("fairseq-kd-teacher-cache",
                                                                      teacher_cache_cli.cli_main)):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(["--data", str(tiny_data_bin), "--teacher-checkpoint", str(tiny_teacher), "--output",
                  str(tmp_path / "out"), "--shard-id", "3"])
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and stderr.strip().splitlines()[-1] == (
            f"{prog}: error: --shard-id 3 needs --num-shards N, the number of workers of the job array")
    assert not (tmp_path / "out").exists() and not (tmp_path / "seqkd").exists()


# ----------------------------------------------------------------------------- shards checked against their records
PASSES = {"seqkd": (seqkd.run, seqkd_config, seqkd.SeqKDError, seqkd.WORK_DIR_NAME, ".pt"),
          "teacher-cache": (build_cache, cache_config, TeacherCacheError, teacher_cache.SHARDS, ".npz")}


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def half_done(tiny_data_bin, tiny_teacher, tmp_path_factory):
    """Each pass's folder after worker 0 of a job array of 2 (its shards written, the others not)."""
    saved = {name: os.environ.pop(name) for name in LAUNCHER_VARIABLES if name in os.environ}
    root = tmp_path_factory.mktemp("half_done")
    try:
        for name, (run, make_config, _, _, _) in PASSES.items():
            run(make_config(tiny_data_bin, tiny_teacher, root / name, num_shards=2, shard_id=0), log=quiet)
    finally:
        os.environ.update(saved)
    return root


def snapshot(folder):
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def shard_file(output, name, index):
    _, _, _, work, suffix = PASSES[name]
    return output / work / f"shard{index:06d}{suffix}"


def edit_shard(path):
    """Another shard of the same shape and format: one value changed, as an editor would."""
    if path.suffix == ".npz":
        with np.load(path) as stored:
            arrays = dict(stored)
        arrays["logprobs"][0, 0] -= 0.25
        np.savez(path, **arrays)
    else:
        shard = torch.load(path, weights_only=True)
        shard["tokens"][0] = shard["tokens"][0] + 1
        edited = io.BytesIO()  # as the pass writes it (a file's name would change the archive's size)
        torch.save(shard, edited)
        path.write_bytes(edited.getvalue())


def flip_a_byte(path):
    """A disk error: one byte changed in the middle, size and modification time kept."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


DAMAGES = {"edited": (edit_shard, "is not the shard this pass wrote (its SHA-256 differs from "),
           "a flipped byte": (flip_a_byte, "is not the shard this pass wrote (its SHA-256 differs from "),
           "truncated": (truncate, "bytes where its record ")}


def damage_keeping_time(path, damage):
    stat = path.stat()
    damage(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def assert_refused_by_name(refused, output, work, shard_name, said):
    message = str(refused.value)
    assert message.startswith(f"--output {output}: {work}/{shard_name} "), message
    assert said in message and message.endswith("it was deleted: re-run the same command to compute it again")
    assert "\n" not in message


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("name", sorted(PASSES))
def test_a_shard_changed_on_disk_is_refused_by_name_when_merged(tiny_data_bin, tiny_teacher, one_process, half_done,
                                                                tmp_path, no_launcher, name, damage):
    """Worker 0 of a job array has written its shards; one changes on disk (an edit, a disk error
    that keeps size and time, a truncation); worker 1, which writes the last shard, refuses to
    merge it, naming it, and writes no output; the same command then computes it again."""
    run, make_config, error, work, _ = PASSES[name]
    output = tmp_path / name
    shutil.copytree(half_done / name, output)
    damaged = shard_file(output, name, 2)  # worker 0's
    damage_keeping_time(damaged, DAMAGES[damage][0])
    with pytest.raises(error) as refused:
        run(make_config(tiny_data_bin, tiny_teacher, output, num_shards=2, shard_id=1), log=quiet)
    assert_refused_by_name(refused, output, work, damaged.name, DAMAGES[damage][1])
    assert not damaged.exists() and not damaged.with_suffix(".json").exists()
    assert not (output / teacher_cache.MANIFEST).exists() and not (output / "train.src-tgt.tgt.bin").exists()
    run(make_config(tiny_data_bin, tiny_teacher, output), log=quiet)  # the same command, as one process
    assert_same_output(output, one_process[(SEQKD if name == "seqkd" else CACHE)[0]])


def foreign_shard(tiny_data_bin, tiny_teacher, tmp_path, name):
    """Shard 0 and its record as a pass of other settings (another --max-tokens) writes them."""
    run, make_config, _, _, _ = PASSES[name]
    other = tmp_path / "other"
    with pytest.raises(Killed):
        run(make_config(tiny_data_bin, tiny_teacher, other, max_tokens=2048),
            log=lambda line: (_ for _ in ()).throw(Killed()) if "shard 1/" in line else None)
    return shard_file(other, name, 0)


RESUME_DAMAGES = {**DAMAGES, "from a pass of other settings": (None, "was written by a pass of other settings"),
                  "without its record": (None, "has no valid record beside it (shard000000.json missing)")}


@pytest.mark.parametrize("damage", ["edited", "a flipped byte", "from a pass of other settings", "without its record"])
@pytest.mark.parametrize("name", sorted(PASSES))
def test_a_shard_changed_on_disk_is_refused_by_name_when_a_resumed_run_skips_it(
        tiny_data_bin, tiny_teacher, one_process, half_done, tmp_path, no_launcher, name, damage):
    """A resumed run checks the shards it skips as done before it computes anything."""
    run, make_config, error, work, _ = PASSES[name]
    output = tmp_path / name
    shutil.copytree(half_done / name, output)
    (output / work / common.JOB_ARRAY_RECORD).unlink(missing_ok=True)  # resumed as one process
    done = shard_file(output, name, 0)
    if damage == "from a pass of other settings":
        foreign = foreign_shard(tiny_data_bin, tiny_teacher, tmp_path, name)
        for path in (foreign, foreign.with_suffix(".json")):
            if path.exists():  # the record: none without the records of shards
                shutil.copy2(path, done.with_suffix(path.suffix))
    elif damage == "without its record":
        done.with_suffix(".json").unlink(missing_ok=True)
    else:
        damage_keeping_time(done, DAMAGES[damage][0])
    before = {path.name for path in (output / work).iterdir()}
    with pytest.raises(error) as refused:
        run(make_config(tiny_data_bin, tiny_teacher, output), log=quiet)
    assert_refused_by_name(refused, output, work, done.name, RESUME_DAMAGES[damage][1])
    # nothing computed: the other shards as they were, the refused one deleted
    assert {path.name for path in (output / work).iterdir()} == before - {done.name, done.with_suffix(".json").name}
    run(make_config(tiny_data_bin, tiny_teacher, output), log=quiet)
    assert_same_output(output, one_process[(SEQKD if name == "seqkd" else CACHE)[0]])


# ----------------------------------------------------------------------------- workers agree on what changes the bytes
def cuda_claimed(monkeypatch):
    """This process believes a GPU is there (the device is part of a pass's identity)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return dict(cpu=False)


DISAGREEING = {
    "seqkd": [
        (dict(max_tokens=2048), "--max-tokens 2048 here, 4096 in the record"),
        (dict(batch_size=8), "--batch-size 8 here, unset in the record"),
        (dict(shard_size=32), "--shard-size 32 here, 64 in the record"),
        (dict(beam=4), "--beam 4 here, 5 in the record"),
        (dict(max_len_b=12), "--max-len-b 12 here, 10 in the record"),
        (dict(lenpen=1.5), "--lenpen 1.5 here, 1.0 in the record"),
        ("cuda", "the device (--cpu) cuda here, cpu in the record"),
        ("cuda fp16", "the device (--cpu) cuda here, cpu in the record; --fp16 on here, off in the record"),
    ],
    "teacher-cache": [
        (dict(max_tokens=2048), "--max-tokens 2048 here, 8192 in the record"),
        (dict(shard_size=50), "--shard-size 50 here, 100 in the record"),
        (dict(k=4), "--k 4 here, 3 in the record"),
        (dict(fp16=True), "--fp16 on here, off in the record"),
        ("cuda", "the device (--cpu) cuda here, cpu in the record"),
    ],
}


@pytest.mark.parametrize("name, flags, said", [(name, flags, said) for name, cases in DISAGREEING.items()
                                               for flags, said in cases],
                         ids=[f"{name}: {said.split(' here')[0]}" for name, cases in DISAGREEING.items()
                              for _, said in cases])
def test_a_worker_whose_settings_differ_from_the_pass_record_is_refused_by_name_before_any_work(
        tiny_data_bin, tiny_teacher, half_done, tmp_path, monkeypatch, no_launcher, name, flags, said):
    run, make_config, error, _, _ = PASSES[name]
    output = tmp_path / name
    shutil.copytree(half_done / name, output)
    if isinstance(flags, str):
        flags = {**cuda_claimed(monkeypatch), **(dict(fp16=True) if "fp16" in flags else {})}
    before = snapshot(output)
    with pytest.raises(error) as refused:
        run(make_config(tiny_data_bin, tiny_teacher, output, num_shards=2, shard_id=1, **flags), log=quiet)
    message = str(refused.value)
    assert said in message and "\n" not in message, message
    assert snapshot(output) == before  # worker 1 computed nothing, and the record is worker 0's


@pytest.mark.parametrize("name", sorted(PASSES))
def test_workers_starting_at_once_with_other_settings_cannot_both_write_the_record(
        tiny_data_bin, tiny_teacher, tmp_path, monkeypatch, no_launcher, name):
    """Worker 1 reads the empty folder before worker 0 writes its record: it still finds worker
    0's record when it creates its own, and is refused by name before any work."""
    run, make_config, error, _, _ = PASSES[name]
    output = tmp_path / name
    worker_1 = make_config(tiny_data_bin, tiny_teacher, output, num_shards=2, shard_id=1, max_tokens=2048)
    set_up = seqkd.plan if name == "seqkd" else teacher_cache._set_up
    stale = set_up(worker_1)  # what worker 1 saw at its start
    run(make_config(tiny_data_bin, tiny_teacher, output, num_shards=2, shard_id=0), log=quiet)
    before = snapshot(output)
    monkeypatch.setattr(*((seqkd, "plan") if name == "seqkd" else (teacher_cache, "_set_up")), lambda config: stale)
    with pytest.raises(error) as refused:
        run(worker_1, log=quiet)
    default = 4096 if name == "seqkd" else 8192
    assert f"--max-tokens 2048 here, {default} in the record" in str(refused.value)
    assert snapshot(output) == before


@pytest.mark.parametrize("name", sorted(PASSES))
def test_job_array_workers_that_disagree_on_num_shards_are_refused_so_that_someone_merges(
        tiny_data_bin, tiny_teacher, one_process, half_done, tmp_path, no_launcher, name):
    run, make_config, error, work, _ = PASSES[name]
    output = tmp_path / name
    shutil.copytree(half_done / name, output)  # worker 0 of 2 is done
    before = snapshot(output)
    with pytest.raises(error) as refused:  # its shards would be 1, 4, ...: shard 3 would have no worker
        run(make_config(tiny_data_bin, tiny_teacher, output, num_shards=3, shard_id=1), log=quiet)
    record = output / work / common.JOB_ARRAY_RECORD
    message = str(refused.value)
    assert message.startswith(f"--num-shards 3 here, 2 in the job array's record at {record}: give every worker "
                              "of the array the same --num-shards") and "\n" not in message
    assert snapshot(output) == before
    # the array's own worker 1 finishes and merges
    run(make_config(tiny_data_bin, tiny_teacher, output, num_shards=2, shard_id=1), log=quiet)
    assert_same_output(output, one_process[(SEQKD if name == "seqkd" else CACHE)[0]])


@pytest.mark.parametrize("name", sorted(PASSES))
def test_a_duplicated_shard_id_of_a_job_array_is_refused_by_name_while_its_twin_runs(
        tiny_data_bin, tiny_teacher, half_done, tmp_path, no_launcher, name):
    """Two workers given the same --shard-id (a duplicated array index) would both do the same
    shards while another index's shards get no worker, and both exit 0 with no output: the index is
    claimed while a worker runs, and its twin is refused in one line naming --shard-id and the
    holder, before any work. A later run of that index (a re-run after a kill) takes it."""
    run, make_config, error, work, _ = PASSES[name]
    output = tmp_path / name
    shutil.copytree(half_done / name, output)  # worker 0 of 2 is done; worker 1 is running:
    claim = output / work / "worker000001.lock"
    with common.held_lock(claim) as holder:
        assert holder is None
        before = snapshot(output)
        with pytest.raises(error) as refused:
            run(make_config(tiny_data_bin, tiny_teacher, output, num_shards=2, shard_id=1), log=quiet)
        message = str(refused.value)
        assert message.startswith(f"--shard-id 1: another worker of this job array runs with the same index (pid "
                                  f"{os.getpid()} on {socket.gethostname()}") and "\n" not in message, message
        assert f"give each worker its own --shard-id 0..1 (if no worker of the array is running, delete {claim}" in message
        assert snapshot(output) == before
    # the twin has ended: the index is free again, and its run finishes and merges
    run(make_config(tiny_data_bin, tiny_teacher, output, num_shards=2, shard_id=1), log=quiet)
    assert not (output / work).exists()


@pytest.mark.parametrize("name", sorted(PASSES))
def test_the_systems_refusal_to_write_the_output_is_one_line_naming_the_flag(
        tiny_data_bin, tiny_teacher, tmp_path, monkeypatch, no_launcher, name):
    """A full disk, or a file of --output the system refuses to write, is a user error naming
    --output (one line, no traceback under the commands), not a programming error."""
    import errno

    from fairseq_kd.errors import UserError

    run, make_config, _, work, _ = PASSES[name]
    output = tmp_path / name
    refusals = {"a full disk": (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), os.strerror(errno.ENOSPC)),
                "a refused file": (PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(output / work / "x")),
                                   f"{output / work / 'x'}: {os.strerror(errno.EACCES)}")}
    for error, words in refusals.values():
        def refused_write(*_args, error=error):
            raise error

        monkeypatch.setattr(common, "write_json", refused_write)  # the first shard's record
        with pytest.raises(UserError) as refused:
            run(make_config(tiny_data_bin, tiny_teacher, output), log=quiet)
        assert str(refused.value) == f"--output {output}: {words}"


@pytest.mark.parametrize("hard_links", [True, False], ids=["hard links", "no hard links"])
def test_a_record_is_created_once_and_a_later_creator_reads_the_first(tmp_path, monkeypatch, hard_links):
    if not hard_links:
        def no_link(*_args):
            raise PermissionError("operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    path = tmp_path / "work" / "record.json"
    assert common.create_record(path, {"num_shards": 2}) is None
    assert common.create_record(path, {"num_shards": 3}) == {"num_shards": 2}
    assert json.loads(path.read_text()) == {"num_shards": 2}
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]  # no temporary file left


def test_the_batch_split_of_ctranslate2_threads_is_part_of_the_identity_only_when_it_splits(
        tiny_data_bin, tiny_teacher, tmp_path):
    """CTranslate2Engine decodes each batch as --threads parts on the CPU, each padded alone."""
    def identity(threads):
        planned = seqkd.plan(seqkd_config(tiny_data_bin, tiny_teacher, tmp_path / "out", engine="ctranslate2",
                                          threads=threads))
        return seqkd._identity(planned.record)

    assert identity(0) == identity(1) and "ct2_batch_parts" not in identity(1)
    assert identity(4)["ct2_batch_parts"] == 4
    said = common.identity_differences(identity(2), identity(4), seqkd.LABELS, seqkd.INPUTS)
    assert said == ["the batch split of --threads 4 here, 2 in the record"]
    assert not (tmp_path / "out").exists()  # planning writes nothing
