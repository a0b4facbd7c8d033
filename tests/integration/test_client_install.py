"""The client SDK from the default install (`pip install <repo>`, no extras), in a fresh venv.

The default install must pull only what the client imports (httpx and the
standard-library ``ballast.policies``), never Ray, torch or NVML, and the client from it
must talk to the real stack. The venv is built once per module (~15 s here:
venv, then pip resolving httpx and its few dependencies from the index; it needs
the package index, as any install does). The source is copied to a temporary
directory first, so that setuptools' build/ and egg-info land there and not in
the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BASE, ROOT

pytestmark = pytest.mark.integration

#: What the default install carries: the packages setuptools finds, plus the files pyproject names.
_SOURCE_FILES = ("pyproject.toml", "README.md", "constraints.txt")
_SOURCE_DIRS = ("ballast",)


def _bin(venv: Path, name: str) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / name


def _env() -> dict[str, str]:
    # The checkout must not leak in: the venv's python imports only what was installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return env


def _run(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("client-install")
    src = tmp / "src"
    src.mkdir()
    for name in _SOURCE_FILES:
        shutil.copy2(ROOT / name, src / name)
    for name in _SOURCE_DIRS:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], tmp, 120)
    assert made.returncode == 0, made.stderr
    # -c constraints.txt: the same pins as `make install` (httpx and its dependencies).
    pip = _run(
        [str(_bin(venv, "python")), "-m", "pip", "install", "-q", "-c", str(src / "constraints.txt"), str(src)],
        tmp,
        600,
    )
    assert pip.returncode == 0, f"pip install of the default install failed:\n{pip.stdout}\n{pip.stderr}"
    return venv


def _python(venv: Path, code: str) -> subprocess.CompletedProcess[str]:
    # cwd is the venv's parent, never the checkout, so `import ballast` finds the installed copy.
    return _run([str(_bin(venv, "python")), "-c", code], venv.parent, 120)


def test_the_default_install_pulls_no_server_package(client_venv: Path) -> None:
    probe = _python(
        client_venv,
        """
import importlib, json
out = {}
for name in ("ray", "torch", "pynvml", "yaml", "typer", "psutil", "httpx", "ballast.client"):
    try:
        mod = importlib.import_module(name)
        out[name] = getattr(mod, "__file__", "") or "imported"
    except ImportError:
        out[name] = None
print(json.dumps(out))
""",
    )
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    for server_only in ("ray", "torch", "pynvml", "yaml", "typer", "psutil"):
        assert found[server_only] is None, f"{server_only} is importable from the client-only install"
    assert found["httpx"] is not None
    assert str(client_venv) in found["ballast.client"], found["ballast.client"]  # the installed copy


def test_the_console_script_without_the_server_extra_says_how_to_install_it(client_venv: Path) -> None:
    ran = _run([str(_bin(client_venv, "ballast")), "status"], client_venv.parent, 60)
    assert ran.returncode == 1
    assert "ballast[serve]" in ran.stderr
    assert "Traceback" not in ran.stderr


_SDK_SCRIPT = """
import asyncio, json, sys
from ballast.client import AsyncBallastClient, BallastClient, ClientConfig, Unauthenticated

base = sys.argv[1]
out = {}
with BallastClient(ClientConfig(base, "dev-key-gold", max_attempts=1)) as client:
    gen = client.generate("hello", max_tokens=4)
    out["unary"] = {"text": gen.text, "tokens": gen.tokens_generated, "model": gen.model}
    with client.stream("hello", max_tokens=4) as tokens:
        texts = list(tokens)
    out["stream"] = {"pieces": len(texts), "done_tokens": tokens.done.tokens_generated,
                     "joined_is_done_text": "".join(texts) == tokens.done.text}
with BallastClient(ClientConfig(base, "not-a-key", max_attempts=1)) as client:
    try:
        client.generate("hello", max_tokens=4)
        out["wrong_key"] = "answered"
    except Unauthenticated as e:
        out["wrong_key"] = e.status

async def main():
    async with AsyncBallastClient(ClientConfig(base, "dev-key-gold", max_attempts=1)) as client:
        gen = await client.generate("hello", max_tokens=4)
        return gen.tokens_generated

out["async_tokens"] = asyncio.run(main())
print(json.dumps(out))
"""


def test_the_client_from_the_default_install_talks_to_the_stack(client_venv: Path, ballast) -> None:
    ran = _run([str(_bin(client_venv, "python")), "-c", _SDK_SCRIPT, BASE], client_venv.parent, 120)
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    assert out["unary"]["tokens"] >= 1 and isinstance(out["unary"]["text"], str)
    assert out["stream"]["pieces"] >= 1 and out["stream"]["done_tokens"] >= 1
    assert out["stream"]["joined_is_done_text"] is True
    assert out["wrong_key"] == 401
    assert out["async_tokens"] >= 1
