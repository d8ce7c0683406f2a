//! Who is calling, and what they may do. A server that requires
//! authentication reads a token table (one entry per token: the token's
//! SHA-256, a name, a role and, for clients, a tenant); a connection
//! presents its token once (`Opcode::Auth`) and every request after that is
//! checked against the identity it stands for.
//!
//! A tenant owns the namespace of its name and every namespace below it
//! (`acme`, `acme/llama-3-8b`): its clients can neither read nor write, nor
//! even probe, blocks of any other tenant, whatever namespace they send.

use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::codec::{Reader, Writer};
use crate::error::ProtoError;
use crate::key::Namespace;
use crate::message::Body;
use crate::Opcode;

/// Longest token accepted on the wire.
pub const MAX_TOKEN_LEN: usize = 1024;

/// What an identity may do, in increasing power.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// A worker: blocks of its tenant's namespaces.
    Client,
    /// A daemon or meta replica: registration, inventories, and blocks of
    /// every namespace (it stores them all).
    Cluster,
    /// An operator: everything, draining and forced eviction included.
    Admin,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "client" => Some(Role::Client),
            "cluster" => Some(Role::Cluster),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    /// The role an operation needs.
    pub fn needed_for(op: Opcode) -> Role {
        match op {
            Opcode::Evict | Opcode::Drain => Role::Admin,
            Opcode::Register
            | Opcode::Heartbeat
            | Opcode::Events
            | Opcode::Inventory
            | Opcode::Leave
            | Opcode::Admit
            | Opcode::Fetch => Role::Cluster,
            _ => Role::Client,
        }
    }
}

/// The identity behind a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// For logs and metrics: which token this is.
    pub name: Arc<str>,
    pub role: Role,
    /// The tenant whose namespaces a client may use; `None`: every
    /// namespace (cluster and admin roles, or authentication off).
    pub tenant: Option<Arc<str>>,
}

impl Identity {
    /// Anyone, when a server does not require authentication.
    pub fn open() -> Identity {
        Identity {
            name: "anonymous".into(),
            role: Role::Admin,
            tenant: None,
        }
    }

    /// Whether this identity may use blocks of `ns`.
    pub fn may_use(&self, ns: &Namespace) -> bool {
        match &self.tenant {
            None => true,
            Some(t) => {
                let ns = ns.as_str();
                ns == &**t
                    || (ns.len() > t.len()
                        && ns.starts_with(&**t)
                        && ns.as_bytes()[t.len()] == b'/')
            }
        }
    }

    /// Whether this identity may ask for `op` at all.
    pub fn may(&self, op: Opcode) -> bool {
        self.role >= Role::needed_for(op)
    }
}

/// The authentication state of one server connection: open when the server
/// requires none; otherwise nothing but `Auth` until a valid token came.
#[derive(Debug, Clone)]
pub struct Gate {
    table: Option<Arc<TokenTable>>,
    who: Option<Identity>,
    /// The name a verified client certificate gave this connection (mutual
    /// TLS): only a token of that name is accepted on it.
    bound_to: Option<String>,
}

impl Gate {
    /// A new connection's gate; `None`: authentication is off.
    pub fn new(table: Option<Arc<TokenTable>>) -> Gate {
        let who = table.is_none().then(Identity::open);
        Gate {
            table,
            who,
            bound_to: None,
        }
    }

    /// A gate for a connection whose client proved, with a certificate,
    /// that it is `name`: a token stolen from another holder is refused
    /// here, because its name is not the certificate's.
    pub fn bound_to(table: Option<Arc<TokenTable>>, name: Option<String>) -> Gate {
        Gate {
            bound_to: name,
            ..Gate::new(table)
        }
    }

    /// A token presented with `Opcode::Auth`: `Ok`, or `Unauthorized`
    /// (the server then closes the connection).
    pub fn present(&mut self, token: &str) -> crate::ErrorCode {
        match &self.table {
            None => crate::ErrorCode::Ok,
            Some(table) => match table.identify(token) {
                Some(who) if self.bound_to.as_deref().is_none_or(|n| n == &*who.name) => {
                    self.who = Some(who);
                    crate::ErrorCode::Ok
                }
                _ => crate::ErrorCode::Unauthorized,
            },
        }
    }

    /// Whether requests may come: authentication is off, or a valid token
    /// was presented.
    pub fn is_proven(&self) -> bool {
        self.who.is_some()
    }

    /// The identity a request of `op` runs as, or `Unauthorized`.
    pub fn admit(&self, op: Opcode) -> Result<&Identity, crate::ErrorCode> {
        match &self.who {
            Some(who) if who.may(op) => Ok(who),
            _ => Err(crate::ErrorCode::Unauthorized),
        }
    }
}

/// The body of `Opcode::Auth`: the token, as the client has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthRequest {
    pub token: String,
}

impl Body for AuthRequest {
    fn encode(&self, w: &mut Writer) {
        w.str(&self.token);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let token = r.str()?;
        if token.is_empty() || token.len() > MAX_TOKEN_LEN {
            return Err(ProtoError::Invalid {
                field: "token",
                why: format!("{} bytes; 1 to {MAX_TOKEN_LEN} expected", token.len()),
            });
        }
        Ok(AuthRequest {
            token: token.to_string(),
        })
    }
}

/// The SHA-256 of a token, as the token table lists it (hex).
pub fn token_digest(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Tokens a server accepts, by digest. The table holds no secret: a token
/// cannot be recovered from it.
#[derive(Debug, Clone, Default)]
pub struct TokenTable {
    by_digest: HashMap<[u8; 32], Identity>,
}

impl TokenTable {
    /// The identity a token stands for, if any.
    pub fn identify(&self, token: &str) -> Option<Identity> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_digest.get(&digest).cloned()
    }

    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// Adds a token by its hex SHA-256 digest.
    pub fn insert(&mut self, sha256_hex: &str, identity: Identity) -> Result<(), String> {
        let raw = hex::decode(sha256_hex.trim())
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| format!("token {}: sha256 is not 64 hex digits", identity.name))?;
        if identity.role == Role::Client && identity.tenant.is_none() {
            return Err(format!(
                "token {}: a client token needs a tenant",
                identity.name
            ));
        }
        if let Some(t) = &identity.tenant {
            Namespace::new(t.to_string())
                .map_err(|e| format!("token {}: tenant {t:?}: {e}", identity.name))?;
        }
        if self.by_digest.insert(raw, identity.clone()).is_some() {
            return Err(format!("token {}: listed twice", identity.name));
        }
        Ok(())
    }
}

#[cfg(feature = "serde")]
mod file {
    use super::*;

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct FileEntry {
        name: String,
        sha256: String,
        role: String,
        tenant: Option<String>,
    }

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct TokenFile {
        #[serde(default)]
        tokens: Vec<FileEntry>,
    }

    impl TokenTable {
        /// Parses a token file: `[[tokens]]` entries with `name`, `sha256`
        /// (of the token), `role` (`client`, `cluster`, `admin`) and, for
        /// clients, `tenant`.
        pub fn parse(text: &str) -> Result<TokenTable, String> {
            let file: TokenFile = toml::from_str(text).map_err(|e| e.to_string())?;
            let mut table = TokenTable::default();
            for e in file.tokens {
                let role = Role::parse(&e.role).ok_or_else(|| {
                    format!(
                        "token {}: role {:?} is not client, cluster or admin",
                        e.name, e.role
                    )
                })?;
                let tenant = match role {
                    Role::Client => e.tenant.map(Arc::from),
                    _ if e.tenant.is_some() => {
                        return Err(format!(
                            "token {}: only client tokens have a tenant",
                            e.name
                        ))
                    }
                    _ => None,
                };
                table.insert(
                    &e.sha256,
                    Identity {
                        name: e.name.into(),
                        role,
                        tenant,
                    },
                )?;
            }
            if table.is_empty() {
                return Err("no [[tokens]] listed".into());
            }
            Ok(table)
        }

        /// The table at `path`, if a path is given.
        pub fn load_optional(
            path: Option<&std::path::Path>,
        ) -> Result<Option<Arc<TokenTable>>, String> {
            path.map(|p| Self::load(p).map(Arc::new)).transpose()
        }

        pub fn load(path: &std::path::Path) -> Result<TokenTable, String> {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("token file {}: {e}", path.display()))?;
            Self::parse(&text).map_err(|e| format!("token file {}: {e}", path.display()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(tenant: &str) -> Identity {
        Identity {
            name: "t".into(),
            role: Role::Client,
            tenant: Some(tenant.into()),
        }
    }

    #[test]
    fn a_tenant_owns_its_namespace_and_those_below_only() {
        let acme = client("acme");
        for ok in ["acme", "acme/llama", "acme/a/b"] {
            assert!(acme.may_use(&Namespace::new(ok).unwrap()), "{ok}");
        }
        for no in ["acmecorp", "acme-2", "globex", "globex/acme", "acm"] {
            assert!(!acme.may_use(&Namespace::new(no).unwrap()), "{no}");
        }
        assert!(Identity::open().may_use(&Namespace::new("anything").unwrap()));
    }

    #[test]
    fn roles_gate_operations() {
        let c = client("acme");
        assert!(c.may(Opcode::Get) && c.may(Opcode::PutStart) && c.may(Opcode::Ping));
        assert!(!c.may(Opcode::Evict) && !c.may(Opcode::Drain) && !c.may(Opcode::Register));
        let cluster = Identity {
            role: Role::Cluster,
            tenant: None,
            ..c
        };
        assert!(cluster.may(Opcode::Register) && !cluster.may(Opcode::Drain));
    }

    #[test]
    fn tokens_are_found_by_digest_only() {
        let mut t = TokenTable::default();
        t.insert(&token_digest("s3cret"), client("acme")).unwrap();
        assert_eq!(t.identify("s3cret"), Some(client("acme")));
        assert_eq!(t.identify("s3cret "), None);
        assert!(t.insert(&token_digest("s3cret"), client("acme")).is_err());
        assert!(t.insert("abc", client("acme")).is_err());
    }

    #[test]
    fn a_connection_bound_to_a_certificate_takes_only_that_name_s_token() {
        let named = |name: &str| Identity {
            name: name.into(),
            ..client("acme")
        };
        let mut t = TokenTable::default();
        t.insert(&token_digest("mine"), named("worker-1")).unwrap();
        t.insert(&token_digest("stolen"), named("worker-2"))
            .unwrap();
        let table = Some(Arc::new(t));
        let mut gate = Gate::bound_to(table.clone(), Some("worker-1".into()));
        assert_eq!(gate.present("stolen"), crate::ErrorCode::Unauthorized);
        assert!(gate.admit(Opcode::Get).is_err());
        assert_eq!(gate.present("mine"), crate::ErrorCode::Ok);
        assert_eq!(&*gate.admit(Opcode::Get).unwrap().name, "worker-1");
        // Unbound (TCP, or no client certificate): any listed token.
        assert_eq!(
            Gate::bound_to(table, None).present("stolen"),
            crate::ErrorCode::Ok
        );
    }

    #[cfg(feature = "serde")]
    #[test]
    fn token_files_parse_and_refuse_nonsense() {
        let text = format!(
            "[[tokens]]\nname = \"acme-workers\"\nsha256 = \"{}\"\nrole = \"client\"\ntenant = \"acme\"\n\
             [[tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nrole = \"admin\"\n",
            token_digest("a"),
            token_digest("b")
        );
        let t = TokenTable::parse(&text).unwrap();
        assert_eq!(t.identify("b").unwrap().role, Role::Admin);
        assert!(TokenTable::parse("").is_err());
        let no_tenant = format!(
            "[[tokens]]\nname = \"x\"\nsha256 = \"{}\"\nrole = \"client\"\n",
            token_digest("a")
        );
        assert!(TokenTable::parse(&no_tenant)
            .unwrap_err()
            .contains("needs a tenant"));
    }
}
