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
