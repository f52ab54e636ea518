#!/usr/bin/env bash
# Runs the workspace's test binaries, the in-process ones (unit, reconciler, property tests) and
# the integration binaries of tests/, in TEST_LANES parallel lanes. The integration binaries
# spend most of their time waiting on real servers (apiserver, brokers, a browser), so two lanes
# on two cores roughly halve the wall time without starving any test (three cut it further, but
# two runs of three each had a test time out on a loaded server); the in-process ones fill the
# lanes beside them (run one after another first, they were 45 s of one core idle). Each
# binary's output goes to target/test-logs/<binary>.log and is printed when it fails.
#
#   scripts/test-lanes.sh <cargo test args...>     (TEST_LANES=1 for one lane)
set -uo pipefail
lanes=${TEST_LANES:-2}
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

# Seconds each slow binary took in a fresh-clone run here (2026-12-05): the longest go first (LPT
# scheduling). Stale weights cost wall time: the old ones left the lanes at 716 s and 515 s.
weight() {
  case $1 in
    backends) echo 392 ;; chaos) echo 135 ;; sidekiq) echo 68 ;; knative) echo 55 ;;
    redrive) echo 48 ;; alerts) echo 46 ;; chart_rbac) echo 44 ;; park) echo 39 ;;
    release) echo 44 ;; sqs) echo 23 ;; kafka) echo 18 ;; replay) echo 34 ;; http_park) echo 31 ;;
    chart_node) echo 29 ;; bodies) echo 27 ;; nats) echo 28 ;; groups) echo 26 ;; leader) echo 23 ;;
    gitops) echo 20 ;; capacity) echo 17 ;; quota) echo 43 ;; ui|seal) echo 16 ;; pubsub) echo 15 ;; cli) echo 14 ;;
    bodies_clouds|bodies_cli) echo 14 ;;
    deadletter.lib) echo 25 ;; dlq_testenv.lib) echo 9 ;; dlq_core.lib) echo 7 ;;
    *.lib | *.bin | *.example) echo 1 ;; *) echo 12 ;;
  esac
}

run_one() { # name dir exe -> appends "name rc seconds" to the results file
  local name=$1 dir=$2 exe=$3 start=$SECONDS rc
  (cd "$dir" && "$exe") >"$logs/$name.log" 2>&1; rc=$?
  echo "$name $rc $((SECONDS - start))" >>"$logs/results"
  if [ "$rc" -ne 0 ]; then
    echo "---- $name FAILED (rc $rc); its output:"; cat "$logs/$name.log"; echo "---- end of $name"
  else
    echo "test-lanes: $name ok ($((SECONDS - start))s): $(grep -E '^test result' "$logs/$name.log" | tail -1)"
  fi
}

start=$SECONDS

# Every test binary, heaviest first, each to the least loaded lane.
declare -a load lane_items
for ((i = 0; i < lanes; i++)); do load[i]=0; lane_items[i]=""; done
while read -r w name dir exe; do
  best=0
  for ((i = 1; i < lanes; i++)); do [ "${load[i]}" -lt "${load[best]}" ] && best=$i; done
  load[best]=$((load[best] + w)); lane_items[best]+="$name=$dir=$exe "
done < <(for e in "${entries[@]}"; do
  read -r _ name dir exe <<<"$e"
  echo "$(weight "$name") $name $dir $exe"
done | sort -rn)

# Binaries that need the slowest tools to build (promtool, Flux, Knative, the release's and the
# node's) run last in their lane: on a cold machine `make test` builds the tools beside the tests
# (TEST_TOOLS in the Makefile, these tools last), so the others need not wait for them.
late=" ${TEST_LATE:-chart_alerts chart_node gitops knative release} "
for ((i = 0; i < lanes; i++)); do
  early="" later=""
  for item in ${lane_items[i]}; do
    if [[ $late == *" ${item%%=*} "* ]]; then later+="$item "; else early+="$item "; fi
  done
  lane_items[i]="$early$later"
done

pids=()
for ((i = 0; i < lanes; i++)); do
  ( for item in ${lane_items[i]}; do IFS== read -r n d x <<<"$item"; run_one "$n" "$d" "$x"; done ) &
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
