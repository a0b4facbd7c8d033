"""Refusals before Python runs: Serve's HAProxy sheds the classes the level does not admit.

Under overload most requests are refusals, and on a host where the ingress shares
cores with the model every millisecond a refusal costs is taken from the model. A
refusal in the router costs the router's HTTP server, FastAPI and the pipeline;
HAProxy, a C program already in front of every router, answers one for a few
microseconds. So the classes the current degradation level does not
admit are refused there:

* ``haproxy_edge.sh`` is Serve's HAProxy binary (``RAY_SERVE_HAPROXY_BINARY_PATH``):
  it adds ``haproxy_edge.cfg``'s rules to the config Serve writes, then runs HAProxy.
  A request whose ``X-Ballast-Criticality`` header names a class in the node's map
  file (``ballast-shed.map``, beside Serve's config) gets the router's own 503
  OVERLOADED (same body, Ballast's or OpenAI's shape by route, and Retry-After),
  plus ``X-Ballast-Edge: refused``.
* Each router keeps the map equal to what its level sheds (:func:`shed_entries`):
  the file (HAProxy reads it when Serve reloads it) and HAProxy's copy in memory
  (the admin socket), whenever it changes. A class the level admits but the model
  cannot take all of is refused in part, at random, in the share the gate would refuse
  anyway (``ballast/policies/edge.py``: SRE's adaptive throttling, run at the edge); that
  refusal says so ("no model capacity"), as the gate's does.
* HAProxy counts the refusals it can vouch for per map key in a stick table; a router
  drains it once per report (:meth:`Edge.drain`, under a lock shared with the node's
  other routers) and adds them to the demand the level turned away (and to the
  throttle's requests), so the controller sees the demand it shed at the edge as it
  sees the demand shed in Python, and the level does not fall because the edge hid it.

The edge reads only what it can trust. The class is the one ``X-Ballast-Criticality``
header of a POST when its whole value is one of the four class names; anything else
(another value, ``<model>:<class>``, a list, two headers) is not read at the edge and goes
to the router, which answers it as it answers any bad claim. A request's model is known
at the edge only through ``ballast-models.map`` (a name -> its model, kept by the routers:
:func:`model_entries`), which holds only names every caller may use
(``Catalog.open_names``): HAProxy reads the body's ``model`` (it buffers the body for its
retries anyway) and looks it up there. So a "<model>:<class>" entry of the shed map is
looked up only for a model taken from that map, and a refusal is counted as a model's
demand only when its model came from there. With one model the map stays empty and the
"<class>" entries are that model's; with several there are no "<class>" entries: a
request whose model HAProxy cannot tell (none named, a name only some tenants may use, a
body it cannot parse or larger than its buffer) goes to the router, which refuses it by
its own model's level. What the edge answers thus depends on the open models alone:
no answer there says whether a model only some tenants may use exists, or how loaded it
is.

Refusing by the claimed class before authentication is safe: a tenant's class is
only ever lowered to its cap (``max_criticality``), and every level admits an
upward-closed set of classes, so a claim the level refuses is refused whatever the
key. Counting it is not: only authenticated demand may move the level, the throttle
and the fair shares. So a refusal is counted only when HAProxy vouches for its key:
the SHA-256 of the ``Authorization: Bearer`` key (one such header) is in the node's key
map (``ballast-keys.map``: digest -> the tenant's cap rank, kept by the routers as the
shed map is, with only the tenants that may use a model the edge judges and without the
tenants a kill switch turns off), and the claim is within the tenant's cap (a claim the
router would lower is not counted: it would be counted under another class). A keyless
or unknown-key request is refused just the same and counted nowhere; the edge's random
share of a class falls on it and on the paying requests alike, so the counted refusals
are the paying ones'. critical_plus is never in the map: it may be answered by the
fallback at any level, which only the pipeline can decide. A request without the header
goes to the router as before.

Every word the routers write into a map and send on the admin socket (a model's name, a
class, a digest, an entry) is checked to be one word there: no whitespace, ``;`` (which
ends a socket command), ``\\`` or ``#`` (:data:`_WORD`); model and adapter names are
held to that when the config is loaded and when an adapter is added
(``ballast.policies.catalog.name_problem``), so a map that breaks it is never sent.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import re
import socket
import stat
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

from ballast.policies.admission import retry_after_s
from ballast.policies.criticality import Criticality
from ballast.policies.degradation import LevelConstraints
from ballast.policies.edge import ALL

log = logging.getLogger("ballast.edge")

HERE = Path(__file__).resolve().parent
WRAPPER = HERE / "haproxy_edge.sh"
MAP_NAME = "ballast-shed.map"
KEYS_MAP_NAME = "ballast-keys.map"
MODELS_MAP_NAME = "ballast-models.map"
MAP_COMMANDS_PER_WRITE = 50  # "add map" commands per socket write: HAProxy reads a line of 16 KiB at most
LOCK_NAME = "ballast-edge.lock"
TABLE = "ballast_edge"
SOCKET_TIMEOUT_S = 0.5


def shed_entries(
    level: int,
    constraints: LevelConstraints,
    drops: Mapping[str, int] | None = None,
    ceiling_rps: float | None = None,
) -> dict[str, str]:
    """The map at ``level``: class -> "retry_after:level:per_mille:rank:ceiling" for each class the edge judges.

    A class the level does not admit: all of it, with the router's Retry-After for that
    refusal (whole seconds, at least 1). A class it admits: ``drops[class]`` per mille
    (``ballast.policies.edge.EdgeThrottle``), with the gate's Retry-After (1 s). Never
    critical_plus. ``rank``: the class's (0 most critical), against which HAProxy checks
    the key's cap before it counts a refusal. ``ceiling``: the model's arrival ceiling in
    requests a second (``ballast.policies.edge.EdgeCeiling``; 0: none); with one, every
    class but critical_plus has an entry, so HAProxy judges each against it.
    """
    retry = max(1, math.ceil(retry_after_s(level)))
    ceiling = _two_digits(ceiling_rps) if ceiling_rps is not None else 0
    out = {}
    for c in Criticality:
        if c is Criticality.CRITICAL_PLUS:
            continue
        if c not in constraints.admitted:
            out[c.value] = f"{retry}:{level}:{ALL}:{c.rank}:{ceiling}"
        elif drops and drops.get(c.value, 0) > 0:
            out[c.value] = f"1:{level}:{min(int(drops[c.value]), ALL - 1)}:{c.rank}:{ceiling}"
        elif ceiling:
            out[c.value] = f"1:{level}:0:{c.rank}:{ceiling}"
    return out


def _two_digits(rps: float) -> int:
    """``rps`` as a whole number of requests a second, to two significant digits (at least 1):
    the map changes when the ceiling moves by a few per cent, not with every report."""
    if rps < 1:
        return 1
    scale: int = 10 ** max(0, math.floor(math.log10(rps)) - 1)
    return max(1, int(round(rps / scale)) * scale)


def key_entries(
    digests: Iterable[tuple[bytes, str]], caps: Mapping[str, Criticality], switched_off: Collection[str] = ()
) -> dict[str, str]:
    """The key map: the upper-case hex SHA-256 of each API key (as HAProxy's ``sha2(256),hex``
    writes it) -> its tenant's cap rank; none for a tenant in ``switched_off`` or not in ``caps``."""
    return {d.hex().upper(): str(caps[t].rank) for d, t in digests if t in caps and t not in switched_off}


#: One word of a map line and of an admin-socket command: no whitespace (the end of a
#: word), ";" (the end of a command), "\\" (an escape) or "#" (a comment in a map file).
#: A catalog's names are held to it (``name_problem``); keys join them with ":".
_WORD = re.compile(r"[A-Za-z0-9._:/+@=-]{1,160}")


def model_entries(open_names: Mapping[str, str], models: Collection[str]) -> dict[str, str]:
    """The models map: each name that every caller may use (``Catalog.open_names``) -> its
    model, for the ``models`` this router serves, when it serves more than one (with one,
    the "<class>" entries are that model's and the map stays empty). A name that is not
    one word (:data:`_WORD`; the catalog holds none) is left out: the router answers it."""
    if len(models) < 2:
        return {}
    return {n: m for n, m in open_names.items() if m in models and _WORD.fullmatch(n) and _WORD.fullmatch(m)}


def model_shed_entries(model: str, entries: Mapping[str, str]) -> dict[str, str]:
    """``shed_entries`` of one model's level, keyed "<model>:<class>" as HAProxy looks them up."""
    return {f"{model}:{c}": v for c, v in entries.items()}


def render_map(entries: Mapping[str, str]) -> str:
    return "".join(f"{k} {v}\n" for k, v in sorted(entries.items()))


def parse_table(text: str) -> dict[str, int]:
    """``show table ballast_edge`` -> refusals per key (lines ``0x..: key=<key> ... http_req_cnt=<n>``):
    "<class>", or "<model>:<class>" for a model's own entry (:func:`split_key`)."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("0x"):
            continue
        fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
        key, n = fields.get("key"), fields.get("http_req_cnt")
        if key is not None and split_key(key)[1] in _CLASSES and n is not None and n.isdigit():
            counts[key] = counts.get(key, 0) + int(n)
    return counts


def split_key(key: str) -> tuple[str | None, str]:
    """A table key as (model, class): (None, class) for a "<class>" key."""
    model, sep, crit = key.rpartition(":")
    return (model, crit) if sep else (None, key)


_CLASSES = frozenset(c.value for c in Criticality)


def admin_command(socket_path: str, command: str, timeout_s: float = SOCKET_TIMEOUT_S) -> str:
    """One command (or several, ``;``-separated) on HAProxy's admin socket; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(socket_path)
        s.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


class Edge:
    """One node's HAProxy edge, as a router drives it: the map and the refusal counts."""

    def __init__(self, haproxy_dir: str, socket_path: str, send: Callable[[str, str], str] = admin_command) -> None:
        self.dir = Path(haproxy_dir)
        self.map_path = str(self.dir / MAP_NAME)
        self.keys_path = str(self.dir / KEYS_MAP_NAME)
        self.models_path = str(self.dir / MODELS_MAP_NAME)
        self.socket_path = socket_path
        self._send = send
        self._applied: dict[str, str] | None = None
        self._applied_keys: dict[str, str] | None = None
        self._applied_models: dict[str, str] | None = None
        self._warned = False

    @classmethod
    def from_env(cls) -> Edge | None:
        """The edge of this process's node when its HAProxy runs ``haproxy_edge.sh``; else None."""
        if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
            return None
        if os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") != str(WRAPPER):
            return None
        import ray
        from ray.serve._private.constants import RAY_SERVE_HAPROXY_CONFIG_FILE_LOC, RAY_SERVE_HAPROXY_SOCKET_PATH

        # Serve puts each node's HAProxy files (config, admin socket) in a directory
        # named by the node's id beside the configured paths; the wrapper puts the map
        # beside the config.
        node = ray.get_runtime_context().get_node_id()

        def per_node(path: str) -> str:
            d, f = os.path.split(path)
            return os.path.join(d, node, f)

        edge = cls(
            os.path.dirname(per_node(RAY_SERVE_HAPROXY_CONFIG_FILE_LOC)), per_node(RAY_SERVE_HAPROXY_SOCKET_PATH)
        )
        if not edge.private():
            log.warning(
                "edge: %s is not a directory of this user's that only it may write; refusing in the router instead",
                edge.dir,
            )
            return None
        return edge

    def private(self) -> bool:
        """Whether the edge's directory is a directory (not a symlink) owned by this user
        that no one else may write (the wrapper adds the edge only to such a one)."""
        try:
            st = os.lstat(self.dir)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o022 == 0

    @property
    def shedding(self) -> dict[str, str]:
        return dict(self._applied or {})

    def apply(self, entries: Mapping[str, str]) -> bool:
        """Make the node's map ``entries`` (file and HAProxy's memory) if it is not already.

        True when it was changed. A failure is logged once and tried again at the next
        call: the router refuses the same classes in Python meanwhile.
        """
        entries = dict(entries)
        if entries == self._applied:
            return False
        self._applied = entries if self._set_map(self.map_path, entries, "refusing in the router") else None
        return self._applied is not None

    def apply_keys(self, entries: Mapping[str, str]) -> bool:
        """Make the node's key map ``entries`` (:func:`key_entries`) if it is not already;
        True when it was changed. Until it is, refusals are counted for the keys it held."""
        entries = dict(entries)
        if entries == self._applied_keys:
            return False
        self._applied_keys = entries if self._set_map(self.keys_path, entries, "its refusals are not counted") else None
        return self._applied_keys is not None

    def apply_models(self, entries: Mapping[str, str]) -> bool:
        """Make the node's models map ``entries`` (:func:`model_entries`) if it is not
        already; True when it was changed. Until it is, every model's requests are refused
        by what all the models' levels refuse (the "<class>" entries)."""
        entries = dict(entries)
        if entries == self._applied_models:
            return False
        self._applied_models = (
            entries if self._set_map(self.models_path, entries, "refusing by model in the router") else None
        )
        return self._applied_models is not None

    def _set_map(self, path: str, entries: Mapping[str, str], meanwhile: str) -> bool:
        """The file, then HAProxy's copy in memory (cleared, then filled a few commands per
        write). Refused whole, before anything is written or sent, when a key or value is
        not one word (:data:`_WORD`): it would split a command or a map line. HAProxy
        answers each map command it carries out with an empty line; any other answer is
        a failure. A failure is logged once and tried again at the next call."""
        try:
            broken = sorted(w for kv in entries.items() for w in kv if not _WORD.fullmatch(w))
            if broken:
                raise ValueError(f"{broken[0]!r} is not one word of a map line")
            self._write_file(path, entries)
            commands = [f"clear map {path}"] + [f"add map {path} {k} {v}" for k, v in sorted(entries.items())]
            for i in range(0, len(commands), MAP_COMMANDS_PER_WRITE):
                answer = self._send(self.socket_path, "; ".join(commands[i : i + MAP_COMMANDS_PER_WRITE]))
                if answer.strip():
                    raise RuntimeError(answer.strip()[:200])
        except (OSError, RuntimeError, ValueError) as e:
            if not self._warned:
                log.warning("edge: could not set HAProxy's map %s (%s); %s", path, e, meanwhile)
                self._warned = True
            return False
        self._warned = False
        return True

    def drain(self) -> dict[str, int]:
        """Refusals at the edge since the last drain on this node, per class.

        Read and cleared under a file lock, so two routers on one node never count the
        same refusals; a refusal landing between the read and the clear is lost (the
        two commands are one socket write: microseconds).
        """
        try:
            # O_NOFOLLOW: a symlink in its place is an error, never a file elsewhere opened.
            fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "r+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                answer = self._send(self.socket_path, f"show table {TABLE}; clear table {TABLE}")
        except OSError:
            return {}
        return parse_table(answer)

    def _write_file(self, path: str, entries: Mapping[str, str]) -> None:
        """Atomically: HAProxy reads the file whenever Serve reloads it. A new file (mode
        0600, O_EXCL) renamed over the map: a symlink there is replaced, never followed."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".shed-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(render_map(entries))
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
