#!/usr/bin/env bash
# A multi-node Ray cluster on this machine (docs/CLUSTER.md, "A cluster"): a head and worker nodes, each its own
# raylet started by `ray start`, all bound to a loopback address, with cluster.yaml's custom resources: `small` nodes carry
# s2d_small_gpu (the draft, the small targets), `large` nodes s2d_large_gpu (the large targets, TP groups).
#
#   scripts/local_cluster.sh up [SMALL (1)] [LARGE (2)]   head + SMALL small nodes + LARGE large nodes
#   scripts/local_cluster.sh status                         the nodes (ray status)
#   scripts/local_cluster.sh kill NODE                      lose a node: SIGKILL its raylet (e.g. kill large-0)
#   scripts/local_cluster.sh down                           stop every node this script started, and only those
#
# Then: serve deploy -a http://127.0.0.2:8265 deployments/local_cluster.yaml
# Environment: S2D_CLUSTER_PORT (GCS, 6390), S2D_DASHBOARD_PORT (8265), S2D_NODE_CPUS (logical CPUs per node, 2),
# S2D_NODE_IP (the loopback address every node binds, 127.0.0.2),
# S2D_CLUSTER_DIR (pids and logs, ~/.cache/s2d_ray/local-cluster), RAY (the ray command, .venv/bin/ray).
#
# Each node runs `ray start --block` in the background: stopping it (down) stops that node's processes only, and a
# killed raylet takes its node's workers with it, as a lost machine would. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 lets
# worker nodes join (0 refuses them, on Linux too). With it, Ray replaces a --node-ip-address of 127.0.0.1 by the
# machine's outward address; 127.0.0.2 (S2D_NODE_IP), also loopback, keeps every node off the network.
set -eu
cmd=${1:?usage: scripts/local_cluster.sh up [SMALL] [LARGE] | status | kill NODE | down}
ray_cmd=${RAY:-.venv/bin/ray}
port=${S2D_CLUSTER_PORT:-6390}
dash=${S2D_DASHBOARD_PORT:-8265}
cpus=${S2D_NODE_CPUS:-2}
ip=${S2D_NODE_IP:-127.0.0.2}
dir=${S2D_CLUSTER_DIR:-$HOME/.cache/s2d_ray/local-cluster}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

start_node() {  # name, then ray start arguments
  local name=$1; shift
  setsid "$ray_cmd" start --block --node-ip-address "$ip" --num-cpus "$cpus" "$@" > "$dir/$name.log" 2>&1 &
  echo $! > "$dir/$name.pid"
}

wait_nodes() {  # until N nodes are alive, at most 120 s
  for _ in $(seq 1 120); do
    alive=$("$ray_cmd" list nodes --address "http://$ip:$dash" --filter "state=ALIVE" 2>/dev/null |
      grep -c ALIVE || true)
    [ "$alive" -ge "$1" ] && return 0
    sleep 1
  done
  echo "local cluster: $1 nodes not alive after 120 s; logs in $dir" >&2
  return 1
}

case $cmd in
  up)
    small=${2:-1}; large=${3:-2}
    mkdir -p "$dir"
    if ls "$dir"/*.pid > /dev/null 2>&1; then echo "local cluster: already up ($dir); run down first" >&2; exit 1; fi
    start_node head --head --port "$port" --include-dashboard true --dashboard-host "$ip" \
      --dashboard-port "$dash"
    wait_nodes 1
    n=1  # nodes join one at a time: several raylets starting at once on a busy machine can miss Ray's start timeout
    for i in $(seq 0 $((small - 1))); do
      start_node "small-$i" --address "$ip:$port" --resources '{"s2d_small_gpu": 1}'
      n=$((n + 1)); wait_nodes $n
    done
    for i in $(seq 0 $((large - 1))); do
      start_node "large-$i" --address "$ip:$port" --resources '{"s2d_large_gpu": 2}'
      n=$((n + 1)); wait_nodes $n
    done
    echo "local cluster: head + $small small + $large large nodes; GCS $ip:$port, dashboard http://$ip:$dash"
    ;;
  status)
    "$ray_cmd" status --address "$ip:$port"
    ;;
  kill)
    node=${2:?usage: scripts/local_cluster.sh kill NODE}
    pid=$(cat "$dir/$node.pid")
    raylet=$(pgrep -P "$pid" -x raylet || true)
    [ -n "$raylet" ] || { echo "local cluster: no raylet under node $node (pid $pid)" >&2; exit 1; }
    kill -KILL "$raylet"
    rm -f "$dir/$node.pid"
    echo "local cluster: killed the raylet of $node (pid $raylet)"
    ;;
  down)
    pids=""
    for f in "$dir"/*.pid; do
      [ -e "$f" ] || continue
      pids="$pids $(cat "$f")"
      kill -TERM "$(cat "$f")" 2> /dev/null || true
      rm -f "$f"
    done
    for _ in $(seq 1 120); do  # each node stops its replicas gracefully first: up to a minute or so
      alive=0
      for p in $pids; do kill -0 "$p" 2> /dev/null && alive=1; done
      [ $alive = 0 ] && { echo "local cluster: stopped"; exit 0; }
      sleep 1
    done
    echo "local cluster: still stopping after 120 s (pids$pids)" >&2; exit 1
    ;;
  *)
    echo "usage: scripts/local_cluster.sh up [SMALL] [LARGE] | status | kill NODE | down" >&2; exit 2
    ;;
esac
