# deadletter-operator — the two commands are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
# Features the test suite needs: failpoints lets tests crash the operator at chosen points.
TEST_FEATURES := deadletter-operator/failpoints
# The test build: the workspace's binaries the tests run (operator, kubectl-dlq, dlq-testenv, the
# demo and its worker) and the examples.
TEST_BUILD = $(CARGO) build --workspace --features $(TEST_FEATURES) --bins --examples
# Features the benchmarks need: bench gives the operator its hidden --disable for the A/B. Every
# `cargo bench` line passes it too: a bench builds the package's binaries into target/release,
# and a build without it would replace the operator the bench runs.
BENCH_FEATURES := deadletter-operator/bench

.PHONY: all test ensure-deps fmt-check clippy lint-probe crds crds-check deps-check tools cluster cluster-down demo bench

all: test

## install what the tests and their checks need, or say exactly what is missing (idempotent: a
## machine that has everything is left alone in a second). Every target below that needs more
## than Go, Rust and a C compiler depends on it, so each works on a fresh machine on its own.
ensure-deps:
	@bash scripts/ensure-deps.sh

## the reference scenario end to end: control plane, redis, operator, sample worker
# Only what the demo runs: redis-server, kube-apiserver and etcd (the control plane's tools),
# the operator built without its default features (the Kafka, SQS and Pub/Sub backends and the
# jemalloc allocator: C and gRPC builds of minutes; `make test` and the image keep them),
# kubectl-dlq, and the demo and worker examples. About 7 minutes on a fresh 2-core machine.
DEMO_TOOLS := kube:kube-apiserver etcd
# One build: the operator and the plugin without default features, and dlq-examples' two
# binaries (the demo and its worker, over a test environment with only its control plane).
DEMO_CARGO := --no-default-features -p deadletter-operator -p kubectl-dlq -p dlq-examples \
  --bin deadletter-operator --bin kubectl-dlq --bin dlq-demo --bin dlq-demo-worker
demo:
	@bash scripts/ensure-deps.sh demo
	@# The Go tools build beside the cargo build, so that each one's downloads and single-threaded
	@# steps (links) fill the other's idle time; in its own session, so that it stops with a failed
	@# cargo build or an interrupt instead of running on. One cold build: incremental compilation
	@# would only add its bookkeeping.
	@setsid bash tools/build.sh $(DEMO_TOOLS) >/dev/null & tools=$$!; \
	  trap 'kill -- -$$tools 2>/dev/null; wait; exit 130' INT TERM; \
	  if ! CARGO_INCREMENTAL=0 $(CARGO) build -q $(DEMO_CARGO); then \
	    kill -- -$$tools 2>/dev/null; wait; exit 1; fi; \
	  wait $$tools
	@RUST_BACKTRACE=0 target/debug/dlq-demo

## benchmarks against the apiserver's own ceiling (release build; BENCH_N / BENCH_C override)
bench: ensure-deps
	@bash tools/build.sh kube etcd >/dev/null
	$(CARGO) build --release --workspace --features $(BENCH_FEATURES) --bins
	RUST_BACKTRACE=0 $(CARGO) bench -p deadletter-operator --features $(BENCH_FEATURES) --bench operator
	RUST_BACKTRACE=0 $(CARGO) bench -p deadletter-operator --features $(BENCH_FEATURES) --bench alerts
	RUST_BACKTRACE=0 $(CARGO) bench -p deadletter-operator --features $(BENCH_FEATURES) --bench groups

## every check CI runs: rustfmt, clippy -D warnings, CRDs up to date, dependency rules, the docs'
## links, the GitHub workflows, all tests (in-process reconciler tests, then real apiserver + brokers)
# One compile, linted: under `make test` (and lint-probe) clippy's driver compiles the
# workspace's own crates, as `cargo clippy` does but generating code too, with the same lints
# denied as `make clippy`. A separate `cargo clippy` checks every dependency a second time: about
# 150 s of a fresh clone's run on 2 cores. CLIPPY_ARGS is cargo-clippy's own channel to its
# driver; lint-probe fails if that ever stops denying a lint.
test lint-probe: export RUSTC_WORKSPACE_WRAPPER = $(shell rustc --print sysroot)/bin/clippy-driver
test lint-probe: export CLIPPY_ARGS = -D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__
test: ensure-deps fmt-check lint-probe commits-check docs-check
	@# (No $$(MAKE) in this recipe: `make -n test` would run it, tests/commands.rs does.)
	@# The Go, Java and npm tools build in the background, niced, while cargo builds the
	@# binaries, the examples and the test binaries and then while the tests run: a cold
	@# machine's tool builds (downloads, links, single-threaded steps) fill the idle time of the
	@# others instead of preceding them. TEST_TOOLS lists them in the order the tests first need
	@# them; a test that needs one not built yet waits on its lock in tools/build.sh. With warm
	@# caches tools/build.sh returns at once. The test binaries run in TEST_LANES (default 3)
	@# lanes, the dependency and workflow checks beside them (a few seconds of CPU, not a
	@# sequential step); the benches are compiled with the tests (so linted) and not run
	@# (`make bench` runs them).
	@mkdir -p target
	@nice -n 19 setsid bash tools/build.sh $(TEST_TOOLS) >/dev/null 2>target/tools.log & tools=$$!; \
	  trap 'kill -- -$$tools 2>/dev/null; wait; exit 130' INT TERM; \
	  stop() { kill -- -$$tools 2>/dev/null; wait; exit "$$1"; }; \
	  { $(TEST_BUILD) && $(CARGO) test -q $(TEST_CARGO_ARGS) --no-run && $(CRDS_CHECK); } || stop 1; \
	  { bash scripts/deps-check.sh && bash scripts/workflows-check.sh; } >target/checks.log 2>&1 & checks=$$!; \
	  bash scripts/test-lanes.sh $(TEST_CARGO_ARGS); lanes=$$?; \
	  wait $$checks; checked=$$?; cat target/checks.log; [ $$checked -eq 0 ] || stop 1; \
	  [ $$lanes -eq 0 ] || stop 101; \
	  wait $$tools || { cat target/tools.log; echo "make test: a test tool failed to build (above)"; exit 1; }; \
	  grep -E '^>> (built|resolved|installed)' target/tools.log || true

# What `cargo test` builds and test-lanes runs.
TEST_CARGO_ARGS = --workspace --features $(TEST_FEATURES) --lib --bins --tests --examples --benches

lint-probe: ensure-deps
	@mkdir -p target && printf 'pub fn f(v: &[u8]) -> bool {\n    v.len() == 0\n}\n' >target/lint-probe.rs
	@if ! out=$$("$$RUSTC_WORKSPACE_WRAPPER" rustc --edition 2024 --crate-type lib --emit metadata \
	    -o target/lint-probe.rmeta target/lint-probe.rs 2>&1) && grep -q 'clippy::len.zero' <<<"$$out"; then :; else \
	  echo "lint-probe: clippy-driver did not deny clippy::len_zero through CLIPPY_ARGS: make test's"; \
	  echo "lint-probe: lints would pass unchecked. Run 'make clippy' and fix the Makefile's lint build."; exit 1; fi

# Each check that needs an installed tool (rustfmt, clippy, shellcheck, Java, ...) depends on
# ensure-deps, so `make -j test` and `make <check>` alone install first too.
tools fmt-check clippy crds crds-check docs-check workflows-check: ensure-deps

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --features $(TEST_FEATURES) --all-targets -- -D warnings

## the architecture's dependency rules: the core has no kube client, runtime or broker crate;
## test infrastructure (rcgen) stays out of the operator and the plugin
deps-check:
	@bash scripts/deps-check.sh

.PHONY: docs-check
## every relative link and #anchor in README.md, CHANGELOG.md, docs/ and charts/, and the chart's
## runbook URLs (external links only checked for form: no network)
docs-check:
	@bash scripts/docs-check.sh

.PHONY: commits-check
## every commit since the rule began has a subject of at most 72 characters (the story in the body)
commits-check:
	@bash scripts/commits-check.sh

.PHONY: workflows-check
## .github/workflows linted by actionlint + shellcheck (after a known-bad workflow must fail), actions
## pinned to commits, the krew manifest template against the platforms release.yml builds
workflows-check:
	@bash scripts/workflows-check.sh

## regenerate crds/ from the Rust types
crds:
	$(TEST_BUILD)
	target/debug/deadletter-operator crds > crds/dlq.dev.yaml
	cp crds/dlq.dev.yaml charts/deadletter-operator/crds/dlq.dev.yaml

## fail when crds/ is stale
# The operator of the test build (not `cargo run -p`: its own feature set would compile the
# operator and part of its dependencies a second time, about 100 s of `make test`).
CRDS_CHECK = { target/debug/deadletter-operator crds | diff -u crds/dlq.dev.yaml - \
  || { echo "crds/dlq.dev.yaml is stale: run 'make crds' and commit it"; exit 1; }; }
crds-check:
	$(TEST_BUILD)
	@$(CRDS_CHECK)

## build the test tooling (kube-apiserver, kubelet, kube-proxy, kubectl, etcd, helm, promtool, CNI
## plugins, pause, toxiproxy; ElasticMQ and Kafka; Flux's source- and kustomize-controller and a
## loopback git server for the GitOps tests; actionlint for the workflows; pstest-server, Google's
## Pub/Sub test server; cesender, a CloudEvents Go SDK sender for the park endpoint; Knative
## Eventing's controllers, broker and in-memory channel for tests/knative.rs; crane, cosign and
## krew for the release test, tests/release.rs; versitygw, fake-gcs-server and Azurite (npm) for
## the body store's S3, GCS and Azure tests) into the cache
# In the order the tests first need them (scripts/test-lanes.sh runs the binaries that need the
# last ones last): the workflows check's linter, the control plane, the brokers, the chart's
# helm, the node's binaries, then promtool, Flux, Knative and the release's tools.
TEST_TOOLS := actionlint kube:kube-apiserver,kubectl etcd kafka elasticmq pstest-server versitygw \
  toxiproxy cesender helm fake-gcs-server azurite kube cni pause promtool flux knative crane \
  cosign krew
tools:
	@bash tools/build.sh $(TEST_TOOLS) >/dev/null

## start a local control plane for a human; prints the KUBECONFIG to export. NODE=1 adds a real
## node (kubelet, containerd, kube-proxy; needs root): see docs/development.md. Its state (kubeconfig,
## log, the node's containerd socket) goes to DLQ_CLUSTER_DIR, default target/cluster
cluster:
	@bash scripts/ensure-deps.sh $(if $(filter 1,$(NODE)),,demo)
	@NODE=$(NODE) bash scripts/cluster.sh up

## stop the cluster started by `make cluster`
cluster-down:
	@bash scripts/cluster.sh down

.PHONY: chaos
## chaos run: kills, pauses, restarts and cut links during parking storms and replays, checked
## against the invariants (CHAOS_FAULTS, CHAOS_MESSAGES, CHAOS_SEED; report in target/chaos/)
chaos: ensure-deps
	@bash tools/build.sh kube etcd toxiproxy >/dev/null
	$(CARGO) build --workspace --features $(TEST_FEATURES) --bins
	RUST_BACKTRACE=0 target/debug/dlq-chaos

.PHONY: chart-crds chart-test image
IMAGE ?= ghcr.io/deadletter-operator/deadletter-operator:dev

## copy crds/ into the Helm chart (tests/chart_render.rs fails while the two differ)
chart-crds:
	cp crds/dlq.dev.yaml charts/deadletter-operator/crds/dlq.dev.yaml

## only the packaging tests: helm lint/template + dry-run, RBAC, admission policy, promtool, hadolint
chart-test: tools
	$(CARGO) build --workspace --features $(TEST_FEATURES) --bins
	$(CARGO) test --features $(TEST_FEATURES) --test chart_render --test chart_rbac --test chart_admission --test chart_alerts --test dockerfile

## build the container image (needs a Docker/BuildKit engine; `make test` only lints the Dockerfile)
image:
	docker build -t $(IMAGE) .

.PHONY: image-local
## the operator image without a Docker daemon (release binaries, the Dockerfile's final stage),
## imported into the node of `make cluster NODE=1` when one runs (the cluster at DLQ_CLUSTER_DIR,
## default target/cluster, as for `make cluster`); the last line is the image ref
image-local:
	@bash scripts/ensure-deps.sh build
	@$(CARGO) build -q --release --locked -p deadletter-operator -p kubectl-dlq
	@$(CARGO) build -q -p dlq-testenv --bin dlq-image
	@sock=$${DLQ_CLUSTER_DIR:-$(CURDIR)/target/cluster}/containerd; \
	  target/debug/dlq-image --bin-dir target/release --out target/image/deadletter-operator.tar \
	    $$( [ -s $$sock ] && echo --load-into $$(cat $$sock) )

.PHONY: release-local
## the release as .github/workflows/release.yml makes it, on this machine (scripts/release.sh):
## the image without a daemon (release binaries) pushed by digest, the chart pushed to
## oci://$(REGISTRY)/charts, both signed with cosign (a key pair in target/release/dist, no
## transparency log), the crates' SBOM attested to the image, the krew manifest and the
## linux/amd64 plugin archive. REGISTRY=host[:port][/path] pushes there; without it a loopback
## registry serves the run and stops with it. Files and release.env in target/release/dist
release-local:
	@bash scripts/ensure-deps.sh build
	@bash tools/build.sh crane cosign helm >/dev/null
	@$(CARGO) build -q --release --locked -p deadletter-operator -p kubectl-dlq
	@$(CARGO) build -q -p dlq-testenv --bin dlq-image
	@REGISTRY=$(REGISTRY) bash scripts/release.sh all
