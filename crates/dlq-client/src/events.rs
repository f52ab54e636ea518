//! Publishing an [`EventPlan`]: through kube's recorder (which aggregates repeats into one
//! series with a count), or, for Events that never repeat, straight to the API; and a storm's
//! Event series (`dlq_core::event_series`): created with its count, its count patched.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as KubeEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType as KubeEventType, Recorder, Reporter};
use kube::{Api, Client};

use dlq_core::event_series::Occurrences;
use dlq_core::events::{EventPlan, EventType};

/// The recorder's form of `plan`.
pub fn to_recorder_event(plan: &EventPlan) -> Event {
    Event {
        type_: match plan.type_ {
            EventType::Normal => KubeEventType::Normal,
            EventType::Warning => KubeEventType::Warning,
        },
        reason: plan.reason.into(),
        note: Some(plan.note.clone()),
        action: plan.action.into(),
        secondary: None,
    }
}

/// Publishes `plan` about `regarding`. A failed publish is logged, never fatal: Events are a
/// view of what happened, the record's status is the truth.
pub async fn publish(
    client: &Client,
    recorder: &Recorder,
    reporter: &Reporter,
    regarding: &ObjectReference,
    plan: &EventPlan,
) {
    let result = if plan.once {
        create_once(client, reporter, regarding, plan).await
    } else {
        recorder
            .publish(&to_recorder_event(plan), regarding)
            .await
            .map_err(|e| e.to_string())
    };
    if let Err(error) = result {
        tracing::warn!(%error, reason = plan.reason, "publishing event failed");
    }
}

/// Creates the Event directly: the recorder keeps every Event it sent for minutes to aggregate
/// repeats, which for a parking storm of 10,000 records is most of the operator's memory.
async fn create_once(
    client: &Client,
    reporter: &Reporter,
    regarding: &ObjectReference,
    plan: &EventPlan,
) -> Result<(), String> {
    create(client, reporter, regarding, plan, None)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Creates `plan` about `regarding` as one Event standing for `series` (None: a plain Event,
/// one occurrence); answers its name, which [`patch_series`] takes.
pub async fn create(
    client: &Client,
    reporter: &Reporter,
    regarding: &ObjectReference,
    plan: &EventPlan,
    series: Option<Occurrences>,
) -> Result<String, kube::Error> {
    let ns = regarding.namespace.clone().unwrap_or_default();
    let now = jiff::Timestamp::now();
    let event = KubeEvent {
        metadata: ObjectMeta {
            // As the recorder names them: the object's name and the time, unique enough.
            name: Some(format!(
                "{}.{:x}",
                regarding.name.clone().unwrap_or_default(),
                now.as_nanosecond()
            )),
            namespace: Some(ns.clone()),
            ..Default::default()
        },
        event_time: Some(MicroTime(now)),
        series: series.map(event_series),
        type_: Some(
            match plan.type_ {
                EventType::Normal => "Normal",
                EventType::Warning => "Warning",
            }
            .into(),
        ),
        reason: Some(plan.reason.into()),
        action: Some(plan.action.into()),
        note: Some(plan.note.clone()),
        regarding: Some(regarding.clone()),
        reporting_controller: Some(reporter.controller.clone()),
        reporting_instance: Some(
            reporter
                .instance
                .clone()
                .unwrap_or_else(|| reporter.controller.clone()),
        ),
        ..Default::default()
    };
    let created = Api::<KubeEvent>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &event)
        .await?;
    Ok(created.metadata.name.unwrap_or_default())
}

/// Merge-patches the series of Event `name` (its count and last observation), as client-go's
/// events recorder does: the series is the one part of an Event the apiserver lets change.
pub async fn patch_series(
    client: &Client,
    namespace: &str,
    name: &str,
    series: Occurrences,
) -> Result<(), kube::Error> {
    let patch = serde_json::json!({ "series": event_series(series) });
    Api::<KubeEvent>::namespaced(client.clone(), namespace)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map(|_| ())
}

/// The API's form of `series`.
fn event_series(series: Occurrences) -> EventSeries {
    EventSeries {
        count: i32::try_from(series.count).unwrap_or(i32::MAX),
        last_observed_time: MicroTime(series.last_observed),
    }
}
