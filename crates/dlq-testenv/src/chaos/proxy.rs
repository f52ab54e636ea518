//! A TCP proxy that can cut the link between the operator and a broker: a real network fault
//! (open connections are closed, new ones are refused) at a moment the harness chooses.

use std::io;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Forwards `127.0.0.1:port` to an upstream loopback port until cut.
pub struct CutProxy {
    /// Where clients connect (the Secret's URL points here).
    pub port: u16,
    cut: Arc<watch::Sender<bool>>,
}

impl CutProxy {
    /// Starts forwarding to `127.0.0.1:upstream`; the task lives as long as the runtime.
    pub async fn start(upstream: u16) -> io::Result<CutProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (tx, _) = watch::channel(false);
        let cut = Arc::new(tx);
        let accept_cut = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *accept_cut.borrow() {
                    drop(client); // refused while cut: the client sees a reset
                    continue;
                }
                tokio::spawn(forward(client, upstream, accept_cut.subscribe()));
            }
        });
        Ok(CutProxy { port, cut })
    }

    /// Cuts (closing every open connection) or restores the link.
    pub fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// One connection, both ways, until either side closes or the link is cut.
async fn forward(mut client: TcpStream, upstream: u16, mut cut: watch::Receiver<bool>) {
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
        return;
    };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = cut.wait_for(|c| *c) => {}
    }
}
