//! What one parked record costs the operator's memory, counted by the allocator: the record as
//! the apiserver sends it (managed fields, labels, annotations, a condition, a 1 KiB payload)
//! goes through the job index, the record index and the records controller's feeder, as the
//! record watch does. Allocation counts do not depend on the machine's speed, so this is a budget,
//! not a timing: 100,000 records are 100,000 times this figure. And what keeping one large
//! sealed body holds at once beside it, sealed whole against sealed on its way up, and
//! what opening it holds on its way out.

use deadletter::run::feeder::Feeder;
use deadletter::state::jobs::JobIndex;
use deadletter::state::records::RecordIndex;
use dlq_core::api::DeadLetter;
use dlq_testenv::alloc::{self, Counting};
use kube::runtime::{reflector, watcher};

/// The tests count the whole process: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const RECORDS: usize = 10_000;

/// Record `i` as a watch event carries it once the operator marked it Parked.
fn watched(i: usize) -> String {
    let payload = "x".repeat(1024);
    let managed = r#"[{"manager":"relayer","operation":"Update","apiVersion":"dlq.dev/v1alpha1","time":"2026-12-01T10:00:00Z","fieldsType":"FieldsV1","fieldsV1":{"f:metadata":{"f:labels":{".":{},"f:dlq.dev/job-key":{},"f:dlq.dev/queue":{}}},"f:spec":{".":{},"f:cycle":{},"f:job":{".":{},"f:id":{},"f:payload":{}},"f:queue":{}}}},{"manager":"deadletter-operator","operation":"Update","apiVersion":"dlq.dev/v1alpha1","time":"2026-12-01T10:00:01Z","fieldsType":"FieldsV1","fieldsV1":{"f:status":{".":{},"f:conditions":{},"f:phase":{}}},"subresource":"status"}]"#;
    format!(
        r#"{{"apiVersion":"dlq.dev/v1alpha1","kind":"DeadLetter",
        "metadata":{{"name":"relayer-order-{i:06}-1-5f3a9c21","namespace":"payments",
            "uid":"6f1c9a52-1c1e-4d0b-9a43-0d5b6c{i:06}","resourceVersion":"{rv}","generation":1,
            "creationTimestamp":"2026-12-01T10:00:00Z",
            "labels":{{"dlq.dev/queue":"relayer","dlq.dev/failure-kind":"transient",
                "dlq.dev/job-key":"0123456789abcdef0123456789abcdef{i:08}"}},
            "annotations":{{"dlq.dev/slot-block":"b-17","dlq.dev/source-message":"redis/relayer:dead/{i}"}},
            "managedFields":{managed}}},
        "spec":{{"queue":"relayer","cycle":1,"job":{{"id":"order-{i:06}","payload":"{payload}"}},
            "deliveries":3,"reason":"payment provider timed out","failureKind":"Transient",
            "failedAt":"2026-12-01T10:00:00Z"}},
        "status":{{"phase":"Parked","observedGeneration":1,"conditions":[{{"type":"Parked",
            "status":"True","reason":"Parked","message":"waiting for a decision",
            "observedGeneration":1,"lastTransitionTime":"2026-12-01T10:00:01Z"}}]}}}}"#,
        rv = 1_000_000 + i
    )
}

/// Bytes held per record once `RECORDS` records have been listed through `keep`.
fn held_per_record(keep: impl FnOnce(&[String]) -> Box<dyn std::any::Any>) -> usize {
    let events: Vec<String> = (0..RECORDS).map(watched).collect();
    // Once per process, not per record: the failure-group masks (compiled regexes, built on
    // first use, and this thread's search cache) are made before counting starts.
    if let Some(first) = events.first() {
        let _ = dlq_core::record::Facts::group(&parsed(first));
    }
    let before = alloc::held();
    let kept = keep(&events);
    let held = alloc::held() - before;
    drop(kept);
    usize::try_from(held).unwrap_or(0) / RECORDS
}

fn parsed(text: &str) -> DeadLetter {
    serde_json::from_str(text).expect("a record")
}

/// The records whole in a reflector store, as kube's controllers keep them.
fn whole(events: &[String]) -> Box<dyn std::any::Any> {
    let (store, mut writer) = reflector::store::<DeadLetter>();
    writer.apply_watcher_event(&watcher::Event::Init);
    for text in events {
        writer.apply_watcher_event(&watcher::Event::InitApply(parsed(text)));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    assert_eq!(store.len(), RECORDS);
    Box::new(store)
}

/// The records through the operator's record watch: the job index, the record index, and the
/// records controller's feeder (which holds none of them: they wait for a decision).
fn operator(events: &[String]) -> Box<dyn std::any::Any> {
    let (store, writer) = reflector::store::<DeadLetter>();
    let (wakes, woken) = futures::channel::mpsc::unbounded();
    let (queue_wakes, queues) = futures::channel::mpsc::unbounded();
    let jobs = JobIndex::default();
    let index = RecordIndex::default();
    let mut feeder = Feeder::new(writer, index.clone(), wakes, queue_wakes);
    let mut apply = |event: watcher::Event<DeadLetter>| {
        jobs.observe(&event);
        index.observe(&event);
        feeder.observe(event);
    };
    apply(watcher::Event::Init);
    for text in events {
        apply(watcher::Event::InitApply(parsed(text)));
    }
    apply(watcher::Event::InitDone);
    assert_eq!(index.len(), RECORDS);
    assert_eq!(
        store.len(),
        0,
        "records waiting for a decision are not held whole"
    );
    drop((woken, queues));
    Box::new((store, feeder, jobs, index))
}

/// What is left: the summary (name, uid, resourceVersion, job id, reason, error class,
/// timestamps; the namespace, queue, failure group and slot block shared), its place in the
/// index and the job index. (A reflector store of stripped records held 2,193 bytes a record,
/// 2,027 once a waiting record's conditions were dropped; the record index held 816, and 873
/// once failure groups added the group's shared name and the error class to each summary;
/// 864 once the failure-group masks' one-time regexes were built before counting, not spread over
/// the records as 6 bytes each.)
const BUDGET: usize = 896;

#[test]
fn a_parked_record_costs_the_operator_at_most_its_budget() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let whole = held_per_record(whole);
    let kept = held_per_record(operator);
    println!(
        "bytes per parked record: {whole} in a reflector store, {kept} in the operator ({}%); DeadLetter inline {}, Summary inline {}",
        kept * 100 / whole,
        std::mem::size_of::<DeadLetter>(),
        std::mem::size_of::<dlq_core::record::Summary>()
    );
    assert!(
        kept <= BUDGET,
        "a parked record costs the operator {kept} bytes (budget {BUDGET}): see state::records"
    );
}

/// Runs `test` on a runtime of two workers, one such test at a time (they count the process).
fn serially(test: impl std::future::Future<Output = ()>) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(test);
}

/// The most the process held beside what it held when `run` started, while it ran.
async fn peak_while<F: std::future::Future>(run: F) -> (F::Output, isize) {
    let before = alloc::start_peak();
    let out = run.await;
    (out, alloc::peak_above(before))
}

/// A body of 32 MiB kept in a sealing queue's store (a volume here): sealed on its way up, it
/// holds a few parts beside the plaintext (the part being filled and those being sent), not a
/// second copy of it as ciphertext. Sealed whole first (as before), measured in the same run.
#[test]
fn a_large_sealed_body_is_never_held_twice_on_its_way_to_the_store() {
    serially(a_large_sealed_body_kept());
}

/// A volume store in `dir`.
fn volume(dir: &std::path::Path) -> deadletter::body::BodyStore {
    std::fs::create_dir_all(dir).expect("a scratch directory");
    let fs = object_store::local::LocalFileSystem::new_with_prefix(dir).expect("a directory");
    let spec = dlq_core::api::BodiesSpec {
        volume: Some(dlq_core::api::VolumeBodies {
            path: dir.display().to_string(),
        }),
        ..Default::default()
    };
    deadletter::body::BodyStore::new(std::sync::Arc::new(fs), spec)
}

async fn a_large_sealed_body_kept() {
    let dir = std::env::temp_dir().join(format!("dlq-held-sealed-{}", std::process::id()));
    let store = volume(&dir);
    let (_, recipient) = dlq_core::seal::generate_identity();
    let plain = bytes::Bytes::from(vec![7u8; 32 << 20]);

    let (whole, whole_peak) = peak_while(async {
        let sealed = dlq_core::seal::seal_body("j", &plain, &recipient).expect("sealed");
        store
            .put(bytes::Bytes::from(sealed), Some(&recipient))
            .await
    })
    .await;
    drop(whole.expect("kept, sealed whole"));
    let (streamed, peak) = peak_while(store.put_sealed(plain.clone(), "j", &recipient)).await;
    drop(streamed.expect("kept, sealed on its way up"));
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "a sealed body of {} MiB held {:.1} MiB beside it sealed on its way up, {:.1} MiB sealed whole",
        plain.len() >> 20,
        peak as f64 / 1048576.0,
        whole_peak as f64 / 1048576.0
    );
    assert!(
        whole_peak >= plain.len() as isize,
        "the baseline holds its ciphertext"
    );
    assert!(
        peak < (plain.len() / 2) as isize,
        "held {peak} bytes beside a body of {}",
        plain.len()
    );
}

/// A sealed body of 32 MiB opened from the store as a redrive and a reveal read it: opened as
/// it streams in, a redrive holds the plaintext it sends and a chunk, and a reveal a chunk;
/// fetched whole and then opened (as before), both the ciphertext and the plaintext, measured
/// in the same run.
#[test]
fn a_large_sealed_body_is_never_held_twice_on_its_way_out() {
    serially(a_large_sealed_body_opened());
}

async fn a_large_sealed_body_opened() {
    use futures::{AsyncReadExt, StreamExt};
    let dir = std::env::temp_dir().join(format!("dlq-held-opened-{}", std::process::id()));
    let store = volume(&dir);
    let (file, recipient) = dlq_core::seal::generate_identity();
    let mut keys = dlq_core::seal::Keyring::default();
    keys.add(&file).expect("a key");
    let plain = bytes::Bytes::from(vec![7u8; 32 << 20]);
    let kept = store
        .put_sealed(plain.clone(), "j", &recipient)
        .await
        .expect("kept");
    let want = kept.body.clone();
    drop(kept);

    let (whole, whole_peak) = peak_while(async {
        let sealed = store.fetch("j", &want).await.expect("fetched");
        let mut reader = dlq_core::seal::body_reader("j", &sealed[..], &recipient, &keys)
            .await
            .expect("a reader");
        let mut opened = Vec::with_capacity(sealed.len());
        reader.read_to_end(&mut opened).await.map(|_| opened)
    })
    .await;
    assert!(whole.expect("opened whole") == plain, "the exact bytes");
    let (redriven, redrive_peak) =
        peak_while(store.fetch_opened("j", &want, &recipient, &keys)).await;
    assert!(redriven.expect("opened") == plain, "the exact bytes");
    let (revealed, reveal_peak) = peak_while(async {
        let mut chunks = store.plaintext("j", &want, &keys).await.expect("a stream");
        let mut len = 0;
        while let Some(chunk) = chunks.next().await {
            len += chunk.expect("a chunk").len();
        }
        len
    })
    .await;
    assert_eq!(revealed, plain.len());
    let _ = std::fs::remove_dir_all(&dir);
    let mib = |n: isize| n as f64 / 1048576.0;
    println!(
        "a sealed body of {} MiB: opened whole held {:.1} MiB, a redrive {:.1} MiB, a reveal {:.1} MiB",
        plain.len() >> 20,
        mib(whole_peak),
        mib(redrive_peak),
        mib(reveal_peak)
    );
    let len = plain.len() as isize;
    assert!(
        whole_peak >= 2 * len,
        "the baseline holds ciphertext and plaintext"
    );
    assert!(
        redrive_peak < len + len / 4,
        "a redrive held {redrive_peak} bytes for a body of {len}"
    );
    assert!(
        reveal_peak < len / 8,
        "a reveal held {reveal_peak} bytes for a body of {len}"
    );
}
