"""Recipes (examples/translation/fairseq_kd_recipes, fairseq-kd-recipe): the method table resolves to command lines
fairseq itself accepts, bad requests fail before anything runs, training checkpoints are never
replaced, and the IWSLT'14 recipe runs end to end on a small archive in the release's layout
(prepare, tiny teacher, tiny students, decode, score, report, plots), then skips every step when
run again.

The end-to-end test builds ``de-en.tgz`` from real IWSLT'14 segments in ../shared/data when it is
there, and from synthetic sentences otherwise (as tests/test_prepare_iwslt.py does): the recipe's
pipeline does not depend on which.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_kd_recipes import recipe as recipe_cli
from fairseq_kd_recipes.execute import (
    TRAIN_RECORD_NAME,
    RecipeError,
    check_checkpoint_folder,
    describe_plan,
    run_plan,
    training_record,
)
from fairseq_kd_recipes.methods import (BASELINE, METHODS, PLAIN_CRITERION, README_TABLE_HEADER, TEACHER, criteria,
                                       needs_teacher_heads, readme_flag_table)
from fairseq_kd_recipes.pairs import PAIRS
from fairseq_kd_recipes.plan import MANIFEST_NAME, RecipeOptions, batch_split, build_plan, with_placement
from fairseq_kd_recipes.prepare.corpora import iwslt14_de_en
from fairseq_kd_recipes.prepare.iwslt import read_segments
from fairseq_kd_recipes.profiles import PROFILES
from prepare_fixtures import (IWSLT14_DATA, build_wit3_archive, load_entry_point, synthetic_parallel, truncated_xml,
                              xml_set_text)


def two_gpus() -> int:
    return 2


def plan_for(tmp_path, pair, profile="gpu", methods=("all",), **options):
    return build_plan(RecipeOptions(pair=pair, methods=list(methods), profile=profile, workdir=tmp_path / pair,
                                    **options), device_count=two_gpus)


def options_parser(kind):
    from fairseq import options

    return options.get_training_parser() if kind == "training" else options.get_generation_parser()


def parse_command(parser, command):
    """fairseq's own parsing of a command line (architecture defaults applied)."""
    from fairseq import options

    arguments = command[3:] if command[1] == "-m" else command[1:]  # without the program
    return options.parse_args_and_arch(parser, input_args=arguments)


def parse_training_command(command):
    return parse_command(options_parser("training"), command)


def flag_values(flags):
    """``--a-b 1 --switch --c d`` -> {"a_b": "1", "switch": "True", "c": "d"}: a flag followed by a
    flag (or by nothing) is a boolean switch, which fairseq parses to True."""
    values, i = {}, 0
    while i < len(flags):
        assert flags[i].startswith("--"), flags
        name = flags[i][2:].replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            values[name], i = flags[i + 1], i + 2
        else:
            values[name], i = "True", i + 1
    return values


# ----------------------------------------------------------------------------- the method table


@pytest.mark.parametrize("pair_name", list(PAIRS))
def test_every_method_is_a_valid_fairseq_train_command(tmp_path, pair_name):
    import fairseq_kd

    fairseq_kd.register()
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY, CRITERION_REGISTRY

    pair = PAIRS[pair_name]
    plan = plan_for(tmp_path, pair_name)
    assert [m.name for m in plan.methods] == [m.name for m in pair.methods()]
    assert plan.world_size == 2
    teacher = parse_training_command(plan.step(f"train-{TEACHER}").commands[0])
    assert teacher.task == "translation" and teacher.criterion == "label_smoothed_cross_entropy"
    # methods.md, "Settings from the papers"; WMT'14 and the CKD paper's pairs follow Vaswani et al.
    # (dropout 0.1, 25K tokens per update: 4 accumulated steps of 3,125 tokens on each of the 2
    # GPUs). The low-resource setups' 4,096 tokens per update are 2,048 per GPU here, not 4,096 on each.
    vaswani = pair_name in ("wmt14_en_de", "iwslt14_pt_en", "iwslt14_tr_en")
    dropout, update_freq = (0.1, 4) if vaswani else (0.3, 1)
    # Multi30k: our own setup for small models (pairs.py, _multi30k_fr_en), 2,048 tokens per update.
    lr, warmup = (1.5e-3, 500) if pair_name == "multi30k_fr_en" else (5e-4, 4000)
    max_tokens = 3125 if vaswani else 1024 if pair_name == "multi30k_fr_en" else 2048
    if pair_name == "multi30k_fr_en":
        dropout = 0.2
    # Decoding: Vaswani et al.'s beam 4 and length penalty 0.6 on the average of the last 5
    # checkpoints; beam 5 of the selected checkpoint elsewhere (A2D).
    generate = parse_command(options_parser("generation"), plan.step(f"generate-{TEACHER}").commands[0])
    assert (generate.beam, generate.lenpen) == ((4, 0.6) if vaswani else (5, 1.0))
    assert generate.fp16 and generate.required_batch_size_multiple == 1
    decoded = plan.workdir / "train" / TEACHER / ("checkpoint_avg.pt" if vaswani else "checkpoint_best.pt")
    export = plan.step(f"export-{TEACHER}").commands[0]
    assert str(decoded) in export
    if vaswani:
        average = plan.step(f"average-{TEACHER}").commands[0]
        assert average[average.index("--last") + 1] == "5" and str(decoded) in average
        assert average[average.index("--kind") + 1] == ("update" if pair_name == "wmt14_en_de" else "epoch")
    else:
        assert not any(step.name.startswith("average-") for step in plan.steps)
    # The A2D authors' low-resource scripts: up to 100 epochs, patience 10, best validation BLEU
    # (En-Zh: validation nll, since fairseq's --eval-bleu cannot tokenise Chinese).
    by_bleu = pair_name in ("iwslt14_de_en", "wmt22_de_dsb")
    a2d_low_resource = by_bleu or pair_name == "iwslt17_en_zh"

    for method in plan.methods:
        command = plan.step(f"train-{method.name}").commands[0]
        flags = [arg for arg in command if arg.startswith("--")]
        assert len(flags) == len(set(flags)), f"{method.name}: a flag is given twice"
        args = parse_training_command(command)
        # The criterion is registered and every flag of the table is a field of its config.
        assert args.criterion == method.criterion and method.criterion in CRITERION_REGISTRY
        fields = {f.name for f in dataclasses.fields(CRITERION_DATACLASS_REGISTRY[method.criterion])}
        for name, value in flag_values(pair.criterion_args(method)).items():
            assert name in fields, f"{method.name}: --{name} is not a flag of criterion {method.criterion}"
            assert str(getattr(args, name)) == value
        assert args.label_smoothing == 0.1
        # The papers' training values, fp16 data-parallel over the 2 GPUs of the plan.
        assert args.optimizer == "adam" and ast.literal_eval(args.adam_betas) == (0.9, 0.98)
        assert args.lr == [lr] and args.lr_scheduler == "inverse_sqrt" and args.warmup_updates == warmup
        assert args.weight_decay == 1e-4 and args.dropout == dropout and args.max_tokens == max_tokens
        # Checkpoints are chosen on the references' nll or BLEU, never on a KD criterion's total loss.
        if by_bleu:
            assert args.best_checkpoint_metric == "bleu" and args.maximize_best_checkpoint_metric and args.eval_bleu
            assert json.loads(args.eval_bleu_args)["beam"] == 5
            assert args.eval_bleu_remove_bpe == ("@@ " if pair_name == "iwslt14_de_en" else "sentencepiece")
        else:
            assert args.best_checkpoint_metric == "nll_loss" and not args.maximize_best_checkpoint_metric
            assert not args.eval_bleu
        if a2d_low_resource:
            assert args.max_epoch == 100 and args.patience == 10
        else:
            assert args.patience == -1
        # Checkpoints to average: the last 5 epochs (CKD pairs) or update checkpoints (WMT'14).
        if pair_name == "wmt14_en_de":
            assert args.save_interval_updates == 1000 and args.keep_interval_updates == 5 and args.no_epoch_checkpoints
        elif vaswani:
            assert args.keep_last_epochs == 5 and not args.no_epoch_checkpoints
        else:
            assert args.no_epoch_checkpoints
        assert args.fp16 and args.distributed_world_size == 2 and args.update_freq == [update_freq]
        # Data and teacher.
        assert args.task == "translation_kd"
        assert args.data.endswith("data-bin" if method.data == "original" else "data-" + method.data.replace("_", "-"))
        if method.uses_teacher:
            assert args.teacher_checkpoint == str(decoded)
        else:
            assert args.teacher_checkpoint is None
        # The student the method's name promises, smaller than the teacher.
        assert args.encoder_layers < teacher.encoder_layers and args.decoder_layers < teacher.decoder_layers
        if method.student == "student_2l":
            assert args.encoder_layers == args.decoder_layers == 2
        if method.student in ("student_4h", "student_8h"):
            heads = 4 if method.student == "student_4h" else 8
            assert args.encoder_attention_heads == args.decoder_attention_heads == heads
        if needs_teacher_heads(method.criterion):  # tinybert, minilm
            assert args.encoder_attention_heads == teacher.encoder_attention_heads
            assert args.decoder_attention_heads == teacher.decoder_attention_heads


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("pair_name", list(PAIRS))
def test_each_pair_prepares_through_the_module_its_checkout_script_runs(tmp_path, pair_name):
    """The recipe runs the preparation as ``python -m`` of a module of the installed package (no
    checkout needed), the same module whose flags ``examples/translation/<corpus>/prepare.py`` parses."""
    pair = PAIRS[pair_name]
    module = importlib.import_module(pair.prepare_module)
    assert load_entry_point(pair.prepare_script).cli_main is module.cli_main
    prepare = plan_for(tmp_path, pair_name, profile="cpu", methods=["no_kd"]).step("prepare").commands[0]
    assert prepare[1:3] == ["-m", pair.prepare_module]
    module.build_parser().parse_args(prepare[3:])  # every flag the recipe gives is the module's


def test_readme_flag_table_is_the_one_generated_from_the_method_table():
    """The README's table of criterions and flags is what ``python -m fairseq_kd_recipes.methods``
    prints (regenerate it with that command after changing a criterion's row in CRITERIA or its config)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start = readme.index(README_TABLE_HEADER)
    end = readme.index("\n\n", start)
    assert readme[start:end + 1] == readme_flag_table()


def test_every_listed_flag_value_parses_with_fairseq_train_for_its_criterion(tmp_path):
    """Each value the README lists for a flag is accepted by fairseq-train's parser with that
    criterion and arrives unchanged; a flag with choices lists all of them (so a renamed or added
    choice cannot drift from the table); the first value is the criterion's default where the
    config has one."""
    import fairseq_kd

    fairseq_kd.register()
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY

    for criterion in criteria():
        config = CRITERION_DATACLASS_REGISTRY[criterion.name]
        defaults = {field.name: field.default for field in dataclasses.fields(config)}
        for flag, *values in criterion.flags:
            dest = flag[2:].replace("-", "_")
            assert dest in defaults, f"{criterion.name}: {flag} is not a flag of the criterion"
            for value in values or [None]:
                parser = options_parser("training")
                command = ["python", str(tmp_path), "--task", "translation_kd", "--arch", "transformer",
                           "--criterion", criterion.name, flag, *([value] if value is not None else [])]
                parsed = getattr(parse_command(parser, command), dest)
                if value is None:
                    assert parsed is True, f"{criterion.name} {flag}: not a switch"
                else:
                    assert str(parsed) == value or float(parsed) == float(value), (criterion.name, flag, value, parsed)
            (action,) = [a for a in parser._actions if flag in a.option_strings]
            if action.choices is not None:
                assert sorted(values) == sorted(map(str, action.choices)), (criterion.name, flag, action.choices)
            default = defaults[dest]
            if values and default is not None:
                assert str(default) == values[0] or float(default) == float(values[0]), (criterion.name, flag, default)


def test_recipes_benchmark_and_readme_are_derived_from_one_table():
    """Every method trains a criterion of the README's table (or plain CE), every criterion of that
    table has a method, the benchmark's rows are the table's rows with the table's flags, and each
    pair trains only rows meant for recipes."""
    from fairseq_kd_recipes import benchmark

    table = criteria()
    names = {criterion.name for criterion in table}
    assert len(names) == len(table)
    used = {method.criterion for method in METHODS.values()}
    assert used - names == {PLAIN_CRITERION} and names <= used
    for name, flags in benchmark.METHODS.items():
        if name in (benchmark.PLAIN, benchmark.LIMIT):
            assert flags == ["--criterion", PLAIN_CRITERION, "--label-smoothing", "0.1"]
            continue
        method = METHODS[name]
        assert flags[:2] == ["--criterion", method.criterion]
        assert tuple(flags[2:2 + len(method.criterion_args)]) == method.criterion_args
    assert set(benchmark.DEFAULT_METHODS) <= set(benchmark.METHODS)
    assert {name for name, method in METHODS.items() if method.benchmarked} == set(benchmark.DEFAULT_METHODS[2:])
    for pair in PAIRS.values():
        assert all(method.in_recipes for method in pair.methods()), pair.name
    only_measured = [name for name, method in METHODS.items() if not method.in_recipes]
    assert only_measured and not any(name in {m.name for m in pair.methods()} for pair in PAIRS.values()
                                     for name in only_measured)


def test_paper_specific_settings(tmp_path):
    from fairseq_kd.criterions.a2d_kd import PRESETS

    def train_args(pair, method):
        plan = plan_for(tmp_path, pair, methods=[method])
        return parse_training_command(plan.step(f"train-{method}").commands[0])

    # A2D (Sec. 5.2): lambda of L_att starts at 1 on the low-resource pairs, 0.1 on WMT'14.
    assert PRESETS[str(train_args("iwslt14_de_en", "a2d_kd_4h").a2d_preset)][0] == 1.0
    assert PRESETS[str(train_args("wmt14_en_de", "a2d_kd_8h").a2d_preset)][0] == 0.1
    # Word-level KD weight: 0.5 as A2D's code, eta = 0.1 on the CKD paper's pairs.
    assert train_args("iwslt14_de_en", "word_kd").kd_weight == 0.5
    assert train_args("iwslt14_tr_en", "word_kd").kd_weight == 0.1
    # CKD's 6+6 teacher and 2+2 students at transformer-base widths.
    ckd_plan = plan_for(tmp_path, "iwslt14_pt_en", methods=["ckd_sc"])
    for step, layers in (("train-teacher", 6), ("train-ckd_sc", 2)):
        model = parse_training_command(ckd_plan.step(step).commands[0])
        assert model.encoder_layers == model.decoder_layers == layers
        assert (model.encoder_embed_dim, model.encoder_ffn_embed_dim, model.encoder_attention_heads) == (512, 2048, 8)

    # Scoring: Chinese with sacreBLEU's zh tokeniser, SentencePiece decoded; IWSLT'14 BPE removed
    # and Moses-detokenised.
    def score_flags(pair):
        command = plan_for(tmp_path, pair, methods=["no_kd"]).step("score-no_kd").commands[0]
        return {command[i]: command[i + 1] for i in range(len(command) - 1) if command[i].startswith("--")}

    assert score_flags("iwslt17_en_zh")["--tokenize"] == "zh"
    assert score_flags("iwslt17_en_zh")["--remove-bpe"] == "sentencepiece"
    assert "--detok-moses" not in score_flags("iwslt17_en_zh")
    assert score_flags("iwslt14_de_en")["--remove-bpe"] == "subword_nmt"
    assert score_flags("iwslt14_de_en")["--detok-moses"] == "en" and score_flags("wmt14_en_de")["--detok-moses"] == "de"


def test_smoke_and_cpu_profiles_resolve(tmp_path):
    plan = plan_for(tmp_path, "iwslt14_de_en", profile="smoke", methods=["a2d_kd_8h", "ckd_sc"])
    a2d = parse_training_command(plan.step("train-a2d_kd_8h").commands[0])
    ckd = parse_training_command(plan.step("train-ckd_sc").commands[0])
    teacher = parse_training_command(plan.step("train-teacher").commands[0])
    assert a2d.cpu and not a2d.fp16 and a2d.max_update == 30 and a2d.encoder_attention_heads == 8
    assert ckd.encoder_layers < a2d.encoder_layers < teacher.encoder_layers
    assert "--bpe-merges" in plan.step("prepare").commands[0]
    generate = plan.step("generate-a2d_kd_8h").commands[0]
    assert generate[generate.index("--beam") + 1] == str(PROFILES["smoke"].beam)
    cpu = plan_for(tmp_path, "iwslt14_de_en", profile="cpu", methods=["no_kd"], max_update=123)
    args = parse_training_command(cpu.step("train-no_kd").commands[0])
    assert args.cpu and args.max_update == 123 and args.arch == "transformer_kd_iwslt_student_3l"


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_the_test_set_is_decoded_with_the_length_limit_of_the_validation_bleu(tmp_path, profile):
    """A student that loops stops at the same length on test as in the validation BLEU that scored it."""
    validation = json.loads(parse_training_command(
        plan_for(tmp_path, "iwslt14_de_en", profile=profile, methods=["no_kd"]).step("train-no_kd").commands[0]
    ).eval_bleu_args)
    plan = plan_for(tmp_path, "multi30k_fr_en", profile=profile, methods=["no_kd"])  # which selects by nll
    for step in ("generate-no_kd", "generate-teacher"):
        command = plan.step(step).commands[0]
        flags = {command[i]: command[i + 1] for i in range(len(command) - 1) if command[i].startswith("--max-len")}
        assert (float(flags["--max-len-a"]), int(flags["--max-len-b"])) == (
            validation["max_len_a"], validation["max_len_b"]) == (1.2, 10)
        assert "at most 1.2 x source + 10 tokens" in plan.step(step).description
    assert not any(flag.startswith("--max-len") for flag in plan_for(
        tmp_path, "multi30k_fr_en", profile=profile, methods=["seq_kd"]).step("seqkd-data").commands[0])


def test_the_smoke_profile_limits_every_decoding_to_its_own_length(tmp_path):
    """Untrained models repeat a piece until the limit: the smoke profile's limit (0 x source + 20)
    replaces the shared one in the test decoding and bounds the teacher passes too, once each."""
    plan = plan_for(tmp_path, "multi30k_fr_en", profile="smoke", methods=["no_kd", "seq_kd"])
    for step in ("generate-no_kd", "generate-teacher", "seqkd-data"):
        command = plan.step(step).commands[0]
        limits = [(command[i], command[i + 1]) for i in range(len(command) - 1) if command[i].startswith("--max-len")]
        assert limits == [("--max-len-a", "0"), ("--max-len-b", "20")], (step, limits)
    assert "at most 0 x source + 20 tokens" in plan.step("generate-no_kd").description


@pytest.mark.parametrize("profile, max_update, interval", [("cpu", None, 800), ("smoke", None, 6), ("cpu", 7, 1)])
def test_checkpoints_to_average_exist_at_the_end_of_any_budget(tmp_path, profile, max_update, interval):
    """WMT'14 writes a checkpoint every 1,000 updates; a shorter budget of M updates writes one every
    M / 5 updates, so that the last 5 exist when training ends."""
    plan = plan_for(tmp_path, "wmt14_en_de", profile=profile, methods=["no_kd"], max_update=max_update)
    args = parse_training_command(plan.step("train-no_kd").commands[0])
    assert args.save_interval_updates == interval and args.keep_interval_updates == 5
    assert args.max_update // args.save_interval_updates >= 5


# ----------------------------------------------------------------------------- bad requests


def test_bad_requests_fail_before_anything_runs(tmp_path, capsys):
    workdir = tmp_path / "work"
    common = ["--workdir", str(workdir), "--profile", "cpu"]
    assert recipe_cli.cli_main(["iwslt14_de_en", "--methods", "word_kd,bogus_kd", *common]) == 2
    error = capsys.readouterr().err
    assert "bogus_kd" in error and all(name in error for name in ("no_kd", "a2d_kd_4h", "a2d_kd_8h", "ckd_cc"))
    assert recipe_cli.cli_main(["iwslt14_pt_en", "--methods", "no_kd_2l", *common]) == 2
    assert "no_kd_2l" in capsys.readouterr().err

    assert recipe_cli.cli_main(["iwslt14_de_en", "--archives", str(tmp_path / "nowhere"), *common]) == 2
    error = capsys.readouterr().err
    assert str(tmp_path / "nowhere") in error and "de-en.tgz" in error
    (tmp_path / "archives").mkdir()
    assert recipe_cli.cli_main(["wmt14_en_de", "--archives", str(tmp_path / "archives"), *common]) == 2
    assert "lacks training-parallel-europarl-v7.tgz" in capsys.readouterr().err
    assert not workdir.exists()

    with pytest.raises(RecipeError, match="no CUDA device"):
        build_plan(RecipeOptions(pair="iwslt14_de_en", profile="gpu", workdir=workdir), device_count=lambda: 0)
    with pytest.raises(RecipeError, match="--gpus 3"):
        build_plan(RecipeOptions(pair="iwslt14_de_en", profile="gpu", gpus=3, workdir=workdir), device_count=two_gpus)

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="not a recipe's working folder"):
        build_plan(RecipeOptions(pair="iwslt14_de_en", profile="cpu", workdir=foreign))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / MANIFEST_NAME).write_bytes(b'{"pair": "iwslt14_de_en", "prof')  # a write cut short
    with pytest.raises(RecipeError, match=f"its {MANIFEST_NAME} cannot be read .*damaged"):
        build_plan(RecipeOptions(pair="iwslt14_de_en", profile="cpu", workdir=damaged))
    with pytest.raises(SystemExit):
        recipe_cli.cli_main(["iwslt99_xx_yy"])


def test_a_missing_fairseq_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """fairseq is no declared dependency of the plugin: the recipe refuses to plan without it, rather
    than starting hours of preparation that end in a step's log at fairseq-preprocess."""
    monkeypatch.setitem(sys.modules, "fairseq", None)  # `import fairseq` raises ImportError
    workdir = tmp_path / "work"
    assert recipe_cli.cli_main(["iwslt14_de_en", "--profile", "cpu", "--workdir", str(workdir)]) == 2
    error = capsys.readouterr().err
    assert "fairseq-kd needs fairseq, which cannot be imported" in error and error.count("\n") == 1, error
    assert not workdir.exists()


def test_checkpoint_folder_is_used_only_by_the_same_training(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"corpus")
    save_dir = tmp_path / "train" / "teacher"
    settings = {"commands": [["fairseq-train", "--lr", "5e-4"]]}
    record = check_checkpoint_folder(save_dir, settings, [data])  # no folder yet
    assert record == training_record(settings, [data])
    assert record["inputs"][str(data)]["sha256"] == hashlib.sha256(b"corpus").hexdigest()
    save_dir.mkdir(parents=True)
    (save_dir / "train.log").write_text("")
    check_checkpoint_folder(save_dir, settings, [data])  # no checkpoint yet
    (save_dir / "checkpoint_last.pt").write_bytes(b"weights")
    with pytest.raises(RecipeError, match="no record of how they were trained"):
        check_checkpoint_folder(save_dir, settings, [data])
    (save_dir / TRAIN_RECORD_NAME).write_text(json.dumps(record))
    check_checkpoint_folder(save_dir, settings, [data])  # an interrupted run of the same training resumes
    os.utime(data, ns=(1, 1))  # the same content, touched: still the same training (content, not times)
    check_checkpoint_folder(save_dir, settings, [data])
    with pytest.raises(RecipeError, match="other settings"):
        check_checkpoint_folder(save_dir, {"commands": [["fairseq-train", "--lr", "1e-3"]]}, [data])
    data.write_bytes(b"another corpus")
    with pytest.raises(RecipeError, match="inputs .* have changed"):
        check_checkpoint_folder(save_dir, settings, [data])
    assert (save_dir / "checkpoint_last.pt").read_bytes() == b"weights"


def test_a_training_record_of_another_format_is_refused(tmp_path):
    """A record without the current format (the sizes and modification times of the first recipes)
    does not match: the checkpoints it describes are protected like those of another training."""
    data = tmp_path / "data-bin"
    data.mkdir()
    (data / "train.bin").write_bytes(b"corpus")
    save_dir = tmp_path / "train" / "teacher"
    save_dir.mkdir(parents=True)
    (save_dir / "checkpoint_last.pt").write_bytes(b"weights")
    settings = {"commands": [["fairseq-train", "--lr", "5e-4"]]}
    stat = (data / "train.bin").stat()
    legacy = {"settings": settings, "inputs": {str(data): {"train.bin": [stat.st_size, stat.st_mtime_ns]}}}
    (save_dir / TRAIN_RECORD_NAME).write_text(json.dumps(legacy))
    with pytest.raises(RecipeError, match="holds checkpoints"):
        check_checkpoint_folder(save_dir, settings, [data])
    assert (save_dir / "checkpoint_last.pt").read_bytes() == b"weights"


# ----------------------------------------------------------------------------- end to end

SEGMENTS_PER_SET = 30
TRAIN_SEGMENTS = 400


def build_de_en_archive(folder: Path) -> tuple[Path, bool]:
    """``de-en.tgz`` in the WIT3 layout: train.tags from the last 400 segments of TED.tst2012 and
    the five test sets cut to their first 30 segments (real data), or synthetic text."""
    folder.mkdir(parents=True, exist_ok=True)
    orig = IWSLT14_DATA / "orig"
    real = orig.is_dir()
    if real:
        train = tuple(read_segments(orig / f"IWSLT14.TED.tst2012.de-en.{lang}.xml", False)[-TRAIN_SEGMENTS:]
                      for lang in ("de", "en"))
        sets = {name: tuple(truncated_xml(orig / f"IWSLT14.{name}.de-en.{lang}.xml", SEGMENTS_PER_SET)
                            for lang in ("de", "en")) for name in iwslt14_de_en.TEST_SETS}
    else:
        train = synthetic_parallel(TRAIN_SEGMENTS, "de", "en", seed=1)
        sets = {}
        for index, name in enumerate(iwslt14_de_en.TEST_SETS):
            source, target = synthetic_parallel(SEGMENTS_PER_SET, "de", "en", seed=10 + index)
            sets[name] = (xml_set_text(source, name, "srcset", "german"), xml_set_text(target, name, "refset", "english"))
    return build_wit3_archive(folder / "de-en.tgz", "de-en", "IWSLT14", train, sets), real


def smoke_methods() -> list[str]:
    return ["no_kd", "word_kd", "a2d_kd_4h"]


def read_h_and_t_lines(generate_output: Path):
    hypotheses, references = {}, {}
    for line in generate_output.read_text(encoding="utf-8").splitlines():
        kind, _, rest = line.partition("-")
        if kind in ("H", "T") and rest.split("\t")[0].isdigit():
            fields = rest.split("\t")
            (hypotheses if kind == "H" else references)[int(fields[0])] = fields[-1]
    ids = sorted(references)
    return [hypotheses[i] for i in ids], [references[i] for i in ids]


def reference_bleu(generate_output: Path, raw_references: Path):
    """sacreBLEU of the H- lines, BPE removed and Moses-detokenised here independently, against
    the untouched reference file, case-insensitively (the IWSLT'14 corpus is lowercased)."""
    import sacrebleu
    from sacremoses import MosesDetokenizer

    hypotheses, _ = read_h_and_t_lines(generate_output)
    detok = MosesDetokenizer(lang="en")
    plain = [detok.detokenize((text + " ").replace("@@ ", "").split()) for text in hypotheses]
    references = raw_references.read_text(encoding="utf-8").splitlines()
    return sacrebleu.corpus_bleu(plain, [references], lowercase=True)


def tokenized_bleu(generate_output: Path):
    """The A2D authors' BLEU: sacreBLEU on the tokenised H- and T- lines with BPE removed."""
    import sacrebleu

    hypotheses, references = read_h_and_t_lines(generate_output)
    unbpe = lambda text: (text + " ").replace("@@ ", "").strip()  # noqa: E731
    return sacrebleu.corpus_bleu([unbpe(h) for h in hypotheses], [[unbpe(t) for t in references]])


def test_iwslt14_recipe_end_to_end_then_skips_everything(tmp_path, monkeypatch, capsys, warm_recipe_children):
    """The recipe's fairseq-train and fairseq-generate steps run as children of the warm interpreter
    (conftest.warm_recipe_children: the same command lines, environment and logs, without a new
    interpreter's imports); test_quality_benchmark_command_runs_its_steps_on_tiny_data runs every
    step as a new process."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the machine is shared: one thread per child
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    archive, real = build_de_en_archive(tmp_path / "archives")
    workdir = tmp_path / "recipe"
    methods = smoke_methods()
    argv = ["iwslt14_de_en", "--profile", "smoke", "--methods", ",".join(methods), "--archives", str(archive.parent),
            "--workdir", str(workdir), "--workers", "1"]
    status = recipe_cli.cli_main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.err[-3000:]
    systems = [TEACHER] + methods

    # The report: every system with BLEU inside its 95% interval, compared with no_kd.
    report = json.loads((workdir / "report" / "results.json").read_text())
    rows = {row["system"]: row for row in report["systems"]}
    assert list(rows) == systems and report["baseline"] == BASELINE and report["n_sentences"] == 5 * SEGMENTS_PER_SET
    for name, row in rows.items():
        assert row["mean"] >= 0 and row["ci"] >= 0  # sacreBLEU's mu +- half-width
        assert (row["p_bootstrap"] is None) == (row["p_randomization"] is None) == (name == BASELINE)
    markdown = (workdir / "report" / "results.md").read_text()
    assert all(re.search(rf"^\| {name}( \(baseline\))? \| \d+\.\d\d \| \d+\.\d\d ± \d+\.\d\d \|", markdown, re.M) for name in systems)
    assert markdown in captured.out
    # BLEU as sacreBLEU computes it on the decoded test set (30 updates teach the tiny models next
    # to nothing, so the lengths after detokenisation are compared as well as the score).
    teacher_output = workdir / "generate" / TEACHER / "generate-test.txt"
    expected = reference_bleu(teacher_output, workdir / "data-bin" / "raw" / "test.en")
    record = json.loads((workdir / "scores" / f"{TEACHER}.json").read_text())
    assert rows[TEACHER]["bleu"] == pytest.approx(expected.score, abs=1e-6)
    assert f"hyp_len = {expected.sys_len} ref_len = {expected.ref_len}" in record["verbose"]
    assert "case:lc" in report["signature"] and "untouched test references" in markdown
    # The paper's BLEU (tokenised, lowercased, T- lines) in its own, labelled table.
    tokenized = json.loads((workdir / "report" / "results_tokenized.json").read_text())
    assert "A2D authors' IWSLT'14 protocol" in tokenized["title"]
    tokenized_rows = {row["system"]: row for row in tokenized["systems"]}
    assert tokenized_rows[TEACHER]["bleu"] == pytest.approx(tokenized_bleu(teacher_output).score, abs=1e-6)
    # Parameters of the shipped models: the alignment modules of A2D do not ship, so every student
    # (same architecture) has the same count, below the teacher's.
    assert rows["no_kd"]["params"] == rows["word_kd"]["params"] == rows["a2d_kd_4h"]["params"] < rows[TEACHER]["params"]
    # Every test sentence decoded once; decoding speed: fairseq-generate's own figure.
    assert len(re.findall(r"^H-\d+\t", teacher_output.read_text(), re.M)) == 5 * SEGMENTS_PER_SET
    generate_text = teacher_output.read_text() + (workdir / "logs" / "generate-teacher.log").read_text()
    speed = re.findall(r"\(([\d.]+) sentences/s", generate_text)[-1]
    assert rows[TEACHER]["sents_per_sec"] == float(speed)

    # Training logs in JSON with each loss term, and their curves; the A2D alignment heatmap.
    log_lines = [json.loads(line) for line in (workdir / "train" / "a2d_kd_4h" / "train.log").read_text().splitlines()
                 if line.startswith("{\"")]
    assert any("enc_self_att_loss" in line and "word_kd_loss" in line for line in log_lines)
    figures = [workdir / "plots" / f"{name}-curves.png" for name in systems] + [workdir / "plots" / "a2d_kd_4h-alignment.png",
                                                                                 workdir / "plots" / "validation-nll.png"]
    for figure in figures:
        assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure

    # Re-running: every step is skipped and nothing is rewritten.
    outputs = {path: path.stat().st_mtime_ns for path in workdir.rglob("*") if path.is_file() and "logs" not in path.parts}
    options = RecipeOptions(pair="iwslt14_de_en", methods=methods, profile="smoke", archives=archive.parent,
                            workdir=workdir, workers=1)
    plan = build_plan(options)
    assert all(line.startswith("[done]") for line in describe_plan(plan).splitlines() if line.startswith("["))
    result = run_plan(plan)
    assert result.executed == [] and result.skipped == [step.name for step in plan.steps]
    assert {path: path.stat().st_mtime_ns for path in outputs} == outputs

    # The systems step as the command that --print-commands and --sbatch show writes what the recipe
    # wrote in its own process.
    command = plan.step("systems").commands[0]
    assert command[1:3] == ["-m", "fairseq_kd_recipes.systems"]
    command[command.index("--output") + 1] = str(tmp_path / "systems.json")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "systems.json").read_text()) == json.loads((workdir / "report" / "systems.json").read_text())

    # Other training settings in the same folder: refused before any step, checkpoints untouched.
    assert recipe_cli.cli_main(argv + ["--max-update", "7"]) == 2
    error = capsys.readouterr().err
    assert str(workdir / "train" / TEACHER) in error and "never overwrites a checkpoint" in error
    assert {path: path.stat().st_mtime_ns for path in outputs} == outputs
    print(f"end-to-end recipe on {'real' if real else 'synthetic'} segments: "
          + ", ".join(f"{name} {rows[name]['bleu']:.2f}" for name in systems))


def test_a_given_teacher_replaces_the_teacher_training(tmp_path, capsys):
    teacher = tmp_path / "mine" / "teacher.pt"
    teacher.parent.mkdir()
    teacher.write_bytes(b"a checkpoint")
    plan = plan_for(tmp_path, "multi30k_fr_en", profile="cpu", methods=("no_kd", "word_kd", "a2d_kd_4h"),
                    teacher=teacher)
    names = [step.name for step in plan.steps]
    assert f"train-{TEACHER}" not in names and f"export-{TEACHER}" in names
    word_kd = parse_training_command(plan.step("train-word_kd").commands[0])
    assert word_kd.teacher_checkpoint == str(teacher.resolve())
    assert word_kd.teacher_data == str(plan.data)  # its dictionaries are the data's (--teacher's promise)
    assert teacher.resolve() in plan.step("train-word_kd").inputs
    # The pair's own budget on the CPU: 6 epochs, its warm-up kept over the cpu profile's.
    assert word_kd.max_epoch == 6 and word_kd.warmup_updates == 500 and word_kd.max_update == 0
    assert word_kd.encoder_embed_dim == 64 and word_kd.encoder_layers == 3
    common = ["--workdir", str(tmp_path / "other"), "--profile", "cpu"]
    assert recipe_cli.cli_main(["multi30k_fr_en", "--teacher", str(tmp_path / "absent.pt"), *common]) == 2
    assert "--teacher" in capsys.readouterr().err and not (tmp_path / "other").exists()


MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k-fr-en"
SMOKE_SIZES = {"train": 300, "val": 30, "test_2016_flickr": 30}


def build_multi30k_release(folder):
    """The Multi30k release's file names with the first lines of the real corpus (synthetic
    French-English text when ../shared/data is absent)."""
    import gzip

    folder.mkdir(parents=True)
    for stem, count in SMOKE_SIZES.items():
        if (MULTI30K / f"{stem}.fr.gz").is_file():
            sides = {}
            for lang in ("fr", "en"):
                with gzip.open(MULTI30K / f"{stem}.{lang}.gz", "rt", encoding="utf-8") as handle:
                    sides[lang] = [next(handle).rstrip("\n") for _ in range(count)]
        else:
            french, english = synthetic_parallel(count, "fr", "en", seed=len(stem))
            sides = {"fr": french, "en": english}
        for lang, lines in sides.items():
            with gzip.open(folder / f"{stem}.{lang}.gz", "wt", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")
    return folder


def test_quality_benchmark_command_runs_its_steps_on_tiny_data(tmp_path):
    """scripts/quality_benchmark.sh as a user runs it (smoke profile, tiny corpus in the release's
    layout): preparation, teacher, a no-KD student, decoding, report, copied report. (The KD students'
    steps are the recipe's own, run by test_iwslt14_recipe_end_to_end_then_skips_everything.)"""
    release = build_multi30k_release(tmp_path / "release")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MULTI30K_DIR": str(release),
           "QUALITY_WORKDIR": str(tmp_path / "work"), "QUALITY_RESULTS_DIR": str(tmp_path / "results")}
    script = Path(__file__).resolve().parents[1] / "scripts" / "quality_benchmark.sh"
    command = ["bash", str(script), "--profile", "smoke", "--methods", "no_kd", "--workers", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "work" / "report" / "results.json").read_text())
    assert [row["system"] for row in report["systems"]] == [TEACHER, "no_kd"]
    assert report["n_sentences"] == SMOKE_SIZES["test_2016_flickr"] and report["baseline"] == BASELINE
    prepared = json.loads((tmp_path / "work" / "data-bin" / "prepare.json").read_text())
    assert prepared["sizes"] == {"train": 300, "valid": 30, "test": 30} and prepared["corpus"] == "multi30k.fr-en"
    copied = (tmp_path / "results" / "multi30k_fr_en_smoke.md").read_text()
    assert copied == (tmp_path / "work" / "report" / "results.md").read_text() and "no_kd" in copied
    # every system's detokenised test translations, one line per test sentence, for later sessions
    hypotheses = tmp_path / "results" / "multi30k_fr_en_smoke_hypotheses"
    for system in (TEACHER, "no_kd"):
        lines = (hypotheses / f"{system}.en").read_text(encoding="utf-8").splitlines()
        assert len(lines) == SMOKE_SIZES["test_2016_flickr"] and "@@" not in " ".join(lines)
    # A second run skips every step, and copies only the tables of its own plan: not a table that an
    # earlier invocation with other --student-seeds left in the working folder.
    (tmp_path / "work" / "report" / "results_seed9.md").write_text("a stale table\n", encoding="utf-8")
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert again.returncode == 0 and re.search(r"ran 0 step\(s\)", again.stdout), again.stdout[-2000:]
    assert (tmp_path / "results" / "multi30k_fr_en_smoke.md").read_text() == copied
    # Printing the commands copies nothing, even where no run has listed its tables (a folder of an
    # older recipe): the copy is never made from an empty list (which would copy stdin).
    (tmp_path / "work" / "report" / "tables.txt").unlink()
    printed = subprocess.run(command + ["--print-commands"], capture_output=True, text=True, env=env, timeout=900,
                             stdin=subprocess.DEVNULL)
    assert printed.returncode == 0 and "report copied" not in printed.stdout, printed.stderr[-2000:]
    assert (tmp_path / "results" / "multi30k_fr_en_smoke.md").read_text() == copied


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("pair_name", sorted(PAIRS))
def test_tokens_per_update_are_the_papers_on_any_number_of_gpus(pair_name, gpus):
    """--max-tokens per GPU x GPUs x --update-freq is the pair's tokens per update (up to rounding
    to a whole number of tokens per GPU), and no GPU takes more than the pair's --max-tokens."""
    pair = PAIRS[pair_name]
    cap = int(pair.training()["--max-tokens"])
    max_tokens, update_freq = batch_split(pair.tokens_per_update, cap, gpus)
    assert max_tokens <= cap
    total = max_tokens * gpus * update_freq
    assert pair.tokens_per_update <= total < pair.tokens_per_update + gpus * update_freq
    # no fewer accumulation steps would do
    assert update_freq == 1 or cap * gpus * (update_freq - 1) < pair.tokens_per_update


def test_placement_replaces_max_tokens_in_place():
    args = ["fairseq-train", "data", "--max-tokens", "4096", "--seed", "1"]
    assert with_placement(args, ["--fp16", "--max-tokens", "512", "--update-freq", "2"]) == [
        "fairseq-train", "data", "--max-tokens", "512", "--seed", "1", "--fp16", "--update-freq", "2"]
    assert with_placement(args, ["--cpu"]) == args + ["--cpu"]


def report_tables(plan):
    """{step name: (systems, baseline)} of the plan's report steps, read from their commands."""
    tables = {}
    for step in plan.steps:
        if step.name.startswith("report"):
            command = step.commands[0]
            systems = [command[i + 1].split("=")[0] for i, arg in enumerate(command) if arg == "--system"]
            baseline = command[command.index("--baseline") + 1] if "--baseline" in command else None
            tables[step.name] = (systems, baseline)
    return tables


def test_each_student_shape_is_compared_with_its_own_no_kd_system(tmp_path):
    plan = plan_for(tmp_path, "multi30k_fr_en", profile="cpu", methods=("no_kd", "word_kd", "no_kd_2l", "ckd_rc"))
    assert report_tables(plan) == {
        "report": ([TEACHER, "no_kd", "word_kd"], "no_kd"),
        "report-2l": (["no_kd_2l", "ckd_rc"], "no_kd_2l"),
    }
    assert [prefix.name for prefix in plan.report_prefixes] == ["results", "results_2l"]
    # Without the 2+2 baseline in the recipe, CKD stays in the main table (against no_kd).
    alone = plan_for(tmp_path / "alone", "multi30k_fr_en", profile="cpu", methods=("no_kd", "ckd_rc"))
    assert report_tables(alone) == {"report": ([TEACHER, "no_kd", "ckd_rc"], "no_kd")}
    # A pair with the paper's tokenised BLEU gets both tables per shape.
    iwslt = plan_for(tmp_path / "iwslt", "iwslt14_de_en", methods=("no_kd", "no_kd_2l", "ckd_rc"))
    assert set(report_tables(iwslt)) == {"report", "report-tokenized", "report-2l", "report-tokenized-2l"}
    assert report_tables(iwslt)["report-tokenized-2l"] == (["no_kd_2l", "ckd_rc"], "no_kd_2l")


def test_student_seeds_train_every_student_again_beside_one_teacher_and_leave_the_first_run_as_it_was(tmp_path):
    methods = ("no_kd", "seq_kd", "no_kd_2l", "ckd_rc")
    plain = plan_for(tmp_path / "plain", "multi30k_fr_en", profile="cpu", methods=methods)
    plan = plan_for(tmp_path / "plain", "multi30k_fr_en", profile="cpu", methods=methods, student_seeds=(3, 1, 2, 3))
    steps = {step.name: step for step in plan.steps}
    # The first run's steps are unchanged (their stamps stay valid: adding seeds retrains nothing) ...
    for step in plain.steps:
        if step.name not in ("validation-curves", "systems"):
            assert steps[step.name].commands == step.commands, step.name
    # ... the teacher and its passes run once, every student once more per further seed, in its own folder.
    ordered = [method.name for method in plan.methods]
    assert sorted(ordered) == sorted(methods) and [name for name in steps if name.startswith("train-")] == [
        "train-teacher", *(f"train-{m}" for m in ordered), *(f"train-{m}-seed{s}" for s in (3, 2) for m in ordered)]
    assert [name for name in steps if name.endswith("-data")] == ["seqkd-data"]
    for seed in (3, 2):
        args = parse_training_command(steps[f"train-seq_kd-seed{seed}"].commands[0])
        assert args.seed == seed and args.save_dir.endswith(f"/train/seq_kd-seed{seed}")
        assert args.data == parse_training_command(steps["train-seq_kd"].commands[0]).data
        assert f"generate-seq_kd-seed{seed}" in steps and f"figure-seq_kd-seed{seed}" not in steps
    # Each seed's students in tables of their own, against that seed's no-KD system, beside the teacher.
    tables = report_tables(plan)
    assert tables["report-seed2"] == ([TEACHER, "no_kd-seed2", "seq_kd-seed2"], "no_kd-seed2")
    assert tables["report-2l-seed3"] == (["no_kd_2l-seed3", "ckd_rc-seed3"], "no_kd_2l-seed3")
    assert [prefix.name for prefix in plan.report_prefixes] == [
        "results", "results_2l", "results_seed3", "results_2l_seed3", "results_seed2", "results_2l_seed2"]
    # What holds on every seed: the main tables (seed 1's is results.json) and the main shape's logs.
    summary = steps["report-seeds"].commands[0]
    reports = [summary[i + 1] for i, arg in enumerate(summary) if arg == "--report"]
    assert [r.rsplit("/", 1)[1] for r in reports] == ["results.json", "results_seed3.json", "results_seed2.json"]
    assert [r.split("=")[0] for r in reports] == ["1", "3", "2"] and "--plain-names" in summary
    logs = [summary[i + 1] for i, arg in enumerate(summary) if arg == "--log"]
    assert logs[:3] == [f"no_kd/{s}={tmp_path}/plain/multi30k_fr_en/train/{d}/train.log"
                        for s, d in (("1", "no_kd"), ("3", "no_kd-seed3"), ("2", "no_kd-seed2"))]
    assert not any("ckd_rc" in log for log in logs)
    # Without no_kd there is nothing to beat: no summary.
    alone = plan_for(tmp_path / "alone", "multi30k_fr_en", profile="cpu", methods=("word_kd",), student_seeds=(1, 2))
    assert "report-seeds" not in {step.name for step in alone.steps} and "train-word_kd-seed2" in {
        step.name for step in alone.steps}


def test_student_seeds_on_the_command_line(tmp_path, capsys):
    common = ["multi30k_fr_en", "--workdir", str(tmp_path / "w"), "--profile", "cpu", "--methods", "no_kd",
              "--dry-run", "--data", str(tmp_path / "absent")]
    with pytest.raises(SystemExit):
        recipe_cli.cli_main([*common, "--student-seeds", "1,two"])
    assert "--student-seeds: expected seeds separated by commas (1,2,3), got '1,two'" in capsys.readouterr().err


def test_the_multi30k_benchmark_runs_ckd_against_no_kd_2l_and_tinybert_and_alp_at_their_chosen_weights(tmp_path):
    plan = plan_for(tmp_path, "multi30k_fr_en", profile="cpu")
    assert {"no_kd_2l", "ckd_rc"} <= {method.name for method in plan.methods}
    tinybert = parse_training_command(plan.step("train-tinybert").commands[0])
    assert (tinybert.tinybert_att_weight, tinybert.tinybert_hidden_weight, tinybert.tinybert_emb_weight) == (0.1, 0.1, 0.1)
    assert parse_training_command(plan.step("train-alp_kd").commands[0]).layer_weight == 0.1
    ckd = parse_training_command(plan.step("train-ckd_rc").commands[0])
    assert ckd.ckd_map_side == "student" and ckd.encoder_layers == 2
