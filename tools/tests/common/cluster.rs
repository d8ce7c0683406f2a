//! A cluster on one machine, as an operator runs it: a real etcd, meta
//! replicas and daemons as separate `mooncake-store` processes, and faults
//! made by killing and pausing real processes. Shared by the cluster tests
//! and the fault suite.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_client::{Client, ClientConfig};
use mooncake_coord::{leader_address, Coordinator, EtcdConfig, EtcdCoordinator};

use super::{free_port, BIN};

pub const TTL: Duration = Duration::from_secs(2);

pub fn scratch_dir(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-{name}-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A scratch folder, removed when dropped unless its test failed (its
/// logs and data stay then, for a look).
#[derive(Debug)]
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A child process that is killed (SIGKILL) and reaped when dropped.
pub struct Proc {
    pub child: Child,
    name: String,
}

impl Proc {
    pub fn spawn(name: &str, program: &str, args: &[&str], logs: &Path) -> Proc {
        // Appended: a restarted process keeps its earlier log.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(logs.join(format!("{name}.log")))
            .unwrap();
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
        Proc {
            child,
            name: name.to_string(),
        }
    }

    /// Takes charge of a process started some other way.
    pub fn from_child(name: &str, child: Child) -> Proc {
        Proc {
            child,
            name: name.to_string(),
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Pauses the process (SIGSTOP) and returns once every one of its
    /// threads is stopped: a signal is only queued when `kill` returns, and
    /// a test that calls the process next must not race its delivery.
    pub fn pause(&self) {
        self.signal("-STOP");
        let tasks = format!("/proc/{}/task", self.child.id());
        let stopped = || {
            std::fs::read_dir(&tasks).is_ok_and(|dir| {
                dir.flatten().all(|t| {
                    // `pid (comm) STATE ...`: the state follows the last ')'.
                    std::fs::read_to_string(t.path().join("stat")).is_ok_and(|st| {
                        st.rsplit_once(')')
                            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['T', 't']))
                    })
                })
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !stopped() {
            assert!(Instant::now() < deadline, "{} did not stop", self.name);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Resumes a paused process (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {}", self.name);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal_quietly();
        self.kill9();
    }
}

impl Proc {
    pub fn signal_quietly(&self) {
        // A paused process must be resumed to die promptly.
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

pub struct Cluster {
    pub etcd: Proc,
    pub etcd_url: String,
    pub etcd_peer_url: String,
    pub metas: Vec<(String, Proc)>,
    pub daemons: Vec<(String, Proc)>,
    pub logs: Scratch,
    pub daemon_config: PathBuf,
    /// The meta replicas' configuration file (`[meta]`).
    pub meta_config: PathBuf,
    pub daemon_dram: String,
    /// The lease each daemon registers under (`--lease-ttl`).
    pub daemon_lease: String,
    /// With TLS on every TCP port: the development CA and certificates,
    /// which every server and client of the cluster uses.
    pub tls: Option<PathBuf>,
    /// With store events: each meta replica's events and replay addresses,
    /// by replica.
    pub events: Option<Vec<(String, String)>>,
}

impl Cluster {
    pub async fn start(metas: usize, daemons: usize) -> Cluster {
        Self::start_sized(metas, daemons, "64MiB").await
    }

    /// As `start`, with `dram` of pool per daemon.
    pub async fn start_sized(metas: usize, daemons: usize, dram: &str) -> Cluster {
        Self::start_with(metas, daemons, dram, "2s").await
    }

    /// As `start_sized`, with daemons registered under a lease of
    /// `daemon_lease` (a daemon that stops answering leaves the index when
    /// it ends).
    pub async fn start_with(
        metas: usize,
        daemons: usize,
        dram: &str,
        daemon_lease: &str,
    ) -> Cluster {
        Self::launch(metas, daemons, dram, daemon_lease, false, false).await
    }

    /// As `start_sized`, each meta replica publishing store events on
    /// ports of its own (`events`).
    pub async fn start_events(metas: usize, daemons: usize, dram: &str) -> Cluster {
        Self::launch(metas, daemons, dram, "2s", false, true).await
    }

    /// As `start_events`, the meta replicas reading `meta_toml` (the body
    /// of their `[meta]` table).
    pub async fn start_events_with(
        metas: usize,
        daemons: usize,
        dram: &str,
        meta_toml: &str,
    ) -> Cluster {
        Self::launch_with(metas, daemons, dram, "2s", (false, true), meta_toml).await
    }

    /// As `start_sized`, with TLS on every TCP port: clients, daemons and
    /// meta replicas all speak TLS to each other (mutual TLS between the
    /// servers), with a development CA.
    pub async fn start_tls(metas: usize, daemons: usize, dram: &str) -> Cluster {
        Self::launch(metas, daemons, dram, "2s", true, false).await
    }

    /// As `start_with`, the meta replicas reading `meta_toml` (the body of
    /// their `[meta]` table).
    pub async fn start_with_meta(
        metas: usize,
        daemons: usize,
        dram: &str,
        meta_toml: &str,
    ) -> Cluster {
        Self::launch_with(metas, daemons, dram, "2s", (false, false), meta_toml).await
    }

    async fn launch(
        metas: usize,
        daemons: usize,
        dram: &str,
        daemon_lease: &str,
        tls: bool,
        events: bool,
    ) -> Cluster {
        Self::launch_with(metas, daemons, dram, daemon_lease, (tls, events), "").await
    }

    async fn launch_with(
        metas: usize,
        daemons: usize,
        dram: &str,
        daemon_lease: &str,
        (tls, events): (bool, bool),
        meta_toml: &str,
    ) -> Cluster {
        let logs = scratch_dir("cluster");
        let tls = tls.then(|| {
            let dir = logs.join("certs");
            mooncake_net::DevCerts::generate(&["127.0.0.1".into()], "worker")
                .unwrap()
                .write(&dir)
                .unwrap();
            dir
        });
        let (client_port, peer_port) = (free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd = spawn_etcd(&logs, &etcd_url, &peer_url);
        let daemon_config = logs.join("daemon.toml");
        std::fs::write(
            &daemon_config,
            "[daemon]\nhugepages = false\nprefault = false\nheartbeat_interval = \"200ms\"\n",
        )
        .unwrap();
        let meta_config = logs.join("meta.toml");
        std::fs::write(&meta_config, format!("[meta]\n{meta_toml}\n")).unwrap();
        let mut cluster = Cluster {
            etcd,
            etcd_url,
            etcd_peer_url: peer_url,
            metas: Vec::new(),
            daemons: Vec::new(),
            logs,
            daemon_config,
            meta_config,
            daemon_dram: dram.to_string(),
            daemon_lease: daemon_lease.to_string(),
            tls,
            events: events.then(Vec::new),
        };
        for _ in 0..metas {
            cluster.spawn_meta();
        }
        for _ in 0..daemons {
            let addr = format!("127.0.0.1:{}", free_port());
            cluster.spawn_daemon(&addr);
        }
        cluster.wait_healthy(daemons, Duration::from_secs(15)).await;
        cluster
    }

    /// The last lines of each server's log, for a failure's message (a CI
    /// machine keeps nothing else).
    pub fn log_tails(&self, lines: usize) -> String {
        let mut names: Vec<_> = std::fs::read_dir(&self.logs)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        names.sort();
        let mut out = String::new();
        for path in names {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            let tail = &all[all.len().saturating_sub(lines)..];
            out += &format!("\n--- {} ---\n{}", path.display(), tail.join("\n"));
        }
        out
    }

    /// Stops etcd (SIGKILL) and starts it again on its data and ports.
    pub fn restart_etcd(&mut self) {
        self.etcd.kill9();
        self.etcd = spawn_etcd(&self.logs, &self.etcd_url, &self.etcd_peer_url);
    }

    pub fn spawn_meta(&mut self) {
        let addr = format!("127.0.0.1:{}", free_port());
        let name = format!("meta-{}", self.metas.len());
        let mut args: Vec<String> = [
            "meta",
            "--etcd",
            &self.etcd_url,
            "--listen",
            &addr,
            "--lease-ttl",
            "2s",
            "--admin",
            "",
            "--config",
            self.meta_config.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec();
        args.extend(self.tls_args());
        if let Some(events) = &mut self.events {
            let publish = format!("127.0.0.1:{}", free_port());
            let replay = format!("127.0.0.1:{}", free_port());
            args.extend(["--events".into(), publish.clone()]);
            args.extend(["--events-replay".into(), replay.clone()]);
            events.push((publish, replay));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let p = Proc::spawn(&name, BIN, &args, &self.logs);
        self.metas.push((addr, p));
    }

    /// A server's TLS flags in this cluster: TLS on its TCP port, mutual
    /// TLS, and the other servers called over TLS. None without TLS.
    fn tls_args(&self) -> Vec<String> {
        let Some(dir) = &self.tls else {
            return Vec::new();
        };
        let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
        vec![
            "--tls".into(),
            "--tls-cert".into(),
            path("daemon.pem"),
            "--tls-key".into(),
            path("daemon.key"),
            "--tls-client-ca".into(),
            path("ca.pem"),
            "--peer-ca".into(),
            path("ca.pem"),
        ]
    }

    /// How the test reaches this cluster's servers itself.
    pub fn dialer(&self) -> mooncake_net::Dialer {
        match self.tls_connector() {
            Some(tls) => mooncake_net::Dialer::Tls(Arc::new(tls)),
            None => mooncake_net::Dialer::Tcp,
        }
    }

    fn tls_connector(&self) -> Option<mooncake_net::TlsConnector> {
        let dir = self.tls.as_ref()?;
        let tls = mooncake_net::DevCerts::client_tls(dir, true);
        Some(mooncake_net::TlsConnector::new(&tls).unwrap())
    }

    /// A byte stream to a server of this cluster (over TLS when it speaks
    /// TLS), for writing frames by hand.
    pub async fn raw_stream(
        &self,
        addr: &str,
    ) -> (mooncake_net::ReadHalf, mooncake_net::WriteHalf) {
        let side = mooncake_client::ErrorSource::Daemon;
        match self.tls_connector() {
            Some(tls) => tls
                .stream(addr, side, Duration::from_secs(2))
                .await
                .unwrap(),
            None => {
                let (rd, wr) = tokio::net::TcpStream::connect(addr)
                    .await
                    .unwrap()
                    .into_split();
                (Box::new(rd), Box::new(wr))
            }
        }
    }

    pub fn spawn_daemon(&mut self, addr: &str) -> usize {
        let args = self.daemon_args(addr, &self.daemon_dram.clone());
        self.spawn_daemon_with(addr, args)
    }

    /// A daemon serving on `addr` as host `node` (distinct nodes hold a
    /// block's distinct copies).
    pub fn spawn_daemon_on(&mut self, addr: &str, node: &str) -> usize {
        let mut args = self.daemon_args(addr, &self.daemon_dram.clone());
        args.extend(["--node".to_string(), node.to_string()]);
        self.spawn_daemon_with(addr, args)
    }

    fn spawn_daemon_with(&mut self, addr: &str, args: Vec<String>) -> usize {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let name = format!("daemon-{}", self.daemons.len());
        let p = Proc::spawn(&name, BIN, &args, &self.logs);
        self.daemons.push((addr.to_string(), p));
        self.daemons.len() - 1
    }

    /// The arguments of a daemon of this cluster serving on `addr`.
    pub fn daemon_args(&self, addr: &str, dram: &str) -> Vec<String> {
        let mut args: Vec<String> = [
            "daemon",
            "--etcd",
            &self.etcd_url,
            "--listen",
            addr,
            "--dram",
            dram,
            "--lease-ttl",
            &self.daemon_lease,
            "--config",
            self.daemon_config.to_str().unwrap(),
            "--admin",
            "",
        ]
        .map(String::from)
        .to_vec();
        args.extend(self.tls_args());
        args
    }

    /// A connection to the cluster's etcd. etcd listens a moment before
    /// its gRPC service answers (longer on a loaded machine), so a refused
    /// connection is tried again, for at most 15 s.
    pub async fn coordinator(&self) -> Arc<EtcdCoordinator> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let connected = EtcdCoordinator::connect(EtcdConfig {
                ttl: TTL,
                ..EtcdConfig::new(vec![self.etcd_url.clone()])
            })
            .await;
            match connected {
                Ok(c) => return c,
                Err(err) if Instant::now() < deadline => {
                    eprintln!("etcd not answering yet ({err}); trying again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(err) => panic!("etcd at {} never answered: {err}", self.etcd_url),
            }
        }
    }

    pub async fn client(&self, timeout: Duration) -> Client {
        let resolver = Arc::new(leader_address(self.coordinator().await));
        let mut cfg = ClientConfig::new("")
            .with_timeout(timeout)
            .with_resolver(resolver)
            .await
            .unwrap();
        if let Some(dir) = &self.tls {
            cfg = cfg
                .with_tls(&mooncake_net::DevCerts::client_tls(dir, true))
                .unwrap();
        }
        Client::new(cfg)
    }

    /// Waits for a leader with `daemons` live daemons registered.
    pub async fn wait_healthy(&self, daemons: usize, within: Duration) {
        let deadline = Instant::now() + within;
        let coordinator = self.coordinator().await;
        loop {
            if let Ok(Some(_)) = coordinator.leader().await {
                let client = self.client(Duration::from_secs(2)).await;
                if let Ok(st) = client.cluster_stats().await {
                    if st.daemons.iter().filter(|d| d.alive).count() == daemons {
                        return;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "cluster not healthy within {within:?}; logs in {}",
                self.logs.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn leader_index(&self) -> usize {
        let leader = self.coordinator().await.leader().await.unwrap().unwrap();
        self.metas
            .iter()
            .position(|(a, _)| *a == leader.addr)
            .unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.daemons.clear();
        self.metas.clear();
        self.etcd.kill9();
        // Then `logs` goes, unless the test failed.
    }
}

/// etcd on `client_url`, its data under `logs`; returns once it listens.
fn spawn_etcd(logs: &Path, client_url: &str, peer_url: &str) -> Proc {
    let data = logs.join("etcd-data");
    let etcd = Proc::spawn(
        "etcd",
        "etcd",
        &[
            "--name",
            "t",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            &format!("t={peer_url}"),
        ],
        logs,
    );
    let port: u16 = client_url.rsplit(':').next().unwrap().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "etcd did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    etcd
}
