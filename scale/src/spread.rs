//! `gpumem-scale spread`: one TCP address in front of several backends, each new connection to the
//! next backend in turn, as a Service spreads kube-scheduler's connections over the scorer's
//! replicas. TLS passes through untouched. A backend that refuses the connection is skipped for
//! this one: a Service whose endpoints no longer list a killed replica (its container not Ready)
//! sends nothing there either.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context as _, bail};
use clap::Args;
use tokio::net::{TcpListener, TcpStream};

#[derive(Args, Debug, Clone)]
pub struct SpreadArgs {
    /// The address clients connect to.
    #[arg(long)]
    pub listen: SocketAddr,
    /// A backend (repeat for each).
    #[arg(long = "to", required = true)]
    pub backends: Vec<SocketAddr>,
}

/// The backends, taken in turn.
pub struct RoundRobin {
    backends: Vec<SocketAddr>,
    next: AtomicUsize,
}

impl RoundRobin {
    pub fn new(backends: Vec<SocketAddr>) -> anyhow::Result<Self> {
        if backends.is_empty() {
            bail!("no backend");
        }
        Ok(Self {
            backends,
            next: AtomicUsize::new(0),
        })
    }

    /// Connects to the next backend that answers, starting with the one whose turn it is.
    pub async fn connect(&self) -> anyhow::Result<(SocketAddr, TcpStream)> {
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let mut last_error = None;
        for i in 0..self.backends.len() {
            let addr = self.backends[(first + i) % self.backends.len()];
            match TcpStream::connect(addr).await {
                Ok(s) => return Ok((addr, s)),
                Err(e) => last_error = Some(format!("{addr}: {e}")),
            }
        }
        bail!("no backend answers (last: {})", last_error.unwrap_or_default())
    }
}

/// Serves `listener` until the process ends.
pub async fn serve(listener: TcpListener, backends: Arc<RoundRobin>) {
    loop {
        let (mut client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(err) => {
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let backends = backends.clone();
        tokio::spawn(async move {
            match backends.connect().await {
                Ok((addr, mut server)) => {
                    tracing::debug!(%peer, backend = %addr, "connection");
                    // Either side closing or failing ends both (a killed backend drops its clients).
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
                Err(err) => tracing::warn!(%peer, error = %err, "connection refused"),
            }
        });
    }
}

pub async fn spread(args: SpreadArgs) -> anyhow::Result<()> {
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    tracing::info!(listen = %args.listen, backends = ?args.backends, "spreading connections");
    serve(listener, Arc::new(RoundRobin::new(args.backends)?)).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A backend that answers each connection with its own name.
    async fn backend(name: &'static str) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let _ = s.write_all(name.as_bytes()).await;
            }
        });
        addr
    }

    async fn ask(addr: SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    }

    #[tokio::test]
    async fn connections_alternate_and_skip_a_backend_that_is_down() {
        let a = backend("a").await;
        let b = backend("b").await;
        // A port nothing listens on: bound, then closed.
        let down = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind")
            .local_addr()
            .expect("addr");
        let front = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = front.local_addr().expect("addr");
        tokio::spawn(serve(
            front,
            Arc::new(RoundRobin::new(vec![a, down, b]).expect("rr")),
        ));
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.push(ask(addr).await);
        }
        // a; the dead one's turn goes to b; b.
        assert_eq!(seen, ["a", "b", "b"]);
        assert_eq!(ask(addr).await, "a");
    }

    #[test]
    fn no_backend_is_an_error() {
        assert!(RoundRobin::new(Vec::new()).is_err());
    }
}
