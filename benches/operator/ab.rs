//! `BENCH_PHASES=ab` (part of the default run): what each throughput mechanism buys, as the same
//! build with it and without it (the operator's hidden `--disable`, the parker's
//! `ParkOptions`) in one run, so that the machine's drift and noise fall on both alike.
//!
//! Each phase runs its variants (every mechanism on, then each of its mechanisms off) in
//! `BENCH_AB_ROUNDS` (default 2) rounds whose order reverses every other round, the phase's
//! ceiling measured in the middle of each round; a variant's rate is its records over its
//! seconds across the rounds. What a mechanism buys is `(with − without) / ceiling`, in
//! points. The memory phase runs in rounds too (its marks a second drift as any rate does);
//! its peak RSS is the mean over the rounds.
//!
//! `BENCH_AB_N` (default 2000) sizes the runs: a storm of 2 N messages into `maxParked` N, 2 N
//! parks through the sources' path, a redrive of N / 2; `BENCH_AB_MEMORY` (default 5000)
//! unmarked records of 1 KiB for the mark quota's memory (and the marks a second, with and
//! without). `BENCH_AB_PHASES` (a
//! comma list of storm, park, redrive, memory; default all) runs only those.

use super::*;

/// A phase that exercises some of the mechanisms.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// A Redis dead list drained by the operator's source into a queue with a `maxParked`.
    Storm,
    /// The sources' parking path in this process (job index, `park_known`).
    Park,
    /// A bulk redrive by the operator.
    Redrive,
    /// The operator's peak RSS while it marks records that existed before it started.
    Memory,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Storm => "storm",
            Phase::Park => "park",
            Phase::Redrive => "redrive",
            Phase::Memory => "memory",
        }
    }

    /// The mechanisms this phase switches off, one variant each.
    fn mechanisms(self) -> &'static [&'static str] {
        match self {
            Phase::Storm => &["parking_first", "mark_quota", "ask_ahead"],
            Phase::Park => &["ask_ahead"],
            Phase::Redrive => &["aggregation"],
            Phase::Memory => &["mark_quota"],
        }
    }
}

/// Every mechanism on.
const ON: &str = "on";

/// The sizes of the A/B's runs.
#[derive(Clone, Copy)]
struct Sizes {
    storm_max: usize,
    park: usize,
    redrive: usize,
    memory: usize,
}

impl Sizes {
    fn from_env() -> Sizes {
        let n = env_usize("BENCH_AB_N", 2000).max(2);
        Sizes {
            storm_max: n,
            park: 2 * n,
            redrive: n / 2,
            memory: env_usize("BENCH_AB_MEMORY", 5000),
        }
    }

    fn records(self, phase: Phase) -> usize {
        match phase {
            Phase::Storm => self.storm_max,
            Phase::Park => self.park,
            Phase::Redrive => self.redrive,
            Phase::Memory => self.memory,
        }
    }
}

/// One variant's run: records/s, and the operator's peak RSS where one ran.
struct Outcome {
    rate: f64,
    peak_mib: Option<f64>,
}

/// One run of `phase` with the mechanism `off` switched off (none for [`ON`]).
async fn once(b: &mut Bench, phase: Phase, sizes: Sizes, off: &str) -> anyhow::Result<Outcome> {
    let disable: Vec<&str> = (off != ON).then_some(off).into_iter().collect();
    Ok(match phase {
        Phase::Storm => {
            let s = scale::storm_without(b, 2 * sizes.storm_max, sizes.storm_max, &disable).await?;
            Outcome {
                rate: s.rate,
                peak_mib: Some(s.peak_mib),
            }
        }
        Phase::Park => {
            let options = ParkOptions {
                ask_ahead: off != "ask_ahead",
            };
            let ns = b.namespace("ab-park").await?;
            let rate = park_sourced(&b.client, &ns, sizes.park, b.c, 64, false, options).await?;
            clear(&b.client, &ns).await?;
            Outcome {
                rate,
                peak_mib: None,
            }
        }
        Phase::Redrive => Outcome {
            rate: redrive_without(b, sizes.redrive, &disable).await?,
            peak_mib: None,
        },
        Phase::Memory => {
            let (peak, rate) = marking(b, sizes.memory, &disable).await?;
            Outcome {
                rate,
                peak_mib: Some(peak),
            }
        }
    })
}

/// The ceiling `phase` is compared with (as its row in the main table measures it).
async fn ceiling(b: &mut Bench, phase: Phase, sizes: Sizes) -> anyhow::Result<f64> {
    Ok(match phase {
        Phase::Storm => {
            let concs = [b.c, deadletter::source::redis::CONCURRENCY];
            let [a, c] = storm_ceilings(b, sizes.storm_max, concs).await?;
            a.max(c)
        }
        Phase::Park => park_phase(b, ParkKind::Ceiling, sizes.park, b.c).await?,
        Phase::Redrive => redrive_ceiling(b, sizes.redrive).await?,
        Phase::Memory => 0.0,
    })
}

/// The operator's peak RSS (MiB) from its start over `n` unmarked 1 KiB records until it has
/// marked them all, and its marks a second.
async fn marking(b: &mut Bench, n: usize, disable: &[&str]) -> anyhow::Result<(f64, f64)> {
    let ns = b.namespace("ab-memory").await?;
    create_plain(&b.client, &ns, n, b.c, 1024).await?;
    let (operator, pid) = b.operator_without(&ns, disable)?;
    let start = Instant::now();
    operator.until_marked(n, Duration::from_secs(600)).await?;
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let peak = rss_mib(pid).0;
    drop(operator);
    clear(&b.client, &ns).await?;
    Ok((peak, rate))
}

/// A phase's variants over the rounds.
struct Measured {
    rates: Rounds,
    /// Peak RSS per variant, per round.
    peaks: std::collections::BTreeMap<&'static str, Vec<f64>>,
}

/// Runs `phase`'s variants in `rounds` rounds, the order reversed every other round, its
/// ceiling between the two halves of each round.
async fn measure(
    b: &mut Bench,
    phase: Phase,
    sizes: Sizes,
    rounds: usize,
) -> anyhow::Result<Measured> {
    let mut variants: Vec<&'static str> = vec![ON];
    variants.extend(phase.mechanisms());
    let mut m = Measured {
        rates: Rounds::default(),
        peaks: Default::default(),
    };
    let n = sizes.records(phase);
    for round in 0..rounds {
        let mut order = variants.clone();
        if round % 2 == 1 {
            order.reverse();
        }
        let half = order.len().div_ceil(2);
        for (i, off) in order.into_iter().enumerate() {
            if i == half && phase != Phase::Memory {
                m.rates.add("ceiling", n, ceiling(b, phase, sizes).await?);
            }
            let out = once(b, phase, sizes, off).await?;
            eprintln!(
                "ab {} round {round}: {off}: {:.0}/s{}",
                phase.name(),
                out.rate,
                out.peak_mib
                    .map_or(String::new(), |p| format!(", operator peak {p:.1} MiB"))
            );
            if out.rate > 0.0 {
                m.rates.add(off, n, out.rate);
            }
            if let Some(p) = out.peak_mib {
                m.peaks.entry(off).or_default().push(p);
            }
        }
    }
    Ok(m)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// One row of the A/B table: mechanism (phase), with, without, points.
type Row = (String, String, String, String);

/// The rows and JSON of a throughput phase.
fn throughput_rows(
    phase: Phase,
    m: &Measured,
    rows: &mut Vec<Row>,
    out: &mut Vec<serde_json::Value>,
) {
    let (on, ceiling) = (m.rates.rate(ON), m.rates.rate("ceiling"));
    let pct = |rate: f64| 100.0 * rate / ceiling;
    for &name in phase.mechanisms() {
        let off = m.rates.rate(name);
        let points = pct(on) - pct(off);
        rows.push((
            format!("{name} ({})", phase.name()),
            format!("{on:.0}/s {:.0}%", pct(on)),
            format!("{off:.0}/s {:.0}%", pct(off)),
            format!("{points:+.1}"),
        ));
        out.push(json!({"mechanism": name, "phase": phase.name(), "with_per_s": on, "without_per_s": off, "ceiling_per_s": ceiling, "with_ratio": on / ceiling, "without_ratio": off / ceiling, "points": points, "peak_mib_with": m.peaks.get(ON).map(|p| mean(p)), "peak_mib_without": m.peaks.get(name).map(|p| mean(p)), "each": m.rates.json()}));
    }
}

/// The memory phase's rows: peak RSS with and without, and the difference in MiB; the marks a
/// second with and without, and the change in per cent.
fn memory_rows(sizes: Sizes, m: &Measured, rows: &mut Vec<Row>, out: &mut Vec<serde_json::Value>) {
    let on = mean(m.peaks.get(ON).map_or(&[][..], |p| p));
    let marks_on = m.rates.rate(ON);
    for &name in Phase::Memory.mechanisms() {
        let off = mean(m.peaks.get(name).map_or(&[][..], |p| p));
        rows.push((
            format!("{name} (peak RSS, {} unmarked)", sizes.memory),
            format!("{on:.1} MiB"),
            format!("{off:.1} MiB"),
            format!("{:+.1} MiB", on - off),
        ));
        let marks_off = m.rates.rate(name);
        rows.push((
            format!("{name} (marks, {} unmarked)", sizes.memory),
            format!("{marks_on:.0}/s"),
            format!("{marks_off:.0}/s"),
            format!("{:+.0}%", 100.0 * (marks_on / marks_off - 1.0)),
        ));
        out.push(json!({"mechanism": name, "phase": "memory", "records": sizes.memory, "peak_mib_with": on, "peak_mib_without": off, "marks_per_s_with": marks_on, "marks_per_s_without": marks_off, "each": m.peaks.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>()}));
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The whole A/B: its table's rows, and its JSON.
pub async fn run(b: &mut Bench) -> anyhow::Result<(Vec<Row>, serde_json::Value)> {
    let sizes = Sizes::from_env();
    let rounds = env_usize("BENCH_AB_ROUNDS", 2).max(1);
    let (before, started) = (loadavg(), Instant::now());
    eprintln!("ab: load average {before}");
    let (mut rows, mut out) = (Vec::new(), Vec::new());
    let only = std::env::var("BENCH_AB_PHASES").unwrap_or_default();
    let wanted = |p: Phase| only.is_empty() || only.split(',').any(|w| w.trim() == p.name());
    for phase in [Phase::Storm, Phase::Park, Phase::Redrive, Phase::Memory] {
        if !wanted(phase) {
            continue;
        }
        let m = measure(b, phase, sizes, rounds).await?;
        if phase == Phase::Memory {
            memory_rows(sizes, &m, &mut rows, &mut out);
        } else {
            throughput_rows(phase, &m, &mut rows, &mut out);
        }
    }
    let after = loadavg();
    eprintln!(
        "ab: load average {after}, {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let json = json!({"rounds": rounds, "storm_max_parked": sizes.storm_max, "storm_messages": 2 * sizes.storm_max, "park_n": sizes.park, "redrive_n": sizes.redrive, "memory_n": sizes.memory, "loadavg_before": before, "loadavg_after": after, "seconds": started.elapsed().as_secs_f64(), "mechanisms": out});
    Ok((rows, json))
}
