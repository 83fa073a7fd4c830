"""Downloads: resume over HTTP Range, verification, mirrors, and the --archives folder.

A local HTTP server (http.server on 127.0.0.1 in a thread) serves the files; it can cut the
connection after some bytes, ignore Range requests, or answer 404.  Expected checksums are
computed here with hashlib, independently of the code under test.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fairseq_kd_recipes.prepare.download import Fetcher, RemoteFile, load_pinned_checksums
from fairseq_kd_recipes.prepare.errors import PrepareError

PAYLOAD = bytes(range(256)) * 4000 + b"tail"  # 1,024,004 bytes: more than one read chunk


class _Handler(BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    cut_first_after: int | None = None  # send only this many bytes on the first full request
    honour_range = True
    requests: list[dict] = []

    def log_message(self, *args):  # keep the test output clean
        pass

    def do_GET(self):
        type(self).requests.append({"path": self.path, "range": self.headers.get("Range")})
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404, "Not Found")
            return
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if match and self.honour_range:
            start = int(match.group(1))
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        chunk = body[start:]
        if type(self).cut_first_after is not None:
            chunk = chunk[: type(self).cut_first_after]
            type(self).cut_first_after = None
            self.close_connection = True
        self.wfile.write(chunk)
        self.wfile.flush()


@pytest.fixture
def server():
    handler = type("Handler", (_Handler,), {"files": {"/data/corpus.tgz": PAYLOAD}, "requests": [],
                                             "cut_first_after": None, "honour_range": True})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _remote(base: str, **known) -> RemoteFile:
    return RemoteFile(name="corpus.tgz", urls=(f"{base}/data/corpus.tgz",), **known)


def test_download_verifies_sha256_and_records_nothing_when_pinned(server, tmp_path):
    handler, base = server
    remote = _remote(base, sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD))
    path = Fetcher(tmp_path / "downloads", retry_wait=0).fetch(remote)
    assert path == tmp_path / "downloads" / "corpus.tgz"
    assert path.read_bytes() == PAYLOAD
    assert not (tmp_path / "downloads" / "corpus.tgz.part").exists()
    assert not (tmp_path / "downloads" / "checksums.json").exists()
    # A second fetch finds the verified file and does not touch the network.
    count = len(handler.requests)
    assert Fetcher(tmp_path / "downloads").fetch(remote) == path
    assert len(handler.requests) == count


def test_interrupted_download_resumes_with_range(server, tmp_path):
    handler, base = server
    handler.cut_first_after = 300_000
    remote = _remote(base, sha256=hashlib.sha256(PAYLOAD).hexdigest())
    fetcher = Fetcher(tmp_path, retries=0, retry_wait=0)
    with pytest.raises(PrepareError, match="corpus.tgz.*partial file .*corpus.tgz.part is kept"):
        fetcher.fetch(remote)
    part = tmp_path / "corpus.tgz.part"
    assert part.read_bytes() == PAYLOAD[:300_000]
    # The next run asks only for the missing bytes and completes the file.
    path = fetcher.fetch(remote)
    assert handler.requests[-1]["range"] == "bytes=300000-"
    assert path.read_bytes() == PAYLOAD
    assert not part.exists()


def test_retry_within_one_run_resumes(server, tmp_path):
    handler, base = server
    handler.cut_first_after = 1000
    path = Fetcher(tmp_path, retries=1, retry_wait=0).fetch(_remote(base, md5=hashlib.md5(PAYLOAD).hexdigest()))
    assert path.read_bytes() == PAYLOAD
    assert [r["range"] for r in handler.requests] == [None, "bytes=1000-"]


def test_server_ignoring_range_restarts_from_zero(server, tmp_path):
    handler, base = server
    handler.cut_first_after = 5000
    handler.honour_range = False
    path = Fetcher(tmp_path, retries=1, retry_wait=0).fetch(_remote(base, size=len(PAYLOAD)))
    assert path.read_bytes() == PAYLOAD  # not the first 5000 bytes twice


def test_complete_part_file_is_accepted_after_416(server, tmp_path):
    handler, base = server
    (tmp_path / "corpus.tgz.part").write_bytes(PAYLOAD)
    (tmp_path / "corpus.tgz.part.url").write_text(f"{base}/data/corpus.tgz", encoding="utf-8")
    path = Fetcher(tmp_path, retries=0).fetch(_remote(base, sha256=hashlib.sha256(PAYLOAD).hexdigest()))
    assert handler.requests[-1]["range"] == f"bytes={len(PAYLOAD)}-"
    assert path.read_bytes() == PAYLOAD


def test_checksum_mismatch_is_an_error_naming_file_and_checksum(server, tmp_path):
    _, base = server
    wrong = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(PrepareError) as error:
        Fetcher(tmp_path, retries=0).fetch(_remote(base, sha256=wrong))
    message = str(error.value)
    assert "corpus.tgz" in message and wrong in message and "corrupt" in message
    assert hashlib.sha256(PAYLOAD).hexdigest() in message  # what was received
    assert not (tmp_path / "corpus.tgz").exists() and not (tmp_path / "corpus.tgz.part").exists()


def test_size_mismatch_is_an_error(server, tmp_path):
    _, base = server
    with pytest.raises(PrepareError, match=r"size is 1024004 bytes, expected 1024000"):
        Fetcher(tmp_path, retries=0).fetch(_remote(base, size=1024000))


def test_unpinned_download_prints_and_records_sha256(server, tmp_path, caplog):
    _, base = server
    expected = hashlib.sha256(PAYLOAD).hexdigest()
    with caplog.at_level(logging.WARNING):
        Fetcher(tmp_path, retries=0).fetch(_remote(base))
    assert expected in caplog.text
    assert json.loads((tmp_path / "checksums.json").read_text()) == {"corpus.tgz": expected}
    # The recorded file is accepted as --checksums and then pins the checksum.
    assert load_pinned_checksums(tmp_path / "checksums.json") == {"corpus.tgz": expected}


def test_missing_url_falls_through_to_next_mirror(server, tmp_path):
    handler, base = server
    remote = RemoteFile(name="corpus.tgz", urls=(f"{base}/gone/corpus.tgz", f"{base}/data/corpus.tgz"),
                        sha256=hashlib.sha256(PAYLOAD).hexdigest())
    assert Fetcher(tmp_path, retries=2, retry_wait=0).fetch(remote).read_bytes() == PAYLOAD
    assert [r["path"] for r in handler.requests] == ["/gone/corpus.tgz", "/data/corpus.tgz"]  # no retry on 404


def test_unreachable_host_error_mentions_archives(tmp_path):
    remote = RemoteFile(name="corpus.tgz", urls=("http://127.0.0.1:9/corpus.tgz",))
    with pytest.raises(PrepareError, match="could not download corpus.tgz.*--archives"):
        Fetcher(tmp_path, retries=0, timeout=2).fetch(remote)


def test_archives_folder_is_used_without_network(tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    (archives / "corpus.tgz").write_bytes(PAYLOAD)
    remote = RemoteFile(name="corpus.tgz", urls=("http://127.0.0.1:9/never-contacted",),
                        sha256=hashlib.sha256(PAYLOAD).hexdigest())
    assert Fetcher(tmp_path / "downloads", archives_dir=archives).fetch(remote) == archives / "corpus.tgz"


def test_archives_folder_missing_file_names_it(tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    digest = hashlib.sha256(PAYLOAD).hexdigest()
    remote = RemoteFile(name="corpus.tgz", urls=("https://example.org/corpus.tgz",), sha256=digest)
    with pytest.raises(PrepareError) as error:
        Fetcher(tmp_path, archives_dir=archives).fetch(remote)
    assert "corpus.tgz is missing from --archives" in str(error.value)
    assert digest in str(error.value) and "https://example.org/corpus.tgz" in str(error.value)


def test_archives_folder_corrupt_file_names_it(tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    (archives / "corpus.tgz").write_bytes(PAYLOAD[:-1])
    remote = RemoteFile(name="corpus.tgz", urls=("https://example.org/corpus.tgz",),
                        md5=hashlib.md5(PAYLOAD).hexdigest())
    with pytest.raises(PrepareError, match=r"archives/corpus.tgz is corrupt.*md5"):
        Fetcher(tmp_path / "downloads", archives_dir=archives).fetch(remote)


def test_pinned_checksum_overrides_manifest(tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    (archives / "corpus.tgz").write_bytes(PAYLOAD)
    remote = RemoteFile(name="corpus.tgz", urls=("https://example.org/corpus.tgz",))
    pinned = {"corpus.tgz": hashlib.sha256(b"another release").hexdigest()}
    with pytest.raises(PrepareError, match="sha256"):
        Fetcher(tmp_path / "d", archives_dir=archives, pinned_sha256=pinned).fetch(remote)


def test_downloaded_file_changed_afterwards_is_reported(server, tmp_path):
    _, base = server
    remote = _remote(base, sha256=hashlib.sha256(PAYLOAD).hexdigest())
    path = Fetcher(tmp_path, retries=0).fetch(remote)
    with open(path, "r+b") as handle:
        handle.write(b"X")
    os.utime(path, ns=(1, 1))  # the digest cache must notice the change
    with pytest.raises(PrepareError, match=f"{re.escape(str(path))} is corrupt.*delete"):
        Fetcher(tmp_path, retries=0).fetch(remote)


@pytest.mark.parametrize("content", ["[]", '{"a.tgz": "abc"}', "not json"])
def test_bad_checksums_file_is_rejected(tmp_path, content):
    path = tmp_path / "sums.json"
    path.write_text(content)
    with pytest.raises(PrepareError, match="--checksums"):
        load_pinned_checksums(path)


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_a_download_shows_bytes_rate_and_time_left_on_a_terminal_only(server, tmp_path, monkeypatch, caplog):
    """No terminal (a log file): a line every 10%, no bar. A terminal: a bar in bytes with rate and
    time left, starting where the resumed transfer starts, and no percentage lines through it."""
    handler, base = server
    handler.cut_first_after = 300_000
    remote = _remote(base, sha256=hashlib.sha256(PAYLOAD).hexdigest())
    fetcher = Fetcher(tmp_path, retries=0, retry_wait=0)
    with caplog.at_level(logging.INFO, logger="fairseq_kd_recipes.prepare.download"):
        with pytest.raises(PrepareError):
            fetcher.fetch(remote)
        assert f"corpus.tgz: 29% of {len(PAYLOAD)} bytes" in caplog.text
        caplog.clear()
        terminal = _FakeTerminal()
        monkeypatch.setattr("sys.stderr", terminal)
        assert fetcher.fetch(remote).read_bytes() == PAYLOAD
    shown = terminal.getvalue()
    assert "% of" not in caplog.text and "corpus.tgz: 100%" in shown, shown
    assert re.search(r" 29%\|.*\| 293k/0\.98M \[", shown), shown  # resumed at byte 300,000 of 1,024,004
    assert re.search(r"0\.98M/0\.98M \[[\d:]+<[\d:]+, +[\d.]+[kMG]?B/s\]", shown), shown
