#!/usr/bin/env bash
# The architecture's dependency rules (docs/architecture.md), checked on the normal (non-dev)
# dependency trees:
# - dlq-core holds no kube client, HTTP stack, async runtime or broker client;
# - the operator and kubectl-dlq carry no test infrastructure (rcgen: certificates for the
#   local control plane), and kubectl-dlq does not depend on the operator.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
tree() { cargo tree -q -p "$1" -e normal --prefix none | sed 's/ (.*//; s/ v[0-9].*//' | sort -u; }
check() {
  local pkg=$1 pattern=$2 why=$3 found
  found=$(tree "$pkg" | grep -E "^($pattern)$" || true)
  if [ -n "$found" ]; then
    echo "deps-check: $pkg must not depend on $(echo "$found" | tr '\n' ' ')($why)" >&2
    fail=1
  fi
}
check dlq-core 'kube|kube-client|kube-runtime|hyper|hyper-util|tower|tokio|redis|lapin|async-nats|reqwest' 'the core is pure'
check deadletter-operator 'rcgen|dlq-testenv' 'test infrastructure'
check kubectl-dlq 'rcgen|dlq-testenv|deadletter-operator' 'the plugin depends on the core, not the controller'
[ $fail = 0 ] && echo "deps-check: dlq-core is pure; no test infrastructure in the operator or the plugin"
exit $fail
