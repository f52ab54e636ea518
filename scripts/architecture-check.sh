#!/usr/bin/env bash
# docs/architecture.md's module table stays true: every module file of the operator
# (`deadletter`), `dlq_core` and `dlq_client` has a row, and every row of theirs names a module
# that exists.
#
#   scripts/architecture-check.sh [ROOT]   (ROOT: a checkout, default this one)
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
doc=docs/architecture.md

# Module paths from the file tree: src/run/mod.rs -> deadletter::run, src/run/feeder.rs ->
# deadletter::run::feeder. Entry points and test files are not modules of the design.
modules_of() {
  local crate=$1 dir=$2
  (cd "$dir" && find . -name '*.rs' | sort) | sed 's|^\./||' |
    grep -vE '(^|/)(lib|main|tests)\.rs$' |
    sed -E 's|/mod\.rs$||; s|\.rs$||; s|/|::|g' | sed "s|^|$crate::|"
}
code=$( { modules_of deadletter src; modules_of dlq_core crates/dlq-core/src
          modules_of dlq_client crates/dlq-client/src; } | sort -u)
rows=$(grep -oE '^\| `(deadletter|dlq_core|dlq_client)(::[a-z_]+)*`' "$doc" | sed 's/^| `//; s/`$//' | sort -u)

fail=0
missing=$(comm -23 <(echo "$code") <(echo "$rows"))
stale=$(comm -13 <(echo "$code") <(echo "$rows"))
for m in $missing; do echo "architecture-check: $doc has no row for module $m" >&2; fail=1; done
for m in $stale; do echo "architecture-check: $doc has a row for $m, which is no module" >&2; fail=1; done
[ $fail = 0 ] && echo "architecture-check: $doc has a row for each of the $(echo "$code" | wc -l) modules of deadletter, dlq_core and dlq_client"
exit $fail
