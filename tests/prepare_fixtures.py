"""Builders of small corpora in the original release formats, shared by tests/test_prepare_*.py.

* WIT3 (IWSLT) archives: ``<pair>/train.tags.<pair>.<lang>`` (languages spelt as the release
  spells them: the 2014 release's Portuguese is ``pt-br``, ``pt-br-en/train.tags.pt-br-en.pt-br``)
  with the talk metadata lines of the release (``<url>``, ``<keywords>``, ``<talkid>``,
  ``<title>``, ``<description>``; plus ``<speaker>``, ``<reviewer href=...>``,
  ``<translator href=...>`` in the 2017 style) and the ``IWSLT*.xml`` development/test sets with
  their ``mteval``/``doc``/``seg`` structure;
* WMT SGML test sets (``<srcset>``/``<doc>``/``<seg>``);
* the Multitarget TED Talks archive (Duh 2018): ``multitarget-ted/en-<lang>/raw/`` with
  ``ted_{train,dev,test1}_en-<lang>.raw.{<lang>,en}`` and ``tok/`` copies (``.tok.``, and
  ``.tok.clean.`` for train: lowercased and tokenised), as its README.txt describes;
* a deterministic synthetic bilingual text for when ../shared/data is absent.
"""
from __future__ import annotations

import importlib.util
import io
import random
import re
import tarfile
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
IWSLT14_DATA = SHARED_DATA / "iwslt14-de-en"


def load_entry_point(relative_path: str) -> ModuleType:
    """Import an ``examples/translation/*/prepare.py`` script as a module (to call ``cli_main``)."""
    path = REPO_ROOT / relative_path
    spec = importlib.util.spec_from_file_location(f"entry_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_to_tar(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode("utf-8")
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def train_tags_text(lines: list[str], lang: str, talk_size: int = 25, style: int = 2014) -> str:
    """A ``train.tags`` file: talks of ``talk_size`` transcript lines, each after its metadata lines."""
    out = []
    for talk, start in enumerate(range(0, len(lines), talk_size), start=1):
        out.append(f"<url>http://www.ted.com/talks/lang/{lang}/speaker_{talk}.html</url>")
        out.append(f"<keywords>talks, science, {lang}</keywords>")
        if style >= 2017:
            out.append(f"<speaker>Speaker {talk}</speaker>")
        out.append(f"<talkid>{1000 + talk}</talkid>")
        out.append(f"<title>Speaker {talk} ({lang}): Talk title number {talk}</title>")
        out.append(f"<description>TED talk {talk} description in {lang}.</description>")
        if style >= 2017:
            out.append(f'<reviewer href="http://www.ted.com/profiles/{talk}">Reviewer {talk}</reviewer>')
            out.append(f'<translator href="http://www.ted.com/profiles/{talk + 50}">Translator {talk}</translator>')
        out.extend(lines[start:start + talk_size])
    return "\n".join(out) + "\n"


def xml_set_text(segments: list[str], setid: str, side: str, lang: str) -> str:
    """An IWSLT ``.xml`` development/test file (``side``: ``srcset`` or ``refset``)."""
    attributes = f'setid="{setid}" srclang="{lang}"' + (f' trglang="{lang}" refid="ref"' if side == "refset" else "")
    out = ['<?xml version="1.0" encoding="UTF-8"?>', "<mteval>", f"<{side} {attributes}>"]
    for doc, start in enumerate(range(0, len(segments), 20), start=1):
        out += [f'<doc docid="{doc}" genre="lectures">', f"<url>http://www.ted.com/talks/{doc}.html</url>",
                f"<description>Description {doc}</description>", "<keywords>talks</keywords>",
                f"<talkid>{doc}</talkid>", f"<title>Title {doc}</title>"]
        out += [f'<seg id="{i}"> {text} </seg>' for i, text in enumerate(segments[start:start + 20], start=1)]
        out.append("</doc>")
    out += [f"</{side}>", "</mteval>"]
    return "\n".join(out) + "\n"


def truncated_xml(path: Path, segments: int) -> str:
    """The first ``segments`` segments of a real IWSLT ``.xml`` file, with its header, tags closed."""
    kept, seen = [], 0
    for line in path.read_text(encoding="utf-8").split("\n"):
        if "<seg id" in line:
            if seen == segments:
                break
            seen += 1
        kept.append(line)
    side = "srcset" if any("<srcset" in line for line in kept) else "refset"
    return "\n".join(kept + ["</doc>", f"</{side}>", "</mteval>"]) + "\n"


def build_wit3_archive(
    archive: Path,
    pair: str | tuple[str, str],
    release: str,
    train: tuple[list[str], list[str]],
    sets: dict[str, tuple[str, str]],
    style: int = 2014,
) -> Path:
    """A ``<pair>.tgz`` in the WIT3 layout; ``sets`` maps a set name to its two XML texts.

    ``pair``: ``"de-en"``, or the two languages as WIT3 spells them where one has a region
    (``("pt-br", "en")``: ``pt-br-en/train.tags.pt-br-en.pt-br``,
    ``pt-br-en/IWSLT14.TED.dev2010.pt-br-en.pt-br.xml``).
    """
    first, second = pair if isinstance(pair, tuple) else pair.split("-")
    pair = f"{first}-{second}"
    with tarfile.open(archive, "w:gz") as tar:
        for lang, lines in zip((first, second), train):
            add_to_tar(tar, f"{pair}/train.tags.{pair}.{lang}", train_tags_text(lines, lang, style=style))
        for set_name, texts in sets.items():
            for lang, text in zip((first, second), texts):
                add_to_tar(tar, f"{pair}/{release}.{set_name}.{pair}.{lang}.xml", text)
        add_to_tar(tar, f"{pair}/README", "Fake WIT3 release built by the fairseq-kd tests.\n")
    return archive


def build_multitarget_ted_archive(
    archive: Path,
    sets: dict[str, dict[str, tuple[list[str], list[str]]]],
) -> Path:
    """A ``multitarget-ted.tgz`` in the release's layout.

    ``sets`` maps a foreign language (``"tr"``) to its ``train``/``dev``/``test1`` pairs (foreign
    side, English side): ``multitarget-ted/en-tr/raw/ted_dev_en-tr.raw.tr`` and ``.raw.en``, the
    lowercased, tokenised ``tok/ted_dev_en-tr.tok.{tr,en}`` (and ``tok/ted_train_en-tr.tok.clean.*``),
    next to the release's ``README.txt`` and ``talkids/`` folder.
    """
    def tokenized(line: str) -> str:
        return " ".join(re.findall(r"\w+|[^\w\s]", line.lower()))

    with tarfile.open(archive, "w:gz") as tar:
        add_to_tar(tar, "multitarget-ted/README.txt", "Multitarget TED Talks Task (fake, built by the fairseq-kd tests)\n")
        add_to_tar(tar, "multitarget-ted/talkids/shared-dev", "1\n2\n")
        for lang, splits in sets.items():
            folder = f"multitarget-ted/en-{lang}"
            for split, sides in splits.items():
                for side, lines in zip((lang, "en"), sides):
                    add_to_tar(tar, f"{folder}/raw/ted_{split}_en-{lang}.raw.{side}", "\n".join(lines) + "\n")
                    tok = "\n".join(tokenized(line) for line in lines) + "\n"
                    add_to_tar(tar, f"{folder}/tok/ted_{split}_en-{lang}.tok.{side}", tok)
                    if split == "train":
                        add_to_tar(tar, f"{folder}/tok/ted_{split}_en-{lang}.tok.clean.{side}", tok)
    return archive


def sgm_text(segments: list[str], setid: str, lang: str, side: str = "srcset") -> str:
    """A WMT ``.sgm`` file."""
    out = [f'<{side} setid="{setid}" srclang="any" trglang="{lang}">', f'<doc sysid="ref" docid="doc-1" genre="news" origlang="{lang}">', "<p>"]
    out += [f'<seg id="{i}">{text}</seg>' for i, text in enumerate(segments, start=1)]
    out += ["</p>", "</doc>", f"</{side}>"]
    return "\n".join(out) + "\n"


_WORDS = {  # position i of every list is (roughly) the same word
    "zh": "那 房子 是 大 和 老 我们 看见 那 树 在 花园 今天 早上 孩子们 玩 高兴地 外面".split(),
    "de": "das haus ist groß und alt wir sehen den baum im garten heute morgen kinder spielen gern draußen".split(),
    "en": "the house is big and old we see the tree in garden today morning children play gladly outside".split(),
    "pt": "a casa é grande e velha nós vemos a árvore no jardim hoje manhã crianças brincam lá fora".split(),
    "tr": "bu ev çok büyük ve eski biz görüyoruz şu ağacı içinde bahçe bugün sabah çocuklar oynuyor severek dışarıda".split(),
    "dsb": "ten dom jo wjeliki a stary my wiźimy ten bom w zagroźe źinsa zajtša źiśi grajkaju rad wenka".split(),
    "fr": "la maison est grande et vieille nous voyons l' arbre dans jardin aujourd'hui matin enfants jouent volontiers dehors".split(),
}


def synthetic_parallel(count: int, source: str, target: str, seed: int = 0) -> tuple[list[str], list[str]]:
    """``count`` sentence pairs: the same word positions drawn from parallel word lists, cased
    and punctuated, so both sides have equal lengths (the cleaning keeps them all)."""
    rng = random.Random(seed)
    source_lines, target_lines = [], []
    for _ in range(count):
        positions = [rng.randrange(len(_WORDS["en"])) for _ in range(rng.randint(3, 12))]
        punctuation = rng.choice([".", "!", "?"])
        for lang, out in ((source, source_lines), (target, target_lines)):
            words = [_WORDS[lang][p] for p in positions]
            if lang == "zh":  # written without spaces, with a full-width full stop
                out.append("".join(words) + "。")
            else:
                out.append(" ".join(words).capitalize() + punctuation)
    return source_lines, target_lines
