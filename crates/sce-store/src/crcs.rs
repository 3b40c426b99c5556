//! Page checksums outside the records: the in-memory table of a cache without persistence,
//! and one unit's checksums read back from the device (a persistent cache keeps its page
//! checksums in its records and in memory only for the units in use: the engine's
//! `crcs.rs`).

use crate::choose_copy;
use crate::layout::Layout;
use crate::unit::decode_unit;
use sce_io::{AlignedBuf, BlockDevice, IoError};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// Per-page checksums of every slot, in memory (4 bytes per 4 KiB page): what a cache
/// without persistence keeps, since nothing else holds its checksums.
#[derive(Debug)]
pub struct CrcTable {
    pages: usize,
    v: Box<[AtomicU32]>,
}

impl CrcTable {
    /// A table for `slots` slots of `pages` pages.
    pub fn new(slots: u32, pages: u32) -> Self {
        CrcTable {
            pages: pages as usize,
            v: (0..slots as usize * pages as usize)
                .map(|_| AtomicU32::new(0))
                .collect(),
        }
    }
    /// The checksum of page `p` of slot `s`.
    #[inline]
    pub fn get(&self, s: u32, p: u32) -> u32 {
        self.v[s as usize * self.pages + p as usize].load(Relaxed)
    }
    /// Sets the checksum of page `p` of slot `s`.
    #[inline]
    pub fn set(&self, s: u32, p: u32, crc: u32) {
        self.v[s as usize * self.pages + p as usize].store(crc, Relaxed)
    }
    /// Bytes the table takes.
    pub fn bytes(&self) -> usize {
        self.v.len() * 4
    }
}

/// What the device's records say of one unit's page checksums.
#[derive(Debug, PartialEq, Eq)]
pub enum UnitCrcs {
    /// The unit's copy that loading would choose: the checksums of its slots' pages, slot
    /// by slot (`slots_per_unit` x `pages_per_fragment`; an invalid page's is 0).
    Found(Vec<u32>),
    /// Neither copy holds a record of this device's (never written, or only a copy no
    /// round completed): the unit claims nothing.
    Blank,
    /// Both copies were this device's units and are damaged: what it held is unknown.
    Damaged,
}

/// Returns the checksums of unit `unit`'s copy that loading would choose (the same rule:
/// the valid one, or of two the later round's). `seq`: the low 32 bits of the sequence of
/// the last image this device is known to hold for the unit (written by a round, or loaded;
/// 0: unknown). A primary copy that decodes with that sequence is that image, and is used
/// alone: one read. Otherwise both copies are read and chosen between. If one copy cannot
/// be read, the other is used if it is the image known (or, with none known, if it is
/// valid); otherwise the read error is returned: an I/O error never passes for damage.
pub fn read_unit_crcs(
    dev: &dyn BlockDevice,
    l: &Layout,
    uuid: &[u8; 16],
    unit: u32,
    seq: u32,
) -> Result<UnitCrcs, IoError> {
    let us = l.unit_size as usize;
    let mut buf = AlignedBuf::new(2 * us);
    let (prim, mirr) = buf.split_at_mut(us);
    let primary = dev.read_at(l.unit_offset(unit), prim);
    let known = primary.is_ok()
        && seq != 0
        && decode_unit(l, uuid, unit, prim, |_, _| {}).is_ok()
        && crate::unit::unit_seq(prim) as u32 == seq;
    if known {
        return Ok(found(l, uuid, unit, &buf[..us]));
    }
    let mirror = dev.read_at(l.unit_mirror_offset(unit), mirr);
    // One copy unreadable: the other is used only if it is the image known (or, with none
    // known, valid); otherwise the read error stands (nothing is assumed of the unit).
    let alone = |img: &[u8]| {
        decode_unit(l, uuid, unit, img, |_, _| {}).is_ok()
            && (seq == 0 || crate::unit::unit_seq(img) as u32 == seq)
    };
    let img = match (primary, mirror) {
        (Ok(()), Ok(())) => choose_copy(l, uuid, unit, [&buf[..us], &buf[us..]]),
        (Ok(()), Err(e)) => match alone(&buf[..us]) {
            true => return Ok(found(l, uuid, unit, &buf[..us])),
            false => return Err(e),
        },
        (Err(e), Ok(())) => match alone(&buf[us..]) {
            true => return Ok(found(l, uuid, unit, &buf[us..])),
            false => return Err(e),
        },
        (Err(e), Err(_)) => return Err(e),
    };
    match img {
        Ok((Some(img), _)) => Ok(found(l, uuid, unit, img)),
        Ok((None, _))
        | Err(crate::unit::UnitError::Blank)
        | Err(crate::unit::UnitError::Foreign) => Ok(UnitCrcs::Blank),
        Err(_) => Ok(UnitCrcs::Damaged),
    }
}

/// The page checksums a valid image of unit `unit` holds, slot by slot.
pub fn image_crcs(l: &Layout, uuid: &[u8; 16], unit: u32, img: &[u8]) -> Option<Vec<u32>> {
    let pages = l.pages_per_fragment;
    let mut crcs = vec![0u32; (l.slots_per_unit * pages) as usize];
    decode_unit(l, uuid, unit, img, |i, e| {
        for p in 0..pages {
            crcs[(i * pages + p) as usize] = e.crc(p);
        }
    })
    .ok()?;
    Some(crcs)
}

fn found(l: &Layout, uuid: &[u8; 16], unit: u32, img: &[u8]) -> UnitCrcs {
    image_crcs(l, uuid, unit, img).map_or(UnitCrcs::Damaged, UnitCrcs::Found)
}
