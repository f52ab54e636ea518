#!/usr/bin/env bash
# Every commit since the rule began has a subject of at most 72 characters (the story and the
# figures go in the body), so that `git log --oneline` stays readable. Commits before SINCE are
# history and are not read. A checkout without git history (an archive, a shallow clone that
# lacks SINCE) is not checked, and says so.
#
#   scripts/commits-check.sh [RANGE]   (make commits-check; part of make test; default SINCE..HEAD)
set -euo pipefail
export LC_ALL=C.UTF-8
cd "$(dirname "$0")/.."

# The last commit before the rule (issue 61).
SINCE=aa6e7c6ef10cdba057985830665aaf9d6a5c39e0
MAX=72

if ! git rev-parse --git-dir >/dev/null 2>&1; then
  echo "commits-check: not a git checkout; nothing to check"
  exit 0
fi
range=${1:-}
if [ -z "$range" ]; then
  if ! git cat-file -e "$SINCE^{commit}" 2>/dev/null; then
    echo "commits-check: $SINCE is not in this clone's history (shallow?); nothing to check"
    exit 0
  fi
  range="$SINCE..HEAD"
fi

# The check itself: SINCE's own subject (118 characters) must be refused.
if ! git log -1 --format=%s "$SINCE" | awk -v max=$MAX 'length($0) > max { found = 1 } END { exit !found }'; then
  echo "commits-check: the check no longer refuses $SINCE's long subject" >&2
  exit 1
fi

bad=0 n=0
while IFS=$'\t' read -r sha subject; do
  n=$((n + 1))
  len=${#subject}
  if [ "$len" -gt "$MAX" ]; then
    echo "commits-check: $sha: subject of $len characters (at most $MAX; the story goes in the body): $subject" >&2
    bad=$((bad + 1))
  fi
done < <(git log --no-merges --format='%h%x09%s' "$range")
if [ "$bad" -gt 0 ]; then
  echo "commits-check: $bad of $n commits in $range have a subject over $MAX characters" >&2
  exit 1
fi
echo "commits-check: $n commits in $range, every subject at most $MAX characters"
