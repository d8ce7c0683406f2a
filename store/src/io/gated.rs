//! For tests: an engine whose writes end only when the test lets them, so
//! that what happens while a write is in flight is arranged, not raced.

use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::sync::Semaphore;

use super::{IoEngine, IoKind, IoRequest, IoResult};

/// Writes go to `inner` at once, but each answers only after taking one
/// of `gate`'s permits (`gate.add_permits(n)` ends the next `n`).
pub struct Gated {
    pub inner: Box<dyn IoEngine>,
    pub gate: Arc<Semaphore>,
}

impl IoEngine for Gated {
    fn submit(&self, kind: IoKind, batch: Vec<IoRequest>) -> BoxFuture<'static, Vec<IoResult>> {
        let done = self.inner.submit(kind, batch);
        if kind != IoKind::Write {
            return done;
        }
        let gate = self.gate.clone();
        Box::pin(async move {
            let out = done.await;
            gate.acquire().await.expect("the gate stays open").forget();
            out
        })
    }

    fn name(&self) -> &'static str {
        "gated"
    }
}
