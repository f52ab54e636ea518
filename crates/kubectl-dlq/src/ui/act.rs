//! Decisions from the page: on one record or an explicit selection, each carried out only on
//! the version the person saw (resourceVersion precondition), signed with who they are.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::Response;
use kube::Api;
use maud::{Markup, html};

use dlq_core::api::{Action, DeadLetter};

use super::frame::{failure, layout};
use super::guard::csrf_ok;
use super::state::Ui;
use super::view::{self, Snapshot};
use crate::decision::sign_at;

/// Above this many records, the person types the count to confirm (no "Delete All" by reflex).
pub const CONFIRM_ABOVE: usize = 10;

/// The form that signs a decision on exactly these snapshots.
pub fn decision_form(ui: &Ui, snaps: &[Snapshot]) -> Markup {
    html! {
        form #decide method="post" action="/decide" {
            input type="hidden" name="csrf" value=(ui.csrf);
            @for s in snaps { input type="hidden" name="sel" value=(s.encode()); }
            label { "Note " input #note name="note" placeholder="why (ticket, incident)"; }
            @if snaps.len() > CONFIRM_ABOVE {
                label { "Type " b { (snaps.len()) } " to confirm " input #confirm name="confirm" autocomplete="off"; }
            }
            button #redrive type="submit" name="action" value="redrive" { "Redrive " (snaps.len()) }
            button #drop type="submit" name="action" value="drop" { "Drop " (snaps.len()) }
            p.muted { "Signed as " (ui.user) ". A record that changed since you saw it is refused." }
        }
    }
}

/// The snapshots in a query or form; malformed entries are ignored (they name no record).
fn snapshots(pairs: &[(String, String)]) -> Vec<Snapshot> {
    pairs
        .iter()
        .filter(|(k, _)| k == "sel")
        .filter_map(|(_, v)| Snapshot::parse(v))
        .collect()
}

/// `/review?sel=…`: the selection exactly as ticked, with its current state, before deciding.
pub async fn review(State(ui): State<Arc<Ui>>, RawQuery(q): RawQuery) -> Response {
    let snaps = snapshots(&view::pairs(q.as_deref()));
    if snaps.is_empty() {
        return failure(&ui, StatusCode::BAD_REQUEST, "nothing selected");
    }
    let body = html! {
        h1 { "Decide on " (snaps.len()) " records" }
        table #selected {
            thead { tr { th { "Record" } th { "Job" } th { "Phase now" } th { "Reason" } th { "Seen at version" } } }
            tbody { @for s in &snaps {
                @let now = ui.records.get(&s.namespace, &s.name);
                tr {
                    td { a href=(format!("/r/{}/{}", s.namespace, s.name)) { (s.name) } }
                    td { (now.as_ref().map(|r| r.spec.job.id.as_str()).unwrap_or("?")) }
                    td { (now.as_ref().map_or("gone", |r| r.phase().as_str())) }
                    td.reason { (now.as_ref().map(|r| r.spec.reason.as_str()).unwrap_or_default()) }
                    td { (s.version) }
                }
            } }
        }
        (decision_form(&ui, &snaps))
    };
    layout(&ui, "Review selection", body)
}

/// One line of the outcome.
struct Outcome {
    snap: Snapshot,
    result: Result<(), (u16, String)>,
}

/// `POST /decide`: CSRF, then each snapshot signed in turn; refusals in the apiserver's words.
pub async fn decide(State(ui): State<Arc<Ui>>, body: Bytes) -> Response {
    let form = view::pairs(std::str::from_utf8(&body).ok());
    if !csrf_ok(&ui, &form) {
        return failure(&ui, StatusCode::FORBIDDEN, "missing or wrong CSRF token");
    }
    let action = match view::value(&form, "action") {
        Some("redrive") => Action::Redrive,
        Some("drop") => Action::Drop,
        _ => {
            return failure(
                &ui,
                StatusCode::BAD_REQUEST,
                "action must be redrive or drop",
            );
        }
    };
    let snaps = snapshots(&form);
    if snaps.is_empty() {
        return failure(&ui, StatusCode::BAD_REQUEST, "nothing selected");
    }
    if snaps.len() > CONFIRM_ABOVE
        && view::value(&form, "confirm") != Some(&snaps.len().to_string())
    {
        return failure(
            &ui,
            StatusCode::BAD_REQUEST,
            &format!("type {} to confirm", snaps.len()),
        );
    }
    let note = view::value(&form, "note");
    let mut outcomes = Vec::new();
    for snap in snaps {
        let api: Api<DeadLetter> = Api::namespaced(ui.client.clone(), &snap.namespace);
        let result = match sign_at(&api, &snap.name, &snap.version, action, &ui.user, note).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) => Err((s.code, s.message)),
            Err(e) => Err((502, e.to_string())),
        };
        outcomes.push(Outcome { snap, result });
    }
    outcome_page(&ui, action, &outcomes)
}

/// What was signed and what was refused; 403 when the apiserver forbade every one.
fn outcome_page(ui: &Ui, action: Action, outcomes: &[Outcome]) -> Response {
    let verb = format!("{action:?}").to_lowercase();
    let signed = outcomes.iter().filter(|o| o.result.is_ok()).count();
    let body = html! {
        h1 { (verb) ": " (signed) " of " (outcomes.len()) " signed by " (ui.user) }
        table #outcomes { tbody { @for o in outcomes { tr {
            td { a href=(format!("/r/{}/{}", o.snap.namespace, o.snap.name)) { (o.snap.name) } }
            @match &o.result {
                Ok(()) => { td.signed { "signed" } }
                Err((_, msg)) => { td.refused { "refused: " (msg) } }
            }
        } } } }
        p { a href="/records" { "Back to records" } " — the operator carries signed decisions out; the records page shows them resolve." }
    };
    let mut r = layout(ui, "Decided", body);
    if signed == 0 && outcomes.iter().all(|o| matches!(o.result, Err((403, _)))) {
        *r.status_mut() = StatusCode::FORBIDDEN;
    }
    r
}
