//! TLS 1.3 (rustls): the certificates and keys each side presents and
//! trusts, loaded from PEM files with one-line errors naming the file, the
//! rustls settings built from them, and a development CA for test
//! clusters. QUIC (`crate::quic`) and TLS over TCP (`crate::tcp_tls`) use
//! the same settings.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

/// What goes wrong loading certificates: one line, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    #[error("{path}: no {what} found in this PEM file")]
    Empty { path: PathBuf, what: &'static str },
    #[error("{path}: {err}")]
    Rejected { path: PathBuf, err: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// A client's TLS settings: the CA that signed the daemons' certificates,
/// and this client's own certificate and key for mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTls {
    pub ca: PathBuf,
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// A server's TLS settings: its certificate and key, and the CA whose
/// clients it accepts (mutual TLS; none: any client, as over TCP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The application protocol both sides must name, over QUIC and TCP.
pub const ALPN: &[u8] = b"mooncake/1";

/// A client's rustls settings: trusts `tls.ca`, presents `tls.identity`
/// if set; TLS 1.3 only.
pub(crate) fn client_crypto(tls: &ClientTls) -> Result<rustls::ClientConfig, TlsError> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots(&tls.ca)?);
    let mut config = match &tls.identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|err| TlsError::Rejected {
                path: key.clone(),
                err: err.to_string(),
            })?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}

/// A server's rustls settings: its certificate, and mutual TLS if
/// `client_ca` is set; TLS 1.3 only, no early data.
pub(crate) fn server_crypto(tls: &ServerTls) -> Result<rustls::ServerConfig, TlsError> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match &tls.client_ca {
        Some(ca) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(ca)?),
                provider(),
            )
            .build()
            .map_err(|err| TlsError::Rejected {
                path: ca.clone(),
                err: err.to_string(),
            })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(load_certs(&tls.cert)?, load_key(&tls.key)?)
        .map_err(|err| TlsError::Rejected {
            path: tls.key.clone(),
            err: err.to_string(),
        })?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    config.max_early_data_size = 0;
    Ok(config)
}

/// The name a peer's verified certificate chain gives it: the leaf's
/// first DNS name (`mooncake-store certs --client NAME` puts the name
/// there). `None` without a certificate (mutual TLS off).
pub(crate) fn cert_name(certs: &[CertificateDer<'_>]) -> Option<String> {
    let leaf = webpki::EndEntityCert::try_from(certs.first()?).ok()?;
    let name = leaf.valid_dns_names().next().map(str::to_string);
    name
}

/// The name a server's certificate must carry: the host part of its
/// address (an IP address or a DNS name).
pub(crate) fn server_name(addr: &str) -> String {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

fn open(path: &Path) -> Result<BufReader<File>, TlsError> {
    File::open(path)
        .map(BufReader::new)
        .map_err(|err| TlsError::Read {
            path: path.to_path_buf(),
            err,
        })
}

/// Every certificate in a PEM file (a leaf and its chain, or CAs).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = rustls_pemfile::certs(&mut open(path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| TlsError::Read {
            path: path.to_path_buf(),
            err,
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            path: path.to_path_buf(),
            what: "certificate",
        });
    }
    Ok(certs)
}

/// The private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    rustls_pemfile::private_key(&mut open(path)?)
        .map_err(|err| TlsError::Read {
            path: path.to_path_buf(),
            err,
        })?
        .ok_or_else(|| TlsError::Empty {
            path: path.to_path_buf(),
            what: "private key",
        })
}

pub(crate) fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|err| TlsError::Rejected {
            path: path.to_path_buf(),
            err: err.to_string(),
        })?;
    }
    Ok(roots)
}

/// A development CA with one daemon certificate and one client
/// certificate (PEM), for test clusters; production clusters bring
/// certificates from their own CA, in the same files.
pub struct DevCerts {
    pub ca_pem: String,
    pub ca_key: String,
    pub daemon_pem: String,
    pub daemon_key: String,
    pub client_pem: String,
    pub client_key: String,
}

impl DevCerts {
    /// The daemon certificate is valid for `hosts` (names or addresses);
    /// the client certificate is named `client`.
    pub fn generate(hosts: &[String], client: &str) -> Result<DevCerts, rcgen::Error> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "Mooncake Store development CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key)?;
        let leaf = |names: Vec<String>, cn: &str, usage| {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(names)?;
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = usage;
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            let cert = params.signed_by(&key, &ca_cert, &ca_key)?;
            Ok::<_, rcgen::Error>((cert.pem(), key.serialize_pem()))
        };
        let daemon = leaf(
            hosts.to_vec(),
            "mooncake-daemon",
            // Servers also present it when they call each other
            // (`peer_ca`), as clients.
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )?;
        let client = leaf(
            vec![client.to_string()],
            client,
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        )?;
        Ok(DevCerts {
            ca_pem: ca_cert.pem(),
            ca_key: ca_key.serialize_pem(),
            daemon_pem: daemon.0,
            daemon_key: daemon.1,
            client_pem: client.0,
            client_key: client.1,
        })
    }

    /// Writes `ca.pem`, `ca.key`, `daemon.pem`, `daemon.key`, `client.pem`,
    /// `client.key` into `dir` (keys readable by their owner only).
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::create_dir_all(dir)?;
        for (name, text) in self.files() {
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create(true).truncate(true);
            if name.ends_with(".key") {
                options.mode(0o600);
            }
            let mut file = options.open(dir.join(name)).map_err(|err| {
                std::io::Error::new(err.kind(), format!("{}: {err}", dir.join(name).display()))
            })?;
            file.write_all(text.as_bytes())?;
        }
        Ok(())
    }

    /// File names and contents, as `write` lays them out.
    pub fn files(&self) -> [(&'static str, &str); 6] {
        [
            ("ca.pem", &self.ca_pem),
            ("ca.key", &self.ca_key),
            ("daemon.pem", &self.daemon_pem),
            ("daemon.key", &self.daemon_key),
            ("client.pem", &self.client_pem),
            ("client.key", &self.client_key),
        ]
    }

    /// The daemon's settings for certificates written to `dir`.
    pub fn server_tls(dir: &Path, mutual: bool) -> ServerTls {
        ServerTls {
            cert: dir.join("daemon.pem"),
            key: dir.join("daemon.key"),
            client_ca: mutual.then(|| dir.join("ca.pem")),
        }
    }

    /// A client's settings for certificates written to `dir`.
    pub fn client_tls(dir: &Path, with_identity: bool) -> ClientTls {
        ClientTls {
            ca: dir.join("ca.pem"),
            identity: with_identity.then(|| (dir.join("client.pem"), dir.join("client.key"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_name_is_the_host_part() {
        assert_eq!(server_name("127.0.0.1:7171"), "127.0.0.1");
        assert_eq!(server_name("[::1]:7171"), "::1");
        assert_eq!(server_name("gpu-3.example:7171"), "gpu-3.example");
    }

    #[test]
    fn missing_and_empty_files_are_named() {
        let err = load_certs(Path::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(
            err.to_string().starts_with("/nonexistent/ca.pem: "),
            "{err}"
        );
        let dir = std::env::temp_dir().join(format!("mc-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a pem file\n").unwrap();
        let err = load_key(&empty).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{}: no private key found in this PEM file", empty.display())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
