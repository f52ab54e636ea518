//! A real browser for the page tests: Debian's headless Chromium driven over WebDriver
//! (chromedriver, on loopback: plain HTTP) with fantoccini. `scripts/ensure-deps.sh` installs both packages.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

pub use fantoccini::{self, Locator};
use fantoccini::{Client, ClientBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::json;

use crate::plane::{free_port, spawn_guarded, terminate};

/// Where the Debian packages put them; `DLQ_CHROMIUM` / `DLQ_CHROMEDRIVER` override.
fn program(env: &str, default: &str) -> PathBuf {
    std::env::var_os(env).map_or_else(|| PathBuf::from(default), PathBuf::from)
}

/// A chromedriver process and one headless Chromium session; both end on drop.
pub struct Browser {
    pub client: Client,
    driver: Child,
    _profile: PathBuf,
}

impl Browser {
    /// Starts chromedriver on a free port and opens a session with a fresh profile.
    pub async fn start(name: &str) -> Browser {
        let chromium = program("DLQ_CHROMIUM", "/usr/bin/chromium");
        let chromedriver = program("DLQ_CHROMEDRIVER", "/usr/bin/chromedriver");
        assert!(
            chromium.is_file() && chromedriver.is_file(),
            "{} or {} missing: run scripts/ensure-deps.sh (apt-get install chromium chromium-driver)",
            chromium.display(),
            chromedriver.display()
        );
        let dir =
            crate::paths::target_tmp_dir().join(format!("browser-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("browser scratch dir");
        let port = free_port().expect("free port");
        let driver = spawn_guarded(
            Command::new(&chromedriver).args([format!("--port={port}"), "--allowed-ips=".into()]),
            &dir.join("chromedriver.log"),
        )
        .expect("start chromedriver");
        let profile = dir.join("profile");
        let caps = json!({"goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", "--window-size=1400,900",
                format!("--user-data-dir={}", profile.display())],
        }});
        let serde_json::Value::Object(caps) = caps else {
            unreachable!()
        };
        let url = format!("http://127.0.0.1:{port}");
        let mut last = String::new();
        for _ in 0..100 {
            match ClientBuilder::new(HttpConnector::new())
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                Ok(client) => {
                    return Browser {
                        client,
                        driver,
                        _profile: profile,
                    };
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!(
            "no WebDriver session from chromedriver at {url}: {last} (log: {})",
            dir.display()
        );
    }

    /// Saves a screenshot as `target/ui-screenshots/<name>.png` and returns its path.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.expect("screenshot");
        let dir = crate::paths::profile_dir()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .unwrap_or_else(std::env::temp_dir)
            .join("ui-screenshots");
        std::fs::create_dir_all(&dir).expect("screenshot dir");
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write screenshot");
        path
    }

    /// The text of the first element matching a CSS selector, retrying for up to 10 s (the
    /// page may be navigating, or htmx may swap the element under us).
    pub async fn text(&self, css: &str) -> String {
        let mut last = String::new();
        for _ in 0..100 {
            match self.client.find(Locator::Css(css)).await {
                Ok(e) => match e.text().await {
                    Ok(t) => return t,
                    Err(err) => last = err.to_string(),
                },
                Err(err) => last = err.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no text of {css}: {last}");
    }

    /// Clicks the first element matching a CSS selector, retrying for up to 10 s.
    pub async fn click(&self, css: &str) {
        let mut last = String::new();
        for _ in 0..100 {
            match self.client.find(Locator::Css(css)).await {
                Ok(e) => match e.click().await {
                    Ok(()) => return,
                    Err(err) => last = err.to_string(),
                },
                Err(err) => last = err.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("cannot click {css}: {last}");
    }

    /// How many elements match a CSS selector now.
    pub async fn count(&self, css: &str) -> usize {
        self.client
            .find_all(Locator::Css(css))
            .await
            .map_or(0, |v| v.len())
    }

    /// Resizes the window (the page is laid out again at that width).
    pub async fn set_width(&self, width: u32) {
        self.client
            .set_window_size(width, 900)
            .await
            .unwrap_or_else(|e| panic!("window width {width}: {e}"));
    }

    /// The words of column headers (`th`) laid out over more than one line, i.e. broken inside
    /// the word ("Queu" / "e"): each word's text range must make a single box.
    pub async fn broken_header_words(&self) -> Vec<String> {
        const SCRIPT: &str = r"
            const broken = [];
            for (const th of document.querySelectorAll('th')) {
              const walker = document.createTreeWalker(th, NodeFilter.SHOW_TEXT);
              for (let t = walker.nextNode(); t; t = walker.nextNode()) {
                const re = /\S+/g;
                let m;
                while ((m = re.exec(t.textContent))) {
                  const r = document.createRange();
                  r.setStart(t, m.index);
                  r.setEnd(t, m.index + m[0].length);
                  if (r.getClientRects().length > 1) broken.push(m[0]);
                }
              }
            }
            return broken;";
        let value = self
            .client
            .execute(SCRIPT, vec![])
            .await
            .unwrap_or_else(|e| panic!("measuring the column headers: {e}"));
        serde_json::from_value(value).unwrap_or_default()
    }

    /// Ends the session and chromedriver.
    pub async fn stop(mut self) {
        let _ = self.client.clone().close().await;
        terminate(&mut self.driver, Duration::from_secs(2));
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
    }
}
