"""The figures, drawn with matplotlib's object-oriented API (a ``Figure``, no pyplot, no global
backend), each returned so that callers and tests can inspect its axes; ``docs/design/figures.md``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure

from ..errors import InputError
from .training_log import LogRecord, curve_keys, validation_series

ATTENTION_KIND_TITLES = {"encoder_self": "Encoder self-attention", "decoder_self": "Decoder self-attention",
                         "decoder_cross": "Decoder cross-attention"}


#: statistics of fairseq's logs that are not losses, and their y-axis labels
STATISTIC_LABELS = {"ppl": "perplexity (2^nll_loss)", "lr": "learning rate", "gnorm": "gradient norm (L2)",
                    "clip": "clipped updates (%)", "loss_scale": "fp16 loss scale", "wps": "target tokens per second",
                    "ups": "updates per second", "wpb": "target tokens per batch", "bsz": "sentences per batch",
                    "wall": "wall-clock time (s)", "train_wall": "training time (s)", "bleu": "BLEU",
                    "accuracy": "accuracy (%)"}
#: the logged losses that are log-likelihoods or KL divergences, so in bits once divided by ln 2
_BITS = ("nll_loss", "ce_loss")
_BITS_ENDINGS = ("kd_loss", "kl_loss", "_att_loss", "value_relation_loss")


def statistic_label(key: str) -> str:
    """The y-axis label of a statistic of fairseq's log, with its unit (losses are logged per
    target token divided by ln 2: bits for log-likelihoods and KL terms only)."""
    if key in STATISTIC_LABELS:
        return STATISTIC_LABELS[key]
    if key in _BITS or key.endswith(_BITS_ENDINGS):
        return f"{key} (bits per target token)"
    if key.endswith("loss"):
        return f"{key} (per target token, / ln 2)"
    return key


def _titled(figure: Figure, title: Optional[str]) -> Figure:
    if title:
        figure.suptitle(title)
    return figure


def save_figure(figure: Figure, path: Path, dpi: int = 150) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


def _finite_matrix(values, what: str) -> np.ndarray:
    try:
        matrix = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{what}: expected a rectangular list of lists of numbers") from None
    if matrix.ndim != 2 or matrix.size == 0:
        raise InputError(f"{what}: expected a non-empty 2-D list of numbers, got shape {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        raise InputError(f"{what}: contains NaN or infinite values")
    return matrix


def _map_labels(layers: int, heads: int) -> List[str]:
    """``layer.head`` (1-based) for each attention map, in layer-major order."""
    return [f"{layer}.{head}" for layer in range(1, layers + 1) for head in range(1, heads + 1)]


def _positive_int(entry: Dict, key: str, kind: str) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"alignment weights, kind {kind!r}: {key} must be a positive integer, got {value!r}")
    return value


def plot_alignment_heatmaps(alignments: Dict[str, Dict], title: Optional[str] = None) -> Figure:
    """One heatmap per attention kind of Align-to-Distill's alignment weights: ``alignments[kind]``
    holds the four sizes and ``weights`` of shape ``(student_layers * student_heads, teacher_layers *
    teacher_heads)``, maps layer-major (heads = 1 for the layer-wise variant). Signed weights get a
    diverging colour scale centred on 0."""
    if not isinstance(alignments, dict) or not alignments:
        raise InputError('alignment weights: expected {"encoder_self": {"weights": [[...]], "student_layers": m, '
                         '"student_heads": hs, "teacher_layers": n, "teacher_heads": ht}, ...}')
    checked = {}
    for kind, entry in alignments.items():
        if not isinstance(entry, dict) or "weights" not in entry:
            raise InputError(f"alignment weights, kind {kind!r}: expected an object with 'weights'")
        sizes = {key: _positive_int(entry, key, kind)
                 for key in ("student_layers", "student_heads", "teacher_layers", "teacher_heads")}
        weights = _finite_matrix(entry["weights"], f"alignment weights, kind {kind!r}")
        expected = (sizes["student_layers"] * sizes["student_heads"],
                    sizes["teacher_layers"] * sizes["teacher_heads"])
        if weights.shape != expected:
            hint = " (transposed? rows must be student maps)" if weights.shape == expected[::-1] else ""
            raise InputError(f"alignment weights, kind {kind!r}: shape {weights.shape} but the sizes give "
                             f"{expected} = (student_layers*student_heads, teacher_layers*teacher_heads){hint}")
        checked[kind] = (weights, sizes)

    figure = Figure(figsize=(5.2 * len(checked), 4.6), layout="constrained")
    for index, (kind, (weights, sizes)) in enumerate(checked.items()):
        axes = figure.add_subplot(1, len(checked), index + 1)
        if weights.min() < 0 < weights.max():
            limit = float(np.abs(weights).max())
            image = axes.imshow(weights, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
        else:
            image = axes.imshow(weights, cmap="viridis", aspect="auto", interpolation="nearest")
        figure.colorbar(image, ax=axes, shrink=0.85, label="alignment weight (teacher map -> student map)")
        for boundary in range(1, sizes["student_layers"]):
            axes.axhline(boundary * sizes["student_heads"] - 0.5, color="black", linewidth=0.8)
        for boundary in range(1, sizes["teacher_layers"]):
            axes.axvline(boundary * sizes["teacher_heads"] - 0.5, color="black", linewidth=0.8)
        student_labels = _map_labels(sizes["student_layers"], sizes["student_heads"])
        teacher_labels = _map_labels(sizes["teacher_layers"], sizes["teacher_heads"])
        font = max(4, min(8, int(160 / max(len(student_labels), len(teacher_labels)))))
        axes.set_yticks(range(len(student_labels)), student_labels, fontsize=font)
        axes.set_xticks(range(len(teacher_labels)), teacher_labels, fontsize=font, rotation=90)
        axes.set_ylabel("student map (layer.head)")
        axes.set_xlabel("teacher map (layer.head)")
        axes.set_title(ATTENTION_KIND_TITLES.get(kind, kind.replace("_", " ")))
    return _titled(figure, title)


def plot_alp_weights(weights_by_side: Dict[str, Sequence[Sequence[float]]], title: Optional[str] = None) -> Figure:
    """ALP-KD attention weights, one panel per side: row ``j`` holds student layer ``j``'s weights
    ``alpha_jk`` over teacher layers ``k`` (rows sum to 1 is not enforced: averaged weights too)."""
    if not isinstance(weights_by_side, dict) or not weights_by_side:
        raise InputError('ALP-KD weights: expected {"encoder": [[weights over teacher layers] per student '
                         'layer], "decoder": ...}')
    matrices = {side: _finite_matrix(values, f"ALP-KD weights, side {side!r}")
                for side, values in weights_by_side.items()}
    figure = Figure(figsize=(4.8 * len(matrices), 3.8), layout="constrained")
    for index, (side, matrix) in enumerate(matrices.items()):
        axes = figure.add_subplot(1, len(matrices), index + 1)
        image = axes.imshow(matrix, cmap="Blues", vmin=0.0, vmax=max(1.0, float(matrix.max())), aspect="auto", interpolation="nearest")
        figure.colorbar(image, ax=axes, shrink=0.85, label="attention weight alpha_jk (rows sum to 1)")
        student_layers, teacher_layers = matrix.shape
        axes.set_yticks(range(student_layers), [str(j) for j in range(1, student_layers + 1)])
        axes.set_xticks(range(teacher_layers), [str(k) for k in range(1, teacher_layers + 1)])
        axes.set_ylabel("student layer")
        axes.set_xlabel("teacher layer")
        axes.set_title(f"ALP-KD weights: {side}")
        if matrix.size <= 144:
            for row in range(student_layers):
                for column in range(teacher_layers):
                    value = matrix[row, column]
                    axes.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=7,
                              color="white" if value > 0.6 else "black")
    return _titled(figure, title)


# --------------------------------------------------------------------------- training logs


SPLIT_STYLES = {"train_inner": {"linewidth": 1.0, "alpha": 0.8},
                "train": {"marker": "o", "markersize": 3, "linewidth": 1.2}}


def plot_training_curves(
    records: Sequence[LogRecord], extra_keys: Sequence[str] = (), columns: int = 3, title: Optional[str] = None
) -> Figure:
    """One panel per statistic (:func:`curve_keys`), each with a curve per split, against the
    update number. Raises if an ``extra_keys`` entry never occurs, or if nothing is plottable."""
    records = [record for record in records if record.num_updates is not None]
    present = {key for record in records for key in record.values}
    missing = [key for key in extra_keys if key not in present]
    if missing:
        raise InputError(
            f"--keys {', '.join(missing)}: not in the log; it has {', '.join(sorted(present)) or 'no statistics'}")
    keys = curve_keys(records, extra_keys)
    if not keys:
        raise InputError("the log has no statistic ending in 'loss'; name some with --keys")
    splits = list(dict.fromkeys(record.split for record in records))
    columns = max(1, min(columns, len(keys)))
    rows = math.ceil(len(keys) / columns)
    figure = Figure(figsize=(4.4 * columns, 3.2 * rows), layout="constrained")
    for index, key in enumerate(keys):
        axes = figure.add_subplot(rows, columns, index + 1)
        for split in splits:
            points = [(record.num_updates, record.values[key])
                      for record in records
                      if record.split == split and key in record.values]
            if points:
                x, y = zip(*points)
                style = SPLIT_STYLES.get(split, {"marker": "s", "markersize": 3, "linewidth": 1.2})
                axes.plot(x, y, label=split, **style)
        axes.set_title(key)
        axes.set_xlabel("update")
        axes.set_ylabel(statistic_label(key), fontsize=8)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    return _titled(figure, title)


def plot_run_comparison(runs: Dict[str, Sequence[LogRecord]], key: str = "nll_loss", split: str = "valid",
                        title: Optional[str] = None) -> Figure:
    """One statistic of several training runs on one axis against updates; raises naming a run
    without that statistic."""
    if not runs:
        raise InputError("no runs given")
    figure = Figure(figsize=(6.4, 4.2), layout="constrained")
    axes = figure.add_subplot(1, 1, 1)
    for name, records in runs.items():
        series = validation_series(records, key, split)
        if not series:
            raise InputError(f"run {name!r}: its log has no {split} {key} (was validation on? "
                             f"--log-format json or simple)")
        x, y = zip(*series)
        axes.plot(x, y, marker="o", markersize=3, linewidth=1.4, label=name)
    axes.set_title(f"{split} {key}")
    axes.set_xlabel("update")
    axes.set_ylabel(f"{split} {statistic_label(key)}")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    return _titled(figure, title)
