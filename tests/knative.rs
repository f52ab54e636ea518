//! Knative Eventing end to end (issue 33): a Trigger whose subscriber always fails and whose
//! `deadLetterSink` is a DeadLetterQueue. Knative's own controllers, broker and in-memory
//! channel, built from their Go module (`tools/build.sh knative`), resolve the queue as an
//! Addressable and, once the subscriber has refused the event twice, POST it to the operator's
//! park endpoint, which parks it.
//!
//! The scenario is `tests/knative/eventing.sh`, run in its own network, mount and PID
//! namespaces (loopback only, a private /etc/hosts for Knative's Service names, nothing left
//! running after it); this test builds the tools first (the namespace has no network) and checks
//! the record it leaves. Needs root, `unshare`, `iptables`, `openssl`, `curl` and `python3`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long the scenario may take (it takes about 30 s).
const SCENARIO: Duration = Duration::from_secs(240);

fn tools() -> (Vec<PathBuf>, PathBuf, PathBuf) {
    let dirs = dlq_testenv::plane::tool_dirs(&["kube", "etcd", "knative"])
        .expect("building kube, etcd and Knative Eventing (tools/build.sh)");
    let knative = dirs
        .iter()
        .find(|d| d.join("channel_dispatcher").is_file())
        .and_then(|d| d.parent())
        .expect("tools/build.sh knative printed no directory with the dispatcher")
        .to_path_buf();
    let kubectl = dirs
        .iter()
        .map(|d| d.join("kubectl"))
        .find(|p| p.is_file())
        .expect("tools/build.sh kube built no kubectl");
    (dirs, knative, kubectl)
}

/// Runs the scenario into `out`; panics with its output and the logs' tails when it fails.
fn run_scenario(out: &Path) {
    let (dirs, knative, kubectl) = tools();
    let root = dlq_testenv::paths::workspace_root();
    let mut child = Command::new("unshare")
        .args([
            "--mount",
            "--net",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
        ])
        .arg("bash")
        .arg(root.join("tests/knative/eventing.sh"))
        .env("OUT", out)
        .env("KNATIVE", &knative)
        .env("KUBECTL", &kubectl)
        .env("TESTENV", dlq_testenv::paths::bin("dlq-testenv"))
        .env("OPERATOR", dlq_testenv::paths::bin("deadletter-operator"))
        .env("CRDS", root.join("crds/dlq.dev.yaml"))
        .env(
            "DLQ_TOOLS_BIN",
            std::env::join_paths(&dirs).expect("tool dirs"),
        )
        .env("RUST_LOG", "info")
        .stdout(std::fs::File::create(out.join("scenario.out")).expect("scenario.out"))
        .stderr(std::fs::File::create(out.join("scenario.err")).expect("scenario.err"))
        .spawn()
        .expect("running unshare (util-linux) for the scenario's namespaces");
    let deadline = Instant::now() + SCENARIO;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the scenario") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if status.is_some_and(|s| s.success()) {
        return;
    }
    let mut report = format!(
        "the Knative scenario failed ({status:?}) in {}\n",
        out.display()
    );
    for log in [
        "scenario.out",
        "scenario.err",
        "operator.log",
        "imc-dispatcher.log",
        "mt-broker-controller.log",
        "controller.log",
    ] {
        let text = std::fs::read_to_string(out.join(log)).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(8).collect();
        report.push_str(&format!("--- {log}\n"));
        for line in tail.into_iter().rev() {
            report.push_str(&format!("{}\n", line.chars().take(400).collect::<String>()));
        }
    }
    panic!("{report}");
}

#[test]
fn a_triggers_dead_letter_sink_that_is_a_queue_parks_the_event_knative_gave_up_on() {
    // SAFETY: geteuid has no preconditions.
    assert!(
        unsafe { libc::geteuid() } == 0,
        "tests/knative needs root (a network and a mount namespace, iptables)"
    );
    let out = dlq_testenv::paths::target_tmp_dir().join(format!("knative-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("scratch dir");
    run_scenario(&out);

    // The queue is Addressable: Knative resolved the sink from this.
    let address: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("address.json")).unwrap()).unwrap();
    assert_eq!(
        address["url"],
        "https://127.0.0.1:19443/v1/namespaces/kn/queues/relayer"
    );
    assert_eq!(address["audience"], "/v1/namespaces/kn/queues/relayer");
    // ...and the endpoint's CA, which Knative carried to the channel's dispatcher (it trusts no
    // other way here).
    let ca = std::fs::read_to_string(out.join("ca.crt")).unwrap();
    assert_eq!(address["CACerts"], ca.trim_end().to_string() + "\n");
    let delivery: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("delivery.json")).unwrap()).unwrap();
    assert_eq!(
        delivery["deadLetterSink"]["CACerts"], address["CACerts"],
        "{delivery}"
    );

    // The subscriber refused the event twice (retry: 1) before Knative gave up on it.
    let attempts = std::fs::read_to_string(out.join("attempts")).unwrap_or_default();
    assert_eq!(attempts.len(), 2, "the subscriber's attempts: {attempts:?}");

    let list: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("record.json")).unwrap()).unwrap();
    let records = list["items"].as_array().expect("a list");
    assert_eq!(records.len(), 1, "one record: {list}");
    let r = &records[0];
    let (spec, job) = (&r["spec"], &r["spec"]["job"]);
    assert_eq!(spec["queue"], "relayer");
    assert_eq!(r["status"]["phase"], "Parked", "{r}");
    // The event untouched: its id and source name the job, the data is the payload byte for
    // byte, the attributes are the headers.
    assert_eq!(job["id"], "pi_0003-settle@/payments/relayer");
    assert_eq!(job["payload"], r#"{"intent":"pi_0003","ref":"settle"}"#);
    let headers = &job["headers"];
    assert_eq!(headers["ce-type"], "payment.settle");
    assert_eq!(headers["ce-id"], "pi_0003-settle");
    assert_eq!(headers["content-type"], "application/json");
    // Knative's error attributes: the code and the destination kept, the reason from the data.
    assert_eq!(headers["ce-knativeerrorcode"], "500");
    assert_eq!(headers["ce-knativeerrordest"], "http://127.0.0.1:19999/");
    assert_eq!(spec["errorClass"], "HTTP 500");
    let reason = spec["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("http://127.0.0.1:19999/") && reason.contains("payer down"),
        "{reason}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
