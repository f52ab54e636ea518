//! The sample worker of `make demo`: consumes payment jobs from a Redis list, re-reads the
//! intent from its own store on every delivery, and acts only on `authorized` intents. That is
//! what makes a redrive safe: a job whose intent moved on is a no-op.
//!
//!   worker --redis redis://127.0.0.1:6379/ --list relayer:jobs

use std::io::Write;

use anyhow::Context;
use clap::Parser;
use serde::Deserialize;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    redis: String,
    #[arg(long, default_value = "relayer:jobs")]
    list: String,
}

#[derive(Deserialize)]
struct SettleJob {
    intent: String,
    #[serde(rename = "ref")]
    reference: String,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = redis::Client::open(args.redis.as_str()).context("redis url")?;
    // BRPOP blocks for up to a second: allow replies to take longer than that.
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(std::time::Duration::from_secs(10)));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .context("connecting to redis")?;
    loop {
        let popped: Option<(String, Vec<u8>)> = redis::cmd("BRPOP")
            .arg(&args.list)
            .arg(1)
            .query_async(&mut conn)
            .await
            .context("BRPOP")?;
        let Some((_, body)) = popped else { continue };
        let job: SettleJob = match serde_json::from_slice(&body) {
            Ok(j) => j,
            Err(e) => {
                println!("worker  unreadable job: {e}");
                continue;
            }
        };
        let id = format!("{}/{}", job.intent, job.reference);
        let delivery: i64 = redis::cmd("HINCRBY")
            .arg("worker:deliveries")
            .arg(&id)
            .arg(1)
            .query_async(&mut conn)
            .await?;
        // Re-read the business state: the job is only a reminder to look.
        let state: Option<String> = redis::cmd("HGET")
            .arg(format!("intent:{}", job.intent))
            .arg("state")
            .query_async(&mut conn)
            .await?;
        let state = state.unwrap_or_else(|| "unknown".into());
        let (outcome, detail) = if state == "authorized" {
            let tx = format!("0x{}", &job.intent[job.intent.len().saturating_sub(4)..]);
            let _: () = redis::cmd("HSET")
                .arg(format!("intent:{}", job.intent))
                .arg("state")
                .arg("sent")
                .arg("tx")
                .arg(&tx)
                .query_async(&mut conn)
                .await?;
            ("sent", format!("tx {tx}"))
        } else {
            ("no-op", format!("(already {state})"))
        };
        println!(
            "worker  {id:<17}{:<4}{outcome:<13}{detail}",
            format!("#{delivery}")
        );
        std::io::stdout().flush()?;
    }
}
