//! Same-host gets into and puts from GPU memory with no staging copy: the
//! pool's mapping is registered with the GPU once (page-locked, so its
//! copy engines reach it).
//!
//! - A get leases each block and the GPU copies it up straight from the
//!   pool, while this CPU checks the pool's bytes against the block's
//!   checksum. The leases end only once the copies are done, so the bytes
//!   copied are the bytes checked. A block that does not check out is
//!   read again the usual way (staged, where a corrupt copy is reported).
//! - A put reserves room for each block and the GPU copies it down
//!   straight into that room. Once the copies are done this CPU hashes
//!   the rooms (on several threads for a large group) and each commit
//!   carries the checksum of the bytes as they lie in the pool: the
//!   checksum is of what is stored, read once.

use std::sync::Arc;

use mooncake_proto::checksum::checksum;
use mooncake_proto::frame::MAX_BATCH;
use mooncake_proto::message::EngineTag;
use mooncake_proto::BlockHash;

use super::*;
use crate::device::{down, up, Device, DeviceError, Span, Stage, COPY_FAILED};

/// What became of one block read straight into GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direct {
    /// Its bytes fill the first `n` bytes of its spans, once the stage's
    /// copies are done.
    Hit(usize),
    /// Larger than its spans.
    TooLarge,
    /// Not in the pool, or its bytes did not check out: read it another
    /// way.
    Elsewhere,
}

/// One block put straight from GPU memory.
pub(crate) struct FromDevice<'a> {
    pub hash: BlockHash,
    /// Its bytes, in order: device memory of the stage's GPU.
    pub spans: &'a [Span],
    pub parent: Option<BlockHash>,
    /// As in `PutItem`.
    pub continues: bool,
    pub tag: Option<Arc<EngineTag>>,
}

impl ShmLink {
    /// Registers the pool with `device`, the first time; whether it is.
    pub(crate) fn on_device(&self, device: &dyn Device) -> bool {
        self.on_device
            .get_or_init(|| {
                // SAFETY: the mapping outlives the registration (the
                // field's order in `ShmLink`).
                match unsafe { device.register_host(self.map.ptr.as_ptr(), self.map.len) } {
                    Ok(registration) => {
                        tracing::info!(bytes = self.map.len, "same-host pool registered with the GPU: gets into GPU memory copy straight from it");
                        Some(registration)
                    }
                    Err(err) => {
                        tracing::warn!(%err, "the same-host pool could not be registered with the GPU; gets into GPU memory go through staging");
                        None
                    }
                }
            })
            .is_some()
    }

    /// Reads blocks straight from the pool into device memory (see the
    /// module's comment), the copies on `stage`'s lane, waited for before
    /// the leases end. An outcome per block, and how the copies went (a
    /// failed copy fails every hit).
    ///
    /// # Safety
    /// The spans must be device memory of the stage's GPU, writable until
    /// the call returns, apart from each other.
    pub(crate) async unsafe fn get_to_device(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        blocks: &[&[Span]],
        stage: &mut Stage,
    ) -> io::Result<(Vec<Direct>, Result<(), DeviceError>)> {
        let mut out = Vec::with_capacity(hashes.len());
        let mut copied = Ok(());
        for (hs, bs) in hashes.chunks(MAX_BATCH).zip(blocks.chunks(MAX_BATCH)) {
            // SAFETY: the caller's promise, passed on.
            let (got, went) = unsafe { self.get_batch_to_device(namespace, hs, bs, stage) }.await?;
            out.extend(got);
            copied = copied.and(went);
        }
        Ok((out, copied))
    }

    async unsafe fn get_batch_to_device(
        &self,
        namespace: &Namespace,
        hashes: &[BlockHash],
        blocks: &[&[Span]],
        stage: &mut Stage,
    ) -> io::Result<(Vec<Direct>, Result<(), DeviceError>)> {
        let mut conn = self.conn().await?;
        let mut outbox = Outbox::default();
        for (i, hash) in hashes.iter().enumerate() {
            let body = KeyRequest {
                key: BlockKey::new(namespace.clone(), *hash),
            }
            .to_bytes();
            outbox.push(Opcode::ShmGet, i as u64 + 1, &body);
        }
        let mut out = vec![Direct::Elsewhere; hashes.len()];
        let mut leases = Vec::new();
        // This CPU checks the pool's bytes while the GPU copies them.
        let most = blocks.iter().flat_map(|b| b.iter()).map(|s| s.len).sum();
        let mut hashing = Hashing::new(self, most);
        // Blocks copied up, in the order hashed: (index, length, checksum).
        let mut checks = Vec::new();
        let mut queued = Ok(());
        for (i, spans) in blocks.iter().enumerate() {
            outbox.before_answer(&mut conn, i).await?;
            let (status, body) = answer(&mut conn, Opcode::ShmGet, i as u64 + 1).await?;
            if status != ErrorCode::Ok {
                continue;
            }
            let lease = ShmLease::from_bytes(&body).map_err(io::Error::other)?;
            leases.push(lease.lease);
            let (offset, len) = (lease.offset as usize, lease.len as usize);
            if offset.checked_add(len).is_none_or(|end| end > self.map.len) {
                return Err(io::Error::other("a lease outside the shared pool"));
            }
            if len > spans.iter().map(|s| s.len).sum() {
                out[i] = Direct::TooLarge;
                continue;
            }
            if queued.is_err() {
                // The device refused a copy: the rest go another way.
                continue;
            }
            // SAFETY: in bounds (checked above); the lease keeps the bytes
            // in place until released, after the wait below; the mapping
            // is registered with the device; the spans are the caller's.
            let src = unsafe { self.map.ptr.as_ptr().add(offset) };
            match unsafe { up(stage, src, len, spans) } {
                Ok(()) => {
                    checks.push((i, len, lease.checksum));
                    // SAFETY: in bounds, leased until after `finish`.
                    unsafe { hashing.push(offset, len) }.await?;
                }
                Err(err) => queued = Err(err),
            }
        }
        let sums = hashing.finish().await?;
        for ((i, len, want), sum) in checks.into_iter().zip(sums) {
            if sum == want {
                out[i] = Direct::Hit(len);
            }
        }
        let waited = stage.wait();
        if !leases.is_empty() {
            let id = hashes.len() as u64 + 1;
            outbox.push(Opcode::ShmRelease, id, &ShmRelease { leases }.to_bytes());
            outbox.flush(&mut conn).await?;
            self.put_back(conn, vec![(Opcode::ShmRelease, id)]);
        } else {
            self.put_back(conn, Vec::new());
        }
        Ok((out, queued.and(waited)))
    }

    /// Stores blocks straight from device memory (see the module's
    /// comment): a status and checksum for each block, in order, and how
    /// the copies went. A failed copy ends the call: the blocks of its
    /// group fail (their rooms freed with the connection), and the blocks
    /// after them get no status.
    ///
    /// Blocks go in groups of at most `group_bytes` (at least one block),
    /// on the two stages' lanes in turn: a group's room is reserved and
    /// its copies queued as each reservation is answered. Once a group's
    /// copies are done, its rooms are hashed on blocking threads while the
    /// next group is reserved and its copies queued, then committed. A
    /// call holds room for about two groups at a time, so a group
    /// is also at most a sixteenth of the pool: the room that puts in
    /// progress may hold is a quarter of it (`Busy` past that), and other
    /// writers share it.
    ///
    /// # Safety
    /// The spans must be device memory of the stages' GPU, readable until
    /// the call returns; the pool must be registered with that GPU
    /// (`on_device`).
    pub(crate) async unsafe fn put_from_device(
        &self,
        namespace: &Namespace,
        blocks: &[FromDevice<'_>],
        group_bytes: usize,
        stages: [&mut Stage; 2],
    ) -> io::Result<(Vec<Written>, Result<(), DeviceError>)> {
        let group_bytes = group_bytes.min(self.map.len / 16);
        let conn = self.conn().await?;
        let mut run = PutRun {
            conn,
            outbox: Outbox::default(),
            queued: Vec::new(),
            read: 0,
            groups: 0,
            // Each block's status comes from its reservation's answer or its
            // commit's: none means not stored.
            written: vec![
                Written {
                    code: ErrorCode::Unavailable,
                    checksum: 0,
                };
                blocks.len()
            ],
        };
        // Dropped before the run's connection: a call given up midway (its
        // deadline) frees its rooms only once no copy can still land in
        // them.
        let mut lanes = CopiesDone(stages);
        let mut next = 0;
        // SAFETY (for each `reserve`): the caller's promise, passed on.
        let mut running = match blocks.is_empty() {
            true => None,
            false => Some(
                unsafe { run.group(self, namespace, blocks, &mut next, &mut lanes, group_bytes) }
                    .await?,
            ),
        };
        while let Some(Group {
            rooms,
            end,
            lane,
            queued,
        }) = running.take()
        {
            if let Err(err) = queued.and_then(|()| lanes.0[lane].wait()) {
                for room in rooms {
                    run.written[room.block].code = COPY_FAILED;
                }
                // The commits sent before, answered; then the connection
                // is not put back: closing it frees every room this call
                // still holds, once both lanes are done (`lanes`, dropped
                // first).
                while run.read < run.queued.len() {
                    run.answer().await?;
                }
                let mut written = std::mem::take(&mut run.written);
                written.truncate(end);
                return Ok((written, Err(err)));
            }
            // The group's rooms are hashed while the next group's are
            // reserved and its copies queued on the other lane.
            let bytes = rooms.iter().map(|r| r.len).sum();
            let mut hashing = Hashing::new(self, bytes);
            for room in &rooms {
                // SAFETY: in bounds, reserved for this block, its copy
                // done; committed only after `finish`.
                unsafe { hashing.push(room.offset, room.len) }.await?;
            }
            if next < blocks.len() {
                running = Some(
                    unsafe {
                        run.group(self, namespace, blocks, &mut next, &mut lanes, group_bytes)
                    }
                    .await?,
                );
            }
            run.commit(&rooms, hashing.finish().await?);
        }
        while run.read < run.queued.len() {
            run.answer().await?;
        }
        let PutRun { conn, written, .. } = run;
        self.put_back(conn, Vec::new());
        Ok((written, Ok(())))
    }
}

/// Room reserved in the pool for one block of a put from device memory.
struct Room {
    /// The block's index in the call.
    block: usize,
    slot: u64,
    offset: usize,
    len: usize,
}

/// A group of blocks of a put from device memory whose copies run.
struct Group {
    rooms: Vec<Room>,
    /// Where the group ends in the call's blocks.
    end: usize,
    /// The stage whose lane copies it.
    lane: usize,
    /// Whether every copy was queued.
    queued: Result<(), DeviceError>,
}

/// The requests of one `put_from_device` on its connection, sent while
/// their answers are read, in order (request k has id k + 1).
struct PutRun {
    conn: UnixStream,
    outbox: Outbox,
    /// Each request queued, with the block it is for.
    queued: Vec<(Opcode, usize)>,
    /// Answers read.
    read: usize,
    written: Vec<Written>,
    /// Groups reserved so far (they take the two lanes in turn).
    groups: usize,
}

impl PutRun {
    fn push(&mut self, op: Opcode, block: usize, body: &[u8]) {
        self.outbox.push(op, self.queued.len() as u64 + 1, body);
        self.queued.push((op, block));
    }

    /// Reads the next answer: a commit's status is the block's; a
    /// reservation's, with its body, is returned.
    async fn answer(&mut self) -> io::Result<Option<(usize, ErrorCode, Vec<u8>)>> {
        self.outbox.before_answer(&mut self.conn, self.read).await?;
        let (op, block) = self.queued[self.read];
        let (status, body) = answer(&mut self.conn, op, self.read as u64 + 1).await?;
        self.read += 1;
        if op == Opcode::ShmCommit {
            self.written[block].code = status;
            return Ok(None);
        }
        Ok(Some((block, status, body)))
    }

    /// Reserves room for `blocks` (the call's blocks from `first` on) and
    /// queues each one's copy into its room on `stage` as its reservation
    /// is answered: the rooms, and whether every copy was queued (after a
    /// refused one the others are not; the rooms are still returned).
    ///
    /// # Safety
    /// As `ShmLink::put_from_device`, for `stage`.
    async unsafe fn reserve(
        &mut self,
        link: &ShmLink,
        namespace: &Namespace,
        blocks: &[FromDevice<'_>],
        first: usize,
        stage: &mut Stage,
    ) -> io::Result<(Vec<Room>, Result<(), DeviceError>)> {
        for (k, block) in blocks.iter().enumerate() {
            let body = ShmPutRequest {
                key: BlockKey::new(namespace.clone(), block.hash),
                len: total(block.spans) as u64,
                checksum: None,
                parent: block.parent,
                continues: block.continues,
                tag: block.tag.clone(),
            }
            .to_bytes();
            self.push(Opcode::ShmPut, first + k, &body);
        }
        let last = self.queued.len();
        let mut rooms = Vec::with_capacity(blocks.len());
        let mut queued = Ok(());
        while self.read < last {
            let Some((i, status, body)) = self.answer().await? else {
                continue;
            };
            if status != ErrorCode::Ok {
                self.written[i].code = status;
                continue;
            }
            let slot = ShmSlot::from_bytes(&body).map_err(io::Error::other)?;
            let (offset, len) = (slot.offset as usize, total(blocks[i - first].spans));
            if offset.checked_add(len).is_none_or(|end| end > link.map.len) {
                return Err(io::Error::other("a reservation outside the shared pool"));
            }
            if queued.is_ok() {
                // SAFETY: in bounds (checked above), reserved for this
                // block alone; the pool is registered with the device and
                // stays mapped; the spans are the caller's.
                let room = unsafe { link.map.ptr.as_ptr().add(offset) };
                queued = unsafe { down(stage, room, blocks[i - first].spans) };
            }
            rooms.push(Room {
                block: i,
                slot: slot.slot,
                offset,
                len,
            });
        }
        Ok((rooms, queued))
    }

    /// Reserves room for the group of blocks that starts at `*next` (at
    /// most `bytes`, at least one block) and queues its copies on the
    /// lane after the last group's; moves `*next` past it.
    ///
    /// # Safety
    /// As `ShmLink::put_from_device`.
    async unsafe fn group(
        &mut self,
        link: &ShmLink,
        namespace: &Namespace,
        blocks: &[FromDevice<'_>],
        next: &mut usize,
        lanes: &mut CopiesDone<'_>,
        bytes: usize,
    ) -> io::Result<Group> {
        let (start, end) = (*next, group_end(blocks, *next, bytes));
        let lane = self.groups % 2;
        self.groups += 1;
        *next = end;
        // SAFETY: the caller's promise, passed on.
        let (rooms, queued) =
            unsafe { self.reserve(link, namespace, &blocks[start..end], start, lanes.0[lane]) }
                .await?;
        Ok(Group {
            rooms,
            end,
            lane,
            queued,
        })
    }

    /// Queues the commits of `rooms`, each with its checksum.
    fn commit(&mut self, rooms: &[Room], sums: Vec<u64>) {
        for (room, sum) in rooms.iter().zip(sums) {
            self.written[room.block].checksum = sum;
            let commit = ShmCommitRequest {
                slot: room.slot,
                checksum: Some(sum),
            };
            self.push(Opcode::ShmCommit, room.block, &commit.to_bytes());
        }
    }
}

/// Bytes one hashing task takes, about.
const PART: usize = 2 << 20;

/// Checksums of byte ranges of the pool, computed on the runtime's
/// blocking threads while the caller goes on (reads answers, queues
/// copies): at most `copy_threads` tasks at once, each of about `PART`
/// bytes; the sums in the order the ranges were given. For fewer bytes
/// than `PARALLEL_BYTES` in all, or one copy thread, each range is hashed
/// at once on the caller's thread.
struct Hashing {
    map: Arc<Mapping>,
    /// Tasks at once, at most; below 2, none.
    threads: usize,
    part: Vec<(usize, usize)>,
    part_bytes: usize,
    tasks: std::collections::VecDeque<tokio::task::JoinHandle<Vec<u64>>>,
    sums: Vec<u64>,
}

impl Hashing {
    /// For ranges of `link`'s pool, `bytes` of them at most.
    fn new(link: &ShmLink, bytes: usize) -> Hashing {
        let threads = match bytes < PARALLEL_BYTES {
            true => 1,
            false => link.copy_threads,
        };
        Hashing {
            map: link.map.clone(),
            threads,
            part: Vec::new(),
            part_bytes: 0,
            tasks: Default::default(),
            sums: Vec::new(),
        }
    }

    /// Hashes `len` bytes of the pool at `offset`, now or on a task; waits
    /// for the oldest task while `threads` run.
    ///
    /// # Safety
    /// In bounds, and unwritten until `finish` returns (or the tasks end,
    /// if it is never called: they hold the mapping).
    async unsafe fn push(&mut self, offset: usize, len: usize) -> io::Result<()> {
        if self.threads < 2 {
            // SAFETY: the caller's promise.
            self.sums
                .push(checksum(unsafe { self.map.slice(offset, len) }));
            return Ok(());
        }
        self.part.push((offset, len));
        self.part_bytes += len;
        if self.part_bytes >= PART {
            self.spawn().await?;
        }
        Ok(())
    }

    async fn spawn(&mut self) -> io::Result<()> {
        if self.part.is_empty() {
            return Ok(());
        }
        if self.tasks.len() >= self.threads {
            let oldest = self.tasks.pop_front().expect("tasks running");
            self.sums.extend(joined(oldest).await?);
        }
        let (map, part) = (self.map.clone(), std::mem::take(&mut self.part));
        self.part_bytes = 0;
        self.tasks.push_back(tokio::task::spawn_blocking(move || {
            part.iter()
                // SAFETY: `push`'s promise; `map` keeps the mapping.
                .map(|&(offset, len)| checksum(unsafe { map.slice(offset, len) }))
                .collect()
        }));
        Ok(())
    }

    /// The sums of every range pushed, in order.
    async fn finish(mut self) -> io::Result<Vec<u64>> {
        self.spawn().await?;
        while let Some(task) = self.tasks.pop_front() {
            self.sums.extend(joined(task).await?);
        }
        Ok(self.sums)
    }
}

/// A hashing task's sums; its panic goes on in the caller.
async fn joined(task: tokio::task::JoinHandle<Vec<u64>>) -> io::Result<Vec<u64>> {
    match task.await {
        Ok(sums) => Ok(sums),
        Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
        Err(err) => Err(io::Error::other(err)),
    }
}

/// Waits for both stages' copies when dropped.
struct CopiesDone<'s>([&'s mut Stage; 2]);

impl Drop for CopiesDone<'_> {
    fn drop(&mut self) {
        for stage in &mut self.0 {
            if let Err(err) = stage.wait() {
                tracing::warn!(%err, "a copy from the GPU of a put given up failed");
            }
        }
    }
}

/// Where the group of blocks that starts at `start` ends: at most
/// `bytes`, at least one block.
fn group_end(blocks: &[FromDevice<'_>], start: usize, bytes: usize) -> usize {
    let mut sum = 0;
    let mut end = start;
    while end < blocks.len() {
        sum += total(blocks[end].spans);
        if end > start && sum > bytes {
            break;
        }
        end += 1;
    }
    end
}

fn total(spans: &[Span]) -> usize {
    spans.iter().map(|s| s.len).sum()
}
