"""Where the `ballast` CLI sends the admin token, and the pid files it writes and believes
(ballast/ops/cli.py: read_pid, write_pid, default_url, stop)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from ballast.ops import cli
from ballast.ops.cli import DEFAULT_URL, default_url, is_loopback_url, main, read_pid, write_pid


def _pid(run: Path, port: int, url: str, mode: int = 0o600, **extra: Any) -> Path:
    run.mkdir(exist_ok=True)
    path = run / f"ballast-{port}.pid"
    path.write_text(json.dumps({"pid": 1, "url": url, **extra}))
    path.chmod(mode)
    return path


def test_a_pid_file_is_believed_only_when_it_is_the_operators_own(tmp_path: Path) -> None:
    run = tmp_path / ".run"
    path = _pid(run, 8123, "http://127.0.0.1:8123")
    assert default_url(run) == "http://127.0.0.1:8123"
    for mode in (0o620, 0o602, 0o666):  # writable by the group or by anyone
        path.chmod(mode)
        assert read_pid(path) is None and default_url(run) == DEFAULT_URL, oct(mode)
    path.chmod(0o644)
    assert default_url(run) == "http://127.0.0.1:8123"  # readable by others is fine
    run.chmod(0o777)  # a directory anyone may write: anyone may have put it there
    assert default_url(run) == DEFAULT_URL
    run.chmod(0o700)
    if os.geteuid() == 0:  # someone else's file
        os.chown(path, 65534, 65534)
        assert default_url(run) == DEFAULT_URL
        os.chown(path, 0, 0)
    assert default_url(run) == "http://127.0.0.1:8123"


def test_a_symlink_is_never_followed_for_a_pid_file_or_its_directory(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    target = _pid(elsewhere, 8123, "http://127.0.0.1:8123")
    run = tmp_path / ".run"
    run.mkdir()
    (run / "ballast-8123.pid").symlink_to(target)
    assert read_pid(run / "ballast-8123.pid") is None and default_url(run) == DEFAULT_URL
    linked = tmp_path / "linked"
    linked.symlink_to(elsewhere)
    assert read_pid(linked / "ballast-8123.pid") is None


def test_only_a_loopback_url_of_a_pid_file_is_used(tmp_path: Path) -> None:
    run = tmp_path / ".run"
    for url in (
        "http://attacker.example:8000",
        "http://10.0.0.5:8000",
        "file:///etc/passwd",
        "http://127.0.0.1:notaport",
    ):
        _pid(run, 8123, url)
        assert default_url(run) == DEFAULT_URL, url
    _pid(run, 8123, "http://localhost:8123", admin_url="http://127.0.0.1:9123")
    assert default_url(run) == "http://127.0.0.1:9123"  # the admin port, when the stack has one
    _pid(run, 8123, "http://127.0.0.1:8123", admin_url="http://attacker.example:9123")
    assert default_url(run) == DEFAULT_URL
    assert is_loopback_url("http://[::1]:8000") and is_loopback_url("http://127.1.2.3")
    assert not is_loopback_url("http://0.0.0.0:8000")


class _Recorder(BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self) -> None:
        _Recorder.seen.append(self.headers.get("Authorization", ""))
        body = json.dumps({"level": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen = []
    server = HTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_token_goes_to_the_url_the_operator_named_never_to_a_planted_pid_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorder: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "DEFAULT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("BALLAST_ADMIN_TOKEN", "secret")
    monkeypatch.delenv("BALLAST_URL", raising=False)
    _pid(tmp_path / ".run", 8000, recorder, mode=0o666)  # someone else's checkout: anyone may write it
    assert main(["status"]) != 0
    assert _Recorder.seen == []
    monkeypatch.setenv("BALLAST_URL", recorder)  # the operator's pointer
    assert main(["status", "--json"]) == 0
    assert _Recorder.seen == ["Bearer secret"]
    monkeypatch.delenv("BALLAST_URL")
    (tmp_path / ".run" / "ballast-8000.pid").chmod(0o600)  # the operator's own
    assert main(["status", "--json"]) == 0 and len(_Recorder.seen) == 2


def test_serve_writes_its_pid_file_privately_and_refuses_a_symlink(tmp_path: Path) -> None:
    run = tmp_path / ".run"
    path = run / "ballast-8123.pid"
    write_pid(path, {"pid": 7, "url": "http://127.0.0.1:8123"})
    assert run.stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o600
    assert read_pid(path) == {"pid": 7, "url": "http://127.0.0.1:8123"}
    with pytest.raises(FileExistsError):
        write_pid(path, {"pid": 8, "url": "http://127.0.0.1:8123"})
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(OSError):
        write_pid(path, {"pid": 8, "url": "http://127.0.0.1:8123"})
    assert victim.read_text() == "precious"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError):
        write_pid(shared / "ballast-8123.pid", {"pid": 8, "url": "http://127.0.0.1:8123"})


def test_stop_signals_no_process_a_pid_file_it_does_not_believe_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = tmp_path / ".run"
        run.mkdir()
        path = run / "ballast-8123.pid"
        path.write_text(json.dumps({"pid": bystander.pid, "url": "http://127.0.0.1:8123"}))
        path.chmod(0o666)
        config = tmp_path / "c.yaml"
        config.write_text("http:\n  port: 8123\n")
        assert cli.cmd_stop(argparse.Namespace(config=str(config), timeout_s=0.0)) == 1
        with pytest.raises(subprocess.TimeoutExpired):  # not signalled: SIGINT would end it at once
            bystander.wait(timeout=1)
    finally:
        bystander.kill()
        bystander.wait()
