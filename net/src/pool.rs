//! A pool of idle connections (TCP, TLS over TCP, or streams of one QUIC
//! connection) to
//! one address. A connection goes back only
//! when its last call finished cleanly; one dropped mid-call (a deadline, an
//! error) is closed, so a pooled connection never holds a stale response.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use mooncake_proto::message::Body;
use mooncake_proto::transport::TransportKind;
use mooncake_proto::Opcode;

use crate::conn::Connection;
use crate::error::{CallError, ErrorSource};
use crate::quic::QuicConnector;
use crate::tcp_tls::TlsConnector;

/// How a pool opens a new connection.
#[derive(Clone)]
pub enum Dialer {
    Tcp,
    /// TLS over TCP, with the client's certificates.
    Tls(Arc<TlsConnector>),
    /// A new stream on the (shared, multiplexed) QUIC connection.
    Quic(Arc<QuicConnector>),
}

impl Dialer {
    /// A new connection to `addr` (for QUIC, its QUIC address), within
    /// `timeout`.
    pub async fn open(
        &self,
        addr: &str,
        side: ErrorSource,
        timeout: Duration,
    ) -> Result<Connection, CallError> {
        match self {
            Dialer::Tcp => Connection::connect(addr, side, timeout).await,
            Dialer::Tls(tls) => tls.connect(addr, side, timeout).await,
            Dialer::Quic(quic) => quic.open(addr, side, timeout).await,
        }
    }
}

pub struct ConnPool {
    addr: String,
    side: ErrorSource,
    connect_timeout: Duration,
    max_idle: usize,
    token: Option<Arc<str>>,
    dialer: Dialer,
    idle: Mutex<Vec<Connection>>,
}

impl ConnPool {
    pub fn new(
        addr: String,
        side: ErrorSource,
        connect_timeout: Duration,
        max_idle: usize,
    ) -> Self {
        ConnPool {
            addr,
            side,
            connect_timeout,
            max_idle,
            token: None,
            dialer: Dialer::Tcp,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Presents `token` on every new connection (servers that require
    /// authentication refuse anything else).
    pub fn with_token(mut self, token: Option<Arc<str>>) -> Self {
        self.token = token;
        self
    }

    /// Opens connections with `dialer` instead of plain TCP.
    pub fn with_dialer(mut self, dialer: Dialer) -> Self {
        self.dialer = dialer;
        self
    }

    pub fn kind(&self) -> TransportKind {
        match self.dialer {
            Dialer::Tcp | Dialer::Tls(_) => TransportKind::Tcp,
            Dialer::Quic(_) => TransportKind::Quic,
        }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// An idle connection (`true`: reused; one its peer is seen to have
    /// closed is dropped, but a close not seen yet can still fail the next
    /// call) or a new one.
    pub async fn get(&self) -> Result<(Connection, bool), CallError> {
        loop {
            let Some(mut conn) = self.idle.lock().pop() else {
                break;
            };
            if !conn.peer_gone() {
                return Ok((conn, true));
            }
        }
        let mut conn = self
            .dialer
            .open(&self.addr, self.side, self.connect_timeout)
            .await?;
        if let Some(token) = &self.token {
            conn.authenticate(token).await?;
        }
        Ok((conn, false))
    }

    /// One request and its response on a pooled connection. A reused
    /// connection that fails on the way (its peer restarted since the last
    /// call, before any answer) is dropped with the other idle ones, and the
    /// call is made once more on a new connection; the caller bounds the
    /// whole with its deadline.
    pub async fn call<Resp: Body>(
        &self,
        op: Opcode,
        req: &impl Body,
        name: &'static str,
    ) -> Result<Resp, CallError> {
        let mut retried = false;
        loop {
            let (mut conn, reused) = self.get().await?;
            match conn.call(op, req, name).await {
                Ok(resp) => {
                    self.put_back(conn);
                    return Ok(resp);
                }
                Err(err @ CallError::Server { .. }) => {
                    self.put_back(conn);
                    return Err(err);
                }
                Err(CallError::Io { .. }) if reused && !retried => {
                    self.clear();
                    retried = true;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Returns a connection after a clean call.
    pub fn put_back(&self, conn: Connection) {
        if !conn.is_idle() {
            return;
        }
        let mut idle = self.idle.lock();
        if idle.len() < self.max_idle {
            idle.push(conn);
        }
    }

    /// Drops every idle connection (after the peer was found dead).
    pub fn clear(&self) {
        self.idle.lock().clear();
    }
}
