"""One request's path through Ballast, counted the same way before and after a refactor.

    python -m loadtest.trace_path [--root DIR] [--port 8131] [--requests 5]

``--root`` is the Ballast source tree to trace (default: the current directory), so an
old checkout is traced by the same script. Nothing here names a Ballast function, class
or dict key: the stack is started as the integration tests start it (``cluster/local.yaml``
with ``tests/integration/test_config.yaml`` on top, the built-in engine on CPU, through
``ballast.ops.app.start`` on a local Ray), on port 8131, loopback only.

How it counts:

* Recording. ``loadtest/trace_hook.py`` becomes ``sitecustomize.py`` in a temporary
  directory put first on ``PYTHONPATH`` (the traced tree second) through the Ray job's
  ``runtime_env``, so every worker of the job (router and model replicas, the controller,
  the watchdogs) imports it. While recording, ``sys.setprofile`` sees every call of a
  function defined under ``DIR/ballast/`` (comprehensions and module bodies are not
  functions here): its Ballast call stack (the Ballast frames only, outermost first),
  its asyncio task / contextvars context, and the shapes of its arguments (``self`` /
  ``cls`` left out) and of its return value. A coroutine's resumption counts as a call
  of it for the stacks, not for the shapes or the call counts.
* The request. After 5 warm-up requests and 2 more under the profiler, the recording
  runs through windows of equal width (at least 1 s): two idle windows, then, for each
  of ``--requests`` traced requests, a request window and two idle ones. A traced request
  is ``POST /v1/chat/completions``, unary, one user message holding a unique marker,
  ``max_tokens`` 8. A call belongs to the request when its context (asyncio task, or
  thread outside an event loop) is *marked*, or descends from a marked one (a task or an
  executor call it started): marked when the marker is among a call's arguments (the
  router's request task, the model replica's), or when a context that made no call in
  any idle window is handed an object a marked context passed along first (the row the
  model's engine loop takes from the request task: "taint"). Everything else (report
  exchanges, heartbeats, watchdog beats, health checks) is background, not counted.
* The path is the set of (process, Ballast call stack) pairs seen in the marked contexts
  of more than half of the traced requests: a request's own path varies a little with
  time (a quota lease the controller has just changed takes another branch), and the
  majority keeps the count from following that; stacks seen in some requests only are
  listed with how many had them. *frames*: the distinct Ballast functions on the path's
  stacks; *layers*: their distinct modules; the deepest stack is the longest of them;
  calls per request: first entries of Ballast functions in marked contexts. *shapes*:
  the distinct shapes of those calls' arguments and return values (in more than half of
  the requests too): a dict's is its sorted key set (a dict with over 40 keys, a key
  over 40 characters or a non-str key is a map: its key types), an instance of a Ballast
  class its module and qualified name; dicts, lists, tuples, sets, dataclasses and
  pydantic models are looked into 3 levels deep (16 items each); ints, floats, strs,
  None and other libraries' objects are no shape. *dict_any*: the occurrences of
  ``dict[str, Any]`` (regex ``dict\\[str,\\s*Any\\]``) in the .py files under
  ``DIR/ballast/router`` and ``DIR/ballast/model``; beside it the line count (what
  ``grep -c`` sums to) and how many sit in the signatures or annotated assignments of
  the functions on the path.
* Background seen in most request windows, in no idle window and in no marked context
  is listed as "unlinked" (not counted), as a check on the marking: a gap in it would
  show there. A report loop carrying the request's counts (the router's report, the
  controller taking it) shows there in some runs and not in others, as its tick falls
  inside the request window or after it.

Bounded: a ``--limit-s`` alarm (170 s) ends the run; Ray is stopped and the temporary
directory removed on every exit.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import copy
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

HOOK = Path(__file__).with_name("trace_hook.py")
DICT_ANY = re.compile(r"dict\[str,\s*Any\]")
ROUTE = "/v1/chat/completions"
CLEANUP_S = 60


class Control:
    """The state file every traced process polls (see trace_hook.py)."""

    def __init__(self, ctl: Path) -> None:
        self.ctl = ctl
        self.state: dict[str, Any] = {"rec": False, "window": 0, "marker": None, "idle": False, "dump": False}
        self.set()

    def set(self, **changes: Any) -> None:
        self.state.update(changes)
        tmp = self.ctl / "state.tmp"
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.ctl / "state")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def stack_config(root: Path, port: int) -> dict[str, Any]:
    """The integration suite's config (conftest.py's merge), on ``port``, on CPU."""
    base = yaml.safe_load((root / "cluster/local.yaml").read_text())
    over = yaml.safe_load((root / "tests/integration/test_config.yaml").read_text())
    return _merge(_merge(base, over), {"http": {"port": port}, "model": {"device": "cpu"}})


def start_stack(root: Path, data: dict[str, Any], env: dict[str, str], stops: list[Callable[[], None]]) -> None:
    """Ray and the app as tests/integration/conftest.py starts them; ``stops`` gets the way down."""
    sys.path.insert(0, str(root))
    config = importlib.import_module("ballast.config")
    ingress = importlib.import_module("ballast.router.ingress")
    app = importlib.import_module("ballast.ops.app")
    if not Path(config.__file__).resolve().is_relative_to(root / "ballast"):
        raise RuntimeError(f"ballast imported from {config.__file__}, not from {root}")
    cfg = config.load_config(data)
    ingress.apply_ingress_env(cfg)
    import ray

    # Ray puts the driver's working directory first on its workers' sys.path: the traced tree.
    here = os.getcwd()
    os.chdir(root)
    try:
        ray.init(
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=False,
            num_cpus=4,
            runtime_env={"env_vars": env},
        )
    finally:
        os.chdir(here)
    stops.append(ray.shutdown)
    stops.append(lambda: app.shutdown(cfg))
    app.start(cfg, "127.0.0.1", data["http"]["port"])


def wait_ready(client: httpx.Client, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get("/healthz/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"/healthz/ready not 200 within {timeout_s:.0f} s")


def new_marker() -> str:
    return f"tp{uuid.uuid4().hex[:16]}"


def send(client: httpx.Client, data: dict[str, Any], marker: str) -> float:
    """One unary chat completion, one user message holding ``marker``; its latency in seconds."""
    keys = data.get("auth", {}).get("demo_keys") or {}
    key = next((k for k, tenant in keys.items() if tenant == "gold"), next(iter(keys), ""))
    body = {
        "model": data["model"]["name"],
        "messages": [{"role": "user", "content": f"{marker}: say hello"}],
        "max_tokens": 8,
    }
    t0 = time.monotonic()
    r = client.post(ROUTE, json=body, headers={"Authorization": f"Bearer {key}"})
    if r.status_code != 200 or not r.json().get("choices"):
        raise RuntimeError(f"POST {ROUTE}: {r.status_code} {r.text[:300]}")
    return time.monotonic() - t0


def run_windows(client: httpx.Client, data: dict[str, Any], control: Control, n: int, width_s: float) -> list:
    """Idle, idle, then (request, idle, idle) n times; each window ``width_s`` wide (a request
    window longer if its request is still running)."""
    windows = []
    for i, kind in enumerate(["idle", "idle"] + ["request", "idle", "idle"] * n):
        marker = new_marker() if kind == "request" else None
        control.set(window=i + 1, marker=marker, idle=kind == "idle")
        time.sleep(0.1)  # every process takes the new window (they poll every 20 ms)
        t0 = time.time()
        latency = send(client, data, marker) if marker else None
        end = max(t0 + width_s, time.time() + 0.2 if marker else 0.0)  # at least 0.2 s after an answer
        time.sleep(max(0.0, end - time.time()))
        windows.append({"kind": kind, "t0": t0, "t1": time.time(), "marker": marker, "latency_s": latency})
    return windows


def collect(ctl: Path, control: Control, timeout_s: float = 20) -> tuple[list, list]:
    """Every traced process's dump (those still alive); and the pids that loaded the hook."""
    control.set(rec=False, dump=True)
    deadline = time.monotonic() + timeout_s
    while True:
        pids = sorted(int(p.name.split("-")[1]) for p in ctl.glob("hello-*"))
        waiting = [p for p in pids if _alive(p) and not (ctl / f"dump-{p}.json").exists()]
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    dumps = [json.loads(p.read_text()) for p in sorted(ctl.glob("dump-*.json"))]
    return dumps, pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _counted(cid: int, marked: set, links: dict) -> bool:
    seen = 0
    while cid is not None and seen < 10_000:
        if cid in marked:
            return True
        cid = links.get(cid)
        seen += 1
    return False


def _by_window(dump: dict[str, Any], windows: list) -> dict[int, list]:
    starts = [w["t0"] for w in windows]
    out: dict[int, list] = defaultdict(list)
    for ev in dump["events"]:
        i = bisect.bisect_right(starts, ev[0]) - 1
        if i >= 0 and ev[0] < windows[i]["t1"]:
            out[i].append(ev)
    return out


def _empty_request() -> dict[str, Any]:
    return {"stacks": set(), "shapes": set(), "background": set(), "calls": Counter()}


def analyse(dumps: list, windows: list) -> dict[str, Any]:
    """Per traced request: the stacks and shapes of its marked contexts; across them: the path."""
    requests = {i: _empty_request() for i, w in enumerate(windows) if w["kind"] == "request"}
    idle: set = set()
    processes: Counter = Counter(d["label"] for d in dumps)
    for dump in dumps:
        label, stacks = dump["label"], [tuple(s) for s in dump["stacks"]]
        links = {int(k): v for k, v in dump["links"].items()}
        for i, events in _by_window(dump, windows).items():
            if i not in requests:
                idle.update((label, stacks[ev[3]]) for ev in events if ev[1] != "m")
                continue
            req = requests[i]
            marked = {ev[2] for ev in events if ev[1] == "m"}
            for _, kind, cid, sid, shapes_id in events:
                if kind == "m":
                    continue
                if not _counted(cid, marked, links):
                    req["background"].add((label, stacks[sid]))
                    continue
                req["stacks"].add((label, stacks[sid]))
                req["calls"][label] += kind == "c"
                if shapes_id >= 0:
                    req["shapes"].update(dump["shapes"][shapes_id])
    per = list(requests.values())
    path, varying = _most([r["stacks"] for r in per])
    shapes, varying_shapes = _most([r["shapes"] for r in per])
    return {
        "path": path,
        "shapes": shapes,
        "varying": varying,
        "varying_shapes": varying_shapes,
        "unlinked": _most([r["background"] for r in per])[0] - idle - path,
        "calls": [r["calls"] for r in per],
        "processes": processes,
    }


def _most(sets: list) -> tuple[set, dict]:
    """What more than half of ``sets`` hold; and, for what some but not all hold, in how many."""
    seen = Counter(x for s in sets for x in s)
    return {x for x, n in seen.items() if 2 * n > len(sets)}, {x: n for x, n in seen.items() if n < len(sets)}


def _own_annotations(fn: ast.AST) -> list:
    """A function's signature annotations and the annotated assignments of its own body."""
    args = fn.args
    out = [a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a]
    out = [a for a in out if a is not None] + ([fn.returns] if fn.returns is not None else [])
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.AnnAssign):
            out.append(node.annotation)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _functions(tree: ast.AST) -> list:
    """(qualified name as ``co_qualname`` spells it, function node) for every function."""
    out = []

    def visit(node: ast.AST, qual: str, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{qual}.<locals>.{child.name}" if in_function else f"{qual}.{child.name}".lstrip(".")
                if not isinstance(child, ast.ClassDef):
                    out.append((name, child))
                visit(child, name, not isinstance(child, ast.ClassDef))
            else:
                visit(child, qual, in_function)

    visit(tree, "", False)
    return out


def count_dict_any(root: Path) -> dict[str, Any]:
    """``dict[str, Any]`` in ballast/router and ballast/model: occurrences, lines, per function."""
    total = lines = 0
    per_function: Counter = Counter()
    for sub in ("router", "model"):
        for path in sorted((root / "ballast" / sub).rglob("*.py")):
            src = path.read_text()
            total += len(DICT_ANY.findall(src))
            lines += sum(1 for line in src.splitlines() if DICT_ANY.search(line))
            parts = list(path.relative_to(root).with_suffix("").parts)
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for qual, fn in _functions(ast.parse(src)):
                n = sum(len(DICT_ANY.findall(ast.get_source_segment(src, a) or "")) for a in _own_annotations(fn))
                if n:
                    per_function[f"{module}:{qual}"] += n
    return {"total": total, "lines": lines, "per_function": per_function}


def _modules(frames: set) -> set:
    return {f.split(":", 1)[0] for f in frames}


def _listing(title: str, items: list, indent: str = "    ") -> list[str]:
    return [f"{title} ({len(items)}):"] + [f"{indent}{item}" for item in items]


def report_lines(result: dict[str, Any], dict_any: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    path = result["path"]
    frames = {f for _, stack in path for f in stack}
    layers = _modules(frames)
    lines = [
        f"Ballast request path: POST {ROUTE} (unary, 1 user message, max_tokens 8), tree {meta['tree']}",
        f"traced {len(result['calls'])} requests, latencies {meta['latencies']} s, windows {meta['width_s']:.2f} s,"
        f" {meta['idle_windows']} idle windows; {meta['hooked']} processes loaded the hook",
        "processes that loaded the hook: "
        + ", ".join(f"{n} {label}" for label, n in sorted(result["processes"].items())),
        "processes on the path:",
    ]
    by_process: dict[str, set] = defaultdict(set)
    for label, stack in path:
        by_process[label].update(stack)
    for label in sorted(by_process):
        deepest = max((len(s) for lab, s in path if lab == label), default=0)
        calls = sorted({c[label] for c in result["calls"]})
        lines.append(
            f"    {label} ({result['processes'][label]} process): layers {len(_modules(by_process[label]))},"
            f" frames {len(by_process[label])}, deepest stack {deepest}, calls per request {calls}"
        )
    lines += _listing("layers", sorted(layers))
    lines += _listing("frames", sorted(frames))
    deepest = max(path, key=lambda ls: (len(ls[1]), ls), default=("-", ()))
    lines.append(f"deepest ballast stack ({len(deepest[1])} frames, {deepest[0]}):")
    lines += [f"    {'  ' * i}{f}" for i, f in enumerate(deepest[1])]
    keysets = sorted(s for s in result["shapes"] if s.startswith("{"))
    classes = sorted(s[len("class ") :] for s in result["shapes"] if s.startswith("class "))
    lines += _listing("shapes: dict key sets", keysets)
    lines += _listing("shapes: Ballast classes", classes)
    on_path = {f: n for f, n in dict_any["per_function"].items() if f in frames}
    lines.append(
        f"dict[str, Any] in ballast/router + ballast/model: {dict_any['total']} occurrences"
        f" ({dict_any['lines']} lines, as grep -c counts); {sum(on_path.values())} in"
        f" {len(on_path)} functions on the path:"
    )
    lines += [f"    {n}  {f}" for f, n in sorted(on_path.items())]
    n = len(result["calls"])
    varying = [f"{name} [{k}/{n}]" for name, k in _stack_names(result["varying"])]
    lines += _listing("varying stacks, [in how many traced requests]; counted in over half", varying)
    shapes = [f"{shape} [{k}/{n}]" for shape, k in sorted(result["varying_shapes"].items())]
    lines += _listing("varying shapes, [in how many traced requests]; counted in over half", shapes)
    unlinked = [name for name, _ in _stack_names(dict.fromkeys(result["unlinked"], 0))]
    lines += _listing("not counted: unlinked background in most request windows", unlinked)
    lines.append(
        f"path: layers={len(layers)} frames={len(frames)} shapes={len(result['shapes'])} dict_any={dict_any['total']}"
    )
    return lines


def _stack_names(stacks: dict) -> list[tuple[str, Any]]:
    """(``process: outermost > ... > innermost (depth)``, value) for each (process, stack) key."""
    out = []
    for (label, s), value in stacks.items():
        out.append((f"{label}: {' > '.join(s if len(s) < 3 else (s[0], '...', s[-1]))} ({len(s)})", value))
    return sorted(out)


def _git_head(root: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return f"{root} ({out.stdout.strip() or 'no git'})"
    except OSError:
        return str(root)


def trace(root: Path, tmp: Path, args: argparse.Namespace, stops: list) -> tuple:
    site, ctl = tmp / "site", tmp / "ctl"
    site.mkdir()
    ctl.mkdir()
    shutil.copyfile(HOOK, site / "sitecustomize.py")
    control = Control(ctl)
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), str(root)]),
        "BALLAST_TRACE_CTL": str(ctl),
        "BALLAST_TRACE_SRC": f"{root}/ballast/",
    }
    data = stack_config(root, args.port)
    t0 = time.monotonic()
    start_stack(root, data, env, stops)
    with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=30, trust_env=False) as client:
        wait_ready(client, max(10.0, args.limit_s - 60 - (time.monotonic() - t0)))
        print(f"trace_path: stack ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        for _ in range(5):
            send(client, data, new_marker())
        control.set(rec=True, window=-1, idle=False)
        time.sleep(0.3)
        traced = max(send(client, data, new_marker()) for _ in range(2))  # first calls under the profiler
        width_s = max(1.0, 2 * traced + 0.3)
        windows = run_windows(client, data, control, args.requests, width_s)
    dumps, hooked = collect(ctl, control)
    while stops:  # Ray down before the counting: the CPUs are the counting's
        stops.pop()()
    return dumps, hooked, windows, width_s


def _check(dumps: list, root: Path) -> None:
    for d in dumps:
        f = d.get("ballast_file")
        if d["events"] and f and not Path(f).resolve().is_relative_to(root.resolve()):
            raise RuntimeError(f"{d['label']} (pid {d['pid']}) imported ballast from {f}, not from {root}")
        if d["stats"]["errors"]:
            print(
                f"trace_path: {d['label']}: {d['stats']['errors']} hook errors: {d['stats']['last_error']}",
                file=sys.stderr,
            )


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError("trace_path ran past its time limit")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=".", help="the Ballast source tree to trace (default: .)")
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--requests", type=int, default=5, help="traced requests (the path: what most of them share)")
    p.add_argument("--limit-s", type=int, default=170, help="the whole run's time limit")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be at least 1")
    root = Path(args.root).resolve()
    started = time.monotonic()
    signal.signal(signal.SIGALRM, _alarm)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.alarm(args.limit_s)
    tmp = Path(tempfile.mkdtemp(prefix="ballast-trace-"))
    stops: list[Callable[[], None]] = []
    try:
        dumps, hooked, windows, width_s = trace(root, tmp, args, stops)
        _check(dumps, root)
        result = analyse(dumps, windows)
        meta = {
            "tree": _git_head(root),
            "latencies": [round(w["latency_s"], 3) for w in windows if w["kind"] == "request"],
            "width_s": width_s,
            "idle_windows": sum(w["kind"] == "idle" for w in windows),
            "hooked": len(hooked),
        }
        print("\n".join(report_lines(result, count_dict_any(root), meta)))
        print(f"trace_path: {time.monotonic() - started:.1f} s", file=sys.stderr)
        if len({label for label, _ in result["path"]}) < 2:
            print("trace_path: the traced request crossed fewer than 2 Ballast processes", file=sys.stderr)
            return 2
        return 0
    except Exception as e:
        print(f"trace_path: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(CLEANUP_S)
        try:
            while stops:
                try:
                    stops.pop()()
                except Exception as e:
                    print(f"trace_path: stopping: {e!r}", file=sys.stderr)
        finally:
            signal.alarm(0)
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
