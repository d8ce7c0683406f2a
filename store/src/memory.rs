//! Room for the DRAM pool, read before it is mapped. A cache fills to its
//! capacity, so a pool larger than the memory the host (or the daemon's
//! cgroup, a container's limit) can give ends with the kernel's OOM killer,
//! at start while the pool is filled or later as puts fill it, and the
//! process it kills may be a GPU worker next to the daemon rather than the
//! daemon. So the daemon refuses to start with such a pool, in one line
//! that says what there is.

use std::path::Path;

use mooncake_proto::units::ByteSize;

/// Above this share of the room a pool starts with a warning: what is left
/// is little for the rest of the host.
const TIGHT: f64 = 0.9;

/// What a pool may take, and where that figure comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Room {
    pub bytes: u64,
    pub source: String,
}

/// Whether a pool of `asked` bytes fits this host: `Err` with the reason if
/// not, `Ok(Some(warning))` if it leaves under a tenth of the room.
/// Reserved huge pages count for a pool that may use them (`hugepages`).
/// `Ok(None)` also where nothing could be read (no `/proc/meminfo`).
pub fn check(asked: u64, hugepages: bool) -> Result<Option<String>, String> {
    let Some(meminfo) = std::fs::read_to_string("/proc/meminfo").ok() else {
        return Ok(None);
    };
    let Some(host) = Meminfo::parse(&meminfo) else {
        return Ok(None);
    };
    if hugepages && host.huge_free >= asked.next_multiple_of(host.huge_size.max(1)) {
        // The pool maps reserved huge pages, which it was given already.
        return Ok(None);
    }
    let cgroups = std::fs::read_to_string("/proc/self/cgroup")
        .map(|text| cgroup_limits(&text, Path::new("/sys/fs/cgroup")))
        .unwrap_or_default();
    verdict(asked, room(&host, &cgroups))
}

fn verdict(asked: u64, room: Room) -> Result<Option<String>, String> {
    if asked > room.bytes {
        return Err(format!(
            "a DRAM pool of {} does not fit in the {} this host can give it ({}): lower --dram (`dram` in [daemon])",
            ByteSize(asked),
            ByteSize(room.bytes),
            room.source
        ));
    }
    if asked as f64 > room.bytes as f64 * TIGHT {
        return Ok(Some(format!(
            "the DRAM pool of {} leaves {} of the {} this host can give ({}) to everything else",
            ByteSize(asked),
            ByteSize(room.bytes - asked),
            ByteSize(room.bytes),
            room.source
        )));
    }
    Ok(None)
}

/// The least of the host's available memory and each cgroup's limit less
/// its use.
fn room(host: &Meminfo, cgroups: &[Limit]) -> Room {
    let mut room = Room {
        bytes: host.available,
        source: "MemAvailable in /proc/meminfo".into(),
    };
    for limit in cgroups {
        let left = limit.max.saturating_sub(limit.current);
        if left < room.bytes {
            room = Room {
                bytes: left,
                source: format!(
                    "the limit of cgroup {} ({}) less its use ({})",
                    limit.cgroup,
                    ByteSize(limit.max),
                    ByteSize(limit.current)
                ),
            };
        }
    }
    room
}

/// The figures of `/proc/meminfo` that matter here, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Meminfo {
    available: u64,
    huge_free: u64,
    huge_size: u64,
}

impl Meminfo {
    fn parse(text: &str) -> Option<Meminfo> {
        let field = |name: &str| -> Option<u64> {
            let line = text.lines().find(|l| l.starts_with(name))?;
            let mut words = line[name.len()..].split_whitespace();
            let n: u64 = words.next()?.parse().ok()?;
            Some(match words.next() {
                Some("kB") => n * 1024,
                _ => n,
            })
        };
        let pages = field("HugePages_Free:").unwrap_or(0);
        let huge_size = field("Hugepagesize:").unwrap_or(0);
        Some(Meminfo {
            available: field("MemAvailable:")?,
            huge_free: pages * huge_size,
            huge_size,
        })
    }
}

/// A memory limit on the daemon's cgroup or one above it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Limit {
    cgroup: String,
    max: u64,
    current: u64,
}

/// The memory limits on the process's cgroup and its ancestors, from
/// `/proc/self/cgroup` (`text`) and the cgroup filesystem at `root`:
/// cgroup v2 (`memory.max`, `memory.current`) or v1's memory controller
/// (`memory.limit_in_bytes`, `memory.usage_in_bytes`). Unlimited ones and
/// unreadable ones are left out.
fn cgroup_limits(text: &str, root: &Path) -> Vec<Limit> {
    let mut limits = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (base, files) = if controllers.is_empty() {
            (root.to_path_buf(), ("memory.max", "memory.current"))
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                root.join("memory"),
                ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            )
        } else {
            continue;
        };
        let mut cgroup = Path::new(path.trim());
        loop {
            let dir = base.join(cgroup.strip_prefix("/").unwrap_or(cgroup));
            let read = |name: &str| -> Option<u64> {
                std::fs::read_to_string(dir.join(name))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            };
            // "max" (v2) does not parse; v1 says unlimited with a huge number.
            if let (Some(max), Some(current)) = (read(files.0), read(files.1)) {
                if max < 1 << 60 {
                    limits.push(Limit {
                        cgroup: cgroup.display().to_string(),
                        max,
                        current,
                    });
                }
            }
            match cgroup.parent() {
                Some(parent) => cgroup = parent,
                None => break,
            }
        }
    }
    limits
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24000000 kB\nMemFree:        20000000 kB\nMemAvailable:   22000000 kB\nHugePages_Total:    1024\nHugePages_Free:      512\nHugepagesize:       2048 kB\n";

    #[test]
    fn meminfo_gives_the_available_memory_and_free_huge_pages() {
        let m = Meminfo::parse(MEMINFO).unwrap();
        assert_eq!(m.available, 22_000_000 * 1024);
        assert_eq!(m.huge_free, 512 * (2 << 20));
        assert_eq!(m.huge_size, 2 << 20);
        assert_eq!(Meminfo::parse("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn a_pool_larger_than_the_room_is_refused_with_the_figures() {
        let m = Meminfo::parse(MEMINFO).unwrap();
        let gib = 1u64 << 30;
        let err = verdict(40 * gib, room(&m, &[])).unwrap_err();
        assert!(err.contains("40GiB does not fit in the 21.0GiB"), "{err}");
        assert!(err.contains("MemAvailable"), "{err}");
        assert_eq!(verdict(4 * gib, room(&m, &[])), Ok(None));
        let tight = verdict(20 * gib, room(&m, &[])).unwrap().unwrap();
        assert!(tight.contains("leaves 1004.4MiB of the 21.0GiB"), "{tight}");
    }

    #[test]
    fn a_cgroup_limit_below_the_hosts_memory_is_the_room() {
        let m = Meminfo::parse(MEMINFO).unwrap();
        let gib = 1u64 << 30;
        let limit = Limit {
            cgroup: "/kubepods/pod1".into(),
            max: 8 * gib,
            current: gib,
        };
        let r = room(&m, &[limit]);
        assert_eq!(r.bytes, 7 * gib);
        let err = verdict(16 * gib, r).unwrap_err();
        assert!(
            err.contains("cgroup /kubepods/pod1 (8GiB) less its use (1GiB)"),
            "{err}"
        );
    }

    #[test]
    fn cgroup_limits_are_read_up_the_tree_and_unlimited_ones_left_out() {
        let root = std::env::temp_dir().join(format!(
            "mooncake-cgroup-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let write = |dir: &str, max: &str, current: &str| {
            let d = root.join(dir);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("memory.max"), max).unwrap();
            std::fs::write(d.join("memory.current"), current).unwrap();
        };
        write("a/b", "max\n", "100\n");
        write("a", "1000\n", "300\n");
        write("", "max\n", "5000\n");
        let limits = cgroup_limits("0::/a/b\n", &root);
        assert_eq!(
            limits,
            vec![Limit {
                cgroup: "/a".into(),
                max: 1000,
                current: 300
            }]
        );
        // cgroup v1: the memory controller's hierarchy.
        let v1 = root.join("memory/x");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "4096\n").unwrap();
        std::fs::write(v1.join("memory.usage_in_bytes"), "1024\n").unwrap();
        let limits = cgroup_limits("4:cpu:/x\n5:memory:/x\n", &root);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(limits.len(), 1);
        assert_eq!((limits[0].max, limits[0].current), (4096, 1024));
    }
}
