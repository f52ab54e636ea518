#!/usr/bin/env bash
# `make cluster` / `make cluster-down`: a local control plane for a human, in the background.
#   scripts/cluster.sh up     start (or reuse) it and print `export KUBECONFIG=...`
#                             (NODE=1: plus a real node, kubelet + containerd; needs root)
#   scripts/cluster.sh down   stop it and remove its data
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${DLQ_CLUSTER_DIR:-$PWD/target/cluster}
pidfile=$dir/pid
running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

case ${1:-up} in
  up)
    mkdir -p "$dir"
    if ! running; then
      tools=(kube etcd); node=()
      if [ "${NODE:-0}" = 1 ]; then tools+=(cni pause); node=(--node); fi
      bins=$(bash tools/build.sh "${tools[@]}" | paste -sd:)
      cargo build -q -p dlq-testenv --bin dlq-testenv
      rm -f "$dir/log"
      DLQ_TOOLS_BIN=$bins nohup target/debug/dlq-testenv "${node[@]}" \
        --kubeconfig-out "$dir/kubeconfig" --pid-file "$pidfile" >"$dir/log" 2>&1 </dev/null &
      for _ in $(seq 1 600); do
        grep -q '^ready' "$dir/log" 2>/dev/null && break
        if ! kill -0 $! 2>/dev/null; then cat "$dir/log" >&2; exit 1; fi
        sleep 0.2
      done
      grep -q '^ready' "$dir/log" || { cat "$dir/log" >&2; exit 1; }
    fi
    # `make image-local` imports into this node's containerd.
    sed -n 's/^containerd=//p' "$dir/log" > "$dir/containerd"
    [ -s "$dir/containerd" ] || rm -f "$dir/containerd"
    grep '^node_ready_secs=' "$dir/log" | sed 's/^node_ready_secs=/node Ready after (s): /' || true
    echo "kubectl (v1.36, matches the apiserver): $(bash tools/build.sh kube)/kubectl"
    echo "export KUBECONFIG=$dir/kubeconfig"
    ;;
  down)
    if running; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 1 100); do running || break; sleep 0.1; done
      echo "cluster stopped"
    else
      echo "no cluster running"
    fi
    rm -f "$pidfile" "$dir/containerd"
    ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
