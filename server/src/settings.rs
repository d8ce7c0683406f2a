//! Settings both servers read from their configuration under the same
//! names: TLS on the TCP port (`tls`) and certificate files (`tls_cert`,
//! `tls_key`, `tls_client_ca`, `peer_ca`). The limits are
//! [`crate::Limits`].

use std::path::PathBuf;
use std::sync::Arc;

use mooncake_net::quic::QuicConnector;
use mooncake_net::{ClientTls, Dialer, ServerTls, TlsAcceptor, TlsConnector};

/// A server's certificate files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// The TCP port speaks TLS only, with `cert` and `key`.
    pub tcp: bool,
    /// This server's certificate (PEM, with its chain).
    pub cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    pub key: Option<PathBuf>,
    /// Mutual TLS: only clients whose certificate this CA signed.
    pub client_ca: Option<PathBuf>,
    /// The CA that signed the other servers' certificates: calls to them
    /// are encrypted, presenting `cert` and `key` (see `peer_dialer`).
    pub peer_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// The settings of a QUIC listener, checked to be complete; `setting`
    /// names what needs them in the error.
    pub fn server_tls(&self, setting: &str) -> Result<ServerTls, String> {
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Ok(ServerTls {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.client_ca.clone(),
            }),
            _ => Err(format!(
                "{setting} needs tls_cert and tls_key (mooncake-store certs makes a development set)"
            )),
        }
    }

    /// The TLS settings of the TCP port, when `tls` is on.
    pub fn tcp_acceptor(&self) -> Result<Option<Arc<TlsAcceptor>>, String> {
        if !self.tcp {
            return Ok(None);
        }
        let tls = self.server_tls("tls")?;
        let acceptor = TlsAcceptor::new(&tls).map_err(|e| format!("tls: {e}"))?;
        Ok(Some(Arc::new(acceptor)))
    }

    /// The certificates this server presents to the others, and the CA it
    /// trusts them with (`peer_ca`), if it has one.
    pub fn peer_tls(&self) -> Option<ClientTls> {
        Some(ClientTls {
            ca: self.peer_ca.clone()?,
            identity: self.cert.clone().zip(self.key.clone()),
        })
    }

    /// How this server calls the others: in clear without `peer_ca`; with
    /// it, over TLS on their TCP ports when this server's own TCP port
    /// speaks TLS (`tls`: the cluster's ports do), else over QUIC.
    pub fn peer_dialer(&self) -> Result<Dialer, String> {
        let Some(tls) = self.peer_tls() else {
            return Ok(Dialer::Tcp);
        };
        let failed = |e: mooncake_net::TlsError| format!("peer_ca: {e}");
        Ok(if self.tcp {
            Dialer::Tls(Arc::new(TlsConnector::new(&tls).map_err(failed)?))
        } else {
            Dialer::Quic(Arc::new(QuicConnector::new(&tls).map_err(failed)?))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_needs_both_files_and_peers_present_them() {
        let none = TlsFiles::default();
        let err = none.server_tls("quic_listen").unwrap_err();
        let tcp = TlsFiles {
            tcp: true,
            ..TlsFiles::default()
        };
        let err_tcp = tcp.tcp_acceptor().err().expect("no certificate");
        assert!(
            err_tcp.starts_with("tls needs tls_cert and tls_key"),
            "{err_tcp}"
        );
        assert!(
            err.starts_with("quic_listen needs tls_cert and tls_key"),
            "{err}"
        );
        assert_eq!(none.peer_tls(), None);
        let files = TlsFiles {
            tcp: false,
            cert: Some("d.pem".into()),
            key: Some("d.key".into()),
            client_ca: None,
            peer_ca: Some("ca.pem".into()),
        };
        assert_eq!(
            files.server_tls("quic").unwrap().cert,
            PathBuf::from("d.pem")
        );
        let peer = files.peer_tls().unwrap();
        assert_eq!(peer.ca, PathBuf::from("ca.pem"));
        assert_eq!(peer.identity, Some(("d.pem".into(), "d.key".into())));
    }
}
