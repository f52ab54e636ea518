//! Publishing an [`EventPlan`]: through kube's recorder (which aggregates repeats into one
//! series with a count), or, for Events that never repeat, straight to the API.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as KubeEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::events::{Event, EventType as KubeEventType, Recorder, Reporter};
use kube::{Api, Client};

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
    Api::<KubeEvent>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &event)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}
