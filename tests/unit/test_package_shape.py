"""The package's shape, kept as issue 61 left it: no module of ``ballast/`` over 800 lines
(a file past it had become several things at once: vllm_engine.py at 1,097, config.py at
1,295), so that growth goes into a module of its own instead."""

from __future__ import annotations

from pathlib import Path

import ballast

MAX_LINES = 800


def test_no_module_of_the_package_is_over_800_lines() -> None:
    root = Path(ballast.__file__).parent
    sizes = {
        p.relative_to(root.parent).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in root.rglob("*.py")
    }
    assert len(sizes) > 100  # the package itself was read, not an empty folder
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"


def test_no_two_test_modules_share_a_name() -> None:
    # The test folders are not packages: pytest imports each file by its name alone, and a
    # second file of that name anywhere under tests/ stops the whole collection.
    tests = Path(__file__).resolve().parents[1]
    names: dict[str, list[str]] = {}
    for p in tests.rglob("test_*.py"):
        names.setdefault(p.name, []).append(p.relative_to(tests).as_posix())
    assert len(names) > 100
    assert not {n: where for n, where in names.items() if len(where) > 1}
