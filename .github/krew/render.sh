#!/usr/bin/env bash
# Renders the krew plugin manifest template (dlq.yaml beside this script) for one release and
# prints it: {{TAG}} and {{REPOSITORY}} become the arguments, each {{SHA256_<os>_<arch>}} the
# sha256 of kubectl-dlq_<tag>_<os>_<arch>.tar.gz read from the sum files (`sha256sum` or
# `shasum -a 256` lines). Fails on a sum missing or given twice, or on any placeholder left.
# With --only-given (scripts/release.sh's local release: linux/amd64 only) a platform without a
# sum is left out of the manifest instead; at least one must remain.
#
#   .github/krew/render.sh [--only-given] TAG OWNER/REPO SUMFILE... > dlq.yaml
set -euo pipefail
only_given=
if [ "${1:-}" = --only-given ]; then only_given=1; shift; fi
[ $# -ge 3 ] || { echo "usage: render.sh [--only-given] TAG OWNER/REPO SUMFILE..." >&2; exit 2; }
tag=$1 repo=$2
shift 2
template=$(dirname "$0")/dlq.yaml

# krew wants the version as v<semver>.
[[ $tag =~ ^v[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] \
  || { echo "render.sh: '$tag' is not v<semver>" >&2; exit 1; }
[[ $repo =~ ^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$ ]] \
  || { echo "render.sh: '$repo' is not OWNER/REPO" >&2; exit 1; }

sums=$(cat "$@")
out=$(sed -e '/^#/d' -e "s|{{TAG}}|$tag|g" -e "s|{{REPOSITORY}}|$repo|g" "$template")
mapfile -t keys < <(grep -o '{{SHA256_[a-z0-9]*_[a-z0-9]*}}' <<<"$out" | sort -u)
[ ${#keys[@]} -gt 0 ] || { echo "render.sh: no {{SHA256_<os>_<arch>}} in $template" >&2; exit 1; }
for key in "${keys[@]}"; do
  platform=${key#'{{SHA256_'}
  platform=${platform%'}}'}
  archive=kubectl-dlq_${tag}_${platform}.tar.gz
  sum=$(awk -v a="$archive" '$2 == a || $2 == "*" a { print $1 }' <<<"$sums")
  if [ -n "$only_given" ] && [ -z "$sum" ]; then
    # Drop the platform list item (from its `- selector:` to the next one) holding the key.
    out=$(awk -v key="$key" '
      function flush() { if (buf != "" && !drop) printf "%s", buf; buf = ""; drop = 0 }
      /^    - selector:/ { flush(); item = 1 }
      item && !/^    - selector:/ && !/^      / { flush(); item = 0 }
      item { buf = buf $0 "\n"; if (index($0, key)) drop = 1; next }
      { print }
      END { flush() }' <<<"$out")
    continue
  fi
  [[ $sum =~ ^[0-9a-f]{64}$ ]] \
    || { echo "render.sh: no single sha256 for $archive in $*" >&2; exit 1; }
  out=${out//"$key"/$sum}
done
grep -q 'sha256: "[0-9a-f]\{64\}"' <<<"$out" \
  || { echo "render.sh: no platform has a sum in $*" >&2; exit 1; }
if grep -n '{{' <<<"$out" >&2; then
  echo "render.sh: placeholders left (above)" >&2
  exit 1
fi
printf '%s\n' "$out"
