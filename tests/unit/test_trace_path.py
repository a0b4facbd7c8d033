"""loadtest/trace_path.py's counting, on synthetic recordings (no Ray)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from loadtest import trace_hook, trace_path


def _window(kind: str, t0: float) -> dict:
    return {"kind": kind, "t0": t0, "t1": t0 + 1.0, "marker": None, "latency_s": None}


def test_the_path_is_what_most_traced_requests_share_in_their_marked_contexts():
    windows = [_window("idle", 0), _window("request", 2), _window("request", 4), _window("request", 6)]
    stacks = [["m:bg"], ["m:handler"], ["m:handler", "m:step"], ["m:handler", "m:rare"], ["m:child"]]
    events = [(0.5, "s", 1, 0, -1)]  # background loop (context 1) in the idle window
    for t0 in (2, 4, 6):
        events += [
            (t0 + 0.1, "c", 2, 1, 0),
            (t0 + 0.2, "m", 2, -1, -1),  # the request's context marked after its first call
            (t0 + 0.3, "c", 2, 2, -1),
            (t0 + 0.4, "c", 3, 4, -1),  # a task the request started
            (t0 + 0.5, "s", 1, 0, -1),  # background during the request: not counted
        ]
    events.append((2.35, "c", 2, 3, -1))  # a branch taken by one request only
    dump = {
        "label": "P",
        "stacks": stacks,
        "shapes": [["{a, b}", "class ballast.x.Y"]],
        "links": {"1": None, "2": None, "3": 2},
        "events": events,
    }
    result = trace_path.analyse([dump], windows)
    assert result["path"] == {("P", ("m:handler",)), ("P", ("m:handler", "m:step")), ("P", ("m:child",))}
    assert result["varying"] == {("P", ("m:handler", "m:rare")): 1}
    assert result["shapes"] == {"{a, b}", "class ballast.x.Y"}
    assert result["unlinked"] == set()  # the background loop also ran in the idle window
    assert [c["P"] for c in result["calls"]] == [4, 3, 3]


def test_dict_any_is_counted_per_function_by_its_qualified_name(tmp_path):
    src = textwrap.dedent(
        """
        from typing import Any, Optional

        FIELD: dict[str, Any] = {}

        class A:
            x: Optional[dict[str, Any]] = None

            def f(self, a: dict[str, Any]) -> "list[dict[str, Any]]":
                b: dict[str,  Any] = {}

                def inner(c: dict[str, Any]) -> None: ...

                return [b]
        """
    )
    (tmp_path / "ballast" / "router").mkdir(parents=True)
    (tmp_path / "ballast" / "model").mkdir()
    (tmp_path / "ballast" / "router" / "m.py").write_text(src)
    out = trace_path.count_dict_any(tmp_path)
    assert out["total"] == 6 and out["lines"] == 5  # two on the def line
    assert out["per_function"] == {"ballast.router.m:A.f": 3, "ballast.router.m:A.f.<locals>.inner": 1}


@dataclass
class _Call:
    prompt: str
    rest: dict = field(default_factory=dict)


_Call.__module__ = "ballast.protocol"  # a Ballast class: looked into


def test_shapes_key_sets_and_the_marker_inside_dataclasses(monkeypatch):
    monkeypatch.setattr(trace_hook, "MARKER", "tp123")
    shapes, objects, hit = trace_hook._walk_all([_Call("tp123: hi", {"k": [{"role": "user"}]}), 3, "x"])
    assert hit and shapes == {"class ballast.protocol._Call", "{k}", "{role}"}
    assert trace_hook._dict_shape({1: 2}) == "{<map of int>}"
    assert trace_hook._dict_shape({"b": 1, "a": 2}) == "{a, b}"
