//! A broker as a child of the test process: its free port, its fresh data dir, waiting until
//! it listens or has closed, starting it so that it outlives the test that started it, and
//! killing it like a crash. What every broker here shares, apart from the facade that
//! re-exports them.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// `name` on the PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// A fresh, empty data dir for one broker.
pub(super) fn temp_dir(kind: &str, port: u16) -> PathBuf {
    crate::paths::sweep_stale_scratch();
    let dir = std::env::temp_dir().join(format!("dlq-{kind}-{}-{port}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("creating the broker dir {}: {e}", dir.display()));
    dir
}

/// A free loopback port for a broker.
pub(super) fn port() -> u16 {
    crate::plane::free_port().expect("a free loopback port")
}

/// Waits until something listens on `port`; panics with the log after `secs`.
pub(super) fn wait_listening(port: u16, secs: u64, what: &str, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "{what} did not listen on {port} within {secs}s; log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// Waits until `child` listens on `port`: an error with its log's tail as soon as it exits
/// (then `child` is None), or after `secs`. For servers whose start may fail for a reason the
/// test should show (an emulator's bad flag, a taken port).
pub(super) fn wait_child_listening(
    child: &mut Option<Child>,
    port: u16,
    secs: u64,
    what: &'static str,
    log: &Path,
) -> Result<(), crate::plane::TestenvError> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if let Some(c) = child.as_mut()
            && let Ok(Some(status)) = c.try_wait()
        {
            *child = None;
            return Err(crate::plane::TestenvError::Setup(format!(
                "{what} exited ({status}) before listening on {port}; log:\n{}",
                crate::plane::tail(log, 30)
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(crate::plane::TestenvError::NotReady {
        what,
        secs,
        log: log.display().to_string(),
        tail: crate::plane::tail(log, 30),
    })
}

/// Waits (up to `secs`) until nothing listens on `port` any more.
pub(super) fn wait_closed(port: u16, secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while TcpStream::connect(("127.0.0.1", port)).is_ok() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Spawns `cmd` from a thread that lives as long as the test process, so a broker shared by
/// several tests is not killed (PR_SET_PDEATHSIG) when the test that started it ends.
pub(super) fn spawn_detached_from_test(mut cmd: Command, log: PathBuf) -> Child {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let child = crate::plane::spawn_guarded(&mut cmd, &log);
        let _ = tx.send(child);
        loop {
            std::thread::park();
        }
    });
    rx.recv()
        .expect("the spawner thread answers")
        .unwrap_or_else(|e| panic!("starting a broker: {e}"))
}

/// Kills a child hard, like a crashed broker.
pub(super) fn stop_child(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}
