"""Recipes on several GPUs and nodes, planned from a machine without any (a cluster's login node):
``fairseq-kd-recipe --print-commands`` and ``--sbatch DIR`` (fairseq_kd_recipes/cluster.py).

The commands printed and the batch scripts written are the plan's own command lines (the ones the
recipe runs), checked here as fairseq and the teacher passes parse them: the world size is nodes x
GPUs per node, the tokens per update stay the pair's, training starts through srun (one task per
node) or torchrun, the teacher passes run one process per GPU or as a job array of
``--num-shards N --shard-id $SLURM_ARRAY_TASK_ID``. The scripts' own logic (skip a finished step,
stop after a step) runs under bash.
"""
from __future__ import annotations

import importlib
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from fairseq_kd_recipes import recipe as recipe_cli
from fairseq_kd_recipes.cluster import ARRAY_SCRIPT, RECIPE_SCRIPT, SUBMIT_SCRIPT
from fairseq_kd_recipes.execute import RecipeError
from fairseq_kd_recipes.pairs import PAIRS
from fairseq_kd_recipes.plan import RecipeOptions, batch_split, build_plan
from test_recipe import parse_training_command

PASS_MODULES = {"seqkd-data": "fairseq_kd.cli.seqkd_decode", "teacher-cache": "fairseq_kd.cli.teacher_cache"}
METHODS = "no_kd,seq_kd,word_kd_cached,a2d_kd_4h"


def no_gpu() -> int:
    return 0


def cluster_plan(tmp_path, pair="wmt14_en_de", gpus=8, nodes=2, **options):
    return build_plan(RecipeOptions(pair=pair, methods=METHODS.split(","), profile="auto", gpus=gpus, nodes=nodes,
                                    workdir=tmp_path / "work", print_only=True, **options), device_count=no_gpu)


def printed(capsys, argv) -> dict[str, list[list[str]]]:
    """{step: its command lines} of ``fairseq-kd-recipe ARGV --print-commands``, parsed as the shell
    would; a teacher pass's job-array task comes under ``STEP.array``."""
    assert recipe_cli.cli_main([*argv, "--print-commands"]) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    checked = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    steps, current = {}, None
    for line in text.splitlines():
        step = re.match(r"^# \[(\S+)\] ", line)
        if step:
            current = step.group(1)
            steps[current] = []
        elif line.startswith("#   ") and current in PASS_MODULES and not line.startswith("#   or as"):
            steps[f"{current}.array"] = [shlex.split(line[4:])]
        elif line and not line.startswith("#") and current is not None:
            steps[current].append(shlex.split(line))
    return steps


def program_args(command: list[str], launcher_end: str) -> list[str]:
    """The command after its launcher (everything up to and including ``launcher_end``)."""
    return command[command.index(launcher_end) + 1:]


def check_pass_command(step: str, command: list[str]) -> object:
    """The teacher pass's own parser accepts the command (``python -m MODULE ARGS``)."""
    module = importlib.import_module(PASS_MODULES[step])
    parser = module.build_parser()
    if "--num-shards" not in parser._option_string_actions:
        pytest.skip(f"{PASS_MODULES[step]} has no --num-shards yet (the teacher passes' sharding)")
    start = command.index(PASS_MODULES[step]) + 1
    return parser.parse_args(command[start:])


# ----------------------------------------------------------------------------- printed commands


def test_print_commands_for_two_nodes_of_eight_gpus_on_a_machine_without_any(tmp_path, capsys):
    workdir = tmp_path / "work"
    steps = printed(capsys, ["wmt14_en_de", "--gpus-per-node", "8", "--nodes", "2", "--methods", METHODS,
                             "--workdir", str(workdir)])
    assert not workdir.exists()  # nothing is written
    pair = PAIRS["wmt14_en_de"]
    max_tokens, update_freq = batch_split(pair.tokens_per_update, int(pair.training()["--max-tokens"]), 16)
    plan = cluster_plan(tmp_path)
    for name in ("train-teacher", "train-no_kd", "train-seq_kd", "train-word_kd_cached", "train-a2d_kd_4h"):
        (command,) = steps[name]
        assert command == plan.step(name).commands[0]  # the plan's own command line
        assert command[:8] == ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
        args = parse_training_command(program_args(command, "--kill-on-bad-exit=1"))
        assert args.distributed_world_size == 16 and args.distributed_port == 29500 and args.fp16
        # the pair's ~25K tokens per update on 16 GPUs: 1,563 per GPU, no accumulation
        assert (args.max_tokens, args.update_freq) == (max_tokens, [update_freq]) == (1563, [1])
        assert args.max_tokens * 16 * update_freq >= pair.tokens_per_update
    assert parse_training_command(program_args(steps["train-a2d_kd_4h"][0], "--kill-on-bad-exit=1")).find_unused_parameters
    # The teacher passes: one process per GPU on both nodes, or a job array of 16 one-GPU tasks.
    for name in PASS_MODULES:
        (command,) = steps[name]
        assert command[:9] == ["srun", "--nodes", "2", "--ntasks", "16", "--ntasks-per-node", "8", "--cpus-per-task", "4"]
        (task,) = steps[f"{name}.array"]
        assert task[-4:] == ["--num-shards", "16", "--shard-id", "$SLURM_ARRAY_TASK_ID"]
        assert task[:-4] == program_args(command, "--kill-on-bad-exit=1")
        args = check_pass_command(name, [*task[:-1], "3"])
        assert (args.num_shards, args.shard_id, args.fp16) == (16, 3, True)
    # Every step, in the plan's order; the steps that ran in-process have their command too.
    assert list(step for step in steps if not step.endswith(".array")) == [step.name for step in plan.steps]
    assert steps["systems"][0][1:3] == ["-m", "fairseq_kd_recipes.systems"]


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (4, 1), (8, 1), (4, 2), (8, 4)])
@pytest.mark.parametrize("pair_name", ["iwslt14_de_en", "wmt14_en_de"])
def test_tokens_per_update_stay_the_pairs_on_any_layout(tmp_path, pair_name, gpus, nodes):
    """--max-tokens per GPU x GPUs x nodes x --update-freq is the pair's tokens per update."""
    pair = PAIRS[pair_name]
    plan = cluster_plan(tmp_path, pair=pair_name, gpus=gpus, nodes=nodes)
    command = plan.step("train-no_kd").commands[0]
    args = parse_training_command(command[command.index("--kill-on-bad-exit=1") + 1:] if nodes > 1 else command)
    world = gpus * nodes
    assert args.distributed_world_size == world == plan.world_size
    total = args.max_tokens * world * args.update_freq[0]
    assert pair.tokens_per_update <= total < pair.tokens_per_update + world * args.update_freq[0]


def test_torchrun_lines_for_each_node_and_one_node(tmp_path, capsys):
    steps = printed(capsys, ["iwslt14_de_en", "--gpus-per-node", "4", "--nodes", "2", "--launcher", "torchrun",
                             "--methods", "no_kd,seq_kd", "--workdir", str(tmp_path / "work"), "--master-port", "4242"])
    (train,) = steps["train-teacher"]
    assert train[1:11] == ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                           "--node-rank", "$NODE_RANK", "--master-addr", "$MASTER_ADDR"]
    assert train[11:13] == ["--master-port", "4242"] and train[13].endswith("fairseq-train")
    args = parse_training_command(train[13:])
    assert args.distributed_world_size == 8 and args.max_tokens == 512 and args.update_freq == [1]
    (decode,) = steps["seqkd-data"]
    assert decode[decode.index("--master-port") + 2:decode.index("--master-port") + 4] == ["-m", PASS_MODULES["seqkd-data"]]
    # One node: fairseq-train spawns its workers; the passes start under torchrun --standalone.
    steps = printed(capsys, ["iwslt14_de_en", "--gpus-per-node", "4", "--methods", "no_kd,seq_kd",
                             "--workdir", str(tmp_path / "work")])
    (train,) = steps["train-teacher"]
    assert train[0].endswith("fairseq-train") and parse_training_command(train).distributed_world_size == 4
    (decode,) = steps["seqkd-data"]
    assert decode[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m"]


def test_layouts_that_cannot_work_are_refused_in_one_line(tmp_path, capsys):
    workdir = tmp_path / "work"
    base = ["wmt14_en_de", "--workdir", str(workdir)]
    cases = [
        (["--gpus-per-node", "8", "--nodes", "2"], "--nodes 2: a recipe runs its steps from one node"),
        (["--gpus-per-node", "8", "--nodes", "2", "--launcher", "fairseq", "--print-commands"], "--launcher fairseq"),
        (["--profile", "cpu", "--nodes", "2", "--print-commands"], "--nodes applies to the gpu profile only; name the GPUs"),
        (["--gpus-per-node", "0", "--print-commands"], "--gpus-per-node must be >= 1"),
        (["--gpus-per-node", "8", "--nodes", "0", "--print-commands"], "--nodes must be >= 1"),
        (["--gpus-per-node", "8", "--master-port", "70000", "--print-commands"], "--master-port 70000"),
        (["--gpus-per-node", "8", "--nodes", "2", "--launcher", "torchrun", "--sbatch", str(tmp_path / "s")],
         "--sbatch starts several nodes with srun"),
    ]
    for flags, message in cases:
        assert recipe_cli.cli_main(base + flags) == 2, flags
        error = capsys.readouterr().err
        assert message in error and len(error.strip().splitlines()) == 1, error
    with pytest.raises(SystemExit):
        recipe_cli.cli_main(base + ["--gpus-per-node", "8", "--array-tasks", "4"])  # without --print-commands
    assert "--array-tasks" in capsys.readouterr().err
    # The GPU profile on a machine without a GPU names the way to print the commands.
    with pytest.raises(RecipeError, match="--print-commands .* --gpus-per-node N"):
        build_plan(RecipeOptions(pair="wmt14_en_de", profile="gpu", workdir=workdir, print_only=True),
                   device_count=no_gpu)
    assert not workdir.exists() and not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------- batch scripts


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, re.M))


def run_steps(script: str) -> dict[str, list[str]]:
    """{step: command} of a recipe.sbatch's ``run_step STEP COMMAND...`` lines."""
    steps = {}
    for line in script.splitlines():
        if line.startswith("run_step "):
            _, name, *command = shlex.split(line)
            steps[name] = command
    return steps


def write_scripts(tmp_path, capsys, *flags):
    folder = tmp_path / "slurm"
    argv = ["wmt14_en_de", "--methods", METHODS, "--workdir", str(tmp_path / "work"), "--sbatch", str(folder), *flags]
    assert recipe_cli.cli_main(argv) == 0, capsys.readouterr().err
    assert f"bash {folder / SUBMIT_SCRIPT}" in capsys.readouterr().out
    scripts = {name: (folder / name).read_text() for name in (RECIPE_SCRIPT, ARRAY_SCRIPT, SUBMIT_SCRIPT)}
    for name, text in scripts.items():
        checked = subprocess.run(["bash", "-n", str(folder / name)], capture_output=True, text=True)
        assert checked.returncode == 0, (name, checked.stderr)
    return folder, scripts


def test_sbatch_scripts_for_several_nodes(tmp_path, capsys):
    folder, scripts = write_scripts(tmp_path, capsys, "--gpus-per-node", "8", "--nodes", "2")
    assert not (tmp_path / "work").exists()
    job = sbatch_options(scripts[RECIPE_SCRIPT])
    assert (job["nodes"], job["ntasks-per-node"], job["gpus-per-node"], job["cpus-per-task"]) == ("2", "1", "8", "32")
    assert job["output"] == str(folder / "slurm-%x-%j.out")
    # where srun's teacher-pass ranks meet (fairseq-train finds the nodes itself)
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in scripts[RECIPE_SCRIPT]
    assert "export MASTER_PORT=29501" in scripts[RECIPE_SCRIPT]
    # The steps: the plan's own commands, in its order.
    plan = cluster_plan(tmp_path)
    steps = run_steps(scripts[RECIPE_SCRIPT])
    assert steps == {step.name: step.commands[0] for step in plan.steps}
    train = steps["train-a2d_kd_4h"]
    assert train[:8] == ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    args = parse_training_command(train[8:])
    assert args.distributed_world_size == 16 and args.distributed_port == 29500 and args.criterion == "a2d_kd"
    assert args.teacher_checkpoint == str(plan.workdir / "train" / "teacher" / "checkpoint_avg.pt")
    assert steps["seqkd-data"][:7] == ["srun", "--nodes", "2", "--ntasks", "16", "--ntasks-per-node", "8"]
    # The job array: 16 one-GPU tasks, task $SLURM_ARRAY_TASK_ID of each pass.
    array = sbatch_options(scripts[ARRAY_SCRIPT])
    assert (array["array"], array["nodes"], array["gpus-per-node"], array["cpus-per-task"]) == ("0-15", "1", "1", "4")
    tasks = [shlex.split(line.split(" >>")[0]) for line in scripts[ARRAY_SCRIPT].splitlines()
             if line.startswith(plan.step("seqkd-data").array_command[0])]
    assert [task[2] for task in tasks] == [PASS_MODULES["seqkd-data"], PASS_MODULES["teacher-cache"]]
    for name, task in zip(PASS_MODULES, tasks):
        assert task == [*plan.step(name).array_command, "--num-shards", "16", "--shard-id", "$SLURM_ARRAY_TASK_ID"]
    # submit.sh: the recipe up to the teacher passes, the array after it, the rest after the array.
    submit = [line for line in scripts[SUBMIT_SCRIPT].splitlines() if "sbatch " in line and not line.startswith("#")]
    assert "STOP_AFTER=curves-teacher" in submit[0] and submit[0].endswith(f'"$here/{RECIPE_SCRIPT}")')
    assert 'afterok:"${teacher%%;*}"' in submit[1] and submit[1].endswith(f'"$here/{ARRAY_SCRIPT}")')
    assert 'afterok:"${passes%%;*}"' in submit[2] and submit[2].endswith(f'"$here/{RECIPE_SCRIPT}"')
    names = [step.name for step in plan.steps]
    assert names.index("curves-teacher") + 1 == names.index("seqkd-data")


def test_sbatch_scripts_for_one_node(tmp_path, capsys):
    _, scripts = write_scripts(tmp_path, capsys, "--gpus-per-node", "4", "--array-tasks", "32")
    job = sbatch_options(scripts[RECIPE_SCRIPT])
    assert (job["nodes"], job["ntasks-per-node"], job["gpus-per-node"]) == ("1", "1", "4")
    assert "MASTER_ADDR" not in scripts[RECIPE_SCRIPT] and "srun" not in scripts[RECIPE_SCRIPT]
    steps = run_steps(scripts[RECIPE_SCRIPT])
    args = parse_training_command(steps["train-teacher"])  # fairseq-train spawns the node's 4 workers
    assert args.distributed_world_size == 4 and (args.max_tokens, args.update_freq) == (3125, [2])  # 25K per update
    assert steps["teacher-cache"][1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    assert sbatch_options(scripts[ARRAY_SCRIPT])["array"] == "0-31"
    assert "--num-shards 32 --shard-id \"$SLURM_ARRAY_TASK_ID\"" in scripts[ARRAY_SCRIPT]


def test_sbatch_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    folder, scripts = write_scripts(tmp_path, capsys, "--gpus-per-node", "8")
    write_scripts(tmp_path, capsys, "--gpus-per-node", "4")  # its own scripts: replaced
    assert sbatch_options((folder / RECIPE_SCRIPT).read_text())["gpus-per-node"] == "4"
    (folder / SUBMIT_SCRIPT).write_text("#!/bin/bash\nsbatch mine.sbatch\n")
    argv = ["wmt14_en_de", "--workdir", str(tmp_path / "work"), "--gpus-per-node", "8", "--sbatch", str(folder)]
    assert recipe_cli.cli_main(argv) == 2
    assert f"{SUBMIT_SCRIPT} exists and was not written by fairseq-kd-recipe" in capsys.readouterr().err
    assert (folder / SUBMIT_SCRIPT).read_text() == "#!/bin/bash\nsbatch mine.sbatch\n"
    assert sbatch_options((folder / RECIPE_SCRIPT).read_text())["gpus-per-node"] == "4"


def test_a_finished_step_is_skipped_and_stop_after_ends_the_job(tmp_path, capsys):
    """recipe.sbatch's run_step under bash: a step runs once per command line, a failing step
    stops the job with the end of its log, STOP_AFTER ends the job after the named step."""
    _, scripts = write_scripts(tmp_path, capsys, "--gpus-per-node", "8")
    text = scripts[RECIPE_SCRIPT]
    start = text.index("run_step() {")
    function = text[start:text.index("\n}\n", start) + 3]
    counter = tmp_path / "counter"

    def run(*steps, **environment):
        script = tmp_path / "steps.sh"
        script.write_text("\n".join([f"set -euo pipefail\nLOGS={tmp_path}/logs\nDONE={tmp_path}/done",
                                     "mkdir -p $LOGS $DONE", function, *steps]) + "\n")
        return subprocess.run(["bash", str(script)], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", **environment})

    def step(name, word, status=0):
        return f"run_step {name} bash -c 'echo {word} >> {counter}; exit {status}'"

    steps = [step("one", "one"), step("one", "one"), step("two", "two"), step("three", "three"),
             step("four", "broken", status=3)]
    first = run(*steps, STOP_AFTER="two")
    assert first.returncode == 0 and first.stdout.splitlines()[-1].startswith("stopping after two"), first.stderr
    assert re.findall(r"^\[(\w+)\] (\w+)", first.stdout, re.M) == [("run", "one"), ("done", "one"), ("run", "two")]
    assert counter.read_text().splitlines() == ["one", "two"]
    second = run(*steps)
    assert second.returncode == 1 and "step four failed" in second.stderr
    assert re.findall(r"^\[(\w+)\] (\w+)", second.stdout, re.M) == [
        ("done", "one"), ("done", "one"), ("done", "two"), ("run", "three"), ("run", "four")]
    assert counter.read_text().splitlines() == ["one", "two", "three", "broken"]
    assert "$ bash -c" in (tmp_path / "logs" / "four.log").read_text()
    # another command under a finished step's name runs
    third = run(step("one", "one again"))
    assert third.returncode == 0 and counter.read_text().splitlines()[-1] == "one again"
