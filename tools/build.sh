#!/usr/bin/env bash
# Builds the Go test tooling (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and
# kube-proxy from one k8s.io/kubernetes build, kubectl, etcd, helm, promtool, toxiproxy, the CNI
# plugins) from the modules
# pinned in tools/<tool>/go.mod into a cache outside the repo, keyed by go.mod+go.sum, so a
# second run is instant. Prints the directory holding the binaries on stdout; progress on stderr.
# `elasticmq` (an SQS-compatible server, Java) is resolved by Maven from tools/elasticmq/pom.xml
# into the same cache, keyed by the pom; it prints the directory whose lib/ is the classpath.
# `kafka` (Apache Kafka in KRaft mode, for tests/kafka.rs) is resolved the same way.
# `versitygw` (Versity's S3 gateway, its posix backend on a temp dir: the S3-compatible server of
# the body-store tests, crates/dlq-testenv/src/brokers/s3.rs) is built from its Go module.
# `pause` (the test node's sandbox process) is Kubernetes' own build/pause/linux/pause.c, taken
# from the k8s.io/kubernetes module of tools/kube and compiled static with the machine's C compiler.
# `flux` builds Flux's source-controller and kustomize-controller from their Go modules, and
# `gitserver` (tools/flux/gitserver: `git http-backend` on loopback), for tests/gitops.rs;
# Flux's CRDs, from the same modules, go to the directory's `crds/` beside `bin/`.
# `actionlint` lints .github/workflows (scripts/workflows-check.sh).
# `pstest-server` (tools/pstest-server: Google's in-process Pub/Sub server, pstest, on loopback
# with a JSON admin shim) is built from a vendored copy of its modules in a scratch directory,
# pstest's fake.go patched there by tools/pstest-server/fake.go.sed (part of the cache key).
# `cesender` (tools/cesender, on the CloudEvents Go SDK) posts CloudEvents to the park endpoint
# for tests/http_park.rs.
# `crane` (go-containerregistry: `crane registry serve` is a loopback OCI registry; push, digest,
# copy), `cosign` (signatures and attestations) and `krew` (the kubectl plugin manager) are the
# release's tools (scripts/release.sh, tests/release.rs).
# `fake-gcs-server` (tools/fake-gcs-server: fsouza's GCS emulator, its fakestorage package from
# the pinned module, on loopback with a filesystem backend, plus the XML API object PUT that
# object_store uploads with and upstream lacks) for the body store's GCS tests
# (crates/dlq-testenv/src/brokers/gcs.rs).
# `azurite` (Microsoft's Azure Storage emulator, Node.js: its blob service for the body store's
# Azure tests, crates/dlq-testenv/src/brokers/azurite.rs) is installed from the npm registry by
# `npm ci` of tools/azurite/package.json and its lock into the cache, keyed by both; it prints
# the directory holding `azurite-blob` (node_modules/.bin). Needs Node.js >= 20 and npm.
# `knative` builds Knative Eventing's controller, mt-broker controller, broker ingress and
# filter, and the in-memory channel's controller and dispatcher from their Go module, for
# tests/knative.rs; Knative's CRDs and ConfigMaps, from the same module, go to `config/`.
#
# `kube:<binary>,...` builds only those binaries of the kube set (`make demo` needs only
# kube-apiserver and kubectl) into the same directory; a later `kube` builds only the missing
# ones. Each binary gets its own marker there; `.done` means the whole set is built.
#
#   tools/build.sh kube[:bin,...]|etcd|helm|promtool|toxiproxy|versitygw|fake-gcs-server|azurite|cni|pause|elasticmq|kafka|flux|actionlint|pstest-server|cesender|knative|crane|cosign|krew [...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${DLQ_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/deadletter-operator/tools}

need_go() {
  command -v go >/dev/null || { echo "tools/build.sh: 'go' is not on PATH; install Go >= $(sed -n 's/^go //p' "$here/kube/go.mod") (https://go.dev/doc/install or apt-get install golang)" >&2; exit 1; }
}

# Java tools (ElasticMQ, Kafka): the jars of tools/<tool>/pom.xml copied into the cache (never
# into the repo).
build_maven() {
  local tool=$1 dir="$here/$1" key out
  key=$(sha256sum < "$dir/pom.xml" | cut -c1-12)
  out="$cache/$tool/$key"
  if [ -f "$out/.done" ]; then echo "$out"; return; fi
  command -v java >/dev/null || { echo "tools/build.sh: 'java' is not on PATH; install a JRE >= 17 (apt-get install openjdk-17-jre-headless)" >&2; exit 1; }
  command -v mvn >/dev/null || { echo "tools/build.sh: 'mvn' is not on PATH; install Maven (apt-get install maven)" >&2; exit 1; }
  echo ">> resolving $tool into $out (first time only)" >&2
  rm -rf "$out"; mkdir -p "$out/lib"
  local start=$SECONDS
  mvn -q -B -f "$dir/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$out/lib" >&2
  touch "$out/.done"
  echo ">> resolved $tool in $((SECONDS - start))s" >&2
  echo "$out"
}

# Node.js tools (Azurite): tools/<tool>/package.json and its lock installed by `npm ci` into the
# cache (never into the repo); the lifecycle scripts are not run (Azurite needs none).
build_npm() {
  local tool=$1 dir="$here/$1" key out
  key=$(cat "$dir/package.json" "$dir/package-lock.json" | sha256sum | cut -c1-12)
  out="$cache/$tool/$key"
  if [ -f "$out/.done" ]; then echo "$out/node_modules/.bin"; return; fi
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "tools/build.sh: 'node' and 'npm' must be on PATH for $tool; install Node.js >= 20 with npm (https://nodejs.org, or apt-get install nodejs npm)" >&2; exit 1
  fi
  mkdir -p "$cache/$tool"
  if command -v flock >/dev/null; then exec 9>"$out.lock"; flock 9; fi
  if [ -f "$out/.done" ]; then echo "$out/node_modules/.bin"; return; fi
  echo ">> installing $tool into $out (first time only)" >&2
  rm -rf "$out"; mkdir -p "$out"
  cp "$dir/package.json" "$dir/package-lock.json" "$out/"
  local start=$SECONDS
  npm ci --prefix "$out" --ignore-scripts --no-audit --no-fund --loglevel=error >&2
  touch "$out/.done"
  echo ">> installed $tool in $((SECONDS - start))s" >&2
  echo "$out/node_modules/.bin"
}

# pause.c of the k8s.io/kubernetes release pinned in tools/kube, static (the image has nothing else).
build_pause() {
  local version src out
  version=$(cat "$here/kube/VERSION")
  out="$cache/pause/$version"
  if [ -f "$out/.done" ]; then echo "$out/bin"; return; fi
  need_go
  command -v gcc >/dev/null || { echo "tools/build.sh: 'gcc' is not on PATH (apt-get install gcc libc6-dev)" >&2; exit 1; }
  src=$(cd "$here/kube" && go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  rm -rf "$out"; mkdir -p "$out/bin"
  gcc -Os -Wall -Werror -static -DVERSION="$version" -o "$out/bin/pause" "$src/build/pause/linux/pause.c"
  strip "$out/bin/pause"
  touch "$out/.done"
  echo "$out/bin"
}

# Knative Eventing's CRDs (core and in-memory channel), namespace and ConfigMaps.
knative_config() {
  local dir=$1 dest=$2 src
  src=$(cd "$dir" && go list -m -f '{{.Dir}}' knative.dev/eventing)/config
  mkdir -p "$dest/crds" "$dest/configmaps"
  cp "$src"/core/resources/*.yaml "$src"/channels/in-memory-channel/resources/*.yaml "$dest/crds/"
  cp "$src"/core/configmaps/*.yaml "$src"/channels/in-memory-channel/configmaps/*.yaml "$dest/configmaps/"
  cp "$src"/core/100-namespace.yaml "$dest/"
  chmod -R u+w "$dest"
}

# Flux's CRDs as its modules ship them (config/crd/bases), one file per kind.
flux_crds() {
  local dir=$1 dest=$2 m
  mkdir -p "$dest"
  for m in github.com/fluxcd/source-controller github.com/fluxcd/kustomize-controller; do
    cp "$(cd "$dir" && go list -m -f '{{.Dir}}' "$m")"/config/crd/bases/*.yaml "$dest/"
  done
  chmod u+w "$dest"/*.yaml
}

# The binaries of the kube tool, all from one k8s.io/kubernetes build.
kube_bins=(kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet kube-proxy)

# Runs in a subshell: the lock on the tool's directory is released when it returns.
build() (
  local tool=${1%%:*} only=() b
  case $1 in
    kube:*)
      IFS=, read -r -a only <<< "${1#kube:}"
      for b in "${only[@]}"; do
        [[ " ${kube_bins[*]} " == *" $b "* ]] \
          || { echo "tools/build.sh: '$b' is not a kube binary (${kube_bins[*]})" >&2; exit 2; }
      done ;;
    *:*) echo "tools/build.sh: only kube builds a subset of its binaries ('$1')" >&2; exit 2 ;;
  esac
  case $tool in
    elasticmq|kafka) build_maven "$tool"; return ;;
    azurite) build_npm "$tool"; return ;;
    pause) build_pause; return ;;
  esac
  local dir="$here/$tool"
  [ -f "$dir/go.mod" ] || { echo "tools/build.sh: unknown tool '$tool' (no $dir/go.mod)" >&2; exit 2; }
  local version key out
  version=$(cat "$dir/VERSION")
  # The tool's own Go sources (flux's gitserver) and patches (*.sed) are part of the key too.
  key=$(cat "$dir/go.mod" "$dir/go.sum" $(find "$dir" -name '*.go' -o -name '*.sed' | sort) \
    | sha256sum | cut -c1-12)
  out="$cache/$tool/$version-$key"
  if [ -f "$out/.done" ]; then echo "$out/bin"; return; fi
  # kube binaries already built need no lock: a test asking for kube-apiserver does not wait
  # while `make test`'s background build adds the node's binaries.
  if [ "$tool" = kube ] && [ ${#only[@]} -gt 0 ]; then
    local have=1
    for b in "${only[@]}"; do [ -f "$out/.built-$b" ] || have=; done
    if [ -n "$have" ]; then echo "$out/bin"; return; fi
  fi
  # One build per directory at a time (a second caller waits, then finds the binaries built).
  mkdir -p "$cache/$tool"
  if command -v flock >/dev/null; then exec 9>"$out.lock"; flock 9; fi
  if [ -f "$out/.done" ]; then echo "$out/bin"; return; fi
  # kube: the binaries asked for (all six by default) that are not built yet. Each one built gets
  # its marker `.built-<binary>`; `.done`, the whole set, only comes with the last of them.
  local todo=() what=$tool
  if [ "$tool" = kube ]; then
    [ ${#only[@]} -gt 0 ] || only=("${kube_bins[@]}")
    for b in "${only[@]}"; do [ -f "$out/.built-$b" ] || todo+=("$b"); done
    if [ ${#todo[@]} -eq 0 ]; then echo "$out/bin"; return; fi
    [ ${#todo[@]} -eq ${#kube_bins[@]} ] || what="${todo[*]} of kube"
  fi
  need_go
  echo ">> building $what $version into $out (first time only; this takes minutes)" >&2
  # Binaries already built there (a partial kube) are kept; anything else is a failed build.
  compgen -G "$out/.built-*" >/dev/null || rm -rf "$out"
  mkdir -p "$out/bin"
  local start=$SECONDS ldflags="-s -w" pkgs=() tags=()
  case $tool in
    kube)
      local minor=${version#v1.}; minor=${minor%%.*}
      for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $p.gitVersion=$version -X $p.gitMajor=1 -X $p.gitMinor=$minor"
        ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
      done
      for b in "${todo[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done ;;
    etcd)
      pkgs=(go.etcd.io/etcd/server/v3) ;;
    helm)
      ldflags+=" -X helm.sh/helm/v3/internal/version.version=$version"
      pkgs=(helm.sh/helm/v3/cmd/helm) ;;
    promtool)
      # Without Prometheus' service-discovery plugins (cloud SDKs): the rule checks and tests
      # need none, and the build compiles 50 MB of Go source instead of 129 MB.
      tags=(-tags remove_all_sd)
      pkgs=(github.com/prometheus/prometheus/cmd/promtool) ;;
    toxiproxy)
      pkgs=(github.com/Shopify/toxiproxy/v2/cmd/server) ;;
    versitygw)
      ldflags+=" -X main.Version=$version"
      pkgs=(github.com/versity/versitygw/cmd/versitygw) ;;
    fake-gcs-server)
      pkgs=(.) ;;
    cni)
      local m=github.com/containernetworking/plugins/plugins
      pkgs=("$m/main/bridge" "$m/ipam/host-local" "$m/main/loopback" "$m/meta/portmap") ;;
    flux)
      pkgs=(github.com/fluxcd/source-controller github.com/fluxcd/kustomize-controller ./gitserver) ;;
    cesender)
      pkgs=(.) ;;
    knative)
      local k=knative.dev/eventing/cmd
      pkgs=("$k/controller" "$k/mtchannel_broker" "$k/broker/ingress" "$k/broker/filter"
        "$k/in_memory/channel_controller" "$k/in_memory/channel_dispatcher") ;;
    actionlint)
      ldflags+=" -X github.com/rhysd/actionlint.version=$version"
      pkgs=(github.com/rhysd/actionlint/cmd/actionlint) ;;
    pstest-server)
      pkgs=(.) ;;
    crane)
      pkgs=(github.com/google/go-containerregistry/cmd/crane) ;;
    cosign)
      ldflags+=" -X sigs.k8s.io/release-utils/version.gitVersion=$version"
      pkgs=(github.com/sigstore/cosign/v2/cmd/cosign) ;;
    krew)
      ldflags+=" -X sigs.k8s.io/krew/internal/version.gitTag=$version"
      pkgs=(sigs.k8s.io/krew/cmd/krew) ;;
  esac
  local dest="$out/bin/"
  # etcd's and toxiproxy's main packages would both be named "server" by go.
  case $tool in
    etcd) dest="$out/bin/etcd" ;; toxiproxy) dest="$out/bin/toxiproxy-server" ;;
    cesender|fake-gcs-server) dest="$out/bin/$tool" ;;
  esac
  # The linker drops DWARF anyway (-w): the compiler need not make it (about a tenth of the
  # compile time; the binaries behave the same).
  local src=$dir mod=()
  if [ "$tool" = pstest-server ]; then
    # pstest patched (fake.go.sed) in a vendored copy: never the module cache or the repo.
    src="$out/src"; mod=(-mod=vendor)
    rm -rf "$src"; mkdir -p "$src"
    cp "$dir"/go.mod "$dir"/go.sum "$dir"/*.go "$src/"
    (cd "$src" && go mod vendor)
    local fake="$src/vendor/cloud.google.com/go/pubsub/v2/pstest/fake.go"
    chmod u+w "$fake"
    sed -i -f "$dir/fake.go.sed" "$fake"
    grep -q 'func (s \*Server) Pending' "$fake" \
      || { echo "tools/build.sh: fake.go.sed did not apply to $fake" >&2; exit 1; }
  fi
  (cd "$src" && CGO_ENABLED=0 go build "${mod[@]}" "${tags[@]}" -trimpath -gcflags=all=-dwarf=false \
    -ldflags "$ldflags" -o "$dest" "${pkgs[@]}")
  if [ "$tool" = pstest-server ]; then rm -rf "$src"; fi
  if [ "$tool" = flux ]; then flux_crds "$dir" "$out/crds"; fi
  if [ "$tool" = knative ]; then knative_config "$dir" "$out/config"; fi
  local complete=1
  if [ "$tool" = kube ]; then
    for b in "${todo[@]}"; do touch "$out/.built-$b"; done
    for b in "${kube_bins[@]}"; do [ -f "$out/.built-$b" ] || complete=; done
  fi
  if [ -n "$complete" ]; then touch "$out/.done"; fi
  echo ">> built $what in $((SECONDS - start))s" >&2
  echo "$out/bin"
)

[ $# -gt 0 ] || { echo "usage: tools/build.sh kube[:bin,...]|etcd|helm|promtool|toxiproxy|versitygw|fake-gcs-server|azurite|cni|pause|elasticmq|kafka|flux|actionlint|pstest-server|cesender|knative|crane|cosign|krew ..." >&2; exit 2; }
for t in "$@"; do build "$t"; done
