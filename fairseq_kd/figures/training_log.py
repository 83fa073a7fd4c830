"""The statistics lines of fairseq-train logs (``--log-format json`` or ``simple``, or a mix, with or
without the logging prefix) as :class:`LogRecord` objects, and the series the figures draw from
them. Imports neither matplotlib, torch nor fairseq (the criterion tests read their logs with it).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import FILE, InputError, require_path


@dataclass
class LogRecord:
    """One statistics line of a fairseq training log.

    ``split``: ``train_inner`` (every ``--log-interval`` updates), ``train`` (end of epoch) or the
    validation subset's name (``valid``). ``values``: numeric statistics with fairseq's
    ``<subset>_`` key prefix removed; ``num_updates`` is the x coordinate of the curves.
    ``epochs_done``: how far training is, in epochs (fairseq's fractional ``update`` of a
    ``train_inner`` line, ``epoch - 1 + batches done / batches per epoch``), where the line says.
    """

    split: str
    epoch: Optional[int]
    num_updates: Optional[float]
    values: Dict[str, float] = field(default_factory=dict)
    epochs_done: Optional[float] = None
    #: statistics whose value was a number but not a finite one (nan, inf), left out of ``values``
    nonfinite: List[str] = field(default_factory=list)


# fairseq_cli/train.py's logging format: "%(asctime)s | %(levelname)s | %(name)s | %(message)s";
# the progress bar renames its logger to the tag (train_inner, train, valid) while it logs.
# Lines written through --log-file carry the bare message.
_LOGGING_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| [A-Z]+ \| [^|]+? \| (?P<message>.*)$")
# SimpleProgressBar.log: "{prefix}:  {i:5d} / {size:d} {key=value, ...}"
_SIMPLE_INNER = re.compile(r"^epoch (?P<epoch>\d+):\s+(?P<step>\d+) / (?P<size>\d+) (?P<stats>.*)$")
# SimpleProgressBar.print: "{prefix} | {key value | ...}", prefix "epoch 001[ | valid on 'x' subset]"
_SIMPLE_EPOCH = re.compile(r"^epoch (?P<epoch>\d+) \| (?P<stats>.*)$")
_VALID_PREFIX = re.compile(r"^valid on '(?P<subset>[^']+)' subset$")


def _number(value) -> Optional[float]:
    """``value`` as a float, nan and infinities included; None for what is no number."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _statistics(pairs) -> Tuple[Dict[str, float], List[str]]:
    """The finite numbers of ``(key, value)`` pairs by key, and the keys of nan and infinite ones."""
    values, nonfinite = {}, []
    for key, value in pairs:
        number = _number(value)
        if number is not None and math.isfinite(number):
            values[key] = number
        elif number is not None:
            nonfinite.append(key)
    return values, nonfinite


def _json_record(message: str) -> Optional[LogRecord]:
    """JsonProgressBar lines: train_inner stats unprefixed (with "update" = fractional epoch);
    end-of-epoch and validation stats prefixed with "<tag>_" (JsonProgressBar.print)."""
    try:
        stats = json.loads(message)
    except json.JSONDecodeError:
        return None
    if not isinstance(stats, dict):
        return None
    epoch = stats.get("epoch")
    if "num_updates" in stats:
        split, prefix = "train_inner", ""
    else:
        prefixed = [key for key in stats if key.endswith("_num_updates")]
        if not prefixed:
            return None
        prefix = prefixed[0][: -len("num_updates")]
        split = prefix[:-1]
    values, nonfinite = _statistics((key[len(prefix):], value) for key, value in stats.items()
                                    if key.startswith(prefix) and key not in ("epoch", "update"))
    update = _number(stats.get("update")) if split == "train_inner" else None
    return LogRecord(split, epoch if isinstance(epoch, int) else None, values.pop("num_updates", None), values,
                     update if update is not None and math.isfinite(update) else None, nonfinite)


def _simple_record(message: str) -> Optional[LogRecord]:
    match = _SIMPLE_INNER.match(message)
    epochs_done = None
    if match:
        pairs = [item.split("=", 1) for item in match.group("stats").split(", ")]
        split = "train_inner"
        if int(match.group("size")) > 0:
            epochs_done = int(match.group("epoch")) - 1 + int(match.group("step")) / int(match.group("size"))
    else:
        match = _SIMPLE_EPOCH.match(message)
        if not match:
            return None
        segments = match.group("stats").split(" | ")
        split = "train"
        subset = _VALID_PREFIX.match(segments[0])
        if subset:
            split = subset.group("subset")
            segments = segments[1:]
        pairs = [segment.split(" ", 1) for segment in segments]
    values, nonfinite = _statistics((pair[0].strip(), pair[1].strip()) for pair in pairs if len(pair) == 2)
    if not values and not nonfinite:
        return None
    return LogRecord(split, int(match.group("epoch")), values.pop("num_updates", None), values, epochs_done,
                     nonfinite)


def parse_fairseq_log(lines: Iterable[str]) -> List[LogRecord]:
    """Statistics lines of a fairseq-train log in ``json`` or ``simple`` format (or a mix), in
    file order; every other line is skipped."""
    records = []
    for line in lines:
        line = line.rstrip("\r\n")
        prefix = _LOGGING_PREFIX.match(line)
        message = (prefix.group("message") if prefix else line).strip()
        record = _json_record(message) if message.startswith("{") else _simple_record(message)
        if record is not None:
            records.append(record)
    return records


def read_fairseq_log(path: Path) -> List[LogRecord]:
    path = require_path(path, "training log", FILE)
    with open(path, encoding="utf-8", errors="replace") as handle:
        records = parse_fairseq_log(handle)
    if not records:
        raise InputError(f"{path}: no fairseq statistics lines found (expected fairseq-train output with "
                         "--log-format json or simple)")
    return records


def curve_keys(records: Sequence[LogRecord], extra_keys: Sequence[str] = ()) -> List[str]:
    """Every numeric statistic whose name ends in ``loss`` (without ``best_loss``, the running
    minimum of the validation loss, not a loss term), then ``extra_keys`` in the order given."""
    keys = []
    for record in records:
        for key in record.values:
            if key.endswith("loss") and not key.startswith("best_") and key not in keys:
                keys.append(key)
    keys.sort()
    for key in extra_keys:
        if key not in keys:
            keys.append(key)
    return keys


def validation_series(records: Sequence[LogRecord], key: str, split: str = "valid") -> List[tuple]:
    """``(update, value)`` of ``key`` in the ``split`` lines, one per update, in update order.

    fairseq's ``--log-file`` repeats earlier validation lines (the k-th validation's line k times,
    measured here); a repeated update keeps its last value, so the series is what was measured."""
    points = {}
    for record in records:
        if record.split == split and record.num_updates is not None and key in record.values:
            points[record.num_updates] = record.values[key]
    return sorted(points.items())
