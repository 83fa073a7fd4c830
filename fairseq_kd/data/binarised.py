"""The files of a binarised fairseq split."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import List


def split_files(data: Path, split: str, src: str, tgt: str) -> List[Path]:
    """Binary files of ``split`` and its fairseq continuation parts ``split1``, ``split2``, ...
    (either language-pair naming), in the order fairseq's translation task concatenates them."""
    data = Path(data)
    files: List[Path] = []
    for k in itertools.count():
        name = split + (str(k) if k > 0 else "")
        for pair in (f"{src}-{tgt}", f"{tgt}-{src}"):
            stem = data / f"{name}.{pair}"
            if (data / f"{stem.name}.{src}.idx").is_file():
                files += sorted(p for p in data.glob(f"{stem.name}.*") if p.suffix in (".bin", ".idx"))
                break
        else:
            return files
