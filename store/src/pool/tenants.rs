//! Tenants' shares of the pool: a tenant with a quota that is over its
//! share makes room from its own blocks, and what each tenant holds is
//! reported.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{DramPool, Inner, PoolError, UNIT};

impl DramPool {
    /// Over its share, a tenant makes room for `units` more from its own
    /// blocks.
    pub(super) fn tenant_room(
        &self,
        inner: &mut Inner,
        t: u16,
        units: u64,
    ) -> Result<(), PoolError> {
        let capacity_units = self.region.len() as u64 / UNIT;
        let limit = self.cfg.quotas.limit(t, capacity_units);
        if units > limit {
            return Err(PoolError::NoSpace);
        }
        while inner.tenant_used[t as usize] + units > limit {
            if !self.evict_tenant_one(inner, t) {
                return Err(PoolError::NoSpace);
            }
        }
        Ok(())
    }

    /// Each tenant with a quota: (tenant, bytes used, bytes allowed).
    pub fn tenant_usage(&self) -> Vec<(Arc<str>, u64, u64)> {
        let inner = self.inner.lock();
        let capacity = self.region.len() as u64;
        (0..self.cfg.quotas.len() as u16)
            .map(|t| {
                let used = inner.tenant_used[t as usize] * UNIT;
                (
                    self.cfg.quotas.name(t).clone(),
                    used,
                    self.cfg.quotas.limit(t, capacity),
                )
            })
            .collect()
    }

    /// Blocks evicted because their tenant was over its share.
    pub fn quota_evictions(&self) -> u64 {
        self.quota_evictions.load(Ordering::Relaxed)
    }
}
