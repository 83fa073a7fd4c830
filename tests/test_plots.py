"""Plots: the PNG is written and the Figure has the expected panels, ticks and boundary lines;
fairseq training logs are parsed in both formats, including lines produced by fairseq's own
progress bar (the reference for the format)."""
import io
import json
import logging
from collections import OrderedDict

import numpy as np
import pytest

from fairseq_kd.cli import plot as plot_cli
from fairseq_kd.figures.draw import (
    plot_alignment_heatmaps,
    plot_alp_weights,
    plot_run_comparison,
    plot_training_curves,
)
from fairseq_kd.figures.training_log import parse_fairseq_log, validation_series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def image_panels(figure):
    """Axes that hold an image (the heatmaps), leaving out colour bars."""
    return [axes for axes in figure.axes if axes.images]


def alignment_data(seed=0):
    rng = np.random.default_rng(seed)
    sizes = {
        "encoder_self": (3, 4, 6, 4),
        "decoder_self": (3, 8, 6, 4),
        "decoder_cross": (2, 4, 6, 2),
    }
    return {
        kind: {
            "weights": rng.normal(size=(m * hs, n * ht)).tolist(),
            "student_layers": m,
            "student_heads": hs,
            "teacher_layers": n,
            "teacher_heads": ht,
        }
        for kind, (m, hs, n, ht) in sizes.items()
    }


def test_alignment_heatmaps_panels_ticks_and_layer_lines():
    data = alignment_data()
    figure = plot_alignment_heatmaps(data)
    panels = image_panels(figure)
    assert len(panels) == 3
    for panel, (kind, entry) in zip(panels, data.items()):
        m, hs, n, ht = (entry[k] for k in ("student_layers", "student_heads", "teacher_layers", "teacher_heads"))
        assert panel.images[0].get_array().shape == (m * hs, n * ht)
        y_labels = [label.get_text() for label in panel.get_yticklabels()]
        x_labels = [label.get_text() for label in panel.get_xticklabels()]
        assert y_labels[0] == "1.1" and y_labels[-1] == f"{m}.{hs}" and len(y_labels) == m * hs
        assert x_labels[1] == "1.2" and x_labels[-1] == f"{n}.{ht}" and len(x_labels) == n * ht
        # axhline/axvline: one line per inner layer boundary, at the boundary between maps
        horizontal = sorted(line.get_ydata()[0] for line in panel.lines if line.get_ydata()[0] == line.get_ydata()[1])
        vertical = sorted(line.get_xdata()[0] for line in panel.lines if line.get_xdata()[0] == line.get_xdata()[1])
        assert horizontal == [layer * hs - 0.5 for layer in range(1, m)]
        assert vertical == [layer * ht - 0.5 for layer in range(1, n)]
    # signed weights: diverging colour scale symmetric around 0
    low, high = panels[0].images[0].get_clim()
    assert low == -high


def test_alignment_heatmaps_reject_wrong_shapes():
    data = alignment_data()
    entry = data["encoder_self"]
    entry["weights"] = np.array(entry["weights"]).T.tolist()
    with pytest.raises(ValueError, match="transposed"):
        plot_alignment_heatmaps(data)
    with pytest.raises(ValueError, match="student_heads must be a positive integer"):
        plot_alignment_heatmaps({"encoder_self": {"weights": [[1.0]], "student_layers": 1, "teacher_layers": 1, "teacher_heads": 1}})


def test_alp_weights_one_panel_per_side_with_values():
    encoder = np.full((3, 6), 1 / 6).tolist()
    decoder = [[0.5, 0.5, 0, 0, 0, 0], [0, 0, 0.5, 0.5, 0, 0], [0, 0, 0, 0, 0.25, 0.75]]
    figure = plot_alp_weights({"encoder": encoder, "decoder": decoder})
    panels = image_panels(figure)
    assert len(panels) == 2
    assert [panel.get_title() for panel in panels] == ["ALP-KD weights: encoder", "ALP-KD weights: decoder"]
    assert len(panels[1].texts) == 18 and "0.75" in [text.get_text() for text in panels[1].texts]
    assert panels[0].images[0].get_array().shape == (3, 6)
    with pytest.raises(ValueError, match="rectangular|2-D"):
        plot_alp_weights({"encoder": [[0.5, 0.5], [1.0]]})


# --------------------------------------------------------------------------- training logs

# The formats of fairseq 0.12's JsonProgressBar and SimpleProgressBar, as fairseq_cli/train.py logs
# them (timestamp | level | tag | message); the --log-file copy carries the bare message.
JSON_LOG = """\
2024-05-01 10:00:00 | INFO | fairseq_cli.train | begin training epoch 1
2024-05-01 10:00:01 | INFO | train_inner | {"epoch": 1, "update": 0.5, "loss": "9.100", "nll_loss": "8.9", "kd_loss": "2.5", "ppl": "477", "num_updates": "100", "lr": "0.0001"}
2024-05-01 10:00:02 | INFO | train_inner | {"epoch": 1, "update": 1.0, "loss": "8.700", "nll_loss": "8.5", "kd_loss": "2.1", "ppl": "362", "num_updates": "200", "lr": "0.0002"}
2024-05-01 10:00:03 | INFO | train | {"epoch": 1, "train_loss": "8.9", "train_nll_loss": "8.7", "train_kd_loss": "2.3", "train_num_updates": "200", "train_wall": "5"}
2024-05-01 10:00:04 | INFO | valid | {"epoch": 1, "valid_loss": "8.2", "valid_nll_loss": "8", "valid_kd_loss": "1.9", "valid_num_updates": "200", "valid_best_loss": "8.2"}
{"epoch": 2, "update": 1.5, "loss": "8.300", "nll_loss": "8.1", "kd_loss": "1.8", "ppl": "274", "num_updates": "300", "lr": "0.0003"}
"""

SIMPLE_LOG = """\
2024-05-01 10:00:01 | INFO | train_inner | epoch 001:    100 / 200 loss=9.100, nll_loss=8.9, kd_loss=2.5, ppl=477, num_updates=100, lr=0.0001
2024-05-01 10:00:02 | INFO | train_inner | epoch 001:    200 / 200 loss=8.700, nll_loss=8.5, kd_loss=2.1, ppl=362, num_updates=200, lr=0.0002
2024-05-01 10:00:03 | INFO | train | epoch 001 | loss 8.9 | nll_loss 8.7 | kd_loss 2.3 | num_updates 200 | wall 5
2024-05-01 10:00:04 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 8.2 | nll_loss 8 | kd_loss 1.9 | num_updates 200 | best_loss 8.2
2024-05-01 10:00:05 | INFO | fairseq.checkpoint_utils | Saved checkpoint checkpoint1.pt (epoch 1 @ 200 updates, score 8.2)
epoch 002:    100 / 200 loss=8.300, nll_loss=8.1, kd_loss=1.8, ppl=274, num_updates=300, lr=0.0003
"""


@pytest.mark.parametrize("log", [JSON_LOG, SIMPLE_LOG], ids=["json", "simple"])
def test_parse_fairseq_log_both_formats(log):
    records = parse_fairseq_log(log.splitlines())
    assert [(r.split, r.epoch, r.num_updates) for r in records] == [
        ("train_inner", 1, 100), ("train_inner", 1, 200), ("train", 1, 200), ("valid", 1, 200), ("train_inner", 2, 300),
    ]
    assert records[0].values["loss"] == 9.1 and records[0].values["kd_loss"] == 2.5
    assert records[2].values == {"loss": 8.9, "nll_loss": 8.7, "kd_loss": 2.3, "wall": 5.0}
    assert records[3].values["best_loss"] == 8.2 and records[3].values["nll_loss"] == 8.0
    # how far training is, in epochs (what the recipe's bar estimates a --max-epoch run's length from)
    assert [r.epochs_done for r in records] == [0.5, 1.0, None, None, 1.5]


def test_parse_log_lines_made_by_fairseqs_progress_bar():
    """The formats above, checked against fairseq's own progress bars."""
    progress_bar = pytest.importorskip("fairseq.logging.progress_bar", reason="fairseq not installed")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s", "%Y-%m-%d %H:%M:%S"))
    bar_logger = progress_bar.logger
    bar_logger.addHandler(handler)
    old_level = bar_logger.level
    bar_logger.setLevel(logging.INFO)
    try:
        for log_format in ("json", "simple"):
            bar = progress_bar.progress_bar(list(range(4)), log_format=log_format, log_interval=2, epoch=3)
            for step, _ in enumerate(bar, start=1):
                bar.log(OrderedDict(loss=5.0 - step, a2d_loss=0.5 * step, num_updates=40 + step), tag="train_inner", step=40 + step)
            bar.print(OrderedDict(loss=3.5, a2d_loss=1.1, num_updates=44), tag="train", step=44)
            valid = progress_bar.progress_bar([0], log_format=log_format, epoch=3, prefix="valid on 'valid' subset")
            valid.print(OrderedDict(loss=3.2, a2d_loss=0.9, num_updates=44, best_loss=3.2), tag="valid", step=44)
    finally:
        bar_logger.removeHandler(handler)
        bar_logger.setLevel(old_level)
    records = parse_fairseq_log(stream.getvalue().splitlines())
    expected = [("train_inner", 42, 3.0, 1.0), ("train_inner", 44, 1.0, 2.0), ("train", 44, 3.5, 1.1), ("valid", 44, 3.2, 0.9)]
    assert [(r.split, r.num_updates, r.values["loss"], r.values["a2d_loss"]) for r in records] == expected * 2
    assert all(r.epoch == 3 for r in records)


def test_training_curves_one_panel_per_loss_key():
    records = parse_fairseq_log(JSON_LOG.splitlines())
    figure = plot_training_curves(records)
    assert [axes.get_title() for axes in figure.axes] == ["kd_loss", "loss", "nll_loss"]  # no best_loss
    loss_panel = figure.axes[1]
    assert sorted(line.get_label() for line in loss_panel.lines) == ["train", "train_inner", "valid"]
    inner = next(line for line in loss_panel.lines if line.get_label() == "train_inner")
    assert list(inner.get_xdata()) == [100, 200, 300] and list(inner.get_ydata()) == [9.1, 8.7, 8.3]
    with_extra = plot_training_curves(records, extra_keys=["ppl", "lr"], columns=2)
    assert [axes.get_title() for axes in with_extra.axes] == ["kd_loss", "loss", "nll_loss", "ppl", "lr"]
    with pytest.raises(ValueError, match="--keys gnorm"):
        plot_training_curves(records, extra_keys=["gnorm"])


def valid_line(epoch, updates, nll):
    return json.dumps({"epoch": epoch, "valid_loss": nll + 1, "valid_nll_loss": nll, "valid_num_updates": updates})


def test_run_comparison_one_line_per_run_without_the_log_files_repeats():
    # fairseq's --log-file writes the k-th validation line k times (measured): the series keeps one.
    no_kd = [valid_line(1, 100, 5.0), valid_line(1, 100, 5.0), valid_line(2, 200, 4.5)]
    no_kd = parse_fairseq_log(no_kd + [valid_line(2, 200, 4.5), valid_line(2, 200, 4.5)])
    word_kd = parse_fairseq_log([valid_line(1, 100, 4.8), valid_line(2, 200, 4.1)])
    assert validation_series(no_kd, "nll_loss") == [(100, 5.0), (200, 4.5)]
    figure = plot_run_comparison({"no_kd": no_kd, "word_kd": word_kd})
    (axes,) = figure.axes
    assert [line.get_label() for line in axes.lines] == ["no_kd", "word_kd"]
    assert list(axes.lines[1].get_ydata()) == [4.8, 4.1] and axes.get_title() == "valid nll_loss"
    train_only = parse_fairseq_log([json.dumps({"epoch": 1, "update": 0.5, "loss": 3.0, "num_updates": 50})])
    with pytest.raises(ValueError, match="run 'x': its log has no valid nll_loss"):
        plot_run_comparison({"x": train_only})


def colour_bar_labels(figure):
    """The labels of the colour bars (the axes without an image that are not the panels)."""
    return [axes.get_ylabel() for axes in figure.axes if not axes.images]


def test_figures_say_their_units_colour_bars_and_titles():
    """fairseq logs its losses per target token divided by ln 2: nll and KL terms are bits."""
    no_kd = parse_fairseq_log([valid_line(1, 100, 5.0), valid_line(2, 200, 4.5)])
    comparison = plot_run_comparison({"no_kd": no_kd}, title="valid nll_loss: no_kd")
    assert comparison.axes[0].get_ylabel() == "valid nll_loss (bits per target token)"
    assert comparison.get_suptitle() == "valid nll_loss: no_kd"
    curves = plot_training_curves(parse_fairseq_log(JSON_LOG.splitlines()), extra_keys=["ppl", "lr"], title="run")
    assert [axes.get_ylabel() for axes in curves.axes] == [
        "kd_loss (bits per target token)", "loss (per target token, / ln 2)", "nll_loss (bits per target token)",
        "perplexity (2^nll_loss)", "learning rate"]
    assert curves.get_suptitle() == "run"
    heatmaps = plot_alignment_heatmaps(alignment_data(), title="A2D")
    assert colour_bar_labels(heatmaps) == ["alignment weight (teacher map -> student map)"] * 3
    assert heatmaps.get_suptitle() == "A2D"
    alp = plot_alp_weights({"encoder": [[0.5, 0.5]]})
    assert colour_bar_labels(alp) == ["attention weight alpha_jk (rows sum to 1)"] and alp.get_suptitle() == ""


def test_the_command_titles_each_figure_with_what_it_shows(tmp_path, monkeypatch):
    from fairseq_kd.figures import draw

    drawn = []
    monkeypatch.setattr(draw, "save_figure", lambda figure, path, dpi=150: drawn.append(figure))
    alignment = tmp_path / "aam.json"
    alignment.write_text(json.dumps(alignment_data()))
    log = tmp_path / "word_kd" / "train.log"
    log.parent.mkdir()
    log.write_text(JSON_LOG)
    run_plot("alignment", "--input", alignment, "--output", tmp_path / "a.png")
    run_plot("curves", "--log", log, "--output", tmp_path / "c.png")
    run_plot("compare", "--log", f"no_kd={log}", "--log", f"word_kd={log}", "--output", tmp_path / "v.png")
    run_plot("curves", "--log", log, "--output", tmp_path / "t.png", "--title", "mine")
    assert [figure.get_suptitle() for figure in drawn] == [
        f"Align-to-Distill alignment weights: {tmp_path.name}/aam.json", "Training curves of word_kd",
        "valid nll_loss: no_kd, word_kd", "mine"]
    assert not any(str(tmp_path) in figure.get_suptitle() for figure in drawn)  # shareable: no machine path
    assert drawn[2].axes[0].get_ylabel() == "valid nll_loss (bits per target token)"


# --------------------------------------------------------------------------- the command


def run_plot(*argv):
    plot_cli.cli_main([str(a) for a in argv])


def test_cli_writes_pngs(tmp_path):
    alignment = tmp_path / "aam.json"
    alignment.write_text(json.dumps(alignment_data()))
    alp = tmp_path / "alp.json"
    alp.write_text(json.dumps({"encoder": [[0.2, 0.8], [0.6, 0.4]]}))
    log = tmp_path / "train.log"
    log.write_text(SIMPLE_LOG)
    for command, flag, source in (("alignment", "--input", alignment), ("alp", "--input", alp), ("curves", "--log", log),
                                  ("compare", "--log", f"a={log}")):
        output = tmp_path / "figs" / f"{command}.png"
        run_plot(command, flag, source, "--output", output)
        assert output.read_bytes()[:8] == PNG_MAGIC


def test_cli_errors(tmp_path, capsys):
    existing = tmp_path / "exists.png"
    existing.write_bytes(b"keep")
    log = tmp_path / "train.log"
    log.write_text("no statistics here\n")
    cases = [
        (["curves", "--log", log, "--output", existing], "--overwrite"),
        (["curves", "--log", log, "--output", tmp_path / "a.pdf"], ".png"),
        (["curves", "--log", log, "--output", tmp_path / "a.png"], "no fairseq statistics lines"),
        (["curves", "--log", tmp_path / "absent.log", "--output", tmp_path / "a.png"], "absent.log"),
        (["alp", "--input", log, "--output", tmp_path / "a.png"], "not valid JSON"),
    ]
    for argv, fragment in cases:
        with pytest.raises(SystemExit) as raised:
            run_plot(*argv)
        assert raised.value.code == 2
        assert fragment in capsys.readouterr().err
    assert existing.read_bytes() == b"keep"


# ------------------------------------------------ figures drawn straight from a training checkpoint


def save_training_checkpoint(path, criterion_parameters=None, task_criterion_state=None):
    """A fairseq-train checkpoint reduced to the entries fairseq's loader and the figures read:
    the criterion's parameters (``criterion``) and the task's extra state (``TranslationKDTask``)."""
    torch = pytest.importorskip("torch")
    state = {
        "model": {}, "cfg": None, "criterion": criterion_parameters or {},
        "optimizer_history": [{"criterion_name": "kd", "optimizer_name": "adam", "lr_scheduler_state": {"best": None},
                               "num_updates": 3}],
        "extra_state": {"train_iterator": {"epoch": 1}, "TranslationKDTask": {"criterion": task_criterion_state or {}}},
    }
    torch.save(state, path)
    return path


def test_cli_alignment_from_checkpoint_draws_and_writes_the_mixture_coefficients(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("fairseq")
    from fairseq_kd.modules.attention_alignment import AttentionAlignment

    generator = torch.Generator().manual_seed(0)
    modules = {"encoder_self": AttentionAlignment(2, 3, 4, 2, combination="mixture"),
               "decoder_cross": AttentionAlignment(1, 2, 2, 2, combination="mixture")}
    parameters = {}
    for kind, module in modules.items():
        module.weight.data = torch.randn(module.weight.shape, generator=generator)
        parameters.update({f"alignments.{kind}.{key}": value for key, value in module.state_dict().items()})
    checkpoint = save_training_checkpoint(tmp_path / "checkpoint_last.pt", criterion_parameters=parameters)

    weights_json, figure = tmp_path / "out" / "aam.json", tmp_path / "out" / "aam.png"
    run_plot("alignment", "--checkpoint", checkpoint, "--output", figure, "--weights-output", weights_json)
    assert figure.read_bytes()[:8] == PNG_MAGIC
    written = json.loads(weights_json.read_text())
    assert set(written) == set(modules)
    for kind, module in modules.items():
        # rows = student maps: the softmax over student maps (Eq. 9's mixture), transposed
        expected = torch.softmax(module.weight.detach(), dim=1).t()
        assert torch.allclose(torch.tensor(written[kind]["weights"]), expected, atol=1e-6)
        assert [written[kind][key] for key in ("student_layers", "student_heads", "teacher_layers", "teacher_heads")] \
            == [module.student_layers, module.student_heads, module.teacher_layers, module.teacher_heads]
    # the JSON is what --input reads
    run_plot("alignment", "--input", weights_json, "--output", tmp_path / "again.png")
    assert (tmp_path / "again.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_alp_from_checkpoint_divides_the_saved_sums_by_the_positions(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("fairseq")
    sums = {"encoder": torch.tensor([[6.0, 4.0, 0.0], [0.0, 1.0, 9.0]], dtype=torch.float64),
            "decoder": torch.tensor([[2.0, 3.0, 5.0], [1.0, 1.0, 8.0]], dtype=torch.float64)}
    positions = {"encoder": torch.tensor(10.0, dtype=torch.float64), "decoder": torch.tensor(10.0, dtype=torch.float64)}
    checkpoint = save_training_checkpoint(
        tmp_path / "checkpoint_last.pt",
        task_criterion_state={"alpha_sums": {"epoch": 1, "sums": {
            **{f"alpha/{side}": total for side, total in sums.items()},
            **{f"positions/{side}": count for side, count in positions.items()}}}})
    weights_json = tmp_path / "alp.json"
    run_plot("alp", "--checkpoint", checkpoint, "--output", tmp_path / "alp.png", "--weights-output", weights_json)
    assert (tmp_path / "alp.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads(weights_json.read_text()) == {"encoder": [[0.6, 0.4, 0.0], [0.0, 0.1, 0.9]],
                                                     "decoder": [[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]}


def test_cli_alp_refuses_a_state_of_another_layout_in_one_line(tmp_path, capsys):
    """A criterion state of another layout (here an older one's alpha_sum) is a checkpoint without
    ALP-KD's current state: refused as such (issue 42 removed the older-format refusals)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fairseq")
    checkpoint = save_training_checkpoint(
        tmp_path / "checkpoint_last.pt",
        task_criterion_state={"alpha_epoch": 1, "alpha_sum": {"encoder": torch.ones(2, 3, dtype=torch.float64)},
                              "alpha_positions": {"encoder": torch.tensor(1.0, dtype=torch.float64)}})
    with pytest.raises(SystemExit) as raised:
        run_plot("alp", "--checkpoint", checkpoint, "--output", tmp_path / "alp.png")
    assert raised.value.code == 2
    assert "--criterion alp_kd" in capsys.readouterr().err and not (tmp_path / "alp.png").exists()


def test_cli_checkpoint_errors_name_the_flag_and_write_nothing(tmp_path, capsys):
    pytest.importorskip("fairseq")
    no_criterion = save_training_checkpoint(tmp_path / "teacher.pt")
    existing = tmp_path / "exists.json"
    existing.write_text("keep")
    cases = [
        (["alignment", "--checkpoint", no_criterion], "--criterion a2d_kd"),
        (["alp", "--checkpoint", no_criterion], "--criterion alp_kd"),
        (["alp", "--checkpoint", tmp_path / "absent.pt"], "absent.pt"),
        (["alp", "--checkpoint", tmp_path], "is a folder"),
        (["alp", "--checkpoint", no_criterion, "--weights-output", existing], "--overwrite"),
        (["alp", "--input", existing, "--weights-output", tmp_path / "w.json"], "--weights-output"),
    ]
    for argv, fragment in cases:
        with pytest.raises(SystemExit) as raised:
            run_plot(*argv, "--output", tmp_path / "figure.png")
        assert raised.value.code == 2
        assert fragment in capsys.readouterr().err
    assert existing.read_text() == "keep"
    assert not (tmp_path / "figure.png").exists() and not (tmp_path / "w.json").exists()
    with pytest.raises(SystemExit):  # --checkpoint and --input are alternatives
        run_plot("alp", "--checkpoint", no_criterion, "--input", existing, "--output", tmp_path / "figure.png")
