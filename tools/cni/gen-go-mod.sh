#!/usr/bin/env bash
# Regenerates go.mod/go.sum for the CNI plugins the test node uses (bridge, host-local, loopback,
# portmap) from github.com/containernetworking/plugins.
set -euo pipefail
cd "$(dirname "$0")"
version=${1:-$(cat VERSION)}
m=github.com/containernetworking/plugins
rm -f go.mod go.sum
printf 'module deadletter-operator/tools/cni\n\ngo 1.26.0\n' > go.mod
go get -tool "$m/plugins/main/bridge@$version" "$m/plugins/ipam/host-local@$version" \
  "$m/plugins/main/loopback@$version" "$m/plugins/meta/portmap@$version"
go mod tidy
echo "$version" > VERSION
