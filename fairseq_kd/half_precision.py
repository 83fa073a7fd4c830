"""``--bf16`` on CUDA and on the CPU under fairseq's own commands, installed by :func:`install`
(made by :func:`fairseq_kd.register`, so by ``--user-dir fairseq_kd``).

fairseq 0.12's ``options.parse_args_and_arch``, which parses the command line of fairseq-train,
-generate, -interactive, -validate and -eval-lm, sets ``tpu = True`` whenever ``bf16`` is set: the
Trainer then asks torch-xla for a TPU and fails on any other machine. :func:`install` wraps that
function so that ``tpu`` is what the command line says (``--bf16 --tpu`` still selects a TPU):
``--bf16`` then trains on CUDA, or on the CPU with ``--cpu``, through fairseq's own bf16 path (model
and criterion cast to bfloat16, float32 master weights in ``FP16Optimizer``, no loss scaling).
The commands import the plugin while building their parser, before they call this function.
fairseq-hydra-train needs nothing: its ``common.tpu`` is not derived from ``common.bf16``.
"""
import argparse
import functools


def tpu_given(input_args=None) -> bool:
    """Whether ``--tpu`` is on the command line (``input_args``, else ``sys.argv``); fairseq's
    parsers take no abbreviations, so only the whole flag counts."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--tpu", action="store_true")
    return parser.parse_known_args(input_args)[0].tpu


def keep_tpu_as_given(parse_args_and_arch):
    """``parse_args_and_arch`` whose ``--bf16`` no longer implies ``--tpu``."""

    @functools.wraps(parse_args_and_arch)
    def parse_args_and_arch_bf16_without_tpu(parser, input_args=None, *args, **kwargs):
        parsed = parse_args_and_arch(parser, input_args, *args, **kwargs)
        namespace = parsed[0] if isinstance(parsed, tuple) else parsed  # parse_known=True: (args, extra)
        if getattr(namespace, "bf16", False) and getattr(namespace, "tpu", False) and not tpu_given(input_args):
            namespace.tpu = False
        return parsed

    parse_args_and_arch_bf16_without_tpu.bf16_keeps_tpu_as_given = True
    return parse_args_and_arch_bf16_without_tpu


def install() -> None:
    """Replace ``fairseq.options.parse_args_and_arch`` (looked up there by every fairseq command at
    call time) with :func:`keep_tpu_as_given`'s wrapper. Idempotent."""
    from fairseq import options

    if not getattr(options.parse_args_and_arch, "bf16_keeps_tpu_as_given", False):
        options.parse_args_and_arch = keep_tpu_as_given(options.parse_args_and_arch)
