#!/bin/sh
# Serve's HAProxy with Ballast's edge rules (haproxy_edge.cfg, ballast/router/edge.py).
#
# Serve starts HAProxy as `<binary> -db -f <config> [...]` (RAY_SERVE_HAPROXY_BINARY_PATH
# names this script). The config Serve wrote is copied to <config>.edge with the rules
# inserted after the bind line of its http_frontend and the table's backend appended,
# and the real HAProxy ($BALLAST_HAPROXY_REAL) runs on the copy, as this process.
#
# Three changes to how HAProxy treats a router replica that goes away (its process
# killed, its node lost or cut off):
# - the sessions it holds when HAProxy judges it down are shut (`on-marked-down
#   shutdown-sessions`), so their clients resend or resume them elsewhere at once
#   instead of waiting out their timeouts;
# - a health check gets `timeout check 5s` to answer once connected (a check's connect
#   still times out at `inter`: a cut-off node is seen at once, a busy router is not
#   taken for a dead one);
# - a request it took and closed with nothing answered is sent to another router
#   (`retry-on ... empty-response`, which needs the whole request in HAProxy's buffer
#   before it is forwarded: `option http-buffer-request`). Serve retries only a
#   connection that failed and answers the rest with its 502, rewritten to a plain
#   "500 Internal Server Error" that no client can tell from a model error. Every
#   Ballast route may be sent twice: a generation has no side effects, an admin change
#   sets a state, a keyed request is answered once wherever it lands. A router that
#   answered anything, an error included, is never asked again; a request larger than
#   HAProxy's buffer (tune.bufsize, 16 KiB in Serve's config) is not sent again.
#
# HAProxy's stats page (`listen stats`) and Prometheus exporter (`frontend prometheus`),
# which Serve binds on every interface with no authentication, are bound to 127.0.0.1:
# they show every router's address and state, and nothing of Ballast's reads them from
# another host (docs/operations.md, "Fence the admin routes").
#
# Runtime files stay private: the edge is added only when the config's directory is a
# directory (not a symlink) owned by this user that no one else may write; the files
# written there are made with O_EXCL (mktemp, noclobber), never through a symlink; and
# the admin socket Serve declares `mode 666` is bound `mode 600` (only this user
# connects: the routers and Serve's manager run as it).
set -eu
real="${BALLAST_HAPROXY_REAL:?BALLAST_HAPROXY_REAL: the HAProxy binary to run}"
rules="$(dirname "$0")/haproxy_edge.cfg"
cfg=""
prev=""
for a in "$@"; do
    if [ "$prev" = "-f" ]; then cfg="$a"; fi
    prev="$a"
done
if [ -z "$cfg" ]; then exec "$real" "$@"; fi
dir="$(dirname "$cfg")"
out="$cfg.edge"
if [ -L "$dir" ] || [ ! -d "$dir" ] || [ ! -O "$dir" ] || [ -n "$(find "$dir" -maxdepth 0 -perm /022)" ]; then
    echo "haproxy_edge.sh: $dir is not a directory of this user's that only it may write; running $cfg as Serve wrote it" >&2
    exec "$real" "$@"
fi
for m in ballast-shed.map ballast-keys.map ballast-models.map; do
    if [ -L "$dir/$m" ]; then rm -f "$dir/$m"; fi
    [ -f "$dir/$m" ] || ( set -C; : > "$dir/$m" )
done
tmp="$(mktemp "$dir/.edge.XXXXXXXX")"
if ! awk -v rules="$rules" -v dir="$dir" '
    BEGIN { n = 0; m = 0; part = 0
            while ((getline line < rules) > 0) {
                gsub(/@EDGE_DIR@/, dir, line)
                if (line == "#@backend") { part = 1; continue }
                if (part == 0) front[n++] = line; else back[m++] = line } }
    /^[^ \t#]/ { section = $1 " " $2 }
    (section == "listen stats" || section == "frontend prometheus") && /^[ \t]*bind / {
        sub(/bind +[^ ]*:/, "bind 127.0.0.1:"); print; next }
    /^[ \t]*default-server / { print $0 " on-marked-down shutdown-sessions"; next }
    /^[ \t]*stats socket / { gsub(/ mode [0-7]+/, " mode 600"); print; next }
    /^[ \t]*retry-on / && $0 !~ /empty-response/ { print $0 " empty-response"; next }
    { print }
    /^defaults/ { print "    timeout check 5s"; print "    option http-buffer-request" }
    /^frontend http_frontend/ { infront = 1; next }
    infront && !done && /^[ \t]*bind / { for (i = 0; i < n; i++) print front[i]; done = 1 }
    END { if (!done) { print "haproxy_edge.sh: no bind line in frontend http_frontend" > "/dev/stderr"; exit 3 }
          for (i = 0; i < m; i++) print back[i] }
' "$cfg" > "$tmp"; then
    # HAProxy without the edge rather than no HAProxy: the router still refuses in Python.
    echo "haproxy_edge.sh: edge rules not added to $cfg; running it as Serve wrote it" >&2
    rm -f "$tmp"
    exec "$real" "$@"
fi
mv -f "$tmp" "$out"
n=$#
prev=""
for a in "$@"; do
    if [ "$prev" = "-f" ]; then set -- "$@" "$out"; else set -- "$@" "$a"; fi
    prev="$a"
done
shift "$n"
exec "$real" "$@"
