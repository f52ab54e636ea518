#!/usr/bin/env bash
# The architecture's dependency rules (docs/architecture.md), checked on the normal (non-dev)
# dependency trees:
# - dlq-core holds no kube client, HTTP stack, async runtime or broker client;
# - the operator and kubectl-dlq carry no test infrastructure (rcgen: certificates for the
#   local control plane), and kubectl-dlq does not depend on the operator;
# - inside the operator crate, module arrows run one way (scripts/module-arrows.sh), and
#   docs/architecture.md has one row per module (scripts/architecture-check.sh);
# - no module cycle inside the crates scripts/module-cycles.sh lists.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
tree() { cargo tree -q -p "$1" -e normal --prefix none | sed 's/ (.*//; s/ v[0-9].*//' | sort -u; }
check() {
  local pkg=$1 pattern=$2 why=$3 found
  found=$(tree "$pkg" | grep -E "^($pattern)$" || true)
  if [ -n "$found" ]; then
    echo "deps-check: $pkg must not depend on $(echo "$found" | tr '\n' ' ')($why)" >&2
    fail=1
  fi
}
check dlq-core 'kube|kube-client|kube-runtime|hyper|hyper-util|tower|tokio|redis|lapin|async-nats|reqwest' 'the core is pure'
check deadletter-operator 'rcgen|dlq-testenv' 'test infrastructure'
check kubectl-dlq 'rcgen|dlq-testenv|deadletter-operator' 'the plugin depends on the core, not the controller'
[ $fail = 0 ] && echo "deps-check: dlq-core is pure; no test infrastructure in the operator or the plugin"

# The operator crate's module arrows, and a proof that the check catches an upward one; the
# architecture's module table in step with the code.
bash scripts/module-arrows.sh || fail=1
bash scripts/architecture-check.sh || fail=1
bash scripts/module-cycles.sh || fail=1
probe=$(mktemp -d)
cycles=$(mktemp -d)
trap 'rm -rf "$probe" "$cycles"' EXIT
cp -r src "$probe/src"
sed -i '1i use crate::run::Process;' "$probe/src/state/jobs.rs"
if bash scripts/module-arrows.sh "$probe" >/dev/null 2>&1; then
  echo "deps-check: scripts/module-arrows.sh did not catch an arrow from state up to run" >&2
  fail=1
fi
# An injection into a fresh copy of src/ that module-arrows.sh must catch, saying `expect`.
caught() { # expect what file sed-expression
  local found
  rm -rf "$probe/src" && cp -r src "$probe/src"
  sed -i "$4" "$probe/$3"
  found=$(bash scripts/module-arrows.sh "$probe" 2>&1 || true)
  if ! grep -q "$1" <<<"$found"; then
    echo "deps-check: scripts/module-arrows.sh did not catch $2" >&2
    fail=1
  fi
}
# Caught by name: a cycle through `super::` (a shared part reaching back into a reconciler), a source
# reaching into a target, pass-through climbing back up (the pass room naming the reconcilers:
# a passing dead letter went source -> state -> reconcile -> target before it had a room of its
# own; the shared state below it naming it), and src/lib.rs leaving a layer's module out.
caught 'cycle between the files of src/: .*src/reconcile/context.rs -> src/reconcile/queue.rs' \
  'a super:: cycle (reconcile::context -> reconcile::queue -> reconcile::context)' \
  src/reconcile/context.rs '1i use super::queue::QueueError;'
caught 'src/source/redis.rs names crate::targets' 'a source naming crate::targets' \
  src/source/redis.rs '1i use crate::targets::Target;'
caught 'src/pass/standing.rs (pass, layer 4) names crate::reconcile (layer 5)' \
  'the pass room naming crate::reconcile' src/pass/standing.rs '1i use crate::reconcile::Context;'
caught 'src/state/jobs.rs (state, layer 3) names crate::pass (layer 4)' \
  'the shared state naming crate::pass' src/state/jobs.rs '1i use crate::pass::Standing;'
# Seal-or-open decided in a second room (redrive, reveal and park each decided it before
# body::payload): the redrive opening a record itself, the reveal reading a sealed body itself.
caught 'src/reconcile/record.rs names a seal or open primitive' \
  'the redrive opening a sealed job itself' src/reconcile/record.rs \
  '1i fn o(j: \&Job, k: \&Keyring) { let _ = dlq_core::seal::open_job(j, k); }'
caught 'src/reveal/mod.rs names a seal or open primitive' \
  'the reveal API reading a sealed body itself' src/reveal/mod.rs \
  '1i async fn o(s: \&crate::body::BodyStore) { let _ = s.fetch_opened("j", todo!(), "r", todo!()).await; }'
# A park asking the core step by step again (placement, dispose, arriving, after_refusal were
# four trips per park before dlq_core::source_plan).
caught 'src/source/park_into.rs calls a step of a source.s park plan itself' \
  'park_into asking the core for a step of its plan' src/source/park_into.rs \
  's/^use dlq_core::park::job_key;/use dlq_core::park::{after_refusal, job_key};/'
caught 'src/source/http/mod.rs calls a step of a source.s park plan itself' \
  'the park endpoint disposing of an event itself' src/source/http/mod.rs \
  '1i fn d(r: ParkRequest, b: \&[u8]) { let _ = dlq_core::park::dispose(r, b); }'
caught 'src/lib.rs puts broker in layer none' "src/lib.rs leaving a layer's module out" \
  src/lib.rs 's/\[`broker`\]/broker/'
# A source reading its target's Secret itself again (the family `source/pubsub.rs` ~
# `source/sqs.rs` was), beside the one place per backend in crate::broker; and a source reaching
# the reconcilers' Context (a source takes the narrow services it parks with, never the Context).
caught 'src/source/pubsub.rs reads a Secret itself' 'a source reading a Secret itself' \
  src/source/pubsub.rs '1i fn key(c: &kube::Client, r: &dlq_core::api::SecretKeyRef) { let _ = crate::secret::read_secret(c, "ns", r); }'
caught 'src/source/redis.rs (source, layer 5) names crate::reconcile (layer 5)' \
  'a source reaching the reconcilers'"'"' Context' src/source/redis.rs '1i use crate::reconcile::Context;'
rm -rf "$probe/src" && cp -r src "$probe/src"
mkdir -p "$probe/docs" "$probe/crates/dlq-core" "$probe/crates/dlq-client"
cp docs/architecture.md "$probe/docs/"
cp -r crates/dlq-core/src "$probe/crates/dlq-core/src"
cp -r crates/dlq-client/src "$probe/crates/dlq-client/src"
touch "$probe/src/state/undocumented.rs"
if bash scripts/architecture-check.sh "$probe" >/dev/null 2>&1; then
  echo "deps-check: scripts/architecture-check.sh did not catch a module without a row" >&2
  fail=1
fi

# Cycles injected into a copy must fail the cycle check, each by name: one through `super::`
# (the pages' frame naming the pages, which use it), one through `crate::` (admission naming
# the parker, which uses it), one back to a facade (dlq-testenv's harness naming its lib.rs,
# which re-exports it), and one whose parent names the child only by a bare path.
cp -r src "$cycles/src"
for d in crates/*/src; do mkdir -p "$cycles/${d%/src}"; cp -r "$d" "$cycles/$d"; done
sed -i '1i use super::pages::can_decide;' "$cycles/crates/kubectl-dlq/src/ui/frame.rs"
sed -i '1i use crate::park::Parker;' "$cycles/crates/dlq-client/src/admission.rs"
sed -i '1i use crate::report;' "$cycles/crates/dlq-testenv/src/harness.rs"
# (the page's records naming its parent, which names them only by a bare path: pages::queues)
sed -i '1i use super::HTMX;' "$cycles/crates/kubectl-dlq/src/ui/pages.rs"
found=$(bash scripts/module-cycles.sh "$cycles" 2>&1 || true)
if ! grep -q 'a cycle among .*ui::frame' <<<"$found"; then
  echo "deps-check: scripts/module-cycles.sh did not catch a super:: cycle (ui::frame, ui::pages)" >&2
  fail=1
fi
if ! grep -q 'kubectl-dlq/src: a cycle among .*ui -> ui::pages.*ui::pages -> ui[;)]' <<<"$found"; then
  echo "deps-check: scripts/module-cycles.sh did not catch a cycle through a bare child path (ui -> ui::pages by pages::queues)" >&2
  fail=1
fi
if ! grep -q 'a cycle among admission, park' <<<"$found"; then
  echo "deps-check: scripts/module-cycles.sh did not catch a crate:: cycle (admission, park)" >&2
  fail=1
fi
if ! grep -q 'dlq-testenv/src: a cycle among crate, .*harness -> crate' <<<"$found"; then
  echo "deps-check: scripts/module-cycles.sh did not catch a cycle back to a facade (dlq-testenv's crate, harness)" >&2
  fail=1
fi
exit $fail
