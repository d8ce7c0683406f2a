//! Settings both servers read from their configuration under the same
//! names: certificate files (`tls_cert`, `tls_key`, `tls_client_ca`,
//! `peer_ca`). The limits are [`crate::Limits`].

use std::path::PathBuf;

use mooncake_net::{ClientTls, ServerTls};

/// A server's certificate files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// This server's certificate (PEM, with its chain).
    pub cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    pub key: Option<PathBuf>,
    /// Mutual TLS: only clients whose certificate this CA signed.
    pub client_ca: Option<PathBuf>,
    /// The CA that signed the other servers' certificates: calls to them
    /// go over QUIC, presenting `cert` and `key`.
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

    /// How this server calls the others over QUIC (`peer_ca`), if it does.
    pub fn peer_tls(&self) -> Option<ClientTls> {
        Some(ClientTls {
            ca: self.peer_ca.clone()?,
            identity: self.cert.clone().zip(self.key.clone()),
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
        assert!(
            err.starts_with("quic_listen needs tls_cert and tls_key"),
            "{err}"
        );
        assert_eq!(none.peer_tls(), None);
        let files = TlsFiles {
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
