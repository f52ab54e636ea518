//! `BENCH_PHASES=seal` (part of the default run): payload sealing (issue 32) on against off in
//! one run, so the machine's drift falls on both alike.
//!
//! - park: `park()` of `BENCH_SEAL_N` (default N) jobs of 1 KiB into a queue that seals against
//!   one that does not (the sealed queue's recipient is in its status as the operator publishes
//!   it), in `BENCH_SEAL_ROUNDS` (default 2) rounds whose order alternates; and, to tell the
//!   record's growth from the sealing's CPU, plain jobs as large as the sealed ciphertext;
//! - redrive: the operator redriving N / 2 sealed records (opened with the queue's key, read
//!   from its Secret) against N / 2 plaintext ones, same rounds;
//! - cost per record: `dlq_core::seal::seal` and `open_job` in this process, in microseconds, at
//!   64 B, 1 KiB and 64 KiB.
//!
//! A ratio is sealed over plaintext; the goal is within 5 points of 1.

use super::*;

/// Payload of the park and redrive runs.
const SEAL_PAYLOAD: usize = 1024;

/// Rows and JSON of the seal phase.
pub async fn run(
    b: &mut Bench,
    n: usize,
    rounds: usize,
) -> anyhow::Result<(Vec<(String, String, String, String)>, serde_json::Value)> {
    let park_n = env_usize("BENCH_SEAL_N", n);
    let rounds = env_usize("BENCH_SEAL_ROUNDS", rounds.min(2)).max(1);
    let redrive_n = (park_n / 2).max(1);
    let mut runs = Rounds::default();
    let sized = sealed_size();
    for round in 0..rounds {
        for sealed in [round % 2 == 1, round % 2 == 0] {
            let label = if sealed { "park-sealed" } else { "park-plain" };
            runs.add(
                label,
                park_n,
                park_run(b, sealed, park_n, SEAL_PAYLOAD).await?,
            );
        }
        runs.add(
            "park-plain-sized",
            park_n,
            park_run(b, false, park_n, sized).await?,
        );
        for sealed in [round % 2 == 0, round % 2 == 1] {
            let label = if sealed {
                "redrive-sealed"
            } else {
                "redrive-plain"
            };
            runs.add(label, redrive_n, redrive_run(b, sealed, redrive_n).await?);
        }
    }
    let (park_on, park_off) = (runs.rate("park-sealed"), runs.rate("park-plain"));
    let (redrive_on, redrive_off) = (runs.rate("redrive-sealed"), runs.rate("redrive-plain"));
    let park_sized = runs.rate("park-plain-sized");
    eprintln!(
        "seal: park {park_on:.0}/s sealed vs {park_off:.0}/s plain; redrive {redrive_on:.0}/s sealed vs {redrive_off:.0}/s plain; over {rounds} rounds: {}",
        runs.each()
    );
    let costs = micro();
    let mut rows = vec![
        ratio_row(
            "park() of 1 KiB, sealed vs plain (records/s)",
            park_on,
            park_off,
        ),
        ratio_row(
            &format!("park() plain of {sized} B (the sealed size) vs 1 KiB"),
            park_sized,
            park_off,
        ),
        ratio_row(
            "redrive of 1 KiB, sealed vs plain (records/s)",
            redrive_on,
            redrive_off,
        ),
    ];
    for (size, seal_us, open_us) in &costs {
        eprintln!("seal: {size} B payload: seal {seal_us:.1} us, open {open_us:.1} us per record");
        rows.push((
            format!("seal / open per record, {size} B payload (us)"),
            format!("{seal_us:.1}"),
            format!("{open_us:.1}"),
            "-".into(),
        ));
    }
    let json = json!({
        "park": {"n": park_n, "rounds": rounds, "sealed_per_s": park_on, "plain_per_s": park_off, "ratio": park_on / park_off,
                 "plain_at_sealed_size": {"bytes": sized, "per_s": park_sized, "ratio": park_sized / park_off}},
        "redrive": {"n": redrive_n, "rounds": rounds, "sealed_per_s": redrive_on, "plain_per_s": redrive_off, "ratio": redrive_on / redrive_off},
        "cost_us": costs.iter().map(|(size, s, o)| json!({"payload": size, "seal_us": s, "open_us": o})).collect::<Vec<_>>(),
        "each": runs.json(),
    });
    Ok((rows, json))
}

/// A namespace whose queue seals: a fresh identity in Secret `seal` named as the queue's
/// identity, and its status recipient written as the operator publishes it (park runs start no
/// operator).
async fn sealed_namespace(b: &mut Bench, prefix: &str) -> anyhow::Result<(String, String)> {
    let ns = b.namespace(prefix).await?;
    let (identity, recipient) = dlq_core::seal::generate_identity();
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "seal"}, "stringData": {"identity": identity}});
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(b.client.clone(), &ns)
        .create(&PostParams::default(), &serde_json::from_value(secret)?)
        .await?;
    let queues: Api<dlq_core::api::DeadLetterQueue> = Api::namespaced(b.client.clone(), &ns);
    let keys = json!({"spec": {"protection": {"seal": {"identitySecretRef": {"name": "seal"}}}}});
    queues
        .patch("relayer", &PatchParams::default(), &Patch::Merge(&keys))
        .await?;
    let status = json!({"status": {"protection": {"recipient": recipient}}});
    queues
        .patch_status("relayer", &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok((ns, recipient))
}

/// How many bytes a job of [`SEAL_PAYLOAD`] takes sealed: its ciphertext, as the apiserver
/// stores it.
fn sealed_size() -> usize {
    let (_, recipient) = dlq_core::seal::generate_identity();
    let job = Job::from_bytes("bench/size", "x".repeat(SEAL_PAYLOAD).as_bytes());
    dlq_core::seal::seal(&job, &recipient)
        .ok()
        .and_then(|j| j.sealed.map(|s| s.ciphertext.len()))
        .unwrap_or(SEAL_PAYLOAD)
}

/// `park()` of `n` jobs of `size` bytes into a sealing (or plain) queue: records/s.
async fn park_run(b: &mut Bench, sealed: bool, n: usize, size: usize) -> anyhow::Result<f64> {
    let ns = if sealed {
        sealed_namespace(b, "seal-park").await?.0
    } else {
        b.namespace("plain-park").await?
    };
    let kind = if sealed { "sealed" } else { "plain" };
    let label = format!("seal, park {kind} of {size} B");
    let profiled = super::profile::Profiled::start(&b.plane, &label, None);
    let rate = park_all(&b.client, &ns, n, b.c, size).await?;
    profiled.end(&b.plane, n).await;
    clear(&b.client, &ns).await?;
    Ok(rate)
}

/// The operator's redrive of `n` records of [`SEAL_PAYLOAD`], sealed (or not): records/s.
async fn redrive_run(b: &mut Bench, sealed: bool, n: usize) -> anyhow::Result<f64> {
    if !sealed {
        let ns = b.namespace("plain-redrive").await?;
        create_plain(&b.client, &ns, n, b.c, SEAL_PAYLOAD).await?;
        return redrive_in(b, &ns, n, &[], "redrive, plain").await;
    }
    let (ns, recipient) = sealed_namespace(b, "seal-redrive").await?;
    let api: Api<DeadLetter> = Api::namespaced(b.client.clone(), &ns);
    let pp = as_parker();
    let results: Vec<anyhow::Result<DeadLetter>> = futures::stream::iter(0..n)
        .map(|i| {
            let (api, pp, recipient) = (&api, &pp, &recipient);
            async move {
                let mut r = plain_record(i, SEAL_PAYLOAD, false);
                r.spec.job = dlq_core::seal::seal(&r.spec.job, recipient)?;
                Ok(api.create(pp, &r).await?)
            }
        })
        .buffer_unordered(b.c)
        .collect()
        .await;
    for r in results {
        r?;
    }
    redrive_in(b, &ns, n, &[], "redrive, sealed").await
}

/// Seal and open cost per record in this process, in microseconds: (payload bytes, seal, open).
fn micro() -> Vec<(usize, f64, f64)> {
    let (identity, recipient) = dlq_core::seal::generate_identity();
    let mut keys = dlq_core::seal::Keyring::default();
    if keys.add(&identity).is_err() {
        return Vec::new();
    }
    [64usize, 1024, 65536]
        .into_iter()
        .map(|size| {
            let iterations = if size > 4096 { 200 } else { 2000 };
            let mut job = Job::from_bytes("bench/cost", "x".repeat(size).as_bytes());
            job.headers.insert("x-trace".into(), "abc".into());
            let start = Instant::now();
            let mut sealed = job.clone();
            for _ in 0..iterations {
                sealed = dlq_core::seal::seal(&job, &recipient).unwrap_or_default();
            }
            let seal_us = start.elapsed().as_secs_f64() * 1e6 / iterations as f64;
            let start = Instant::now();
            for _ in 0..iterations {
                let opened = dlq_core::seal::open_job(&sealed, &keys);
                assert!(
                    opened.is_ok_and(|o| o == job),
                    "a sealed job opens to itself"
                );
            }
            let open_us = start.elapsed().as_secs_f64() * 1e6 / iterations as f64;
            (size, seal_us, open_us)
        })
        .collect()
}
