"""What the plugin changes in fairseq's half precision (:func:`install`):

1. **--bf16 without --tpu.** fairseq 0.12's ``options.parse_args_and_arch`` sets ``tpu`` whenever
   ``bf16`` is set, and the Trainer then asks torch-xla for a TPU. Wrapped, ``tpu`` is what the
   command line says, so ``--bf16`` trains on CUDA, or on the CPU with ``--cpu``, through fairseq's
   own bf16 path (float32 master weights, no loss scale).
2. **Master weights in the checkpoint.** ``FP16Optimizer`` (``--fp16``, ``--bf16``) updates float32
   masters but fairseq saves only the half-precision weights, so a resume continued from rounded
   masters. Its state dict now carries them (``MASTERS_KEY``, 4 bytes a parameter) and loading
   restores them, so a resume continues as the uninterrupted run; a checkpoint without them loads
   as before.
"""
import argparse
import functools
import logging

logger = logging.getLogger(__name__)

#: the key of the optimizer state (``last_optimizer_state``) that holds FP16Optimizer's master weights
MASTERS_KEY = "fairseq_kd_fp32_masters"


# ----------------------------------------------------------------------------- 1. --bf16 without --tpu
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


# ----------------------------------------------------------------------------- 2. master weights
def master_tensors(fp32_params) -> list:
    """FP16Optimizer's master weights as a list: one flat tensor per device (``--fp16`` on CUDA) or
    one tensor per parameter (``--bf16``, ``--fp16-no-flatten-grads``)."""
    if isinstance(fp32_params, dict):
        return list(fp32_params.values())
    return [fp32_params] if hasattr(fp32_params, "shape") else list(fp32_params)


def with_masters(state_dict):
    """FP16Optimizer's ``state_dict`` that also returns the master weights, under :data:`MASTERS_KEY`."""

    @functools.wraps(state_dict)
    def state_dict_with_masters(optimizer):
        state = state_dict(optimizer)
        state[MASTERS_KEY] = [master.detach() for master in master_tensors(optimizer.fp32_params)]
        return state

    state_dict_with_masters.keeps_fp32_masters = True
    return state_dict_with_masters


def restoring_masters(load_state_dict):
    """FP16Optimizer's ``load_state_dict`` that restores the master weights a state dict carries
    (after fairseq's own load, which never sees them) when they fit this run's."""

    @functools.wraps(load_state_dict)
    def load_state_dict_restoring_masters(optimizer, state_dict, optimizer_overrides=None):
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTERS_KEY, None)
        load_state_dict(optimizer, state_dict, optimizer_overrides)
        if saved is None:
            return
        masters = master_tensors(optimizer.fp32_params)
        if [tuple(t.shape) for t in saved] != [tuple(t.shape) for t in masters]:
            # another parameter layout (flat or not): the masters come from the model, as in fairseq
            logger.warning("the checkpoint's float32 master weights do not fit this run's; they are "
                           "taken from the model's half-precision weights instead")
            return
        for master, value in zip(masters, saved):
            master.data.copy_(value)
        optimizer._sync_fp32_params_to_fp16()  # the model's weights: the masters rounded

    return load_state_dict_restoring_masters


def install() -> None:
    """Install both parts (idempotent)."""
    from fairseq import options
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin

    if not getattr(options.parse_args_and_arch, "bf16_keeps_tpu_as_given", False):
        options.parse_args_and_arch = keep_tpu_as_given(options.parse_args_and_arch)
    if not getattr(_FP16OptimizerMixin.state_dict, "keeps_fp32_masters", False):
        _FP16OptimizerMixin.state_dict = with_masters(_FP16OptimizerMixin.state_dict)
        _FP16OptimizerMixin.load_state_dict = restoring_masters(_FP16OptimizerMixin.load_state_dict)
