//! The meta service's TCP control server: its state, and its answers to
//! control requests. Its housekeeping is in `housekeeping`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_net::{ConnPool, Dialer, ErrorSource};
use mooncake_proto::auth::{Identity, TokenTable};
use mooncake_proto::frame::MAX_BATCH;
use mooncake_proto::message::{
    Body, ClusterStats, Empty, EventsRequest, HeartbeatRequest, InventoryRequest, KeyRequest,
    KeysRequest, ListRequest, ListResponse, Locations, PinRequest, PutCommitRequest,
    PutStartRequest, PutStartResponse, RegisterRequest, RegisterResponse, RouteRequest, Slot,
    Statuses, ToPlace,
};
use mooncake_proto::transport::TransportKind;
use mooncake_proto::{BlockKey, ErrorCode, Header, Namespace, Opcode, ProtoError};
use mooncake_server::{reply, ConnError, Service};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use tokio_util::sync::CancellationToken;

use mooncake_coord::{Coordinator, MemberKind};

use crate::branches::Put;
use crate::clients::Client;
use crate::config::MetaConfig;
use crate::daemons::Daemons;
use crate::events::Events;
use crate::index::{Index, ListFilter, Reservation};
use crate::metrics::MetaMetrics;
use crate::removals::OwedRemovals;
use crate::remove;

mod housekeeping;

pub use housekeeping::reaper;

/// Deadline of a call from the meta service to a daemon.
pub(crate) const DAEMON_CALL_TIMEOUT: Duration = Duration::from_secs(2);

pub struct State {
    pub index: Index,
    /// The store events' queue (off: does nothing).
    events: Events,
    pub daemons: Daemons,
    /// Removals that daemons have not confirmed.
    pub(crate) owed: Arc<OwedRemovals>,
    /// Keys whose forced removal is being told to their daemons: not put
    /// again meanwhile.
    pub(crate) removing: crate::removing::Removing,
    daemon_ttl: Duration,
    put_timeout: Duration,
    max_pending_puts: u64,
    max_pending_puts_per_client: u32,
    links: Mutex<HashMap<u32, Arc<ConnPool>>>,
    addr: String,
    revision: u64,
    coordinator: Arc<dyn Coordinator>,
    /// Cancelled when the term ends.
    stop: CancellationToken,
    /// Tokens accepted from clients and daemons; `None`: no authentication.
    pub(crate) tokens: Option<Arc<TokenTable>>,
    /// Presented to daemons that require authentication.
    token: Option<Arc<str>>,
    /// How daemons are called: plain TCP, or with `peer_ca` TLS over TCP
    /// or QUIC.
    peer: Dialer,
    /// The serving instance on each host, by node name (for `route`).
    instances: std::collections::BTreeMap<String, String>,
    /// Copies per block by namespace, for puts that ask for none.
    pub(crate) replicas: std::collections::BTreeMap<String, u8>,
    /// Blocks short of the copies they want, waiting for a new one.
    pub repairs: crate::repair::Repairs,
    /// Blocks read often enough to get more copies.
    pub hot: crate::hot::Hot,
    /// Evicted blocks readers came back for, to tell their daemons.
    pub(crate) misses: crate::misses::Misses,
    /// Prefixes readers matched and the branches put after them, to judge
    /// which new blocks continue a branch that comes back.
    pub(crate) branches: crate::branches::Branches,
    /// When the index, rebuilt from inventories, gets its namespaces'
    /// wanted copies back (`Index::restore_wants`): a daemon TTL after the
    /// term began, and again after a daemon registers later.
    restore_wants_at: Mutex<Option<Instant>>,
}

impl State {
    pub fn new(
        cfg: &MetaConfig,
        addr: String,
        revision: u64,
        coordinator: Arc<dyn Coordinator>,
        stop: CancellationToken,
        events: Events,
    ) -> Result<Self, crate::MetaError> {
        Ok(State {
            index: Index::with_events(events.clone()),
            events,
            daemons: Daemons::default(),
            owed: Arc::default(),
            removing: Default::default(),
            daemon_ttl: cfg.daemon_ttl.0,
            put_timeout: cfg.put_timeout.0,
            max_pending_puts: cfg.max_pending_puts,
            max_pending_puts_per_client: cfg.max_pending_puts_per_client,
            links: Mutex::new(HashMap::new()),
            addr,
            revision,
            coordinator,
            stop,
            tokens: cfg.tokens().map_err(crate::MetaError::Config)?,
            token: cfg.token.as_deref().map(Arc::from),
            peer: cfg
                .tls_files()
                .peer_dialer()
                .map_err(crate::MetaError::Config)?,
            instances: cfg.instances.clone(),
            replicas: cfg.replicas.clone(),
            repairs: crate::repair::Repairs::new(cfg.repair_queue, cfg.repair_rate.0),
            hot: crate::hot::Hot::new(cfg.hot()),
            misses: crate::misses::Misses::new(crate::misses::DEFAULT_CAP),
            branches: crate::branches::Branches::new(crate::branches::DEFAULT_CAP),
            restore_wants_at: Mutex::new(Some(Instant::now() + cfg.daemon_ttl.0)),
        })
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Removals owed by daemons now, and given up this term.
    pub fn owed_removals(&self) -> (usize, u64) {
        self.owed.counts()
    }

    /// Whether this term is still being served.
    pub fn is_serving(&self) -> bool {
        !self.stop.is_cancelled()
    }

    /// Other meta replicas listed by the coordinator (standbys).
    async fn standbys(&self) -> Vec<String> {
        let members = self.coordinator.members(MemberKind::Meta);
        match tokio::time::timeout(DAEMON_CALL_TIMEOUT, members).await {
            Ok(Ok(members)) => members.into_iter().filter(|m| *m != self.addr).collect(),
            _ => Vec::new(),
        }
    }

    /// Where to call a daemon: its TCP address, or over QUIC its QUIC
    /// endpoint (none: it is not called, rather than called in clear).
    pub(crate) fn daemon_call_addr(&self, daemon: u32) -> Option<String> {
        let found = self.daemons.addrs([daemon]).into_iter().next()?;
        if !matches!(self.peer, Dialer::Quic(_)) {
            return Some(found.addr);
        }
        let quic = found
            .endpoints
            .into_iter()
            .find(|e| e.kind == TransportKind::Quic);
        if quic.is_none() {
            tracing::warn!(daemon, addr = %found.addr, "daemon serves no QUIC endpoint; with peer_ca it is not called");
        }
        quic.map(|e| e.addr)
    }

    /// Sends a one-key command (remove, pin, unpin) to a daemon.
    async fn tell_daemon(&self, daemon: u32, op: Opcode, key: BlockKey) -> ErrorCode {
        self.call_daemon(daemon, op, &KeyRequest { key }, DAEMON_CALL_TIMEOUT)
            .await
    }

    /// One call to a daemon, answered by an empty body, within `timeout`.
    pub(crate) async fn call_daemon(
        &self,
        daemon: u32,
        op: Opcode,
        req: &impl Body,
        timeout: Duration,
    ) -> ErrorCode {
        let Some(addr) = self.daemon_call_addr(daemon) else {
            return ErrorCode::Unavailable;
        };
        let pool = {
            let mut links = self.links.lock();
            let stale = links.get(&daemon).is_some_and(|p| p.addr() != addr);
            if stale {
                links.remove(&daemon);
            }
            links
                .entry(daemon)
                .or_insert_with(|| {
                    Arc::new(
                        ConnPool::new(addr, ErrorSource::Daemon, DAEMON_CALL_TIMEOUT, 4)
                            .with_token(self.token.clone())
                            .with_dialer(self.peer.clone()),
                    )
                })
                .clone()
        };
        let call = pool.call::<Empty>(op, req, op.name());
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(_)) => ErrorCode::Ok,
            Ok(Err(err)) => err.code().unwrap_or(ErrorCode::Unavailable),
            Err(_) => ErrorCode::Timeout,
        }
    }

    /// Tells `daemon` to drop `key`, which the index no longer has. Until
    /// the daemon confirms, the removal is owed (see `removals`); the
    /// answer is the daemon's, with `NotFound` as success.
    pub(crate) async fn remove_on_daemon(&self, daemon: u32, key: BlockKey) -> ErrorCode {
        match self.tell_daemon(daemon, Opcode::Remove, key.clone()).await {
            ErrorCode::Ok | ErrorCode::NotFound => {
                self.owed.settle(daemon, &key);
                ErrorCode::Ok
            }
            code => {
                tracing::warn!(daemon, %key, %code, "daemon did not confirm a removal; it stays owed");
                self.owed.owe(daemon, key);
                code
            }
        }
    }

    /// `daemon` holds `key`, which the index no longer has, and could not
    /// be told: it is told again when it answers (see `removals`).
    pub(crate) fn owe_removal(&self, daemon: u32, key: BlockKey) {
        self.owed.owe(daemon, key);
    }
}

/// The meta service's answers to control requests, whichever transport
/// they came on; the server skeleton (`mooncake-server`) admits
/// connections, authenticates them and applies the deadlines.
pub struct MetaService {
    pub state: Arc<State>,
    pub metrics: Arc<MetaMetrics>,
}

impl Service for MetaService {
    /// The client a connection's reservations are counted against.
    type Session = Client;

    fn session(&self, peer: std::net::SocketAddr) -> Client {
        Client::of(peer.ip())
    }

    fn serves(&self, op: Opcode) -> bool {
        !is_data_plane(op)
    }

    async fn handle<R, W>(
        &self,
        client: &mut Client,
        header: Header,
        rd: &mut R,
        wr: &mut W,
        who: &Identity,
    ) -> Result<ErrorCode, ConnError>
    where
        R: AsyncRead + Unpin + Send,
        W: AsyncWrite + Unpin + Send,
    {
        let mut body = vec![0u8; header.body_len as usize];
        rd.read_exact(&mut body).await?;
        let answer = dispatch(
            &self.state,
            &self.metrics,
            header.opcode,
            &body,
            (who, *client),
        )
        .await;
        match answer {
            Ok(body) => reply(wr, header, ErrorCode::Ok, &body).await,
            Err(Failure::Code(code)) => reply(wr, header, code, &[]).await,
            Err(Failure::Protocol(err)) => Err(err.into()),
        }
    }
}

/// `Unauthorized` unless `who` may use blocks of `ns`.
fn owns(who: &Identity, ns: &Namespace) -> Result<(), Failure> {
    if who.may_use(ns) {
        Ok(())
    } else {
        Err(Failure::Code(ErrorCode::Unauthorized))
    }
}

fn is_data_plane(op: Opcode) -> bool {
    (op as u8) < 0x20 && op != Opcode::Ping && op != Opcode::Auth
}

enum Failure {
    /// Answer with this status and an empty body; the connection stays.
    Code(ErrorCode),
    /// The body broke the protocol: answer, then close.
    Protocol(ProtoError),
}

impl From<ProtoError> for Failure {
    fn from(err: ProtoError) -> Self {
        Failure::Protocol(err)
    }
}

async fn dispatch(
    state: &Arc<State>,
    metrics: &MetaMetrics,
    op: Opcode,
    body: &[u8],
    (who, client): (&Identity, Client),
) -> Result<Vec<u8>, Failure> {
    let now = Instant::now();
    Ok(match op {
        Opcode::Ping => {
            Empty::from_bytes(body)?;
            mooncake_proto::message::Revision {
                revision: state.revision,
            }
            .to_bytes()
        }
        Opcode::PutStart => {
            let req = PutStartRequest::from_bytes(body)?;
            owns(who, &req.namespace)?;
            put_start(state, req, client, now).to_bytes()
        }
        Opcode::Admit => {
            let req = PutCommitRequest::from_bytes(body)?;
            crate::admit::admit(state, req, client, now)
                .map_err(Failure::Code)?
                .to_bytes()
        }
        Opcode::PutCommit => {
            let req = PutCommitRequest::from_bytes(body)?;
            owns(who, &req.namespace)?;
            let codes = req
                .items
                .iter()
                .map(|it| state.index.commit(&req.namespace, it))
                .collect();
            Statuses { codes }.to_bytes()
        }
        Opcode::Lookup => {
            let req = KeysRequest::from_bytes(body)?;
            owns(who, &req.namespace)?;
            let items = state.index.lookup(&req.namespace, &req.hashes);
            // The serving engines find a prefix this way (`branches.rs`).
            let leading = items.iter().take_while(|i| i.is_some()).count();
            state.branches.matched(&req.namespace, &req.hashes, leading);
            state.misses.missed(
                &req.namespace,
                crate::misses::missed_by_lookup(&req.hashes, &items),
            );
            let hits = items.iter().flatten().count() as u64;
            metrics.lookup_hits.inc_by(hits);
            metrics.lookup_misses.inc_by(items.len() as u64 - hits);
            with_daemons(state, items).to_bytes()
        }
        Opcode::MatchPrefix => {
            let req = KeysRequest::from_bytes(body)?;
            owns(who, &req.namespace)?;
            let items = state.index.match_prefix(&req.namespace, &req.hashes);
            // The match stopped at the first block not found.
            state
                .misses
                .missed(&req.namespace, req.hashes.get(items.len()));
            state
                .branches
                .matched(&req.namespace, &req.hashes, items.len());
            metrics.match_hits.inc_by(items.len() as u64);
            metrics
                .match_misses
                .inc_by((req.hashes.len() - items.len()) as u64);
            with_daemons(state, items.into_iter().map(Some).collect()).to_bytes()
        }
        Opcode::MetaRemove | Opcode::MetaRemoveUnleased => {
            let req = KeysRequest::from_bytes(body)?;
            owns(who, &req.namespace)?;
            let codes = match op {
                Opcode::MetaRemove => remove::forced(state, &req.namespace, &req.hashes).await,
                _ => remove::unleased(state, &req.namespace, &req.hashes).await,
            };
            Statuses { codes }.to_bytes()
        }
        Opcode::MetaPin => {
            let req = PinRequest::from_bytes(body)?;
            let ns = &req.keys.namespace;
            owns(who, ns)?;
            let locations = state.index.lookup(ns, &req.keys.hashes);
            let op = if req.pin { Opcode::Pin } else { Opcode::Unpin };
            let mut codes = Vec::with_capacity(locations.len());
            for (hash, loc) in req.keys.hashes.iter().zip(locations) {
                let Some(loc) = loc else {
                    codes.push(ErrorCode::NotFound);
                    continue;
                };
                // Every copy pinned, or the first refusal.
                let mut code = ErrorCode::Ok;
                for d in loc.daemons.iter() {
                    let said = state
                        .tell_daemon(d, op, BlockKey::new(ns.clone(), *hash))
                        .await;
                    if code == ErrorCode::Ok {
                        code = said;
                    }
                }
                codes.push(code);
            }
            Statuses { codes }.to_bytes()
        }
        Opcode::ClusterStat => {
            Empty::from_bytes(body)?;
            let st = state.index.stats();
            ClusterStats {
                leader: state.addr.clone(),
                revision: state.revision,
                standbys: state.standbys().await,
                blocks: st.visible,
                copies: st.copies,
                bytes: st.bytes,
                pending: st.pending,
                repairing: state.repairs.len() as u64,
                daemons: state.daemons.infos(),
                errors: metrics.top_errors(5),
            }
            .to_bytes()
        }
        Opcode::List => {
            let req = ListRequest::from_bytes(body)?;
            match &req.namespace {
                Some(ns) => owns(who, ns)?,
                // Every namespace: not for a tenant.
                None if who.tenant.is_some() => return Err(Failure::Code(ErrorCode::Unauthorized)),
                None => {}
            }
            let limit = (req.limit as usize).clamp(1, MAX_BATCH);
            let filter = ListFilter {
                prefix: &req.prefix,
                daemon: (req.daemon != 0).then_some(req.daemon),
            };
            let (entries, more) =
                state
                    .index
                    .list(req.namespace.as_ref(), req.after.as_ref(), filter, limit);
            ListResponse { entries, more }.to_bytes()
        }
        Opcode::Route => {
            let req = RouteRequest::from_bytes(body)?;
            owns(who, &req.keys.namespace)?;
            let answer =
                crate::route::route(&state.index, &state.daemons.hosts(), &state.instances, &req);
            metrics.match_hits.inc_by(u64::from(answer.matched));
            metrics
                .match_misses
                .inc_by(u64::from(answer.blocks - answer.matched));
            answer.to_bytes()
        }
        Opcode::Drain => {
            let req = mooncake_proto::message::DrainRequest::from_bytes(body)?;
            if !state.daemons.set_draining(req.daemon, req.drain) {
                return Err(Failure::Code(ErrorCode::NotFound));
            }
            // Its blocks get their copies on other hosts (a drain undone
            // leaves them nothing to do at their turn).
            let queued = if req.drain {
                let keys = state.index.keys_on(req.daemon);
                let n = keys.len();
                n - state.repairs.add(keys, now)
            } else {
                0
            };
            tracing::info!(
                daemon = req.daemon,
                draining = req.drain,
                queued,
                "daemon drain changed"
            );
            Vec::new()
        }
        Opcode::Register => {
            let req = RegisterRequest::from_bytes(body)?;
            if state.tokens.is_some() && !req.requires_auth {
                tracing::warn!(addr = %req.addr, "daemon refused: it requires no token of its clients, and this meta service requires authentication");
                return Err(Failure::Code(ErrorCode::Unauthorized));
            }
            let (addr, capacity, node) = (req.addr.clone(), req.capacity, req.node.clone());
            let daemon = state.daemons.register(req, now);
            state.events.set_node(daemon, &node);
            // A (re)registering daemon's blocks are whatever its inventory
            // says next: entries from its previous life go.
            let gone = state.index.remove_daemon(daemon);
            state.misses.forget(daemon);
            tracing::info!(daemon, %addr, capacity, dropped = gone.copies, "daemon registered");
            // What its inventory does not bring back is made again (not
            // counted lost: its inventory may bring it all back).
            state.repair(gone.short, now);
            state.restore_wants_later(now);
            RegisterResponse {
                daemon,
                revision: state.revision,
                keep_tags: state.events.keep_tags(),
            }
            .to_bytes()
        }
        Opcode::Inventory => {
            let req = InventoryRequest::from_bytes(body)?;
            let mut owed = false;
            for item in &req.items {
                if state.owed.is_owed(req.daemon, &item.key) {
                    owed = true;
                    continue;
                }
                state.index.insert_reported(
                    &item.key,
                    (req.daemon, item.tier),
                    (item.size, item.checksum),
                    (item.parent, item.tag.clone()),
                );
            }
            if owed {
                state.resend_owed(req.daemon);
            }
            Vec::new()
        }
        Opcode::Heartbeat => {
            let req = HeartbeatRequest::from_bytes(body)?;
            let Some(secs) = state.daemons.heartbeat(req.daemon, req.stats, now) else {
                return Err(Failure::Code(ErrorCode::NotFound));
            };
            // Blocks it serves hot get more copies (made by the repairs).
            let hosts = state.daemons.hosts_alive();
            let heated = state.hot.observe(&state.index, hosts, &req.hot, secs, now);
            if !heated.is_empty() {
                tracing::info!(
                    daemon = req.daemon,
                    blocks = heated.len(),
                    "hot blocks get more copies"
                );
                state.repair(heated, now);
            }
            // It answers again: what it was not told, it is told now.
            state.resend_owed(req.daemon);
            mooncake_proto::message::HeartbeatResponse {
                missed: state.misses.take(req.daemon),
            }
            .to_bytes()
        }
        Opcode::Leave => {
            let req = mooncake_proto::message::LeaveRequest::from_bytes(body)?;
            if !state.daemons.leave(req.daemon, &req.addr) {
                return Err(Failure::Code(ErrorCode::NotFound));
            }
            let gone = state.index.remove_daemon(req.daemon);
            state.misses.forget(req.daemon);
            tracing::info!(
                daemon = req.daemon,
                addr = %req.addr,
                copies = gone.copies,
                lost = gone.blocks,
                short = gone.short.len(),
                "daemon left"
            );
            state.lost(gone, now);
            Vec::new()
        }
        Opcode::Events => {
            let req = EventsRequest::from_bytes(body)?;
            for key in &req.removed {
                if state.index.remove_at(key, req.daemon) {
                    state.misses.evicted(req.daemon, key);
                }
            }
            for (key, tier) in &req.moved {
                state.index.set_tier(key, req.daemon, *tier);
            }
            Vec::new()
        }
        Opcode::Put
        | Opcode::Get
        | Opcode::Remove
        | Opcode::RemoveUnleased
        | Opcode::LeaseOf
        | Opcode::ShmAdmit
        | Opcode::Pin
        | Opcode::Unpin
        | Opcode::DaemonStats
        | Opcode::Verify
        | Opcode::Evict
        | Opcode::Auth
        | Opcode::ShmGet
        | Opcode::ShmRelease
        | Opcode::ShmPut
        | Opcode::ShmCommit
        | Opcode::ShmTouch
        | Opcode::ShmRoom
        | Opcode::ShmStore
        | Opcode::Hold
        | Opcode::RdmaConnect
        | Opcode::Fetch => return Err(Failure::Protocol(ProtoError::UnknownOpcode(op as u8))),
    })
}

fn put_start(
    state: &State,
    req: PutStartRequest,
    client: Client,
    now: Instant,
) -> PutStartResponse {
    let largest = state.daemons.largest_capacity();
    // Reservations are bounded, cluster-wide and per client: past either
    // cap, back-pressure, not growth.
    let mut room = state
        .max_pending_puts
        .saturating_sub(state.index.stats().pending)
        .min(u64::from(
            state
                .max_pending_puts_per_client
                .saturating_sub(state.index.pending_of(client)),
        ));
    let copies = match req.replicas {
        0 => crate::config::replicas_in(&state.replicas, req.namespace.as_str()),
        n => n,
    }
    .clamp(1, mooncake_proto::message::MAX_COPIES as u8);
    let mut placed = Vec::new();
    let evicted_by = state
        .misses
        .returning(&req.namespace, req.items.iter().map(|it| &it.hash));
    let returning: Vec<bool> = evicted_by.iter().map(Option::is_some).collect();
    let mut slots: Vec<Slot> = req
        .items
        .iter()
        .zip(evicted_by)
        .map(|(ToPlace { hash, size, .. }, evicted_by)| {
            let size = u64::from(*size);
            if largest == 0 {
                return Slot::Skip(ErrorCode::Unavailable);
            }
            if size > largest {
                return Slot::Skip(ErrorCode::TooLarge);
            }
            if state.index.lookup(&req.namespace, &[*hash])[0].is_some() {
                return Slot::Skip(ErrorCode::AlreadyExists);
            }
            // Out of the index, but its daemons not all told yet: placed
            // now, it could land on one still holding it, and go with it.
            if state.removing.contains(&req.namespace, *hash) {
                return Slot::Skip(ErrorCode::Busy);
            }
            if room == 0 {
                return Slot::Skip(ErrorCode::Busy);
            }
            let daemons =
                state
                    .daemons
                    .place_copies(size, &req.node, usize::from(copies), evicted_by);
            if daemons.is_empty() {
                // Live daemons, all draining: none offers room (a refusal;
                // no live daemon at all is `Unavailable`, above).
                return Slot::Skip(ErrorCode::NoSpace);
            }
            let want = (size as u32, daemons, copies);
            match state
                .index
                .reserve(&req.namespace, *hash, want, client, now)
            {
                Reservation::Reserved => {
                    // The put replaces any stale bytes the daemons hold,
                    // unless a removal of them is on its way there now.
                    if state.owed.any() {
                        let key = BlockKey::new(req.namespace.clone(), *hash);
                        let on: Vec<u32> = daemons.iter().collect();
                        if !state.owed.settle_for_put(&on, &key) {
                            state.index.release(&req.namespace, *hash);
                            return Slot::Skip(ErrorCode::Busy);
                        }
                    }
                    room -= 1;
                    placed.extend(daemons.iter());
                    Slot::Place {
                        copies: daemons,
                        continues: false,
                    }
                }
                Reservation::Exists => Slot::Skip(ErrorCode::AlreadyExists),
            }
        })
        .collect();
    let blocks = req.items.iter().map(|it| (it.hash, it.parent));
    judge_branches(state, &req.namespace, blocks, returning, &mut slots);
    PutStartResponse {
        slots,
        daemons: state.daemons.addrs(placed),
    }
}

/// Says in each placed slot whether its block continues a branch readers
/// come back to (`branches.rs`): `blocks` (hash, parent) and whether each
/// is stored again soon after an eviction (`returning`), slot by slot.
pub(crate) fn judge_branches(
    state: &State,
    namespace: &Namespace,
    blocks: impl Iterator<Item = (mooncake_proto::BlockHash, Option<mooncake_proto::BlockHash>)>,
    returning: Vec<bool>,
    slots: &mut [Slot],
) {
    let puts: Vec<Put> = blocks
        .zip(slots.iter())
        .zip(returning)
        .map(|(((hash, parent), slot), returning)| Put {
            hash,
            parent,
            placed: matches!(slot, Slot::Place { .. }),
            returning,
        })
        .collect();
    let judged = state.branches.judge(namespace, &puts);
    for (slot, verdict) in slots.iter_mut().zip(judged) {
        if let Slot::Place { continues, .. } = slot {
            *continues = verdict;
        }
    }
}

fn with_daemons(state: &State, items: Vec<Option<mooncake_proto::message::Location>>) -> Locations {
    let daemons = state
        .daemons
        .addrs(items.iter().flatten().flat_map(|l| l.daemons.iter()));
    Locations { items, daemons }
}
