"""The ``ballast`` console script: the CLI, or one clear line when the server extra is missing.

The default install (``pip install ballast``) is the client SDK only; the CLI
needs Ray, typer and the rest of the ``serve`` extra. Without them a user who
types ``ballast`` gets the install command, not a ModuleNotFoundError traceback.
Imports are lazy (the CLI module itself needs typer) and only a missing
*server* package is turned into the message: any other import error is a bug
and keeps its traceback.
"""

from __future__ import annotations

import sys

#: Top-level modules the ``serve`` extra provides (pyproject.toml); keep the two in step.
SERVER_MODULES = frozenset(
    {
        "ray",
        "torch",
        "pynvml",
        "psutil",
        "pydantic",
        "yaml",
        "prometheus_client",
        "typer",
        "click",
        "fastapi",
        "starlette",
        "numpy",
    }
)
INSTALL_HINT = "pip install 'ballast[serve]'  (or `make install` in a checkout)"


def _missing_server_module(exc: ModuleNotFoundError) -> bool:
    return (exc.name or "").split(".")[0] in SERVER_MODULES


def main(argv: list[str] | None = None) -> int:
    try:
        from ballast.ops.cli import main as cli_main

        return cli_main(argv)
    except ModuleNotFoundError as e:
        if not _missing_server_module(e):
            raise
        print(
            f"ballast: the command line needs the server packages ({e.name} is not installed).\n"
            f"Install them with: {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
