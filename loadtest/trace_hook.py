"""The per-process recorder of ``loadtest/trace_path.py``: copied into a temporary
directory as ``sitecustomize.py``, which the tracer puts first on the ``PYTHONPATH`` of
the Ray job's workers (``runtime_env``), so every Ballast process of the job imports it
at interpreter start. Standard library only; it does nothing unless
``BALLAST_TRACE_CTL`` (the control directory) is set.

A thread polls ``<ctl>/state`` (JSON written by the tracer: ``rec``, ``window``,
``marker``, ``idle``, ``dump``; on ``dump`` it writes ``<ctl>/dump-<pid>.json``). While
``rec`` is on, ``sys.setprofile`` runs in every event-loop thread (found through
``asyncio._set_running_loop``), in executor threads (at their next work item) and in
threads started meanwhile; off, each thread drops it at its next call, so serving
outside the recording runs at full speed.

For each call of a function whose file is under ``BALLAST_TRACE_SRC`` (the traced
tree's ``ballast/``), first entry or coroutine resumption, it records the time, the
Ballast call stack (qualified names of the Ballast frames from the outermost down,
comprehensions and module bodies left out) and a context id; on a first entry the
shapes of the arguments (``self`` / ``cls`` left out), on a return those of the value.

Context ids follow ``contextvars``: each asyncio task (or thread outside a loop) gets its
own id at its first recorded call, and the id it inherited from the task that created
it becomes its parent. A context is *marked* as the request's when a call in it gets
the request's marker string among its arguments, or an object that a marked context
passed along before (a row handed to the engine loop: "taint"); objects that an
unmarked context had already passed in this window are never tainted, and a context
that made calls in an idle window (or descends from one that did: a report loop, a
heartbeat) is never marked by taint, only by the marker. ``window`` changes reset the
marks and the taint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread as _futures_thread
import contextvars
import dataclasses
import dis
import itertools
import json
import os
import sys
import threading
import time

CTL = os.environ.get("BALLAST_TRACE_CTL")
PREFIXES = tuple(p for p in os.environ.get("BALLAST_TRACE_SRC", "").split(os.pathsep) if p)
RESUME = dis.opmap.get("RESUME", -1)
SKIP_CODE = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<module>"})
SCALARS = (int, float, bool, complex, type(None), bytes, bytearray, str)
SEQUENCES = (list, tuple, set, frozenset)
WALK_DEPTH = 3  # how deep an argument is looked into
WALK_ITEMS = 16  # items of a container looked at
MAX_KEYS = 40  # a dict with more keys (or a key longer) is a map, not a record: its shape is its key type

REC = False
IDLE = False  # an idle window: no request in flight
MARKER: str | None = None
CODES: dict = {}  # code -> Ballast name or "" (not Ballast)
STACKS: dict = {}  # stack tuple -> id
SHAPES: dict = {}  # frozenset of shapes -> id
EVENTS: list = []  # (time, kind, context id, stack id, shapes id); kind: c(all), s (resumption), r(eturn), m(ark)
LINKS: dict = {}  # context id -> parent context id
MARKED: set = set()
IDLE_ACTIVE: set = set()  # contexts with calls in an idle window: background, never marked by taint
TAINT: dict = {}  # id -> object passed along by a marked context (kept alive: no id reuse)
SEEN: dict = {}  # id -> context that passed the object first in this window
LOOPS: dict = {}  # thread id -> its running event loop
STATS = {"errors": 0, "last_error": ""}
CONTEXT = contextvars.ContextVar("ballast_trace_context", default=None)
NEXT_ID = itertools.count(1)


def _name(frame) -> str:
    code = frame.f_code
    name = CODES.get(code)
    if name is None:
        name = ""
        if code.co_filename.startswith(PREFIXES) and code.co_name not in SKIP_CODE:
            module = frame.f_globals.get("__name__") or "?"
            name = f"{module}:{getattr(code, 'co_qualname', code.co_name)}"
        CODES[code] = name
    return name


def _hook(frame, event, arg):
    if not REC:
        sys.setprofile(None)
        return
    if event != "call" and event != "return":
        return
    name = CODES.get(frame.f_code)
    if name is None:
        name = _name(frame)
    if not name:
        return
    try:
        _record(frame, event, arg)
    except Exception as e:  # never into the traced code
        STATS["errors"] += 1
        STATS["last_error"] = repr(e)[:300]


def _stack(frame) -> int:
    names = []
    while frame is not None:
        name = CODES.get(frame.f_code)
        if name is None:
            name = _name(frame)
        if name:
            names.append(name)
        frame = frame.f_back
    key = tuple(reversed(names))
    sid = STACKS.get(key)
    if sid is None:
        sid = STACKS[key] = len(STACKS)
    return sid


def _owner():
    loop = asyncio.events._get_running_loop()
    task = asyncio.current_task(loop) if loop is not None else None
    return id(task) if task is not None else -threading.get_ident()


def _context() -> int:
    held = CONTEXT.get()
    owner = _owner()
    if held is not None and held[0] == owner:
        return held[1]
    cid = next(NEXT_ID)
    LINKS[cid] = held[1] if held is not None else None
    CONTEXT.set((owner, cid))
    return cid


def _within(cid, contexts: set) -> bool:
    """Whether ``cid`` or one of the contexts it descends from is in ``contexts``."""
    while cid is not None:
        if cid in contexts:
            return True
        cid = LINKS.get(cid)
    return False


def _record(frame, event, arg) -> None:
    now = time.time()
    sid = _stack(frame)
    cid = _context()
    if IDLE:
        IDLE_ACTIVE.add(cid)
    values = None
    if event == "call":
        code = frame.f_code
        lasti = frame.f_lasti
        raw = code.co_code
        if lasti >= 0 and raw[lasti] == RESUME and raw[lasti + 1] == 0:
            values = _arguments(frame)
    elif frame.f_lasti >= 0 and dis.opname[frame.f_code.co_code[frame.f_lasti]].startswith("RETURN_"):
        values = [arg]
    shapes_id = -1
    if values:
        shapes, objects, hit = _walk_all(values)
        _propagate(now, cid, objects, hit)
        if shapes:
            key = frozenset(shapes)
            shapes_id = SHAPES.get(key)
            if shapes_id is None:
                shapes_id = SHAPES[key] = len(SHAPES)
    kind = "r" if event == "return" else ("c" if values is not None else "s")
    EVENTS.append((now, kind, cid, sid, shapes_id))


def _arguments(frame) -> list:
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:n])
    if code.co_flags & 4:  # *args: its items
        names.append(code.co_varnames[n])
        n += 1
    star = code.co_varnames[n] if code.co_flags & 8 else None  # **kwargs: its values
    local = frame.f_locals
    out = [local.get(a) for a in names if a not in ("self", "cls")]
    if star is not None:
        out.extend((local.get(star) or {}).values())
    return out


def _propagate(now: float, cid: int, objects: list, hit: bool) -> None:
    """Marks and taint: see the module's docstring."""
    if not _within(cid, MARKED):
        tainted = any(id(o) in TAINT for o in objects) and not _within(cid, IDLE_ACTIVE)
        if not hit and not tainted:
            for o in objects:
                SEEN.setdefault(id(o), cid)
            return
        MARKED.add(cid)
        EVENTS.append((now, "m", cid, -1, -1))
    for o in objects:
        first = SEEN.get(id(o))
        if first is None or _within(first, MARKED):
            TAINT[id(o)] = o


def _walk_all(values: list) -> tuple:
    shapes: set = set()
    objects: list = []
    hit = [False]
    for v in values:
        _walk(v, WALK_DEPTH, shapes, objects, hit)
    return shapes, objects, hit[0]


def _dict_shape(d: dict) -> str:
    keys = list(d.keys())
    if len(keys) <= MAX_KEYS and all(type(k) is str and len(k) <= MAX_KEYS for k in keys):
        return "{" + ", ".join(sorted(keys)) + "}"
    kinds = sorted({type(k).__name__ for k in keys})
    return "{<map of " + "|".join(kinds) + ">}"


def _walk(v, depth: int, shapes: set, objects: list, hit: list) -> None:
    t = type(v)
    if isinstance(v, SCALARS):
        if MARKER and ((t is str and MARKER in v) or (t in (bytes, bytearray) and MARKER.encode() in v)):
            hit[0] = True
        return
    if isinstance(v, dict):
        shapes.add(_dict_shape(v))
        items = v.values()
    elif (t.__module__ or "").split(".")[0] == "ballast":
        shapes.add(f"class {t.__module__}.{t.__qualname__}")
        items = v if isinstance(v, SEQUENCES) else _fields(v)
    elif isinstance(v, SEQUENCES):
        items = v
    else:
        return
    objects.append(v)
    if depth > 0:
        for item in itertools.islice(items, WALK_ITEMS):
            _walk(item, depth - 1, shapes, objects, hit)


def _fields(v) -> list:
    """A data class's field values (dataclass, pydantic model); of another class, only the
    str attributes (where the marker may be), not looked into for shapes."""
    if dataclasses.is_dataclass(v):
        return [getattr(v, f.name, None) for f in dataclasses.fields(v)]
    fields = getattr(type(v), "model_fields", None)
    if isinstance(fields, dict):
        return [getattr(v, k, None) for k in fields]
    slots = getattr(type(v), "__slots__", ())
    names = list(getattr(v, "__dict__", None) or ()) or ([slots] if isinstance(slots, str) else list(slots))
    values = [getattr(v, k, None) for k in itertools.islice(names, WALK_ITEMS)]
    return [x for x in values if isinstance(x, (str, bytes))]


def _enable() -> None:
    if REC and sys.getprofile() is None:
        sys.setprofile(_hook)


def _set_running_loop(loop, _original=asyncio.events._set_running_loop):
    if loop is not None:
        LOOPS[threading.get_ident()] = loop
    return _original(loop)


def _run_work_item(self, _original=_futures_thread._WorkItem.run):
    _enable()
    return _original(self)


def _label() -> str:
    if "ray.serve" in sys.modules:
        try:
            return str(sys.modules["ray.serve"].get_replica_context().deployment)
        except Exception:
            pass
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return sys.argv[0] if sys.argv else "?"


def _dump(path: str) -> None:
    ballast = sys.modules.get("ballast")
    out = {
        "pid": os.getpid(),
        "label": _label(),
        "ballast_file": getattr(ballast, "__file__", None),
        "events": list(EVENTS),
        "stacks": [list(k) for k, _ in sorted(STACKS.items(), key=lambda kv: kv[1])],
        "shapes": [sorted(k) for k, _ in sorted(SHAPES.items(), key=lambda kv: kv[1])],
        "links": {str(k): v for k, v in list(LINKS.items())},
        "stats": STATS,
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)


def _apply(state: dict) -> None:
    global REC, MARKER, IDLE
    IDLE = bool(state.get("idle"))
    if state.get("window") != _apply.window:
        _apply.window = state.get("window")
        MARKED.clear()
        TAINT.clear()
        SEEN.clear()
        MARKER = state.get("marker") or None
    rec = bool(state.get("rec"))
    if rec and not REC:
        REC = True
        threading.setprofile(_hook)
        for loop in list(LOOPS.values()):
            try:
                if loop.is_running():
                    loop.call_soon_threadsafe(_enable)
            except Exception:
                pass
    elif not rec and REC:
        REC = False
        threading.setprofile(None)
    if state.get("dump") and not _apply.dumped:
        _apply.dumped = True
        _dump(os.path.join(CTL, f"dump-{os.getpid()}.json"))


_apply.window = None
_apply.dumped = False


def _poll() -> None:
    last = None
    while True:
        time.sleep(0.02)
        try:
            with open(os.path.join(CTL, "state")) as f:
                raw = f.read()
            if raw != last:
                last = raw
                _apply(json.loads(raw))
        except (OSError, ValueError):
            continue
        except Exception as e:
            STATS["errors"] += 1
            STATS["last_error"] = repr(e)[:300]


def install() -> None:
    asyncio.events._set_running_loop = _set_running_loop
    asyncio._set_running_loop = _set_running_loop
    _futures_thread._WorkItem.run = _run_work_item
    with open(os.path.join(CTL, f"hello-{os.getpid()}"), "w") as f:
        f.write(" ".join(sys.argv))
    threading.Thread(target=_poll, name="ballast-trace-poll", daemon=True).start()


if CTL and PREFIXES and __name__ == "sitecustomize":
    install()
