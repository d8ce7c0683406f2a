//! Lets a client follow the meta leader through a coordinator.

use std::sync::Arc;

use futures::future::BoxFuture;
use mooncake_client::MetaResolver;

use crate::Coordinator;

/// Resolves the meta service's address to the current leader's.
pub struct LeaderResolver(pub Arc<dyn Coordinator>);

impl MetaResolver for LeaderResolver {
    fn resolve(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            match self.0.leader().await {
                Ok(Some(leader)) => Ok(leader.addr),
                Ok(None) => Err("no meta leader is elected".into()),
                Err(err) => Err(err.to_string()),
            }
        })
    }
}
