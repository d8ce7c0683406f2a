//! Framed requests on a byte stream: a TCP connection or a QUIC stream.
//! A batch is pipelined on one stream (every request written while the
//! answers are read), values written straight from the caller's slices and
//! read straight into the caller's buffers (each piece of a block in
//! place, for blocks made of pieces).

use std::sync::Arc;

use futures::future::BoxFuture;
use mooncake_proto::message::{Body, KeyRequest, PutHead, GET_HEAD_LEN};
use mooncake_proto::transport::TransportKind;
use mooncake_proto::{BlockKey, ErrorCode, Namespace, Opcode};

use super::{GetItem, PutItem, Read, Transport, Written};
use crate::{ClientError, ErrorSource};
use mooncake_net::ConnPool;
use mooncake_net::FrameReader;

/// TCP or QUIC to one daemon, through a pool of idle streams.
pub(crate) struct StreamTransport {
    pub pool: Arc<ConnPool>,
    /// Most streams one large batch is spread over.
    pub stripes: usize,
}

/// A batch is spread over several streams only when each gets at least
/// this many bytes. One stream drains at each block boundary (its sender
/// is woken for every next block); several keep the bytes flowing. With 1
/// MiB against 8 MiB, batches of 16 blocks of 256 KiB, one in flight, read
/// at 3.86 against 2.79 GB/s (medians of six runs; `docs/benchmarks.md`,
/// "Striping"), and no shape measured lost.
const STRIPE_BYTES: usize = 1 << 20;

/// How many streams a batch of `bytes` in `blocks` blocks goes over.
fn stripes(max: usize, blocks: usize, bytes: usize) -> usize {
    (bytes / STRIPE_BYTES)
        .clamp(1, max.max(1))
        .min(blocks.max(1))
}

impl Transport for StreamTransport {
    fn kind(&self) -> TransportKind {
        self.pool.kind()
    }

    fn get<'a, 'b: 'a>(
        &'a self,
        namespace: &'a Namespace,
        items: &'a mut [GetItem<'b>],
    ) -> BoxFuture<'a, Result<Vec<Read>, ClientError>> {
        Box::pin(async move {
            let bytes = items.iter().map(|it| it.location.size as usize).sum();
            let per = self.part_len(items.len(), bytes);
            // Each block still lands straight in its buffer.
            let parts = items
                .chunks_mut(per)
                .map(|part| self.get_batch(namespace, part));
            joined(parts.collect()).await
        })
    }

    fn put<'a, 'b: 'a>(
        &'a self,
        namespace: &'a Namespace,
        items: &'a [PutItem<'b>],
    ) -> BoxFuture<'a, Result<Vec<Written>, ClientError>> {
        Box::pin(async move {
            let bytes = items.iter().map(|it| it.value.len()).sum();
            let per = self.part_len(items.len(), bytes);
            let parts = items
                .chunks(per)
                .map(|part| self.put_batch(namespace, part));
            joined(parts.collect()).await
        })
    }
}

/// Runs the parts of a batch at once (each on a stream of its own) and
/// joins their answers in order.
async fn joined<T>(
    parts: Vec<impl std::future::Future<Output = Result<Vec<T>, ClientError>>>,
) -> Result<Vec<T>, ClientError> {
    let mut out = Vec::new();
    for part in futures::future::join_all(parts).await {
        out.extend(part?);
    }
    Ok(out)
}

impl StreamTransport {
    /// Blocks per part when a batch of `blocks` blocks and `bytes` bytes
    /// is spread over several streams (the whole batch, when it is not).
    fn part_len(&self, blocks: usize, bytes: usize) -> usize {
        blocks.div_ceil(stripes(self.stripes, blocks, bytes)).max(1)
    }

    async fn get_batch(
        &self,
        namespace: &Namespace,
        items: &mut [GetItem<'_>],
    ) -> Result<Vec<Read>, ClientError> {
        let pool = &self.pool;
        let requests: Vec<Vec<u8>> = items
            .iter()
            .map(|it| {
                KeyRequest {
                    key: BlockKey::new(namespace.clone(), it.hash),
                }
                .to_bytes()
            })
            .collect();
        for attempt in 0..2 {
            let (mut conn, reused) = pool.get().await?;
            let (writer, reader) = conn.split();
            let write = async {
                for req in &requests {
                    writer.send(Opcode::Get, req, &[]).await?;
                }
                writer.flush().await
            };
            let read = async {
                let mut got = Vec::with_capacity(items.len());
                for item in items.iter_mut() {
                    got.push(read_one_get(reader, item).await?);
                }
                Ok::<_, ClientError>(got)
            };
            let (written, read) = tokio::join!(write, read);
            match (written, read) {
                (Ok(()), Ok(got)) => {
                    pool.put_back(conn);
                    return Ok(got);
                }
                // A pooled stream the daemon closed meanwhile: once more
                // on a fresh one.
                (Err(_), _) | (_, Err(ClientError::Io { .. })) if reused && attempt == 0 => {}
                (Err(err), _) => return Err(self.io(err)),
                (_, Err(err)) => return Err(err),
            }
        }
        Err(self.unavailable("get"))
    }

    async fn put_batch(
        &self,
        namespace: &Namespace,
        items: &[PutItem<'_>],
    ) -> Result<Vec<Written>, ClientError> {
        let pool = &self.pool;
        // The checksum goes in the head, before the bytes.
        let sums: Vec<u64> = items.iter().map(PutItem::sum).collect();
        let heads: Vec<Vec<u8>> = items
            .iter()
            .zip(&sums)
            .map(|(it, &checksum)| {
                PutHead {
                    key: BlockKey::new(namespace.clone(), it.hash),
                    checksum,
                    parent: it.parent,
                    continues: it.continues,
                    tag: it.tag.clone(),
                }
                .to_bytes()
            })
            .collect();
        for attempt in 0..2 {
            let (mut conn, reused) = pool.get().await?;
            let (writer, reader) = conn.split();
            let write = async {
                for (item, head) in items.iter().zip(&heads) {
                    writer
                        .send_pieces(Opcode::Put, head, item.value.pieces())
                        .await?;
                }
                writer.flush().await
            };
            let read = async {
                let mut written = Vec::with_capacity(items.len());
                for &checksum in &sums {
                    let header = reader.next_header(Opcode::Put).await?;
                    reader.discard(header.body_len as usize).await?;
                    let code = ErrorCode::from_u16(header.status).unwrap_or(ErrorCode::Internal);
                    written.push(Written { code, checksum });
                }
                Ok::<_, ClientError>(written)
            };
            let (written, read) = tokio::join!(write, read);
            match (written, read) {
                (Ok(()), Ok(codes)) => {
                    pool.put_back(conn);
                    return Ok(codes);
                }
                (Err(_), _) | (_, Err(ClientError::Io { .. })) if reused && attempt == 0 => {}
                (Err(err), _) => return Err(self.io(err)),
                (_, Err(err)) => return Err(err),
            }
        }
        Err(self.unavailable("put"))
    }

    fn io(&self, err: std::io::Error) -> ClientError {
        ClientError::Io {
            side: ErrorSource::Daemon,
            addr: self.pool.addr().to_string(),
            err,
        }
    }

    fn unavailable(&self, op: &'static str) -> ClientError {
        ClientError::Server {
            side: ErrorSource::Daemon,
            addr: self.pool.addr().to_string(),
            op,
            code: ErrorCode::Unavailable,
        }
    }
}

/// Reads one `Get` response into the item's buffer and verifies it: the
/// bytes against the checksum the daemon sent, and that checksum against
/// the one the location carries (the writer's).
async fn read_one_get(
    reader: &mut FrameReader,
    item: &mut GetItem<'_>,
) -> Result<Read, ClientError> {
    let header = reader.next_header(Opcode::Get).await?;
    let len = header.body_len as usize;
    let status = ErrorCode::from_u16(header.status).unwrap_or(ErrorCode::Internal);
    if status != ErrorCode::Ok {
        reader.discard(len).await?;
        return Ok(match status {
            ErrorCode::NotFound => Read::Missing,
            ErrorCode::Corrupt => Read::Corrupt,
            other => Read::Failed(other),
        });
    }
    if len < GET_HEAD_LEN {
        return Err(reader.protocol("get response shorter than its head"));
    }
    let mut head = [0u8; GET_HEAD_LEN];
    reader.read_into(&mut head).await?;
    let sent_checksum = u64::from_le_bytes(head);
    let value_len = len - GET_HEAD_LEN;
    if value_len > item.buf.len() {
        reader.discard(value_len).await?;
        return Ok(Read::Failed(ErrorCode::TooLarge));
    }
    let dst = item.buf.pieces_mut(value_len);
    if reader.read_into_pieces_hashed(dst).await? != sent_checksum {
        return Ok(Read::Corrupt);
    }
    if sent_checksum != item.location.checksum || value_len != item.location.size as usize {
        return Ok(Read::Stale);
    }
    Ok(Read::Hit(value_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_striped_a_megabyte_or_more_a_stream() {
        assert_eq!(stripes(4, 1, 64 << 20), 1, "one block, one stream");
        assert_eq!(stripes(4, 64, 64 * (16 << 10)), 1, "1 MiB in all");
        assert_eq!(stripes(4, 128, 128 * (16 << 10)), 2, "2 MiB in all");
        assert_eq!(stripes(4, 16, 16 * (256 << 10)), 4, "4 MiB");
        assert_eq!(stripes(4, 3, 3 * (256 << 10)), 1, "under a stripe's worth");
        assert_eq!(stripes(4, 3, 3 * (4 << 20)), 3, "a stream a block");
        assert_eq!(stripes(1, 128, 1 << 30), 1, "striping off");
    }
}
