# Throwaway PostgreSQL server for the tests that share an Optuna study through
# `--storage postgresql://...`. Meant to be *sourced* (by .ci/run); safe under `set -euo pipefail`.
# On return it exports AUTOFLASH_TEST_POSTGRES_URL; the server and its data directory are
# removed when the sourcing shell exits (chained onto any EXIT trap already set).

# A server given from outside (e.g. a developer's own) is used as is.
if [[ -n "${AUTOFLASH_TEST_POSTGRES_URL:-}" ]]; then
    echo "postgres: using the given AUTOFLASH_TEST_POSTGRES_URL"
    return 0
fi

# 1. Server binaries: Debian's package, installed only if no initdb is there. `bash .ci/postgres.sh
#    --install` does only this (.ci/run runs it while pip installs, then sources this file).
if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
    _pg_sudo=""; [[ $(id -u) -eq 0 ]] || _pg_sudo="sudo"
    $_pg_sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $_pg_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
if [[ "${1:-}" == "--install" ]]; then
    return 0 2>/dev/null || exit 0
fi
_pg_bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)

# initdb/postgres refuse to run as root: then use the package's `postgres` system user.
_pg_as() { if [[ $(id -u) -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }

# 2. Temp dir for the cluster, its unix socket and logs; owned by the user the server runs as.
_pg_dir=$(mktemp -d)
[[ $(id -u) -ne 0 ]] || chown postgres: "$_pg_dir"

# Stop the server and drop the temp dir at exit, after whatever EXIT trap was there before.
_pg_prev_trap=$(trap -p EXIT)
eval "_pg_prev_trap=(${_pg_prev_trap:-})"   # -> (trap -- 'CMD' EXIT), or empty
trap "${_pg_prev_trap[2]:-:}
(cd $(printf %q "$_pg_dir") && _pg_as $(printf %q "$_pg_bin/pg_ctl") -D data -s stop -m fast) >/dev/null 2>&1 || true
rm -rf $(printf %q "$_pg_dir")" EXIT

# 3. Fresh cluster, trust auth (a throwaway server reachable on loopback only).
(cd "$_pg_dir" && _pg_as "$_pg_bin/initdb" -D "$_pg_dir/data" -U postgres --auth=trust \
    --encoding=UTF8 --no-sync >"$_pg_dir/initdb.log" 2>&1) \
    || { cat "$_pg_dir/initdb.log" >&2; echo "postgres: initdb failed" >&2; return 1; }

# 4. Free port: 54329 if it can be bound on 127.0.0.1, else one the OS picks
#    (SO_REUSEADDR as postgres sets it, so leftover TIME_WAIT connections do not count).
_pg_port=$(python3 -c '
import socket
for p in (54329, 0):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", p)); print(s.getsockname()[1]); break
        except OSError:
            pass')

# 5. Start it (loopback only, socket in the temp dir, no fsync) and wait until it answers.
(cd "$_pg_dir" && _pg_as "$_pg_bin/pg_ctl" -D "$_pg_dir/data" -l "$_pg_dir/server.log" -W \
    -o "-c listen_addresses=127.0.0.1 -p $_pg_port -c unix_socket_directories=$_pg_dir -c fsync=off" \
    start >/dev/null)
for _pg_i in $(seq 60); do
    "$_pg_bin/pg_isready" -q -h 127.0.0.1 -p "$_pg_port" && break
    if [[ $_pg_i -eq 60 ]]; then
        cat "$_pg_dir/server.log" >&2
        echo "postgres: server on 127.0.0.1:$_pg_port not ready after 30 s (log above)" >&2
        return 1
    fi
    sleep 0.5
done

# 6. The test database; export its SQLAlchemy URL.
"$_pg_bin/createdb" -h 127.0.0.1 -p "$_pg_port" -U postgres autoflash_test
export AUTOFLASH_TEST_POSTGRES_URL="postgresql+psycopg2://postgres@127.0.0.1:$_pg_port/autoflash_test"
echo "postgres: $("$_pg_bin/postgres" --version | awk '{print $3}') running at 127.0.0.1:$_pg_port (data in $_pg_dir), AUTOFLASH_TEST_POSTGRES_URL=$AUTOFLASH_TEST_POSTGRES_URL"
