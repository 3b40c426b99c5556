//! Several volumes on one cache device (Mercury's volume table): their sources are laid end
//! to end, each from a fragment boundary, into one address space, and one cache (one core,
//! one eviction policy, one slot pool) serves it. [`Concat`] is that address space as a
//! device; each volume keeps its own entry in the device's volume table (id, generation,
//! identity), its records name its own fragments, and its page checksums are seeded with
//! its own id and page numbers, so what the device holds for it means the same whichever
//! other volumes share the device.

use sce_io::{BlockDevice, Extent, IoError, SharedBytes};
use std::sync::Arc;

/// One volume of a shared cache device, as the caller gives it.
#[derive(Clone)]
pub struct VolumePart {
    /// The volume's name in the volume table (its source's path or URI).
    pub name: String,
    /// Its source.
    pub source: Arc<dyn BlockDevice>,
    /// An operator's version string of the source's content (`--source-generation`).
    pub source_generation: Option<String>,
    /// Drop what the device holds for it at start.
    pub forget: bool,
    /// The most of the cache's slots it may hold, as a fraction (`cache_share = "40%"`):
    /// at its share, a new fragment of the volume takes the slot of one of its own. None:
    /// no cap.
    pub share: Option<f64>,
}

impl VolumePart {
    /// Volume `name` of `source`, with no source generation, nothing forgotten and no cap
    /// on its share of the cache.
    pub fn new(name: impl Into<String>, source: Arc<dyn BlockDevice>) -> VolumePart {
        VolumePart {
            name: name.into(),
            source,
            source_generation: None,
            forget: false,
            share: None,
        }
    }
}

impl std::fmt::Debug for VolumePart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumePart")
            .field("name", &self.name)
            .field("size", &self.source.size())
            .finish()
    }
}

/// A volume placed in the shared address space.
#[derive(Clone, Debug)]
pub struct Placed {
    /// Where its byte 0 is (a multiple of the fragment size).
    pub base: u64,
    /// Its size in bytes.
    pub size: u64,
}

/// Places volumes of `sizes` bytes end to end, each from a multiple of `fragment_size`.
/// Every volume but the last must be a whole number of 4 KiB pages (a page of the cache
/// never holds bytes of two volumes, nor a volume's bytes and a gap).
pub fn place(sizes: &[u64], fragment_size: u64) -> Result<Vec<Placed>, IoError> {
    let mut at = 0u64;
    let mut out = Vec::with_capacity(sizes.len());
    for (i, &size) in sizes.iter().enumerate() {
        if i + 1 < sizes.len() && !size.is_multiple_of(sce_core::PAGE_SIZE) {
            return Err(IoError::Invalid(format!(
                "a volume that shares a cache device must be a whole number of 4 KiB pages; \
                 volume {} is {size} bytes",
                i + 1
            )));
        }
        out.push(Placed { base: at, size });
        at = at
            .checked_add(size.div_ceil(fragment_size) * fragment_size)
            .ok_or_else(|| IoError::Invalid("the volumes are too large together".into()))?;
    }
    Ok(out)
}

/// The volumes' sources end to end: reads of the gaps between a volume's end and the next
/// fragment boundary return zeroes; writes there are refused (no export reaches them).
pub struct Concat {
    parts: Vec<(Placed, Arc<dyn BlockDevice>)>,
    size: u64,
    lbs: u32,
}

impl Concat {
    /// The sources of `parts`, placed as `place` does it.
    pub fn new(parts: &[VolumePart], fragment_size: u64) -> Result<Concat, IoError> {
        let sizes: Vec<u64> = parts.iter().map(|p| p.source.size()).collect();
        let placed = place(&sizes, fragment_size)?;
        let size = placed.last().map_or(0, |p| p.base + p.size);
        let lbs = parts
            .iter()
            .map(|p| p.source.logical_block_size())
            .max()
            .unwrap_or(512);
        Ok(Concat {
            parts: placed
                .into_iter()
                .zip(parts.iter().map(|p| p.source.clone()))
                .collect(),
            size,
            lbs,
        })
    }

    /// Where each volume is.
    pub fn placement(&self) -> Vec<Placed> {
        self.parts.iter().map(|p| p.0.clone()).collect()
    }

    /// The pieces of `[offset, offset+len)`: (part, offset in the part, offset in the
    /// request, length); `None` as the part for a gap.
    fn pieces(&self, offset: u64, len: u64) -> Vec<(Option<usize>, u64, u64, u64)> {
        let mut out = Vec::new();
        let (mut at, end) = (offset, offset + len);
        while at < end {
            let k = self.parts.partition_point(|p| p.0.base <= at) - 1;
            let (pl, _) = &self.parts[k];
            let part_end = pl.base + pl.size;
            if at < part_end {
                let n = end.min(part_end) - at;
                out.push((Some(k), at - pl.base, at - offset, n));
                at += n;
            } else {
                let next = self.parts.get(k + 1).map_or(u64::MAX, |p| p.0.base);
                let n = end.min(next) - at;
                out.push((None, 0, at - offset, n));
                at += n;
            }
        }
        out
    }

    fn check(&self, op: sce_io::Op, offset: u64, len: u64) -> Result<(), IoError> {
        sce_io::check_range(op, offset, len, self.size, self.lbs)
    }
}

impl BlockDevice for Concat {
    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_size(&self) -> u32 {
        self.lbs
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.check(sce_io::Op::Read, offset, buf.len() as u64)?;
        for (k, at, b, n) in self.pieces(offset, buf.len() as u64) {
            let dst = &mut buf[b as usize..(b + n) as usize];
            match k {
                Some(k) => self.parts[k].1.read_at(at, dst)?,
                None => dst.fill(0),
            }
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.check(sce_io::Op::Write, offset, buf.len() as u64)?;
        for (k, at, b, n) in self.pieces(offset, buf.len() as u64) {
            let Some(k) = k else {
                return Err(IoError::Invalid(format!(
                    "write at {offset} reaches between two volumes"
                )));
            };
            self.parts[k]
                .1
                .write_at(at, &buf[b as usize..(b + n) as usize])?;
        }
        Ok(())
    }

    fn write_shared(&self, offset: u64, data: SharedBytes) -> Result<(), IoError> {
        let p = self.pieces(offset, data.len() as u64);
        match p[..] {
            [(Some(k), at, _, _)] => self.parts[k].1.write_shared(at, data),
            _ => self.write_at(offset, &data),
        }
    }

    fn flush(&self) -> Result<(), IoError> {
        for (_, s) in &self.parts {
            s.flush()?;
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.check(sce_io::Op::Discard, offset, len)?;
        for (k, at, _, n) in self.pieces(offset, len) {
            if let Some(k) = k {
                self.parts[k].1.discard(at, n)?;
            }
        }
        Ok(())
    }

    /// None: each volume has its own identity (the engine asks the sources).
    fn identity(&self) -> Option<String> {
        None
    }

    fn extents_are_local(&self) -> bool {
        self.parts.iter().all(|p| p.1.extents_are_local())
    }

    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, IoError> {
        self.check(sce_io::Op::Read, offset, len)?;
        let mut out = Vec::new();
        for (k, at, _, n) in self.pieces(offset, len) {
            if out.len() >= max.max(1) {
                break;
            }
            match k {
                Some(k) => {
                    let e = self.parts[k].1.extents(at, n, max.max(1) - out.len())?;
                    let got: u64 = e.iter().map(|x| x.len).sum();
                    out.extend(e);
                    if got < n {
                        break;
                    }
                }
                None => out.push(Extent { len: n, hole: true }),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sce_io::MemDevice;

    fn part(name: &str, size: u64, fill: u8) -> VolumePart {
        let d = MemDevice::new(size);
        d.write_at(0, &vec![fill; size as usize]).unwrap();
        VolumePart::new(name, Arc::new(d))
    }

    #[test]
    fn volumes_sit_on_fragment_boundaries_and_gaps_read_as_zeroes() {
        let c = Concat::new(&[part("a", 12288, 1), part("b", 8192, 2)], 65536).unwrap();
        assert_eq!(c.size(), 65536 + 8192);
        let mut b = vec![9u8; 65536 + 8192];
        c.read_at(0, &mut b).unwrap();
        assert!(b[..12288].iter().all(|&x| x == 1));
        assert!(b[12288..65536].iter().all(|&x| x == 0));
        assert!(b[65536..].iter().all(|&x| x == 2));
        c.write_at(65536 + 4096, &[7; 4096]).unwrap();
        assert!(
            c.write_at(12288, &[7; 4096]).is_err(),
            "a gap is never written"
        );
        let e = c
            .extents(0, 65536 + 8192, sce_io::extent::MAX_EXTENTS)
            .unwrap();
        assert_eq!(e.iter().map(|x| x.len).sum::<u64>(), 65536 + 8192);
        assert!(e.iter().any(|x| x.hole && x.len == 65536 - 12288));
    }

    #[test]
    fn only_the_last_volume_may_end_inside_a_page() {
        assert!(place(&[4095, 4096], 65536).is_err());
        assert_eq!(place(&[4096, 4095], 65536).unwrap()[1].base, 65536);
    }
}
