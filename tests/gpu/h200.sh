#!/usr/bin/env bash
# The H200 runs behind docs/benchmarks/gpu.md and gpu-serve.md, one step per device command.
#
# On the lent GPU host, from the repository root, with the vLLM bundle's parts in /tmp/p
# (../shared/gpu/bundle.sh; ../shared/gpu/README.md) and .venv/bin/nats-server carried along:
#
#   KVPUSH_REVISION=<commit> tests/gpu/h200.sh STEP OUT
#
# STEP: ipc (tests/gpu/gpu_ipc.py: a WRITE over cuda_ipc into adjacent allocations), transport
# (kvpush bench transport --device cuda, every case, then the streamed push under other poll
# intervals), stream (the streamed push with a worker's intervals), swap (tests.gpu.gpu_swap),
# check (tests.gpu.gpu_serve, with vLLM's API features; check-vllm: the same, one repeat, into
# check-vllm), serve-a / serve-b / serve-tuned / serve-kvpush / serve-aggregated (the serving
# benchmark in two parts of under 10 minutes, joined afterwards with `kvpush bench serve --join`),
# engines (SYSTEMS=...: issue 29's benchmark, one system a command), engine-check / engine-kvpush
# / engine-vllm-serve / engine-breakdown / engine-trace (the engine-mode probe,
# tests/gpu/gpu_engine.py), checksum (issue 31: kvpush-push with and without --kv-checksum, random
# 2048, c=1 and FRACTIONS (0.25,0.5) of capacity, DURATION seconds of arrivals per loaded point,
# default 10 (engines takes it too), REPEATS (1), MIN_REQUESTS (8), BUDGET (540: start no system
# past it)); checksum-cost: `kvpush bench checksum` on the GPU, TTFT=...; checksum-c1: c=1
# only, MIN_REQUESTS (40) requests, REPEATS (1) repeats, systems in turn), soak (issue 31: the
# chaos soak, 2 P + 1 D of the 8B shape on the GPU (PREFILL, DECODE), MINUTES of load and faults, default 8, cut to
# fit the step's 585 s; FAULTS=..., LIMIT, KV_GIB), routing (issue 32: kvpush-routed,
# kvpush-least-loaded (2P1D on the GPU), vllm-serve and vllm-push on the reuse50/reuse90
# prefix-repetition tables (TABLES=... for others: chat:8192; SYSTEMS=...; D_SHARE; REPEATS;
# MIN_REQUESTS, 24; CONCURRENCY, 1,4; TRACE=1: kvpush's spans under traces/), c=1
# and 4, into routing, within LIMIT seconds (default 585); docs/benchmarks/routing/), routed-load (issue 32's
# load target: kvpush-routed and vllm-serve, random 2048, c=1 and 0.25x-1.0x; P_SHARE,
# D_SHARE; REPEATS). Every step first unpacks the bundle once (/tmp/site) and makes kvpush
# importable from this tree (/tmp/kp); results go under OUT. RESUME=<folder> (checksum,
# routed-load): a carried folder with an earlier call's run folders (checksum/,
# routed-load-<system>/, each with its results.partial.json): those runs go on with --resume
# (repeats that did not fit one call's 10 minutes).
set -u
step=${1:?STEP}
out=${2:?OUT}
mkdir -p "$out"
if [ ! -d /tmp/site/vllm ]; then
    mkdir -p /tmp/site && cat /tmp/p/part-* | tar xzf - -C /tmp/site || exit 2
fi
mkdir -p /tmp/bin /tmp/kp/kvpush
[ -x /tmp/bin/nats-server ] || cp .venv/bin/nats-server /tmp/bin/
for part in connector schemas services benchmarks; do ln -sfn "$PWD/$part" "/tmp/kp/kvpush/$part"; done
export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/kp:/tmp/site PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NIXL_LOG_LEVEL=WARN

# the serving plan of both parts: the same tables, rates (fractions of the given prefill
# capacity: 1 / prefill time of the 8B shape, 52 ms at 2k and 216 ms at 8k) and seeds
SERVE=(bench serve --device cuda --model llama-8b --repeats 1 --output-len 32
    --tables random:2048,random:8192,sonnet:2048 --qps auto --capacity 2048=19,8192=4.6
    --fractions 0.1,0.25,0.5 --concurrency 1 --duration 4 --min-requests 6)

# issue 29's benchmark: every system on its users' default engine flags, load from vLLM's own
# client (`vllm bench serve`), one or two systems per device command (SYSTEMS=a[,b]; BUDGET:
# start no system past this many seconds), joined afterwards
ENGINES=(bench serve --device cuda --model llama-8b --client vllm --repeats 1 --output-len 64
    --tables random:2048,random:8192,prefix:2048 --qps auto --capacity 2048=19,8192=4.6
    --fractions 0.25,0.5,1.0 --concurrency 1 --duration "${DURATION:-10}" --min-requests 8
    --time-budget "${BUDGET:-560}")

# `--resume` (and the run's folder copied under OUT) when RESUME holds the run folder $1
resume_flags() {
    if [ -n "${RESUME:-}" ] && [ -d "$RESUME/$1" ]; then
        cp -r "$RESUME/$1" "$out/$1" && echo --resume
    fi
}

case $step in
ipc)
    # tests/gpu/gpu_ipc.py: a NIXL WRITE over cuda_ipc into KV-like tensors registered as kvpush
    # registers them, and (--merged) as one span across allocations (the rule before 2026-12-06)
    timeout 120 python3 -m tests.gpu.gpu_ipc --merged 2>&1 | grep -v "UCX  WARN" | tail -20
    ;;
soak)
    # issue 31: `kvpush bench soak` on the GPU: 2 P + 1 D of the 8B shape sharing it (the
    # workers' CUDA defaults, an 8 GiB KV cache each), 120 prompts of 2048 tokens (D's prefix
    # cache holds about a quarter: most push and pull requests move KV), a fault every 60 s
    # (kill or stop of a random P, of the D; nats-server restarted once), every answer judged
    # token-exact. --time-budget ends the load in time for the run to stop by itself (engine
    # starts: ~100 s cold, ~40 s warm; the step's seconds so far, the bundle's unpacking, count
    # too); then every process the soak started (they carry KVPUSH_SOAK_MARK: workers, engine
    # cores, nats-server) is killed by its pid: the step ends within 585 s
    # LIMIT: the step's seconds in all (default 570; less when the session's device time is)
    # KV_GIB: each engine's KV cache (default 8; 4 lets the three fit an 80 GiB card)
    # DECODE: decode workers (default 1; 2, on an H200 with KV_GIB=4: a D fault costs no answer)
    # PREFILL: prefill workers (default 2; PREFILL=1 DECODE=2 KV_GIB=4 is three engines, which fit
    # an 80 GiB card: the decode faults with a second D to take over)
    mark="soak-$$-$RANDOM" limit=$((${LIMIT:-570} - SECONDS))
    KVPUSH_SOAK_MARK=$mark timeout "$limit" setsid python3 -m kvpush.services.cli bench soak \
        --device cuda --model llama-8b --prefill "${PREFILL:-2}" --decode "${DECODE:-1}" --minutes "${MINUTES:-8}" \
        --fault-every 60 --faults "${FAULTS:-kill_prefill,kill_decode,stop_prefill,stop_decode,restart_nats}" \
        --prompts 120 --prompt-tokens 2048 --kv-cache-gib "${KV_GIB:-8}" --time-budget $((limit - 30)) --json "$out/soak-h200.json" \
        --log-dir "$out/soak-logs" > "$out/soak.log" 2>&1
    echo "soak rc=$?"; tail -40 "$out/soak.log"
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        left=$(grep -lasF "KVPUSH_SOAK_MARK=$mark" /proc/[0-9]*/environ | cut -d/ -f3)
        # vLLM's engine cores retitle themselves (setproctitle), which overwrites their environ
        # and so the mark: on the lent host nothing else computes on the GPU, so what still
        # holds it is the soak's (two engine cores outlived a soak and held 49 GiB)
        left="$left $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)"
        [ -z "${left// /}" ] && break
        echo "soak: killing what is left: $left"; kill -9 $left 2>/dev/null; sleep 1
    done
    tar czf "$out/soak-logs.tgz" -C "$out" soak-logs && rm -rf "$out/soak-logs"
    ;;
checksum)
    timeout 585 setsid python3 -m kvpush.services.cli bench serve --device cuda --model llama-8b \
        --client vllm --repeats "${REPEATS:-1}" --output-len 64 --tables random:2048 --qps auto \
        --capacity 2048=19 --fractions "${FRACTIONS:-0.25,0.5}" --concurrency 1 \
        --duration "${DURATION:-10}" --min-requests "${MIN_REQUESTS:-8}" \
        --time-budget "${BUDGET:-540}" --systems kvpush-push,kvpush-push-unchecked \
        --out-dir "$out/checksum" $(resume_flags checksum) > "$out/checksum.log" 2>&1
    echo "checksum rc=$?"; tail -8 "$out/checksum.log"
    tar czf "$out/checksum.tgz" -C "$out" checksum && rm -rf "$out/checksum"
    ;;
checksum-cost)
    # issue 31: `kvpush bench checksum` on the GPU, the 8B shape's KV: what one transfer's
    # checksum costs P and D (seconds); TTFT: kvpush-push's c=1 P50 at each length, the
    # share's base (default: docs/benchmarks/gpu-serve.md's H200 run)
    timeout 300 python3 -m kvpush.services.cli bench checksum --device cuda \
        --ttft "${TTFT:-2048=69.2,8192=237}" --out "$out/checksum-cost.json" \
        > "$out/checksum-cost.log" 2>&1
    echo "checksum-cost rc=$?"; tail -8 "$out/checksum-cost.log"
    ;;
checksum-c1)  # the same at c=1 only, 40 requests a system
    timeout 585 setsid python3 -m kvpush.services.cli bench serve --device cuda --model llama-8b \
        --client vllm --repeats "${REPEATS:-1}" --output-len 64 --tables random:2048 --qps "" \
        --concurrency 1 --min-requests "${MIN_REQUESTS:-40}" --time-budget 540 \
        --systems kvpush-push,kvpush-push-unchecked \
        --out-dir "$out/checksum-c1" > "$out/checksum-c1.log" 2>&1
    echo "checksum-c1 rc=$?"; tail -8 "$out/checksum-c1.log"
    tar czf "$out/checksum-c1.tgz" -C "$out" checksum-c1 && rm -rf "$out/checksum-c1"
    ;;
routed-load)
    # issue 32's load target: kvpush-routed against vllm-serve on fresh random 2048-token
    # prompts, c=1 and 0.25x / 0.5x / 1.0x of the 8B shape's prefill capacity: P99 TTFT 1.1x of
    # vllm-serve's or less up to its knee. One bench run per system (join them with `kvpush
    # bench serve --join`): kvpush-routed's three engines (2P1D) share the GPU, P_SHARE (0.25)
    # each, D D_SHARE if given (else P_SHARE); vllm-serve keeps the bench's default share (its
    # one engine 0.8, as in issue 29's runs). SYSTEMS="kvpush-routed-1p1d vllm-serve": the
    # 1P1D row (P_SHARE=0.283 D_SHARE=0.567: kvpush up's own split of 0.85)
    for name in ${SYSTEMS:-kvpush-routed vllm-serve}; do
        share=(); [ "$name" = vllm-serve ] || share=(--gpu-memory-utilization "${P_SHARE:-0.25}")
        [ "$name" = vllm-serve ] || [ -z "${D_SHARE:-}" ] \
            || share+=(--decode-gpu-memory-utilization "$D_SHARE")
        timeout 285 setsid python3 -m kvpush.services.cli bench serve --device cuda \
            --model llama-8b --client vllm --repeats "${REPEATS:-1}" --output-len 64 \
            --tables random:2048 \
            --qps auto --capacity 2048=19 --fractions 0.25,0.5,1.0 --concurrency 1 \
            --duration "${DURATION:-10}" --min-requests 16 "${share[@]}" --time-budget 270 \
            --systems "$name" --out-dir "$out/routed-load-$name" \
            $(resume_flags "routed-load-$name") > "$out/routed-load-$name.log" 2>&1
        echo "routed-load $name rc=$?"; tail -8 "$out/routed-load-$name.log"
        tar czf "$out/routed-load-$name.tgz" -C "$out" "routed-load-$name" \
            && rm -rf "$out/routed-load-$name"
    done
    ;;
routing)
    # issue 32: three engines share the GPU (2 P + 1 D at 0.25 each; vllm-serve gets 0.5).
    # TABLES=chat:8192 (multi-turn chat) needs pandas, which the bundle lacks: carry .gpu/extra
    # (pip download pandas, python-dateutil, six for cp312) and it is installed into /tmp/site
    if [ -d .gpu/extra ] && [ ! -d /tmp/site/pandas ]; then
        python3 -m pip install -q --no-deps --no-compile --target /tmp/site .gpu/extra/*.whl
    fi
    # every engine gets 0.25 of the card (vllm-serve's one engine twice it); D_SHARE: kvpush's
    # decode engine's own (e.g. 0.4: P 0.25 + P 0.25 + D 0.4; at 0.25 D's KV cache cannot hold
    # reuse90:8192's shared prefixes beside four running prompts,
    # docs/benchmarks/routing/h100-reuse-1.md). KVPUSH_* settings in the environment reach
    # kvpush's workers and are recorded in results.json (meta.kvpush_env, shown by the report):
    # KVPUSH_SERIAL_PREFILL_TOKENS=512 (D admits long LOCAL prompts one an engine step; the
    # default 0 is vLLM's batching: docs/operating.md "Long prompts D computes"),
    # KVPUSH_ENGINE_ARG=--block-size=16 (vLLM's CUDA block instead of kvpush's 128:
    # docs/operating.md "Block size")
    limit=${LIMIT:-585}
    timeout "$limit" setsid python3 -m kvpush.services.cli bench serve --device cuda \
        --model llama-8b --client vllm --repeats "${REPEATS:-1}" --output-len 64 --qps "" \
        --tables "${TABLES:-reuse50:8192,reuse90:8192}" \
        --concurrency "${CONCURRENCY:-1,4}" --min-requests "${MIN_REQUESTS:-24}" ${TRACE:+--trace} \
        --gpu-memory-utilization 0.25 \
        ${D_SHARE:+--decode-gpu-memory-utilization "$D_SHARE"} --time-budget $((limit - 45)) \
        --systems "${SYSTEMS:-kvpush-routed,kvpush-least-loaded,vllm-serve,vllm-push}" \
        --out-dir "$out/routing" > "$out/routing.log" 2>&1
    echo "routing rc=$?"; tail -8 "$out/routing.log"
    tar czf "$out/routing.tgz" -C "$out" routing && rm -rf "$out/routing"
    ;;
engines)
    name=${SYSTEMS:?SYSTEMS=one,or,more}
    # RESTART=1: the system is started once more after its points (E10, restart_s)
    timeout 585 setsid python3 -m kvpush.services.cli "${ENGINES[@]}" --systems "$name" \
        ${RESTART:+--restart} \
        --out-dir "$out/engines-${name//,/-}" > "$out/engines-${name//,/-}.log" 2>&1
    echo "engines $name rc=$?"; tail -8 "$out/engines-${name//,/-}.log"
    # one file back (the device returns 8 files at most, 2 folders down)
    tar czf "$out/engines-${name//,/-}.tgz" -C "$out" "engines-${name//,/-}" \
        && rm -rf "$out/engines-${name//,/-}"
    ;;
transport)
    timeout 200 python3 -m kvpush.services.cli bench transport --device cuda --repeats 10 \
        --json "$out/transport-cuda.json" 2>&1 | tail -20
    for poll in 500,1000 50,1000 50,200; do
        timeout 60 python3 -m kvpush.services.cli bench transport --device cuda --stream-only \
            --tokens 2048 8192 --repeats 15 --poll-us "$poll" \
            --json "$out/stream-${poll/,/-}.json" 2>&1 | tail -4
    done
    ;;
stream)
    timeout 90 python3 -m kvpush.services.cli bench transport --device cuda --stream-only \
        --tokens 2048 8192 --repeats 15 --json "$out/stream-worker.json" 2>&1 | tail -4
    ;;
swap)
    # the engines as kvpush up runs them on CUDA (graphs, engine-core process); SWAP_ENGINE=eager:
    # the thread-driven eager engines of the earlier runs
    timeout 560 setsid python3 -m tests.gpu.gpu_swap --out "$out/swap" \
        --engine "${SWAP_ENGINE:-vllm}" 2>&1 | tail -15
    ;;
check)
    # kvpush up on the GPU: push and pull token-identical to local, KV received (gpu.md)
    timeout 300 setsid python3 -m tests.gpu.gpu_serve --out "$out/check" --repeats 2 2>&1 | tail -12
    ;;
engine-check)
    # issue 29: the serving check with the workers' CUDA defaults (engine-core process, graphs)
    timeout 570 setsid python3 -m tests.gpu.gpu_serve --out "$out/check" --repeats 1 \
        --start-timeout-s 500 2>&1 | tail -12
    ;;
engine-kvpush|engine-vllm-serve)
    # issue 29: start to ready, then vllm bench serve at c=1 and a rate (tests.gpu.gpu_engine)
    timeout 580 setsid python3 -m tests.gpu.gpu_engine --out "$out/engine" \
        --system "${step#engine-}" ${ENGINE_FLAGS:-} 2>&1 | tail -30
    ;;
engine-breakdown)
    # issue 29: the TTFT breakdown (kvpush ttft) at c=1 and 8 req/s, engine-core process, then
    # the same with the engine on a worker thread (CUDA graphs both)
    timeout 330 setsid python3 -m tests.gpu.gpu_engine --out "$out/engine" --trace process \
        --points c1-2048,r8-2048 --start-timeout-s 280 2>&1 | tail -40
    pkill -f "vllm|kvpush.services|nats-server" 2>/dev/null; sleep 3
    timeout 240 setsid python3 -m tests.gpu.gpu_engine --out "$out/engine" --trace thread \
        --points c1-2048,r8-2048 --start-timeout-s 190 --flag=--engine-core=thread 2>&1 | tail -40
    ;;
engine-trace)
    # issue 29: one traced kvpush run (ENGINE_FLAGS: extra kvpush up flags), packed as one file
    timeout 480 setsid python3 -m tests.gpu.gpu_engine --out "$out/engine" --trace trace \
        --points "${POINTS:-c1-2048,c1-8192,r8-2048}" --start-timeout-s 300 ${ENGINE_FLAGS:-} \
        2>&1 | tail -16
    tar czf "$out/engine-trace.tgz" -C "$out" engine && rm -rf "$out/engine"
    ;;
check-vllm)
    # the same, one repeat (the gateway answers with vLLM 0.26's serving layer, API features too)
    timeout 300 setsid python3 -m tests.gpu.gpu_serve --out "$out/check-vllm" --repeats 1 \
        2>&1 | tail -14
    ;;
serve-aggregated)
    # the one-engine floor again, in the same sitting as serve-kvpush
    timeout 585 setsid python3 -m kvpush.services.cli "${SERVE[@]}" \
        --systems aggregated --out-dir "$out/serve-aggregated" \
        > "$out/serve-aggregated.log" 2>&1
    echo "serve-aggregated rc=$?"; tail -5 "$out/serve-aggregated.log"
    ;;
serve-a)
    # the committed part ran under `timeout 440` (the session's device time left) and was cut
    # short after vllm-push: docs/benchmarks/gpu-serve/parts/a-results.partial.json
    timeout 585 setsid python3 -m kvpush.services.cli "${SERVE[@]}" \
        --systems aggregated,vllm-push,vllm-pull-tuned,kvpush-pull --out-dir "$out/serve-a" \
        > "$out/serve-a.log" 2>&1
    echo "serve-a rc=$?"; tail -5 "$out/serve-a.log"
    ;;
serve-b)
    timeout 585 setsid python3 -m kvpush.services.cli "${SERVE[@]}" \
        --systems kvpush-push,vllm-pull --out-dir "$out/serve-b" \
        > "$out/serve-b.log" 2>&1
    echo "serve-b rc=$?"; tail -5 "$out/serve-b.log"
    ;;
serve-tuned)
    # vLLM's pull with READ on cuda_ipc, alone (serve-a was cut before it)
    timeout 585 setsid python3 -m kvpush.services.cli "${SERVE[@]}" \
        --systems vllm-pull-tuned --out-dir "$out/serve-tuned" \
        > "$out/serve-tuned.log" 2>&1
    echo "serve-tuned rc=$?"; tail -5 "$out/serve-tuned.log"
    ;;
serve-kvpush)
    # kvpush's two modes at this tree's revision (they replace older parts' points on --join)
    timeout 585 setsid python3 -m kvpush.services.cli "${SERVE[@]}" \
        --systems kvpush-pull,kvpush-push --out-dir "$out/serve-kvpush" \
        > "$out/serve-kvpush.log" 2>&1
    echo "serve-kvpush rc=$?"; tail -5 "$out/serve-kvpush.log"
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
pkill -f "vllm|kvpush.services|nats-server" 2>/dev/null
exit 0
