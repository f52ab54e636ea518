//! The read-only pages: failure groups and queues, records (live; a group's page is its
//! filter), one record. maud escapes every interpolated
//! value, so a payload or reason holding markup renders as text.

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use k8s_openapi::api::authorization::v1::SelfSubjectAccessReview;
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use maud::{Markup, html};
use serde_json::json;

use dlq_core::api::{DeadLetter, DeadLetterQueue, LABEL_QUEUE, Phase};
use dlq_core::group::LABEL_GROUP;
use dlq_core::groups::DeadLetterGroup;
use dlq_core::mask::mask_cards;

use super::frame::{failure, layout};
use super::state::Ui;
use super::view::{self, Filter, PAGE, Payload, Snapshot};
use crate::inspect::{human_age, queue_masks, recent_events};
use crate::lookup;
use crate::search::Masks;

/// Whether the user may patch records in `ns` (a SelfSubjectAccessReview): buttons are shown
/// only to those who may use them; the apiserver still decides every write. Answers are kept
/// 15 s, so the list's refresh every 2 s does not ask the apiserver each time.
pub async fn can_decide(ui: &Ui, ns: &str) -> bool {
    const KEEP: std::time::Duration = std::time::Duration::from_secs(15);
    let cached = ui.access.lock().ok().and_then(|c| c.get(ns).copied());
    if let Some((at, allowed)) = cached
        && at.elapsed() < KEEP
    {
        return allowed;
    }
    let allowed = review_access(ui, ns).await;
    if let Ok(mut c) = ui.access.lock() {
        c.insert(ns.to_string(), (std::time::Instant::now(), allowed));
    }
    allowed
}

async fn review_access(ui: &Ui, ns: &str) -> bool {
    let api: Api<SelfSubjectAccessReview> = Api::all(ui.client.clone());
    let Ok(review) = serde_json::from_value::<SelfSubjectAccessReview>(json!({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {
            "group": "dlq.dev", "resource": "deadletters", "verb": "patch", "namespace": ns}}
    })) else {
        return false;
    };
    api.create(&PostParams::default(), &review)
        .await
        .ok()
        .and_then(|r| r.status)
        .is_some_and(|s| s.allowed)
}

/// `/`: each queue with its counts, readiness, oldest parked record and parkings per hour.
pub async fn queues(State(ui): State<Arc<Ui>>) -> Response {
    let api: Api<DeadLetterQueue> = match &ui.namespace {
        Some(ns) => Api::namespaced(ui.client.clone(), ns),
        None => Api::all(ui.client.clone()),
    };
    let queues = match api.list(&ListParams::default()).await {
        Ok(l) => l.items,
        Err(e) => return failure(&ui, StatusCode::BAD_GATEWAY, &e.to_string()),
    };
    let (records, error) = ui.records.all().await;
    let now = jiff::Timestamp::now();
    let tallies = view::tallies(&records, now);
    let empty = view::Tally::default();
    let groups = failure_groups(&ui).await;
    let awaiting = super::approvals::awaiting(&ui).await;
    let body = html! {
        (awaiting)
        (groups)
        h1 { "Queues" }
        @if let Some(e) = &error { p.error { (e) } }
        table #queues {
            thead { tr { th { "Namespace" } th { "Queue" } th { "Ready" } th { "Parked transient" }
                th { "Parked invalid" } th { "Redriven" } th { "Dropped" } th { "Oldest parked" }
                th { "Parked last hour" } th title="dead messages still in the source's broker beyond the records" { "Waiting in the broker" } } }
            tbody {
                @for q in &queues {
                    @let ns = q.namespace().unwrap_or_default();
                    @let t = tallies.get(&(ns.clone(), q.name_any())).unwrap_or(&empty);
                    @let ready = q.status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
                    tr {
                        td { (ns) }
                        td { a href=(format!("/records?queue={}", q.name_any())) { (q.name_any()) } }
                        td title=(ready.map(|c| c.message.as_str()).unwrap_or_default()) {
                            (ready.map(|c| c.status.as_str()).unwrap_or("Unknown")) }
                        td.num { (t.parked_transient) } td.num { (t.parked_invalid) }
                        td.num { (t.redriven) } td.num { (t.dropped) }
                        td { (t.oldest_parked.map_or("-".into(), |o| human_age(now.duration_since(o).as_secs()))) }
                        td.num { (t.parked_last_hour) }
                        td.num.waiting { (crate::inspect::waiting(q)) }
                    }
                }
            }
        }
    };
    layout(&ui, "Queues", body)
}

/// The landing page's first part: the failure groups, most parked first, each a link to its
/// page (the records of the group, where "Review selection" works as on any filter).
async fn failure_groups(ui: &Ui) -> Markup {
    let api: Api<DeadLetterGroup> = match &ui.namespace {
        Some(ns) => Api::namespaced(ui.client.clone(), ns),
        None => Api::all(ui.client.clone()),
    };
    let (mut groups, error) = match api.list(&ListParams::default()).await {
        Ok(l) => (l.items, None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    crate::groups_cmd::sort(&mut groups);
    html! {
        h1 { "Failure groups" }
        @if let Some(e) = &error { p.error { "failure groups unavailable: " (e) } }
        @if groups.is_empty() && error.is_none() { p { "No failure groups." } }
        @else {
            table #groups {
                thead { tr { th { "Namespace" } th { "Queue" } th { "Template" } th { "Kind" }
                    th { "Version" } th { "Parked" }
                    th title="estimated: the queue's backlog times the group's share of its newest records" { "Waiting in the broker" }
                    th { "Rate/min" } th { "Tier" } th { "Acknowledged" } } }
                tbody {
                    @for g in &groups {
                        @let s = g.status.clone().unwrap_or_default();
                        @let label = |k: &str| g.labels().get(k).cloned().unwrap_or_default();
                        @let (queue, fingerprint) = (label(LABEL_QUEUE), label(LABEL_GROUP));
                        tr data-group=(fingerprint) {
                            td { (g.namespace().unwrap_or_default()) }
                            td { (queue) }
                            td { a.group href=(format!("/records?queue={queue}&group={fingerprint}")) { (crate::groups_cmd::visible(&s.template)) } }
                            td.word { (s.failure_kind.map_or("-", |k| k.as_str())) }
                            td.word { (s.service_version.as_deref().unwrap_or("-")) }
                            td.num { (s.parked) }
                            td.num.waiting { (s.backlog.as_ref().map_or_else(|| "-".into(), |b| b.shown())) }
                            td.num { (s.rate_per_minute) }
                            td { (s.tier.as_str()) }
                            td { (g.spec.acknowledged.as_ref().map_or("-", |a| a.by.as_str())) }
                        }
                    }
                }
            }
        }
    }
}

/// A group's page (the records filtered by one group): its history drawn as a chart; None
/// for any other filter, or while the group has no object (the chart says nothing then).
async fn group_history(ui: &Ui, f: &Filter) -> Option<Markup> {
    if f.group.is_empty() {
        return None;
    }
    let api: Api<DeadLetterGroup> = match &ui.namespace {
        Some(ns) => Api::namespaced(ui.client.clone(), ns),
        None => Api::all(ui.client.clone()),
    };
    let mut labels = format!("{LABEL_GROUP}={}", f.group);
    if !f.queue.is_empty() {
        labels.push_str(&format!(",{LABEL_QUEUE}={}", f.queue));
    }
    let lp = ListParams::default().labels(&labels);
    let group = match api.list(&lp).await {
        Ok(list) => list.items.into_iter().next()?,
        Err(e) => return Some(html! { p.error { "the group's history is unavailable: " (e) } }),
    };
    let status = group.status.clone().unwrap_or_default();
    Some(super::chart::group_chart(&status, jiff::Timestamp::now()))
}

/// The filter form, filled with what was asked.
fn filter_form(f: &Filter) -> Markup {
    html! {
        form #filters method="get" action="/records" {
            label { "Queue " input name="queue" value=(f.queue); }
            label { "Kind " select name="kind" {
                @for k in ["", "Transient", "Invalid"] { option value=(k) selected[f.kind.eq_ignore_ascii_case(k)] { (if k.is_empty() { "any" } else { k }) } }
            } }
            label { "Phase " select name="phase" {
                @for p in ["Parked", "Redriven", "Dropped", ""] { option value=(p) selected[f.phase.eq_ignore_ascii_case(p)] { (if p.is_empty() { "any" } else { p }) } }
            } }
            label { "Reason contains " input name="reason" value=(f.reason); }
            label { "Service version " input name="version" value=(f.version); }
            label { "Failed since " input name="since" placeholder="2h or RFC 3339" value=(f.since); }
            label { "until " input name="until" value=(f.until); }
            label { "Group " input name="group" placeholder="fingerprint" value=(f.group); }
            (search_inputs(f))
            button #apply type="submit" { "Filter" }
        }
    }
}

/// The search box (`ls --grep`) and one `PATH=VALUE` input per clause plus an empty one (`ls
/// --where`): a GET form, so the search is the URL's query string, to bookmark or share.
fn search_inputs(f: &Filter) -> Markup {
    let grep_max = crate::search::MAX_GREP_LEN;
    let where_max = crate::search::MAX_PATH_LEN + 1 + crate::search::MAX_VALUE_LEN;
    html! {
        label { "Search " input #grep type="search" name="grep" maxlength=(grep_max)
            placeholder="text in the id, reason, headers or payload" value=(f.grep); }
        @for w in f.wheres.iter().map(String::as_str).chain([""]) {
            label { "Where " input class="where" name="where" maxlength=(where_max)
                placeholder="payload.customer=cus_42" value=(w); }
        }
    }
}

/// `/records`: filters, then the live part (counts, table, pages), refreshed every 2 s.
pub async fn records(State(ui): State<Arc<Ui>>, RawQuery(q): RawQuery) -> Response {
    let f = Filter::from_pairs(&view::pairs(q.as_deref()));
    let live = live_part(&ui, &f).await;
    let chart = group_history(&ui, &f).await;
    let body = html! {
        h1 { "Records" }
        @if let Some(chart) = chart { (chart) }
        (filter_form(&f))
        form #selection method="get" action="/review" {
            div #live hx-get=(format!("/records/live?{}", f.query(f.page))) hx-trigger="every 2s" hx-swap="innerHTML" {
                (live)
            }
        }
    };
    layout(&ui, "Records", body)
}

/// `/records/live`: the part htmx swaps in.
pub async fn records_live(State(ui): State<Arc<Ui>>, RawQuery(q): RawQuery) -> Response {
    let f = Filter::from_pairs(&view::pairs(q.as_deref()));
    Html(live_part(&ui, &f).await.into_string()).into_response()
}

/// Counts, the page of records, page links and (for deciders) the selection button.
async fn live_part(ui: &Ui, f: &Filter) -> Markup {
    let (all, error) = ui.records.all().await;
    let masks = match f.search() {
        Ok(s) if s.reads_payload() => queue_masks(&ui.client, ui.namespace.as_deref()).await,
        _ => Masks::default(),
    };
    let found = match f.apply(&all, &masks) {
        Ok(m) => m,
        Err(e) => return html! { p.error #search-error { (e) } },
    };
    let matched = &found.records;
    let pages = matched.len().div_ceil(PAGE).max(1);
    let page = f.page.min(pages);
    let shown = &matched[(page - 1) * PAGE..(page * PAGE).min(matched.len())];
    let namespaces: BTreeSet<String> = shown.iter().filter_map(|(r, _)| r.namespace()).collect();
    let mut deciding = BTreeSet::new();
    for ns in namespaces {
        if can_decide(ui, &ns).await {
            deciding.insert(ns);
        }
    }
    let searching = f.replayable().is_err();
    html! {
        @if let Some(e) = &error { p.error { (e) } }
        p #count { (matched.len()) " records match · page " (page) " of " (pages) }
        @if let Some(note) = found.unsearched.describe() { p.muted #unsearched { (note) } }
        table #records {
            thead { tr { th {} th { "Job" } th { "#" } th { "Phase" } th { "Intent" } th { "By" }
                th { "Reason" } th { "Queue" } th { "Kind" } th { "Age" }
                @if searching { th { "Match" } } } }
            tbody { @for (r, hit) in shown { (row(r, deciding.contains(&r.namespace().unwrap_or_default()), hit.as_deref())) } }
        }
        nav.pages {
            @if page > 1 { a href=(format!("/records?{}", f.query(page - 1))) { "← newer" } }
            @if page < pages { a #next href=(format!("/records?{}", f.query(page + 1))) { "older →" } }
        }
        @if !deciding.is_empty() {
            button #review type="submit" { "Review selection…" }
            // A DeadLetterReplay cannot select by a search: offered only for plain filters.
            @if !searching {
                " "
                a #replay-link href=(format!("/replay?{}", f.query(1))) { "Replay everything this filter matches (runbook)…" }
            }
        }
    }
}

/// One table row; a decider gets a checkbox holding the snapshot (name + resourceVersion).
/// `hx-preserve` keeps a ticked box across refreshes until the record changes: the id carries
/// the resourceVersion, so a changed record comes back unticked.
fn row(r: &DeadLetter, deciding: bool, hit: Option<&str>) -> Markup {
    let snap = Snapshot::of(r);
    let s = &r.spec;
    let age = r
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or("-".into(), |t| {
            human_age(jiff::Timestamp::now().duration_since(t.0).as_secs())
        });
    html! {
        tr data-name=(snap.name) {
            td { @if deciding && r.phase() == Phase::Parked {
                input type="checkbox" name="sel" value=(snap.encode()) hx-preserve="true"
                    id=(format!("sel-{}-{}-{}", snap.namespace, snap.name, snap.version));
            } }
            td { a href=(format!("/r/{}/{}", snap.namespace, snap.name)) { (s.job.id) } }
            td.num { (s.deliveries) }
            td class=(format!("phase {}", r.phase().as_str().to_lowercase())) { (r.phase().as_str()) }
            td { (s.intent.as_ref().map_or("-".into(), |i| mask_cards(&i.state))) }
            td { (s.by.as_deref().unwrap_or("-")) }
            td.reason { (mask_cards(&s.reason)) }
            td { (s.queue) }
            td { (s.failure_kind.label()) }
            td { (age) }
            @if let Some(hit) = hit { td.hit { (hit) } }
        }
    }
}

/// `/r/{ns}/{name}`: one record in full, its other cycles, Events, and the decision form.
pub async fn record(
    State(ui): State<Arc<Ui>>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    let api: Api<DeadLetter> = Api::namespaced(ui.client.clone(), &ns);
    let r = match api.get(&name).await {
        Ok(r) => r,
        Err(kube::Error::Api(s)) => {
            return failure(
                &ui,
                StatusCode::from_u16(s.code).unwrap_or(StatusCode::BAD_GATEWAY),
                &s.message,
            );
        }
        Err(e) => return failure(&ui, StatusCode::BAD_GATEWAY, &e.to_string()),
    };
    let cycles = lookup::cycles(&ui.client, &ns, &r.spec.job.id)
        .await
        .unwrap_or_default();
    let events = recent_events(&ui.client, &ns, &name).await;
    let mask = crate::inspect::mask_paths(&ui.client, &ns, &r.spec.queue).await;
    let decide = r.phase() == Phase::Parked && can_decide(&ui, &ns).await;
    let body = html! {
        h1 { "Job " (r.spec.job.id) }
        (facts(&r))
        @if decide { (super::act::decision_form(&ui, &[Snapshot::of(&r)])) }
        h2 { "Payload" }
        @if let Some(b) = r.spec.job.stored_body() { (stored_body(b, &r.spec.job.id)) } @else { (payload(&r, &mask)) }
        @if r.spec.job.sealed.is_some() || r.spec.job.stored_body().is_some() {
            // Through the reveal API as the person running the page: refused without the role
            // dlq-payload-reader, an Event and an audit log entry when allowed.
            button #reveal type="button" hx-get=(format!("/r/{ns}/{name}/reveal"))
                hx-target="#revealed" hx-swap="innerHTML" { "Reveal" }
            div #revealed {}
        }
        h2 { "Headers" }
        @if r.spec.job.sealed.is_some() { p.muted #headers { "sealed" } }
        @else { table #headers { @for (k, v) in &r.spec.job.headers { tr { th { (mask_cards(k)) } td { (mask_cards(v)) } } } } }
        h2 { "Every cycle of this job" }
        table #cycles { @for c in &cycles { tr {
            td { a href=(format!("/r/{}/{}", ns, c.name_any())) { "cycle " (c.spec.cycle) } }
            td { (c.phase().as_str()) } td { (c.spec.failed_at.0) } td { (mask_cards(&c.spec.reason)) } } } }
        h2 { "Conditions" }
        table #conditions { @for c in r.status.iter().flat_map(|s| &s.conditions) { tr {
            td { (c.type_) } td { (c.status) } td { (c.reason) } td { (c.message) } td { (c.last_transition_time.0) } } } }
        h2 { "Events" }
        @match &events {
            Ok(evs) => { ol #events { @for e in evs { li {
                (e.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default()) " "
                b { (e.type_.as_deref().unwrap_or_default()) " " (e.reason.as_deref().unwrap_or_default()) } " "
                (e.note.as_deref().unwrap_or_default()) } } } }
            Err(e) => { p.error { "Events: " (e) } }
        }
    };
    layout(&ui, &r.spec.job.id, body)
}

/// `/r/{ns}/{name}/reveal`: the record's payload and headers through the reveal API (masked),
/// as the part htmx swaps in; a refusal says why.
pub async fn reveal(
    State(ui): State<Arc<Ui>>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    let fetched = crate::reveal::fetch(&ui.client, &ns, &name, false).await;
    Html(revealed_part(fetched).into_string()).into_response()
}

/// What the Reveal button swaps in: the payload and headers as the API answered them (masked;
/// card numbers masked again, which changes nothing already masked), or why it was refused.
fn revealed_part(fetched: Result<crate::reveal::Revealed, crate::session::CliError>) -> Markup {
    match fetched {
        Ok(revealed) if revealed.body.is_some() => {
            let headers = revealed.headers.clone();
            let (kind, text) = match (
                revealed.body_head,
                revealed.body_head_base64,
                revealed.body_head_withheld,
            ) {
                (Some(text), _, _) => ("the body's first KiB, text, revealed".to_string(), text),
                (None, Some(b64), _) => ("the body's first KiB, base64, revealed".to_string(), b64),
                (None, None, why) => (
                    "the body's first KiB is not shown".to_string(),
                    why.unwrap_or_default(),
                ),
            };
            html! {
                p.muted { (kind) } pre #revealed-payload { (mask_cards(&text)) }
                table #revealed-headers { @for (k, v) in &headers { tr { th { (mask_cards(k)) } td { (mask_cards(v)) } } } }
            }
        }
        Ok(revealed) => {
            let job = revealed.into_job(&dlq_core::api::Job::default());
            let (kind, text) = match view::payload(&job, &[]) {
                Payload::Json(t) => ("JSON, revealed", t),
                Payload::Text(t) => ("text, revealed", t),
                Payload::Hex(t) => ("binary, hex, revealed", t),
            };
            html! {
                p.muted { (kind) } pre #revealed-payload { (text) }
                table #revealed-headers { @for (k, v) in &job.headers { tr { th { (mask_cards(k)) } td { (mask_cards(v)) } } } }
            }
        }
        Err(e) => html! { p.error #reveal-refused { (e) } },
    }
}

/// The record's facts as a definition list.
fn facts(r: &DeadLetter) -> Markup {
    let s = &r.spec;
    let st = r.status.as_ref();
    html! {
        dl #facts {
            dt { "Record" } dd { (r.name_any()) " (resourceVersion " (r.resource_version().unwrap_or_default()) ")" }
            dt { "Queue" } dd { (s.queue) }
            dt { "Phase" } dd #phase { (r.phase().as_str()) }
            dt { "Cycle" } dd { (s.cycle) }
            dt { "Failure kind" } dd { (s.failure_kind.label()) }
            dt { "Deliveries" } dd { (s.deliveries) }
            dt { "Reason" } dd #reason { (mask_cards(&s.reason)) }
            dt { "Failed at" } dd { (s.failed_at.0) }
            dt { "Service version" } dd { (s.service_version.as_deref().unwrap_or("-")) }
            dt { "Intent when parked" } dd { (s.intent.as_ref().map_or("-".into(), |i| mask_cards(&format!("{} was {}", i.id, i.state)))) }
            dt { "Decision" } dd #decision { (match (&s.action, &s.by) {
                (Some(a), Some(by)) => format!("{a:?} by {by}").to_lowercase(), _ => "none yet".into() }) }
            dt { "Note" } dd { (s.note.as_deref().unwrap_or("-")) }
            dt { "Resolved" } dd { (st.and_then(|s| s.resolved_by.clone().zip(s.resolved_at.clone()))
                .map_or("-".into(), |(by, at)| format!("by {by} at {}", at.0))) }
        }
    }
}

/// A body kept in the queue's store: its size, digest and reference (its bytes are read only
/// through the reveal API: the Reveal button, or `kubectl dlq show --body`).
fn stored_body(b: &dlq_core::api::BodyRef, job: &str) -> Markup {
    let size = b.size.max(0).unsigned_abs();
    html! {
        p.muted { "kept in the queue's body store" }
        dl #body {
            dt { "Size" } dd #body-size { (crate::inspect::human_bytes(size)) " (" (size) " bytes)" }
            dt { "SHA-256" } dd #body-sha256 { (b.sha256) }
            dt { "Reference" } dd #body-ref { (b.reference) }
            @if let Some(r) = &b.recipient { dt { "Sealed to" } dd { (r) } }
            dt { "Download" } dd { code { "kubectl dlq show " (job) " --body > FILE" } }
        }
    }
}

/// The payload as it reads best; always as text, never as markup.
fn payload(r: &DeadLetter, mask: &[String]) -> Markup {
    let (kind, text) = match view::payload(&r.spec.job, mask) {
        Payload::Json(t) => ("JSON", t),
        Payload::Text(t) => ("text", t),
        Payload::Hex(t) => ("binary, hex", t),
    };
    html! { p.muted { (kind) } pre #payload { (text) } }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reveal::Revealed;
    use crate::session::CliError;

    #[test]
    fn the_revealed_part_shows_the_masked_payload_and_headers_or_the_refusal() {
        let revealed = Revealed {
            payload: Some(r#"{"pan":"401288******1881","note":"<b>hi</b>"}"#.into()),
            headers: [("x-card".to_string(), "401288******1881".to_string())].into(),
            view: "masked".into(),
            ..Revealed::default()
        };
        let part = revealed_part(Ok(revealed)).into_string();
        assert!(part.contains("JSON, revealed"), "{part}");
        assert!(part.contains(r#"<pre id="revealed-payload">"#), "{part}");
        assert!(
            part.contains("<th>x-card</th><td>401288******1881</td>"),
            "{part}"
        );
        // The payload is text, never markup.
        assert!(
            part.contains("&lt;b&gt;hi&lt;/b&gt;") && !part.contains("<b>hi"),
            "{part}"
        );
        let refused = revealed_part(Err(CliError::Refused(
            "revealing payloads needs the dlq-payload-reader role <bob>".into(),
        )))
        .into_string();
        assert_eq!(
            refused,
            r#"<p class="error" id="reveal-refused">revealing payloads needs the dlq-payload-reader role &lt;bob&gt;</p>"#
        );
    }
}
