#!/usr/bin/env bash
# Start SGLang HTTP servers on this node (disaggregated rollout), optionally the SGLang router.
#
# Environment (defaults in brackets):
#   MODEL_PATH (required)       HF checkpoint the engines load first (weights are then synced)
#   SGLANG_TP [1]               GPUs per engine; engines per node = GPUs on node / SGLANG_TP
#   SGLANG_PORT [30000]         engine i listens on SGLANG_PORT + 10*i, host 0.0.0.0
#   SGLANG_MEM_FRACTION [0.85]  --mem-fraction-static
#   SGLANG_EXTRA_ARGS []        extra sglang.launch_server flags (word-split)
#   GSPO_CONFIG []              the training config: the engines also get the flags (and environment)
#                               it needs: routing replay, LoRA adapters, --ep-size, the delta loader
#                               (python -m gspo_megatron.fleet.engine_args CONFIG OVERRIDES prints them;
#                               the trainer refuses engines that lack them)
#   GSPO_CONFIG_OVERRIDES []    dotted.key=value overrides of GSPO_CONFIG (word-split)
#   SGLANG_MODULE [sglang.launch_server]  the server program; gspo_megatron.cpu_server is the
#                               CPU stand-in (same flags and HTTP API; tests only)
#   NUM_ENGINES [GPUs on node / SGLANG_TP]
#   START_ROUTER [0]            1: also start the router over ROUTER_WORKER_URLS on ROUTER_PORT [30100]
#   LOG_DIR [logs]              one log per engine: LOG_DIR/sglang-<host>-<i>.log
#   PYTHON [.venv/bin/python if present, else python3]
# Runs until its servers exit or it receives SIGTERM/SIGINT (then stops them).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${MODEL_PATH:?MODEL_PATH must name the HF checkpoint for the SGLang engines}"
SGLANG_TP="${SGLANG_TP:-1}"
SGLANG_PORT="${SGLANG_PORT:-30000}"
SGLANG_MEM_FRACTION="${SGLANG_MEM_FRACTION:-0.85}"
SGLANG_EXTRA_ARGS="${SGLANG_EXTRA_ARGS:-}"
START_ROUTER="${START_ROUTER:-0}"
ROUTER_PORT="${ROUTER_PORT:-30100}"
LOG_DIR="${LOG_DIR:-logs}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
mkdir -p "$LOG_DIR"
HOST="$(hostname)"

SGLANG_MODULE="${SGLANG_MODULE:-sglang.launch_server}"
CONFIG_ARGS=""
if [[ -n "${GSPO_CONFIG:-}" ]]; then
  # shellcheck disable=SC2086  # GSPO_CONFIG_OVERRIDES is a list of overrides
  CONFIG_ARGS="$(cd "$ROOT" && "$PYTHON" -m gspo_megatron.fleet.engine_args "$GSPO_CONFIG" ${GSPO_CONFIG_OVERRIDES:-})" || exit 2
  # shellcheck disable=SC2086
  while IFS= read -r kv; do
    [[ -n "$kv" ]] && export "${kv?}"
  done < <(cd "$ROOT" && "$PYTHON" -m gspo_megatron.fleet.engine_args --env "$GSPO_CONFIG" ${GSPO_CONFIG_OVERRIDES:-} 2>/dev/null)
  echo "[sglang_node.sh] flags from $GSPO_CONFIG: $CONFIG_ARGS"
fi
if [[ -z "${NUM_ENGINES:-}" ]]; then
  NGPUS="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
  if [[ "$NGPUS" -lt "$SGLANG_TP" ]]; then
    echo "$0: node $HOST has $NGPUS GPUs, fewer than SGLANG_TP=$SGLANG_TP" >&2
    exit 2
  fi
  NUM_ENGINES=$((NGPUS / SGLANG_TP))
fi
# SGLang's memory saver does not support expandable segments.
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF

PIDS=()
for ((i = 0; i < NUM_ENGINES; i++)); do
  port=$((SGLANG_PORT + 10 * i))
  # shellcheck disable=SC2086  # SGLANG_EXTRA_ARGS is a list of flags
  "$PYTHON" -m "$SGLANG_MODULE" \
    --model-path "$MODEL_PATH" --host 0.0.0.0 --port "$port" \
    --tp-size "$SGLANG_TP" --base-gpu-id $((i * SGLANG_TP)) \
    --mem-fraction-static "$SGLANG_MEM_FRACTION" --skip-server-warmup \
    $CONFIG_ARGS $SGLANG_EXTRA_ARGS >"$LOG_DIR/sglang-$HOST-$i.log" 2>&1 &
  PIDS+=("$!")
  echo "[sglang_node.sh] engine $i on $HOST:$port (GPUs $((i * SGLANG_TP))..$(((i + 1) * SGLANG_TP - 1)))"
done

if [[ "$START_ROUTER" == "1" ]]; then
  : "${ROUTER_WORKER_URLS:?ROUTER_WORKER_URLS (space separated) is required with START_ROUTER=1}"
  # shellcheck disable=SC2086  # ROUTER_WORKER_URLS is a list
  "$PYTHON" -m sglang_router.launch_router --worker-urls $ROUTER_WORKER_URLS \
    --host 0.0.0.0 --port "$ROUTER_PORT" --policy cache_aware >"$LOG_DIR/sglang-router-$HOST.log" 2>&1 &
  PIDS+=("$!")
  echo "[sglang_node.sh] router on $HOST:$ROUTER_PORT"
fi

# shellcheck disable=SC2317  # invoked through trap
stop_all() {
  kill -s TERM "${PIDS[@]}" 2>/dev/null || true
}
trap stop_all TERM INT
wait
