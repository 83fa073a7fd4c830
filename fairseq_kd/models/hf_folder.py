"""Whether a Hugging Face teacher folder's weights are the model its ``config.json`` describes.

Before anything is allocated, from the weights' headers (safetensors' JSON header; pickles
unpickled weights-only onto the meta device): every tensor floating point, the config's sizes
agreeing with the shapes, its special token ids in the vocabulary. After loading: transformers'
loading report lists no missing, unexpected or mismatched tensor, and every value is finite.
Every check takes ``refuse``, which makes the one-line error of a problem.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import FileAccessError

#: how many positions a model may compute for itself (sinusoidal positions are not in the weights):
#: more than any released translation model's 1024, few enough to build in seconds
MAX_COMPUTED_POSITIONS = 16384
#: weight files (single, sharded), safetensors preferred to pickles (read weights-only)
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: safetensors dtypes that are floating point (the format's own names)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
#: config keys of special token ids, each read from config.json or, when absent there, the config object
SPECIAL_ID_KEYS = ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id", "decoder_start_token_id",
                   "forced_bos_token_id", "forced_eos_token_id")
#: config keys that size the model: each is checked against the weights' shapes, or bounded by them
SIZE_KEY = re.compile(r"(vocab_size|_dim|d_model|hidden_size|d_ff|d_kv|_layers|_heads|_positions|max_position_embeddings)$")
LAYER_INDEX = re.compile(r"(?:^|\.)(encoder|decoder)\.(?:layers|layer|block)\.(\d+)\.")


@dataclass(frozen=True)
class WeightsHeader:
    """The weights' tensors as their files describe them: name -> (dtype name, shape), and which
    file holds each (named in refusals)."""

    tensors: Dict[str, Tuple[str, Tuple[int, ...]]]
    file_of: Dict[str, str]

    def shape(self, suffixes: Sequence[str]) -> Optional[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of the first tensor whose name is or ends with ``.`` + one of ``suffixes``,
        tried in order; None when there is none."""
        for suffix in suffixes:
            for name in sorted(self.tensors):
                if name == suffix or name.endswith("." + suffix):
                    return name, self.tensors[name][1]
        return None

    def largest_dimension(self) -> int:
        return max((size for _, shape in self.tensors.values() for size in shape), default=0)

    def layer_count(self, stack: str) -> Optional[int]:
        """Layers of ``stack`` ("encoder"/"decoder") in the weights (highest index + 1), None when the
        weights have no indexed layers of that stack."""
        indices = [int(match.group(2)) for name in self.tensors for match in [LAYER_INDEX.search(name)]
                   if match and match.group(1) == stack]
        return max(indices) + 1 if indices else None


def first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else ""


def read_weights_header(folder, use_safetensors: bool, refuse: Callable[[str], Exception]) -> WeightsHeader:
    """The header of the folder's weights (a single file or the shards its index lists)."""
    folder = Path(folder)
    single, index = SAFETENSORS_FILES if use_safetensors else PICKLE_FILES
    files = [single] if (folder / single).is_file() else _shards(folder, index, refuse)
    tensors, file_of = {}, {}
    for name in files:
        read = _safetensors_header if use_safetensors else _pickle_header
        for tensor, (dtype, shape) in read(folder / name, refuse).items():
            tensors[tensor], file_of[tensor] = (dtype, shape), name
    if not tensors:
        raise refuse(f"{', '.join(files)} holds no tensors; save the model with save_pretrained")
    return WeightsHeader(tensors, file_of)


def _shards(folder: Path, index: str, refuse) -> List[str]:
    try:
        weight_map = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        refusal = refuse(f"{index} is not a readable weights index ({type(err).__name__}: {err}); "
                         "save the model again with save_pretrained")
        raise (FileAccessError(str(refusal)) if isinstance(err, OSError) else refusal) from None
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or not (folder / shard).is_file():
            raise refuse(f"{index} lists the shard {shard!r}, which is not a file of the folder; "
                         "save the model again with save_pretrained")
    return shards


def _safetensors_header(path: Path, refuse) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as weights:
            return {name: (weights.get_slice(name).get_dtype(), tuple(weights.get_slice(name).get_shape()))
                    for name in weights.keys()}
    except (SafetensorError, OSError) as err:  # a damaged file (its header's every fault is a SafetensorError)
        raise refuse(f"{path.name} is not a readable safetensors file ({type(err).__name__}: "
                     f"{first_line(err)}); save the model again with save_pretrained") from None


def _pickle_header(path: Path, refuse) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Weights-only unpickling onto the meta device; a refused pickle raises ``pickle.UnpicklingError``."""
    import pickle
    import warnings

    import torch

    from ..checkpoints.safe_loading import UNREADABLE_FILE_ERRORS

    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol other than its own precedes a refusal
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(str(path), weights_only=True, map_location="meta")
    except pickle.UnpicklingError:
        raise
    except UNREADABLE_FILE_ERRORS + (OSError,) as err:  # a damaged file
        raise refuse(f"{path.name} cannot be read ({type(err).__name__}: "
                     f"{first_line(err)}); save the model again with save_pretrained") from None
    if not isinstance(state, dict):
        raise refuse(f"{path.name} holds a {type(state).__name__}, not a state dict of tensors")
    header = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise refuse(f"{path.name} holds {name!r}, a {type(value).__name__}, not a tensor")
        header[str(name)] = ("F" if value.dtype.is_floating_point else str(value.dtype).replace("torch.", ""),
                             tuple(value.shape))
    return header


def check_floating_point(header: WeightsHeader, refuse) -> None:
    """Every tensor of the weights is floating point (integer weights would be cast silently)."""
    others = sorted(name for name, (dtype, _) in header.tensors.items() if dtype != "F" and dtype not in FLOAT_DTYPES)
    if others:
        first = others[0]
        raise refuse(f"{len(others)} tensor{'s' if len(others) > 1 else ''} of its weights "
                     f"{'are' if len(others) > 1 else 'is'} not floating point, first: {first} "
                     f"({header.tensors[first][0]} in {header.file_of[first]}); a teacher's weights are floating "
                     "point: save the model again with save_pretrained")


def check_config_fits_weights(config, raw: dict, header: WeightsHeader, refuse) -> None:
    """The config's sizes agree with (or are bounded by) the weights' shapes and its special token
    ids lie in the vocabulary. ``config``: the transformers config object, ``raw``: config.json's dict
    (keys the object drops, e.g. forced ids)."""

    def value(key):  # what the model is built with; config.json's own value where the config object drops it
        try:
            return getattr(config, key)
        except AttributeError:
            return raw.get(key)

    def disagree(key, found, why: str):
        return refuse(f"config.json's {key} {found!r} does not fit the weights: {why}; the config describes "
                      "another model than the weights: fix config.json or save the model again with save_pretrained")

    sizes = {}
    for key in sorted(set(raw) | set(_config_keys(config))):
        found = value(key)
        if not SIZE_KEY.search(key) or found is None or isinstance(found, bool):
            continue
        if not isinstance(found, int) or found < 1:
            raise disagree(key, found, "it is not a positive integer")
        sizes[key] = found
    checked = set()

    def expect(key, expected: int, tensor: str, what: str):
        checked.add(key)
        found = sizes.get(key)
        if found is not None and found != expected:
            raise disagree(key, found, f"{tensor} in {header.file_of[tensor]} has {expected} {what}")

    source = header.shape(("shared.weight", "encoder.embed_tokens.weight", "embed_tokens.weight",
                           "word_embeddings.weight"))
    target = header.shape(("decoder.embed_tokens.weight", "lm_head.weight", "shared.weight"))
    if source is not None and len(source[1]) == 2:
        expect("vocab_size", source[1][0], source[0], "rows")
        for key in ("d_model", "hidden_size"):
            expect(key, source[1][1], source[0], "columns")
    if target is not None and len(target[1]) == 2 and value("share_encoder_decoder_embeddings") is False:
        expect("decoder_vocab_size", target[1][0], target[0], "rows")
    for stack in ("encoder", "decoder"):
        count = header.layer_count(stack)
        keys = (f"{stack}_layers",) + (("num_layers",) if stack == "encoder" else ("num_decoder_layers",))
        for key in keys:
            if count is not None and sizes.get(key) is not None:
                checked.add(key)
                if sizes[key] != count:
                    raise disagree(key, sizes[key], f"the weights hold {count} {stack} layer{'s' * (count != 1)}")
        ffn = header.shape((f"{stack}.layers.0.fc1.weight",))
        if ffn is not None and len(ffn[1]) == 2:
            expect(f"{stack}_ffn_dim", ffn[1][0], ffn[0], "rows")
    width = source[1][1] if source is not None and len(source[1]) == 2 else None
    for key in [key for key in sizes if key.endswith("_heads") and width is not None]:
        checked.add(key)
        if width % sizes[key]:
            raise disagree(key, sizes[key], f"the model's width {width} ({source[0]}) is not a multiple of it")
    positions = header.shape(("embed_positions.weight", "position_embeddings.weight"))
    for key in [key for key in sizes if key.endswith("_positions") or key == "max_position_embeddings"]:
        checked.add(key)
        bound, where = ((positions[1][0], f"{positions[0]} in {header.file_of[positions[0]]} has {positions[1][0]} rows")
                        if positions is not None else
                        (MAX_COMPUTED_POSITIONS, f"the weights hold no positions, and more than "
                                                 f"{MAX_COMPUTED_POSITIONS} computed ones are refused"))
        if sizes[key] > bound:
            raise disagree(key, sizes[key], where)
    largest, count = header.largest_dimension(), len(header.tensors)
    for key, found in sizes.items():
        bound = count if key.endswith("_layers") else largest
        if key not in checked and found > bound:
            raise disagree(key, found, f"it exceeds every {'count of tensors' if key.endswith('_layers') else 'dimension'}"
                                       f" of the weights ({bound})")
    _check_special_ids(value, sizes, source, target, refuse)


def _check_special_ids(value, sizes: dict, source, target, refuse) -> None:
    """Each special token id is a row of the target vocabulary, and the padding id of the source's too."""
    target_rows = target[1][0] if target is not None else (sizes.get("decoder_vocab_size") or sizes.get("vocab_size"))
    source_rows = source[1][0] if source is not None else sizes.get("vocab_size")
    for key in SPECIAL_ID_KEYS:
        found = value(key)
        bounds = [rows for rows in (target_rows, source_rows if key == "pad_token_id" else None) if rows]
        rows = min(bounds) if bounds else None
        for token_id in (found if isinstance(found, list) else [found]):
            if token_id is None:
                continue
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0 or (rows and token_id >= rows):
                where = f" (0..{rows - 1})" if rows else ""
                raise refuse(f"config.json's {key} {found!r} is not a token id of the model's vocabulary{where}; "
                             "fix config.json or save the model again with save_pretrained")


def _config_keys(config) -> List[str]:
    try:
        return list(config.to_dict())
    # transformers' to_dict deep-copies every value of the config and its sub-configs, so it raises
    # whatever a value's copy raises (no common class); config.json's own keys are checked then
    except Exception:  # noqa: BLE001
        return []


def check_loading_info(info: dict, refuse) -> None:
    """transformers' loading report (``output_loading_info=True``) lists no missing, unexpected or
    mismatched tensor and no error."""
    problems = []
    for key, word in (("missing_keys", "missing"), ("unexpected_keys", "unexpected")):
        names = sorted(info.get(key) or ())
        if names:
            problems.append(f"{word} {len(names)} tensor{'s' * (len(names) != 1)}, first: {names[0]}")
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda entry: entry[0])
    if mismatched:
        name, in_weights, in_model = mismatched[0]
        problems.append(f"{len(mismatched)} tensor{'s' * (len(mismatched) != 1)} of another shape, first: {name} "
                        f"({list(in_weights)} in the weights, {list(in_model)} in the model config.json describes)")
    errors = list(info.get("error_msgs") or ())
    if errors:
        problems.append(f"{len(errors)} loading error{'s' * (len(errors) != 1)}, first: {str(errors[0]).splitlines()[0]}")
    if problems:
        raise refuse(f"its weights are not the model config.json describes: {'; '.join(problems)}; fix config.json "
                     "or save the model again with save_pretrained")


def check_finite(model, refuse) -> None:
    """Every parameter and buffer of the loaded model is finite."""
    import torch

    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise refuse(f"its weights hold values that are not finite (NaN or infinity), first in {name}; "
                         "a teacher needs finite weights")
