#!/usr/bin/env bash
# The one script a device lease runs (see docs/gpu.md). Usage, from the repository root:
#
#   bash bench/device_run.sh [smoke] [tests] [bench] [-- extra bench/gpu.py args]
#
# It installs the carried, slimmed wheels (.whl/slim, made by bench/slim_wheels.py) into /tmp/site,
# restores a carried flashinfer JIT cache (.whl/jit/*.tar.xz) when there is one, records the machine
# (GPU, driver, CUDA, torch), then runs the steps named on the command line:
#   smoke  import flashinfer and nixl, JIT-build the attention kernels, one NIXL VRAM agent
#   tests  pytest -m gpu tests/gpu (for real: CUDA is there)
#   bench  python3 bench/gpu.py (writes bench/results/gpu-<device>-<date>.json)
#   boot   process start -> SERVING on one GPU, 8B shape from tmpfs and disk, each phase (bench/gpu_boot.py)
#   boot-cold  the colocated --variant boots of `boot` from a cold disk (args after -- as for boot)
#   zygote     workers forked from a zygote: the GPU test, colocated 8B boots forked vs fresh (page cache, rounds
#              alternated), kill -9 -> healthy under pdserve up with --zygote on / off (bench.restart_time)
#   early-upload  what the early upload costs the imports beside it, off / read / register (bench/early_upload_probe.py)
#   boot-profile  a worker's start step by step (imports, CUDA init, build_engine under cProfile), 8B, twice
#   stream-8b  layer-wise KV push on vs off, llama3-8b shape, NIXL and TCP (bench.prefill_stream)
#   frontier   goodput frontier, 2 GPUs, llama3-8b, log-normal mix: 1P1D NIXL / TCP, conditional, 2 colocated,
#              then each at 1.5x its SLO-goodput rate (bench/gpu_frontier.py; args after -- go to it,
#              e.g. `frontier -- --size small`, ~8 minutes)
#   tp         one worker at TP 2 vs TP 1 (llama3-8b decode b1/b64 x 4k, 4k prefill; llama3-70b-short at TP 2), 2 GPUs
#   tp-serving 1P(TP1) -> 1D(TP1) vs one TP-2 colocated worker, log-normal mix, 2 GPUs (bench.gpu_tp --serving)
#   tp4        1P(TP2) -> 1D(TP2), hetero 1P(TP1) -> 1D(TP2), beside the 2-GPU modes; needs 4 GPUs (bench.gpu_tp4)
#   kv-trace   where TCP frame time goes on both sides (kvtrace tx-frames / rx-frames), staging depth 2 vs 1 vs 4
#   kv-concurrency  TCP KV transfers GPU0 -> GPU1, 1/4/16 in flight (2k tokens, llama3-8b layout), each
#              beside a raw socket over the same connections; mutual TLS (relay helpers, and in-process) vs plaintext
#              at 1 and 16 (bench.kv_bench;
#              args after -- go to it, e.g. `kv-concurrency -- --variant spin=staging_blocking_sync=false`)
#   gemv       decode's matrix products at batch 1/4/16 with cuBLAS and cuBLASLt, GB/s (bench.gemv_probe;
#              `-- --triton` sweeps engine.gemv's configurations beside them)
#   imports    where a worker's imports go, -X importtime of torch, flashinfer, triton (bench.import_profile)
#   lane-staging  TCP transfers between two transports of one process on one GPU, staged on the lanes'
#              threads vs on the event loop (bench.lane_staging_probe; the one-GPU stand-in for kv-concurrency)
#   staging    the TCP path's staging copies alone and beside a loopback socket blast (bench.staging_probe)
#   kv-tiers   KV tiers on one GPU, llama3-8b: onload from host vs a raw pinned copy, an 8k returning turn's TTFT
#              from host vs recomputed, TPOT while offloading (bench/gpu_kv_tiers.py; `-- --parts sessions` runs
#              pdserve bench multi-turn, tiers off vs on, 1P1D on the GPU; needs the gRPC wheels)
#   penalties  what penalties and a logit bias cost a decode step, llama3-8b at batch 1/16/64 x 1k, all rows /
#              half the rows / none penalized, rounds alternated (bench.penalty_cost; ~2 minutes)
#   structured what structured output costs a decode step, llama3-8b at batch 1/16/64 x 1k, 0% / 50% / 100% of
#              the rows under a JSON schema, rounds alternated (bench.structured_cost; needs llguidance's wheel)
#   allreduce  NCCL vs the one-shot all-reduce over symmetric memory (engine.tp_allreduce), exactness and us per
#              call in a CUDA graph, 1-256 rows of 4096 (bench.allreduce_probe; one GPU: the one-shot path alone)
#   step-ahead decode steps launched ahead vs synchronous, one engine, llama3-8b: decode b1..b64 x 1k/4k,
#              token identity, and a colocated serving mix at 2/4/6/8 req/s, 2 rounds in alternating order
#              (bench.gpu_step_ahead; ~7 minutes)
# With no step named it runs smoke, tests and bench (several minutes).
# Everything worth keeping goes to $OUT (logs, JSON, the compiled JIT kernels as one .tar.xz).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Multicast over NVLink stays off on shared hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export FLASHINFER_DISABLE_VERSION_CHECK=1

t0=$(date +%s)
export PDSERVE_BENCH_COMMAND="bash bench/device_run.sh $*"
log() { echo "[device_run +$(( $(date +%s) - t0 ))s] $*"; }

install() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/slim/*.whl 2>&1 | grep -v -i "warning" | tail -5
    # kvtransfer imports `nixl_cu12` or the `nixl` meta-package's `nixl._api`; the cu13 wheel is
    # `nixl_cu13`, so give it the meta-package's name.
    mkdir -p /tmp/site/nixl
    echo "from nixl_cu13._api import *  # noqa" >/tmp/site/nixl/_api.py
    echo "from nixl_cu13 import *  # noqa" >/tmp/site/nixl/__init__.py
    export PYTHONPATH=/tmp/site:$PWD
    # libcudart.so.13 for nixl's UCX plugin comes from the CUDA runtime wheel next to torch.
    local cudart
    cudart=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null)
    for d in "$cudart"/nvidia/cu13/lib "$cudart"/nvidia/cuda_runtime/lib /usr/local/cuda/lib64; do
        [ -d "$d" ] && export LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
    done
    if ls .whl/jit/*.tar.xz >/dev/null 2>&1; then
        mkdir -p "$FLASHINFER_WORKSPACE_BASE" && for f in .whl/jit/*.tar.xz; do tar -xJf "$f" -C "$FLASHINFER_WORKSPACE_BASE"; done
        log "restored flashinfer JIT cache: $(du -sh $FLASHINFER_WORKSPACE_BASE | cut -f1)"
    fi
}

machine() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
    nvidia-smi topo -m 2>/dev/null | head -8 | tee -a "$OUT/machine.txt"
    nvcc --version | tail -2 | tee -a "$OUT/machine.txt"
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'gpus', torch.cuda.device_count())" | tee -a "$OUT/machine.txt"
}

save_jit() {
    # The compiled kernels (.so) only; the generated sources are rebuilt cheaply from the package.
    local base=$FLASHINFER_WORKSPACE_BASE
    [ -d "$base/.cache" ] || return 0
    (cd "$base" && find .cache -name "*.so" | tar -cf - -T - | xz -T8 -6 >"$OUT/jit.tar.xz")
    log "JIT cache: $(du -sh $OUT/jit.tar.xz | cut -f1) (xz); carry it back as .whl/jit/jit.tar.xz"
}

steps=()
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; extra=("$@"); break ;;
        *) steps+=("$1"); shift ;;
    esac
done
[ ${#steps[@]} -eq 0 ] && steps=(smoke tests bench)

install
machine
rc=0
for step in "${steps[@]}"; do
    log "step $step"
    case "$step" in
        smoke) python3 bench/gpu_smoke.py 2>&1 | tee "$OUT/smoke.log"; rc=$(( rc | $? )) ;;
        tests) python3 -m pytest -q -m gpu ${PDSERVE_GPU_TESTS:-tests/gpu} -p no:cacheprovider -o addopts="" -rs --timeout 900 2>&1 \
                   | tee "$OUT/tests.log"; rc=$(( rc | $? )) ;;
        bench) python3 bench/gpu.py --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/bench.log"; rc=$(( rc | $? )) ;;
        frontier) python3 bench/gpu_frontier.py --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/frontier.log"
                  rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        kv-tiers) python3 bench/gpu_kv_tiers.py --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/kv-tiers.log"
                  rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        tp) python3 -m bench.gpu_tp --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/tp.log"; rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        tp-serving) python3 -m bench.gpu_tp --serving --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/tp-serving.log"
                    rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        tp4) python3 -m bench.gpu_tp4 --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/tp4.log"; rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        disagg-small) python3 bench/gpu_disagg.py "$OUT" small 2>&1 | tee "$OUT/disagg.log"; rc=$(( rc | $? ))
                      tail -n 30 "$OUT"/disagg-logs/*.log ;;
        stream-8b)  # layer-wise KV push on vs off on the llama3-8b shape (bench/prefill_stream.py)
            python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; \
from gpu_disagg import write_checkpoint; write_checkpoint(Path('/dev/shm/pdserve-llama3-8b'), 'llama3-8b')"
            for tr in nixl tcp; do
                python3 -m bench.prefill_stream --model /dev/shm/pdserve-llama3-8b --device cuda \
                    --transport $tr --lengths 1024,4096 --iters 6 --threads 1 \
                    --json "$OUT/kv-stream-layers-8b-$tr.json" 2>&1 | tee -a "$OUT/stream.log"; rc=$(( rc | $? ))
            done ;;
        boot)  # process start -> SERVING, llama3-8b shape on ONE GPU, tmpfs / disk cold / page cache,
               # colocated and 1P1D, beside the raw read; then decode at batch 1 vs the HBM bound
            python3 bench/gpu_boot.py --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/boot.log"; rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        boot-cold)  # the colocated --variant boots only, each from a cold disk (evicted before it), into $OUT/cold
            python3 bench/gpu_boot.py --out "$OUT/cold" "${extra[@]}" --layouts "" --skip-roofline --no-first-start \
                --variant-source disk-cold 2>&1 | tee "$OUT/boot-cold.log"; rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        zygote)
            python3 -m pytest -q -m gpu tests/gpu/test_zygote_gpu.py -p no:cacheprovider -o addopts="" -rs -s \
                --timeout 600 2>&1 | tee "$OUT/zygote-tests.log"; rc=$(( rc | ${PIPESTATUS[0]} ))
            python3 bench/gpu_boot.py --out "$OUT" --layouts "" --skip-roofline --zygote "${extra[@]}" 2>&1 \
                | tee "$OUT/boot-zygote.log"; rc=$(( rc | ${PIPESTATUS[0]} ))
            python3 -m bench.restart_time --model /var/tmp/pdserve-boot --role decode --rounds 3 \
                --up-args "--colocated 1 --device cuda --decode-args '--kv-memory-gb 8'" \
                --run-dir /tmp/restart-bench --json "$OUT/restart-gpu.json" 2>&1 | tee "$OUT/restart.log"
            rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        early-upload)  # the early upload beside the imports, per way (off / read / register), page cache then cold
            python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; \
from gpu_disagg import write_checkpoint; write_checkpoint(Path('/dev/shm/pdserve-llama3-8b'), 'llama3-8b')"
            [ -f /var/tmp/pdserve-boot/config.json ] || cp -r /dev/shm/pdserve-llama3-8b/. /var/tmp/pdserve-boot/
            python3 bench/early_upload_probe.py --out "$OUT" 2>&1 | tee "$OUT/early-upload.log"
            rc=$(( rc | ${PIPESTATUS[0]} ))
            python3 bench/early_upload_probe.py --out "$OUT" --cold --rounds 2 2>&1 | tee -a "$OUT/early-upload.log"
            rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        boot-profile)  # where a worker's start goes (bench/boot_profile.py), llama3-8b from tmpfs, twice
                       # (the first also pays flashinfer's JIT when its cache was not carried)
            python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; \
from gpu_disagg import write_checkpoint; write_checkpoint(Path('/dev/shm/pdserve-llama3-8b'), 'llama3-8b')"
            for i in 1 2; do
                python3 -m bench.boot_profile --model /dev/shm/pdserve-llama3-8b --device cuda --top 40 \
                    --json "$OUT/boot-profile-$i.json" "${extra[@]}" 2>&1 | tee "$OUT/boot-profile-$i.log"
                rc=$(( rc | ${PIPESTATUS[0]} ))
            done ;;
        kv-trace)  # where TCP frame time goes on both sides (kvtrace tx-frames / rx-frames), 1 and 16 in
                   # flight, staging depth 2 (default) beside 1 and 4 (bench/kvtrace_frames.py summarises)
            rx_gpu=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
            KVTRANSFER_LOG=INFO python3 -m bench.kv_bench --device cuda --rx-gpu "$rx_gpu" --backends "" \
                --concurrency 1,16 --conc-tokens 2048 --tls-concurrency "" --variant traced=trace=true \
                --variant traced1=trace=true,tcp_stage_ahead=1 --variant traced4=trace=true,tcp_stage_ahead=4 --json "$OUT/kvtransfer-trace-gpu.json" \
                "${extra[@]}" > "$OUT/kv-trace.log" 2>&1
            rc=$(( rc | $? ))
            grep -v "kvtrace" "$OUT/kv-trace.log" | grep -v "^ " | tail -12
            python3 bench/kvtrace_frames.py "$OUT/kv-trace.log" --json "$OUT/kvtrace-frames-gpu.json" ;;
        kv-concurrency)  # GPU0 -> GPU1 over TCP; on a one-GPU machine both processes share GPU0
            rx_gpu=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
            python3 -m bench.kv_bench --device cuda --rx-gpu "$rx_gpu" --backends "" --concurrency 1,4,16 --conc-tokens 2048 \
                --tls-concurrency 1,16 --variant tls_inproc=tls=true,tls_procs=0 --json "$OUT/kvtransfer-concurrency-gpu.json" "${extra[@]}" 2>&1 \
                | tee "$OUT/kv-concurrency.log"
            rc=$(( rc | $? )) ;;
        imports) python3 -m bench.import_profile --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/imports.log"
                 rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        gemv) python3 -m bench.gemv_probe --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/gemv.log"
              rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        lane-staging) python3 -m bench.lane_staging_probe --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/lane-staging.log"
                      rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        step-ahead) python3 -m bench.gpu_step_ahead --out "$OUT" --serve-rates 2,4,6,8 "${extra[@]}" 2>&1 \
            | tee "$OUT/step-ahead.log"; rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        allreduce)  # NCCL vs the one-shot all-reduce over symmetric memory (bench.allreduce_probe); on a
                    # one-GPU machine both ranks share GPU0 and only the one-shot path runs
            ar_gpus=$( [ "$(nvidia-smi -L | wc -l)" -gt 1 ] && echo 0,1 || echo 0,0 )
            python3 -m bench.allreduce_probe --gpus "$ar_gpus" --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/allreduce.log"
            rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        structured) python3 -m bench.structured_cost --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/structured.log"
                    rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        penalties) python3 -m bench.penalty_cost --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/penalties.log"
                   rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        staging) python3 -m bench.staging_probe --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/staging.log"
                 rc=$(( rc | ${PIPESTATUS[0]} )) ;;
        *) echo "unknown step $step"; rc=2 ;;
    esac
    log "step $step done (rc so far $rc)"
done
save_jit
# Only 8 files come back from $OUT: results (json/md/png) and the JIT cache stay; every log and
# sub-folder goes into one logs-<time>.tar.xz (one per invocation: a command may run this script twice).
bundle=logs-$(date +%H%M%S).tar.xz
(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name "*.json" ! -name "*.md" ! -name "*.png" \
    ! -name "*.tar.xz" -printf "%P\n" | tar -cJf "$bundle" -T - --remove-files)
log "logs: $(du -sh "$OUT/$bundle" | cut -f1) in $bundle; back: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
