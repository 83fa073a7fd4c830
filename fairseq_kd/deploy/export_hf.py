"""Export a fairseq Transformer translation checkpoint as a Hugging Face ``save_pretrained`` folder.

    fairseq-kd-export CKPT OUT --format hf [--spm-model SPM.model]

The family whose layout is fairseq's, weight for weight: ``MarianMTModel`` for post-norm,
``M2M100ForConditionalGeneration`` for pre-norm with final layer norms; one vocabulary, the fairseq
dictionary index for index. The folder is loaded back and checked against the fairseq model's
logits before it is renamed into place (:mod:`.model_folder`). Design notes: ``docs/design/deploy.md``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ..fingerprint import dictionary_sha256, fingerprint
from .export_ctranslate2 import CTranslate2ExportError, LoadedTransformer, load_transformer
from .export_fairseq import FAIRSEQ_BUFFER_SUFFIXES, count_parameters
from .layout import LayoutChecker, check_positions_decoder_and_widths, normformer_modules
from .model_folder import ExportFolder

RECORD_NAME = "fairseq_kd_export.json"
RECORD_FORMAT = "fairseq-kd-hf/1"
INSTALL_HINT = "pip install 'fairseq-kd[hf]' (transformers>=5,<6 and sentencepiece)"
#: fairseq --activation-fn -> Hugging Face activation_function (same function)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_accurate": "gelu_new", "gelu_fast": "gelu_new",
               "swish": "swish", "tanh": "tanh", "linear": "linear"}
FAMILIES = {"marian": "MarianMTModel", "m2m_100": "M2M100ForConditionalGeneration"}
#: what CTranslate2's transformers converter makes of each family's export
CTRANSLATE2_NOTE = {"m2m_100": "ctranslate2.converters.TransformersConverter reads this folder",
                    "marian": "CTranslate2's Marian converter cannot read this folder; use --format ctranslate2"}
#: logits of the reloaded folder must match the fairseq model's this closely (float32)
SELF_CHECK_TOLERANCE = 1e-4


class HuggingFaceExportError(CTranslate2ExportError):
    """The checkpoint, its data or the output folder cannot give a Hugging Face model."""


def family_and_differences(loaded: LoadedTransformer) -> Tuple[Optional[str], List[str]]:
    """The Hugging Face family (``marian`` or ``m2m_100``) whose layout is the model's, and what the
    model has that it cannot express (empty: exportable)."""
    from fairseq.modules import SinusoidalPositionalEmbedding

    model = loaded.model
    encoder, decoder = model.encoder, model.decoder
    layers = list(encoder.layers) + list(decoder.layers)
    check = LayoutChecker()
    pre_norm = {bool(layer.normalize_before) for layer in layers}
    family = None if len(pre_norm) > 1 else "m2m_100" if pre_norm == {True} else "marian"
    check(family is None, "--encoder-normalize-before and --decoder-normalize-before differ (Marian: post-norm on "
                          "both sides; M2M100: pre-norm on both sides)")
    check(family == "m2m_100" and (encoder.layer_norm is None or decoder.layer_norm is None),
          "a pre-norm model without a final layer norm (--no-decoder-final-norm); M2M100 has both")
    check(loaded.activation_fn not in ACTIVATIONS,
          f"--activation-fn {loaded.activation_fn} (expressible: {', '.join(ACTIVATIONS)})")
    check(any(getattr(module, "layernorm_embedding", None) is not None for module in (encoder, decoder)),
          "--layernorm-embedding (neither Marian nor M2M100 normalises the embeddings)")
    for side, module in (("encoder", encoder), ("decoder", decoder)):
        positions = module.embed_positions
        check(positions is not None and not isinstance(positions, SinusoidalPositionalEmbedding),
              f"learned positions (--{side}-learned-pos); both families use sinusoidal positions")
    check_positions_decoder_and_widths(check, encoder, decoder)
    for side, module in (("encoder", encoder), ("decoder", decoder)):
        heads = {layer.self_attn.num_heads for layer in module.layers}
        ffn = {layer.fc1.out_features for layer in module.layers}
        check(len(heads) > 1 or len(ffn) > 1, f"{side} layers of different head counts or FFN widths")
    check({layer.encoder_attn.num_heads for layer in decoder.layers} != {layer.self_attn.num_heads for layer in decoder.layers},
          "decoder cross-attention heads differ from its self-attention heads")
    normformer = normformer_modules(layers)
    check(normformer, f"NormFormer layers ({', '.join(normformer)})")
    check(any(getattr(attention, "bias_k", None) is not None for layer in layers
              for attention in (layer.self_attn, getattr(layer, "encoder_attn", None)) if attention is not None),
          "attention with --add-bias-kv")
    source, target = loaded.source_dictionary, loaded.target_dictionary
    check(list(source.symbols) != list(target.symbols), "separate source and target dictionaries (a Hugging Face "
                                                        "folder holds one vocabulary: train with --joined-dictionary)")
    for side, dictionary in (("source", source), ("target", target)):
        check((dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk()) != (0, 1, 2, 3) or
              list(dictionary.symbols[:4]) != ["<s>", "<pad>", "</s>", "<unk>"],
              f"the {side} dictionary does not hold <s> <pad> </s> <unk> at 0-3")
    shared_all = encoder.embed_tokens.weight is decoder.embed_tokens.weight
    check(shared_all and not decoder.share_input_output_embed,
          "shared encoder/decoder embeddings with an untied output projection")
    return (family if not check.problems else None), check.problems


def _config(transformers, family: str, loaded: LoadedTransformer):
    """The Hugging Face config of the family for ``loaded``."""
    model = loaded.model
    encoder, decoder = model.encoder, model.decoder
    dictionary = loaded.target_dictionary
    shared_all = encoder.embed_tokens.weight is decoder.embed_tokens.weight
    dim = encoder.embed_tokens.embedding_dim
    max_positions = max(int(p) for p in model.max_positions())
    common = dict(
        vocab_size=len(dictionary), d_model=dim,
        encoder_layers=len(encoder.layers), decoder_layers=len(decoder.layers),
        encoder_attention_heads=encoder.layers[0].self_attn.num_heads,
        decoder_attention_heads=decoder.layers[0].self_attn.num_heads,
        encoder_ffn_dim=encoder.layers[0].fc1.out_features, decoder_ffn_dim=decoder.layers[0].fc1.out_features,
        activation_function=ACTIVATIONS[loaded.activation_fn], max_position_embeddings=max_positions,
        scale_embedding=encoder.embed_scale != 1.0, dropout=float(getattr(encoder.dropout_module, "p", 0.0)),
        attention_dropout=float(encoder.layers[0].self_attn.dropout_module.p),
        activation_dropout=float(getattr(encoder.layers[0].activation_dropout_module, "p", 0.0)),
        encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        bos_token_id=dictionary.bos(), pad_token_id=dictionary.pad(), eos_token_id=dictionary.eos(),
        decoder_start_token_id=dictionary.eos(), forced_eos_token_id=None,
        tie_word_embeddings=shared_all, is_encoder_decoder=True)
    if family == "marian":
        return transformers.MarianConfig(**common, decoder_vocab_size=len(dictionary),
                                         share_encoder_decoder_embeddings=shared_all)
    return transformers.M2M100Config(**common)


def _generation_config(transformers, loaded: LoadedTransformer):
    """fairseq-generate's defaults: greedy unless asked, --max-len-b 200 within the model's
    positions, --min-len 1 (no </s> first), <pad> never generated, no forced </s>."""
    dictionary = loaded.target_dictionary
    return transformers.GenerationConfig(
        decoder_start_token_id=dictionary.eos(), bos_token_id=dictionary.bos(), eos_token_id=dictionary.eos(),
        pad_token_id=dictionary.pad(), forced_eos_token_id=None, num_beams=1, do_sample=False,
        max_new_tokens=min(200, int(loaded.model.max_positions()[1]) - 1), min_new_tokens=1,
        suppress_tokens=[dictionary.pad()])


def hf_state_dict(family: str, loaded: LoadedTransformer, max_positions: int) -> dict:
    """The Hugging Face weights of ``loaded`` (fairseq's names nearly are Hugging Face's: layers under
    ``model.``, the output projection as ``lm_head``), with Marian's position tables baked in."""
    from fairseq.modules import SinusoidalPositionalEmbedding

    fairseq_state = loaded.model.state_dict()
    state = {}
    for name, tensor in fairseq_state.items():
        if name.endswith(FAIRSEQ_BUFFER_SUFFIXES) or "embed_positions" in name:
            continue
        if name == "decoder.output_projection.weight":
            state["lm_head.weight"] = tensor
        else:
            state[f"model.{name}"] = tensor
    if "lm_head.weight" not in state:  # tied output projection
        state["lm_head.weight"] = fairseq_state["decoder.embed_tokens.weight"]
    state["model.shared.weight"] = fairseq_state["encoder.embed_tokens.weight"]
    if family == "marian":
        for side in ("encoder", "decoder"):
            module = getattr(loaded.model, side).embed_positions
            table = SinusoidalPositionalEmbedding.get_embedding(
                max_positions + module.padding_idx + 1, module.embedding_dim, module.padding_idx)
            state[f"model.{side}.embed_positions.weight"] = table[module.padding_idx + 1:].contiguous()
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


def _save_marian_positions(folder: Path, state: dict) -> None:
    """Add Marian's position tables (which ``save_pretrained`` leaves out) to ``model.safetensors``."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    if not path.is_file():
        raise HuggingFaceExportError(f"save_pretrained wrote no single model.safetensors in {folder}")
    weights = load_file(str(path))
    for side in ("encoder", "decoder"):
        key = f"model.{side}.embed_positions.weight"
        weights[key] = state[key]
    save_file(weights, str(path), metadata={"format": "pt"})


def find_spm_model(data: str, spm_model: Optional[str]) -> Optional[Path]:
    """``--spm-model`` (an existing file), else the one ``*.model`` file of the data folder, else None."""
    if spm_model:
        return Path(spm_model)
    found = sorted(p for p in Path(data).glob("*.model") if p.is_file())
    return found[0] if len(found) == 1 else None


def _write_tokenizer(transformers, folder: Path, dictionary, spm_model: Optional[Path]) -> str:
    """The tokenizer files; returns what text the folder's tokenizer expects, in words."""
    vocabulary = {symbol: index for index, symbol in enumerate(dictionary.symbols)}
    if spm_model is not None:
        import sentencepiece  # noqa: F401 - MarianTokenizer needs it; fail here with the hint below

        work = folder.parent / f"{folder.name}.tokenizer"
        work.mkdir()
        try:
            (work / "vocab.json").write_text(json.dumps(vocabulary, ensure_ascii=False), encoding="utf-8")
            tokenizer = transformers.MarianTokenizer(str(spm_model), str(spm_model), str(work / "vocab.json"),
                                                     unk_token="<unk>", eos_token="</s>", pad_token="<pad>",
                                                     model_max_length=1024)
            tokenizer.save_pretrained(str(folder))
        finally:
            shutil.rmtree(work)
        return f"raw text (SentencePiece model {spm_model.name})"
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                           special_tokens=[("</s>", dictionary.eos())])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", pad_token="<pad>",
                                                     eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(str(folder))
    return "pre-tokenised text (tokenised and BPE-segmented as for fairseq; the tokenizer splits on spaces)"


def _self_check(transformers, family: str, folder: Path, loaded: LoadedTransformer) -> float:
    """The largest logit difference between the saved folder (``from_pretrained``, offline) and the
    fairseq model on a small padded batch; refuses the export above :data:`SELF_CHECK_TOLERANCE`."""
    hf_model = getattr(transformers, FAMILIES[family]).from_pretrained(str(folder), local_files_only=True).eval()
    dictionary = loaded.target_dictionary
    generator = torch.Generator().manual_seed(0)
    first = dictionary.nspecial
    rows = [torch.randint(first, max(first + 1, len(dictionary)), (length,), generator=generator).tolist()
            + [dictionary.eos()] for length in (5, 3)]
    width = max(len(r) for r in rows)
    pad = dictionary.pad()
    right = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    left = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    prev = torch.tensor([[dictionary.eos()] + r[:-1] + [pad] * (width - len(r)) for r in rows])
    model = loaded.model.float()
    with torch.no_grad():
        fairseq_logits = model(left, torch.tensor([len(r) for r in rows]), prev)[0]
        hf_logits = hf_model(input_ids=right, attention_mask=right.ne(pad), decoder_input_ids=prev).logits
    worst = 0.0
    for i, r in enumerate(rows):
        worst = max(worst, float((fairseq_logits[i, :len(r)] - hf_logits[i, :len(r)]).abs().max()))
    if worst > SELF_CHECK_TOLERANCE:
        raise HuggingFaceExportError(f"the saved {FAMILIES[family]} gives logits {worst:.2e} away from the fairseq "
                                     "model's; nothing was written (please report this)")
    return worst


def export_hf(checkpoint: str, output: str, data: Optional[str] = None, spm_model: Optional[str] = None,
              overwrite: bool = False) -> dict:
    """Write the Hugging Face folder ``output`` from ``checkpoint``; return a summary."""
    try:  # before any work: a missing extra is one line naming the fix
        import transformers
    except ImportError as err:
        raise HuggingFaceExportError(f"--format hf needs transformers: {INSTALL_HINT} ({err})") from None
    transformers.utils.logging.disable_progress_bar()  # its weight-loading bars are no progress of ours
    output_folder = ExportFolder(checkpoint, output, overwrite, kind="Hugging Face", record_name=RECORD_NAME,
                                 record_format=RECORD_FORMAT, error=HuggingFaceExportError)
    out = output_folder.check()
    if spm_model is not None and not Path(spm_model).is_file():
        raise HuggingFaceExportError(f"--spm-model {spm_model!r}: no such file")
    try:
        loaded = load_transformer(checkpoint, data)
    except CTranslate2ExportError as err:
        raise HuggingFaceExportError(str(err)) from None
    family, problems = family_and_differences(loaded)
    LayoutChecker(problems).refuse(HuggingFaceExportError, f"{checkpoint!r} cannot be expressed as MarianMT or M2M100")
    spm_path = find_spm_model(loaded.data, spm_model)
    loaded.model.float()
    config = _config(transformers, family, loaded)
    state = hf_state_dict(family, loaded, config.max_position_embeddings)
    hf_model = getattr(transformers, FAMILIES[family])(config).eval()
    if "model.shared.weight" not in hf_model.state_dict():  # Marian without shared embeddings
        del state["model.shared.weight"]
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"final_logits_bias"}:
        raise HuggingFaceExportError(f"weights do not map onto {FAMILIES[family]} (missing {sorted(missing)}, "
                                     f"unexpected {sorted(unexpected)}); please report this")
    if family == "marian":
        hf_model.final_logits_bias.zero_()
    hf_model.generation_config = _generation_config(transformers, loaded)

    with output_folder.staged() as staging:
        hf_model.save_pretrained(str(staging), safe_serialization=True)
        if family == "marian":
            _save_marian_positions(staging, state)
        text = _write_tokenizer(transformers, staging, loaded.target_dictionary, spm_path)
        worst = _self_check(transformers, family, staging, loaded)
        record = {"format": RECORD_FORMAT, "family": family, "architecture": FAMILIES[family],
                  "checkpoint": str(Path(checkpoint).resolve()),
                  "checkpoint_sha256": fingerprint(Path(checkpoint))["sha256"], "num_updates": loaded.num_updates,
                  "source_lang": loaded.source_lang, "target_lang": loaded.target_lang,
                  "dictionary_sha256": dictionary_sha256(loaded.target_dictionary), "data": loaded.data,
                  "tokenizer": text, "spm_model": str(spm_path) if spm_path else None, "max_logit_difference": worst,
                  "parameters": count_parameters(loaded.model.state_dict()),
                  "transformers_version": transformers.__version__}
        output_folder.write_record(staging, record)
    return {"output": str(out), "format": "hf", "family": family, "architecture": FAMILIES[family],
            "bytes": output_folder.size(),
            "tokenizer": text, "ctranslate2": CTRANSLATE2_NOTE[family],
            **{k: record[k] for k in ("parameters", "num_updates", "source_lang", "target_lang",
                                      "max_logit_difference")}}
