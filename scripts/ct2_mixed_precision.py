"""Can a CTranslate2 int8 model keep some matrices in float32? (issue 25's last idea for a d 64 student)

    .venv/bin/python scripts/ct2_mixed_precision.py CKPT DATA WORKDIR [--keep embeddings,projection]

Exports CKPT (a fairseq checkpoint the plugin reads) three ways: float32, int8 (8-bit weights, as
CTranslate2 rounds them) through ``fairseq-kd-export``, and int8 with the variables whose CTranslate2 names contain any of ``--keep``
left in float32 (written by CTranslate2's own spec API: validate, alias, quantise the rest, save).
Each is decoded on DATA's test split (beam 5, 32 sentences per batch, 2 workers) and the
hypotheses are compared. If the mixed model decodes exactly what the all-int8 one decodes although
its file holds the kept matrices in float32, CTranslate2 converts every weight to one compute type
when it loads a model, and a per-layer precision cannot be had this way.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def mixed_export(checkpoint: str, data: str, output: Path, keep: list) -> dict:
    """int8 everywhere but the variables whose names contain an entry of ``keep`` (float32)."""
    from fairseq_kd.deploy import import_ctranslate2
    from fairseq_kd.deploy.export_ctranslate2 import build_spec, load_transformer

    import_ctranslate2()
    spec = build_spec(load_transformer(checkpoint, data))
    spec.validate()  # wraps the tensors as CTranslate2 variables, which _quantize acts on
    spec._alias_variables()  # as ModelSpec.optimize does before quantising
    kept = []
    spec._visit(lambda layer, name, value: kept.append(name) if any(k in name for k in keep) else None)
    spec._quantize("int8", variable_filter=lambda name: not any(k in name for k in keep))
    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)
    spec.save(str(output))
    return {"kept_float32": [n for n in kept if n.endswith("weight")],
            "model_bin_bytes": (output / "model.bin").stat().st_size}


def hypotheses(model: Path, data: str, results: Path) -> dict:
    from fairseq_kd.cli import translate

    translate.cli_main([data, "--model", str(model), "--gen-subset", "test", "--beam", "5", "--batch-size", "32",
                        "--threads", "2", "--results-path", str(results), "--overwrite"])
    lines = (results / "generate-test.txt").read_text(encoding="utf-8").splitlines()
    return {line.split("\t")[0]: line.split("\t")[2] for line in lines if line.startswith("H-")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("data")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--keep", default="embeddings,projection",
                        help="comma-separated parts of CTranslate2 variable names kept in float32")
    args = parser.parse_args()
    from fairseq_kd.deploy.export_ctranslate2 import export_ctranslate2

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    models = {}
    for quantization in ("float32", "int8"):
        models[quantization] = work / f"export-{quantization}"
        # int8 as CTranslate2 rounds it (8-bit weights), as the mixed model's int8 matrices are
        export_ctranslate2(args.checkpoint, str(models[quantization]), quantization=quantization, data=args.data,
                           overwrite=True, int8_weight_bits=8 if quantization == "int8" else None)
    models["int8+float32 " + args.keep] = work / "export-mixed"
    mixed = mixed_export(args.checkpoint, args.data, models["int8+float32 " + args.keep], args.keep.split(","))
    outputs = {name: hypotheses(folder, args.data, work / f"decode-{folder.name}") for name, folder in models.items()}
    report = {"mixed": mixed, "model_bin_bytes": {name: (folder / "model.bin").stat().st_size
                                                  for name, folder in models.items()}, "identical_to": {}}
    for name, hyps in outputs.items():
        report["identical_to"][name] = {other: sum(hyps[k] == theirs[k] for k in hyps)
                                        for other, theirs in outputs.items()}
    report["sentences"] = len(outputs["float32"])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
