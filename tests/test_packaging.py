"""Packaging: ``pip install .`` / ``pip install -e .`` into an environment that already has torch
and fairseq keeps both, and the package's metadata declares what the plugin imports.

pip runs with ``--dry-run --report`` on a copy of the project (so neither the project's venv nor
its checkout is touched) and the report says what pip *would* install.
"""
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import QUIET_ENV, REPO

# pip's words for "could not reach or read the package index"
OFFLINE_MARKERS = ("Could not find a version", "No matching distribution", "NewConnectionError",
                   "Network is unreachable", "Temporary failure in name resolution",
                   "Max retries exceeded", "ConnectTimeout", "ReadTimeout")
#: the installed packages and their folders in the checkout (pyproject.toml's packages.find)
PACKAGE_DIRS = {"fairseq_kd": "fairseq_kd", "fairseq_kd_recipes": "examples/translation/fairseq_kd_recipes"}
NEVER_INSTALLED = {"torch", "torchaudio", "torchvision", "fairseq", "fairseq-fixed", "numpy"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _copy_project(destination: Path) -> Path:
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, destination / name)
    for package in PACKAGE_DIRS.values():
        shutil.copytree(REPO / package, destination / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return destination


def _dry_run(project: Path, editable: bool, report: Path, extras: str = "") -> dict:
    target = ["-e", str(project) + extras] if editable else [str(project) + extras]
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
           "--no-build-isolation", *target]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=QUIET_ENV, cwd=project, timeout=600)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if any(marker in output for marker in OFFLINE_MARKERS):
            pytest.skip(f"package index unreachable for pip's dry run: {output.strip().splitlines()[-1]}")
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-4000:]}")
    return json.loads(report.read_text())


@pytest.mark.parametrize("editable", [True, False], ids=["pip-install-e", "pip-install"])
def test_pip_install_keeps_installed_torch_and_fairseq(tmp_path, editable):
    pytest.importorskip("fairseq")  # the situation under test: fairseq is already installed
    (tmp_path / "project").mkdir()
    project = _copy_project(tmp_path / "project")
    report = _dry_run(project, editable, tmp_path / "report.json")

    installs = {_canonical(item["metadata"]["name"]): item for item in report["install"]}
    assert "fairseq-kd" in installs, f"pip would not install the package: {sorted(installs)}"
    replaced = sorted(NEVER_INSTALLED & set(installs))
    assert not replaced, (f"pip would install {replaced} over the environment's own "
                          f"(would install: {sorted(installs)})")

    metadata = installs["fairseq-kd"]["metadata"]
    requires = {_canonical(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]): req
                for req in metadata.get("requires_dist", [])}
    for needed in ("torch", "numpy", "sacrebleu", "sentencepiece", "subword-nmt", "sacremoses",
                   "matplotlib", "tensorboardx", "tqdm"):
        assert needed in requires, f"{needed} is not declared (declared: {sorted(requires)})"
    # torch: a lower bound only, so any installed torch >= 2.4 satisfies it
    assert not re.search(r"(==|<|~=)", requires["torch"]), requires["torch"]
    # fairseq is brought by the user (stock 0.12.2 does not build on Python 3.11)
    assert not {"fairseq", "fairseq-fixed"} & set(requires)
    # the lowest Python the code runs on (tests/test_supported_versions.py), not the tested one
    assert metadata["requires_python"] == ">=3.8"


def test_entry_points_declared():
    text = (REPO / "pyproject.toml").read_text()
    for script in ("fairseq-kd-score", "fairseq-kd-report", "fairseq-kd-plot", "fairseq-kd-export",
                   "fairseq-kd-make-corpus", "fairseq-kd-seqkd", "fairseq-kd-recipe"):
        module = re.search(rf'^{script} = "([\w.]+):cli_main"$', text, re.MULTILINE)
        assert module, f"{script} is not a console script in pyproject.toml"
        package, _, rest = module.group(1).partition(".")
        assert (REPO / PACKAGE_DIRS[package] / (rest.replace(".", "/") + ".py")).is_file(), module.group(1)
    assert not (REPO / "setup.py").exists(), "setup.py and pyproject.toml would disagree"


def test_register_names_the_fix_when_fairseq_is_missing_or_old(tmp_path):
    """A stub ``fairseq`` package first on sys.path stands for a missing or old install."""
    code = ("import fairseq_kd\n"
            "try:\n    fairseq_kd.register()\n"
            "except fairseq_kd.FairseqMissingError as e:\n    print('REFUSED', e)\n")
    old = tmp_path / "old"
    (old / "fairseq").mkdir(parents=True)
    (old / "fairseq" / "__init__.py").write_text("__version__ = '0.10.2'\n")
    missing = tmp_path / "missing"
    (missing / "fairseq").mkdir(parents=True)
    (missing / "fairseq" / "__init__.py").write_text("raise ImportError('No module named fairseq')\n")
    for stub, expected in ((old, "found 0.10.2"), (missing, "cannot be imported")):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**QUIET_ENV, "PYTHONPATH": str(stub)}, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "REFUSED" in proc.stdout and expected in proc.stdout, proc.stdout
        assert "fairseq-fixed==0.12.3.1" in proc.stdout and "--no-build-isolation" in proc.stdout


def test_the_hf_extra_keeps_installed_torch(tmp_path):
    """``pip install '.[hf]'`` (Hugging Face teachers) brings transformers 5 and sentencepiece within
    their stated bounds and replaces neither torch nor fairseq."""
    pytest.importorskip("fairseq")
    (tmp_path / "project").mkdir()
    project = _copy_project(tmp_path / "project")
    report = _dry_run(project, False, tmp_path / "report.json", extras="[hf]")
    installs = {_canonical(item["metadata"]["name"]): item for item in report["install"]}
    assert not NEVER_INSTALLED & set(installs), sorted(installs)
    requires = installs["fairseq-kd"]["metadata"].get("requires_dist", [])
    assert any(req.startswith("transformers<6,>=5") or req.startswith("transformers>=5,<6") for req in requires), requires
    assert any(req.startswith("sentencepiece") and 'extra == "hf"' in req for req in requires), requires


def test_wheel_holds_every_module_and_the_console_scripts(tmp_path):
    """What `pip install .` installs: a wheel built from the project (without deps or isolation)."""
    import zipfile

    (tmp_path / "project").mkdir()
    project = _copy_project(tmp_path / "project")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(tmp_path / "dist"), str(project)],
                          capture_output=True, text=True, env=QUIET_ENV, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("fairseq_kd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {f"{package}/{p.relative_to(project / folder)}" for package, folder in PACKAGE_DIRS.items()
               for p in (project / folder).rglob("*.py")}
    assert modules and not modules - names, f"missing from the wheel: {sorted(modules - names)[:10]}"
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "fairseq-kd-seqkd = fairseq_kd.cli.seqkd_decode:cli_main" in text
    assert "fairseq-kd-recipe = fairseq_kd_recipes.recipe:cli_main" in text
    assert not any(name.startswith("tests/") for name in names)


def test_the_plugin_imports_no_preparation_or_recipe_code():
    """What ``fairseq-train --user-dir fairseq_kd`` imports (the package, registered with fairseq)
    loads neither corpus preparation nor the recipe engine (they live in fairseq_kd_recipes) nor
    transformers."""
    code = ("import sys, fairseq, fairseq_kd\n"
            "fairseq_kd.register()\n"
            "print('transformers imported' if 'transformers' in sys.modules else 'no transformers')\n"
            "print(sorted(name for name in sys.modules if name.startswith('fairseq_kd')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**QUIET_ENV, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = proc.stdout.strip().splitlines()[-1]
    assert "fairseq_kd.criterions" in loaded and "fairseq_kd.tasks" in loaded, loaded
    assert "fairseq_kd_recipes" not in loaded and "prepare" not in loaded and "recipe" not in loaded, loaded
    # transformers is imported only when a Hugging Face teacher is asked for (models/hf_teacher.py)
    assert proc.stdout.strip().splitlines()[-2] == "no transformers", proc.stdout[-2000:]


def test_recipes_run_from_a_non_editable_install_outside_the_checkout(tmp_path):
    """``pip install .`` (a wheel, no ``examples/`` folder beside it) into a folder of its own, run
    from a folder outside the checkout: ``fairseq-kd-recipe --print-commands`` names only installed
    files, and the preparation command it prints prepares the corpus (Multi30k's smoke settings on
    a few hundred pairs in the release's layout)."""
    from test_recipe import build_multi30k_release

    (tmp_path / "project").mkdir()
    project = _copy_project(tmp_path / "project")
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                           "--target", str(target), str(project)],
                          capture_output=True, text=True, env=QUIET_ENV, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    shutil.rmtree(project)  # nothing may come from the copy it was built from
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    release = build_multi30k_release(tmp_path / "release")
    env = {**QUIET_ENV, "PYTHONPATH": str(target)}  # before the checkout's editable install
    recipe = [str(target / "bin" / "fairseq-kd-recipe"), "multi30k_fr_en", "--profile", "smoke", "--methods", "no_kd",
              "--archives", str(release), "--workdir", str(elsewhere / "work"), "--print-commands"]
    proc = subprocess.run(recipe, capture_output=True, text=True, env=env, cwd=elsewhere, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    commands = {}
    for block in proc.stdout.split("\n# [")[1:]:
        name, _, rest = block.partition("]")
        commands[name] = shlex.split(rest.splitlines()[1])
    # Every file a command names is installed, the environment's (interpreter, fairseq's commands),
    # the archives' or the working folder's: none of the checkout.
    allowed = [str(place) for place in (target, Path(sys.executable).parent, release, elsewhere)]
    for name, command in commands.items():
        paths = [arg.partition("=")[2] if "=/" in arg else arg for arg in command]
        foreign = [path for path in paths if path.startswith("/") and not path.startswith(tuple(allowed))]
        assert not foreign, f"{name} names files outside the installed package: {foreign}"
    train = commands["train-teacher"]
    assert train[train.index("--user-dir") + 1] == str(target / "fairseq_kd")
    prepare = commands["prepare"]
    assert prepare[1:3] == ["-m", "fairseq_kd_recipes.prepare.scripts.multi30k_fr_en"]
    proc = subprocess.run(prepare, capture_output=True, text=True, env=env, cwd=elsewhere, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = Path(prepare[prepare.index("--dest") + 1])
    prepared = json.loads((data / "prepare.json").read_text())
    assert prepared["corpus"] == "multi30k.fr-en" and prepared["sizes"]["train"] == 300
    assert all((data / f"{split}.fr-en.{lang}.bin").is_file() for split in ("train", "valid", "test") for lang in ("fr", "en"))
    # the modules that ran were the installed ones
    check = subprocess.run([sys.executable, "-c", "import fairseq_kd, fairseq_kd_recipes.prepare.scripts as s; "
                            "print(fairseq_kd.__file__); print(s.__file__)"],
                           capture_output=True, text=True, env=env, cwd=elsewhere, timeout=120)
    assert all(line.startswith(str(target)) for line in check.stdout.split()), check.stdout + check.stderr
