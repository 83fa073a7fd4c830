"""Execution profiles of a recipe: where it runs and how much of the papers' schedule it keeps.

* ``gpu``: the papers' models and schedule, mixed precision (``--fp16``), data-parallel over every
  visible GPU through fairseq's own distributed training (``--distributed-world-size N``; fairseq
  spawns one worker per GPU). ``--update-freq`` is derived from the pair's tokens per update, so a
  pair that asks for about 25K tokens per update (WMT'14) gets them on 1 or 8 GPUs alike.
* ``cpu``: the same models and hyper-parameters on the CPU (``--cpu``), with a budget of 4,000
  updates per model and a 1,000-update warm-up (a trial run: the papers' schedules take days
  without a GPU). ``--max-update`` of the recipe changes the budget.
* ``smoke``: tiny models (teacher 3+3 layers, students 2+2, the "2-layer" students 1+1; d = 32 /
  16), 30 updates of 1,024 tokens at a higher learning rate, beam 2, outputs of at most 20
  tokens: checks the whole pipeline on a small archive in minutes, on the CPU. Its BLEU scores
  mean nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass(frozen=True)
class Profile:
    name: str
    #: "cuda" (fp16, data-parallel) or "cpu"
    device: str
    #: training length; None keeps the pair's schedule
    schedule: Optional[tuple[str, ...]] = None
    #: fairseq-train flags replacing the pair's training values
    training_overrides: Mapping[str, str] = field(default_factory=dict)
    #: "teacher" / student role -> architecture flags replacing the pair's; None keeps them
    architectures: Optional[Mapping[str, tuple[str, ...]]] = None
    #: derive --update-freq from the pair's tokens per update
    match_tokens_per_update: bool = True
    #: beam of the test decoding (and of sequence-level KD); None: the pair's (and Kim & Rush's 5)
    beam: Optional[int] = None
    #: (a, b): every decoding, the teacher passes' too, stops at a x source + b tokens; None: the test
    #: decoding stops at the pair's limit (pairs.MAX_LEN_A, MAX_LEN_B), a teacher pass at fairseq's default
    length_limit: Optional[tuple[float, int]] = None
    log_interval: int = 100
    use_smoke_prepare_args: bool = False


def _tiny(layers: int, dim: int, heads: int) -> tuple[str, ...]:
    return (
        "--arch", "transformer", "--encoder-layers", str(layers), "--decoder-layers", str(layers),
        "--encoder-embed-dim", str(dim), "--decoder-embed-dim", str(dim),
        "--encoder-ffn-embed-dim", str(2 * dim), "--decoder-ffn-embed-dim", str(2 * dim),
        "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads),
    )


PROFILES: Mapping[str, Profile] = {
    "gpu": Profile("gpu", device="cuda"),
    "cpu": Profile("cpu", device="cpu", schedule=("--max-update", "4000"),
                   training_overrides={"--warmup-updates": "1000"}, log_interval=50),
    "smoke": Profile(
        "smoke", device="cpu",
        schedule=("--max-update", "30"),
        training_overrides={"--max-tokens": "1024", "--lr": "3e-3", "--warmup-updates": "10", "--dropout": "0.1"},
        architectures={
            "teacher": _tiny(3, 32, 4),
            "student": _tiny(2, 16, 4),
            "student_4h": _tiny(2, 16, 4),
            "student_8h": _tiny(2, 16, 8),
            "student_2l": _tiny(1, 16, 4),
        },
        match_tokens_per_update=False,
        beam=2,
        # An untrained model repeats a piece until the length limit: keep outputs short.
        length_limit=(0, 20),
        log_interval=1,
        use_smoke_prepare_args=True,
    ),
}
