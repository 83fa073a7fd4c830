"""A small step runner: each step runs once, and again only when what it consumed has changed.

A :class:`Step` declares its input files, its output files and its parameters. After the step
succeeds, :class:`StepRunner` writes a stamp ``<stamp_dir>/<step name>.json`` holding the sha256,
size and modification time of every input and output (:mod:`fairseq_kd.fingerprint`, the one
scheme of every resumable record) and the parameters. On the next run the step is skipped when the stamp exists, the
parameters are equal, every input still has the recorded sha256 and every output still exists with
the recorded content. Checksums are recomputed only for files whose size or modification time
changed, so checking a finished pipeline is cheap even for gigabyte-sized corpora.

Because outputs of one step are inputs of the next, a changed upstream file re-runs exactly the
steps that depend on it.  A step that is interrupted leaves no stamp and runs again.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from fairseq_kd.fingerprint import content, fingerprint, read_json, write_json

from .errors import PrepareError

LOG = logging.getLogger(__name__)


@dataclass
class Step:
    """One unit of work: ``action()`` reads ``inputs`` and writes ``outputs``.

    ``params`` holds every setting that changes the outputs (a number of merges, a vocabulary
    size, ...); it must be JSON-serialisable.  Outputs may be files or folders.
    """

    name: str
    action: Callable[[], Any]
    inputs: Sequence[Path] = ()
    outputs: Sequence[Path] = ()
    params: Mapping[str, Any] = field(default_factory=dict)


class StepRunner:
    """Run :class:`Step` objects, skipping those whose stamp is still valid.

    ``force=True`` ignores stamps (every step runs).  ``executed`` and ``skipped`` list step names
    in the order they were seen, for logs and tests.
    """

    def __init__(self, stamp_dir: Path, force: bool = False) -> None:
        self.stamp_dir = Path(stamp_dir)
        self.force = force
        self.executed: list[str] = []
        self.skipped: list[str] = []
        # Fingerprints computed during this run, so an output hashed for one stamp is not
        # hashed again when the next step records it as an input.
        self._known: dict[str, dict[str, Any]] = {}

    def stamp_path(self, name: str) -> Path:
        return self.stamp_dir / f"{name}.json"

    def is_done(self, step: Step) -> bool:
        """Whether ``step``'s stamp is present and still matches its inputs, outputs and params."""
        stamp = self._read_stamp(step.name)
        if stamp is None or self.force:
            return False
        if stamp.get("params") != _json_roundtrip(step.params):
            return False
        for group, paths in (("inputs", step.inputs), ("outputs", step.outputs)):
            recorded = stamp.get(group, {})
            if sorted(recorded) != sorted(str(Path(p).resolve()) for p in paths):
                return False
            for path in paths:
                path = Path(path)
                if not path.exists():
                    return False
                previous = recorded[str(path.resolve())]
                if content(self._fingerprint(path, previous)) != content(previous):
                    return False
        return True

    def run(self, step: Step) -> bool:
        """Run ``step`` unless it is done; return whether it ran."""
        if self.is_done(step):
            LOG.info("[%s] up to date, skipped", step.name)
            self.skipped.append(step.name)
            return False
        missing = [str(p) for p in step.inputs if not Path(p).exists()]
        if missing:
            raise PrepareError(f"step {step.name}: input file(s) missing: {', '.join(missing)}")
        self.stamp_path(step.name).unlink(missing_ok=True)
        LOG.info("[%s] running", step.name)
        started = time.monotonic()
        step.action()
        absent = [str(p) for p in step.outputs if not Path(p).exists()]
        if absent:
            raise PrepareError(f"step {step.name} finished without writing: {', '.join(absent)}")
        self._write_stamp(step)
        LOG.info("[%s] done in %.1f s", step.name, time.monotonic() - started)
        self.executed.append(step.name)
        return True

    def recorded_outputs(self, name: str) -> list[Path]:
        """The outputs the stamp of step ``name`` records (empty without a stamp)."""
        stamp = self._read_stamp(name)
        return [Path(path) for path in (stamp or {}).get("outputs", {})]

    def _fingerprint(self, path: Path, recorded: Mapping[str, Any] | None = None) -> dict[str, Any]:
        key = str(path.resolve())
        recorded_now = fingerprint(path, recorded or self._known.get(key))
        self._known[key] = recorded_now
        return recorded_now

    def _read_stamp(self, name: str) -> dict | None:
        return read_json(self.stamp_path(name))

    def _write_stamp(self, step: Step) -> None:
        stamp = {
            "step": step.name,
            "params": _json_roundtrip(step.params),
            "inputs": {str(Path(p).resolve()): self._fingerprint(Path(p)) for p in step.inputs},
            "outputs": {str(Path(p).resolve()): self._fingerprint(Path(p)) for p in step.outputs},
        }
        write_json(self.stamp_path(step.name), stamp)


def _json_roundtrip(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, sort_keys=True))
    except TypeError as error:
        raise TypeError(f"step parameters must be JSON-serialisable: {error}") from None
