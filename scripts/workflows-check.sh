#!/usr/bin/env bash
# Checks the GitHub Actions workflows (make workflows-check, part of make test):
#  1. self-test: a workflow with known faults (an undefined `needs:`, a broken expression, a
#     finding of shellcheck, an action pinned to a tag) must fail every check below with the fault
#     named, so this script cannot pass by checking nothing;
#  2. actionlint (built from tools/actionlint by tools/build.sh) on .github/workflows/*.yml,
#     with shellcheck on every `run:` script;
#  3. every action is pinned to a full commit sha with its version in a comment;
#  4. the krew plugin manifest template (.github/krew/dlq.yaml), rendered by
#     .github/krew/render.sh with made-up sums, has krew's shape, and its platforms are exactly
#     the os/arch pairs that release.yml builds kubectl-dlq for; a missing sum fails the render;
#  5. release.yml signs, attests, pushes the chart and renders the krew manifest through
#     scripts/release.sh (the steps make release-local and tests/release.rs run), never by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "workflows-check: $*" >&2
  exit 1
}

actionlint=$(bash tools/build.sh actionlint)/actionlint
# Without shellcheck on PATH actionlint silently skips the run: scripts.
shellcheck=$(command -v shellcheck) \
  || fail "shellcheck is not on PATH (scripts/ensure-deps.sh installs it: apt-get install shellcheck)"
lint() { "$actionlint" -no-color -shellcheck "$shellcheck" "$@"; }

# Actions pinned by tag or branch (uses: lines not of the form owner/repo@<40 hex> # v...).
unpinned() {
  grep -nE '^[[:space:]-]*uses:' "$@" \
    | grep -vE 'uses:[[:space:]]*(\./|docker://)' \
    | grep -vE 'uses:[[:space:]]*[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}[[:space:]]+#[[:space:]]*v[0-9]' \
    || true
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. The known-bad workflow.
cat >"$tmp/bad.yml" <<'EOF'
name: known-bad
on: push
jobs:
  test:
    runs-on: ubuntu-24.04
    needs: [no-such-job]
    steps:
      - uses: actions/checkout@v4
      - run: echo "${{ github.event.head_commit.message( }}"
      - run: echo $(ls)
EOF
set +e
out=$(lint "$tmp/bad.yml" 2>&1)
rc=$?
set -e
[ "$rc" -eq 1 ] || { echo "$out" >&2; fail "self-test: actionlint exited $rc on a workflow with known faults (want 1)"; }
for rule in job-needs expression shellcheck; do
  grep -q "\[$rule\]" <<<"$out" \
    || { echo "$out" >&2; fail "self-test: actionlint did not report the known-bad workflow's [$rule] fault"; }
done
[ -n "$(unpinned "$tmp/bad.yml")" ] || fail "self-test: the pin check missed actions/checkout@v4"
echo "workflows-check: self-test ok (actionlint exit $rc: job-needs, expression and shellcheck faults found; tag pin found)"

# 2. actionlint on ours.
shopt -s nullglob
workflows=(.github/workflows/*.yml .github/workflows/*.yaml)
shopt -u nullglob
[ "${#workflows[@]}" -gt 0 ] || fail "no workflows in .github/workflows"
lint "${workflows[@]}" || fail "actionlint found problems in ${workflows[*]} (above)"
echo "workflows-check: actionlint $("$actionlint" -version | head -1) + shellcheck: ${workflows[*]} ok"

# 3. Pins.
bad_pins=$(unpinned "${workflows[@]}")
[ -z "$bad_pins" ] || { echo "$bad_pins" >&2; fail "actions not pinned to a commit sha with a '# vX' comment (above)"; }

# 4. The krew manifest.
python=python3
if ! python3 -c 'import yaml' 2>/dev/null; then
  # PyYAML in a private venv in the tools cache, as ensure-deps does for hadolint.
  venv=${DLQ_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/deadletter-operator/tools}/pyyaml
  if ! "$venv/bin/python" -c 'import yaml' 2>/dev/null; then
    echo ">> pip install PyYAML into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check 'PyYAML==6.0.3'
  fi
  python=$venv/bin/python
fi
tag=v0.0.0-check.1
repo=example/deadletter-operator
# The os/arch pairs release.yml builds kubectl-dlq for, and a made-up sum for each.
"$python" - .github/workflows/release.yml >"$tmp/platforms" <<'EOF'
import sys, yaml
wf = yaml.safe_load(open(sys.argv[1]))
include = wf["jobs"]["kubectl-dlq"]["strategy"]["matrix"]["include"]
for p in include:
    print(p["os"], p["arch"])
EOF
[ -s "$tmp/platforms" ] || fail "release.yml's kubectl-dlq job builds no platform"
while read -r os arch; do
  printf '%s  kubectl-dlq_%s_%s_%s.tar.gz\n' "$(printf '%s' "$os/$arch" | sha256sum | cut -c1-64)" "$tag" "$os" "$arch"
done <"$tmp/platforms" >"$tmp/sums"
bash .github/krew/render.sh "$tag" "$repo" "$tmp/sums" >"$tmp/dlq.yaml" \
  || fail ".github/krew/render.sh failed with a sum for every platform release.yml builds"
"$python" - "$tmp/dlq.yaml" "$tmp/sums" "$tag" "$repo" .github/workflows/release.yml <<'EOF'
import re, sys, yaml
manifest, sums, tag, repo, release = sys.argv[1:]
m = yaml.safe_load(open(manifest))
errors = []
def want(ok, what):
    if not ok:
        errors.append(what)
want(m.get("apiVersion") == "krew.googlecontainertools.github.com/v1alpha2", "apiVersion")
want(m.get("kind") == "Plugin", "kind: Plugin")
want(m.get("metadata", {}).get("name") == "dlq", "metadata.name: dlq (kubectl dlq)")
spec = m.get("spec", {})
want(spec.get("version") == tag, f"spec.version is the tag ({tag})")
want(str(spec.get("homepage", "")).startswith("https://"), "spec.homepage")
short = spec.get("shortDescription", "")
want(isinstance(short, str) and 0 < len(short) <= 50, "spec.shortDescription of 1-50 characters")
want(isinstance(spec.get("description"), str) and spec["description"].strip(), "spec.description")
expected = {}
for line in open(sums):
    sha, name = line.split()
    os_, arch = re.fullmatch(rf"kubectl-dlq_{re.escape(tag)}_(\w+)_(\w+)\.tar\.gz", name).groups()
    expected[(os_, arch)] = (sha, f"https://github.com/{repo}/releases/download/{tag}/{name}")
seen = set()
for i, p in enumerate(spec.get("platforms") or []):
    labels = (p.get("selector") or {}).get("matchLabels") or {}
    key = (labels.get("os"), labels.get("arch"))
    want(set(labels) == {"os", "arch"}, f"platforms[{i}].selector.matchLabels has exactly os and arch")
    want(key not in seen, f"platforms[{i}] {key} only once")
    seen.add(key)
    if key not in expected:
        errors.append(f"platforms[{i}] {key} is not built by release.yml's kubectl-dlq job")
        continue
    sha, uri = expected[key]
    want(p.get("uri") == uri, f"platforms[{i}].uri is {uri}")
    want(p.get("sha256") == sha, f"platforms[{i}].sha256 is the archive's sum")
    want(p.get("bin") == "kubectl-dlq", f"platforms[{i}].bin: kubectl-dlq")
    files = p.get("files") or []
    want(any(f.get("from") == "kubectl-dlq" for f in files) and all(f.get("from") and f.get("to") for f in files),
         f"platforms[{i}].files takes kubectl-dlq from the archive")
want(seen == set(expected), f"platforms are exactly release.yml's {sorted(expected)} (template has {sorted(seen)})")
want({os_ for os_, _ in expected} == {"linux", "darwin"} and {a for _, a in expected} == {"amd64", "arm64"},
     "release.yml builds kubectl-dlq for linux and darwin, amd64 and arm64")
# release.yml names its archives as render.sh looks them up.
want("kubectl-dlq_${TAG}_${OS}_${ARCH}.tar.gz" in open(release).read(),
     "release.yml names archives kubectl-dlq_${TAG}_${OS}_${ARCH}.tar.gz")
if errors:
    sys.exit("krew manifest (.github/krew/dlq.yaml rendered):\n  - " + "\n  - ".join(errors))
print(f"workflows-check: krew manifest ok ({len(seen)} platforms: "
      + ", ".join(f"{o}/{a}" for o, a in sorted(seen)) + ")")
EOF
# A sum the template needs, left out, must fail the render.
first=$(grep -o '{{SHA256_[a-z0-9]*_[a-z0-9]*}}' .github/krew/dlq.yaml | head -1)
first=${first#'{{SHA256_'}
first=${first%'}}'}
grep -v "_${first}\.tar\.gz\$" "$tmp/sums" >"$tmp/short"
if bash .github/krew/render.sh "$tag" "$repo" "$tmp/short" >/dev/null 2>&1; then
  fail ".github/krew/render.sh rendered a manifest without the sum of kubectl-dlq_${tag}_${first}.tar.gz"
fi

# 5. The release's steps are scripts/release.sh's.
for step in sbom sign chart verify krew; do
  grep -qE "scripts/release\.sh $step( |\$)" .github/workflows/release.yml \
    || fail "release.yml does not run 'scripts/release.sh $step' (the steps make release-local runs)"
done
by_hand=$(grep -nE '^[^#]*\b(cosign (sign|attest)|helm (package|push)|krew/render\.sh)\b' .github/workflows/release.yml \
  | grep -vE '^[0-9]+:[[:space:]]*-?[[:space:]]*name:' || true)
[ -z "$by_hand" ] || { echo "$by_hand" >&2; fail "release.yml signs, packages or renders by hand (above): call scripts/release.sh"; }
echo "workflows-check: release.yml runs scripts/release.sh for sbom, sign, chart, verify and krew"
