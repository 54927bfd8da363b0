#!/usr/bin/env bash
# Where a 1P1D cluster's worker processes spend their threads' time past capacity: the TCP mode at one
# rate (default 18 req/s on 2 GPUs, llama3-8b, the frontier's log-normal mix) with py-spy sampling the
# prefill and the decode worker (every thread, idle ones too, native frames) once their first request
# was served. Runs on the device, from the repository root, with py-spy's wheel carried in .whl/tools:
#
#   bash bench/overload_profile.sh [RATE] [SECONDS] [-- extra bench/gpu_frontier.py args]
#   python3 bench/pyspy_threads.py OUT/pyspy-*.txt     # per thread: what it was doing (shares)
#
# Writes $OUT/pyspy-{prefill,decode}.txt (py-spy raw: one collapsed stack per line with its count) next
# to the frontier's own outputs (traced: PDSERVE_KV_TRACE=1, so bench/kvtrace_serving.py reads the logs);
# device_run.sh packs the files under $OUT into logs-<time>.tar.xz when it ends.
set -uo pipefail
OUT=${OUT:-/tmp/out}
RATE=${1:-18}
SECS=${2:-10}
shift $(( $# > 2 ? 2 : $# ))
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/tools/py_spy-*.whl 2>&1 | tail -2
SPY=/tmp/pyspy/bin/py-spy
export PDSERVE_KV_TRACE=1
bash bench/device_run.sh frontier -- --modes 1p1d-tcp --rates "$RATE" --stop-below 0 --overload-factor 0 \
    --tag profile "$@" >"$OUT/frontier-run.log" 2>&1 &
run=$!
for _ in $(seq 600); do
    log=$(ls "$OUT"/frontier-logs/*/logs/prefill-*.log 2>/dev/null | head -1)
    [ -n "$log" ] && grep -q "kvtrace prefill" "$log" && break
    sleep 0.5
done
sleep 2  # into the point: the backlog builds within seconds past capacity
for role in prefill decode; do
    pid=$(pgrep -f "serve --role $role" | head -1)
    [ -n "$pid" ] && "$SPY" record -p "$pid" -r 100 -d "$SECS" --idle --threads --native -f raw \
        -o "$OUT/pyspy-$role.txt" >"$OUT/pyspy-$role.log" 2>&1 &
done
wait "$run"
wait
# device_run.sh bundled everything under $OUT (the py-spy files and this run's log included) into
# $OUT/logs-<time>.tar.xz; unpack it to read them.
ls "$OUT"
