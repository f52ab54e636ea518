//! The link between the operator and a broker, through a real TCP fault proxy: Shopify's
//! toxiproxy (built from its Go module by `tools/build.sh toxiproxy`), driven by its HTTP API
//! on loopback. Two cuts, chosen by the run's seed:
//! - refuse: the proxy is disabled, open connections are closed and new ones refused (a
//!   broker that went away);
//! - black hole: a `timeout` toxic with no timeout, so bytes stop flowing on open and new
//!   connections and nothing is closed (a partition: the nastier one for clients).

use std::path::PathBuf;
use std::process::{Child, Command};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::plane::{TestenvError, free_port, spawn_guarded, tool_dirs};

/// The proxy's name in toxiproxy.
const NAME: &str = "broker";

/// How a link is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    Refuse,
    BlackHole,
}

/// A toxiproxy server forwarding `127.0.0.1:port` to an upstream loopback port; killed on drop.
pub struct Toxiproxy {
    /// Where clients connect (the Secret's URL points here).
    pub port: u16,
    api: u16,
    child: Child,
}

impl Toxiproxy {
    /// Starts the server (logging into `log_dir`) and its one proxy to `127.0.0.1:upstream`.
    pub async fn start(upstream: u16, log_dir: PathBuf) -> Result<Toxiproxy, TestenvError> {
        let bin = tool_dirs(&["toxiproxy"])?
            .into_iter()
            .map(|d| d.join("toxiproxy-server"))
            .find(|p| p.is_file())
            .ok_or_else(|| TestenvError::Setup("toxiproxy-server not built".into()))?;
        let (api, port) = (free_port()?, free_port()?);
        let _ = std::fs::create_dir_all(&log_dir);
        let child = spawn_guarded(
            Command::new(bin).args(["-host", "127.0.0.1", "-port", &api.to_string()]),
            &log_dir.join("toxiproxy.log"),
        )?;
        let proxy = Toxiproxy { port, api, child };
        proxy.wait_api().await?;
        let body = format!(
            r#"{{"name":"{NAME}","listen":"127.0.0.1:{port}","upstream":"127.0.0.1:{upstream}","enabled":true}}"#
        );
        proxy.call("POST", "/proxies", &body).await?;
        Ok(proxy)
    }

    /// Cuts the link the way `cut` says.
    pub async fn cut(&self, cut: Cut) -> Result<(), TestenvError> {
        match cut {
            Cut::Refuse => self.set_enabled(false).await,
            Cut::BlackHole => {
                let toxic = r#"{"name":"blackhole","type":"timeout","stream":"downstream","toxicity":1.0,"attributes":{"timeout":0}}"#;
                self.call("POST", &format!("/proxies/{NAME}/toxics"), toxic)
                    .await
                    .map(drop)
            }
        }
    }

    /// Restores the link after either cut.
    pub async fn restore(&self, cut: Cut) -> Result<(), TestenvError> {
        match cut {
            Cut::Refuse => self.set_enabled(true).await,
            Cut::BlackHole => self
                .call("DELETE", &format!("/proxies/{NAME}/toxics/blackhole"), "")
                .await
                .map(drop),
        }
    }

    async fn set_enabled(&self, enabled: bool) -> Result<(), TestenvError> {
        let body = format!(r#"{{"enabled":{enabled}}}"#);
        self.call("POST", &format!("/proxies/{NAME}"), &body)
            .await
            .map(drop)
    }

    async fn wait_api(&self) -> Result<(), TestenvError> {
        for _ in 0..100 {
            if self.call("GET", "/version", "").await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        Err(TestenvError::Setup(format!(
            "toxiproxy's API on 127.0.0.1:{} did not answer within 10 s",
            self.api
        )))
    }

    /// One HTTP/1.0 request to the API; the response body when the status is 2xx.
    async fn call(&self, method: &str, path: &str, body: &str) -> Result<String, TestenvError> {
        let failed =
            |what: String| TestenvError::Setup(format!("toxiproxy {method} {path}: {what}"));
        let mut s = TcpStream::connect(("127.0.0.1", self.api))
            .await
            .map_err(|e| failed(e.to_string()))?;
        let request = format!(
            "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(request.as_bytes())
            .await
            .map_err(|e| failed(e.to_string()))?;
        let mut out = String::new();
        s.read_to_string(&mut out)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let status = out.split_whitespace().nth(1).unwrap_or_default();
        let body = out
            .split_once("\r\n\r\n")
            .map(|(_, b)| b)
            .unwrap_or_default();
        if status.starts_with('2') {
            Ok(body.to_string())
        } else {
            Err(failed(format!("answered {status}: {body}")))
        }
    }
}

impl Drop for Toxiproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
