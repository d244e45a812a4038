#!/usr/bin/env bash
# Run gspo_megatron.train under torchrun on this node (single node, or one node of a multi-node job).
#
#   launch/torchrun.sh CONFIG.yaml [dotted.key=value ...]
#
# Environment (defaults in brackets):
#   NNODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]
#   NPROC_PER_NODE [number of GPUs from nvidia-smi, or 1]
#   TORCHRUN: torchrun executable [.venv/bin/torchrun if present, else torchrun on PATH]
# Signals: SIGUSR1, SIGTERM and SIGINT are forwarded to the training processes (torchrun's
# children), which checkpoint and exit; this script then exits with torchrun's status.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.yaml [dotted.key=value ...]" >&2
  exit 2
fi
CONFIG="$1"
shift
if [[ ! -f "$CONFIG" ]]; then
  echo "$0: config file not found: $CONFIG" >&2
  exit 2
fi

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
  [[ "$NPROC_PER_NODE" -ge 1 ]] || NPROC_PER_NODE=1
fi
if [[ -z "${TORCHRUN:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/torchrun" ]]; then
    TORCHRUN="$ROOT/.venv/bin/torchrun"
  elif command -v torchrun >/dev/null 2>&1; then
    TORCHRUN="$(command -v torchrun)"
  else
    echo "$0: no torchrun found (set TORCHRUN or create .venv)" >&2
    exit 2
  fi
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
echo "[torchrun.sh] node ${NODE_RANK}/${NNODES} master ${MASTER_ADDR}:${MASTER_PORT} nproc ${NPROC_PER_NODE} config ${CONFIG}"

"$TORCHRUN" \
  --nnodes "$NNODES" \
  --node-rank "$NODE_RANK" \
  --nproc-per-node "$NPROC_PER_NODE" \
  --master-addr "$MASTER_ADDR" \
  --master-port "$MASTER_PORT" \
  -m gspo_megatron.train --config "$CONFIG" "$@" &
TORCHRUN_PID=$!

# Deliver a signal to the training processes (torchrun's children); torchrun itself would kill
# them after a short grace period instead of letting them checkpoint.
# shellcheck disable=SC2317  # invoked through trap
forward() {
  local sig="$1"
  echo "[torchrun.sh] got SIG${sig}: forwarding to training processes" >&2
  local children
  children="$(pgrep -P "$TORCHRUN_PID" 2>/dev/null || true)"
  if [[ -n "$children" ]]; then
    # shellcheck disable=SC2086  # word splitting of the pid list is intended
    kill -s "$sig" $children 2>/dev/null || true
  else
    kill -s "$sig" "$TORCHRUN_PID" 2>/dev/null || true
  fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'forward INT' INT

# `wait` returns early when a trapped signal arrives: keep waiting until torchrun exits.
status=0
while true; do
  wait "$TORCHRUN_PID" && status=0 || status=$?
  if ! kill -0 "$TORCHRUN_PID" 2>/dev/null; then
    break
  fi
done
exit "$status"
