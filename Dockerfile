# syntax=docker/dockerfile:1
# deadletter-operator image: the operator and the kubectl-dlq plugin, release build, distroless
# non-root runtime. Build: docker build -t deadletter-operator:dev .
# Lint:  hadolint Dockerfile   (make test runs it; config in .hadolint.yaml)

ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-slim-bookworm AS build
WORKDIR /src
# Whole-program optimisation for the shipped binaries only (local release builds stay fast):
# the operator's code shrinks from 23.5 to 20.5 MB, its idle RSS by 2.5 MiB (most of an idle
# operator's RSS is its code), and with 10,000 records parked its peak from 48.6 to 46.0 MiB.
ENV CARGO_TERM_COLOR=never \
    CARGO_INCREMENTAL=0 \
    CARGO_PROFILE_RELEASE_LTO=fat \
    CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1
# librdkafka (the Kafka backend) is built from the rdkafka crate's bundled C source: it needs make
# and OpenSSL headers; versions are those of the pinned bookworm base image.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends make pkg-config libssl-dev \
 && rm -rf /var/lib/apt/lists/*
COPY . .
# Cargo.lock is authoritative (--locked); the registry and target dir are cached between builds.
# No test-only features (failpoints) in a release image.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p deadletter-operator -p kubectl-dlq \
 && install -D -m 0755 target/release/deadletter-operator /out/deadletter-operator \
 && install -D -m 0755 target/release/kubectl-dlq /out/kubectl-dlq

# glibc + libgcc + OpenSSL (librdkafka's TLS), no shell, no package manager; runs as uid/gid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="deadletter-operator" \
      org.opencontainers.image.description="Parks given-up queue jobs as DeadLetter resources; redrives or drops them on a signed decision" \
      org.opencontainers.image.source="https://github.com/deadletter-operator/deadletter-operator" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.dlq.license.file="/usr/share/doc/deadletter-operator/LICENSE"
COPY --from=build /out/deadletter-operator /out/kubectl-dlq /usr/local/bin/
# The licence travels with the binaries (Apache-2.0, the LICENSE at the repository's root).
COPY LICENSE /usr/share/doc/deadletter-operator/LICENSE
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/deadletter-operator"]
CMD ["run"]
