//! Where the damage of the write-back damage loop (`wb_damage.rs`) lands: the layout
//! `sce check --json` reports, the raw on-device structures a round damages (metadata unit,
//! record, journal block, data page, superblock copy) and the written pages each could
//! vouch for.

use super::{Target, BLOCK};
use crate::common;
use crate::common::blocks::decode;
use rand::{rngs::SmallRng, Rng};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// The layout fields `sce check --json` names, and the cache image.
pub struct Device {
    version: u64,
    journal_tail: u64,
    l: serde_json::Value,
    img: Vec<u8>,
}

impl Device {
    pub fn read(cache: &Path) -> Device {
        let out = Command::new(common::sce_bin())
            .args(["check", "--json"])
            .arg(cache)
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "sce check --json: {e}: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        let sb = &v["superblock"];
        Device {
            version: sb["version"].as_u64().unwrap(),
            journal_tail: sb["journal_tail"].as_u64().unwrap(),
            l: sb["layout"].clone(),
            img: std::fs::read(cache).unwrap(),
        }
    }

    fn n(&self, k: &str) -> u64 {
        common::num(&self.l, k)
    }

    fn u64_at(&self, off: u64) -> u64 {
        u64::from_le_bytes(self.img[off as usize..off as usize + 8].try_into().unwrap())
    }

    fn u16_at(&self, off: u64) -> u64 {
        u16::from_le_bytes(self.img[off as usize..off as usize + 2].try_into().unwrap()) as u64
    }

    pub fn mirrored(&self) -> bool {
        self.version >= 5
    }

    /// Where each page's last version lives in the cache's data region: page -> slot.
    pub fn slots_of(&self, last: &BTreeMap<u64, u64>) -> BTreeMap<u64, (u64, u64)> {
        let (d0, fs) = (self.n("data_offset"), self.n("fragment_size"));
        let mut at = BTreeMap::new();
        let end = (d0 + self.n("slots") * fs).min(self.img.len() as u64);
        for off in (d0..end).step_by(BLOCK as usize) {
            let p = &self.img[off as usize..(off + BLOCK) as usize];
            let idx = u64::from_le_bytes(p[..8].try_into().unwrap());
            if let Some(&want) = last.get(&idx) {
                if decode(idx, p) == Some(want) {
                    at.insert(idx, ((off - d0) / fs, off));
                }
            }
        }
        at
    }
}

/// The bytes a round damages, the written pages it could vouch for, and what it is.
pub struct Damage {
    pub start: u64,
    pub len: u64,
    pub vouched: BTreeSet<u64>,
    pub what: String,
}

/// The newer of two copies by the sequence number at `seq_at` (a copy without `magic` is
/// older than any), the first on a tie unless `second_on_tie`: (offset, description).
fn newer_copy(
    dev: &Device,
    (a, b): (u64, Option<u64>),
    (magic, seq_at): (&[u8], u64),
    second_on_tie: bool,
) -> (u64, String) {
    let seq = |o: u64| {
        let m = &dev.img[o as usize..o as usize + magic.len()];
        (m == magic).then(|| dev.u64_at(o + seq_at))
    };
    let Some(b) = b else {
        return (a, format!("the only copy, seq {:?}", seq(a)));
    };
    let (sa, sb) = (seq(a), seq(b));
    if sb > sa || (sb == sa && second_on_tie) {
        (b, format!("mirror copy, seq {sb:?} (other {sa:?})"))
    } else {
        (a, format!("primary copy, seq {sa:?} (other {sb:?})"))
    }
}

/// A unit (or one record inside it) holding the slot of a random written page.
fn unit_damage(
    dev: &Device,
    last: &BTreeMap<u64, u64>,
    rng: &mut SmallRng,
    r: u32,
    record: bool,
) -> Option<Damage> {
    let at = dev.slots_of(last);
    let pages: Vec<_> = at.keys().copied().collect();
    let (slot, _) = at[pages.get(rng.gen_range(0..pages.len().max(1)))?];
    let (spu, us, units) = (dev.n("slots_per_unit"), dev.n("unit_size"), dev.n("units"));
    let u = slot / spu;
    let primary = dev.n("meta_offset") + u * us;
    let mirror = dev.mirrored().then_some(primary + units * us);
    let (copy, which) = newer_copy(dev, (primary, mirror), (b"SCMU", 32), r % 2 == 1);
    let holds = |s: u64| if record { s == slot } else { s / spu == u };
    let vouched = at
        .iter()
        .filter(|(_, (s, _))| holds(*s))
        .map(|(p, _)| *p)
        .collect();
    let es = dev.n("entry_size");
    Some(if record {
        Damage {
            start: copy + 64 + (slot % spu) * es,
            len: es,
            vouched,
            what: format!("record of slot {slot} in unit {u}, {which}"),
        }
    } else {
        Damage {
            start: copy,
            len: us,
            vouched,
            what: format!("unit {u}, {which}"),
        }
    })
}

/// A random live journal block (sequence at or above the tail) with dirty entries naming
/// written pages; on a mirrored journal the primary or the mirror copy by round.
fn journal_damage(
    dev: &Device,
    last: &BTreeMap<u64, u64>,
    rng: &mut SmallRng,
    r: u32,
) -> Option<Damage> {
    let (jo, jb, ppf) = (
        dev.n("journal_offset"),
        dev.n("journal_blocks"),
        dev.n("pages_per_fragment"),
    );
    let ring = if dev.mirrored() { jb / 2 } else { jb };
    let mut live = Vec::new();
    for p in 0..ring {
        let off = jo + p * BLOCK;
        if &dev.img[off as usize..off as usize + 4] != b"SCEJ"
            || dev.u64_at(off + 32) < dev.journal_tail
        {
            continue;
        }
        let mut named = BTreeSet::new();
        for i in 0..dev.u16_at(off + 12).min(126) {
            let e = off + 64 + 32 * i;
            let (frag, kind) = (dev.u64_at(e), dev.u16_at(e + 10));
            let first = frag * ppf + dev.u16_at(e + 12);
            let n = dev.u16_at(e + 14);
            if kind == 1 {
                named.extend((first..first + n).filter(|q| last.contains_key(q)));
            }
        }
        if !named.is_empty() {
            live.push((p, dev.u64_at(off + 32), named));
        }
    }
    let k = rng.gen_range(0..live.len().max(1));
    let (p, seq, vouched) = live.into_iter().nth(k)?;
    let mirror = dev.mirrored() && r % 2 == 1;
    let at = if mirror { p + jb / 2 } else { p };
    let what = format!(
        "journal block seq {seq} at position {p} ({}), tail {}",
        if mirror {
            "mirror copy"
        } else if dev.mirrored() {
            "primary copy"
        } else {
            "the only copy"
        },
        dev.journal_tail
    );
    Some(Damage {
        start: jo + at * BLOCK,
        len: BLOCK,
        vouched,
        what,
    })
}

/// The target's bytes and the pages it could vouch for; None if the device holds no such
/// structure worth damaging (said in the table).
pub fn choose(
    dev: &Device,
    t: Target,
    last: &BTreeMap<u64, u64>,
    rng: &mut SmallRng,
    r: u32,
) -> Option<Damage> {
    match t {
        Target::Unit => unit_damage(dev, last, rng, r, false),
        Target::Record => unit_damage(dev, last, rng, r, true),
        Target::Journal => journal_damage(dev, last, rng, r),
        Target::Page => {
            let at = dev.slots_of(last);
            let (&page, &(slot, off)) = at.iter().nth(rng.gen_range(0..at.len().max(1)))?;
            let what = format!("data page {page} in slot {slot}");
            Some(Damage {
                start: off,
                len: BLOCK,
                vouched: [page].into(),
                what,
            })
        }
        Target::Superblock => {
            let (copy, which) = newer_copy(dev, (0, Some(BLOCK)), (b"SCECACHE", 16), false);
            let what = format!("superblock {which}");
            Some(Damage {
                start: copy,
                len: BLOCK,
                vouched: BTreeSet::new(),
                what,
            })
        }
    }
}
