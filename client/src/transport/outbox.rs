//! Requests on a lease connection (same-host socket, RDMA control port),
//! sent while their answers are read. The daemon answers the requests it
//! has read (together, in one write) before it reads more, and reads no
//! further while its answers go unread (`store/src/leases.rs`), so a
//! client that sent a whole batch before reading would leave both sides
//! waiting on each other once the batch outgrew the socket's buffers: at
//! 4,096 requests of one call on a Unix socket, for example. An `Outbox`
//! keeps at most `WINDOW` requests unanswered, sent in turns of half as
//! many.

use std::io;

use mooncake_proto::Opcode;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::push_frame;

/// Requests a connection has unanswered, at most.
pub(crate) const WINDOW: usize = 64;

/// Request frames for one connection, answered in order.
#[derive(Default)]
pub(crate) struct Outbox {
    frames: Vec<u8>,
    /// Where each request's frame ends in `frames`.
    ends: Vec<usize>,
    /// Requests sent.
    sent: usize,
}

impl Outbox {
    /// Queues one request.
    pub fn push(&mut self, op: Opcode, id: u64, body: &[u8]) {
        push_frame(&mut self.frames, op, id, body);
        self.ends.push(self.frames.len());
    }

    /// Queues one request written by `write` into the frames' buffer.
    pub fn push_with(&mut self, write: impl FnOnce(&mut Vec<u8>)) {
        write(&mut self.frames);
        self.ends.push(self.frames.len());
    }

    /// Requests queued, sent or not.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Sends what may go before the answer to request `k` (counted from 0
    /// in the order queued) is read: at least request `k`, and up to
    /// `WINDOW` past the answers read.
    pub async fn before_answer<S: AsyncWrite + Unpin>(
        &mut self,
        conn: &mut S,
        k: usize,
    ) -> io::Result<()> {
        if self.sent <= k + WINDOW / 2 {
            self.send_up_to(conn, k + WINDOW).await?;
        }
        debug_assert!(self.sent > k || k >= self.len(), "request {k} unsent");
        Ok(())
    }

    /// Sends every request not sent yet (those whose answers are read
    /// later, or not at all by this call).
    pub async fn flush<S: AsyncWrite + Unpin>(&mut self, conn: &mut S) -> io::Result<()> {
        self.send_up_to(conn, self.len()).await
    }

    async fn send_up_to<S: AsyncWrite + Unpin>(
        &mut self,
        conn: &mut S,
        n: usize,
    ) -> io::Result<()> {
        let n = n.min(self.len());
        if n > self.sent {
            let from = self.sent.checked_sub(1).map_or(0, |i| self.ends[i]);
            conn.write_all(&self.frames[from..self.ends[n - 1]]).await?;
            self.sent = n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_proto::{Header, HEADER_LEN};

    /// The requests' ids in `bytes`, frames of empty bodies.
    fn ids(bytes: &[u8]) -> Vec<u64> {
        bytes
            .chunks(HEADER_LEN)
            .map(|h| Header::parse(h).unwrap().unwrap().request_id)
            .collect()
    }

    #[tokio::test]
    async fn requests_go_out_at_most_a_window_ahead_of_the_answers_and_all_in_order() {
        let mut outbox = Outbox::default();
        for id in 1..=200u64 {
            outbox.push(Opcode::ShmGet, id, &[]);
        }
        let mut wire = Vec::new();
        for k in 0..200 {
            outbox.before_answer(&mut wire, k).await.unwrap();
            let sent = wire.len() / HEADER_LEN;
            assert!(sent > k, "request {k} is sent before its answer is read");
            assert!(sent <= k + WINDOW, "{sent} sent when answer {k} is read");
        }
        outbox.flush(&mut wire).await.unwrap();
        assert_eq!(ids(&wire), (1..=200).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn flush_sends_what_no_answer_asked_for() {
        let mut outbox = Outbox::default();
        outbox.push(Opcode::ShmGet, 1, &[]);
        outbox.push_with(|f| push_frame(f, Opcode::ShmTouch, 2, &[]));
        let mut wire = Vec::new();
        outbox.before_answer(&mut wire, 0).await.unwrap();
        outbox.flush(&mut wire).await.unwrap();
        outbox.flush(&mut wire).await.unwrap();
        assert_eq!(ids(&wire), vec![1, 2]);
    }
}
