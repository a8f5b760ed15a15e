#!/usr/bin/env bash
# A real multi-node Ray cluster on this machine, for trying and testing multi-node runs:
#   cluster/local.sh up N     a Ray head + N worker nodes (`ray start`) and an MLflow server,
#                             all on 127.0.0.1; writes $STATE/env with the addresses
#                             (RAYACC_LOCAL_MLFLOW=0: no MLflow server, for runs that
#                             record into a store of their own)
#   cluster/local.sh autoscale MAX  a Ray head and Ray's autoscaler, which starts worker nodes
#                             here (fake multi-node provider, up to MAX) when work is pending
#                             and stops them once idle (RAYACC_LOCAL_IDLE_MIN minutes)
#   cluster/local.sh nodes    how many nodes are alive
#   cluster/local.sh slots    free/total worker slots (a slot a finished run's workers still
#                             hold, or a node not yet counted, starts an elastic run smaller)
#                             (`nodes quick`, `slots quick`: from the autoscaler report, cheap
#                             to poll but up to a few seconds behind)
#   cluster/local.sh add      one more worker node (autoscaling experiments by hand)
#   cluster/local.sh remove I kills worker node I and its processes, as a lost machine would go
#   cluster/local.sh reclaim I S  a spot reclaim of worker node I: Ray drains it for preemption
#                             with a deadline S seconds away (the notice), then it is removed
#   cluster/local.sh status
#   cluster/local.sh down     stops exactly the processes `up` and `add` started
#   cluster/local.sh prune    drops records of processes that are gone (`up` does this first)
# A record holds a process id with that process's start time and the boot it started in: a
# process id reused by another process (after the node died, or a reboot) is never signalled.
# Each node has its own ports and custom resources: node_head, node_1, ..., node_N to force
# placement, and one worker_slot each (scaling.extra_resources={worker_slot: 1} puts at most one
# training worker on a node, which elastic runs need: their sizing counts resources). Settings: RAYACC_LOCAL_DIR (state, default .rayacc/local-cluster),
# RAYACC_LOCAL_PORT (first port, default 26379), RAYACC_LOCAL_CPUS (CPUs per node, default 2).
set -euo pipefail

STATE=${RAYACC_LOCAL_DIR:-$PWD/.rayacc/local-cluster}
BASE=${RAYACC_LOCAL_PORT:-26379}
CPUS=${RAYACC_LOCAL_CPUS:-2}
HOST=127.0.0.1
# Ray >= 2.59 starts local clusters with token authentication; every client here must use it
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
BIN=$(dirname "$(command -v python3)")
[ -x "$PWD/.venv/bin/ray" ] && BIN=$PWD/.venv/bin
# job drivers run `python` from the nodes' PATH: the project's environment comes first
export PATH="$BIN:$PATH"
# Every node is on this machine: a node whose raylet stops answering Ray's health checks for 5 s
# is gone (checked every 1 s, not 3 s: a removed node is declared dead in ~5 s instead of ~15 s,
# which a run that lost a worker there waits out). Each check still waits up to 10 s for a reply,
# so a node slowed by a busy machine is not taken for dead.
export RAY_health_check_period_ms=${RAY_health_check_period_ms:-1000}
RAY=${RAY:-$BIN/ray}
MLFLOW=${MLFLOW:-$BIN/mlflow}
GCS_PORT=$BASE
DASH_PORT=$((BASE + 1))
MLFLOW_PORT=$((BASE + 2))
# Unix socket paths must stay short: Ray's session folders live under /tmp, named after $BASE
TEMP=/tmp/rayacc-local-$BASE

node_ports() {  # the ports of node $1 (0 = head), each node in its own block of 200
  local o=$((BASE + 100 + 200 * $1))
  echo "--node-manager-port=$o --object-manager-port=$((o + 1)) --dashboard-agent-grpc-port=$((o + 2))" \
       "--dashboard-agent-listen-port=$((o + 3)) --metrics-export-port=$((o + 4))" \
       "--runtime-env-agent-port=$((o + 5)) --min-worker-port=$((o + 10)) --max-worker-port=$((o + 199))"
}

boot_id() { cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo unknown; }

start_time() {  # the start time of process $1 (field 22 of /proc/PID/stat), empty when gone
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  stat=${stat##*) }  # after the command name, which may hold spaces
  # shellcheck disable=SC2086
  set -- $stat
  echo "${20}"
}

start_bg() {  # start a command in its own session; record it under $1
  local name=$1; shift
  # the command records itself (pid, start time, boot): setsid forks when it cannot detach in
  # place, so $! can name a process that is already gone
  # shellcheck disable=SC2016
  setsid bash -c 'set -- "$@"; f=$1; shift; s=$(cat /proc/$$/stat); s=${s##*) }; read -r -a a <<<"$s"
    echo "$$ ${a[19]} $(cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo unknown)" >"$f"
    exec "$@"' rayacc-local "$STATE/$name.pid" "$@" >"$STATE/$name.log" 2>&1 < /dev/null &
  local i
  for i in $(seq 1 50); do [ -s "$STATE/$name.pid" ] && return 0; sleep 0.1; done
  echo "local.sh: $name did not start" >&2
  return 1
}

descendants() {  # a process id and all its descendants
  local pid=$1
  echo "$pid"
  for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do descendants "$child"; done
}

# A node's start (raylet, dashboard and runtime-env agents: Python processes importing Ray)
# took over 90 s on 2 cores beside a training run; the limits leave room for that
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then echo "local.sh: $what not ready after $limit s" >&2; return 1; fi
    sleep 1
  done
}

start_worker() {  # worker node $1
  # shellcheck disable=SC2046
  start_bg "worker$1" "$RAY" start --block --address=$HOST:$GCS_PORT --node-ip-address=$HOST \
    --num-cpus="$CPUS" --num-gpus=0 --object-store-memory=$((512 * 1024 * 1024)) \
    --resources="{\"node_$1\": 1, \"worker_slot\": 1}" $(node_ports "$1")
}

# Ray's own start of a node gives up after 30 s ("The current node timed out during startup")
# when the machine is loaded, and its `ray start` exits: started again, twice at most
join_worker() {  # join_worker I DEADLINE: waits until worker node I joins, by $SECONDS DEADLINE
  local i=$1 deadline=$2 restarts=0
  until node_joined "$i" >/dev/null 2>&1; do
    if [ -z "$(recorded_pid "$STATE/worker$i.pid")" ]; then
      if [ "$restarts" -ge 2 ]; then
        echo "local.sh: worker node $i's ray start exited $((restarts + 1)) times; its log: $STATE/worker$i.log" >&2
        tail -n 5 "$STATE/worker$i.log" >&2 || true
        return 1
      fi
      restarts=$((restarts + 1))
      cp "$STATE/worker$i.log" "$STATE/worker$i.exited$restarts.log" 2>/dev/null || true
      echo "local.sh: worker node $i's ray start exited before it joined (log kept as worker$i.exited$restarts.log); starting it again" >&2
      start_worker "$i" || return 1
    fi
    if [ $SECONDS -ge "$deadline" ]; then echo "local.sh: worker node $i not ready by the deadline" >&2; return 1; fi
    sleep 1
  done
}

recorded_pid() {  # the pid of record $1 when it is still the process that was started, else nothing
  local pid start boot
  read -r pid start boot <"$1" 2>/dev/null || return 0
  [ -n "$pid" ] && [ "$boot" = "$(boot_id)" ] && [ -n "$start" ] || return 0
  [ "$(start_time "$pid")" = "$start" ] && running "$pid" && echo "$pid"
  return 0
}

prune() {  # drop records of processes that are gone or whose pid another process now holds
  local f kept=0
  for f in "$STATE"/*.pid; do
    [ -f "$f" ] || continue
    if [ -n "$(recorded_pid "$f")" ]; then kept=$((kept + 1)); else rm -f "$f"; fi
  done
  if [ "$kept" -eq 0 ]; then rm -f "$STATE/env"; fi
  return 0
}

ray_token() {  # the token of Ray's token authentication, found where Ray's own clients look
  if [ -n "${RAY_AUTH_TOKEN:-}" ]; then echo "$RAY_AUTH_TOKEN"; return 0; fi
  cat "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" 2>/dev/null || true
}

# What `ray status` prints (the autoscaler's report of nodes and resource use), from the head's
# dashboard. Every wait here polls it each second: `ray status`, or a Python process that calls
# ray.init to read resources, costs 1.5-2 CPU-seconds a poll (a process importing Ray) and
# slowed the very node start it waited for; a curl costs a few milliseconds.
cluster_status() {
  local token auth=()
  token=$(ray_token)
  [ -z "$token" ] || auth=(-H "Authorization: Bearer $token")
  curl -sf --max-time 10 "${auth[@]}" "http://$HOST:$DASH_PORT/api/cluster_status"
}

from_status() {  # from_status nodes|slots|joined I: read from cluster_status's JSON (stdin)
  "$BIN/python" -S -c '
import json, sys
status = json.load(sys.stdin)["data"]["clusterStatus"] or {}
# the autoscaler report appears with its first update, a few seconds after the head starts
report = status.get("autoscalerReport") or {}
usage = (status.get("loadMetricsReport") or {}).get("usage") or {}
what = sys.argv[1]
if what == "nodes":  # the nodes Ray counts alive, busy or idle
    print(sum((report.get("activeNodes") or {}).values()) + sum((report.get("idleNodes") or {}).values()))
elif what == "slots":  # usage holds [used, total] per resource (camel-cased by the dashboard)
    used, total = usage.get("worker_slot") or usage.get("workerSlot") or (0, 0)
    print(f"{total - used:g}/{total:g} worker slots free")
else:  # has worker node I joined: its resource node_I is in the totals
    sys.exit(0 if f"node_{sys.argv[2]}" in usage or f"node{sys.argv[2]}" in usage else 1)
' "$@"
}

head_ready() { cluster_status >/dev/null; }

wait_for_head() {  # as wait_for, but a head whose `ray start` exited is said at once, with why
  local deadline=$((SECONDS + 120))
  until head_ready >/dev/null 2>&1; do
    if [ -z "$(recorded_pid "$STATE/head.pid")" ]; then
      echo "local.sh: the Ray head's ray start exited; the end of its log ($STATE/head.log):" >&2
      tail -n 3 "$STATE/head.log" >&2
      return 1
    fi
    if [ $SECONDS -ge $deadline ]; then echo "local.sh: Ray head not ready after 120 s" >&2; return 1; fi
    sleep 1
  done
}

ensure_token() {  # token authentication needs a token before the head starts, in Ray's place
  [ "$RAY_AUTH_MODE" = token ] && [ -z "$(ray_token)" ] || return 0
  if [ -n "${RAY_AUTH_TOKEN_PATH:-}" ]; then
    echo "local.sh: RAY_AUTH_TOKEN_PATH names $RAY_AUTH_TOKEN_PATH, which holds no token: put" \
      "the cluster's token there, or unset it for a token of this machine's own" >&2
    exit 1
  fi
  # a machine where Ray never ran has none, and `ray start --head` does not make one
  "$RAY" get-auth-token --generate >/dev/null
}

node_joined() {  # has worker node $1 joined the cluster
  cluster_status | from_status joined "$1"
}

add() {
  [ -f "$STATE/env" ] || { echo "local.sh: no cluster is up ($STATE)" >&2; exit 1; }
  local i=1
  while [ -f "$STATE/worker$i.pid" ]; do i=$((i + 1)); done
  start_worker "$i"
  join_worker "$i" $((SECONDS + 180))
  echo "worker node $i up"
}

remove() {
  local f="$STATE/worker${1:?usage: local.sh remove I}.pid"
  [ -f "$f" ] || { echo "local.sh: no worker node $1" >&2; exit 1; }
  local pid; pid=$(recorded_pid "$f")
  if [ -z "$pid" ]; then
    rm -f "$f"
    echo "worker node $1 was already gone"
    return 0
  fi
  # shellcheck disable=SC2046
  signal_same KILL $(with_start $(descendants "$pid"))
  echo "worker node $1 killed"
}

node_id() {  # the Ray node id of worker node $1
  "$BIN/python" - "$HOST:$GCS_PORT" "$1" <<'PY'
import sys

import ray

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
found = [n["NodeID"] for n in ray.nodes() if n["Alive"] and f"node_{sys.argv[2]}" in n["Resources"]]
print(found[0] if found else "")
PY
}

reclaim() {  # a spot reclaim of worker node $1: a preemption notice of $2 seconds, then it goes
  local i=${1:?usage: local.sh reclaim I SECONDS} s=${2:?usage: local.sh reclaim I SECONDS} id
  [ -f "$STATE/worker$i.pid" ] || { echo "local.sh: no worker node $i" >&2; exit 1; }
  id=$(node_id "$i")
  [ -n "$id" ] || { echo "local.sh: worker node $i is not in the cluster" >&2; exit 1; }
  # what a cloud's reclaim warning makes Ray's autoscaler do: drain the node for preemption
  # with a deadline (Ray Train sees it; the node stays up until it is killed)
  "$RAY" drain-node --address=$HOST:$GCS_PORT --node-id="$id" \
    --reason=DRAIN_NODE_REASON_PREEMPTION --reason-message="spot reclaim" \
    --deadline-remaining-seconds="$s"
  echo "worker node $i ($id) drained for preemption; it goes in $s s"
  sleep "$s"
  remove "$i"
}

up() {
  local n=${1:?usage: local.sh up N}
  prune
  if [ -f "$STATE/env" ]; then echo "local.sh: a cluster is already up ($STATE); run down first" >&2; exit 1; fi
  mkdir -p "$STATE" "$TEMP"
  ensure_token
  # shellcheck disable=SC2046
  start_bg head "$RAY" start --head --block --node-ip-address=$HOST --port=$GCS_PORT \
    --dashboard-host=$HOST --dashboard-port=$DASH_PORT --include-dashboard=true \
    --ray-client-server-port=$((BASE + 3)) --temp-dir="$TEMP" --num-cpus="$CPUS" --num-gpus=0 \
    --object-store-memory=$((512 * 1024 * 1024)) --resources='{"node_head": 1, "worker_slot": 1}' \
    $(node_ports 0)
  wait_for_head || exit 1
  for i in $(seq 1 "$n"); do start_worker "$i"; done
  local with_mlflow=${RAYACC_LOCAL_MLFLOW:-1}
  if [ "$with_mlflow" != 0 ]; then
    # one server process: each of the default 4 imports MLflow anew (slow on a small machine)
    start_bg mlflow "$MLFLOW" server --host $HOST --port $MLFLOW_PORT --workers 1 \
      --backend-store-uri "sqlite:///$STATE/mlflow.db" --artifacts-destination "$STATE/mlartifacts"
  fi
  local deadline=$((SECONDS + 180))
  for i in $(seq 1 "$n"); do join_worker "$i" "$deadline" || exit 1; done
  local tracking=""
  if [ "$with_mlflow" != 0 ]; then
    wait_for 120 "MLflow server" curl -sf "http://$HOST:$MLFLOW_PORT/health"
    tracking="export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT"
  fi
  {
    echo "export RAY_ADDRESS=http://$HOST:$DASH_PORT"
    echo "export RAYACC_GCS_ADDRESS=$HOST:$GCS_PORT"
    [ -z "$tracking" ] || echo "$tracking"
    echo "export RAY_AUTH_MODE=$RAY_AUTH_MODE"
  } >"$STATE/env"
  echo "local cluster up: head + $n worker node(s), $CPUS CPUs each"
  cat "$STATE/env"
}

autoscale() {  # a Ray head whose autoscaler starts worker nodes on this machine
  local max=${1:?usage: local.sh autoscale MAX}
  prune
  if [ -f "$STATE/env" ]; then echo "local.sh: a cluster is already up ($STATE); run down first" >&2; exit 1; fi
  mkdir -p "$STATE" "$TEMP"
  ensure_token
  # Ray's fake multi-node provider: the autoscaler "launches" a node as Ray processes here,
  # and terminates it after it has been idle for idle_timeout_minutes
  cat >"$STATE/autoscaling.yaml" <<YAML
cluster_name: rayacc-local
max_workers: $max
upscaling_speed: 1.0
idle_timeout_minutes: ${RAYACC_LOCAL_IDLE_MIN:-0.25}
provider:
  type: fake_multinode
  gcs_address: "$HOST:$GCS_PORT"
  use_node_id_as_ip: true
  disable_node_updaters: true
  disable_launch_config_check: true
available_node_types:
  ray.head.default:
    resources: {CPU: $CPUS, node_head: 1, worker_slot: 1}
    node_config: {}
    max_workers: 0
  ray.worker.cpu:
    resources: {CPU: $CPUS, worker_slot: 1, object_store_memory: $((512 * 1024 * 1024))}
    node_config: {}
    min_workers: 0
    max_workers: $max
head_node_type: ray.head.default
auth: {}
docker: {}
initialization_commands: []
setup_commands: []
head_setup_commands: []
worker_setup_commands: []
head_start_ray_commands: []
worker_start_ray_commands: []
file_mounts: {}
cluster_synced_files: []
file_mounts_sync_continuously: false
rsync_exclude: []
rsync_filter: []
YAML
  # shellcheck disable=SC2046
  RAY_FAKE_CLUSTER=1 AUTOSCALER_UPDATE_INTERVAL_S=1 start_bg head "$RAY" start --head --block \
    --autoscaling-config="$STATE/autoscaling.yaml" --node-ip-address=$HOST --port=$GCS_PORT \
    --dashboard-host=$HOST --dashboard-port=$DASH_PORT --include-dashboard=true \
    --ray-client-server-port=$((BASE + 3)) --temp-dir="$TEMP" --num-cpus="$CPUS" --num-gpus=0 \
    --object-store-memory=$((512 * 1024 * 1024)) --resources='{"node_head": 1, "worker_slot": 1}' \
    $(node_ports 0)
  wait_for_head || exit 1
  cat >"$STATE/env" <<ENV
export RAY_ADDRESS=http://$HOST:$DASH_PORT
export RAYACC_GCS_ADDRESS=$HOST:$GCS_PORT
export RAY_AUTH_MODE=$RAY_AUTH_MODE
ENV
  echo "local autoscaling cluster up: a head; Ray's autoscaler adds up to $max worker node(s) of $CPUS CPUs"
  cat "$STATE/env"
}

# `nodes` and `slots` ask Ray itself (a driver that connects: exact, about 2 CPU-seconds);
# `nodes quick` and `slots quick` read the autoscaler report instead (a curl: cheap, but up to
# its update period behind), for a wait to poll before it confirms with the exact answer
alive_nodes() {  # how many nodes the cluster has now
  if [ "${1:-}" = quick ]; then cluster_status | from_status nodes; return; fi
  "$BIN/python" - "$HOST:$GCS_PORT" <<'PY'
import sys

import ray

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(sum(1 for n in ray.nodes() if n["Alive"]))
PY
}

free_slots() {  # worker slots free / in the cluster, as Ray's resource view has them now
  if [ "${1:-}" = quick ]; then cluster_status | from_status slots; return; fi
  "$BIN/python" - "$HOST:$GCS_PORT" <<'PY'
import sys

import ray

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
free = ray.available_resources().get("worker_slot", 0)
total = ray.cluster_resources().get("worker_slot", 0)
print(f"{free:g}/{total:g} worker slots free")
PY
}

running() {  # is $1 a live process (an exited one awaiting its parent does not count)
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

tree_of_recorded() {  # every live process `up`/`add` started, with its descendants
  for f in "$STATE"/*.pid; do
    [ -f "$f" ] || continue
    local pid; pid=$(recorded_pid "$f")
    if [ -n "$pid" ]; then descendants "$pid"; fi
  done
  return 0
}

wait_gone() {  # wait_gone INTERVAL PID...: up to 20 checks, INTERVAL apart, until none runs
  local interval=$1; shift
  for _ in $(seq 1 20); do
    local alive=0
    for p in "$@"; do running "$p" && alive=1; done
    [ $alive -eq 0 ] && return 0
    sleep "$interval"
  done
  return 0
}

with_start() {  # PID:START for each of the pids given that still runs
  local p s
  for p in "$@"; do
    s=$(start_time "$p")
    if [ -n "$s" ]; then echo "$p:$s"; fi
  done
  return 0
}

signal_same() {  # signal_same SIG PID:START...: signals each process that is still the one
  # recorded (its pid may have been freed and taken by another process since)
  local sig=$1 e; shift
  for e in "$@"; do
    if [ "$(start_time "${e%%:*}")" = "${e#*:}" ]; then kill "-$sig" "${e%%:*}" 2>/dev/null || true; fi
  done
  return 0
}

down() {
  [ -d "$STATE" ] || { echo "local.sh: nothing to stop ($STATE)"; return 0; }
  local procs
  # shellcheck disable=SC2207
  procs=($(with_start $(tree_of_recorded)))
  local count=${#procs[@]}
  if [ "$count" -gt 0 ]; then
    signal_same TERM "${procs[@]}"
    wait_gone 0.5 "${procs[@]%%:*}"
    # what is left, children spawned meanwhile included, is killed outright: each checked
    # again, since a process that ended after TERM may have handed its pid to another
    # shellcheck disable=SC2207
    procs=("${procs[@]}" $(with_start $(tree_of_recorded)))
    signal_same KILL "${procs[@]}"
    wait_gone 0.25 "${procs[@]%%:*}"
  fi
  rm -f "$STATE"/*.pid "$STATE/env"
  rm -rf "$TEMP"
  echo "local cluster down: stopped $count process(es)"
}

status() {
  for f in "$STATE"/*.pid; do
    [ -f "$f" ] || { echo "no local cluster in $STATE"; return 0; }
    local pid; pid=$(recorded_pid "$f")
    if [ -n "$pid" ]; then echo "$(basename "$f" .pid): running (pid $pid)"; else echo "$(basename "$f" .pid): gone"; fi
  done
}

# sourced (tests): the functions only
if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi

case "${1:-}" in
  up) up "${2:-1}" ;;
  add) add ;;
  remove) remove "${2:-}" ;;
  reclaim) reclaim "${2:-}" "${3:-}" ;;
  autoscale) autoscale "${2:-}" ;;
  nodes) alive_nodes "${2:-}" ;;
  node-id) node_id "${2:?usage: local.sh node-id I}" ;;
  slots) free_slots "${2:-}" ;;
  down) down ;;
  status) status ;;
  prune) prune ;;
  *) echo "usage: cluster/local.sh up N | autoscale MAX | add | remove I | reclaim I SECONDS | node-id I | nodes [quick] | slots [quick] | status | down | prune" >&2; exit 2 ;;
esac
