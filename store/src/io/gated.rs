//! For tests: an engine whose transfers go or end only when the test lets
//! them, so that what happens while one is in flight is arranged, not
//! raced.

use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::sync::Semaphore;

use super::{IoEngine, IoKind, IoRequest, IoResult};

/// Writes go to `inner` at once, but each answers only after taking one
/// of `writes`' permits (`writes.add_permits(n)` ends the next `n`).
/// Reads wait for one of `reads`' permits before they go to `inner`.
pub struct Gated {
    pub inner: Arc<dyn IoEngine>,
    pub writes: Arc<Semaphore>,
    pub reads: Arc<Semaphore>,
}

impl Gated {
    /// Over `inner`, every write and read held until the test lets it.
    pub fn over(inner: Box<dyn IoEngine>) -> Self {
        Gated {
            inner: Arc::from(inner),
            writes: Arc::new(Semaphore::new(0)),
            reads: Arc::new(Semaphore::new(0)),
        }
    }
}

impl IoEngine for Gated {
    fn submit(&self, kind: IoKind, batch: Vec<IoRequest>) -> BoxFuture<'static, Vec<IoResult>> {
        match kind {
            IoKind::Write => {
                let (done, gate) = (self.inner.submit(kind, batch), self.writes.clone());
                Box::pin(async move {
                    let out = done.await;
                    gate.acquire().await.expect("the gate stays open").forget();
                    out
                })
            }
            IoKind::Read => {
                let (inner, gate) = (self.inner.clone(), self.reads.clone());
                Box::pin(async move {
                    gate.acquire().await.expect("the gate stays open").forget();
                    inner.submit(kind, batch).await
                })
            }
        }
    }

    fn name(&self) -> &'static str {
        "gated"
    }
}
