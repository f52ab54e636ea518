//! `kubectl dlq ui` in a real browser (Debian's headless Chromium over WebDriver) against the
//! real apiserver, operator and redis-server, acting as an impersonated user.

use std::io::Write;
use std::process::{Command, Stdio};

use dlq_client::park::{ParkRequest, park};
use dlq_core::api::{Action, DeadLetter, FailureKind, IntentSnapshot, Job, Phase};
use dlq_testenv::brokers::Redis;
use dlq_testenv::browser::{Browser, Locator};
use dlq_testenv::ui_page::UiPage as Page;
use dlq_testenv::{
    Operator, create_offline_queue, create_queue, decide, eventually, list_target, setup,
    wait_phase,
};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// The chart's user roles (templates/rbac-users.yaml), bound in one namespace.
fn grant(ns: &str, user: &str, role: &str) {
    let rules = match role {
        "decider" => {
            "- apiGroups: [dlq.dev]\n  resources: [deadletters]\n  verbs: [get, list, watch, patch, update]\n- apiGroups: [dlq.dev]\n  resources: [deadletterreplays]\n  verbs: [get, list, watch, create, patch, update]\n- apiGroups: [dlq.dev]\n  resources: [deadletterqueues]\n  verbs: [get, list, watch]\n- apiGroups: [dlq.dev]\n  resources: [deadlettergroups]\n  verbs: [get, list, watch, patch, update]\n"
        }
        _ => {
            "- apiGroups: [dlq.dev]\n  resources: [deadletters, deadletterqueues, deadletterreplays, deadlettergroups]\n  verbs: [get, list, watch]\n"
        }
    };
    let rbac = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: dlq-{role}, namespace: {ns}}}\nrules:\n{rules}---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: {user}, namespace: {ns}}}\nroleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: dlq-{role}}}\nsubjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: {user}}}]\n"
    );
    let mut apply = dlq_testenv::plane().kubectl();
    apply
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null());
    let mut child = apply.spawn().unwrap();
    child
        .stdin
        .as_mut()
        .unwrap()
        .write_all(rbac.as_bytes())
        .unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

/// Waits until `user` can list records in `ns` (RBAC takes a moment to apply).
async fn wait_for_role(ns: &str, user: &str) {
    let client = dlq_testenv::plane().client_as(user, &[]).await;
    let api: Api<DeadLetter> = Api::namespaced(client, ns);
    eventually(15, "the role to take effect", || async {
        api.list(&ListParams::default()).await.ok().map(|_| ())
    })
    .await;
}

async fn park_one(
    client: &Client,
    ns: &str,
    id: &str,
    reason: &str,
    payload: &str,
    kind: FailureKind,
) -> String {
    let mut r = ParkRequest::new(
        "relayer",
        Job {
            id: id.into(),
            payload: Some(payload.into()),
            // A Redis list target cannot carry headers (redrive would refuse), so only the
            // record that is never redriven has one, for the headers table.
            headers: if kind == FailureKind::Invalid {
                [("x-trace".to_string(), "abc".to_string())].into()
            } else {
                Default::default()
            },
            ..Job::default()
        },
    );
    r.failure_kind = kind;
    r.reason = reason.into();
    r.deliveries = 3;
    r.service_version = Some("relayer@1.4.2".into());
    r.intent = Some(IntentSnapshot {
        id: id.split('/').next().unwrap().into(),
        state: "created".into(),
    });
    park(client.clone(), ns, r)
        .await
        .unwrap()
        .record()
        .name_any()
}

/// The plugin serving the page as `user` on the shared plane.
fn start_page(ns: &str, user: &str) -> Page {
    Page::start(dlq_testenv::plane(), ns, Some(user))
}

fn sel_box(name: &str) -> String {
    format!("tr[data-name=\"{name}\"] input[name=sel]")
}

/// Five timeouts (payloads JSON) and one invalid record whose payload and reason are markup.
async fn park_decider_records(client: &Client, ns: &str) -> (Vec<String>, String) {
    let mut names = Vec::new();
    for i in 1..=5 {
        let id = format!("pi_000{i}/settle");
        let payload = format!("{{\"intent\":\"pi_000{i}\",\"ref\":\"settle\"}}");
        let reason = "timeout talking to the payer";
        names.push(park_one(client, ns, &id, reason, &payload, FailureKind::Transient).await);
    }
    let evil = "<script>window.__xss=1</script><img src=x onerror=\"window.__xss=2\">";
    let reason = format!("bad json {evil}");
    let xss = park_one(client, ns, "evil/1", &reason, evil, FailureKind::Invalid).await;
    (names, xss)
}

#[tokio::test]
async fn decider_filters_opens_and_redrives_a_selection_as_themselves() {
    let (client, ns) = setup("ui-decide").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let _op = Operator::start(&ns);
    let (names, xss) = park_decider_records(&client, &ns).await;
    grant(&ns, "alice", "decider");
    wait_for_role(&ns, "alice").await;
    let page = start_page(&ns, "alice");
    let b = Browser::start("ui-decide").await;

    // The token URL trades the token for a cookie; the header says who acts.
    b.client.goto(&page.url).await.unwrap();
    assert_eq!(b.text("#user").await, "alice");
    assert!(b.text("#queues").await.contains("relayer"));
    headers_whole(&b, "queues").await;
    a_group_is_the_landing_page_and_opens_its_records(&b, &page).await;

    filter_and_follow_live(&b, &page, &client, &ns, &xss).await;
    records_read_as_text(&b, &page, &ns, &xss, &names[0]).await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    redrive_a_selection_of_three(&b, &page, &api, &names[..3]).await;
    assert_eq!(redis.list(dlq_testenv::LIST).await.len(), 3);
    a_stale_selection_is_refused(&b, &page, &api, &names[3], &names[4]).await;
    b.stop().await;
}

/// At 1400 and 800 px the page's column headers break between words only (they once read
/// "Queu e", "Parke d", "Acknowledge d"); a screenshot at each width (`<shot>`, `<shot>-800`).
async fn headers_whole(b: &Browser, shot: &str) {
    for (width, name) in [(1400, shot.to_string()), (800, format!("{shot}-800"))] {
        b.set_width(width).await;
        let broken = b.broken_header_words().await;
        b.screenshot(&name).await;
        assert!(
            broken.is_empty(),
            "{shot} at {width} px: header words broken across lines: {broken:?}"
        );
    }
    b.set_width(1400).await;
}

/// The landing page lists the failure groups (the operator keeps them), most parked first; a
/// group's link is its page: exactly its records, ready for "Review selection".
async fn a_group_is_the_landing_page_and_opens_its_records(b: &Browser, page: &Page) {
    eventually(40, "the timeouts' group on the landing page", || async {
        b.client.goto(&page.url).await.ok()?;
        // Until the operator has made the groups the page says "No failure groups." and has
        // no table: look again rather than wait on an element that is not coming.
        if b.count("#groups").await == 0 {
            return None;
        }
        let text = b.text("#groups").await;
        // Status writes are coalesced: the group may show before all five are counted.
        let parked = b.text("#groups tbody tr:first-child td:nth-child(6)").await;
        (text.contains("timeout talking to the payer") && parked.trim() == "5").then_some(())
    })
    .await;
    assert_eq!(
        b.text("#groups thead th:nth-child(6)").await.trim(),
        "Parked",
        "the column asserted on"
    );
    let first = b.text("#groups tbody tr:first-child td:nth-child(3)").await;
    assert!(first.contains("timeout talking to the payer"), "{first}");
    headers_whole(b, "groups").await;
    b.click("#groups tbody tr:first-child a.group").await;
    eventually(10, "the group's records", || async {
        b.text("#count")
            .await
            .starts_with("5 records match")
            .then_some(())
    })
    .await;
    // The group's page draws its history: the five parkings in their hour (or two).
    let caption = b.text("#group-history figcaption").await;
    assert!(caption.contains("5 in all"), "{caption}");
    let bars = b.count("#history-chart rect.parked").await;
    assert!((1..=2).contains(&bars), "{bars} bars");
    b.screenshot("group-chart").await;
}

/// Filter by reason text: the five timeouts, not the invalid one; a new parking shows up live.
async fn filter_and_follow_live(b: &Browser, page: &Page, client: &Client, ns: &str, xss: &str) {
    b.client
        .goto(&format!("{}/records", page.base()))
        .await
        .unwrap();
    let reason = b
        .client
        .find(Locator::Css("input[name=reason]"))
        .await
        .unwrap();
    reason.send_keys("timeout").await.unwrap();
    b.click("#apply").await;
    eventually(10, "the filtered list", || async {
        b.text("#count")
            .await
            .starts_with("5 records match")
            .then_some(())
    })
    .await;
    assert_eq!(b.count(&format!("tr[data-name=\"{xss}\"]")).await, 0);
    let late = park_one(
        client,
        ns,
        "pi_0009/settle",
        "timeout again",
        "{}",
        FailureKind::Transient,
    )
    .await;
    b.client
        .wait()
        .at_most(std::time::Duration::from_secs(10))
        .for_element(Locator::Css(&format!("tr[data-name=\"{late}\"]")))
        .await
        .expect("the new parking shows up without a reload");
    b.screenshot("records").await;
}

/// One record: markup in a payload or reason is inert text; JSON is pretty-printed.
async fn records_read_as_text(b: &Browser, page: &Page, ns: &str, xss: &str, json_record: &str) {
    b.client
        .goto(&format!("{}/r/{ns}/{xss}", page.base()))
        .await
        .unwrap();
    let payload = b.text("#payload").await;
    assert!(
        payload.contains("<script>window.__xss=1</script>"),
        "{payload}"
    );
    assert!(b.text("#reason").await.contains("<img src=x"));
    assert_eq!(
        b.count("#payload script, #reason script, #reason img")
            .await,
        0
    );
    let ran = b
        .client
        .execute("return window.__xss !== undefined", vec![])
        .await
        .unwrap();
    assert_eq!(ran, json!(false), "an escaped payload must not run");
    assert!(b.text("#headers").await.contains("x-trace"));
    b.client
        .goto(&format!("{}/r/{ns}/{json_record}", page.base()))
        .await
        .unwrap();
    assert!(b.text("#payload").await.contains("\"intent\": \"pi_0001\""));
    assert_eq!(b.count("#redrive").await, 1);
    b.screenshot("record").await;
}

/// Three ticked (a tick survives the list's live refresh), reviewed, redriven: each signed by
/// the user and carried out by the operator.
async fn redrive_a_selection_of_three(
    b: &Browser,
    page: &Page,
    api: &Api<DeadLetter>,
    names: &[String],
) {
    b.client
        .goto(&format!("{}/records?reason=timeout+talking", page.base()))
        .await
        .unwrap();
    b.click(&sel_box(&names[0])).await;
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    for n in &names[1..] {
        b.click(&sel_box(n)).await;
    }
    b.click("#review").await;
    b.text("#selected").await;
    assert_eq!(
        b.count("#selected tbody tr").await,
        3,
        "the first tick outlived a refresh"
    );
    let note = b.client.find(Locator::Css("#note")).await.unwrap();
    note.send_keys("payer re-signed, INC-1234").await.unwrap();
    b.screenshot("review").await;
    b.click("#redrive").await;
    b.text("#outcomes").await;
    let h1 = b.text("h1").await;
    assert!(h1.contains("3 of 3 signed by alice"), "{h1}");
    for n in names {
        let r = wait_phase(api, n, Phase::Redriven, 30).await;
        assert_eq!(r.spec.by.as_deref(), Some("alice"));
        assert_eq!(r.spec.note.as_deref(), Some("payer re-signed, INC-1234"));
        assert_eq!(r.status.unwrap().resolved_by.as_deref(), Some("alice"));
    }
}

/// One record changes after it was ticked: it is refused in the apiserver's words, the other
/// is signed.
async fn a_stale_selection_is_refused(
    b: &Browser,
    page: &Page,
    api: &Api<DeadLetter>,
    stale: &str,
    fresh: &str,
) {
    b.client
        .goto(&format!("{}/records?reason=timeout+talking", page.base()))
        .await
        .unwrap();
    b.click(&sel_box(stale)).await;
    b.click(&sel_box(fresh)).await;
    b.click("#review").await;
    b.text("#selected").await;
    decide(api, stale, Action::Drop, "bob").await;
    b.click("#redrive").await;
    b.text("#outcomes").await;
    let outcome = b.text("main").await;
    assert!(outcome.contains("1 of 2 signed by alice"), "{outcome}");
    assert!(
        outcome.contains("the object has been modified"),
        "{outcome}"
    );
    b.screenshot("stale-selection").await;
    let r = wait_phase(api, stale, Phase::Dropped, 30).await;
    assert_eq!(
        r.spec.by.as_deref(),
        Some("bob"),
        "the stale record keeps the other decision"
    );
    wait_phase(api, fresh, Phase::Redriven, 30).await;
}

#[tokio::test]
async fn viewer_sees_no_buttons_and_a_forged_post_is_refused() {
    let (client, ns) = setup("ui-view").await;
    create_offline_queue(&client, &ns).await;
    let name = park_one(
        &client,
        &ns,
        "pi_0001/settle",
        "timeout",
        "{}",
        FailureKind::Transient,
    )
    .await;
    grant(&ns, "bob", "viewer");
    wait_for_role(&ns, "bob").await;
    let page = start_page(&ns, "bob");

    // Without the token, or under another Host name, nothing is served.
    let no_token = page.raw("GET /records HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    assert!(no_token.contains("401"), "{no_token}");
    let rebound =
        page.raw("GET /records HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n");
    assert!(rebound.contains("403"), "{rebound}");

    let b = Browser::start("ui-view").await;
    b.client.goto(&page.url).await.unwrap();
    assert_eq!(b.text("#user").await, "bob");
    b.client
        .goto(&format!("{}/records", page.base()))
        .await
        .unwrap();
    assert!(b.text("#count").await.starts_with("1 records match"));
    assert_eq!(
        b.count("input[name=sel]").await,
        0,
        "no selection boxes for a viewer"
    );
    assert_eq!(b.count("#review, #replay-link").await, 0);
    b.client
        .goto(&format!("{}/r/{ns}/{name}", page.base()))
        .await
        .unwrap();
    assert_eq!(
        b.count("#redrive, #drop").await,
        0,
        "no decision buttons for a viewer"
    );

    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    forged_posts_are_refused(&b, &api, &ns, &name).await;
    let r = api.get(&name).await.unwrap();
    assert_eq!(r.phase(), Phase::Parked);
    assert_eq!(r.spec.by, None);
    b.stop().await;
    ctrl_c_stops(page).await;
}

/// A forged POST from the page's own origin: without the CSRF token, refused by the page; with
/// it, refused by the apiserver (a viewer may not patch). 403 either way.
/// Long unbroken values wrap inside the viewport: the longest job id a record holds (253), a
/// 1024-character reason, an 8 KiB header value and a 10 KiB payload line, on the record's page
/// and in the list, cause no horizontal overflow.
#[tokio::test]
async fn long_unbroken_values_wrap_within_the_viewport() {
    let (client, ns) = setup("ui-wrap").await;
    create_offline_queue(&client, &ns).await;
    let mut r = ParkRequest::new(
        "relayer",
        Job {
            id: "i".repeat(dlq_core::api::MAX_JOB_ID_LEN),
            payload: Some("p".repeat(10 * 1024)),
            headers: [("x-long".to_string(), "h".repeat(8192))].into(),
            ..Job::default()
        },
    );
    r.reason = "r".repeat(1024);
    let name = park(client.clone(), &ns, r)
        .await
        .unwrap()
        .record()
        .name_any();
    grant(&ns, "bob", "viewer");
    wait_for_role(&ns, "bob").await;
    let page = start_page(&ns, "bob");
    let b = Browser::start("ui-wrap").await;
    b.client.goto(&page.url).await.unwrap();
    for (path, shot) in [
        (format!("/r/{ns}/{name}"), "long-values-record"),
        ("/records".to_string(), "long-values-list"),
    ] {
        b.client
            .goto(&format!("{}{path}", page.base()))
            .await
            .unwrap();
        let id = if shot.ends_with("record") {
            "#payload"
        } else {
            "#records"
        };
        b.text(id).await;
        let widths = b
            .client
            .execute(
                "const e = document.documentElement; return [e.scrollWidth, e.clientWidth];",
                vec![],
            )
            .await
            .unwrap();
        b.screenshot(shot).await;
        let (scroll, client_w) = (widths[0].as_u64().unwrap(), widths[1].as_u64().unwrap());
        assert!(
            scroll <= client_w,
            "{path}: the page is {scroll}px wide in a {client_w}px viewport"
        );
    }
    b.stop().await;
}

async fn forged_posts_are_refused(b: &Browser, api: &Api<DeadLetter>, ns: &str, name: &str) {
    let forge = r#"
        const [csrf, sel, done] = arguments;
        const body = new URLSearchParams({action: 'redrive', sel: sel});
        if (csrf) body.append('csrf', csrf);
        fetch('/decide', {method: 'POST', body})
            .then(r => r.text().then(t => done([r.status, t])), e => done([0, String(e)]));
    "#;
    let rv = api.get(name).await.unwrap().resource_version().unwrap();
    let sel = json!(format!("{ns}/{name}/{rv}"));
    let without = b
        .client
        .execute_async(forge, vec![json!(null), sel.clone()])
        .await
        .unwrap();
    assert_eq!(without[0], json!(403));
    assert!(without[1].as_str().unwrap().contains("CSRF"), "{without}");
    let meta = b
        .client
        .find(Locator::Css("meta[name=csrf-token]"))
        .await
        .unwrap();
    let csrf = meta.attr("content").await.unwrap().unwrap();
    let with = b
        .client
        .execute_async(forge, vec![json!(csrf), sel])
        .await
        .unwrap();
    assert_eq!(with[0], json!(403), "{with}");
    let words = with[1].as_str().unwrap();
    assert!(
        words.contains("forbidden") && words.contains("bob"),
        "the apiserver's words: {words}"
    );
}

/// Ctrl-C (SIGINT) stops the page cleanly.
async fn ctrl_c_stops(mut page: Page) {
    let pid = page.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = eventually(10, "the page to stop on Ctrl-C", || {
        let exited = page.child.try_wait().unwrap();
        async move { exited }
    })
    .await;
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn replay_from_the_page_dry_runs_stops_then_redrives_through_a_deadletterreplay() {
    let (client, ns) = setup("ui-replay").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let _op = Operator::start(&ns);
    for i in 1..=6 {
        let id = format!("pi_010{i}/settle");
        park_one(&client, &ns, &id, "replay me", "{}", FailureKind::Transient).await;
    }
    park_one(
        &client,
        &ns,
        "other/1",
        "leave me",
        "{}",
        FailureKind::Transient,
    )
    .await;
    grant(&ns, "alice", "decider");
    wait_for_role(&ns, "alice").await;
    let page = start_page(&ns, "alice");
    let b = Browser::start("ui-replay").await;
    b.client.goto(&page.url).await.unwrap();
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);

    // Slowly (one decision every 5 s, so a loaded machine still clicks Stop in time), then Stop:
    // deciding ends, and nothing is left signed but not carried out.
    let summary = replay(&b, &page, "0.2/s", Some("1/6 decided")).await;
    assert!(
        summary.contains("stopped: stopped on request (spec.stop)"),
        "{summary}"
    );
    let parked: Vec<DeadLetter> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|r| r.phase() == Phase::Parked && r.spec.reason == "replay me")
        .collect();
    assert!(
        parked.len() >= 3,
        "Stop left the rest parked: {}",
        parked.len()
    );
    assert!(
        parked.iter().all(|r| r.spec.action.is_none()),
        "undone decisions are withdrawn"
    );

    // Then the rest, to completion: each signed by alice, the other filter's record untouched.
    let summary = replay(&b, &page, "20/s", None).await;
    assert!(summary.contains("completed"), "{summary}");
    b.screenshot("replay").await;
    for r in api.list(&ListParams::default()).await.unwrap().items {
        if r.spec.reason == "replay me" {
            let r = wait_phase(&api, &r.name_any(), Phase::Redriven, 10).await;
            assert_eq!(r.spec.by.as_deref(), Some("alice"));
        } else {
            assert_eq!(r.phase(), Phase::Parked, "outside the filter");
        }
    }
    b.stop().await;
}

/// Runs a replay of the "replay me" records from the records page at `rate`; with `stop_at`,
/// presses Stop once the progress shows it. Returns the progress text with the summary.
async fn replay(b: &Browser, page: &Page, rate: &str, stop_at: Option<&str>) -> String {
    b.client
        .goto(&format!(
            "{}/records?queue=relayer&reason=replay+me",
            page.base()
        ))
        .await
        .unwrap();
    b.click("#replay-link").await;
    let count = b.text("#dry-count").await;
    assert!(count.contains("parked records match"), "{count}");
    let input = b.client.find(Locator::Css("#rate")).await.unwrap();
    input.clear().await.unwrap();
    input.send_keys(rate).await.unwrap();
    b.click("#start").await;
    if let Some(at) = stop_at {
        eventually(20, "progress", || async {
            b.text("#progress").await.contains(at).then_some(())
        })
        .await;
        // A real progress element, not a row of '#'.
        assert_eq!(
            b.count("progress#progress-bar").await,
            1,
            "no progress element"
        );
        let line = b.text("#progress-line").await;
        assert!(!line.contains("###") && !line.contains("..."), "{line}");
        b.click("#stop").await;
    }
    let summary = eventually(60, "the replay to end", || async {
        let t = b.text("#progress").await;
        t.contains("replay queue=").then_some(t)
    })
    .await;
    // An ended replay has nothing to stop: the button goes with the summary's swap.
    assert_eq!(b.count("#stop").await, 0, "Stop offered after the end");
    summary
}

/// The search box is `ls --grep/--where` on the page (one matcher): typed, it finds by text
/// and shows where (masked); the search lives in the URL, which answers alone when opened; a
/// card number never matches; a bad PATH is refused in words; and a searched list offers no
/// replay (a DeadLetterReplay cannot select by a search), which the replay page refuses too.
#[tokio::test]
async fn the_search_box_finds_by_text_and_path_from_a_shareable_url() {
    let (client, ns) = setup("ui-search").await;
    create_offline_queue(&client, &ns).await;
    let card = "4111111111111111";
    let one = park_one(
        &client,
        &ns,
        "order/1",
        "timeout",
        &format!(r#"{{"customer":"cus_42","pan":"{card}"}}"#),
        FailureKind::Transient,
    )
    .await;
    let two = park_one(
        &client,
        &ns,
        "order/2",
        "timeout",
        r#"{"customer":"cus_7"}"#,
        FailureKind::Transient,
    )
    .await;
    grant(&ns, "alice", "decider");
    wait_for_role(&ns, "alice").await;
    let page = start_page(&ns, "alice");
    let b = Browser::start("ui-search").await;
    b.client.goto(&page.url).await.unwrap();
    b.client
        .goto(&format!("{}/records?queue=relayer", page.base()))
        .await
        .unwrap();
    let grep = b.client.find(Locator::Css("#grep")).await.unwrap();
    grep.send_keys("CUS_42").await.unwrap();
    b.click("#apply").await;
    wait_count(&b, "1 records match").await;
    assert_eq!(b.count(&format!("tr[data-name=\"{one}\"]")).await, 1);
    assert_eq!(b.count(&format!("tr[data-name=\"{two}\"]")).await, 0);
    let hit = b.text("#records td.hit").await;
    assert!(hit.starts_with(r#"payload: {"customer":"cus_42""#), "{hit}");
    assert!(!b.text("main").await.contains(card));
    let url = b.client.current_url().await.unwrap();
    assert!(
        url.as_str().contains("grep=CUS_42"),
        "the search is in the URL: {url}"
    );
    assert_eq!(b.count("#review").await, 1, "alice may decide");
    assert_eq!(b.count("#replay-link").await, 0, "no replay for a search");
    b.screenshot("search").await;

    // Opened from its URL alone: the same answer, and the boxes filled in.
    let shared = format!("{}/records?where=payload.customer%3Dcus_7", page.base());
    b.client.goto(&shared).await.unwrap();
    wait_count(&b, "1 records match").await;
    assert_eq!(b.count(&format!("tr[data-name=\"{two}\"]")).await, 1);
    let filled = b.client.find(Locator::Css("input.where")).await.unwrap();
    assert_eq!(
        filled.prop("value").await.unwrap().as_deref(),
        Some("payload.customer=cus_7")
    );

    for (query, says) in [
        (format!("grep={card}"), "0 records match"),
        ("where=customer%3Dx".to_string(), "PATH is one of job.id"),
    ] {
        b.client
            .goto(&format!("{}/records?{query}", page.base()))
            .await
            .unwrap();
        eventually(10, says, || async {
            b.text("#live").await.contains(says).then_some(())
        })
        .await;
    }
    b.client
        .goto(&format!("{}/replay?queue=relayer&grep=cus_42", page.base()))
        .await
        .unwrap();
    let refused = b.text("main").await;
    assert!(
        refused.contains("a replay cannot select by a search"),
        "{refused}"
    );
    b.stop().await;
}

/// Waits until the records page's count begins with `want`.
async fn wait_count(b: &Browser, want: &str) {
    eventually(10, want, || async {
        b.text("#count").await.starts_with(want).then_some(())
    })
    .await;
}

/// Issue 59: the landing page lists the replays awaiting approval; alice, who did not write
/// carol's replay, approves it with a note from the page, in her own name, and it runs.
#[tokio::test]
async fn a_replay_awaiting_approval_is_approved_from_the_page() {
    use dlq_core::replay::{DeadLetterReplay, DeadLetterReplaySpec, ReplayPhase};
    let (client, ns) = setup("ui-approve").await;
    let redis = Redis::start();
    let policy = json!({"approvals": {"required": 1, "expireAfter": "1h"}});
    create_queue(&client, &ns, &redis.url(), list_target(), policy).await;
    let _op = Operator::start(&ns);
    for i in 1..=2 {
        let id = format!("pi_020{i}/settle");
        park_one(
            &client,
            &ns,
            &id,
            "approve me",
            "{}",
            FailureKind::Transient,
        )
        .await;
    }
    let replays: Api<DeadLetterReplay> = Api::namespaced(client.clone(), &ns);
    let spec: DeadLetterReplaySpec = serde_json::from_value(json!({
        "queue": "relayer", "action": "redrive", "rate": "50/s", "by": "carol",
        "note": "INC-59", "selector": {"reasonContains": "approve me"}
    }))
    .unwrap();
    replays
        .create(&Default::default(), &DeadLetterReplay::new("inc-59", spec))
        .await
        .unwrap();
    eventually(30, "the replay to await approval", || async {
        let r = replays.get("inc-59").await.ok()?;
        (r.phase() == ReplayPhase::AwaitingApproval).then_some(())
    })
    .await;
    grant(&ns, "alice", "decider");
    wait_for_role(&ns, "alice").await;
    let page = start_page(&ns, "alice");
    let b = Browser::start("ui-approve").await;
    b.client.goto(&page.url).await.unwrap();
    let row = b.text("#awaiting tbody tr").await;
    assert!(row.contains("inc-59") && row.contains("carol"), "{row}");
    let given = b.text("#awaiting tbody tr td:nth-child(6)").await;
    assert_eq!(given.trim(), "0 of 1", "approvals given of required: {row}");
    b.client
        .find(Locator::Css("form.approve input[name=note]"))
        .await
        .unwrap()
        .send_keys("INC-59 reviewed on the page")
        .await
        .unwrap();
    b.screenshot("approve").await;
    b.click("form.approve button").await;
    let approved = eventually(30, "the approved replay to complete", || async {
        let r = replays.get("inc-59").await.ok()?;
        (r.phase() == ReplayPhase::Completed).then_some(r)
    })
    .await;
    let given = &approved.spec.approvals;
    assert_eq!(given.len(), 1, "{given:?}");
    assert_eq!(given[0].by, "alice");
    assert_eq!(
        given[0].note.as_deref(),
        Some("INC-59 reviewed on the page")
    );
    b.client.goto(&page.url).await.unwrap();
    assert_eq!(b.count("#awaiting").await, 0, "nothing waits any more");
    let api: Api<DeadLetter> = Api::namespaced(client, &ns);
    for r in api.list(&ListParams::default()).await.unwrap().items {
        let r = wait_phase(&api, &r.name_any(), Phase::Redriven, 10).await;
        assert!(
            r.spec
                .note
                .as_deref()
                .unwrap_or_default()
                .contains("approved by alice"),
            "{:?}",
            r.spec.note
        );
    }
    b.stop().await;
}
