//! `Client`: the store from Python. Single-key calls raise on failure and
//! answer `None` for a miss; batch calls answer one status per key (bytes
//! read, or a negative code from `codes`), so that one bad key does not
//! hide what happened to the others.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use mooncake_client::device::Span;
use mooncake_client::{ClientConfig, GetOutcome, PutOptions};
use mooncake_proto::message::{ListRequest, Tier};
use mooncake_proto::{BlockHash, BlockKey, Namespace};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use mooncake_client::bindings::{block_on, except};

use crate::buffers::{Region, Registered};
use crate::codes;
use crate::keys::{hash_of, hashes_of};
use crate::pieces::Pieces;
use crate::tags::{tags_of, with_key, with_keys};
use crate::{StoreError, StoreUnavailable};

mod connect;
mod regions;
mod route;

use connect::{follow_leader_through_etcd, tls_settings};
use mooncake_client::ClientError;
use mooncake_proto::ErrorCode;
use regions::{chain_of, check_lengths, regions_of};
use route::{answer_dict, candidates_of};

/// A connection to a Mooncake Store cluster, safe to share between threads.
#[pyclass(frozen, module = "mooncake_store._native")]
pub struct Client {
    inner: Arc<mooncake_client::Client>,
    namespace: Namespace,
    registered: Registered,
    /// Whether blocks may come through a same-host shared pool.
    same_host: bool,
}

impl Client {
    /// Runs a call and waits for it. Over the network, on the runtime's
    /// workers (`bindings::block_on`: this thread is woken once, not at
    /// every socket event); with a same-host shared pool, on this thread,
    /// where the copies out of the pool run, so that several Python
    /// threads copy in parallel (on the workers, two threads' same-host
    /// gets ran at half the rate of one, on 2 cores).
    fn run<F>(&self, call: F) -> F::Output
    where
        F: std::future::Future + Send,
        F::Output: Send + 'static,
    {
        if self.same_host {
            mooncake_client::bindings::runtime().block_on(call)
        } else {
            block_on(call)
        }
    }
}

#[pymethods]
impl Client {
    /// Connects to the meta service at `meta` (default `$MOONCAKE_META`, or
    /// 127.0.0.1:7070), or to whichever meta replica leads, through `etcd`
    /// (a list of endpoints). `namespace` scopes every key (a tenant or a
    /// model); `timeout` (seconds) bounds every call; `token` (default
    /// `$MOONCAKE_TOKEN`) authenticates with a store that requires it.
    /// `shm_socket`: the same-host daemon's socket. `tls_ca` (default
    /// `$MOONCAKE_TLS_CA`; and, for mutual TLS, `tls_cert` and `tls_key`):
    /// speak TLS on every TCP connection, to a store whose servers run with
    /// `--tls`. `quic_ca` (and `quic_cert`, `quic_key`): move blocks over
    /// QUIC.
    /// `rdma` (default `$MOONCAKE_RDMA`): move blocks over RDMA to daemons
    /// that serve it, with a build that has the `rdma` feature (else over
    /// TCP or QUIC); `rdma_device` names the NIC.
    #[new]
    #[pyo3(signature = (meta = None, *, etcd = None, namespace = "default", timeout = 5.0, token = None, shm_socket = None, tls_ca = None, tls_cert = None, tls_key = None, quic_ca = None, quic_cert = None, quic_key = None, rdma = None, rdma_device = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        meta: Option<String>,
        etcd: Option<Vec<String>>,
        namespace: &str,
        timeout: f64,
        token: Option<String>,
        shm_socket: Option<std::path::PathBuf>,
        tls_ca: Option<std::path::PathBuf>,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
        quic_ca: Option<std::path::PathBuf>,
        quic_cert: Option<std::path::PathBuf>,
        quic_key: Option<std::path::PathBuf>,
        rdma: Option<bool>,
        rdma_device: Option<String>,
    ) -> PyResult<Self> {
        let ns = crate::keys::namespace(namespace)?;
        if !(timeout > 0.0 && timeout.is_finite()) {
            return Err(PyValueError::new_err(
                "timeout must be a positive number of seconds",
            ));
        }
        let meta = meta
            .or_else(|| std::env::var("MOONCAKE_META").ok())
            .unwrap_or_else(|| "127.0.0.1:7070".into());
        let mut cfg =
            ClientConfig::new(meta.clone()).with_timeout(Duration::from_secs_f64(timeout));
        if let Some(token) = token.or_else(|| std::env::var("MOONCAKE_TOKEN").ok()) {
            cfg = cfg.with_token(token);
        }
        // The daemon on this host, read through its shared pool.
        cfg.shm_socket =
            shm_socket.or_else(|| std::env::var_os("MOONCAKE_SHM_SOCKET").map(Into::into));
        let same_host = cfg.shm_socket.is_some();
        cfg.rdma = rdma.unwrap_or_else(|| {
            std::env::var("MOONCAKE_RDMA").is_ok_and(|v| matches!(v.as_str(), "1" | "true"))
        });
        cfg.rdma_device = rdma_device.or_else(|| std::env::var("MOONCAKE_RDMA_DEVICE").ok());
        if let Some(tls) = tls_settings("tls", tls_ca, tls_cert, tls_key)? {
            cfg = cfg
                .with_tls(&tls)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
        }
        if let Some(tls) = tls_settings("quic", quic_ca, quic_cert, quic_key)? {
            cfg = cfg
                .with_quic(&tls)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
        }
        let client = py.detach(|| {
            block_on(async {
                let cfg = match etcd.filter(|e| !e.is_empty()) {
                    None => cfg,
                    Some(endpoints) => follow_leader_through_etcd(cfg, endpoints).await?,
                };
                mooncake_client::Client::connect(cfg)
                    .await
                    .map_err(|e| match e {
                        ClientError::Server {
                            code: ErrorCode::Unauthorized,
                            ..
                        } => StoreError::new_err(format!(
                            "{e} (pass token=, or set MOONCAKE_TOKEN, to a token of this store)"
                        )),
                        e @ ClientError::Refused { .. } => StoreError::new_err(format!(
                            "{e} (tls_ca must be the CA that signed the store's certificates; tls_cert and tls_key, or quic_cert and quic_key, a certificate it signed)"
                        )),
                        e => StoreUnavailable::new_err(format!(
                            "{e} (is the store running? `mooncake-store up` starts one)"
                        )),
                    })
            })
        });
        let client = client?;
        Ok(Client {
            inner: Arc::new(client),
            namespace: ns,
            registered: Registered::default(),
            same_host,
        })
    }

    /// The namespace every key of this client lives in.
    #[getter]
    fn namespace(&self) -> &str {
        self.namespace.as_str()
    }

    /// A client on the same connections for another namespace.
    fn with_namespace(&self, namespace: &str) -> PyResult<Client> {
        Ok(Client {
            inner: self.inner.clone(),
            namespace: crate::keys::namespace(namespace)?,
            registered: Registered::default(),
            same_host: self.same_host,
        })
    }

    /// Stores one block from any bytes-like object. Storing a key that is
    /// already stored is a success (blocks are immutable). `replicas`:
    /// copies on distinct hosts, 1 to 4 (0: the client's default).
    #[pyo3(signature = (key, value, replicas = 0))]
    fn put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        replicas: u8,
    ) -> PyResult<()> {
        let hash = hash_of(key)?;
        let region = Region::of_object(value, false, &self.inner)?;
        let tags = [with_key(None, key)?];
        let (client, ns) = (&self.inner, &self.namespace);
        let out = py
            .detach(|| {
                let block = [(hash, vec![region.span()])];
                let opts = PutOptions::copies(replicas);
                // SAFETY: the held object's memory stays valid for the call.
                self.run(unsafe { client.put_spans(ns, &block, None, &tags, opts) })
            })
            .map_err(codes::to_py)?;
        match codes::of_put(out[0]) {
            codes::OK => Ok(()),
            _ => Err(crate::StoreError::new_err(format!(
                "put failed: {:?}",
                out[0]
            ))),
        }
    }

    /// One block as `bytes`, or `None` if it is not stored.
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let key = BlockKey::new(self.namespace.clone(), hash_of(key)?);
        let client = &self.inner;
        let bytes = py
            .detach(|| self.run(client.get(&key)))
            .map_err(codes::to_py)?;
        Ok(bytes.map(|b| PyBytes::new(py, &b)))
    }

    /// Reads one block into `buffer` (any writable contiguous buffer: a
    /// bytearray, a NumPy array, a CPU tensor); returns the bytes read, or
    /// `None` if it is not stored. Raises `ValueError` if the buffer is
    /// smaller than the block.
    fn get_into(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        buffer: &Bound<'_, PyAny>,
    ) -> PyResult<Option<usize>> {
        let hash = hash_of(key)?;
        let region = Region::of_object(buffer, true, &self.inner)?;
        let (client, ns) = (&self.inner, &self.namespace);
        let out = py
            .detach(|| {
                let blocks = [vec![region.span()]];
                // SAFETY: the held object's memory is writable, valid for
                // the call, alone.
                self.run(unsafe { client.get_into_spans(ns, &[hash], &blocks) })
            })
            .map_err(codes::to_py)?;
        match out[0] {
            GetOutcome::Hit(n) => Ok(Some(n)),
            GetOutcome::Miss => Ok(None),
            GetOutcome::Failed(mooncake_proto::ErrorCode::TooLarge) => Err(PyValueError::new_err(
                format!("the block is larger than the {}-byte buffer", region.len),
            )),
            GetOutcome::Failed(code) => Err(crate::StoreError::new_err(format!(
                "get failed: {}",
                code.name()
            ))),
        }
    }

    /// Stores blocks from bytes-like objects, in one call; a status per key
    /// (0, or a negative code). `replicas` as in `put`. `tags`: what the
    /// engine calls each block, one per key, each `None` or `(hash,
    /// token_ids)`, published in the store's events (`docs/events.md`).
    /// `in_order`: the keys are consecutive blocks of one chain, though
    /// they name no parent (as the engines put a request's blocks): each
    /// that no earlier lookup placed extends the key before it, so that
    /// daemons evict them from the tail.
    #[pyo3(signature = (keys, values, replicas = 0, *, tags = None, in_order = false))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        replicas: u8,
        tags: Option<&Bound<'_, PyAny>>,
        in_order: bool,
    ) -> PyResult<Vec<i64>> {
        let hashes = hashes_of(keys)?;
        let regions = regions_of(values, false, &self.inner)?;
        check_lengths(hashes.len(), regions.len(), "values")?;
        let tags = with_keys(tags_of(tags, hashes.len())?, keys, hashes.len())?;
        let opts = PutOptions { replicas, in_order };
        Ok(self.put_regions(py, (hashes, regions), None, &tags, opts))
    }

    /// Like `put_batch`, for consecutive blocks of one chain: `keys[0]`
    /// extends `parent` (the last block of the matched prefix; `None`: it
    /// starts the chain), each next key the one before. Daemons then evict
    /// the chain from its tail, keeping the prefixes later requests match.
    /// `tags` as in `put_batch`.
    #[pyo3(signature = (keys, values, parent = None, replicas = 0, *, tags = None))]
    fn put_chain(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
        replicas: u8,
        tags: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<i64>> {
        let hashes = hashes_of(keys)?;
        let regions = regions_of(values, false, &self.inner)?;
        check_lengths(hashes.len(), regions.len(), "values")?;
        let parent = parent.map(hash_of).transpose()?;
        let tags = with_keys(tags_of(tags, hashes.len())?, keys, hashes.len())?;
        let opts = PutOptions::copies(replicas);
        Ok(self.put_regions(py, (hashes, regions), Some(parent), &tags, opts))
    }

    /// Reads blocks into writable buffers, in one call; per key the bytes
    /// read or a negative code (`OBJECT_NOT_FOUND` for a miss).
    fn get_into_batch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<i64>> {
        let hashes = hashes_of(keys)?;
        let regions = regions_of(buffers, true, &self.inner)?;
        check_lengths(hashes.len(), regions.len(), "buffers")?;
        Ok(self.get_regions(py, hashes, regions))
    }

    /// Registers `size` bytes at address `ptr` (a NumPy array's
    /// `ctypes.data`, a tensor's `data_ptr()`, on the CPU or on a GPU) for
    /// `get_into_ptrs` and `put_from_ptrs`. The memory must stay allocated
    /// until unregistered. With RDMA (a client built with the `rdma`
    /// feature), host memory is also registered with the NIC: blocks then
    /// move straight between it and the daemons' pools. GPU memory goes
    /// through pinned staging (`docs/gpu.md`).
    fn register_buffer(&self, ptr: usize, size: usize) -> PyResult<()> {
        self.registered.register(ptr, size, &self.inner)?;
        // SAFETY: the caller keeps the memory allocated until it
        // unregisters it (this method's contract, as in Mooncake's API).
        unsafe { self.inner.register_memory(ptr as *mut u8, size) }
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
        Ok(())
    }

    /// Forgets a registered buffer; `False` if none starts at `ptr`.
    fn unregister_buffer(&self, ptr: usize) -> bool {
        self.inner.unregister_memory(ptr as *const u8);
        self.registered.unregister(ptr)
    }

    /// Reads blocks straight into address ranges of registered buffers; per
    /// key the bytes read or a negative code (`INVALID_PARAMS` for a range
    /// outside every registered buffer: nothing is written there).
    fn get_into_ptrs(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<i64>> {
        self.on_registered(py, keys, ptrs, sizes, Self::get_regions)
    }

    /// Stores blocks straight from address ranges of registered buffers;
    /// a status per key. `chain` and `parent` as in `put_from_ptr_lists`,
    /// `tags` and `in_order` as in `put_batch`.
    #[pyo3(signature = (keys, ptrs, sizes, chain = false, parent = None, replicas = 0, *, tags = None, in_order = false))]
    #[allow(clippy::too_many_arguments)]
    fn put_from_ptrs(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        chain: bool,
        parent: Option<&Bound<'_, PyAny>>,
        replicas: u8,
        tags: Option<&Bound<'_, PyAny>>,
        in_order: bool,
    ) -> PyResult<Vec<i64>> {
        let chain = chain_of(chain, parent)?;
        let mut tags = with_keys(tags_of(tags, ptrs.len())?, keys, ptrs.len())?;
        if !tags.is_empty() {
            // Those of blocks outside every registered buffer go with them.
            let mut ranges = ptrs.iter().zip(&sizes);
            tags.retain(|_| {
                ranges
                    .next()
                    .is_some_and(|(&p, &n)| self.registered.covers(p, n))
            });
        }
        let opts = PutOptions { replicas, in_order };
        self.on_registered(py, keys, ptrs, sizes, |c, py, h, r| {
            c.put_regions(py, (h, r), chain, &tags, opts)
        })
    }

    /// Stores blocks each made of several pieces of registered buffers
    /// (`ptr_lists[i]`, `size_lists[i]`: block `i`'s pieces, in order),
    /// written straight from them as one block; a status per key (`INVALID_PARAMS` for a
    /// block with a piece outside every registered buffer). With `chain`,
    /// the blocks are consecutive blocks of one chain, as in `put_chain`:
    /// the first extends `parent` (`None`: it starts the chain).
    /// `tags` and `in_order` as in `put_batch`.
    #[pyo3(signature = (keys, ptr_lists, size_lists, chain = false, parent = None, replicas = 0, *, tags = None, in_order = false))]
    #[allow(clippy::too_many_arguments)]
    fn put_from_ptr_lists(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptr_lists: Vec<Vec<usize>>,
        size_lists: Vec<Vec<usize>>,
        chain: bool,
        parent: Option<&Bound<'_, PyAny>>,
        replicas: u8,
        tags: Option<&Bound<'_, PyAny>>,
        in_order: bool,
    ) -> PyResult<Vec<i64>> {
        let (hashes, pieces) = Pieces::of(keys, ptr_lists, size_lists)?;
        let chain = chain_of(chain, parent)?;
        let tags = with_keys(tags_of(tags, hashes.len())?, keys, hashes.len())?;
        let outside: Vec<bool> = (0..hashes.len())
            .map(|i| !pieces.registered(i, &self.registered))
            .collect();
        let items: Vec<(BlockHash, usize)> = hashes.into_iter().zip(0..).collect();
        Ok(except(items, &outside, codes::INVALID_PARAMS, |items| {
            let n = items.len();
            let blocks: Vec<(BlockHash, Vec<Span>)> =
                items.iter().map(|(h, i)| (*h, pieces.spans(*i))).collect();
            let (client, ns) = (&self.inner, &self.namespace);
            let opts = PutOptions { replicas, in_order };
            let tags: Vec<_> = match tags.is_empty() {
                true => Vec::new(),
                false => items.iter().map(|(_, i)| tags[*i].clone()).collect(),
            };
            // SAFETY: every piece lies in a registered buffer (host or GPU
            // memory), which stays allocated while registered.
            let result = py
                .detach(|| self.run(unsafe { client.put_spans(ns, &blocks, chain, &tags, opts) }));
            match result {
                Ok(outcomes) => outcomes.into_iter().map(codes::of_put).collect(),
                Err(err) => vec![codes::of_error(&err); n],
            }
        }))
    }

    /// Reads blocks each into several pieces of registered buffers, the
    /// block's bytes spread over them in order, straight from the
    /// transport; per key the bytes read or
    /// a negative code (`INVALID_PARAMS` for a piece outside every
    /// registered buffer, or pieces that overlap: nothing is written).
    fn get_into_ptr_lists(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptr_lists: Vec<Vec<usize>>,
        size_lists: Vec<Vec<usize>>,
    ) -> PyResult<Vec<i64>> {
        let (hashes, pieces) = Pieces::of(keys, ptr_lists, size_lists)?;
        let refused = pieces.unfit_to_write(&self.registered);
        let items: Vec<(BlockHash, usize)> = hashes.into_iter().zip(0..).collect();
        Ok(except(items, &refused, codes::INVALID_PARAMS, |items| {
            let n = items.len();
            let hashes: Vec<BlockHash> = items.iter().map(|(h, _)| *h).collect();
            let (client, ns) = (&self.inner, &self.namespace);
            let blocks: Vec<Vec<Span>> = items.iter().map(|(_, i)| pieces.spans(*i)).collect();
            // SAFETY: every piece lies in a registered buffer (host or GPU
            // memory), which stays allocated while registered, and no
            // piece overlaps another (checked above).
            let result =
                py.detach(|| self.run(unsafe { client.get_into_spans(ns, &hashes, &blocks) }));
            match result {
                Ok(outcomes) => outcomes.into_iter().map(codes::of_get).collect(),
                Err(err) => vec![codes::of_error(&err); n],
            }
        }))
    }

    /// Copies registered host memory into several pieces of registered
    /// buffers: source `i` (`src_lens[i]` bytes at `src_ptrs[i]`) fills
    /// `ptr_lists[i]` / `size_lists[i]` in order, whose sizes add up to
    /// its length. For slices of blocks read and checked before (the
    /// compatible API's read sessions); GPU pieces through pinned staging.
    /// Per source the bytes copied, or `INVALID_PARAMS` (a source outside
    /// registered host memory, a piece outside every registered buffer,
    /// pieces that overlap each other or a source, sizes that do not add
    /// up: nothing is written).
    fn copy_into_ptr_lists(
        &self,
        py: Python<'_>,
        src_ptrs: Vec<usize>,
        src_lens: Vec<usize>,
        ptr_lists: Vec<Vec<usize>>,
        size_lists: Vec<Vec<usize>>,
    ) -> PyResult<Vec<i64>> {
        check_lengths(src_ptrs.len(), src_lens.len(), "source lengths")?;
        let pieces = Pieces::new(src_ptrs.len(), ptr_lists, size_lists)?;
        Ok(self.copy_into_pieces(py, (&src_ptrs, &src_lens), &pieces))
    }

    /// Where each key is stored: `(size, [daemon address of each copy])`,
    /// or `None`.
    #[allow(clippy::type_complexity)]
    fn locations(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Option<(u32, Vec<String>)>>> {
        let found = self.copies(py, keys)?;
        Ok(found
            .into_iter()
            .map(|l| l.map(|(size, copies)| (size, copies.into_iter().map(|c| c.0).collect())))
            .collect())
    }

    /// Where each key's copies are: `(size, [(daemon address, tier)])`,
    /// the tier `"dram"` or `"nvme"` (held on that daemon's NVMe drives
    /// only), or `None`.
    #[allow(clippy::type_complexity)]
    fn copies(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Option<(u32, Vec<(String, &'static str)>)>>> {
        let hashes = hashes_of(keys)?;
        let (client, ns) = (&self.inner, &self.namespace);
        let locs = py
            .detach(|| self.run(client.lookup(ns, &hashes)))
            .map_err(codes::to_py)?;
        let copy = |(id, tier): (u32, Tier)| {
            let addr = locs
                .daemons
                .iter()
                .find(|d| d.id == id)
                .map_or_else(String::new, |d| d.addr.clone());
            let tier = match tier {
                Tier::Dram => "dram",
                Tier::Nvme => "nvme",
            };
            (addr, tier)
        };
        Ok(locs
            .items
            .iter()
            .map(|l| l.map(|l| (l.size, l.daemons.with_tiers().map(copy).collect())))
            .collect())
    }

    /// How many leading keys of a chain are stored, in one round trip.
    /// With `lease`, the daemons holding them keep them from eviction for
    /// their `kv_lease_ttl`, so that a load planned on the match finds
    /// them (one round trip more); the match ends before a key evicted
    /// since the index answered.
    #[pyo3(signature = (keys, lease = false))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        lease: bool,
    ) -> PyResult<usize> {
        let hashes = hashes_of(keys)?;
        let (client, ns) = (&self.inner, &self.namespace);
        let m = py
            .detach(|| {
                if lease {
                    self.run(client.match_prefix_leased(ns, &hashes))
                } else {
                    self.run(client.match_prefix(ns, &hashes))
                }
            })
            .map_err(codes::to_py)?;
        Ok(m.matched)
    }

    /// The router's question (`docs/events.md`): for a request's keys and
    /// candidate hosts (the node names daemons registered with; `None`:
    /// every host with a live daemon), how much of its prefix each holds
    /// and which serves it at the least cost. `queues` maps a host to work
    /// waiting there, in blocks of prefill; `transfer_cost` is what moving
    /// one block costs against prefilling it. Returns a dict: `blocks`,
    /// `matched`, `best` (a node name or `None`) and `hosts`.
    #[pyo3(signature = (keys, candidates = None, queues = None, transfer_cost = 0.1))]
    fn route<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'_, PyAny>,
        candidates: Option<Vec<String>>,
        queues: Option<HashMap<String, u32>>,
        transfer_cost: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        if !(transfer_cost >= 0.0 && transfer_cost.is_finite()) {
            return Err(PyValueError::new_err("transfer_cost must be 0 or more"));
        }
        let hashes = hashes_of(keys)?;
        let (asked, every_host) = candidates_of(candidates, queues);
        let (client, ns) = (&self.inner, &self.namespace);
        let answer = py
            .detach(|| self.run(client.route(ns, &hashes, &asked, every_host, transfer_cost)))
            .map_err(codes::to_py)?;
        answer_dict(py, &answer)
    }

    /// Whether each key is stored. With `lease`, each daemon holding a
    /// key found keeps it from eviction for its `kv_lease_ttl` (as
    /// Mooncake's `batch_is_exist`), and a key evicted since the index
    /// answered is reported missing.
    #[pyo3(signature = (keys, lease = false))]
    fn exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, lease: bool) -> PyResult<Vec<bool>> {
        let hashes = hashes_of(keys)?;
        let (client, ns) = (&self.inner, &self.namespace);
        py.detach(|| {
            if lease {
                self.run(client.exists_leased(ns, &hashes))
            } else {
                self.run(client.exists(ns, &hashes))
            }
        })
        .map_err(codes::to_py)
    }

    /// Size in bytes of each key's block (`None`: not stored).
    fn sizes(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u32>>> {
        let hashes = hashes_of(keys)?;
        let (client, ns) = (&self.inner, &self.namespace);
        let locs = py
            .detach(|| self.run(client.lookup(ns, &hashes)))
            .map_err(codes::to_py)?;
        Ok(locs.items.iter().map(|l| l.map(|l| l.size)).collect())
    }

    /// Pins keys against eviction (`pinned=False` unpins); a status per key
    /// (0, or `OBJECT_NOT_FOUND`).
    #[pyo3(signature = (keys, pinned = true))]
    fn pin(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, pinned: bool) -> PyResult<Vec<i64>> {
        let hashes = hashes_of(keys)?;
        let (client, ns) = (&self.inner, &self.namespace);
        let out = py
            .detach(|| self.run(client.pin(ns, &hashes, pinned)))
            .map_err(codes::to_py)?;
        Ok(out.into_iter().map(codes::of_code).collect())
    }

    /// Removes keys; `True` for each key that was stored. Raises
    /// `StoreUnavailable` if a daemon holding one could not confirm its
    /// removal (the key is gone from the index; the daemon is told again).
    fn remove(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let hashes = hashes_of(keys)?;
        let (client, ns) = (&self.inner, &self.namespace);
        let removed = py
            .detach(|| self.run(client.remove(ns, &hashes)))
            .map_err(codes::to_py)?;
        codes::removed(&removed)
    }

    /// Removes keys as Mooncake's `batch_remove` does: a status per key,
    /// 0 once removed, `OBJECT_NOT_FOUND` for a key not stored, and,
    /// unless `force`, `OBJECT_HAS_LEASE` for a key a lease holds (looked
    /// up with `exists(lease=True)` within the daemons' `kv_lease_ttl`),
    /// which stays.
    #[pyo3(signature = (keys, force = false))]
    fn remove_codes(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        force: bool,
    ) -> PyResult<Vec<i64>> {
        let hashes = hashes_of(keys)?;
        let (client, ns) = (&self.inner, &self.namespace);
        let out = py
            .detach(|| {
                self.run(async {
                    match force {
                        true => client.remove(ns, &hashes).await,
                        false => client.remove_unleased(ns, &hashes).await,
                    }
                })
            })
            .map_err(codes::to_py)?;
        Ok(out.into_iter().map(codes::of_code).collect())
    }

    /// Removes every block of this client's namespace, but with
    /// `force=False` not those a lease holds (as Mooncake's `remove_all`);
    /// returns how many went. Raises `StoreUnavailable` if a daemon could
    /// not confirm some.
    #[pyo3(signature = (force = true))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<usize> {
        let (client, ns) = (&self.inner, &self.namespace);
        let codes = py
            .detach(|| {
                self.run(async {
                    let mut codes = Vec::new();
                    let mut after = None;
                    loop {
                        let page = client
                            .list(&ListRequest {
                                namespace: Some(ns.clone()),
                                after: after.take(),
                                prefix: Vec::new(),
                                daemon: 0,
                                limit: 1024,
                            })
                            .await?;
                        let hashes: Vec<BlockHash> =
                            page.entries.iter().map(|e| e.key.hash).collect();
                        if hashes.is_empty() {
                            return Ok(codes);
                        }
                        codes.extend(match force {
                            true => client.remove(ns, &hashes).await?,
                            false => client.remove_unleased(ns, &hashes).await?,
                        });
                        if !page.more {
                            return Ok(codes);
                        }
                        after = page.entries.last().map(|e| e.key.clone());
                    }
                })
            })
            .map_err(codes::to_py)?;
        // Blocks a lease holds stay, and are not counted.
        let others: Vec<ErrorCode> = codes
            .into_iter()
            .filter(|c| *c != ErrorCode::Leased)
            .collect();
        Ok(codes::removed(&others)?.into_iter().filter(|r| *r).count())
    }

    /// Blocks read through the same-host shared pool (`shm_socket`).
    #[getter]
    fn shm_reads(&self) -> u64 {
        self.inner.shm_reads()
    }

    /// Of `shm_reads`, those found through the daemon's shared index and
    /// copied without a message to it.
    #[getter]
    fn shm_index_reads(&self) -> u64 {
        self.inner.shm_index_reads()
    }

    /// Connects to the daemon's `shm_socket` and waits, at most `timeout`
    /// seconds, until this process's view of its pool is set up (a few
    /// seconds for a large pool), so that a worker's first loads do not
    /// share a core with it. `False` without a socket or past the timeout.
    #[pyo3(signature = (timeout = 30.0))]
    fn same_host_ready(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let within = std::time::Duration::try_from_secs_f64(timeout)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("timeout: {e}")))?;
        let client = &self.inner;
        Ok(py.detach(|| self.run(client.same_host_ready(within))))
    }

    /// What pages this process's view of the same-host pool has, in words
    /// (`"4KiB"`, `"2MiB (reserved huge pages)"`, or 4 KiB with the share
    /// mapped as transparent huge pages); `None` without a same-host link.
    fn same_host_pages(&self, py: Python<'_>) -> Option<String> {
        let client = &self.inner;
        py.detach(|| client.same_host_pages())
    }

    /// Blocks whose bytes failed their checksum on the way (each was a miss).
    #[getter]
    fn corrupt_reads(&self) -> u64 {
        self.inner.corrupt_reads()
    }

    fn __repr__(&self) -> String {
        format!(
            "Client(meta={:?}, namespace={:?})",
            self.inner.config().meta_addr,
            self.namespace.as_str()
        )
    }
}
