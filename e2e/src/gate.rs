//! What stands between the API server and a webhook in a real cluster, on loopback: a
//! [`TcpGate`] a test can close and reopen (a network outage: connections refused, open
//! connections cut) or slow down (a slow network: answers held back), and a [`Balancer`] that,
//! like a Service's endpoints, sends connections only to ready replicas.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
    /// How long bytes from `target` are held before they go on ([`TcpGate::delay_answers`]).
    delay: Arc<Mutex<Duration>>,
    /// When a read from `target` was last held back ([`TcpGate::last_answer_held`]).
    held: Arc<Mutex<Option<Instant>>>,
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
            delay: Arc::new(Mutex::new(Duration::ZERO)),
            held: Arc::default(),
            stopped: CancellationToken::new(),
        };
        tokio::spawn(accept(
            listener,
            target,
            Delay {
                delay: gate.delay.clone(),
                held: gate.held.clone(),
            },
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

    /// Holds every byte `target` sends back, on open connections too, for `delay` before passing
    /// it on (zero: at once): a webhook whose answers arrive late, decided when its request came.
    pub fn delay_answers(&self, delay: Duration) {
        if let Ok(mut current) = self.delay.lock() {
            *current = delay;
        }
    }

    /// When bytes from `target` were last held back by [`TcpGate::delay_answers`]: a time after
    /// some moment means that a request sent after it has been read by `target`, which is
    /// answering it now.
    pub fn last_answer_held(&self) -> Option<Instant> {
        self.held.lock().ok().and_then(|held| *held)
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
    delay: Delay,
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
        tokio::spawn(forward(inbound, target, token, delay.clone()));
    }
}

/// How long a gate's connections hold what `target` sends, and when they last held some.
#[derive(Clone, Default)]
struct Delay {
    delay: Arc<Mutex<Duration>>,
    held: Arc<Mutex<Option<Instant>>>,
}

/// Copies bytes both ways between `inbound` and a new connection to `target` until either side
/// closes or `cut` fires (a refused `target` ends `inbound` at once); bytes from `target` wait
/// for `delay` each, without adding up.
async fn forward(
    inbound: TcpStream,
    target: SocketAddr,
    cut: CancellationToken,
    Delay {
        delay,
        held: last_held,
    }: Delay,
) {
    let Ok(outbound) = TcpStream::connect(target).await else {
        return;
    };
    let (mut in_read, mut in_write) = inbound.into_split();
    let (mut out_read, mut out_write) = outbound.into_split();
    let (held, mut due) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let requests = async {
        let _ = tokio::io::copy(&mut in_read, &mut out_write).await;
        let _ = out_write.shutdown().await;
    };
    let answers_in = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            match out_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let hold = delay.lock().map(|d| *d).unwrap_or_default();
                    if !hold.is_zero()
                        && let Ok(mut last) = last_held.lock()
                    {
                        *last = Some(Instant::now());
                    }
                    let at = tokio::time::Instant::now() + hold;
                    if held.send((at, buffer[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    };
    let answers_out = async {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if in_write.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = in_write.shutdown().await;
    };
    tokio::select! {
        () = cut.cancelled() => {}
        _ = async { tokio::join!(requests, answers_in, answers_out) } => {}
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
        tokio::spawn(forward(inbound, target, stopped.clone(), Delay::default()));
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
