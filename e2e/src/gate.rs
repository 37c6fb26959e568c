//! What stands between the API server and a webhook in a real cluster, on loopback: a
//! [`TcpGate`] a test can close and reopen (a network outage: connections refused, open
//! connections cut), and a [`Balancer`] that, like a Service's endpoints, sends connections only
//! to ready replicas.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A forwarder from a port of its own to `target`; open when created, stopped when dropped.
#[derive(Debug)]
pub struct TcpGate {
    addr: SocketAddr,
    target: SocketAddr,
    /// Cancelled to close the gate; replaced with a fresh token on reopening.
    open: Arc<Mutex<CancellationToken>>,
    stopped: CancellationToken,
}

impl TcpGate {
    /// Starts forwarding from a free loopback port to `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("failed to bind the gate")?;
        let addr = listener.local_addr()?;
        let gate = Self {
            addr,
            target,
            open: Arc::new(Mutex::new(CancellationToken::new())),
            stopped: CancellationToken::new(),
        };
        tokio::spawn(accept(
            listener,
            target,
            gate.open.clone(),
            gate.stopped.clone(),
        ));
        Ok(gate)
    }

    /// Address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts every forwarded connection and drops new ones until [`TcpGate::open`].
    pub fn close(&self) {
        if let Ok(open) = self.open.lock() {
            open.cancel();
        }
    }

    /// Forwards new connections again.
    pub fn open(&self) {
        if let Ok(mut open) = self.open.lock()
            && open.is_cancelled()
        {
            *open = CancellationToken::new();
        }
    }

    /// Where connections are forwarded to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }
}

impl Drop for TcpGate {
    fn drop(&mut self) {
        self.close();
        self.stopped.cancel();
    }
}

async fn accept(
    listener: TcpListener,
    target: SocketAddr,
    open: Arc<Mutex<CancellationToken>>,
    stopped: CancellationToken,
) {
    loop {
        let (inbound, _) = tokio::select! {
            () = stopped.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(_) => continue,
            },
        };
        let token = match open.lock() {
            Ok(open) => open.clone(),
            Err(_) => return,
        };
        if token.is_cancelled() {
            // Closed: the client sees the connection end before any byte.
            drop(inbound);
            continue;
        }
        tokio::spawn(forward(inbound, target, token));
    }
}

/// Copies bytes both ways between `inbound` and a new connection to `target` until either side
/// closes or `cut` fires (a refused `target` ends `inbound` at once).
async fn forward(mut inbound: TcpStream, target: SocketAddr, cut: CancellationToken) {
    let Ok(mut outbound) = TcpStream::connect(target).await else {
        return;
    };
    tokio::select! {
        () = cut.cancelled() => {}
        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
    }
}

/// A TCP load balancer on loopback in front of several webhook servers, standing in for a
/// Service: like endpoints, it sends new connections only to backends whose readiness probe
/// answers 200, checked every [`Balancer::PROBE_INTERVAL`].
#[derive(Debug)]
pub struct Balancer {
    addr: SocketAddr,
    backends: Arc<Mutex<Vec<Backend>>>,
    stopped: CancellationToken,
}

#[derive(Clone, Debug)]
struct Backend {
    target: SocketAddr,
    readyz: SocketAddr,
    ready: bool,
}

impl Balancer {
    /// How often readiness is probed: the delay of endpoint updates this stands in for.
    pub const PROBE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(200);

    /// Starts balancing over no backend yet.
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("failed to bind the balancer")?;
        let balancer = Self {
            addr: listener.local_addr()?,
            backends: Arc::default(),
            stopped: CancellationToken::new(),
        };
        tokio::spawn(balance(
            listener,
            balancer.backends.clone(),
            balancer.stopped.clone(),
        ));
        tokio::spawn(probe(balancer.backends.clone(), balancer.stopped.clone()));
        Ok(balancer)
    }

    /// Address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Adds a backend serving at `target`, ready when `GET /readyz` on `readyz` answers 200.
    pub fn add(&self, target: SocketAddr, readyz: SocketAddr) {
        if let Ok(mut backends) = self.backends.lock() {
            backends.push(Backend {
                target,
                readyz,
                ready: false,
            });
        }
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.stopped.cancel();
    }
}

async fn balance(
    listener: TcpListener,
    backends: Arc<Mutex<Vec<Backend>>>,
    stopped: CancellationToken,
) {
    let mut next = 0usize;
    loop {
        let (inbound, _) = tokio::select! {
            () = stopped.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(_) => continue,
            },
        };
        let ready: Vec<SocketAddr> = match backends.lock() {
            Ok(b) => b.iter().filter(|b| b.ready).map(|b| b.target).collect(),
            Err(_) => return,
        };
        if ready.is_empty() {
            // No endpoint: the connection is refused, as by a Service without ready pods.
            continue;
        }
        let target = ready[next % ready.len()];
        next = next.wrapping_add(1);
        tokio::spawn(forward(inbound, target, stopped.clone()));
    }
}

async fn probe(backends: Arc<Mutex<Vec<Backend>>>, stopped: CancellationToken) {
    loop {
        let current: Vec<Backend> = match backends.lock() {
            Ok(b) => b.clone(),
            Err(_) => return,
        };
        let mut results = Vec::with_capacity(current.len());
        for backend in &current {
            results.push(is_ready(backend.readyz).await);
        }
        if let Ok(mut b) = backends.lock() {
            for (backend, ready) in b.iter_mut().zip(results) {
                backend.ready = ready;
            }
        }
        tokio::select! {
            () = stopped.cancelled() => return,
            () = tokio::time::sleep(Balancer::PROBE_INTERVAL) => {}
        }
    }
}

/// Whether `GET /readyz` at `addr` answers 200 within a second.
async fn is_ready(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        stream
            .write_all(b"GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await
            .ok()?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.ok()?;
        Some(head.ends_with(b" 200"))
    };
    tokio::time::timeout(std::time::Duration::from_secs(1), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}
