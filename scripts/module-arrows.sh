#!/usr/bin/env bash
# The operator crate's module arrows run one way (docs/architecture.md, "Layers"): a module
# names only modules of a lower layer, never one beside it or above it. Comments and test
# modules are not read (a doc link or a test may look anywhere).
#
#   scripts/module-arrows.sh [ROOT]   (ROOT: a checkout, default this one)
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"

# Layer of each top-level module of src/ (higher uses lower).
declare -A layer=(
  [run]=4
  [reconcile]=3 [source]=3 [alert]=3 [reveal]=3
  [state]=2 [target]=2 [server]=2 [keys]=2
  [metrics]=1 [access]=1 [secret]=1 [https]=1 [serving_tls]=1 [failpoint]=1
)

# The code of a file without comments and without its trailing `#[cfg(test)] mod ...`.
code_of() {
  awk '/^#\[cfg\(test\)\]/ { test = 1; next }
       test && /^(pub(\(crate\))? )?mod / { exit }
       { test = 0; sub(/\/\/.*/, ""); print }' "$1"
}

fail=0
for dir in src/*/ src/*.rs; do
  name=$(basename "$dir" .rs)
  case $name in lib|main) continue ;; esac
  if [ -z "${layer[$name]:-}" ]; then
    echo "module-arrows: src/$name has no layer: add it to scripts/module-arrows.sh and docs/architecture.md" >&2
    fail=1; continue
  fi
  while IFS= read -r file; do
    case $file in */tests.rs) continue ;; esac
    for used in $(code_of "$file" | grep -oE 'crate::[a-z_]+' | sed 's/crate:://' | sort -u); do
      [ "$used" = "$name" ] && continue
      if [ -z "${layer[$used]:-}" ]; then
        echo "module-arrows: $file names crate::$used, which has no layer" >&2; fail=1
      elif [ "${layer[$used]}" -ge "${layer[$name]}" ]; then
        echo "module-arrows: $file ($name, layer ${layer[$name]}) names crate::$used (layer ${layer[$used]}): arrows run down only" >&2
        fail=1
      fi
    done
  done < <(find "${dir%/}" -name '*.rs' | sort)
done
[ $fail = 0 ] && echo "module-arrows: every arrow in src/ runs down (run > reconcile, source, alert, reveal > state, target, server, keys > metrics, access, secret, https, serving_tls, failpoint)"
exit $fail
