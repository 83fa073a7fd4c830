"""Text out of the IWSLT (WIT3) release formats and the WMT SGML test sets.

Mirrors the extraction in fairseq's ``examples/translation/prepare-iwslt14.sh``:

* ``train.tags.<pair>.<lang>``: one talk after another, transcript lines interleaved with
  metadata lines.  Lines containing ``<url>``, ``<talkid>`` or ``<keywords>`` are dropped; the
  ``<title>``/``<description>`` tags are deleted but their text is kept, as in fairseq's script
  (the reference IWSLT'14 validation set, taken from the training data, contains talk titles such
  as ``stephen palumbi : following the mercury trail``).  Later WIT3 releases add ``<speaker>``,
  ``<reviewer ...>`` and ``<translator ...>`` lines (and document tags); they are dropped too.
  The 2014 De-En file has none of them, so this changes nothing there.
* ``IWSLT*.xml`` development/test sets and WMT ``.sgm`` files: the content of every line
  containing ``<seg id``, with the ``<seg id="N">`` and ``</seg>`` tags and the whitespace
  around them removed and, optionally, the right single quotation mark U+2019 replaced by an
  apostrophe (fairseq does this for the sets it tokenises with Moses).
"""
from __future__ import annotations

import re
from pathlib import Path

from .errors import PrepareError
from .textio import iter_lines

# Lines dropped from train.tags files (substring match, like ``grep -v``).
METADATA_LINE_MARKERS = ("<url>", "<talkid>", "<keywords>", "<speaker>", "<reviewer", "<translator", "<doc ", "</doc>")
# Tags deleted from train.tags lines while their text is kept (like fairseq's ``sed``).
TALK_HEADER_TAGS = ("<title>", "</title>", "<description>", "</description>")

_SEG_OPEN = re.compile(r'<seg id="[0-9]*">\s*')
_SEG_CLOSE = re.compile(r"\s*</seg>\s*")
RIGHT_SINGLE_QUOTE = "\u2019"


def read_train_tags(path: Path, keep_talk_headers: bool = True) -> list[str]:
    """Transcript lines of a WIT3 ``train.tags.*`` file.

    ``keep_talk_headers=False`` also drops the ``<title>`` and ``<description>`` lines (fairseq
    keeps their text; see the module docstring).
    """
    lines = []
    for line in iter_lines(path):
        if any(marker in line for marker in METADATA_LINE_MARKERS):
            continue
        if not keep_talk_headers and ("<title>" in line or "<description>" in line):
            continue
        for tag in TALK_HEADER_TAGS:
            line = line.replace(tag, "")
        lines.append(line)
    return lines


def read_parallel_train_tags(source: Path, target: Path, keep_talk_headers: bool = True) -> tuple[list[str], list[str]]:
    """Both sides of a WIT3 training corpus; raises if they do not have the same number of lines."""
    source_lines = read_train_tags(source, keep_talk_headers)
    target_lines = read_train_tags(target, keep_talk_headers)
    if len(source_lines) != len(target_lines):
        raise PrepareError(
            f"{source} and {target} are not parallel after removing the metadata lines "
            f"({len(source_lines)} vs {len(target_lines)} lines); the archive may be damaged"
        )
    return source_lines, target_lines


def read_segments(path: Path, straighten_quotes: bool = True) -> list[str]:
    """The ``<seg id="N">`` contents of an IWSLT ``.xml`` or WMT ``.sgm`` file, in file order."""
    segments = []
    for line in iter_lines(path):
        if "<seg id" not in line:
            continue
        line = _SEG_CLOSE.sub("", _SEG_OPEN.sub("", line))
        if straighten_quotes:
            line = line.replace(RIGHT_SINGLE_QUOTE, "'")
        segments.append(line)
    if not segments:
        raise PrepareError(f"{path} contains no <seg id=...> lines; is it an IWSLT .xml or WMT .sgm file?")
    return segments


def read_parallel_segments(source: Path, target: Path, straighten_quotes: bool = True) -> tuple[list[str], list[str]]:
    """Both sides of an XML/SGML set; raises if their segment counts differ."""
    source_lines = read_segments(source, straighten_quotes)
    target_lines = read_segments(target, straighten_quotes)
    if len(source_lines) != len(target_lines):
        raise PrepareError(
            f"{source} and {target} have different numbers of segments ({len(source_lines)} vs {len(target_lines)})"
        )
    return source_lines, target_lines


_SET_NAME = r"TEDX?\.(?:dev|tst)\d{4}"


def xml_set_path(folder: Path, release: str, set_name: str, pair: str, lang: str) -> Path:
    """Path of ``<release>.<set_name>.<pair>.<lang>.xml`` in ``folder`` (e.g. IWSLT14.TED.tst2010.de-en.de.xml).

    ``pair`` and ``lang`` are spelt as the release spells them, which is not always a two-letter
    code: the 2014 release's Portuguese is ``pt-br`` (IWSLT14.TED.dev2010.pt-br-en.pt-br.xml).
    """
    return Path(folder) / f"{release}.{set_name}.{pair}.{lang}.xml"


def available_xml_sets(folder: Path, release: str, pair: str, lang: str) -> list[str]:
    """Set names (``TED.dev2010``, ``TEDX.dev2012``, ...) present in ``folder`` for one side.

    Ordered development sets first, then test sets, each by year (TED before TEDX in a year):
    for IWSLT'14 De-En this is fairseq's test concatenation order
    dev2010, TEDX.dev2012, tst2010, tst2011, tst2012.
    """
    # The pair and language are matched literally: a pattern for one-part codes (``[a-z]+-[a-z]+``)
    # missed the 2014 release's pt-br-en sets.
    pattern = re.compile(rf"^{re.escape(release)}\.(?P<set>{_SET_NAME})\.{re.escape(pair)}\.{re.escape(lang)}\.xml$")
    names = []
    for path in Path(folder).glob(f"{release}.*.{pair}.{lang}.xml"):
        match = pattern.match(path.name)
        if match:
            names.append(match.group("set"))

    def order(name: str) -> tuple[int, str, str]:
        kind_and_year = name.split(".")[1]
        return (0 if kind_and_year.startswith("dev") else 1, kind_and_year[3:], name.split(".")[0])

    return sorted(names, key=order)
