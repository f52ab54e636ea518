//! Bulk replay from the page, as a DeadLetterReplay pinned to the reviewed records
//! (`runbook::run_replay`, the same as `kubectl dlq redrive --queue`): the filter's dry-run
//! count first, the count typed to confirm above a threshold, a rate, live progress, and Stop
//! (the replay's `spec.stop`: the operator withdraws the decisions not carried out yet).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::http::header::LOCATION;
use axum::response::{Html, IntoResponse, Response};
use kube::Api;
use maud::{Markup, html};

use dlq_core::api::{DeadLetter, DeadLetterQueue};
use dlq_core::replay;

use super::act::CONFIRM_ABOVE;
use super::frame::{failure, layout};
use super::guard::csrf_ok;
use super::state::{Running, Ui};
use super::view::{self, Filter};
use crate::runbook::{Control, Pace, ReplayPlan, parse_rate, select_records};

/// The runbook's stop bounds, as the CLI's defaults.
fn pace(rate: f64) -> Pace {
    Pace {
        rate: Some(rate),
        max: None,
        dry_run: false,
        max_failure_ratio: 0.2,
        window: 20,
        max_new_parked: 10,
        settle_timeout: 60,
        standing: false,
        canary: None,
        observe: None,
    }
}

/// The namespace and queue a replay runs on: the runbook works one queue at a time.
fn target(ui: &Ui, f: &Filter) -> Result<(String, String), String> {
    let ns = ui
        .namespace
        .clone()
        .ok_or("a replay runs in one namespace: start `kubectl dlq ui -n NS`")?;
    if f.queue.is_empty() {
        return Err("a replay runs on one queue: filter by queue first".into());
    }
    f.replayable()?;
    Ok((ns, f.queue.clone()))
}

/// `/replay?<filter>`: the dry run: how many parked records the runbook would take, and the form.
pub async fn dry_run(State(ui): State<Arc<Ui>>, RawQuery(q): RawQuery) -> Response {
    let f = Filter::from_pairs(&view::pairs(q.as_deref()));
    let (ns, queue) = match target(&ui, &f) {
        Ok(t) => t,
        Err(e) => return failure(&ui, StatusCode::BAD_REQUEST, &e),
    };
    let select = match f.selector() {
        Ok(s) => s,
        Err(e) => return failure(&ui, StatusCode::BAD_REQUEST, &e),
    };
    let selected = match select_records(&ui.client, &ns, &queue, &select, None).await {
        Ok(s) => s,
        Err(e) => return failure(&ui, StatusCode::BAD_GATEWAY, &e.to_string()),
    };
    let body = html! {
        h1 { "Replay: dry run" }
        p #dry-count { (selected.len()) " parked records match " code { (select.describe()) } }
        (replay_form(&ui, &f, selected.len()))
    };
    layout(&ui, "Replay", body)
}

fn replay_form(ui: &Ui, f: &Filter, count: usize) -> Markup {
    html! {
        form #replay method="post" action="/replay" {
            input type="hidden" name="csrf" value=(ui.csrf);
            @for (k, v) in view::pairs(Some(&f.query(1))) { input type="hidden" name=(k) value=(v); }
            input type="hidden" name="count" value=(count);
            label { "Rate " input #rate name="rate" value="10/s"; }
            label { "Note " input #note name="note" placeholder="why (ticket, incident)"; }
            @if count > CONFIRM_ABOVE {
                label { "Type " b { (count) } " to confirm " input #confirm name="confirm" autocomplete="off"; }
            }
            button #start type="submit" { "Redrive " (count) " at this rate" }
            p.muted { "Stops by itself when requeues fail (20%) or the queue fills again (10 new); Stop withdraws what was not carried out yet." }
        }
    }
}

/// A replay the page may start: where, on which records, how.
struct Checked {
    ns: String,
    dlq: DeadLetterQueue,
    selected: Vec<DeadLetter>,
    plan: ReplayPlan,
}

/// Refusals carry the status code and the words for the page.
type Refusal = (StatusCode, String);

/// The form's filter, rate and confirmation, against the records as they are now.
async fn check(ui: &Ui, form: &[(String, String)]) -> Result<Checked, Refusal> {
    let bad = |e: String| (StatusCode::BAD_REQUEST, e);
    let f = Filter::from_pairs(form);
    let (ns, queue) = target(ui, &f).map_err(bad)?;
    let select = f.selector().map_err(bad)?;
    let rate = parse_rate(view::value(form, "rate").unwrap_or("10/s")).map_err(bad)?;
    let gateway = |e: String| (StatusCode::BAD_GATEWAY, e);
    let queues: Api<DeadLetterQueue> = Api::namespaced(ui.client.clone(), &ns);
    let dlq = queues
        .get(&queue)
        .await
        .map_err(|e| gateway(e.to_string()))?;
    let selected = select_records(&ui.client, &ns, &queue, &select, None)
        .await
        .map_err(|e| gateway(e.to_string()))?;
    let n = selected.len().to_string();
    // The count confirmed is the count reviewed: a selection that grew meanwhile is re-reviewed.
    if view::value(form, "count") != Some(&n) {
        let why = format!("the selection changed: {n} records match now; review the dry run again");
        return Err((StatusCode::CONFLICT, why));
    }
    if selected.len() > CONFIRM_ABOVE && view::value(form, "confirm") != Some(&n) {
        return Err(bad(format!("type {n} to confirm")));
    }
    let note = view::value(form, "note")
        .map_or_else(|| format!("replay {}", select.describe()), str::to_string);
    let plan = ReplayPlan {
        select,
        pace: pace(rate),
        rate,
        by: ui.user.clone(),
        note,
        action: dlq_core::api::Action::Redrive,
    };
    Ok(Checked {
        ns,
        dlq,
        selected,
        plan,
    })
}

/// `POST /replay`: checks, then the runbook in the background; the page follows it.
pub async fn start(State(ui): State<Arc<Ui>>, body: Bytes) -> Response {
    let form = view::pairs(std::str::from_utf8(&body).ok());
    if !csrf_ok(&ui, &form) {
        return failure(&ui, StatusCode::FORBIDDEN, "missing or wrong CSRF token");
    }
    let busy = ui.replays.get();
    if busy.is_some_and(|r| r.done.lock().is_ok_and(|d| d.is_none())) {
        return failure(&ui, StatusCode::CONFLICT, "a replay is already running");
    }
    let c = match check(&ui, &form).await {
        Ok(c) => c,
        Err((code, why)) => return failure(&ui, code, &why),
    };
    let running = Running {
        control: Control::default(),
        describe: c.plan.select.describe(),
        done: Arc::default(),
    };
    if let Ok(mut current) = ui.replays.current.lock() {
        *current = Some(running.clone());
    }
    let client = ui.client.clone();
    tokio::spawn(async move {
        let control = running.control.clone();
        let result =
            crate::runbook::run_replay(&client, &c.ns, &c.dlq, &c.selected, &c.plan, control).await;
        let line = match result {
            Ok(end) => match end.warning {
                Some(w) => format!("{} (warning: {w})", end.summary),
                None => end.summary,
            },
            Err(e) => format!("replay failed: {e}"),
        };
        if let Ok(mut d) = running.done.lock() {
            *d = Some(line);
        }
    });
    (StatusCode::SEE_OTHER, [(LOCATION, "/replay/run")]).into_response()
}

/// `/replay/run`: live progress (polled) and Stop, offered only while the replay runs.
pub async fn follow(State(ui): State<Arc<Ui>>) -> Response {
    let running = ui
        .replays
        .get()
        .is_some_and(|r| r.done.lock().is_ok_and(|d| d.is_none()));
    let body = html! {
        h1 { "Replay" }
        div #progress hx-get="/replay/status" hx-trigger="every 1s" hx-swap="innerHTML" { (status_part(&ui)) }
        @if running { (stop_form(&ui)) }
    };
    layout(&ui, "Replay", body)
}

fn stop_form(ui: &Ui) -> Markup {
    html! {
        form #stop-form method="post" action="/replay/stop" {
            input type="hidden" name="csrf" value=(ui.csrf);
            button #stop type="submit" { "Stop" }
        }
    }
}

/// `/replay/status`: the part htmx swaps in.
pub async fn status(State(ui): State<Arc<Ui>>) -> Response {
    Html(status_part(&ui).into_string()).into_response()
}

/// The replay's progress: a bar (a `<progress>` element; none for a standing replay, which has
/// no total), the counts in words, and the summary once it ended, when the Stop form goes too
/// (swapped out of band: a finished replay has nothing to stop).
fn status_part(ui: &Ui) -> Markup {
    let Some(r) = ui.replays.get() else {
        return html! { p { "No replay started from this page." } };
    };
    let done = r.done.lock().ok().and_then(|d| d.clone());
    let status = r.control.status();
    let counts = status.as_ref().and_then(replay::progress_counts);
    html! {
        p { code { (r.describe) } }
        @if let Some((decided, selected)) = counts {
            progress #progress-bar max=(selected.max(1)) value=(decided) { (decided) "/" (selected) }
        }
        p #progress-line { (status.as_ref().map(replay::progress_words).unwrap_or_default()) }
        @match done {
            Some(summary) => {
                p #summary { (summary) }
                div #stop-form hx-swap-oob="true" {}
            }
            None => { p.muted { @if r.control.stop_requested() { "stopping…" } @else { "running…" } } }
        }
    }
}

/// `POST /replay/stop`: ends deciding; the runbook withdraws what was not carried out.
pub async fn stop(State(ui): State<Arc<Ui>>, body: Bytes) -> Response {
    let form = view::pairs(std::str::from_utf8(&body).ok());
    if !csrf_ok(&ui, &form) {
        return failure(&ui, StatusCode::FORBIDDEN, "missing or wrong CSRF token");
    }
    if let Some(r) = ui.replays.get() {
        r.control.request_stop();
    }
    (StatusCode::SEE_OTHER, [(LOCATION, "/replay/run")]).into_response()
}
