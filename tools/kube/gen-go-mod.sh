#!/usr/bin/env bash
# Regenerates go.mod/go.sum for building the control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler), the node (kubelet, kube-proxy) and kubectl from one k8s.io/kubernetes build.
# k8s.io/kubernetes requires its staging modules at v0.0.0 (they live in its own repo), so a
# consumer needs one replace per staging module; the list is derived from the release's go.mod.
set -euo pipefail
cd "$(dirname "$0")"
version=${1:-$(cat VERSION)}
staging=${version/v1./v0.}
modfile=$(go mod download -json "k8s.io/kubernetes@${version}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
rm -f go.mod go.sum
{
  echo "module deadletter-operator/tools/kube"
  echo
  grep -E '^go ' "$modfile"
  echo
  grep -E '^\s+k8s\.io/[a-z0-9-]+ v0\.0\.0$' "$modfile" | awk -v v="$staging" '{print "replace " $1 " => " $1 " " v}'
} > go.mod
go get "k8s.io/kubernetes@${version}"
go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@${version}" "k8s.io/kubernetes/cmd/kubectl@${version}" \
  "k8s.io/kubernetes/cmd/kube-controller-manager@${version}" "k8s.io/kubernetes/cmd/kube-scheduler@${version}" \
  "k8s.io/kubernetes/cmd/kubelet@${version}" "k8s.io/kubernetes/cmd/kube-proxy@${version}"
go mod tidy
echo "$version" > VERSION
