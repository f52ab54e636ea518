//! `kubectl dlq ui`: a local web page for on-call, acting as the person who opens it.
//!
//! The server listens on 127.0.0.1 only and every request is made with the user's own
//! kubeconfig client, so RBAC, the admission policy and the audit log see the user, not the page.
//! No second auth system: a per-run secret token in the printed URL (then a cookie) keeps other
//! local users and web pages out; see [`guard`].
//!
//! - [`guard`]: token, cookie, Host and Origin checks, CSRF, security headers.
//! - [`live`]: the watch (as the user) the record pages read from, so they update live.
//! - [`pages`]: the server-rendered pages (maud escapes every value).
//! - [`act`]: decisions on an explicit selection (names + resourceVersions).
//! - [`replay`]: bulk replay through the runbook: dry run, confirmation, progress, Stop.
//! - [`chart`]: a failure group's 7 days of parkings as a server-side SVG (its page).
//! - [`state`]: what every handler shares (its own module, so that they name it without a cycle).

mod act;
mod approvals;
mod chart;
mod frame;
mod guard;
mod live;
mod pages;
mod replay;
mod state;
mod view;

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::routing::{get, post};
use clap::Args;

use crate::decision::whoami;
use crate::session::{CliError, Global, connect};
use state::{Replays, Ui};

#[derive(Args, Debug)]
pub struct UiArgs {
    /// Port on 127.0.0.1 (default: a free one).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
}

/// Static assets compiled into the binary: no Node build, nothing fetched at run time.
const HTMX: &str = include_str!("../../assets/htmx-2.0.4.min.js");
const CSS: &str = include_str!("../../assets/app.css");

/// Serves the page until Ctrl-C.
pub async fn run(g: &Global, args: UiArgs) -> Result<(), CliError> {
    let (client, ns) = connect(g).await?;
    let user = whoami(&client).await?;
    let namespace = (!g.all_namespaces).then_some(ns);
    let listener =
        tokio::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, args.port)))
            .await
            .map_err(|e| CliError::Io(format!("listen on 127.0.0.1:{}", args.port), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::Io("local address".into(), e))?;
    let records = live::Records::watch(client.clone(), namespace.as_deref());
    let ui = Arc::new(Ui {
        client,
        namespace,
        user,
        token: guard::secret()?,
        csrf: guard::secret()?,
        authority: format!("127.0.0.1:{}", addr.port()),
        records,
        replays: Replays::default(),
        access: Mutex::default(),
    });
    // Not println!: a closed stdout (a script that read the URL and left) must not stop the page.
    let mut out = std::io::stdout();
    let _ = writeln!(
        out,
        "kubectl dlq ui: http://{}/?token={}",
        ui.authority, ui.token
    );
    let _ = writeln!(out, "acting as {}; Ctrl-C to stop", ui.user);
    let _ = out.flush();
    axum::serve(listener, router(ui))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| CliError::Io("serve".into(), e))
}

fn router(ui: Arc<Ui>) -> Router {
    Router::new()
        .route("/", get(pages::queues))
        .route("/records", get(pages::records))
        .route("/records/live", get(pages::records_live))
        .route("/r/{ns}/{name}", get(pages::record))
        .route("/r/{ns}/{name}/reveal", get(pages::reveal))
        .route("/review", get(act::review))
        .route("/decide", post(act::decide))
        .route("/replay", get(replay::dry_run).post(replay::start))
        .route("/replay/run", get(replay::follow))
        .route("/replay/status", get(replay::status))
        .route("/replay/stop", post(replay::stop))
        .route("/replay/approve", post(approvals::approve))
        .route(
            "/static/htmx-2.0.4.min.js",
            get(|| async { guard::asset(HTMX, "text/javascript") }),
        )
        .route(
            "/static/app.css",
            get(|| async { guard::asset(CSS, "text/css") }),
        )
        .layer(axum::middleware::from_fn_with_state(
            ui.clone(),
            guard::guard,
        ))
        .with_state(ui)
}
