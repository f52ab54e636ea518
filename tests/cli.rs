//! `kubectl dlq` against a real apiserver, operator and redis-server.

use std::process::{Command, Stdio};

use dlq_client::park::{ParkRequest, park};
use dlq_core::api::{DeadLetter, DeadLetterQueue, FailureKind, IntentSnapshot, Job, Phase};
use dlq_testenv::brokers::Redis;
use dlq_testenv::{
    LIST, Operator, create_offline_queue, create_queue, eventually, list_target, setup,
};
use futures::StreamExt;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn dlq(ns: &str, args: &[&str]) -> Out {
    let plane = dlq_testenv::plane();
    let out = Command::new(dlq_testenv::bin("kubectl-dlq"))
        .args(["--kubeconfig", plane.kubeconfig.to_str().unwrap(), "-n", ns])
        .args(args)
        .stdin(Stdio::null())
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    Out {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

struct Spec<'a> {
    id: &'a str,
    kind: FailureKind,
    reason: &'a str,
    version: &'a str,
    failed_at: &'a str,
    state: &'a str,
}

async fn park_spec(client: &Client, ns: &str, s: &Spec<'_>) {
    let mut r = ParkRequest::new(
        "relayer",
        Job {
            id: s.id.into(),
            payload: Some(format!("{{\"job\":\"{}\"}}", s.id)),
            ..Job::default()
        },
    );
    r.failure_kind = s.kind;
    r.reason = s.reason.into();
    r.deliveries = 3;
    r.service_version = Some(s.version.into());
    r.failed_at = Some(s.failed_at.parse().unwrap());
    r.intent = Some(IntentSnapshot {
        id: s.id.split('/').next().unwrap().into(),
        state: s.state.into(),
    });
    park(client.clone(), ns, r).await.unwrap();
}

#[tokio::test]
async fn ls_show_stats_and_json_round_trip() {
    let (client, ns) = setup("cli-ls").await;
    create_offline_queue(&client, &ns).await;
    for s in [
        Spec {
            id: "pi_0001/settle",
            kind: FailureKind::Invalid,
            reason: "retrying will not help",
            version: "relayer@1.4.2",
            failed_at: "2026-11-29T10:00:00Z",
            state: "failed",
        },
        Spec {
            id: "pi_0002/settle",
            kind: FailureKind::Transient,
            reason: "no luck after 3 deliveries",
            version: "relayer@1.4.2",
            failed_at: "2026-11-29T10:01:00Z",
            state: "needs_review",
        },
    ] {
        park_spec(&client, &ns, &s).await;
    }
    let ls = dlq(&ns, &["ls"]);
    assert!(ls.ok, "{}", ls.stderr);
    let expected = "\
JOB             #   PHASE   INTENT        BY  REASON
pi_0001/settle  #3  parked  failed        -   retrying will not help
pi_0002/settle  #3  parked  needs_review  -   no luck after 3 deliveries
";
    assert_eq!(ls.stdout, expected);
    assert_eq!(dlq(&ns, &["ls", "--phase", "redriven"]).stdout, "");

    let json = dlq(&ns, &["ls", "-o", "json"]);
    let list: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    let items: Vec<DeadLetter> = serde_json::from_value(list["items"].clone()).unwrap();
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let mut live = api.list(&ListParams::default()).await.unwrap().items;
    live.sort_by(|a, b| a.spec.job.id.cmp(&b.spec.job.id));
    assert_eq!(items.len(), 2);
    for (a, b) in items.iter().zip(&live) {
        assert_eq!(a.spec, b.spec, "-o json carries the records unchanged");
        assert_eq!(a.name_any(), b.name_any());
    }
    let yaml = dlq(&ns, &["ls", "-o", "yaml"]);
    let back: serde_json::Value = serde_yaml::from_str(&yaml.stdout).unwrap();
    assert_eq!(back["items"].as_array().unwrap().len(), 2);

    let show = dlq(&ns, &["show", "pi_0001/settle"]);
    assert!(show.ok, "{}", show.stderr);
    for want in [
        "Job:            pi_0001/settle",
        "Phase:          Parked",
        "Failure kind:   Invalid",
        "Intent:         pi_0001 was failed when parked",
        "{\"job\":\"pi_0001/settle\"}",
        "Decision:       none yet",
        "Parked",
    ] {
        assert!(
            show.stdout.contains(want),
            "show lacks {want:?}:\n{}",
            show.stdout
        );
    }
    let by_name = dlq(&ns, &["show", &live[1].name_any()]);
    assert!(
        by_name.stdout.contains("pi_0002/settle"),
        "{}",
        by_name.stdout
    );

    // stats reads the queue's counters, which the operator keeps.
    let _op = Operator::start(&ns);
    let stats = eventually(60, "the operator to count per failure kind", || async {
        let out = dlq(&ns, &["stats"]);
        (out.stdout.lines().count() == 3).then_some(out)
    })
    .await;
    let lines: Vec<&str> = stats.stdout.lines().collect();
    assert_eq!(
        lines[0].split_whitespace().collect::<Vec<_>>(),
        [
            "QUEUE", "KIND", "PARKED", "REDRIVEN", "DROPPED", "OLDEST", "PARKED", "WAITING"
        ]
    );
    let rows: Vec<Vec<&str>> = lines[1..]
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(&rows[0][..5], ["relayer", "invalid", "1", "0", "0"]);
    assert_eq!(&rows[1][..5], ["relayer", "transient", "1", "0", "0"]);
}

#[tokio::test]
async fn ls_reads_a_page_at_a_time_with_selectors_on_the_server() {
    let (client, ns) = setup("cli-page").await;
    create_offline_queue(&client, &ns).await;
    create_other_queue_record(&client, &ns).await;
    for i in 0..7 {
        let s = Spec {
            id: &format!("job_{i}/settle"),
            kind: FailureKind::Transient,
            reason: "gave up",
            version: "relayer@1.4.2",
            failed_at: "2026-11-29T10:00:00Z",
            state: "created",
        };
        park_spec(&client, &ns, &s).await;
    }
    let first = dlq(&ns, &["ls", "--queue", "relayer", "--limit", "3"]);
    assert!(first.ok, "{}", first.stderr);
    assert_eq!(
        first.stdout.lines().count(),
        4,
        "header + 3:\n{}",
        first.stdout
    );
    let token = first
        .stderr
        .split("--continue ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .unwrap_or_else(|| panic!("a continue token: {}", first.stderr))
        .to_string();
    let rest = dlq(
        &ns,
        &[
            "ls",
            "--queue",
            "relayer",
            "--limit",
            "0",
            "--continue",
            &token,
            "--no-headers",
        ],
    );
    assert!(rest.ok, "{}", rest.stderr);
    assert_eq!(
        rest.stdout.lines().count(),
        4,
        "the other 4:\n{}",
        rest.stdout
    );
    let all = format!("{}{}", first.stdout, rest.stdout);
    for i in 0..7 {
        assert!(all.contains(&format!("job_{i}/settle")), "{all}");
    }
    assert!(
        !all.contains("other/1"),
        "the queue selector is applied: {all}"
    );
    // The phase selector runs on the server too: unmarked and Parked records are Parked.
    let parked = dlq(
        &ns,
        &["ls", "--phase", "parked", "--no-headers", "--limit", "0"],
    );
    assert_eq!(parked.stdout.lines().count(), 8, "{}", parked.stdout);
    let redriven = dlq(&ns, &["ls", "--phase", "Redriven"]);
    assert!(
        redriven.ok && redriven.stdout.is_empty(),
        "{}",
        redriven.stdout
    );
}

/// What `show` and `groups` print for hostile records, read back from a real apiserver: a card
/// number in a binary payload, a header name and an intent snapshot never shows whole (nor in
/// the base64 of the bytes), and two templates that differ only by a Cyrillic `о` print apart.
#[tokio::test]
async fn show_masks_cards_everywhere_and_groups_print_look_alike_templates_apart() {
    use base64::Engine;
    let (client, ns) = setup("cli-hostile").await;
    create_offline_queue(&client, &ns).await;
    let card = "4242424242424242";
    let mut job = Job::from_bytes("pi_hostile/settle", b"\xff\x00pan=4242424242424242;");
    job.headers
        .insert("x-pan-6011111111111117".into(), "v".into());
    let mut r = ParkRequest::new("relayer", job);
    r.reason = "timeout talking to payer".into();
    r.intent = Some(IntentSnapshot {
        id: "card-4000056655665556".into(),
        state: "created".into(),
    });
    park(client.clone(), &ns, r).await.unwrap();
    let mut look_alike = ParkRequest::new("relayer", Job::from_bytes("pi_other/settle", b"{}"));
    look_alike.reason = "timeout talking t\u{43e} payer".into();
    park(client.clone(), &ns, look_alike).await.unwrap();

    let show = dlq(&ns, &["show", "pi_hostile/settle"]);
    assert!(show.ok, "{}", show.stderr);
    for whole in [card, "6011111111111117", "4000056655665556"] {
        assert!(
            !show.stdout.contains(whole),
            "{whole} shown:\n{}",
            show.stdout
        );
    }
    let engine = base64::engine::general_purpose::STANDARD;
    let decoded: Vec<Vec<u8>> = show
        .stdout
        .split_whitespace()
        .filter(|w| w.len() >= 16)
        .filter_map(|w| engine.decode(w).ok())
        .collect();
    assert!(
        decoded
            .iter()
            .any(|d| d.ends_with(b"pan=424242******4242;")),
        "the payload's bytes are shown, masked:\n{}",
        show.stdout
    );
    assert!(
        !decoded
            .iter()
            .any(|d| d.windows(card.len()).any(|w| w == card.as_bytes())),
        "no base64 in show decodes to the card:\n{}",
        show.stdout
    );
    assert!(
        show.stdout.contains("x-pan-601111******1117"),
        "{}",
        show.stdout
    );

    let _op = Operator::start(&ns);
    // A group is listed as soon as it exists, its template once its status is written.
    let groups = eventually(60, "two failure groups with their templates", || async {
        let out = dlq(&ns, &["groups"]);
        let rows: Vec<&str> = out.stdout.lines().skip(1).collect();
        (rows.len() == 2 && rows.iter().all(|l| l.contains("timeout"))).then_some(out)
    })
    .await;
    let templates: Vec<&str> = groups
        .stdout
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once("timeout").map(|(_, t)| t))
        .collect();
    assert_eq!(templates.len(), 2, "{}", groups.stdout);
    assert_ne!(templates[0], templates[1], "{}", groups.stdout);
    assert!(
        groups.stdout.contains(r"t\u{43e} payer") && templates.iter().all(|t| t.is_ascii()),
        "the Cyrillic letter is shown as its code point:\n{}",
        groups.stdout
    );

    // Each group's last 24 hours as a sparkline and its trend, once its history is written;
    // `groups NAME` tells one group's 7 days.
    let listed = eventually(60, "each group's sparkline and trend", || async {
        let out = dlq(&ns, &["groups"]);
        let rows: Vec<&str> = out.stdout.lines().skip(1).collect();
        let drawn = |l: &&str| l.contains('█') && l.contains("↑ 0→1");
        (rows.len() == 2 && rows.iter().all(drawn)).then_some(out)
    })
    .await;
    let name = listed
        .stdout
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().next())
        .map(|fingerprint| format!("relayer-{fingerprint}"))
        .unwrap_or_default();
    let story = dlq(&ns, &["groups", &name]);
    assert!(story.ok, "{}", story.stderr);
    for line in [
        format!("Group:      {name}"),
        "Trend:      ↑ 0→1".to_string(),
        "busiest hour 1, 1 in all".to_string(),
    ] {
        assert!(story.stdout.contains(&line), "{line}:\n{}", story.stdout);
    }
    let days = story.stdout.lines().filter(|l| l.starts_with("  ")).count();
    assert_eq!(days, 8, "{}", story.stdout);
}

/// One record of a second queue `other`, which `ls --queue relayer` must not show.
async fn create_other_queue_record(client: &Client, ns: &str) {
    dlq_testenv::create_dlq(
        client,
        ns,
        "other",
        json!({"target": {"redis": list_target()}}),
    )
    .await;
    let mut r = ParkRequest::new(
        "other",
        Job {
            id: "other/1".into(),
            payload: Some("{}".into()),
            ..Job::default()
        },
    );
    r.reason = "gave up".into();
    park(client.clone(), ns, r).await.unwrap();
}

#[tokio::test]
async fn redrive_signs_with_the_authenticated_user_and_refuses_a_second_press() {
    let (client, ns) = setup("cli-redrive").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    let _op = Operator::start(&ns);
    park_spec(
        &client,
        &ns,
        &Spec {
            id: "pi_0003/settle",
            kind: FailureKind::Transient,
            reason: "r",
            version: "v",
            failed_at: "2026-11-29T10:00:00Z",
            state: "created",
        },
    )
    .await;
    // alice may read and decide in this namespace, nothing more.
    let rbac = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: decider, namespace: {ns}}}\nrules:\n- apiGroups: [dlq.dev]\n  resources: [deadletters, deadletterqueues]\n  verbs: [get, list, watch, patch]\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: alice, namespace: {ns}}}\nroleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: decider}}\nsubjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: alice}}]\n"
    );
    let mut apply = dlq_testenv::plane().kubectl();
    apply
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null());
    let mut child = apply.spawn().unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), rbac.as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());

    let first = eventually(10, "alice's role to take effect", || async {
        let out = dlq(
            &ns,
            &[
                "--as",
                "alice",
                "redrive",
                "pi_0003/settle",
                "--note",
                "payer re-signed",
                "--wait",
            ],
        );
        (!out.stdout.contains("forbidden") && !out.stderr.contains("forbidden")).then_some(out)
    })
    .await;
    assert!(first.ok, "{} {}", first.stdout, first.stderr);
    assert_eq!(
        first.stdout,
        "redrive pi_0003/settle   by alice\nredrive pi_0003/settle   redriven\n"
    );
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let r = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .remove(0);
    assert_eq!(
        r.spec.by.as_deref(),
        Some("alice"),
        "--by defaults to the authenticated user"
    );
    assert_eq!(r.spec.note.as_deref(), Some("payer re-signed"));
    assert_eq!(r.status.unwrap().resolved_by.as_deref(), Some("alice"));
    assert_eq!(redis.list(LIST).await.len(), 1);

    let second = dlq(&ns, &["--as", "alice", "redrive", "pi_0003/settle"]);
    assert!(!second.ok, "a second press must exit non-zero");
    assert_eq!(
        second.stdout,
        "redrive pi_0003/settle   refused (record is not parked: pi_0003/settle is redriven)\n"
    );
    let drop = dlq(&ns, &["drop", "pi_0003/settle", "--by", "ops"]);
    assert!(!drop.ok);
    assert!(
        drop.stdout
            .contains("refused (record is not parked: pi_0003/settle is redriven)"),
        "{}",
        drop.stdout
    );
    let ghost = dlq(&ns, &["redrive", "nope/1", "--by", "ops"]);
    assert!(!ghost.ok);
    assert!(
        ghost.stdout.contains("refused (no record of nope/1"),
        "{}",
        ghost.stdout
    );
}

#[tokio::test]
async fn dry_run_selects_exactly_the_matching_records() {
    let (client, ns) = setup("cli-dry").await;
    create_offline_queue(&client, &ns).await;
    let specs = [
        Spec {
            id: "a/1",
            kind: FailureKind::Transient,
            reason: "timeout talking to node",
            version: "relayer@1.4.2",
            failed_at: "2026-11-29T10:00:00Z",
            state: "created",
        },
        Spec {
            id: "b/1",
            kind: FailureKind::Transient,
            reason: "timeout talking to node",
            version: "relayer@1.4.2",
            failed_at: "2026-11-29T12:00:00Z",
            state: "created",
        },
        Spec {
            id: "c/1",
            kind: FailureKind::Invalid,
            reason: "timeout talking to node",
            version: "relayer@1.4.2",
            failed_at: "2026-11-29T10:30:00Z",
            state: "created",
        },
        Spec {
            id: "d/1",
            kind: FailureKind::Transient,
            reason: "bad json",
            version: "relayer@1.4.2",
            failed_at: "2026-11-29T10:30:00Z",
            state: "created",
        },
        Spec {
            id: "e/1",
            kind: FailureKind::Transient,
            reason: "timeout talking to node",
            version: "relayer@1.5.0",
            failed_at: "2026-11-29T10:30:00Z",
            state: "created",
        },
        Spec {
            id: "f/1",
            kind: FailureKind::Transient,
            reason: "timeout talking to node",
            version: "relayer@1.4.2",
            failed_at: "2026-11-29T10:45:00Z",
            state: "created",
        },
    ];
    for s in &specs {
        park_spec(&client, &ns, s).await;
    }
    let ids = |out: &Out| -> Vec<String> {
        out.stdout
            .lines()
            .filter(|l| !l.starts_with("dry run"))
            .map(|l| l.split_whitespace().next().unwrap().to_string())
            .collect()
    };
    let all = dlq(&ns, &["redrive", "--queue", "relayer", "--dry-run"]);
    assert!(all.ok, "{}", all.stderr);
    assert_eq!(
        ids(&all),
        ["a/1", "c/1", "d/1", "e/1", "f/1", "b/1"],
        "ordered by failedAt"
    );
    let narrow = dlq(
        &ns,
        &[
            "redrive",
            "--queue",
            "relayer",
            "--failure-kind",
            "Transient",
            "--reason-contains",
            "timeout",
            "--since",
            "2026-11-29T10:00:00Z",
            "--until",
            "2026-11-29T11:00:00Z",
            "--service-version",
            "relayer@1.4.2",
            "--dry-run",
        ],
    );
    assert_eq!(ids(&narrow), ["a/1", "f/1"]);
    assert!(
        narrow
            .stdout
            .contains("dry run: 2 records would be redriven"),
        "{}",
        narrow.stdout
    );
    assert_eq!(
        ids(&dlq(
            &ns,
            &["redrive", "--queue", "relayer", "--max", "2", "--dry-run"]
        )),
        ["a/1", "c/1"]
    );
    let api: Api<DeadLetter> = Api::namespaced(client, &ns);
    assert!(
        api.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .all(|r| r.spec.action.is_none()),
        "a dry run changes nothing"
    );
}

async fn park_many(client: &Client, ns: &str, n: usize) {
    let jobs = (0..n).map(|i| {
        let client = client.clone();
        let ns = ns.to_string();
        async move {
            let mut r = ParkRequest::new(
                "relayer",
                Job {
                    id: format!("bulk/{i:03}"),
                    payload: Some(format!("job {i}")),
                    ..Job::default()
                },
            );
            r.reason = "retries exhausted".into();
            r.failed_at = Some(jiff::Timestamp::from_second(1_700_000_000 + i as i64).unwrap());
            park(client, &ns, r).await.unwrap();
        }
    });
    futures::stream::iter(jobs)
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
}

fn summary_rate(stdout: &str) -> f64 {
    let s = stdout
        .lines()
        .find(|l| l.starts_with("replay "))
        .unwrap_or_else(|| panic!("no summary in {stdout}"));
    let rate = s
        .split(" decisions in ")
        .nth(1)
        .and_then(|r| r.split('(').nth(1))
        .and_then(|r| r.split("/s)").next())
        .unwrap();
    rate.parse().unwrap()
}

#[tokio::test]
async fn replay_honours_the_rate() {
    let (client, ns) = setup("cli-rate").await;
    let redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    park_many(&client, &ns, 300).await;
    // A first decision 1.5 s late (a loaded machine) must not buy a burst that outruns the rate.
    let _op = Operator::start_with(&ns, &[], &[("DLQ_FAILPOINT", "replay-first-sign@1500")]);
    let started = std::time::Instant::now();
    let out = dlq(
        &ns,
        &[
            "redrive",
            "--queue",
            "relayer",
            "--rate",
            "50/s",
            "--by",
            "ops",
            "--note",
            "INC-9 replay",
        ],
    );
    assert!(out.ok, "{}\n{}", out.stdout, out.stderr);
    let rate = summary_rate(&out.stdout);
    dlq_testenv::report(&format!(
        "replay: 300 records at --rate 50/s went at {rate:.1}/s; run took {:.1}s",
        started.elapsed().as_secs_f64()
    ));
    // Honouring the rate means never faster than asked. How close it gets from below depends
    // on the machine's load (a timed lower bound would be a flaky test): only progress is
    // asserted there, and the figure is reported.
    assert!(rate <= 60.0, "rate {rate} above 50/s (+20%)");
    assert!(rate >= 5.0, "rate {rate}: the replay hardly moved");
    assert!(
        out.stdout
            .contains("selected 300, decided 300, redriven 300, failing 0"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.trim_end().ends_with("completed"),
        "{}",
        out.stdout
    );
    assert_eq!(redis.list(LIST).await.len(), 300);
    let events: Api<Event> = Api::namespaced(client, &ns);
    let record = eventually(10, "the Replay decision record", || async {
        events
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("Replay"))
    })
    .await;
    let note = record.note.unwrap();
    assert!(
        note.contains("by ops") && note.contains("queue=relayer") && note.contains("decided 300"),
        "{note}"
    );
    assert_eq!(
        record.regarding.unwrap().kind.as_deref(),
        Some("DeadLetterQueue")
    );
}

#[tokio::test]
async fn replay_stops_on_requeue_failures_and_leaves_the_rest_parked() {
    let (client, ns) = setup("cli-stop").await;
    let mut redis = Redis::start();
    create_queue(&client, &ns, &redis.url(), list_target(), json!({})).await;
    park_many(&client, &ns, 300).await;
    let _op = Operator::start(&ns);
    let bin = dlq_testenv::bin("kubectl-dlq");
    let plane = dlq_testenv::plane();
    let child = Command::new(bin)
        .args([
            "--kubeconfig",
            plane.kubeconfig.to_str().unwrap(),
            "-n",
            &ns,
            "redrive",
            "--queue",
            "relayer",
            "--rate",
            "40/s",
            "--by",
            "ops",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    eventually(60, "some redrives to land", || async {
        (redis.list(LIST).await.len() >= 40).then_some(())
    })
    .await;
    redis.stop();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "a stopped replay exits non-zero");
    assert!(
        stdout.contains("stopped: requeue failure ratio"),
        "{stdout}"
    );

    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let items = api.list(&ListParams::default()).await.unwrap().items;
    let parked: Vec<&DeadLetter> = items
        .iter()
        .filter(|r| r.phase() == Phase::Parked)
        .collect();
    let redriven = items
        .iter()
        .filter(|r| r.phase() == Phase::Redriven)
        .count();
    assert_eq!(parked.len() + redriven, 300);
    assert!(
        parked.len() >= 150,
        "most records were never decided: {} parked",
        parked.len()
    );
    assert!(
        parked.iter().all(|r| r.spec.action.is_none()),
        "decisions not carried out were withdrawn"
    );
    dlq_testenv::report(&format!(
        "replay stop: {redriven} redriven before the broker died, {} left parked; {}",
        parked.len(),
        stdout.lines().last().unwrap_or("")
    ));
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), &ns);
    assert!(queues.get("relayer").await.is_ok());
    let events: Api<Event> = Api::namespaced(client, &ns);
    let stopped = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("ReplayStopped"));
    assert!(stopped.is_some_and(|e| e.type_.as_deref() == Some("Warning")));
}

/// What `park_bounded` feeds the child's stdin.
enum Stdin {
    Null,
    /// This byte without end, through a pipe, until the child closes it.
    Endless(u8),
    Bytes(Vec<u8>),
}

/// How a bounded `kubectl dlq` run ended.
struct Bounded {
    ok: bool,
    stdout: String,
    stderr: String,
    max_rss_kib: i64,
    secs: f64,
}

/// `kubectl dlq ARGS` under a 1 GiB address-space limit (a regression that reads an endless
/// input fails instead of taking the machine) and a 30 s deadline; its peak RSS from wait4.
// The child is reaped by wait4, which also gives its peak RSS; Child::wait would not.
#[allow(clippy::zombie_processes)]
fn dlq_bounded(ns: &str, args: &[&str], stdin: Stdin) -> Bounded {
    use std::io::{Read, Write};
    use std::os::unix::process::CommandExt;
    let plane = dlq_testenv::plane();
    let mut cmd = Command::new(dlq_testenv::bin("kubectl-dlq"));
    cmd.args(["--kubeconfig", plane.kubeconfig.to_str().unwrap(), "-n", ns])
        .args(args)
        .stdin(match stdin {
            Stdin::Null => Stdio::null(),
            _ => Stdio::piped(),
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("RUST_BACKTRACE", "0");
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let gib = libc::rlimit {
                rlim_cur: 1 << 30,
                rlim_max: 1 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &gib) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let start = std::time::Instant::now();
    let mut child = cmd.spawn().unwrap();
    let feeder = child.stdin.take().map(|mut pipe| {
        std::thread::spawn(move || match stdin {
            Stdin::Endless(b) => {
                let chunk = vec![b; 64 * 1024];
                // Until the reader closes the pipe (EPIPE: the harness ignores SIGPIPE).
                while pipe.write_all(&chunk).is_ok() {}
            }
            Stdin::Bytes(bytes) => {
                let _ = pipe.write_all(&bytes);
            }
            Stdin::Null => {}
        })
    });
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid value for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: pid is our own child, not yet reaped; status and usage are valid pointers.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        assert!(r >= 0, "wait4: {}", std::io::Error::last_os_error());
        if r == pid {
            break;
        }
        if start.elapsed() > std::time::Duration::from_secs(30) {
            let _ = child.kill();
            panic!("kubectl dlq {args:?} still running after 30 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let secs = start.elapsed().as_secs_f64();
    if let Some(f) = feeder {
        f.join().unwrap();
    }
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    Bounded {
        ok: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        stdout,
        stderr,
        max_rss_kib: usage.ru_maxrss,
        secs,
    }
}

#[tokio::test]
async fn park_reads_at_most_the_limit_from_endless_inputs() {
    use dlq_core::api::{MAX_PAYLOAD_BASE64_LEN, MAX_PAYLOAD_BYTES};
    let (client, ns) = setup("cli-bounded").await;
    create_offline_queue(&client, &ns).await;
    let park = ["park", "--queue", "relayer", "--id", "big/settle"];
    let limit = format!("the limit of {MAX_PAYLOAD_BYTES} bytes");
    let b64_limit = format!("the limit of {} bytes", MAX_PAYLOAD_BASE64_LEN + 2);
    let dir = std::env::temp_dir();
    let at_dir = format!("@{}", dir.display());
    let refusals: [(&[&str], Stdin, &str); 6] = [
        (
            &["--payload", "@/dev/zero"],
            Stdin::Null,
            "/dev/zero is a device",
        ),
        (&["--payload", &at_dir], Stdin::Null, "is a directory"),
        (&["--payload", "@-"], Stdin::Endless(b'x'), &limit),
        (&["--payload", "@/dev/stdin"], Stdin::Endless(0), &limit),
        (
            &["--payload-base64", "@-"],
            Stdin::Endless(b'A'),
            &b64_limit,
        ),
        (
            &["--payload", "@-"],
            Stdin::Bytes(vec![b'x'; MAX_PAYLOAD_BYTES + 1]),
            &limit,
        ),
    ];
    for (flags, stdin, want) in refusals {
        let args: Vec<&str> = park.iter().chain(flags).copied().collect();
        let out = dlq_bounded(&ns, &args, stdin);
        dlq_testenv::report(&format!(
            "park {flags:?}: {:.2}s, max RSS {} KiB",
            out.secs, out.max_rss_kib
        ));
        assert!(!out.ok, "{flags:?} was accepted: {}", out.stdout);
        assert!(out.stderr.contains(want), "{flags:?}: {}", out.stderr);
        assert!(out.secs < 10.0, "{flags:?} took {:.1}s", out.secs);
        assert!(
            out.max_rss_kib < 64 * 1024,
            "{flags:?}: peak RSS {} KiB",
            out.max_rss_kib
        );
    }
    let api: Api<DeadLetter> = Api::namespaced(client, &ns);
    assert!(
        api.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // Exactly the limit, through the same pipe, parks.
    let args: Vec<&str> = park.iter().chain(&["--payload", "@-"]).copied().collect();
    let out = dlq_bounded(&ns, &args, Stdin::Bytes(vec![b'x'; MAX_PAYLOAD_BYTES]));
    assert!(out.ok, "{}", out.stderr);
    let items = api.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(items.len(), 1);
    assert_eq!(
        items[0].spec.job.payload.as_ref().map(String::len),
        Some(MAX_PAYLOAD_BYTES)
    );
}

#[test]
fn help_documents_every_verb() {
    let out = Command::new(dlq_testenv::bin("kubectl-dlq"))
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for verb in ["ls", "show", "stats", "redrive", "drop", "park"] {
        assert!(
            text.lines().any(|l| l.trim_start().starts_with(verb)),
            "--help lacks {verb}:\n{text}"
        );
    }
    let out = Command::new(dlq_testenv::bin("kubectl-dlq"))
        .args(["redrive", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--queue",
        "--failure-kind",
        "--reason-contains",
        "--since",
        "--until",
        "--service-version",
        "--rate",
        "--max",
        "--dry-run",
        "--max-failure-ratio",
        "--max-new-parked",
        "--by",
        "--note",
        "--wait",
    ] {
        assert!(text.contains(flag), "redrive --help lacks {flag}");
    }
}

/// The records `ls --grep/--where` is tried on: two orders (one with a card number, a holder
/// under the queue's mask path and a tenant header), a sealed job and a body in the store that
/// both hold `cus_42` where no search may look.
async fn park_search_records(client: &Client, ns: &str) {
    let queues: Api<DeadLetterQueue> = Api::namespaced(client.clone(), ns);
    queues
        .patch(
            "relayer",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"protection": {"mask": ["$.holder"]}}})),
        )
        .await
        .unwrap();
    for (id, payload, tenant) in [
        (
            "order/1",
            r#"{"customer":"cus_42","holder":"Ada Lovelace","pan":"4111111111111111"}"#,
            "acme",
        ),
        (
            "order/2",
            r#"{"customer":"cus_7","items":[{"sku":"A-1"}]}"#,
            "globex",
        ),
    ] {
        let mut job = Job::from_bytes(id, payload.as_bytes());
        job.headers.insert("X-Tenant".into(), tenant.into());
        let mut r = ParkRequest::new("relayer", job);
        r.reason = format!("timeout talking to payer for {id}");
        r.error_class = Some("PayerTimeout".into());
        park(client.clone(), ns, r).await.unwrap();
    }
    let (_, recipient) = dlq_core::seal::generate_identity();
    let secret = Job::from_bytes("sealed/1", br#"{"customer":"cus_42"}"#);
    let sealed = dlq_core::seal::seal(&secret, &recipient).unwrap();
    let mut stored = Job::from_bytes("stored/1", b"");
    stored.payload = None;
    stored.body = Some(Box::new(dlq_core::api::BodyRef {
        reference: "s3://bodies/relayer/cus_42".into(),
        size: 1 << 20,
        sha256: "ab".repeat(32),
        ..Default::default()
    }));
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    for job in [sealed, stored] {
        let req = ParkRequest::new("relayer", job);
        let r = dlq_core::park::new_record(&req, 1);
        records.create(&Default::default(), &r).await.unwrap();
    }
}

/// The job ids of `ls`'s rows (the first column), header left out.
fn listed(out: &Out) -> Vec<String> {
    assert!(out.ok, "{}", out.stderr);
    out.stdout
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect()
}

/// `ls --grep/--where` against a real apiserver: each field found as `show` prints it, card
/// numbers and the queue's mask paths never matched nor printed, sealed jobs and stored bodies
/// not searched and said so, clauses all holding, the limit counting matches, bad PATHs refused.
#[tokio::test]
async fn ls_searches_records_as_show_prints_them() {
    let (client, ns) = setup("cli-search").await;
    create_offline_queue(&client, &ns).await;
    park_search_records(&client, &ns).await;

    let found = dlq(&ns, &["ls", "--grep", "CUS_42"]);
    assert_eq!(listed(&found), ["order/1"], "{}", found.stdout);
    assert!(
        found
            .stdout
            .lines()
            .next()
            .unwrap_or_default()
            .ends_with("MATCH"),
        "{}",
        found.stdout
    );
    assert!(
        found
            .stdout
            .contains(r#"payload: {"customer":"cus_42","holder":"****""#)
    );
    assert!(
        found.stderr.contains("1 of 4 records match")
            && found
                .stderr
                .contains("1 sealed (payload and headers not searched)")
            && found
                .stderr
                .contains("1 with the payload in the body store (not fetched"),
        "{}",
        found.stderr
    );
    for (grep, want) in [
        ("4111111111111111", vec![]),
        ("ada lovelace", vec![]),
        ("411111******1111", vec!["order/1"]),
        ("x-tenant", vec!["order/1", "order/2"]),
        ("GLOBEX", vec!["order/2"]),
        ("payertimeout", vec!["order/1", "order/2"]),
        ("sealed/1", vec!["sealed/1"]),
    ] {
        let out = dlq(&ns, &["ls", "--grep", grep]);
        assert_eq!(listed(&out), want, "--grep {grep}: {}", out.stdout);
        assert!(!out.stdout.contains("4111111111111111") && !out.stdout.contains("Ada"));
    }
    for (wheres, want) in [
        (vec!["payload.customer=cus_42"], vec!["order/1"]),
        (vec!["payload.items[*].sku=A-1"], vec!["order/2"]),
        (vec!["headers.x-tenant=acme"], vec!["order/1"]),
        (vec!["job.id=order/2"], vec!["order/2"]),
        (
            vec!["errorClass=PayerTimeout", "payload.customer=cus_7"],
            vec!["order/2"],
        ),
        (
            vec!["errorClass=PayerTimeout", "headers.x-tenant=nobody"],
            vec![],
        ),
        (vec!["payload.pan=4111111111111111"], vec![]),
        (vec!["payload.holder=****"], vec!["order/1"]),
    ] {
        let mut args = vec!["ls"];
        for w in &wheres {
            args.extend(["--where", w]);
        }
        assert_eq!(listed(&dlq(&ns, &args)), want, "{wheres:?}");
    }
    searches_end_and_refuse_in_words(&client, &ns).await;
}

/// `--limit` counts matches, `-o json` carries exactly the matched records, and a bad search
/// exits 1 in words.
async fn searches_end_and_refuse_in_words(client: &Client, ns: &str) {
    let first = dlq(ns, &["ls", "--grep", "order/", "--limit", "1"]);
    assert_eq!(listed(&first).len(), 1, "{}", first.stdout);
    assert!(
        first.stderr.contains("stopped at --limit 1"),
        "{}",
        first.stderr
    );
    let json = dlq(
        ns,
        &["ls", "-o", "json", "--where", "payload.customer=cus_7"],
    );
    assert!(json.ok, "{}", json.stderr);
    let list: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    let items: Vec<DeadLetter> = serde_json::from_value(list["items"].clone()).unwrap();
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), ns);
    let live = api.get(&items[0].name_any()).await.unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].spec, live.spec, "the record itself");
    for (args, says) in [
        (vec!["--where", "customer=cus_42"], "PATH is one of job.id"),
        (vec!["--where", "payload.items[x]=1"], "not a JSON path"),
        (vec!["--where", "reason"], "is not PATH=VALUE"),
        (vec!["--grep", ""], "--grep needs some text"),
    ] {
        let out = dlq(ns, &[&["ls"][..], &args[..]].concat());
        assert!(
            !out.ok && out.stderr.contains(says),
            "{args:?}: {}",
            out.stderr
        );
    }
    let long = "x".repeat(257);
    let out = dlq(ns, &["ls", "--grep", &long]);
    assert!(
        !out.ok && out.stderr.contains("at most 256"),
        "{}",
        out.stderr
    );
}

/// A search reads every page (the first small, later ones larger, fetched ahead): 600 records
/// over more than one page, matches from all of them, and a record found by its whole payload.
#[tokio::test]
async fn ls_search_reads_every_page() {
    let (client, ns) = setup("cli-search-pages").await;
    create_offline_queue(&client, &ns).await;
    park_many(&client, &ns, 600).await;
    let some = dlq(
        &ns,
        &["ls", "--grep", "job 5", "--limit", "0", "--no-headers"],
    );
    assert!(some.ok, "{}", some.stderr);
    // job 5, job 50..59, job 500..599.
    assert_eq!(some.stdout.lines().count(), 111, "{}", some.stdout);
    assert!(
        some.stderr.contains("111 of 600 records match"),
        "{}",
        some.stderr
    );
    let one = dlq(&ns, &["ls", "--where", "payload=job 599"]);
    assert_eq!(listed(&one), ["bulk/599"], "{}", one.stdout);
}

/// `export` streams every fact of each record (the job as bytes, text masked; CSV too), and
/// `park --from` parks the export again in another namespace, keeping job ids, source message
/// identities, cycles and the exact job; a second run parks nothing twice.
#[tokio::test]
async fn export_then_park_from_moves_records_keeping_ids_identities_and_cycles() {
    use base64::Engine;
    let (client, ns) = setup("cli-export").await;
    create_offline_queue(&client, &ns).await;
    park_search_records(&client, &ns).await;
    let mut req = ParkRequest::new("relayer", Job::from_bytes("moved/1", b"\xff\x01"));
    req = req.with_message("dead#9");
    let third = dlq_core::park::new_record(&req, 3);
    let records: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    records.create(&Default::default(), &third).await.unwrap();

    let out = dlq(&ns, &["export"]);
    assert!(
        out.ok && out.stderr.contains("exported 5 records"),
        "{}",
        out.stderr
    );
    assert!(!out.stdout.contains("4111111111111111"), "{}", out.stdout);
    let lines: Vec<serde_json::Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    let order = lines.iter().find(|l| l["job"]["id"] == "order/1").unwrap();
    let engine = base64::engine::general_purpose::STANDARD;
    let payload = engine
        .decode(order["job"]["payloadBase64"].as_str().unwrap())
        .unwrap();
    assert!(
        String::from_utf8(payload)
            .unwrap()
            .contains("4111111111111111"),
        "bytes exact"
    );
    let csv = dlq(&ns, &["export", "--format", "csv", "--queue", "relayer"]);
    assert_eq!(csv.stdout.lines().count(), 6, "{}", csv.stdout);
    assert!(csv.stdout.starts_with("namespace,name,queue,job_id,cycle,"));
    assert_eq!(dlq(&ns, &["export", "--queue", "other"]).stdout, "");

    let (_, to) = setup("cli-import").await;
    create_offline_queue(&client, &to).await;
    let file = std::env::temp_dir().join(format!("{ns}.ndjson"));
    std::fs::write(&file, &out.stdout).unwrap();
    let from = file.to_str().unwrap();
    let parked = dlq(&to, &["park", "--from", from]);
    assert!(parked.ok, "{}", parked.stderr);
    let said = "4 parked, 0 already had their record here, 0 resolved records skipped, 1 sealed";
    assert!(parked.stderr.contains(said), "{}", parked.stderr);
    let moved: Api<DeadLetter> = Api::namespaced(client.clone(), &to);
    for r in records.list(&ListParams::default()).await.unwrap().items {
        if r.spec.job.sealed.is_some() {
            assert!(moved.get_opt(&r.name_any()).await.unwrap().is_none());
            continue;
        }
        let there = moved.get(&r.name_any()).await.unwrap();
        assert_eq!(there.spec.job, r.spec.job, "the job, exactly");
        assert_eq!(there.spec.cycle, r.spec.cycle);
        assert_eq!(
            there
                .annotations()
                .get(dlq_core::api::ANNOTATION_SOURCE_MESSAGE),
            r.annotations()
                .get(dlq_core::api::ANNOTATION_SOURCE_MESSAGE)
        );
    }
    let again = dlq(&to, &["park", "--from", from]);
    assert!(
        again.stderr.contains("0 parked, 4 already"),
        "{}",
        again.stderr
    );
    std::fs::remove_file(&file).unwrap();
}

/// Issue 59 item 1: `kubectl dlq approve` appends an approval in the caller's own name (who the
/// apiserver says they are), with its note; the author cannot approve, nor anyone twice.
#[tokio::test]
async fn approve_appends_an_approval_in_the_callers_name_once() {
    let (client, ns) = setup("cli-approve").await;
    let rbac = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: approver, namespace: {ns}}}\nrules:\n- apiGroups: [dlq.dev]\n  resources: [deadletterreplays]\n  verbs: [get, list, watch, patch]\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: approvers, namespace: {ns}}}\nroleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: approver}}\nsubjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: alice}}, {{apiGroup: rbac.authorization.k8s.io, kind: User, name: bob}}]\n"
    );
    let mut apply = dlq_testenv::plane().kubectl();
    apply
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null());
    let mut child = apply.spawn().unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), rbac.as_bytes()).unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let replays = dlq_testenv::replays::replays(&client, &ns);
    replays
        .create(
            &Default::default(),
            &dlq_testenv::replays::replay("inc-1", "alice"),
        )
        .await
        .unwrap();

    let first = eventually(10, "bob's role to take effect", || async {
        let out = dlq(
            &ns,
            &[
                "--as",
                "bob",
                "approve",
                "inc-1",
                "--note",
                "INC-1 reviewed",
            ],
        );
        (!out.stdout.contains("forbidden") && !out.stderr.contains("forbidden")).then_some(out)
    })
    .await;
    assert!(first.ok, "{} {}", first.stdout, first.stderr);
    assert!(
        first.stdout.starts_with("replay inc-1 approved by bob."),
        "{}",
        first.stdout
    );
    let stored = replays.get("inc-1").await.unwrap();
    let approvals = &stored.data["spec"]["approvals"];
    assert_eq!(approvals.as_array().map(Vec::len), Some(1), "{approvals}");
    assert_eq!(approvals[0]["by"], "bob");
    assert_eq!(approvals[0]["note"], "INC-1 reviewed");
    assert!(
        approvals[0]["at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );

    let twice = dlq(&ns, &["--as", "bob", "approve", "inc-1"]);
    assert!(!twice.ok, "a second approval by bob must exit non-zero");
    assert!(
        twice
            .stderr
            .contains("you (bob) already approved replay inc-1"),
        "{}",
        twice.stderr
    );
    let own = dlq(&ns, &["--as", "alice", "approve", "inc-1"]);
    assert!(!own.ok);
    assert!(
        own.stderr
            .contains("you (alice) wrote replay inc-1: an approval must come from someone else"),
        "{}",
        own.stderr
    );
    let ghost = dlq(&ns, &["--as", "bob", "approve", "nope"]);
    assert!(!ghost.ok);
    assert_eq!(
        replays.get("inc-1").await.unwrap().data["spec"]["approvals"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
}

/// Issue 59 item 1, end to end with the operator: a queue requiring one approval above 2
/// records. A replay of 2 runs at once; one of 3 waits (the command says so and how to approve,
/// exiting non-zero) and redrives nothing; another person's `kubectl dlq approve` lets it run,
/// and each record it signs names the approver.
#[tokio::test]
async fn a_replay_above_the_threshold_waits_for_another_persons_approval() {
    let (client, ns) = setup("cli-approval").await;
    let redis = Redis::start();
    let policy = json!({"approvals": {"required": 1, "above": 2, "expireAfter": "1h"}});
    create_queue(&client, &ns, &redis.url(), list_target(), policy).await;
    park_many(&client, &ns, 5).await;
    let _op = Operator::start(&ns);
    let redrive = |max: &'static str| {
        let ns = ns.clone();
        move || {
            dlq(
                &ns,
                &[
                    "redrive", "--queue", "relayer", "--max", max, "--rate", "100/s", "--by",
                    "alice", "--note", "INC-59",
                ],
            )
        }
    };
    let small = redrive("2")();
    assert!(small.ok, "{}\n{}", small.stdout, small.stderr);
    assert!(
        small.stdout.contains("selected 2, decided 2, redriven 2"),
        "{}",
        small.stdout
    );

    let waits = redrive("3")();
    assert!(!waits.ok, "a replay awaiting approval exits non-zero");
    assert!(
        waits
            .stderr
            .contains("waits (awaiting approval: 0 of 1 approvals"),
        "{}",
        waits.stderr
    );
    let name = waits
        .stderr
        .split("replay ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap_or_default()
        .to_string();
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(
        redis.list(LIST).await.len(),
        2,
        "nothing more before approval"
    );

    // The test's admin user is not alice: its approval counts.
    let approved = dlq(&ns, &["approve", &name, "--note", "INC-59 reviewed"]);
    assert!(approved.ok, "{}\n{}", approved.stdout, approved.stderr);
    eventually(30, "the approved replay's 3 jobs on the target", || async {
        (redis.list(LIST).await.len() == 5).then_some(())
    })
    .await;
    let api: Api<DeadLetter> = Api::namespaced(client.clone(), &ns);
    let notes: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|r| r.labels().get("dlq.dev/replay") == Some(&name))
        .filter_map(|r| r.spec.note)
        .collect();
    assert_eq!(notes.len(), 3, "{notes:?}");
    assert!(
        notes
            .iter()
            .all(|n| n.starts_with(&format!("replay {name} (approved by "))
                && n.ends_with("): INC-59")),
        "{notes:?}"
    );
    let events: Api<Event> = Api::namespaced(client, &ns);
    eventually(10, "the Approved Event", || async {
        events
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("Approved"))
    })
    .await;
}
