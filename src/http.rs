//! The HTTP server of the scorer and of the agent's metrics: hyper, with [`Limits`] that keep a
//! slow or hostile client from holding connections, descriptors or CPU. HTTP/1.1, and HTTP/2 on TLS
//! connections whose client offers it (ALPN `h2`, see [`crate::tls`]).
//!
//! Why HTTP/2: kube-scheduler's extender client (Go's `http.Transport` through apimachinery's
//! `SetTransportDefaults`) offers `h2` and keeps at most 2 idle HTTP/1.1 connections per host. Its
//! binds run concurrently (one goroutine per pod), so over HTTP/1.1 every bind beyond two in flight
//! dials a new connection, with a full mutual-TLS handshake on both sides, and closes it afterwards.
//! Over HTTP/2 all its calls share one connection.
//!
//! What hyper (1.12, `proto/h1/conn.rs`) bounds, and what is added here:
//! - `header_read_timeout` starts when hyper begins waiting for a request head: at accept, and, since
//!   hyper 1.6, again each time a kept-alive connection goes idle. It stops once the head is parsed.
//!   So it is one bound on idle time and head time together: at 10 s it would close kube-scheduler's
//!   idle connections, at 2 minutes a slowloris client would hold each connection that long. hyper's
//!   timer is given the idle limit, and [`TimedStream`] adds the head limit, counted from accept or
//!   from the first byte of the next request.
//! - Nothing in hyper bounds a body: the handler gets it as tower-http's `DeadlineBody`, which fails
//!   once the whole-body deadline has passed, however steadily a client trickles bytes.
//! - Nor a response that the client does not read (pipelined requests, answers never read): hyper
//!   waits on the write for ever. [`TimedStream`] fails a write pending for the idle limit.
//! - What remains is the handler's own time (the scorer's `bind` waits on the API server, under
//!   the kube client's timeouts).
//! - Connections are capped by a semaphore taken before `accept`: beyond the cap, clients wait in
//!   the listen backlog (no descriptor of ours) and are served as slots free, which the timeouts
//!   guarantee. Closing them at once instead would refuse kube-scheduler too during a flood, and
//!   still cost an accept and a descriptor per attempt.
//! - With TLS ([`crate::tls`]), the handshake runs over [`TimedStream`] too: the head limit bounds
//!   it, counted from accept.
//! - HTTP/2 has no head between requests to time (a client's PING is not a request), so the head
//!   limit runs from accept to the first request only. Its streams are counted instead: a connection
//!   with none open for the idle limit is sent GOAWAY (a client then opens a new one). Bodies have
//!   the same deadline, pending writes the same limit; h2 bounds header lists and streams per
//!   connection ([`H2_MAX_STREAMS`], [`H2_MAX_HEADER_LIST`]) and resets a client that resets streams
//!   in a flood.
//! - Accept errors other than a peer's reset (EMFILE when descriptors run out: the pending
//!   connection stays queued, so the next accept fails at once) pause the loop, 10 ms doubling to
//!   1 s, and are logged at most once a second with the count of those not logged.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::{http1, http2};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tower_http::timeout::DeadlineBody;

use crate::tls::TlsServer;

/// A request body as handlers get it: reading it fails with tower-http's `TimeoutError` once
/// [`Limits::body_timeout`] has passed since the request's head.
pub type Body = DeadlineBody<Incoming>;

pub type Reply = Response<Full<Bytes>>;

/// From accept, or from the first byte of a request on a kept-alive connection, to its last header.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Longer than the 90 s after which kube-scheduler's client (Go's `http.Transport` defaults, through
/// apimachinery's `SetTransportDefaults`) drops an idle connection: the client closes first, so it
/// never sends a request, which it would not retry, on a connection the server is closing.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// From a request's head to the end of its body: above kube-scheduler's `httpTimeout` (5 s shipped,
/// 30 s at most in practice), and counted from the head, so it also covers the scorer's wait for
/// its caches before it reads the body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 1024;
/// Requests in flight on one HTTP/2 connection (kube-scheduler's binds run concurrently).
pub const H2_MAX_STREAMS: u32 = 256;
/// Bytes of one request's headers over HTTP/2, as HPACK decodes them.
pub const H2_MAX_HEADER_LIST: u32 = 64 * 1024;

/// How long a client may take over each part of a connection, and how many connections are served.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_timeout: Duration,
    /// Between requests on a kept-alive connection (hyper's header timer: it also bounds a head),
    /// and for a pending write, waiting for the client to read.
    pub idle_timeout: Duration,
    pub body_timeout: Duration,
    /// 0 is taken as 1.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: HEADER_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            body_timeout: BODY_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

/// Serves `listener` with `handler` until `shutdown` completes (connections in progress finish on
/// their own tasks); over TLS if `tls` is given.
pub async fn serve<H, F>(
    listener: TcpListener,
    limits: Limits,
    tls: Option<Arc<TlsServer>>,
    handler: H,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Body>) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    let handler = Arc::new(handler);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut errors = AcceptErrors::default();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = Arc::clone(&slots).acquire_owned() => slot,
            () = &mut shutdown => return,
        };
        // The semaphore is never closed.
        let Ok(slot) = slot else { return };
        let stream = loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = &mut shutdown => return,
            };
            match accepted {
                Ok((stream, _)) => {
                    errors.succeeded();
                    break stream;
                }
                Err(e) if is_peer_error(&e) => tracing::debug!("accept: {e}"),
                Err(e) => {
                    let pause = errors.failed(&e);
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        () = &mut shutdown => return,
                    }
                }
            }
        };
        tokio::spawn(connection(
            stream,
            limits,
            tls.clone(),
            Arc::clone(&handler),
            slot,
        ));
    }
}

/// What hyper reads and writes: a [`TimedStream`], under TLS or not.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

async fn connection<H, F>(
    stream: TcpStream,
    limits: Limits,
    tls: Option<Arc<TlsServer>>,
    handler: Arc<H>,
    _slot: OwnedSemaphorePermit,
) where
    H: Fn(Request<Body>) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    let _ = stream.set_nodelay(true);
    let phase = Arc::new(Phase::default());
    let timed = TimedStream::new(stream, Arc::clone(&phase), limits);
    let (io, h2): (Box<dyn Io>, bool) = match tls {
        None => (Box::new(timed), false),
        Some(tls) => match tls.acceptor().accept(timed).await {
            Ok(stream) => {
                let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
                (Box::new(stream), h2)
            }
            Err(e) => {
                // A client without a valid certificate, or a stray one: refused before any request.
                // Worth seeing (a scheduler with the wrong certificate leaves GPU pods pending), at
                // a bounded rate (a scanner must not flood the log).
                refused_handshake(&e);
                return;
            }
        },
    };
    let served = if h2 {
        serve_h2(io, limits, phase, handler).await
    } else {
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            phase.set(BUSY);
            let reply = handler(req.map(|body| DeadlineBody::new(limits.body_timeout, body)));
            let phase = Arc::clone(&phase);
            async move {
                let reply = reply.await;
                phase.set(IDLE);
                Ok::<_, Infallible>(reply)
            }
        });
        http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.idle_timeout)
            .serve_connection(TokioIo::new(io), service)
            .await
    };
    if let Err(e) = served {
        // Timeouts and resets are the client's doing: not worth a line each at the default level.
        tracing::debug!("connection: {e}");
    }
}

async fn serve_h2<H, F>(
    io: Box<dyn Io>,
    limits: Limits,
    phase: Arc<Phase>,
    handler: Arc<H>,
) -> hyper::Result<()>
where
    H: Fn(Request<Body>) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    let streams = Arc::new(Streams::new());
    let service = {
        let streams = Arc::clone(&streams);
        hyper::service::service_fn(move |req: Request<Incoming>| {
            // The head limit ends with the first request, for good (see the module's notes).
            phase.set(BUSY);
            let open = Streams::open(&streams);
            let reply = handler(req.map(|body| DeadlineBody::new(limits.body_timeout, body)));
            async move {
                let reply = reply.await;
                drop(open);
                Ok::<_, Infallible>(reply)
            }
        })
    };
    let connection = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .max_concurrent_streams(H2_MAX_STREAMS)
        .max_header_list_size(H2_MAX_HEADER_LIST)
        .serve_connection(TokioIo::new(io), service);
    let mut connection = std::pin::pin!(connection);
    let idle = streams.idle_for(limits.idle_timeout);
    let mut idle = std::pin::pin!(idle);
    let mut closing = false;
    loop {
        tokio::select! {
            served = connection.as_mut() => return served,
            () = idle.as_mut(), if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// The requests open on an HTTP/2 connection, and since when none has been.
struct Streams(Mutex<(usize, Instant)>);

/// One open request: counted until dropped (answered, or reset by the client).
struct OpenStream(Arc<Streams>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.0 = state.0.saturating_sub(1);
        state.1 = Instant::now();
    }
}

impl Streams {
    fn new() -> Self {
        Streams(Mutex::new((0, Instant::now())))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, Instant)> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn open(this: &Arc<Streams>) -> OpenStream {
        this.lock().0 += 1;
        OpenStream(Arc::clone(this))
    }

    /// Completes once no request has been open for `limit`.
    async fn idle_for(&self, limit: Duration) {
        // While requests are open, looked at again this often (their end is not signalled).
        let every = (limit / 4).clamp(Duration::from_millis(1), Duration::from_secs(1));
        loop {
            let (open, since) = *self.lock();
            let wait = if open == 0 {
                match (since + limit).checked_duration_since(Instant::now()) {
                    None => return,
                    Some(left) => left.max(Duration::from_millis(1)),
                }
            } else {
                every
            };
            tokio::time::sleep(wait).await;
        }
    }
}

/// Logs a refused TLS handshake: the first, then at most one a second with the count not logged.
fn refused_handshake(error: &io::Error) {
    static PACE: std::sync::Mutex<LogPace> = std::sync::Mutex::new(LogPace::new());
    let due = PACE.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).due();
    if let Some(not_logged) = due {
        tracing::warn!(%error, not_logged, "TLS handshake refused");
    }
}

/// Lets one log line of a kind through per [`LOG_EVERY`], counting those held back.
struct LogPace {
    logged: Option<Instant>,
    unlogged: u64,
}

impl LogPace {
    const fn new() -> Self {
        Self {
            logged: None,
            unlogged: 0,
        }
    }

    /// `Some(lines held back since the last one)` if this one is to be logged.
    fn due(&mut self) -> Option<u64> {
        if self.logged.is_none_or(|at| at.elapsed() >= LOG_EVERY) {
            self.logged = Some(Instant::now());
            Some(std::mem::take(&mut self.unlogged))
        } else {
            self.unlogged += 1;
            None
        }
    }
}

/// Errors that concern one connection, which the peer reset before it was accepted.
fn is_peer_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused
    )
}

const FIRST_PAUSE: Duration = Duration::from_millis(10);
const LONGEST_PAUSE: Duration = Duration::from_secs(1);
const LOG_EVERY: Duration = Duration::from_secs(1);

/// The accept loop's pause after errors, and how often they are logged.
struct AcceptErrors {
    pause: Duration,
    log: LogPace,
}

impl Default for AcceptErrors {
    fn default() -> Self {
        Self {
            pause: FIRST_PAUSE,
            log: LogPace::new(),
        }
    }
}

impl AcceptErrors {
    /// How long to pause before the next accept.
    fn failed(&mut self, error: &io::Error) -> Duration {
        let pause = self.pause;
        self.pause = (pause * 2).min(LONGEST_PAUSE);
        if let Some(not_logged) = self.log.due() {
            tracing::warn!(
                %error,
                not_logged,
                pause_ms = pause.as_millis(),
                "cannot accept connections; pausing"
            );
        }
        pause
    }

    fn succeeded(&mut self) {
        self.pause = FIRST_PAUSE;
    }
}

/// Waiting for a request head, which [`TimedStream`] times; set at accept and on a request's first
/// byte.
const HEAD: u8 = 0;
/// Inside a request, from its parsed head to its answer: the body has its own deadline.
const BUSY: u8 = 1;
/// Between requests: hyper's timer bounds the wait.
const IDLE: u8 = 2;

/// Where a connection is: the service marks a request's start and end, the reader its first byte.
#[derive(Default)]
struct Phase(AtomicU8);

impl Phase {
    fn set(&self, phase: u8) {
        self.0.store(phase, Ordering::Release);
    }

    fn is_head(&self) -> bool {
        self.0.load(Ordering::Acquire) == HEAD
    }

    /// Idle to head: true if this byte starts a request.
    fn start_head(&self) -> bool {
        self.0
            .compare_exchange(IDLE, HEAD, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// The connection's stream, failing once a request head has taken longer than its limit, or once a
/// write has waited longer than the idle limit for the client to read. hyper polls reads whenever it
/// waits for a head, and polls a pending write again when woken, so each timer wakes it up to fail.
struct TimedStream {
    stream: TcpStream,
    phase: Arc<Phase>,
    limits: Limits,
    head: Pin<Box<Sleep>>,
    /// Runs while a write is pending.
    stall: Pin<Box<Sleep>>,
    stalled: bool,
}

impl TimedStream {
    fn new(stream: TcpStream, phase: Arc<Phase>, limits: Limits) -> Self {
        Self {
            stream,
            phase,
            limits,
            head: Box::pin(tokio::time::sleep(limits.header_timeout)),
            stall: Box::pin(tokio::time::sleep(limits.idle_timeout)),
            stalled: false,
        }
    }

    /// A write's outcome, or an error once writes have been pending for the idle limit.
    fn written<T>(&mut self, cx: &mut Context<'_>, outcome: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if outcome.is_ready() {
            self.stalled = false;
            return outcome;
        }
        if !self.stalled {
            self.stalled = true;
            let deadline = Instant::now() + self.limits.idle_timeout;
            self.stall.as_mut().reset(deadline);
        }
        if self.stall.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {:?}", self.limits.idle_timeout),
            )));
        }
        Poll::Pending
    }
}

impl AsyncRead for TimedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.phase.is_head() && this.head.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no complete request head within {:?}", this.limits.header_timeout),
            )));
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.stream).poll_read(cx, buf))?;
        if buf.filled().len() > before && this.phase.start_head() {
            let deadline = Instant::now() + this.limits.header_timeout;
            this.head.as_mut().reset(deadline);
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for TimedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let outcome = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.written(cx, outcome)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let outcome = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.written(cx, outcome)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
