//! The volume table's entries: finding a volume, and adding the volumes of a cache that
//! several share.

use crate::superblock::{self, Superblock, Volume};
use crate::StoreError;

/// The table entries of several volumes (name, size) one cache serves, added to the table
/// where missing: a new volume gets an id no entry holds, or, with the table full, the place
/// of a volume not named here (its id with a higher generation, so none of its records can
/// count for the newcomer). A named volume of another size is refused, as by [`find_volume`].
/// Returns each volume's index in the table, in the order given.
pub fn ensure_volumes(
    sb: &mut Superblock,
    wanted: &[(String, u64)],
) -> Result<Vec<usize>, StoreError> {
    let mut out = Vec::with_capacity(wanted.len());
    for (name, size) in wanted {
        if name.len() > superblock::MAX_NAME {
            return Err(StoreError::Geometry(format!(
                "volume name {name:?} is longer than {} bytes",
                superblock::MAX_NAME
            )));
        }
        match find_volume(sb, name, *size) {
            Ok(i) => {
                out.push(i);
                continue;
            }
            Err(StoreError::Foreign(m)) if sb.volumes.iter().any(|v| &v.name == name) => {
                return Err(StoreError::Foreign(m))
            }
            Err(_) => {}
        }
        let fresh = Volume {
            id: 0,
            generation: 1,
            source_size: *size,
            name: name.clone(),
            identity: [0; superblock::IDENTITY_BYTES],
            detached: false,
            writeback: false,
        };
        if sb.volumes.len() < superblock::MAX_VOLUMES {
            let id = sb.volumes.iter().map(|v| v.id).max().unwrap_or(0) + 1;
            sb.volumes.push(Volume { id, ..fresh });
            out.push(sb.volumes.len() - 1);
            continue;
        }
        let spare = (0..sb.volumes.len())
            .find(|i| !wanted.iter().any(|(n, _)| *n == sb.volumes[*i].name))
            .ok_or_else(|| {
                StoreError::Geometry(format!(
                    "the volume table is full ({} volumes)",
                    superblock::MAX_VOLUMES
                ))
            })?;
        let old = &sb.volumes[spare];
        sb.volumes[spare] = Volume {
            id: old.id,
            generation: old.generation.wrapping_add(1),
            ..fresh
        };
        out.push(spare);
    }
    Ok(out)
}

/// Which volume of the table `name`/`size` is, or why it is none.
pub fn find_volume(sb: &Superblock, name: &str, size: u64) -> Result<usize, StoreError> {
    match sb.volumes.iter().position(|v| v.name == name) {
        Some(i) if sb.volumes[i].source_size == size => Ok(i),
        Some(i) => Err(StoreError::Foreign(format!(
            "{} of {} bytes, not {size}",
            name, sb.volumes[i].source_size
        ))),
        None => Err(StoreError::Foreign(
            sb.volumes
                .iter()
                .map(|v| v.name.clone())
                .collect::<Vec<_>>()
                .join(", "),
        )),
    }
}

/// Dirty (write-back) data a device holds for one volume of its table: pages only the cache
/// holds, and pages whose only copy was lost (reads of them fail).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct VolumeDirt {
    /// The volume's name in the table.
    pub name: String,
    /// Dirty pages (4 KiB).
    pub dirty: u64,
    /// Lost pages (4 KiB).
    pub lost: u64,
}

/// The dirty and lost pages of each volume of `sb`'s table (`only`: of the volumes it
/// accepts), as a start would restore them: what a reformat, a start that leaves a volume
/// out, or a format would throw away. Volumes with none are left out.
pub fn dirty_by_volume(
    dev: &dyn sce_io::BlockDevice,
    sb: &Superblock,
    only: impl Fn(&Volume) -> bool,
) -> Result<Vec<VolumeDirt>, StoreError> {
    let mut out = Vec::new();
    let logged = log_dirt(dev, sb)?;
    for (i, v) in sb.volumes.iter().enumerate().filter(|(_, v)| only(v)) {
        let frags = v.source_size.div_ceil(sb.layout.fragment_size);
        let r = crate::load(dev, sb.clone(), i, frags)?.report;
        let (ld, ll) = logged.get(&(v.id as u32)).copied().unwrap_or_default();
        if r.pages_dirty + r.dirty_pages_lost + ld + ll > 0 {
            out.push(VolumeDirt {
                name: v.name.clone(),
                dirty: r.pages_dirty + ld,
                lost: r.dirty_pages_lost + ll,
            });
        }
    }
    Ok(out)
}

/// Per volume id, the dirty and lost pages the write-back log holds (format 6), as a
/// start would replay them. A log that cannot be replayed counts as holding an unknown
/// amount: the caller is refused, naming it.
fn log_dirt(
    dev: &dyn sce_io::BlockDevice,
    sb: &Superblock,
) -> Result<std::collections::HashMap<u32, (u64, u64)>, StoreError> {
    let mut out = std::collections::HashMap::<u32, (u64, u64)>::new();
    let Some(log) = &sb.log else {
        return Ok(out);
    };
    let r = crate::wblog::replay(dev, log.region(&sb.layout), &log.key, log.anchor())?;
    if r.anchor_missing() || r.last_seq < log.durable_seq {
        return Err(StoreError::DirtyData(
            "the write-back log is damaged: the dirty data it held cannot be counted".into(),
        ));
    }
    for ((volume, _), _) in r.index.iter() {
        out.entry(volume).or_default().0 += 1;
    }
    for &(volume, _) in &r.lost {
        out.entry(volume).or_default().1 += 1;
    }
    Ok(out)
}

/// Refuses to drop the dirty data of `dirt` unless each volume is named in `discard` (or
/// `discard` holds "all"): `action` says what would drop it. Names the volumes, the counts
/// and what to do. The caller logs, at ERROR, what it then drops.
pub fn refuse_dirty_drop(
    dirt: &[VolumeDirt],
    discard: &[String],
    action: &str,
) -> Result<(), StoreError> {
    let kept: Vec<&VolumeDirt> = dirt
        .iter()
        .filter(|d| !discard.iter().any(|x| x == "all" || *x == d.name))
        .collect();
    let Some(first) = kept.first() else {
        return Ok(());
    };
    let list: Vec<String> = kept
        .iter()
        .map(|d| format!("{:?} ({} dirty, {} lost pages)", d.name, d.dirty, d.lost))
        .collect();
    Err(StoreError::DirtyData(format!(
        "{action} would drop write-back data that only the cache device holds: {}. Serve it \
         with --mode writeback and run `sce ctl flush --to-source` first, or, to give that \
         data up, pass --discard-dirty {:?} (or --discard-dirty all)",
        list.join(", "),
        first.name
    )))
}
