#!/usr/bin/env bash
# docs/architecture.md's module table stays true: every module file of the operator
# (`deadletter`), `dlq_core` and `dlq_client` has a row, and every row of theirs names a module
# that exists. What the rest of the page names exists too, so a module that was renamed or never
# was (a `controller` of the operator, say) fails here instead of misleading a reader:
#  - a backticked path into the checkout (`src/run/mod.rs`, `src/reconcile/`, `tests/cli.rs`)
#    exists;
#  - a Rust path `a::b::c`, backticked or in a diagram, whose first segment is lower case starts
#    at a crate of the workspace, at one of their modules or at a dependency (Cargo.lock), and
#    every lower-case segment before the last is a module (the last may be an item: a word of
#    its module's code);
#  - a backticked name the prose calls a module ("the `x` module", "module `x`") is one.
#
#   scripts/architecture-check.sh [ROOT]   (ROOT: a checkout, default this one)
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
doc=docs/architecture.md

# Module paths from the file tree: src/run/mod.rs -> deadletter::run, src/run/feeder.rs ->
# deadletter::run::feeder. Entry points and test files (`tests.rs`, or a `tests/` directory
# of them) are not modules of the design.
modules_of() {
  local crate=$1 dir=$2
  (cd "$dir" && find . -name '*.rs' | sort) | sed 's|^\./||' |
    grep -vE '(^|/)(lib|main|tests)\.rs$|(^|/)tests/' |
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

# Every module of every crate of the workspace (test files included: `reconcile::tests` is
# named) with its file, indexed by its last segment so that a path may start at any of them; and
# the dependencies, which a path may start at too.
declare -A mod_file=() by_last=() is_dep=([std]=1 [core]=1 [alloc]=1)
add_modules() { # crate dir
  local crate=$1 dir=$2 f m
  [ -d "$dir" ] || return 0
  for f in lib main; do [ -f "$dir/$f.rs" ] && { mod_file[$crate]=$dir/$f.rs; break; }; done
  by_last[$crate]+=" $crate"
  while IFS= read -r f; do
    m=$(echo "$f" | sed -E 's|/mod\.rs$||; s|\.rs$||; s|/|::|g')
    mod_file[$crate::$m]=$dir/$f; by_last[${m##*::}]+=" $crate::$m"
  done < <((cd "$dir" && find . -name '*.rs' | sort) | sed 's|^\./||' |
           grep -vE '(^|/)(lib|main)\.rs$')
}
add_modules deadletter src
for dir in crates/*/src; do
  c=${dir#crates/}; c=${c%/src}; add_modules "${c//-/_}" "$dir"
done
if [ -f Cargo.lock ]; then
  while IFS= read -r d; do is_dep[${d//-/_}]=1; done < <(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.lock)
fi

# Whether the word $2 is in the code (comments left out) of module $1's file.
# (Not grep -q: an early exit would fail sed with SIGPIPE, and pipefail the test.)
in_code() { [ -n "${mod_file[$1]:-}" ] && sed 's|//.*||' "${mod_file[$1]}" | grep -w -- "$2" >/dev/null; }

# Whether `a::b::c` resolves: some module (or crate) named a, under which every lower-case
# segment but the last is a module, and the last a module or (unless $2 is `module`) a word of
# its parent's code (an item); an upper-case segment (a type) ends what is checked.
resolves() { # path [module]
  local path=$1 want=${2:-} first start cur ok i seg last
  local -a segs
  IFS=' ' read -r -a segs <<<"${path//::/ }"
  first=${segs[0]//-/_}
  if [ -z "${by_last[$first]:-}" ]; then
    [ -z "$want" ] && [ -n "${is_dep[$first]:-}" ] && [ ${#segs[@]} -gt 1 ]
    return
  fi
  last=$((${#segs[@]} - 1))
  for start in ${by_last[$first]}; do
    cur=$start ok=1
    for ((i = 1; i <= last; i++)); do
      seg=${segs[i]}
      [[ $seg =~ ^[A-Z] ]] && [ -z "$want" ] && break
      if [ -n "${mod_file[$cur::$seg]:-}" ]; then cur=$cur::$seg; continue; fi
      [ $i = "$last" ] && [ -z "$want" ] && in_code "$cur" "$seg" && break
      ok=0; break
    done
    [ $ok = 1 ] && return 0
  done
  return 1
}

# What the page names, as "line<TAB>kind<TAB>name": `path` (a backticked path into the
# checkout), `rust` (a Rust path) and `module` (a backticked name called a module).
mentions() {
  awk '
    /^[ \t]*```/ { fence = !fence; next }
    {
      line = $0
      if (fence) {
        while (match(line, /[A-Za-z_][A-Za-z0-9_-]*(::[A-Za-z_][A-Za-z0-9_]*)+/)) {
          tok = substr(line, RSTART, RLENGTH); line = substr(line, RSTART + RLENGTH)
          if (tok ~ /^[a-z_]/) print NR "\trust\t" tok
        }
        next
      }
      rest = line
      while (match(rest, /`[^`]+`/)) {
        span = substr(rest, RSTART + 1, RLENGTH - 2); rest = substr(rest, RSTART + RLENGTH)
        if (span ~ /^(src|crates|tests|benches|examples|scripts|tools|charts|docs)\/[^ *]*$/) {
          print NR "\tpath\t" span; continue
        }
        while (match(span, /[A-Za-z_][A-Za-z0-9_-]*(::[A-Za-z_][A-Za-z0-9_]*)+/)) {
          tok = substr(span, RSTART, RLENGTH); span = substr(span, RSTART + RLENGTH)
          if (tok ~ /^[a-z_]/) print NR "\trust\t" tok
        }
      }
      rest = line
      while (match(rest, /`[a-z_][a-z0-9_:-]*` modules?([^a-z_]|$)|modules? `[a-z_][a-z0-9_:-]*`/)) {
        m = substr(rest, RSTART, RLENGTH); rest = substr(rest, RSTART + RLENGTH)
        sub(/^[^`]*`/, "", m); sub(/`.*$/, "", m)
        print NR "\tmodule\t" m
      }
    }' "$doc"
}

named=0 fail_named=0
while IFS=$'\t' read -r line kind name; do
  named=$((named + 1))
  case $kind in
    path)
      [ -e "${name%/}" ] ||
        { echo "architecture-check: $doc:$line names $name, which does not exist" >&2; fail_named=1; } ;;
    rust)
      resolves "$name" ||
        { echo "architecture-check: $doc:$line names $name, which is no module (or item of one) of the workspace or a dependency" >&2; fail_named=1; } ;;
    module)
      resolves "$name" module ||
        { echo "architecture-check: $doc:$line calls $name a module, which it is not" >&2; fail_named=1; } ;;
  esac
done < <(mentions)
[ $fail_named = 0 ] && echo "architecture-check: the $named paths, Rust paths and modules named in $doc exist"
[ $fail = 0 ] && [ $fail_named = 0 ]
