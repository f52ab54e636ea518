//! The page's second pair of eyes: the replays waiting for approval, each with an Approve button
//! for those who may give one (not the replay's author, not twice). The approval is the same
//! patch `kubectl dlq approve` sends, in the page user's name; the apiserver's admission policy
//! decides, and its refusal is shown as it is.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::LOCATION;
use axum::response::{IntoResponse, Response};
use jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use maud::{Markup, html};
use serde_json::json;

use dlq_core::replay::{DeadLetterReplay, ReplayPhase};

use super::frame::failure;
use super::guard::csrf_ok;
use super::state::Ui;
use super::view;

/// The landing page's part: replays in `AwaitingApproval`, none when nothing waits.
pub async fn awaiting(ui: &Ui) -> Markup {
    let api: Api<DeadLetterReplay> = match &ui.namespace {
        Some(ns) => Api::namespaced(ui.client.clone(), ns),
        None => Api::all(ui.client.clone()),
    };
    let waiting: Vec<DeadLetterReplay> = match api.list(&ListParams::default()).await {
        Ok(l) => l
            .items
            .into_iter()
            .filter(|r| r.phase() == ReplayPhase::AwaitingApproval)
            .collect(),
        Err(e) => return html! { p.error { "replays unavailable: " (e) } },
    };
    if waiting.is_empty() {
        return html! {};
    }
    html! {
        h1 { "Replays awaiting approval" }
        table #awaiting {
            thead { tr { th { "Namespace" } th { "Replay" } th { "Queue" } th { "Action" }
                th { "By" } th { "Approvals" } th { "Why it waits" } th {} } }
            tbody { @for r in &waiting { (row(ui, r)) } }
        }
    }
}

fn row(ui: &Ui, r: &DeadLetterReplay) -> Markup {
    let ns = r.namespace().unwrap_or_default();
    let approval = r.status.as_ref().and_then(|s| s.approval.clone());
    let given: Vec<&str> = r.spec.approvals.iter().map(|a| a.by.as_str()).collect();
    let why = r
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.message.clone())
        .unwrap_or_default();
    let own = r.spec.by.trim() == ui.user;
    let done = given.contains(&ui.user.as_str());
    html! {
        tr {
            td.word { (ns) } td.word { (r.name_any()) } td.word { (r.spec.queue) }
            td.word { (action(r)) } td.word { (r.spec.by) }
            td {
                (given.len()) " of " (approval.map_or(0, |a| a.required))
                @if !given.is_empty() { " (" (given.join(", ")) ")" }
            }
            td.reason { (why) }
            td {
                @if own { span.muted { "yours: someone else approves" } }
                @else if done { span.muted { "approved by you" } }
                @else {
                    form.approve method="post" action="/replay/approve" {
                        input type="hidden" name="csrf" value=(ui.csrf);
                        input type="hidden" name="ns" value=(ns);
                        input type="hidden" name="name" value=(r.name_any());
                        input type="text" name="note" placeholder="note (ticket, what you checked)" maxlength="1024";
                        button type="submit" { "Approve" }
                    }
                }
            }
        }
    }
}

fn action(r: &DeadLetterReplay) -> &'static str {
    match r.spec.action() {
        dlq_core::api::Action::Redrive => "redrive",
        dlq_core::api::Action::Drop => "drop",
    }
}

/// `POST /replay/approve`: the page user's approval, guarded by the replay's resourceVersion;
/// back to the landing page, or the apiserver's refusal.
pub async fn approve(State(ui): State<Arc<Ui>>, body: Bytes) -> Response {
    let form = view::pairs(std::str::from_utf8(&body).ok());
    if !csrf_ok(&ui, &form) {
        return failure(&ui, StatusCode::FORBIDDEN, "missing or wrong CSRF token");
    }
    let (Some(ns), Some(name)) = (view::value(&form, "ns"), view::value(&form, "name")) else {
        return failure(&ui, StatusCode::BAD_REQUEST, "which replay?");
    };
    let api: Api<DeadLetterReplay> = Api::namespaced(ui.client.clone(), ns);
    let replay = match api.get_opt(name).await {
        Ok(Some(r)) => r,
        Ok(None) => return failure(&ui, StatusCode::NOT_FOUND, &format!("no replay {name}")),
        Err(e) => return failure(&ui, StatusCode::BAD_GATEWAY, &e.to_string()),
    };
    let note = view::value(&form, "note").map(str::to_string);
    let approvals = match crate::approve::approved(&replay, &ui.user, note, Timestamp::now()) {
        Ok(a) => a,
        Err(e) => return failure(&ui, StatusCode::CONFLICT, &e.to_string()),
    };
    let patch = Patch::Merge(json!({
        "metadata": {"resourceVersion": replay.resource_version()},
        "spec": {"approvals": approvals},
    }));
    match api.patch(name, &PatchParams::default(), &patch).await {
        Ok(_) => (StatusCode::SEE_OTHER, [(LOCATION, "/")]).into_response(),
        Err(e) => failure(&ui, StatusCode::FORBIDDEN, &e.to_string()),
    }
}
