#!/usr/bin/env bash
# Runs one peer runner with the virtual environment made by setup.sh and the environment it needs:
#
#   bench/peers/run.sh VENV nixl|mooncake [--cells 4K:1,64K:100,4M:1,64M:1] [--cell-ms 1000] [--transport T]
#
# nixl: UCX_MODULES=^ib (UCX's InfiniBand module crashes the process at exit on a host without it).
# mooncake: a private network namespace (unshare -n) with only loopback up, since the engine's
# listeners bind every interface.
# stdout: one JSON object per cell, always, also when the peer cannot run (its "error" says why);
# stderr: progress and the libraries' logs. Exit: 0 every cell measured and verified, 1 some cell
# has an error, 2 bad usage.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
log() { echo "peers-run: $*" >&2; }
usage() { log "usage: $0 VENV nixl|mooncake [--cells ...] [--cell-ms N] [--transport T]"; exit 2; }

[[ $# -ge 2 ]] || usage
venv=$1 peer=$2
shift 2
case "$peer" in
    nixl) script="$here/nixl_bench.py" ;;
    mooncake) script="$here/mooncake_bench.py" ;;
    *) usage ;;
esac

# Without a usable environment the runner still reports every cell, with the reason, through the
# host's python (the runners import only the standard library before they load their peer).
if [[ ! -x "$venv/bin/python" || ! -f "$venv/kvgate-peer-pins.txt" ]]; then
    reason="no complete peer environment at $venv (make it with bench/peers/setup.sh $venv)"
    log "$reason"
    exec python3 "$script" "$@" --report-unavailable "$reason"
fi
python="$venv/bin/python"
log "$peer with $(tr '\n' ' ' <"$venv/kvgate-peer-pins.txt")"

case "$peer" in
    nixl)
        UCX_MODULES=${UCX_MODULES:-^ib} exec "$python" "$script" "$@"
        ;;
    mooncake)
        if ! unshare -n true 2>/dev/null; then
            reason="cannot make a private network namespace (unshare -n needs root or CAP_SYS_ADMIN); Mooncake's listeners would bind every interface"
            log "$reason"
            exec "$python" "$script" "$@" --report-unavailable "$reason"
        fi
        exec unshare -n sh -c 'ip link set lo up && exec "$@"' sh "$python" "$script" "$@"
        ;;
esac
