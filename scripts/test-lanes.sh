#!/usr/bin/env bash
# Runs the workspace's test binaries, the in-process ones (unit, reconciler, property tests) and
# the integration binaries of tests/, in TEST_LANES parallel lanes. The integration binaries
# spend most of their time waiting on real servers (apiserver, brokers, a browser): on two cores
# two lanes took 915 s of a fresh clone's run (the binaries' sum: 1,765 s), three take about
# two thirds of that; the in-process ones fill the lanes beside them. Each lane takes the next
# binary from one queue (heaviest first) when it is free, so a slow one delays no other lane's
# list. Each binary's output goes to target/test-logs/<binary>.log, printed when it fails.
#
#   scripts/test-lanes.sh <cargo test args...>     (TEST_LANES=1 for one lane)
set -uo pipefail
lanes=${TEST_LANES:-3}
logs=target/test-logs
rm -rf "$logs"; mkdir -p "$logs"

# The integration tests write control planes, broker data and a node's image store under the
# temp dir and target/: below a few GiB they fail midway with ENOSPC, so say it first.
need_gib=${TEST_MIN_FREE_GIB:-6}
for d in "${TMPDIR:-/tmp}" target; do
  free_kib=$(df -Pk "$d" | awk 'NR == 2 {print $4}')
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((need_gib * 1024 * 1024)) ]; then
    echo "test-lanes: only $((free_kib / 1024)) MiB free under $d; the tests need about ${need_gib} GiB" \
      "(images, etcd, brokers). Free some space (or set TEST_MIN_FREE_GIB to risk it)." >&2
    exit 101
  fi
done

# Build every test binary and learn its path and kind (lib/bin/example or test).
cargo test "$@" --no-run --message-format=json-render-diagnostics >"$logs/build.json" \
  || { echo "test-lanes: building the tests failed" >&2; exit 101; }
mapfile -t entries < <(python3 - "$logs/build.json" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    # Benches are built (make test lints them) but only `make bench` runs them.
    if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["bench"]:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        kind = "integration" if m["target"]["kind"] == ["test"] else "inprocess"
        name = m["target"]["name"] if kind == "integration" else m["target"]["name"] + "." + m["target"]["kind"][0]
        # Run where cargo test would: the package's directory.
        print(kind, name, m["manifest_path"].rsplit("/", 1)[0], m["executable"])
EOF
)

# The tests run as on a developer's machine: without `make test`'s linting compiler (a test that
# runs cargo or make builds as a user would).
unset RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS

# Seconds each slow binary took in a fresh-clone run here (2026-12-07, two lanes): the longest
# go first (LPT). Stale weights cost wall time: the old ones left the lanes at 716 s and 515 s.
weight() {
  case $1 in
    backends.a) echo 240 ;; backends.b) echo 270 ;; chaos) echo 178 ;; sidekiq) echo 112 ;; replay) echo 76 ;;
    bodies) echo 66 ;; knative) echo 59 ;; held_memory) echo 57 ;; redrive) echo 56 ;;
    http_park|chart_node|alerts) echo 49 ;; chart_rbac) echo 44 ;; quota|park) echo 42 ;;
    release) echo 36 ;; bodies_clouds) echo 31 ;; nats) echo 28 ;; leader) echo 25 ;;
    ui|gitops|deadletter.lib) echo 24 ;; groups|cli) echo 23 ;; sqs|capacity) echo 21 ;;
    seal|pubsub|kafka|bodies_cli) echo 18 ;; amqp) echo 16 ;;
    *.lib | *.bin | *.example) echo 1 ;; *) echo 10 ;;
  esac
}

# Binaries run as several processes, each with libtest filters (comma-separated): one binary
# much longer than the rest would otherwise be a whole lane's run. `backends` (78 tests, 447 s)
# by backend (first split with Sidekiq beside Kafka, SQS and Pub/Sub: 326 s against 179 s for
# the others, so Sidekiq moved over); each shard starts its own control plane.
shards() {
  case $1 in
    backends) echo "backends.a=::redis,::rabbitmq,::nats,::http,::sidekiq backends.b=::kafka,::sqs,::pubsub" ;;
    *) echo "$1=" ;;
  esac
}

# The tests of `exe` matching `filters` (comma-separated; empty: every test), one a line.
listed() { # exe filters
  local args=()
  IFS=, read -r -a args <<<"$2"
  "$1" --list "${args[@]}" 2>/dev/null | sed -n 's/: test$//p'
}

run_one() { # name dir exe filters -> appends "name rc seconds" to the results file
  local name=$1 dir=$2 exe=$3 start=$SECONDS rc args=()
  IFS=, read -r -a args <<<"$4"
  (cd "$dir" && "$exe" "${args[@]}") >"$logs/$name.log" 2>&1; rc=$?
  echo "$name $rc $((SECONDS - start))" >>"$logs/results"
  if [ "$rc" -ne 0 ]; then
    echo "---- $name FAILED (rc $rc); its output:"; cat "$logs/$name.log"; echo "---- end of $name"
  else
    echo "test-lanes: $name ok ($((SECONDS - start))s): $(grep -E '^test result' "$logs/$name.log" | tail -1)"
  fi
}

start=$SECONDS

# Every binary (or shard), heaviest first; a binary's shards together must list each of its
# tests exactly once, or a test would silently not run.
items=()
for e in "${entries[@]}"; do
  read -r _ name dir exe <<<"$e"
  parts=$(shards "$name")
  if [ "$parts" != "$name=" ]; then
    all=$(listed "$exe" "" | sort)
    got=$(for part in $parts; do listed "$exe" "${part#*=}"; done | sort)
    if [ "$all" != "$got" ]; then
      echo "test-lanes: the shards of $name ($parts) do not list each of its tests once:" >&2
      diff <(echo "$all") <(echo "$got") | head -20 >&2
      exit 101
    fi
  fi
  for part in $parts; do
    items+=("$(weight "${part%%=*}") ${part%%=*} $dir $exe ${part#*=}")
  done
done

# Binaries that need the slowest tools to build (promtool, Flux, Knative, the release's and the
# node's) go last: on a cold machine `make test` builds the tools beside the tests (TEST_TOOLS in
# the Makefile, these tools last), so the others need not wait for them.
late=" ${TEST_LATE:-chart_alerts chart_node gitops knative release} "
queue=$logs/queue
{
  printf '%s\n' "${items[@]}" | sort -rn | while read -r _ name rest; do
    [[ $late == *" $name "* ]] || echo "$name $rest"
  done
  printf '%s\n' "${items[@]}" | sort -rn | while read -r _ name rest; do
    [[ $late != *" $name "* ]] || echo "$name $rest"
  done
} >"$queue"

# The queue's next item, taken under a lock (empty when none is left).
take() {
  # shellcheck disable=SC2016 # expanded by the inner shell
  flock "$queue.lock" bash -c 'head -n 1 "$1"; sed -i 1d "$1"' _ "$queue"
}

pids=()
for ((i = 0; i < lanes; i++)); do
  ( while item=$(take) && [ -n "$item" ]; do
      read -r n d x f <<<"$item"
      run_one "$n" "$d" "$x" "${f:-}"
    done ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

failed=$(awk '$2 != 0 {print $1}' "$logs/results")
passed=$(cat "$logs"/*.log | awk '/^test result/ {for (i = 1; i < NF; i++) if ($(i+1) ~ /^passed/) n += $i} END {print n + 0}')
echo "test-lanes: $(wc -l <"$logs/results") binaries, ${passed:-0} tests passed, $((SECONDS - start))s in $lanes lanes; slowest:"
sort -k3 -rn "$logs/results" | head -5 | sed 's/^/  /'
if [ -n "$failed" ]; then
  # What each failing test said, without backtraces, last: CI shows the end of a long log.
  for name in $failed; do
    echo "test-lanes: $name, failing tests:"
    awk '/^---- .* stdout ----$/ {on = 1; n = 0}
         /^stack backtrace:/ {on = 0}
         on && n < 12 {print "  " $0; n++}' "$logs/$name.log"
  done
  echo "test-lanes: FAILED: $failed (logs in $logs/)"; exit 101
fi
