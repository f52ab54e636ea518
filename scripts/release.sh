#!/usr/bin/env bash
# The release, as `make release-local` runs it here and .github/workflows/release.yml runs its
# steps on GitHub: the operator image pushed by digest, the Helm chart pushed to an OCI registry,
# both signed with cosign, the image's SBOM attested, the krew manifest and plugin archives.
#
#   scripts/release.sh all            everything below, the image built without a daemon from
#                                     BIN_DIR (make release-local; tests/release.rs)
#   scripts/release.sh sbom FILE      SPDX 2.3 JSON of the crates deadletter-operator and kubectl-dlq
#                                     are built from (cargo metadata, linux/amd64)
#   scripts/release.sh sign REF@DIGEST [SBOM]   sign an image (and attest SBOM, type spdxjson)
#   scripts/release.sh chart REPO@DIGEST        package the chart with that image digest as its
#                                     default, push it to oci://$REGISTRY/charts and sign it
#   scripts/release.sh krew [--only-given] DIR   the krew manifest (DIR/dlq.yaml) for the
#                                     kubectl-dlq archives in DIR (kubectl-dlq_<tag>_<os>_<arch>.tar.gz
#                                     and .sha256): every platform of release.yml, or with
#                                     --only-given (`all`: linux/amd64 here) only those in DIR
#   scripts/release.sh verify IMAGE CHART       cosign verify both (and the SBOM attestation)
#
# Environment:
#   REGISTRY     where to push, host[:port][/path] (ghcr.io/<owner>). `all` without it starts a
#                loopback registry (crane registry serve) for the run and stops it at the end: a
#                dry run of the whole release (the files stay in OUT, the registry's content does not).
#                A loopback registry (127.*, localhost) is spoken to over plain HTTP.
#   SIGN         key (default): cosign's key pair COSIGN_KEY (generated into OUT when missing, with
#                COSIGN_PASSWORD, default empty), no transparency log (nothing leaves the machine);
#                keyless (the workflow): a Fulcio certificate for GitHub's OIDC identity, logged in Rekor
#   COSIGN_KEY   default $OUT/cosign.key (its public half: the same name, .pub)
#   IDENTITY     for `verify` with SIGN=keyless: the certificate identity (the workflow's ref)
#   BIN_DIR      deadletter-operator and kubectl-dlq for the image and the krew archive (default
#                target/release)
#   OUT          where files go (default target/release/dist): image/ (the OCI archive), the chart
#                .tgz, the SBOM, krew/ (archives, sums, dlq.yaml), cosign.key/.pub, release.env
#   VERSION      default Cargo.toml's [workspace.package] version; the tag is v$VERSION
#   GITHUB_REPOSITORY   owner/repo for the krew manifest's URLs (default deadletter-operator/deadletter-operator)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

fail() {
  echo "release: $*" >&2
  exit 1
}
say() { echo ">> $*" >&2; }

VERSION=${VERSION:-$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)}
[[ $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] || fail "version '$VERSION' is not semver"
TAG=v$VERSION
SIGN=${SIGN:-key}
OUT=${OUT:-$root/target/release/dist}
BIN_DIR=${BIN_DIR:-$root/target/release}
COSIGN_KEY=${COSIGN_KEY:-$OUT/cosign.key}
GITHUB_REPOSITORY=${GITHUB_REPOSITORY:-deadletter-operator/deadletter-operator}
export COSIGN_PASSWORD=${COSIGN_PASSWORD:-}
mkdir -p "$OUT"
case $OUT in /*) ;; *) OUT=$root/$OUT ;; esac
case $SIGN in key | keyless) ;; *) fail "SIGN is key or keyless, not '$SIGN'" ;; esac

# Tools: the pinned builds of tools/ (tools/build.sh), or what PATH has (the workflow installs
# cosign and helm with their actions).
tool() {
  local name=$1 from=$2 dir
  if [ -z "${GITHUB_ACTIONS:-}" ] || ! command -v "$name" >/dev/null; then
    dir=$(bash tools/build.sh "$from") || fail "building $from (tools/build.sh $from)"
    echo "$dir/$name"
  else
    command -v "$name"
  fi
}

loopback() { [[ ${1%%/*} =~ ^(127\.[0-9.]+|localhost|\[::1\])(:[0-9]+)?$ ]]; }

# cosign's flags for the registry of $1 and the signing mode.
cosign_registry_flags() {
  if loopback "$1"; then echo --allow-http-registry --allow-insecure-registry; fi
}

sign_flags() {
  case $SIGN in
    key) echo --key "$COSIGN_KEY" --tlog-upload=false ;;
    keyless) echo --yes ;;
  esac
}

verify_flags() {
  case $SIGN in
    # No transparency log to check, and an empty trusted root: without --trusted-root cosign
    # first asks Sigstore's TUF repository for one, over the network.
    key)
      printf '%s\n' '{"mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1"}' \
        >"$OUT/offline-trusted-root.json"
      echo --key "${COSIGN_KEY%.key}.pub" --insecure-ignore-tlog=true \
        --trusted-root "$OUT/offline-trusted-root.json" ;;
    keyless)
      [ -n "${IDENTITY:-}" ] || fail "SIGN=keyless verify needs IDENTITY (the signing workflow's ref)"
      echo --certificate-identity "$IDENTITY" \
        --certificate-oidc-issuer https://token.actions.githubusercontent.com ;;
  esac
}

ensure_key() {
  [ "$SIGN" = key ] || return 0
  if [ ! -s "$COSIGN_KEY" ]; then
    say "generating the cosign key pair ${COSIGN_KEY%.key}.{key,pub}"
    (cd "$(dirname "$COSIGN_KEY")" && "$COSIGN" generate-key-pair \
      --output-key-prefix "$(basename "${COSIGN_KEY%.key}")" >/dev/null 2>&1) \
      || fail "cosign generate-key-pair failed"
  fi
  [ -s "${COSIGN_KEY%.key}.pub" ] || fail "no public key beside $COSIGN_KEY"
}

# SPDX 2.3 JSON of every crate deadletter-operator and kubectl-dlq are built from: cargo
# metadata's resolved graph for linux/amd64, normal and build dependencies (not dev), with
# Cargo.lock's checksums and a purl per crate.
sbom() {
  local file=$1
  cargo metadata --format-version 1 --locked --filter-platform x86_64-unknown-linux-gnu >"$file.metadata" \
    || fail "cargo metadata failed"
  python3 - "$file.metadata" Cargo.lock "$VERSION" "$GITHUB_REPOSITORY" >"$file" <<'EOF'
import hashlib, json, os, re, sys, time
meta_path, lock_path, version, repo = sys.argv[1:]
meta = json.load(open(meta_path))
checksums, cur = {}, {}
for line in open(lock_path):
    line = line.strip()
    if line == "[[package]]":
        cur = {}
    m = re.match(r'^(name|version|checksum) = "(.*)"$', line)
    if m:
        cur[m.group(1)] = m.group(2)
        if m.group(1) == "checksum":
            checksums[(cur.get("name"), cur.get("version"))] = m.group(2)
pkgs = {p["id"]: p for p in meta["packages"]}
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
roots = [i for i, p in pkgs.items() if p["name"] in ("deadletter-operator", "kubectl-dlq") and i in meta["workspace_members"]]
if len(roots) != 2:
    sys.exit("sbom: deadletter-operator and kubectl-dlq not both in the workspace")
def spdx_id(p):
    return "SPDXRef-Package-" + re.sub(r"[^A-Za-z0-9.-]", "-", f"{p['name']}-{p['version']}")
seen, edges, todo = set(roots), [], list(roots)
while todo:
    i = todo.pop()
    for d in nodes[i]["deps"]:
        if not any(k["kind"] in (None, "build") for k in d["dep_kinds"]):
            continue
        edges.append((i, d["pkg"]))
        if d["pkg"] not in seen:
            seen.add(d["pkg"]); todo.append(d["pkg"])
packages = []
for i in sorted(seen, key=lambda i: (pkgs[i]["name"], pkgs[i]["version"])):
    p = pkgs[i]
    crates_io = (p.get("source") or "").startswith("registry+")
    lic = p.get("license") or "NOASSERTION"
    lic = " OR ".join(x.strip() for x in lic.split("/")) if "/" in lic else lic
    entry = {
        "name": p["name"], "SPDXID": spdx_id(p), "versionInfo": p["version"],
        "downloadLocation": f"https://crates.io/api/v1/crates/{p['name']}/{p['version']}/download"
            if crates_io else ("git+https://github.com/" + repo if i in meta["workspace_members"] else "NOASSERTION"),
        "filesAnalyzed": False, "licenseConcluded": "NOASSERTION", "licenseDeclared": lic,
        "copyrightText": "NOASSERTION",
        "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                          "referenceLocator": f"pkg:cargo/{p['name']}@{p['version']}"}],
    }
    sha = checksums.get((p["name"], p["version"]))
    if sha:
        entry["checksums"] = [{"algorithm": "SHA256", "checksumValue": sha}]
    packages.append(entry)
rels = [{"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES",
         "relatedSpdxElement": spdx_id(pkgs[r])} for r in sorted(roots)]
rels += [{"spdxElementId": spdx_id(pkgs[a]), "relationshipType": "DEPENDS_ON",
          "relatedSpdxElement": spdx_id(pkgs[b])} for a, b in sorted(set(edges))]
epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or time.time())
digest = hashlib.sha256(json.dumps(packages, sort_keys=True).encode()).hexdigest()[:16]
print(json.dumps({
    "spdxVersion": "SPDX-2.3", "dataLicense": "CC0-1.0", "SPDXID": "SPDXRef-DOCUMENT",
    "name": f"deadletter-operator-{version}",
    "documentNamespace": f"https://github.com/{repo}/spdx/deadletter-operator-{version}-{digest}",
    "creationInfo": {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch)),
                     "creators": [f"Tool: deadletter-operator scripts/release.sh {version}"]},
    "packages": packages, "relationships": rels,
}, indent=1))
EOF
  rm -f "$file.metadata"
  say "SBOM: $(grep -c '"SPDXID": "SPDXRef-Package-' "$file") crates in $file"
}

# Signs REF@DIGEST (never a tag: what is signed is exactly what was pushed) and attests the SBOM.
sign() {
  local ref=$1 sbom_file=${2:-}
  [[ $ref == *@sha256:* ]] || fail "sign wants REF@sha256:..., not '$ref'"
  ensure_key
  # shellcheck disable=SC2046 # word splitting of the flag lists is intended
  "$COSIGN" sign --yes $(sign_flags) $(cosign_registry_flags "$ref") "$ref" >&2 \
    || fail "cosign sign $ref failed"
  say "signed $ref"
  if [ -n "$sbom_file" ]; then
    # shellcheck disable=SC2046
    "$COSIGN" attest --yes $(sign_flags) $(cosign_registry_flags "$ref") \
      --type spdxjson --predicate "$sbom_file" "$ref" >&2 \
      || fail "cosign attest (SBOM) $ref failed"
    say "SBOM attested to $ref"
  fi
}

# The chart with REPO@DIGEST as its default image, pushed to oci://$REGISTRY/charts, signed.
chart() {
  local image=$1 repo digest src out pushed chart_digest
  repo=${image%@*} digest=${image#*@}
  [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || fail "chart wants the image as REPO@sha256:..., not '$image'"
  [ -n "${REGISTRY:-}" ] || fail "chart needs REGISTRY"
  src=$(mktemp -d)
  cp -R charts/deadletter-operator "$src/"
  sed -i -e "s|^  repository: ghcr.io/deadletter-operator/deadletter-operator\$|  repository: $repo|" \
    -e "s|^  digest: \"\"\$|  digest: \"$digest\"|" "$src/deadletter-operator/values.yaml"
  { grep -q "^  repository: $repo\$" "$src/deadletter-operator/values.yaml" \
    && grep -q "^  digest: \"$digest\"\$" "$src/deadletter-operator/values.yaml"; } \
    || fail "values.yaml has no image.repository / image.digest line to point at $image"
  "$HELM" package "$src/deadletter-operator" --version "$VERSION" --app-version "$VERSION" \
    --destination "$OUT" >&2 || fail "helm package failed"
  rm -rf "$src"
  out=$OUT/deadletter-operator-$VERSION.tgz
  local plain=()
  if loopback "$REGISTRY"; then plain=(--plain-http); fi
  pushed=$("$HELM" push "$out" "oci://$REGISTRY/charts" "${plain[@]}" 2>&1) \
    || fail "helm push failed: $pushed"
  chart_digest=$(sed -n 's/^Digest: //p' <<<"$pushed")
  [[ $chart_digest =~ ^sha256:[0-9a-f]{64}$ ]] || fail "no digest in helm push's output: $pushed"
  CHART_REF=$REGISTRY/charts/deadletter-operator@$chart_digest
  say "chart pushed: oci://$REGISTRY/charts/deadletter-operator --version $VERSION ($chart_digest)"
  sign "$CHART_REF"
}

# The krew manifest for the archives in DIR (with --only-given: only their platforms).
krew() {
  local only=()
  if [ "$1" = --only-given ]; then only=(--only-given); shift; fi
  local dir=$1
  shopt -s nullglob
  local sums=("$dir"/kubectl-dlq_"$TAG"_*.tar.gz.sha256)
  shopt -u nullglob
  [ ${#sums[@]} -gt 0 ] || fail "no kubectl-dlq_${TAG}_<os>_<arch>.tar.gz.sha256 in $dir"
  bash .github/krew/render.sh "${only[@]}" "$TAG" "$GITHUB_REPOSITORY" "${sums[@]}" >"$dir/dlq.yaml" \
    || fail "rendering the krew manifest failed"
  say "krew manifest: $dir/dlq.yaml (${#sums[@]} platform(s))"
}

# kubectl-dlq of BIN_DIR as the linux/amd64 plugin archive, as release.yml names them.
krew_archive() {
  local dir=$1 name stage
  name=kubectl-dlq_${TAG}_linux_amd64.tar.gz
  stage=$(mktemp -d)
  cp "$BIN_DIR/kubectl-dlq" "$stage/kubectl-dlq"
  mkdir -p "$dir"
  tar -C "$stage" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -czf "$dir/$name" kubectl-dlq
  rm -rf "$stage"
  (cd "$dir" && sha256sum "$name" >"$name.sha256")
}

verify() {
  local image=$1 chart_ref=$2
  # shellcheck disable=SC2046
  "$COSIGN" verify $(verify_flags) $(cosign_registry_flags "$image") "$image" >/dev/null \
    || fail "cosign verify $image failed"
  # shellcheck disable=SC2046
  "$COSIGN" verify-attestation --type spdxjson $(verify_flags) $(cosign_registry_flags "$image") \
    "$image" >/dev/null || fail "cosign verify-attestation (SBOM) $image failed"
  # shellcheck disable=SC2046
  "$COSIGN" verify $(verify_flags) $(cosign_registry_flags "$chart_ref") "$chart_ref" >/dev/null \
    || fail "cosign verify $chart_ref failed"
  say "verified: $image (signature, SBOM attestation) and $chart_ref"
}

# A loopback registry for this run (crane registry serve), stopped on exit.
registry_pid=
start_registry() {
  local crane=$1 log=$OUT/registry.log port=
  "$crane" registry serve --address 127.0.0.1:0 >"$log" 2>&1 &
  registry_pid=$!
  trap 'kill "$registry_pid" 2>/dev/null || true' EXIT
  for _ in $(seq 100); do
    port=$(sed -n 's/.*serving on port \([0-9]*\).*/\1/p' "$log")
    [ -n "$port" ] && break
    kill -0 "$registry_pid" 2>/dev/null || fail "crane registry serve exited: $(cat "$log")"
    sleep 0.1
  done
  [ -n "$port" ] || fail "crane registry serve did not say its port in 10s"
  REGISTRY=127.0.0.1:$port
  say "loopback registry at $REGISTRY (stopped when this run ends)"
}

all() {
  local crane image_ref layout digest started=$SECONDS
  for b in deadletter-operator kubectl-dlq; do
    [ -x "$BIN_DIR/$b" ] || fail "$BIN_DIR/$b is missing (cargo build --release -p deadletter-operator -p kubectl-dlq, or BIN_DIR=)"
  done
  crane=$(tool crane crane)
  if [ -z "${REGISTRY:-}" ]; then start_registry "$crane"; fi
  ensure_key

  # The image, daemonless (crates/dlq-testenv/src/image.rs), pushed by digest; the OCI archive
  # stays in OUT/image.
  local dlq_image=${DLQ_IMAGE_BIN:-$root/target/debug/dlq-image}
  [ -x "$dlq_image" ] || cargo build -q -p dlq-testenv --bin dlq-image || fail "building dlq-image"
  "$dlq_image" --bin-dir "$BIN_DIR" --out "$OUT/image/deadletter-operator.tar" >/dev/null \
    || fail "dlq-image failed"
  layout=$OUT/image/layout
  rm -rf "$layout"; mkdir -p "$layout"
  tar -C "$layout" -xf "$OUT/image/deadletter-operator.tar"
  local insecure=()
  if loopback "$REGISTRY"; then insecure=(--insecure); fi
  "$crane" push "${insecure[@]}" "$layout" "$REGISTRY/deadletter-operator:$VERSION" \
    --image-refs "$OUT/image/refs" >/dev/null 2>"$OUT/image/push.log" \
    || fail "crane push failed: $(cat "$OUT/image/push.log")"
  image_ref=$(head -1 "$OUT/image/refs")
  digest=${image_ref#*@}
  [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || fail "crane push wrote no digest ($image_ref)"
  image_ref=$REGISTRY/deadletter-operator@$digest
  say "image pushed: $image_ref (tag $VERSION)"

  sbom "$OUT/deadletter-operator_${TAG}_crates.spdx.json"
  sign "$image_ref" "$OUT/deadletter-operator_${TAG}_crates.spdx.json"
  chart "$image_ref"

  krew_archive "$OUT/krew"
  krew --only-given "$OUT/krew"

  verify "$image_ref" "$CHART_REF"
  cat >"$OUT/release.env" <<EOF_ENV
VERSION=$VERSION
REGISTRY=$REGISTRY
IMAGE=$image_ref
CHART=oci://$REGISTRY/charts/deadletter-operator
CHART_REF=$CHART_REF
SBOM=$OUT/deadletter-operator_${TAG}_crates.spdx.json
KREW_MANIFEST=$OUT/krew/dlq.yaml
KREW_ARCHIVE=$OUT/krew/kubectl-dlq_${TAG}_linux_amd64.tar.gz
COSIGN_PUBLIC_KEY=${COSIGN_KEY%.key}.pub
EOF_ENV
  say "release $TAG in $((SECONDS - started))s: $OUT/release.env"
  cat "$OUT/release.env"
}

cmd=${1:-}
[ -n "$cmd" ] || fail "usage: scripts/release.sh all|sbom FILE|sign REF@DIGEST [SBOM]|chart REPO@DIGEST|krew DIR|verify IMAGE CHART"
shift
case $cmd in
  sbom) [ $# -eq 1 ] || fail "usage: release.sh sbom FILE"; sbom "$1"; exit 0 ;;
  krew) [ $# -ge 1 ] || fail "usage: release.sh krew [--only-given] DIR"; krew "$@"; exit 0 ;;
esac
COSIGN=$(tool cosign cosign)
case $cmd in all | chart) HELM=$(tool helm helm) ;; esac
case $cmd in
  all) all ;;
  sign) [ $# -ge 1 ] || fail "usage: release.sh sign REF@DIGEST [SBOM]"; sign "$@" ;;
  chart)
    [ $# -eq 1 ] || fail "usage: release.sh chart REPO@DIGEST"
    chart "$1"
    echo "$CHART_REF" ;;
  verify) [ $# -eq 2 ] || fail "usage: release.sh verify IMAGE@DIGEST CHART@DIGEST"; verify "$1" "$2" ;;
  *) fail "unknown step '$cmd'" ;;
esac
