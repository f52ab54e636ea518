#!/usr/bin/env bash
# Knative Eventing end to end (driven by tests/knative.rs, which runs this under `unshare --mount
# --net --pid --fork --mount-proc`: a private network with only loopback, a private /etc/hosts,
# and every process gone when this script ends).
#
# Knative's controller, mt-broker controller, broker ingress and filter, and the in-memory
# channel's controller and dispatcher (built from their Go module by `tools/build.sh knative`)
# run as processes against a local control plane beside the operator's park endpoint. A Broker,
# a Trigger whose subscriber always fails and whose deadLetterSink is the DeadLetterQueue
# `relayer`; one event posted to the Broker must end as a record of that queue.
#
# Not pods: there are no Knative images here and no cluster DNS. The data plane's Service names
# resolve through /etc/hosts to loopback addresses, and iptables (of this namespace only) maps
# their port 80 to each process's port. The three controllers each get a network namespace of
# their own (all serve health probes on :8080, as the dispatcher serves events), on a bridge
# whose address the apiserver listens on. Knative's Deployments and Endpoints that its
# controllers check are created as the cluster would have them (the dispatcher's Available).
#
# In: OUT (results and logs), KNATIVE (tools/build.sh knative's directory: bin/, config/),
# KUBECTL, TESTENV and OPERATOR (binaries), CRDS (crds/dlq.dev.yaml).
# Out: $OUT/record.json (the queue's records), $OUT/attempts (POSTs the subscriber refused).
set -euo pipefail
: "${OUT:?}" "${KNATIVE:?}" "${KUBECTL:?}" "${TESTENV:?}" "${OPERATOR:?}" "${CRDS:?}"
KB=$KNATIVE/bin CFG=$KNATIVE/config
# A temp dir of its own: the scratch dirs of the tests beside this one stay out of reach (from
# inside this PID namespace their processes are invisible, so they would look abandoned).
export TMPDIR=$OUT/tmp
mkdir -p "$TMPDIR"
k() { "$KUBECTL" --kubeconfig "$OUT/kubeconfig" "$@"; }
fail() { echo "knative: $*" >&2; exit 1; }
# until CMD succeeds, at most $1 seconds
until_ok() { local secs=$1; shift; for _ in $(seq $((secs * 2))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done; return 1; }

pids=()
stop() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  exec 9>&- || true   # the control plane stops (and removes its files) when its stdin closes
  wait || true
}
trap stop EXIT

ip link set lo up
BRIDGE=198.18.254.1
ip link add kn0 type bridge
ip addr add "$BRIDGE/24" dev kn0
ip link set kn0 up
cat > "$OUT/hosts" <<H
127.0.0.1 localhost
127.0.0.2 broker-ingress.knative-eventing.svc.cluster.local
127.0.0.3 broker-filter.knative-eventing.svc.cluster.local
127.0.0.4 imc-dispatcher.knative-eventing.svc.cluster.local default-kne-trigger-kn-channel.kn.svc.cluster.local
H
mount --bind "$OUT/hosts" /etc/hosts
iptables -t nat -A OUTPUT -d 127.0.0.2 -p tcp --dport 80 -j DNAT --to-destination 127.0.0.1:18080
iptables -t nat -A OUTPUT -d 127.0.0.3 -p tcp --dport 80 -j DNAT --to-destination 127.0.0.1:28080
iptables -t nat -A OUTPUT -d 127.0.0.4 -p tcp --dport 80 -j DNAT --to-destination 127.0.0.1:8080

mkfifo "$OUT/plane-stdin"
"$TESTENV" --address "$BRIDGE" --kubeconfig-out "$OUT/kubeconfig" --until-stdin-closes < "$OUT/plane-stdin" > "$OUT/plane.log" 2>&1 &
pids+=("$!")
exec 9> "$OUT/plane-stdin"
until_ok 90 k get ns default || fail "the control plane did not come up: $(tail -5 "$OUT/plane.log")"

k apply -f "$CRDS" -f "$CFG/crds/" -f "$CFG/100-namespace.yaml" > /dev/null
k create namespace kn > /dev/null
k apply -f "$CFG/configmaps/" > /dev/null
# No metrics or traces exporters (they would dial out).
k -n knative-eventing create configmap config-observability --from-literal=metrics-protocol=none \
  --from-literal=tracing-protocol=none --dry-run=client -o yaml | k apply -f - > /dev/null
k wait --for condition=established crd --all --timeout=60s > /dev/null

# The park endpoint's certificate, its CA beside it as cert-manager writes it (ca.crt): the
# operator publishes that CA in the queue's status.address.CACerts, which is how Knative's
# dispatcher comes to trust the endpoint.
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$OUT/ca.key" -out "$OUT/ca.crt" -days 1 -subj /CN=dlq-test-ca 2> /dev/null
openssl req -newkey rsa:2048 -nodes -keyout "$OUT/tls.key" -out "$OUT/tls.csr" -subj /CN=park 2> /dev/null
printf 'subjectAltName=IP:127.0.0.1\n' > "$OUT/san"
openssl x509 -req -in "$OUT/tls.csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" -CAcreateserial \
  -out "$OUT/tls.crt" -days 1 -extfile "$OUT/san" 2> /dev/null

KUBECONFIG="$OUT/kubeconfig" "$OPERATOR" run --leader-election=false --metrics-addr=127.0.0.1:19090 \
  --park-addr=127.0.0.1:19443 --park-tls-dir="$OUT" --park-url=https://127.0.0.1:19443 \
  --park-anonymous-from=127.0.0.0/8 > "$OUT/operator.log" 2>&1 &
pids+=("$!")

# The subscriber that always fails: 500 "payer down", each POST counted.
python3 - > "$OUT/subscriber.log" 2>&1 <<'PY' &
import http.server, os
out = os.environ["OUT"]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with open(os.path.join(out, "attempts"), "a") as f:
            f.write("x")
        self.send_response(500); self.send_header("content-type", "text/plain"); self.end_headers()
        self.wfile.write(b"payer down")
http.server.HTTPServer(("127.0.0.1", 19999), H).serve_forever()
PY
pids+=("$!")

# Knative's environment for process $1 (profiling port $2), into the array kenv_out.
kenv() {
  kenv_out=(SYSTEM_NAMESPACE=knative-eventing CONFIG_LOGGING_NAME=config-logging
    CONFIG_OBSERVABILITY_NAME=config-observability METRICS_DOMAIN=knative.dev/eventing
    POD_NAME="$1" CONTAINER_NAME="$1" PROFILING_PORT="$2" KUBECONFIG="$OUT/kubeconfig")
}
knative() {
  local name=$1 port=$2; shift 2
  kenv "$name" "$port"
  env "${kenv_out[@]}" "$@" > "$OUT/$name.log" 2>&1 &
  pids+=("$!")
}
# Like knative, in a network namespace of its own: the next address of the bridge's network.
host=10
isolated() {
  local name=$1 port=$2 pid; shift 2
  host=$((host + 1))
  kenv "$name" "$port"
  unshare --net bash -c 'until ip -4 addr show dev eth0 2>/dev/null | grep -q inet; do sleep 0.1; done; exec "$@"' \
    _ env "${kenv_out[@]}" "$@" > "$OUT/$name.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  until [ "$(readlink /proc/$pid/ns/net)" != "$(readlink /proc/self/ns/net)" ]; do sleep 0.05; done
  ip link add "kn$host" type veth peer name eth0 netns "$pid"
  ip link set "kn$host" master kn0 up
  nsenter -t "$pid" -n sh -c "ip link set lo up && ip link set eth0 up && ip addr add 198.18.254.$host/24 dev eth0"
}
images=()
for v in APISERVER_RA AUTH_PROXY EVENT_TRANSFORM_JSONATA INTEGRATION_SOURCE_TIMER \
  INTEGRATION_SOURCE_AWS_SQS INTEGRATION_SOURCE_AWS_DDB_STREAMS INTEGRATION_SINK_LOG \
  INTEGRATION_SINK_AWS_SQS INTEGRATION_SINK_AWS_SNS; do images+=("${v}_IMAGE=unused"); done
isolated controller 18001 "${images[@]}" "$KB/controller"
isolated mt-broker-controller 18002 "$KB/mtchannel_broker"
# Only ingress and filter are namespace-scoped (NAMESPACE); the dispatcher would be too.
knative ingress 18003 NAMESPACE=knative-eventing INGRESS_PORT=18080 INGRESS_PORT_HTTPS=18443 "$KB/ingress"
knative filter 18004 NAMESPACE=knative-eventing FILTER_PORT=28080 FILTER_PORT_HTTPS=28443 "$KB/filter"
isolated imc-controller 18005 WEBHOOK_NAME=inmemorychannel-webhook WEBHOOK_PORT=18444 \
  DISPATCHER_IMAGE=unused "$KB/channel_controller"
knative imc-dispatcher 18006 MAX_IDLE_CONNS=100 MAX_IDLE_CONNS_PER_HOST=100 "$KB/channel_dispatcher"

# What the cluster would have: the data plane's Services with Endpoints (an address of the
# benchmark range; traffic goes by /etc/hosts), the dispatcher's Deployment Available.
for svc in imc-dispatcher broker-ingress broker-filter; do
  k apply -f - > /dev/null 2>&1 <<Y
apiVersion: v1
kind: Service
metadata: {name: $svc, namespace: knative-eventing}
spec: {ports: [{name: http, port: 80, targetPort: 8080}]}
---
apiVersion: v1
kind: Endpoints
metadata: {name: $svc, namespace: knative-eventing}
subsets: [{addresses: [{ip: 198.18.255.1}], ports: [{name: http, port: 8080}]}]
Y
done
k apply -f - > /dev/null <<Y
apiVersion: apps/v1
kind: Deployment
metadata: {name: imc-dispatcher, namespace: knative-eventing}
spec:
  selector: {matchLabels: {app: imc-dispatcher}}
  template:
    metadata: {labels: {app: imc-dispatcher}}
    spec: {containers: [{name: dispatcher, image: unused}]}
Y
k patch deployment imc-dispatcher -n knative-eventing --subresource=status --type=merge -p \
  '{"status":{"replicas":1,"readyReplicas":1,"availableReplicas":1,"conditions":[{"type":"Available","status":"True","reason":"MinimumReplicasAvailable","lastUpdateTime":"2026-01-01T00:00:00Z","lastTransitionTime":"2026-01-01T00:00:00Z"}]}}' > /dev/null

# The README's Trigger, with the labels Knative's webhook would add (no webhook runs here).
k apply -f - > /dev/null <<Y
apiVersion: dlq.dev/v1alpha1
kind: DeadLetterQueue
metadata: {name: relayer, namespace: kn}
spec:
  http: {allowAnonymous: true}
  target: {http: {url: "http://127.0.0.1:19999/"}}
---
apiVersion: eventing.knative.dev/v1
kind: Broker
metadata:
  name: default
  namespace: kn
  annotations: {eventing.knative.dev/broker.class: MTChannelBasedBroker}
spec:
  config: {apiVersion: v1, kind: ConfigMap, name: config-br-default-channel, namespace: knative-eventing}
---
apiVersion: eventing.knative.dev/v1
kind: Trigger
metadata: {name: settle, namespace: kn, labels: {eventing.knative.dev/broker: default}}
spec:
  broker: default
  subscriber: {uri: "http://127.0.0.1:19999/"}
  delivery:
    retry: 1
    deadLetterSink: {ref: {kind: DeadLetterQueue, apiVersion: dlq.dev/v1alpha1, name: relayer}}
Y
ready() { [ "$(k get "$1" -n kn -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]; }
until_ok 90 ready trigger/settle || fail "the Trigger is not Ready: $(k get trigger settle -n kn -o jsonpath='{.status.conditions}')"
k get dlq relayer -n kn -o jsonpath='{.status.address}' > "$OUT/address.json"
k get inmemorychannel -n kn -o jsonpath='{.items[0].spec.subscribers[0].delivery}' > "$OUT/delivery.json"

# One event into the Broker; the subscriber refuses it twice (retry: 1), then the dead-letter sink.
code=$(curl -s -o "$OUT/ingress.out" -w '%{http_code}' -X POST http://broker-ingress.knative-eventing.svc.cluster.local/kn/default \
  -H 'ce-specversion: 1.0' -H 'ce-id: pi_0003-settle' -H 'ce-source: /payments/relayer' \
  -H 'ce-type: payment.settle' -H 'content-type: application/json' -d '{"intent":"pi_0003","ref":"settle"}')
[ "$code" = 202 ] || fail "the broker's ingress answered $code: $(cat "$OUT/ingress.out")"
parked() { [ -n "$(k get dl -n kn -o name)" ]; }
until_ok 60 parked || fail "no record within a minute; the dispatcher: $(grep -i 'dead\|error' "$OUT/imc-dispatcher.log" | grep -v OIDC | tail -3)"
sleep 1
k get dl -n kn -o json > "$OUT/record.json"
echo "knative: parked $(k get dl -n kn -o name)"
