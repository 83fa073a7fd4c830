"""fairseq-kd: knowledge distillation for fairseq translation Transformers.

Install with ``scripts/setup_env.sh`` (it pins torch and builds fairseq-fixed without build
isolation); ``pip install -e .`` alone deliberately declares no dependencies so that no resolver can
replace the installed torch.
"""
from setuptools import find_packages, setup

setup(
    name="fairseq-kd",
    version="0.1.0",
    description="Knowledge distillation methods for fairseq encoder-decoder Transformers",
    python_requires=">=3.11",
    packages=find_packages(include=["fairseq_kd", "fairseq_kd.*"]),
    # Dependencies are installed by scripts/setup_env.sh in a fixed order (see its header).
    install_requires=[],
    entry_points={
        "console_scripts": [
            "fairseq-kd-score = fairseq_kd.cli.score:cli_main",
            "fairseq-kd-report = fairseq_kd.cli.report:cli_main",
            "fairseq-kd-plot = fairseq_kd.cli.plot:cli_main",
            "fairseq-kd-export = fairseq_kd.cli.export_student:cli_main",
            "fairseq-kd-make-corpus = fairseq_kd.cli.make_corpus:cli_main",
            "fairseq-kd-seqkd = fairseq_kd.cli.seqkd_decode:cli_main",
            "fairseq-kd-recipe = fairseq_kd.cli.recipe:cli_main",
        ]
    },
)
