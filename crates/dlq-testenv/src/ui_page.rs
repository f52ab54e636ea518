//! `kubectl dlq ui` as a person starts it: the plugin serving its page against a plane, its URL
//! (with the run's token) read from its first line; killed on drop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

use crate::cluster::Plane;

/// The plugin serving the page.
pub struct UiPage {
    pub child: Child,
    /// `http://127.0.0.1:<port>/?token=…`, as printed.
    pub url: String,
}

impl UiPage {
    /// `kubectl dlq ui -n ns` against `plane`, as `user` (`--as`) when given.
    pub fn start(plane: &Plane, ns: &str, user: Option<&str>) -> UiPage {
        let mut cmd = Command::new(crate::paths::bin("kubectl-dlq"));
        cmd.arg("--kubeconfig")
            .arg(&plane.kubeconfig)
            .args(["-n", ns]);
        if let Some(user) = user {
            cmd.args(["--as", user]);
        }
        let mut child = cmd
            .arg("ui")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("kubectl dlq ui runs");
        let mut line = String::new();
        let mut out = BufReader::new(child.stdout.take().expect("stdout is piped"));
        out.read_line(&mut line).expect("the page's URL");
        // Keep reading so the plugin's later lines never meet a closed pipe.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let url = line
            .split_whitespace()
            .last()
            .unwrap_or_default()
            .to_string();
        assert!(
            url.starts_with("http://127.0.0.1:") && url.contains("/?token="),
            "{line}"
        );
        UiPage { child, url }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn base(&self) -> String {
        self.url.split("/?").next().unwrap_or_default().to_string()
    }

    /// A raw HTTP/1.1 request with exactly these headers (`{host}` replaced by the page's
    /// authority); returns the status line.
    pub fn raw(&self, request: &str) -> String {
        let authority = self.base().trim_start_matches("http://").to_string();
        let mut s = TcpStream::connect(&authority).expect("the page listens");
        s.write_all(request.replace("{host}", &authority).as_bytes())
            .expect("writing the request");
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.lines().next().unwrap_or_default().to_string()
    }
}

impl Drop for UiPage {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
