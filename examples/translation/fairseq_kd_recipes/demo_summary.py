"""A verdict over several seeds (the demo's, a recipe's --student-seeds): which students beat no
KD, and in what order.

    python -m fairseq_kd_recipes.demo_summary --report 1=report_seed1.json --report 2=... \\
        --log no_kd/1=logs/no_kd_seed1.log ... --deploy deploy.json --out-prefix demo_output/summary

Each ``--report`` is ``fairseq-kd-report --output-json`` for one seed: every student of that seed
against that seed's no-KD student (sacreBLEU's paired bootstrap; a ``-seedN`` ending of the names
in seed N's report is dropped). A method *beats no KD* when it
does so on every seed, with p below ``--alpha``; it is *worse* when it loses on every seed with
such a p. Of two methods that beat no KD, one is *above* the other only when its BLEU is higher
on every seed; otherwise they are tied within the seeds' spread. One seed's p measures the test
set's sampling only; asking for every seed asks the difference to outlast training noise too (a
new seed, a new CPU or a new rounding all move a short training as much as each other).
Writes PREFIX.json (every number and the verdict), PREFIX.md and, with ``--deploy``, the README's
demo section;
``--record-into tests/expected/demo.json`` adds the run, with its machine, to the runs the suite
checks (replacing an earlier run of the same machine and kernel pins).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from fairseq_kd.cli.score import split_name_and_path
from fairseq_kd.figures.training_log import read_fairseq_log, validation_series

BASELINE = "no_kd"
TEACHER = "teacher"
ALPHA = 0.05
NAMES = {"teacher": "teacher (4+4, d 128)", "no_kd": "no KD (2+2, d 64)", "word_kd": "word-level KD",
         "a2d_kd": "Align-to-Distill", "seq_kd": "sequence-level KD"}


def verdict(reports: Mapping[str, Mapping[str, Mapping]], alpha: float = ALPHA) -> Dict:
    """Who beats no KD and the order at the top, from per-seed rows ``{seed: {system: row}}``
    (a row has ``bleu``, ``difference`` and ``p_bootstrap``; the teacher and no KD are not ranked)."""
    seeds = list(reports)
    if not seeds:
        raise ValueError("no seeds")
    methods = [name for name in reports[seeds[0]] if name not in (BASELINE, TEACHER)]
    for seed in seeds:
        if set(reports[seed]) != set(reports[seeds[0]]):
            raise ValueError(f"seed {seed} has systems {sorted(reports[seed])}, seed {seeds[0]} {sorted(reports[seeds[0]])}")

    def significant(row, sign):
        return row["p_bootstrap"] is not None and row["p_bootstrap"] < alpha and sign * row["difference"] > 0

    beats = [m for m in methods if all(significant(reports[s][m], +1) for s in seeds)]
    worse = [m for m in methods if all(significant(reports[s][m], -1) for s in seeds)]
    mean = {m: statistics.fmean(reports[s][m]["bleu"] for s in seeds) for m in methods}
    top = sorted(beats, key=lambda m: -mean[m])
    order = []  # consecutive pairs of the top, each "above" or "tied"
    for higher, lower in zip(top, top[1:]):
        above = all(reports[s][higher]["bleu"] > reports[s][lower]["bleu"] for s in seeds)
        order.append({"higher": higher, "lower": lower, "relation": "above" if above else "tied"})
    return {"seeds": seeds, "alpha": alpha, "beats_no_kd": top, "worse_than_no_kd": worse,
            "not_shown_different": [m for m in methods if m not in beats and m not in worse], "order": order}


def verdict_sentence(result: Mapping, names: Mapping[str, str] = NAMES) -> str:
    """The verdict in one sentence, as the README states it."""
    name = lambda m: names.get(m, m)
    seeds = len(result["seeds"])
    parts = []
    if result["beats_no_kd"]:
        ranked = name(result["beats_no_kd"][0])
        for pair in result["order"]:
            ranked += (" > " if pair["relation"] == "above" else " ≈ ") + name(pair["lower"])
        verb = "beats" if len(result["beats_no_kd"]) == 1 else "beat"
        parts.append(f"{ranked} {verb} no KD on each of the {seeds} seeds (paired bootstrap p < {result['alpha']})")
    else:
        parts.append(f"no student beats no KD on all {seeds} seeds")
    if result["worse_than_no_kd"]:
        parts.append(_listed(map(name, result["worse_than_no_kd"])) + " worse on every seed")
    if result["not_shown_different"]:
        parts.append(_listed(map(name, result["not_shown_different"])) + " not shown better or worse")
    return "; ".join(parts) + "."


def _listed(names) -> str:
    names = list(names)
    return names[0] + " is" if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1] + " are"


def best_valid_nll(log: Path) -> float:
    """The lowest validation nll (bits per target token) a fairseq-train log reports."""
    series = validation_series(read_fairseq_log(Path(log)), "nll_loss")
    if not series:
        raise ValueError(f"{log}: no validation nll_loss")
    return min(value for _, value in series)


def summarise(reports: Mapping[str, Mapping], nll: Mapping[str, Mapping[str, float]], alpha: float = ALPHA,
              names: Mapping[str, str] = NAMES) -> Dict:
    """``reports``: ``{seed: report.json}``; ``nll``: ``{system: {seed: best valid nll}}``."""
    rows = {seed: {_unseeded(row["system"], seed): row for row in report["systems"]} for seed, report in reports.items()}
    result = verdict(rows, alpha)
    seeds = result["seeds"]
    systems = []
    for system in rows[seeds[0]]:
        bleu = [rows[s][system]["bleu"] for s in seeds]
        entry = {"system": system, "params": rows[seeds[0]][system].get("params"), "bleu": bleu,
                 "bleu_mean": statistics.fmean(bleu), "ci": [rows[s][system]["ci"] for s in seeds],
                 "valid_nll": [nll[system][s] for s in seeds if s in nll[system]] if system in nll else None}
        if all("chrf" in rows[s][system] for s in seeds):  # less moved than BLEU by a student's output length
            entry["chrf"] = [rows[s][system]["chrf"] for s in seeds]
        if system not in (BASELINE, TEACHER):
            entry["difference"] = [rows[s][system]["difference"] for s in seeds]
            entry["p_bootstrap"] = [rows[s][system]["p_bootstrap"] for s in seeds]
        systems.append(entry)
    return {"systems": systems, "verdict": result, "sentence": verdict_sentence(result, names)}


def _unseeded(system: str, seed: str) -> str:
    ending = f"-seed{seed}"
    return system[:-len(ending)] if system.endswith(ending) else system


def _range(values: Sequence[float], signed: bool = False, digits: int = 2) -> str:
    fmt = ("{:+." if signed else "{:.") + f"{digits}f}}"
    mean = fmt.format(statistics.fmean(values))
    return mean if len(values) == 1 else f"{mean} ({fmt.format(min(values))} to {fmt.format(max(values))})"


def summary_markdown(summary: Mapping, names: Mapping[str, str] = NAMES) -> str:
    seeds = summary["verdict"]["seeds"]
    spread = "min to max over " + str(len(seeds)) + " seeds" if len(seeds) > 1 else "one seed"
    chrf = all("chrf" in row for row in summary["systems"])  # (runs recorded before it have no chrF)
    lines = [f"| system | parameters | BLEU, mean ({spread}) | Δ vs no KD of the same seed | largest p "
             f"| best valid nll (bits) |" + (f" chrF, mean ({spread}) |" if chrf else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if chrf else "")]
    for row in summary["systems"]:
        delta = _range(row["difference"], signed=True) if "difference" in row else ""
        p = f"{max(row['p_bootstrap']):.3f}" if "p_bootstrap" in row else ""
        nll = _range(row["valid_nll"], digits=3) if row["valid_nll"] else ""
        bleu = _range(row["bleu"]) if row["system"] != TEACHER else f"{row['bleu'][0]:.2f}"
        params = f"{row['params']:,}" if row["params"] else ""
        cells = [names.get(row["system"], row["system"]), params, bleu, delta, p, nll]
        if chrf:
            cells.append(_range(row["chrf"]) if row["system"] != TEACHER else f"{row['chrf'][0]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + summary["sentence"] + "\n"


def deploy_markdown(deploy: Mapping) -> str:
    """The shipped A2D student's table: fairseq and CTranslate2 float32/int8 against the teacher."""
    teacher = next(row for row in deploy["rows"] if row["role"] == "teacher")
    speed = lambda row: row["measurements"][0]
    lines = [f"| A2D student shipped | BLEU | Δ vs fairseq student | p | sentences/s ({speed(teacher)['threads']} threads, "
             f"batch {speed(teacher)['batch_size']}) | vs teacher | size on disk |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in deploy["rows"]:
        engine = {"fairseq": "fairseq", "ctranslate2": "CTranslate2"}[row["engine"]]
        label = "teacher, fairseq float32" if row["role"] == "teacher" else f"{engine} {row['weights']}"
        identical = (row.get("paired") or {}).get("sentences_differing") == 0
        delta = "" if row["delta"] is None or row["role"] == "teacher" else f"{row['delta']:+.2f}"
        p = "" if row["role"] == "teacher" or row["p_bootstrap"] is None else (
            "identical" if identical else f"{row['p_bootstrap']:.3f}")
        lines.append(f"| {label} | {row['bleu']:.2f} | {delta} | {p} | {speed(row)['sentences_per_s']:.0f} | "
                     f"{speed(row)['speedup_vs_teacher']:.1f}x | {row['size_mb']:.2f} MB |")
    return "\n".join(lines) + "\n"


def _pairs(values: Sequence[str], flag: str) -> List[tuple]:
    pairs = []
    for value in values:
        try:
            key, path = split_name_and_path(value, flag)
        except argparse.ArgumentTypeError as error:
            raise SystemExit(str(error))
        if not path.is_file():
            raise SystemExit(f"{flag} {value!r}: {path} is not a file")
        pairs.append((key, path))
    return pairs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fairseq_kd_recipes.demo_summary",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="append", required=True, metavar="SEED=JSON",
                        help="fairseq-kd-report's JSON for one seed (its baseline no_kd of that seed)")
    parser.add_argument("--log", action="append", default=[], metavar="SYSTEM/SEED=LOG",
                        help="a fairseq-train log, for the system's best validation nll on that seed")
    parser.add_argument("--deploy", type=Path, help="fairseq-kd-deploy-benchmark's JSON (the shipped student)")
    parser.add_argument("--alpha", type=float, default=ALPHA, help="significance level of every paired test")
    parser.add_argument("--out-prefix", type=Path, required=True, help="writes PREFIX.json, PREFIX.md, "
                        "and with --deploy readme_section.md beside them")
    parser.add_argument("--plain-names", action="store_true",
                        help="name the systems as the reports do, not as the demo's README does")
    parser.add_argument("--record-into", type=Path, metavar="JSON",
                        help="add this run and its machine to the full runs of this file (tests/expected/demo.json)")
    return parser


def this_machine() -> Dict:
    """The CPU, its vector extensions and the kernel pins: what a run's last bits depend on."""
    import platform

    from fairseq_kd_recipes.deploy_benchmark import cpu_model_and_flags, machine_info

    info = machine_info()
    _, flags = cpu_model_and_flags()
    return {"cpu": info["cpu"], "avx512f": "avx512f" in flags, "vnni": info["int8_dot_product"] == "VNNI",
            "kernel_pins": info["kernel_pins"], "torch": info["torch"], "python": platform.python_version()}


def record_run(path: Path, summary: Mapping, machine: Mapping) -> None:
    """Put the run into ``path``'s ``full_runs``, replacing a run of the same machine and pins."""
    data = json.loads(path.read_text())
    same = lambda run: (run["machine"]["cpu"], run["machine"]["kernel_pins"]) == (machine["cpu"], machine["kernel_pins"])
    data["full_runs"] = [run for run in data.get("full_runs", []) if not same(run)] + [
        {"machine": dict(machine), "summary": summary}]
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def cli_main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    if not 0 < args.alpha < 1:
        raise SystemExit(f"--alpha {args.alpha}: must lie strictly between 0 and 1")
    reports = {seed: json.loads(path.read_text()) for seed, path in _pairs(args.report, "--report")}
    nll: Dict[str, Dict[str, float]] = {}
    for key, path in _pairs(args.log, "--log"):
        system, _, seed = key.partition("/")
        nll.setdefault(system, {})[seed] = best_valid_nll(path)
    names = {} if args.plain_names else NAMES
    summary = summarise(reports, nll, args.alpha, names)
    prefix = args.out_prefix
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    table = summary_markdown(summary, names)
    prefix.with_suffix(".md").write_text(table)
    if args.deploy:
        section = table + "\n" + deploy_markdown(json.loads(args.deploy.read_text()))
        (prefix.parent / "readme_section.md").write_text(section)
    if args.record_into:
        record_run(args.record_into, summary, this_machine())
    print(table, end="")


if __name__ == "__main__":
    cli_main()
