"""The ``ballast`` script without the server extra: one clear line, not a traceback.

The client-only install is simulated by blocking the import of a server package
(``sys.modules[name] = None`` makes ``import name`` raise ModuleNotFoundError, as
a missing package does); the real client-only venv is covered by
tests/integration/test_client_install.py.
"""

from __future__ import annotations

import sys

import pytest

from ballast.ops import console


def _without(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    monkeypatch.delitem(sys.modules, "ballast.ops.cli", raising=False)  # re-run its imports
    monkeypatch.setitem(sys.modules, module, None)


def test_a_missing_server_package_prints_the_install_command(monkeypatch, capsys) -> None:
    _without(monkeypatch, "typer")
    assert console.main(["status"]) == 1
    err = capsys.readouterr().err
    assert "typer is not installed" in err and "ballast[serve]" in err


def test_a_missing_module_that_is_not_a_server_package_keeps_its_traceback(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ballast.ops.cli", None)  # our own module gone: a bug, not a missing extra
    with pytest.raises(ModuleNotFoundError, match="ballast.ops.cli"):
        console.main(["status"])


def test_with_the_server_packages_the_cli_runs(capsys) -> None:
    assert console.main(["--help"]) == 0
    assert "Usage" in capsys.readouterr().out
