//! An in-memory network for tests (feature `memnet`): gRPC servers and
//! channels joined by tokio duplex pipes instead of sockets. With no real
//! I/O, a test may run on tokio's paused clock: the clock only jumps when
//! every task waits on a timer, so backoffs, deadlines and resends are
//! measured exactly instead of raced against a busy machine.
//!
//! An address is any `HOST:PORT` string; one nobody listens at refuses the
//! connection, like a master that is down.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::io::DuplexStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::Status;

use crate::follow::Connect;

/// Each pipe's buffer: HTTP/2 flow control bounds what is in flight.
const PIPE_BYTES: usize = 256 * 1024;

/// The listeners by address.
#[derive(Default)]
pub struct Net {
    listeners: Mutex<HashMap<String, mpsc::UnboundedSender<DuplexStream>>>,
}

impl Net {
    pub fn new() -> Arc<Net> {
        Arc::default()
    }

    /// Listens at `addr` (replacing a listener there): the connections, for
    /// `Server::serve_with_incoming`.
    pub fn listen(&self, addr: &str) -> impl Stream<Item = Result<DuplexStream, std::io::Error>> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock().insert(addr.to_string(), tx);
        UnboundedReceiverStream::new(rx).map(Ok)
    }

    /// Stops listening at `addr`: new connections are refused.
    pub fn close(&self, addr: &str) {
        self.lock().remove(addr);
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, mpsc::UnboundedSender<DuplexStream>>> {
        self.listeners.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn dial(&self, addr: &str) -> Result<DuplexStream, std::io::Error> {
        let (client, server) = tokio::io::duplex(PIPE_BYTES);
        match self.lock().get(addr) {
            Some(tx) if tx.send(server).is_ok() => Ok(client),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                format!("nobody listens at {addr}"),
            )),
        }
    }

    /// A lazy channel to `addr`: each connection it makes is a new pipe.
    pub fn channel(self: &Arc<Self>, addr: &str) -> Result<Channel, Status> {
        let ep = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::invalid_argument(format!("master address {addr:?}: {e}")))?;
        Ok(ep.connect_with_connector_lazy(Dialer {
            net: self.clone(),
            addr: addr.to_string(),
        }))
    }

    /// A [`Connect`] for a follower that dials through this network.
    pub fn connect(self: &Arc<Self>) -> Connect {
        let net = self.clone();
        Arc::new(move |addr: &str| net.channel(addr))
    }
}

/// Dials one address (the channel's URI is only its name).
struct Dialer {
    net: Arc<Net>,
    addr: String,
}

impl tower_service::Service<Uri> for Dialer {
    type Response = TokioIo<DuplexStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let dialed = self.net.dial(&self.addr).map(TokioIo::new);
        Box::pin(async move { dialed })
    }
}
