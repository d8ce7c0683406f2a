//! Tenants' shares of a tier: which tenant a block belongs to (the longest
//! tenant name that is its namespace or a path above it), and how much of
//! the tier that tenant may hold. Used by the DRAM pool and the NVMe drives
//! alike; a tenant over its share makes room from its own coldest blocks.

use std::sync::Arc;

use mooncake_proto::Namespace;

/// Blocks looked at, coldest first, for one of an over-quota tenant's own.
pub const MAX_QUOTA_SCAN: usize = 1 << 16;

#[derive(Debug, Clone, Default)]
pub struct Quotas(Vec<(Arc<str>, f64)>);

impl Quotas {
    /// Tenants and their shares (above 0, at most 1).
    pub fn new(shares: impl IntoIterator<Item = (Arc<str>, f64)>) -> Quotas {
        Quotas(shares.into_iter().collect())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The tenant (its index) whose share a block of `ns` counts against.
    pub fn tenant_of(&self, ns: &Namespace) -> Option<u16> {
        let ns = ns.as_str();
        self.0
            .iter()
            .enumerate()
            .filter(|(_, (t, _))| {
                ns == &**t || (ns.starts_with(&**t) && ns.as_bytes().get(t.len()) == Some(&b'/'))
            })
            .max_by_key(|(_, (t, _))| t.len())
            .map(|(i, _)| i as u16)
    }

    /// How much of `capacity` tenant `t` may hold.
    pub fn limit(&self, t: u16, capacity: u64) -> u64 {
        (capacity as f64 * self.0[t as usize].1) as u64
    }

    pub fn name(&self, t: u16) -> &Arc<str> {
        &self.0[t as usize].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_counts_against_its_longest_tenant() {
        let q = Quotas::new([("acme".into(), 0.5), ("acme/big".into(), 0.25)]);
        let ns = |s: &str| Namespace::new(s).unwrap();
        assert_eq!(q.tenant_of(&ns("acme")), Some(0));
        assert_eq!(q.tenant_of(&ns("acme/llama")), Some(0));
        assert_eq!(q.tenant_of(&ns("acme/big/x")), Some(1));
        assert_eq!(q.tenant_of(&ns("acmecorp")), None);
        assert_eq!(q.limit(1, 1000), 250);
    }
}
