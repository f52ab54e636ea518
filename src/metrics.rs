//! Prometheus metrics (names are part of the product contract: alerts are written on them).

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use dlq_core::api::{FailureKind, Phase};
use dlq_core::plan::{Counts, MetricChange, RedriveResult};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub namespace: String,
    pub queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ParkedLabels {
    pub namespace: String,
    pub queue: String,
    pub failure_kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub namespace: String,
    pub queue: String,
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub namespace: String,
    pub queue: String,
    /// success | failure | conflict
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub namespace: String,
    pub queue: String,
    /// Why, in a bounded set of words: why a dead message can never be a record (e.g.
    /// PayloadTooLarge), why a pass-through's enqueue failed (e.g. BrokerUnreachable).
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AlertResultLabels {
    /// success | failure
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    /// The HTTP status answered.
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    /// client_limit | connection_limit
    pub reason: String,
    /// "true" when the refusal was written, "false" when the connection closed without it.
    pub answered: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BoundLabels {
    pub namespace: String,
    pub queue: String,
    /// The bound that refused: max_parked | quota | max_records | uncounted
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub kind: String,
}

#[derive(Clone)]
pub struct Metrics {
    pub parked: Family<ParkedLabels, Counter>,
    pub records: Family<PhaseLabels, Gauge>,
    pub redrives: Family<ResultLabels, Counter>,
    pub drops: Family<QueueLabels, Counter>,
    pub oldest_parked_age: Family<QueueLabels, Gauge>,
    pub requeue_duration: Histogram,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub rejected: Family<ReasonLabels, Counter>,
    pub alerts_sent: Family<AlertResultLabels, Counter>,
    pub http_park_requests: Family<CodeLabels, Counter>,
    pub http_refused: Family<RefusedLabels, Counter>,
    pub passed_through: Family<QueueLabels, Counter>,
    pub pass_through_failures: Family<ReasonLabels, Counter>,
    pub park_refusals: Family<BoundLabels, Counter>,
    pub records_held: Gauge,
    pub records_ceiling: Gauge,
    pub registry: Arc<Registry>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let parked = Family::<ParkedLabels, Counter>::default();
        registry.register(
            "dlq_parked",
            "Jobs parked as DeadLetter records, by failure kind",
            parked.clone(),
        );
        let records = Family::<PhaseLabels, Gauge>::default();
        registry.register(
            "dlq_records",
            "DeadLetter records by phase",
            records.clone(),
        );
        let redrives = Family::<ResultLabels, Counter>::default();
        registry.register(
            "dlq_redrives",
            "Redrive attempts by result (success, failure, conflict)",
            redrives.clone(),
        );
        let drops = Family::<QueueLabels, Counter>::default();
        registry.register("dlq_drops", "Records dropped", drops.clone());
        let oldest_parked_age = Family::<QueueLabels, Gauge>::default();
        registry.register(
            "dlq_oldest_parked_age_seconds",
            "Age of the oldest Parked record",
            oldest_parked_age.clone(),
        );
        let requeue_duration = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "dlq_requeue_duration_seconds",
            "Time from the start of a requeue until the broker confirmed it",
            requeue_duration.clone(),
        );
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "dlq_reconcile_errors",
            "Reconcile errors by kind",
            reconcile_errors.clone(),
        );
        let rejected = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "dlq_rejected",
            "Dead messages that can never be records, kept in the broker's rejected list or queue",
            rejected.clone(),
        );
        let alerts_sent = Family::<AlertResultLabels, Counter>::default();
        registry.register(
            "dlq_alerts_sent",
            "Per-record alerts posted to Alertmanager, by result (success, failure)",
            alerts_sent.clone(),
        );
        let http_park_requests = Family::<CodeLabels, Counter>::default();
        registry.register(
            "dlq_http_park_requests",
            "Requests to the HTTP park endpoint, by the status answered",
            http_park_requests.clone(),
        );
        let http_refused = Family::<RefusedLabels, Counter>::default();
        registry.register(
            "dlq_http_refused",
            "Connections to the HTTP park endpoint refused over its connection limits, by limit and whether the refusal was written",
            http_refused.clone(),
        );
        let passed_through = Family::<QueueLabels, Counter>::default();
        registry.register(
            "dlq_passed_through",
            "Dead messages a standing replay passed from the broker to the target without a record",
            passed_through.clone(),
        );
        let pass_through_failures = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "dlq_pass_through_failures",
            "Dead messages a standing replay covered whose enqueue on the target failed (parked instead), by reason",
            pass_through_failures.clone(),
        );
        let park_refusals = Family::<BoundLabels, Counter>::default();
        registry.register(
            "dlq_park_refusals",
            "Parkings refused for now by a bound (maxParked, a ResourceQuota on records, --max-records): the dead message waits in its broker",
            park_refusals.clone(),
        );
        let records_held = Gauge::default();
        registry.register(
            "dlq_records_held",
            "Records the operator keeps across every queue it watches, with slots being parked, as its --max-records ledger counts them",
            records_held.clone(),
        );
        let records_ceiling = Gauge::default();
        registry.register(
            "dlq_records_ceiling",
            "The operator's --max-records (0 without one)",
            records_ceiling.clone(),
        );
        Metrics {
            park_refusals,
            records_held,
            records_ceiling,
            http_park_requests,
            http_refused,
            passed_through,
            pass_through_failures,
            rejected,
            parked,
            records,
            redrives,
            drops,
            oldest_parked_age,
            requeue_duration,
            reconcile_errors,
            alerts_sent,
            registry: Arc::new(registry),
        }
    }
}

/// One more in `family`'s series of queue `namespace/queue` and `reason`.
fn count_reason(
    family: &Family<ReasonLabels, Counter>,
    namespace: &str,
    queue: &str,
    reason: &str,
) {
    family
        .get_or_create(&ReasonLabels {
            namespace: namespace.into(),
            queue: queue.into(),
            reason: reason.into(),
        })
        .inc();
}

impl Metrics {
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// A parking refused for now by `bound` (`dlq_client::ParkError::bound`).
    pub fn park_refused(&self, namespace: &str, queue: &str, bound: &str) {
        self.park_refusals
            .get_or_create(&BoundLabels {
                namespace: namespace.into(),
                queue: queue.into(),
                reason: bound.into(),
            })
            .inc();
    }

    /// One more dead message that can never be a record.
    pub fn rejected(&self, namespace: &str, queue: &str, reason: &str) {
        count_reason(&self.rejected, namespace, queue, reason);
    }

    /// One more dead message passed through by a standing replay.
    pub fn passed_through(&self, namespace: &str, queue: &str) {
        self.passed_through
            .get_or_create(&QueueLabels {
                namespace: namespace.into(),
                queue: queue.into(),
            })
            .inc();
    }

    /// One more dead message whose pass-through failed for `reason` (an `EnqueueError`'s).
    pub fn pass_through_failed(&self, namespace: &str, queue: &str, reason: &str) {
        count_reason(&self.pass_through_failures, namespace, queue, reason);
    }

    /// Counts `n` alerts posted to an Alertmanager with `result` (success | failure).
    pub fn alert_sent(&self, result: &str, n: u64) {
        self.alerts_sent
            .get_or_create(&AlertResultLabels {
                result: result.into(),
            })
            .inc_by(n);
    }

    /// One more request to the HTTP park endpoint, answered with `code`.
    pub fn http_park_request(&self, code: u16) {
        self.http_park_requests
            .get_or_create(&CodeLabels {
                code: code.to_string(),
            })
            .inc();
    }

    /// One more connection to the HTTP park endpoint refused for `reason`, `answered` or
    /// closed without its answer.
    pub fn http_refused(&self, reason: &str, answered: bool) {
        self.http_refused
            .get_or_create(&RefusedLabels {
                reason: reason.into(),
                answered: answered.to_string(),
            })
            .inc();
    }

    /// Creates the series of `reasons` at 0, so the first refusal is an increase.
    pub fn touch_http_refused(&self, reasons: &[&str]) {
        for reason in reasons {
            for answered in [true, false] {
                let _ = self.http_refused.get_or_create(&RefusedLabels {
                    reason: (*reason).into(),
                    answered: answered.to_string(),
                });
            }
        }
    }

    /// Carries out one metric change of a plan.
    pub fn apply(&self, change: &MetricChange) {
        match change {
            MetricChange::Parked {
                namespace,
                queue,
                failure_kind,
            } => {
                self.parked
                    .get_or_create(&ParkedLabels {
                        namespace: namespace.clone(),
                        queue: queue.clone(),
                        failure_kind: failure_kind.label().into(),
                    })
                    .inc();
            }
            MetricChange::Redrive {
                namespace,
                queue,
                result,
            } => {
                self.redrives
                    .get_or_create(&ResultLabels {
                        namespace: namespace.clone(),
                        queue: queue.clone(),
                        result: result.label().into(),
                    })
                    .inc();
            }
            MetricChange::Dropped { namespace, queue } => {
                self.drops
                    .get_or_create(&QueueLabels {
                        namespace: namespace.clone(),
                        queue: queue.clone(),
                    })
                    .inc();
            }
            MetricChange::QueueGauges {
                namespace,
                queue,
                counts,
                oldest_parked_age_secs,
            } => self.set_queue_gauges(namespace, queue, counts, *oldest_parked_age_secs),
        }
    }

    fn set_queue_gauges(&self, namespace: &str, queue: &str, counts: &Counts, oldest_age: i64) {
        self.touch_queue(namespace, queue);
        for (phase, value) in [
            (Phase::Parked, counts.parked),
            (Phase::Redriven, counts.redriven),
            (Phase::Dropped, counts.dropped),
        ] {
            self.records
                .get_or_create(&PhaseLabels {
                    namespace: namespace.into(),
                    queue: queue.into(),
                    phase: phase.as_str().into(),
                })
                .set(value);
        }
        self.oldest_parked_age
            .get_or_create(&QueueLabels {
                namespace: namespace.into(),
                queue: queue.into(),
            })
            .set(oldest_age);
    }

    /// Creates every counter series of a queue at 0, so the first parking or failure is an
    /// increase that `rate()`/`increase()` can see.
    fn touch_queue(&self, namespace: &str, queue: &str) {
        for kind in [FailureKind::Transient, FailureKind::Invalid] {
            let _ = self.parked.get_or_create(&ParkedLabels {
                namespace: namespace.into(),
                queue: queue.into(),
                failure_kind: kind.label().into(),
            });
        }
        for result in RedriveResult::ALL {
            let _ = self.redrives.get_or_create(&ResultLabels {
                namespace: namespace.into(),
                queue: queue.into(),
                result: result.label().into(),
            });
        }
        let _ = self.drops.get_or_create(&QueueLabels {
            namespace: namespace.into(),
            queue: queue.into(),
        });
    }
}
