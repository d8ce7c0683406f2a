//! Lets a client follow the meta leader through a coordinator.

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::Coordinator;

/// A function that resolves the meta service's address to the current
/// leader's: what a client is given to follow leader changes (the
/// client's `MetaResolver` is any such function).
pub fn leader_address(
    coordinator: Arc<dyn Coordinator>,
) -> impl Fn() -> BoxFuture<'static, Result<String, String>> + Send + Sync + 'static {
    move || {
        let coordinator = coordinator.clone();
        Box::pin(async move {
            match coordinator.leader().await {
                Ok(Some(leader)) => Ok(leader.addr),
                Ok(None) => Err("no meta leader is elected".into()),
                Err(err) => Err(err.to_string()),
            }
        })
    }
}
