//! The daemons that hold a block's copies, and a stored block's location.
//! A block has one copy unless its writer asked for more (each on a
//! distinct host); `Copies` keeps up to `MAX_COPIES` daemon ids inline, so
//! that a location stays `Copy` and an index entry stays small.

use super::*;

/// Most copies one block may have.
pub const MAX_COPIES: usize = 4;

/// The fastest tier of a daemon that holds a copy: its DRAM pool, or only
/// its NVMe drives (demoted there; a read costs a drive read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Tier {
    #[default]
    Dram,
    Nvme,
}

impl Tier {
    pub(super) fn encode(self, w: &mut Writer) {
        w.u8(self as u8);
    }

    pub(super) fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        match r.u8()? {
            0 => Ok(Tier::Dram),
            1 => Ok(Tier::Nvme),
            t => Err(ProtoError::Invalid {
                field: "tier",
                why: format!("unknown tier {t}"),
            }),
        }
    }
}

/// A set of daemon ids, in the order they were chosen (the first is the
/// one a writer on its host placed first), with the tier each holds its
/// copy in. A new copy is in DRAM.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Copies {
    ids: [u32; MAX_COPIES],
    len: u8,
    /// Bit i set: copy i is on NVMe only.
    nvme: u8,
}

impl Copies {
    pub fn one(daemon: u32) -> Self {
        let mut c = Copies::default();
        c.push(daemon);
        c
    }

    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_full(&self) -> bool {
        self.len() == MAX_COPIES
    }

    pub fn as_slice(&self) -> &[u32] {
        &self.ids[..self.len()]
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.as_slice().iter().copied()
    }

    /// Each copy's daemon with the tier it holds the block in.
    pub fn with_tiers(&self) -> impl Iterator<Item = (u32, Tier)> + '_ {
        self.iter().enumerate().map(|(i, d)| (d, self.tier_at(i)))
    }

    fn tier_at(&self, i: usize) -> Tier {
        if self.nvme & (1 << i) != 0 {
            Tier::Nvme
        } else {
            Tier::Dram
        }
    }

    /// The tier `daemon` holds its copy in; `None` if it holds none.
    pub fn tier_of(&self, daemon: u32) -> Option<Tier> {
        let at = self.as_slice().iter().position(|d| *d == daemon)?;
        Some(self.tier_at(at))
    }

    /// Records the tier `daemon`'s copy is in now; the tier it was in
    /// before if that changed, `None` if unchanged or `daemon` holds none.
    pub fn set_tier(&mut self, daemon: u32, tier: Tier) -> Option<Tier> {
        let at = self.as_slice().iter().position(|d| *d == daemon)?;
        let was = self.tier_at(at);
        if was == tier {
            return None;
        }
        match tier {
            Tier::Nvme => self.nvme |= 1 << at,
            Tier::Dram => self.nvme &= !(1 << at),
        }
        Some(was)
    }

    pub fn first(&self) -> Option<u32> {
        self.as_slice().first().copied()
    }

    pub fn contains(&self, daemon: u32) -> bool {
        self.as_slice().contains(&daemon)
    }

    /// Adds a daemon; `false` if it is there already or the set is full.
    pub fn push(&mut self, daemon: u32) -> bool {
        if self.contains(daemon) || self.is_full() {
            return false;
        }
        self.ids[self.len()] = daemon;
        self.len += 1;
        true
    }

    /// Takes a daemon out, keeping the others' order; `false` if absent.
    pub fn remove(&mut self, daemon: u32) -> bool {
        let Some(at) = self.as_slice().iter().position(|d| *d == daemon) else {
            return false;
        };
        let len = self.len();
        self.ids.copy_within(at + 1..len, at);
        // The tiers of the copies after it move down with them.
        let below = self.nvme & ((1 << at) - 1);
        let above = (self.nvme >> (at + 1)) << at;
        self.nvme = below | above;
        self.len -= 1;
        self.ids[self.len()] = 0;
        true
    }

    pub(super) fn encode(&self, w: &mut Writer) {
        w.u8(self.len);
        w.u8(self.nvme);
        for d in self.iter() {
            w.u32(d);
        }
    }

    pub(super) fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = usize::from(r.u8()?);
        if n > MAX_COPIES {
            return Err(ProtoError::Invalid {
                field: "copies",
                why: format!("{n} copies, at most {MAX_COPIES}"),
            });
        }
        let nvme = r.u8()?;
        if u32::from(nvme) >> n != 0 {
            return Err(ProtoError::Invalid {
                field: "copies",
                why: format!("tiers {nvme:#b} name copies beyond the {n} there are"),
            });
        }
        let mut c = Copies {
            nvme,
            ..Copies::default()
        };
        for _ in 0..n {
            if !c.push(r.u32()?) {
                return Err(ProtoError::Invalid {
                    field: "copies",
                    why: "a daemon named twice".into(),
                });
            }
        }
        Ok(c)
    }
}

impl std::fmt::Debug for Copies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        for (d, tier) in self.with_tiers() {
            match tier {
                Tier::Dram => list.entry(&d),
                Tier::Nvme => list.entry(&format_args!("{d}(nvme)")),
            };
        }
        list.finish()
    }
}

impl FromIterator<u32> for Copies {
    /// Keeps the first `MAX_COPIES` distinct ids.
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        let mut c = Copies::default();
        for d in iter {
            c.push(d);
        }
        c
    }
}

/// Where a stored block lives (every copy), with what the writer declared
/// of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub daemons: Copies,
    pub size: u32,
    pub checksum: u64,
}

impl Location {
    /// The block on one daemon.
    pub fn on(daemon: u32, size: u32, checksum: u64) -> Self {
        Location {
            daemons: Copies::one(daemon),
            size,
            checksum,
        }
    }

    pub(super) fn encode(&self, w: &mut Writer) {
        self.daemons.encode(w);
        w.u32(self.size);
        w.u64(self.checksum);
    }

    pub(super) fn decode(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let daemons = Copies::decode(r)?;
        if daemons.is_empty() {
            return Err(ProtoError::Invalid {
                field: "location",
                why: "no copy".into(),
            });
        }
        Ok(Location {
            daemons,
            size: r.u32()?,
            checksum: r.u64()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_keep_order_refuse_twins_and_stay_bounded() {
        let mut c: Copies = [3, 1, 3, 2].into_iter().collect();
        assert_eq!(c.as_slice(), &[3, 1, 2]);
        assert!(!c.push(1), "already there");
        assert!(c.push(9));
        assert!(!c.push(10), "full");
        assert!(c.remove(1));
        assert_eq!(c.as_slice(), &[3, 2, 9]);
        assert!(!c.remove(1));
        assert_eq!(
            c,
            [3, 2, 9].into_iter().collect(),
            "removal leaves no trace"
        );
    }

    #[test]
    fn each_copy_keeps_its_tier_through_removals_and_the_wire() {
        let mut c: Copies = [3, 1, 2, 9].into_iter().collect();
        assert_eq!(c.set_tier(1, Tier::Nvme), Some(Tier::Dram));
        assert_eq!(c.set_tier(1, Tier::Nvme), None, "unchanged");
        assert_eq!(c.set_tier(9, Tier::Nvme), Some(Tier::Dram));
        assert_eq!(c.set_tier(4, Tier::Nvme), None, "holds no copy");
        assert!(c.remove(3));
        assert_eq!(
            c.with_tiers().collect::<Vec<_>>(),
            [(1, Tier::Nvme), (2, Tier::Dram), (9, Tier::Nvme)]
        );
        assert!(c.remove(2));
        assert_eq!(c.tier_of(9), Some(Tier::Nvme));
        assert_eq!(c.set_tier(9, Tier::Dram), Some(Tier::Nvme));
        assert!(c.push(5));
        assert_eq!(c.tier_of(5), Some(Tier::Dram), "a new copy is in DRAM");
        let mut w = Writer { buf: Vec::new() };
        let loc = Location {
            daemons: c,
            size: 4,
            checksum: 5,
        };
        loc.encode(&mut w);
        assert_eq!(Location::decode(&mut Reader::new(&w.buf)).unwrap(), loc);
        assert!(c.remove(1) && c.remove(9) && c.remove(5));
        assert_eq!(c, Copies::default(), "removal leaves no trace");
    }

    #[test]
    fn a_location_without_copies_or_with_too_many_is_refused() {
        let mut w = Writer { buf: Vec::new() };
        Location::on(7, 10, 11).encode(&mut w);
        let ok = w.buf.clone();
        assert_eq!(
            Location::decode(&mut Reader::new(&ok)).unwrap(),
            Location::on(7, 10, 11)
        );
        let mut none = ok.clone();
        none.drain(0..6);
        none.splice(0..0, [0, 0]);
        assert!(Location::decode(&mut Reader::new(&none)).is_err());
        let mut beyond = ok.clone();
        beyond[1] = 0b10;
        assert!(Location::decode(&mut Reader::new(&beyond)).is_err());
        let mut many = vec![5u8, 0];
        for d in 0..5u32 {
            many.extend(d.to_le_bytes());
        }
        assert!(Copies::decode(&mut Reader::new(&many)).is_err());
    }
}
