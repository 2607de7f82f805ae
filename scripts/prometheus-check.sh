#!/usr/bin/env bash
# Checks the Prometheus alert rules and the Grafana dashboard in deploy/ against a real Prometheus
# scraping two real gateways:
#   1. promtool checks the rules file, the example config and the config generated here;
#   2. a prefill and a decode gateway start on loopback (temporary folder, free ports, psk peer link,
#      discovery pointed at an etcd that is not there), and the Python client moves KV between them,
#      fails three rooms (two aborts, one deadline) and holds one live;
#   3. Prometheus (its own port and storage) scrapes both admin listeners every second, rules loaded;
#   4. every dashboard query and every rule's expression is run through Prometheus' HTTP API: none may
#      fail, every dashboard query must return series, every metric a rule reads must exist, and every
#      rule must be loaded with health "ok".
# Needs: the release binary (cargo build --release), the Python client's environment
# (scripts/python-tests.sh makes target/python-venv), prometheus and promtool (Debian: prometheus).
# Exits non-zero on any failure; every process it starts is stopped on exit. KEEP_WORK=1 keeps the
# temporary folder (configs, logs, Prometheus data); the *_TIMEOUT_S variables below bound each wait.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

# Bounded waits (seconds).
GATEWAY_READY_TIMEOUT_S="${GATEWAY_READY_TIMEOUT_S:-20}"   # gateways answering, peer link up
PROMETHEUS_READY_TIMEOUT_S="${PROMETHEUS_READY_TIMEOUT_S:-30}" # Prometheus answering /-/ready
TARGETS_UP_TIMEOUT_S="${TARGETS_UP_TIMEOUT_S:-30}"         # both targets scraped and up
TRAFFIC_TIMEOUT_S="${TRAFFIC_TIMEOUT_S:-60}"               # rooms moved, aborted, one held live
QUERY_TIMEOUT_S="${QUERY_TIMEOUT_S:-30}"                   # series appearing for the queries
export GATEWAY_READY_TIMEOUT_S PROMETHEUS_READY_TIMEOUT_S TARGETS_UP_TIMEOUT_S QUERY_TIMEOUT_S

target_dir="${CARGO_TARGET_DIR:-target}"
kvgate="${KVGATE_BIN:-$(realpath "$target_dir")/release/kvgate}"
venv_py="$(realpath "$target_dir")/python-venv/bin/python"
prometheus="${PROMETHEUS_BIN:-prometheus}"
promtool="${PROMTOOL_BIN:-promtool}"
rules="$repo/deploy/prometheus/kvgate-alerts.yml"
dashboard="$repo/deploy/grafana/kvgate-dashboard.json"
check_py="$repo/scripts/prometheus_check.py"

say() { echo "prometheus-check: $*"; }
fail() { echo "prometheus-check: FAIL: $*" >&2; exit 1; }

[ -x "$kvgate" ] || fail "no kvgate binary at $kvgate (cargo build --release first, or set KVGATE_BIN)"
[ -x "$venv_py" ] || fail "no Python client environment at $venv_py (run scripts/python-tests.sh first)"
command -v "$prometheus" >/dev/null || fail "no $prometheus (Debian: apt-get install prometheus, or set PROMETHEUS_BIN)"
command -v "$promtool" >/dev/null || fail "no $promtool (Debian: apt-get install prometheus, or set PROMTOOL_BIN)"
command -v python3 >/dev/null || fail "no python3"

work="$(mktemp -d "${TMPDIR:-/tmp}/kvgate-prom.XXXXXX")"
pids=()
cleanup() {
  local rc=$?
  local i pid
  # The last started first: the engine, Prometheus, then the gateways.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ "$rc" -ne 0 ]; then
    for f in prefill.log decode.log prometheus.log traffic.log; do
      [ -s "$work/$f" ] || continue
      echo "prometheus-check: --- last lines of $f ---" >&2
      grep -v 'kvgate::discovery' "$work/$f" | tail -n 25 >&2 || true
    done
  fi
  if [ "${KEEP_WORK:-0}" = 1 ]; then echo "prometheus-check: work folder kept: $work" >&2; else rm -rf "$work"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Waits until the file $1 exists, at most $2 seconds (named by $3), while process $4 lives.
wait_for_file() {
  local file="$1" timeout="$2" name="$3" pid="$4" t=0
  while [ ! -e "$file" ]; do
    kill -0 "$pid" 2>/dev/null || fail "$name: the process exited first"
    t=$((t + 1)); [ "$t" -le $((timeout * 10)) ] || fail "$name: not done within $timeout s"
    sleep 0.1
  done
}

# 1. promtool on the rules and the example config.
say "promtool check rules deploy/prometheus/kvgate-alerts.yml"
"$promtool" check rules "$rules"
say "promtool check config deploy/prometheus/prometheus.yml (the example)"
"$promtool" check config "$repo/deploy/prometheus/prometheus.yml"

# 2. Two gateways.
read -r p_peer d_peer p_admin d_admin prom_port etcd_port <<<"$(python3 "$check_py" ports 6)"
"$kvgate" keygen psk "$work/peer.key" >/dev/null
write_config() { # name peer-name listen-port peer-port admin-port
  cat >"$work/$1.toml" <<EOF
[gateway]
name = "$1"

[engine_api]
unix_socket = "$work/$1.sock"
session_grace_ms = 1000

[peer_link]
listen = "127.0.0.1:$3"
heartbeat_interval_ms = 100
heartbeat_misses = 5
reconnect_interval_ms = 100
psk_file = "$work/peer.key"

[discovery]
# No etcd listens there: discovery errors are counted (the static peer below still serves).
etcd_endpoints = ["http://127.0.0.1:$etcd_port"]
request_timeout_ms = 500
retry_interval_ms = 2000

[[peers]]
name = "$2"
address = "127.0.0.1:$4"
same_host = true

[plugins]
preference = ["shm"]

[scheduler]
# The room held live while Prometheus is queried must outlast the check.
bootstrap_timeout_ms = 120000
room_timeout_ms = 120000

[admin]
listen = "127.0.0.1:$5"
# Early, so that the held room is counted in kvgate_stuck_rooms_total.
stuck_room_warn_ms = [1000]

[admin.connections]
# Short, so that the silent connection opened below is closed and counted (listener_refused_total).
handshake_timeout_ms = 500

[driver]
io_threads = 1
EOF
}
write_config prefill decode "$p_peer" "$d_peer" "$p_admin"
write_config decode prefill "$d_peer" "$p_peer" "$d_admin"
for g in prefill decode; do
  "$kvgate" config check "$work/$g.toml" >/dev/null
  RUST_LOG="${RUST_LOG:-info}" "$kvgate" serve --config "$work/$g.toml" </dev/null >/dev/null 2>"$work/$g.log" &
  pids+=($!)
  say "gateway $g started (pid $!, config $work/$g.toml)"
done
python3 "$check_py" wait-ready "127.0.0.1:$p_admin" "127.0.0.1:$d_admin"

# 3. Prometheus, scraping both every second with the rules loaded (the example config's job, with
# loopback targets and short intervals).
cat >"$work/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - $rules
scrape_configs:
  - job_name: kvgate
    static_configs:
      - targets: ["127.0.0.1:$p_admin"]
        labels: {role: prefill}
      - targets: ["127.0.0.1:$d_admin"]
        labels: {role: decode}
EOF
say "promtool check config (generated)"
"$promtool" check config "$work/prometheus.yml"
prom_url="http://127.0.0.1:$prom_port"
"$prometheus" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" --log.level=warn >"$work/prometheus.log" 2>&1 &
prom_pid=$!
pids+=("$prom_pid")
say "prometheus started (pid $prom_pid, $prom_url)"
python3 "$check_py" wait-prometheus "$prom_url" "$prom_pid"
python3 "$check_py" wait-targets "$prom_url" 2

# KV moved, rooms failed, one held live.
"$venv_py" "$check_py" traffic "$work/prefill.sock" "$work/decode.sock" prefill decode "$work/traffic.ready" \
  </dev/null >"$work/traffic.log" 2>&1 &
traffic_pid=$!
pids+=("$traffic_pid")
say "traffic started (pid $traffic_pid)"
wait_for_file "$work/traffic.ready" "$TRAFFIC_TIMEOUT_S" "traffic (TRAFFIC_TIMEOUT_S)" "$traffic_pid"
cat "$work/traffic.log"
# A connection to each admin listener that never says anything: closed after handshake_timeout_ms,
# and counted, so that the listener-refusal series exist.
python3 - "$p_admin" "$d_admin" <<'PY'
import socket, sys, time
held = [socket.create_connection(("127.0.0.1", int(port))) for port in sys.argv[1:]]
time.sleep(1.0)
PY
say "a silent connection held past each admin listener's handshake bound"

# 4. Every query.
python3 "$check_py" check "$prom_url" "$dashboard" "$rules"
