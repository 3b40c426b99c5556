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
    // The log's dirty data, as a start would replay it. A log that cannot be replayed in
    // full holds an unknown amount: the caller is refused, naming it.
    let logged = check_log(dev, sb)?.unwrap_or_default();
    if logged.short {
        return Err(StoreError::DirtyData(
            "the write-back log is damaged: the dirty data it held cannot be counted".into(),
        ));
    }
    for (i, v) in sb.volumes.iter().enumerate().filter(|(_, v)| only(v)) {
        let frags = v.source_size.div_ceil(sb.layout.fragment_size);
        let r = crate::load(dev, sb.clone(), i, frags)?.report;
        let (ld, ll) = (logged.volumes.iter())
            .find(|x| x.0 == v.name)
            .map_or((0, 0), |x| (x.1, x.2));
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

/// True if `--discard-dirty` (`discard`: volume names, or "all") gives up the dirty data
/// of volume `name`.
pub fn gives_up(discard: &[String], name: &str) -> bool {
    discard.iter().any(|x| x == "all" || x == name)
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
        .filter(|d| !gives_up(discard, &d.name))
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

/// What `sce check` finds in the write-back log (format 6): the replay a start would do.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LogCheck {
    /// Bytes of the log region.
    pub bytes: u64,
    /// Commit records replayed from the anchor.
    pub commits: u64,
    /// The last replayed commit's sequence number.
    pub last_seq: u64,
    /// The newest commit the superblock records as durable: a replay that ends below it,
    /// or that cannot find its anchor commit, lost committed data (damage).
    pub durable_seq: u64,
    /// The replay fell short of `durable_seq`, or lost its anchor commit.
    pub short: bool,
    /// Entries of the last commits whose data did not match (torn or never written before a
    /// crash: their pages keep their older version; not damage).
    pub torn_skipped: u64,
    /// Per volume name: dirty pages the log holds, and lost ones (their newest committed
    /// version is damaged: reads of them fail).
    pub volumes: Vec<(String, u64, u64)>,
    /// A commit damaged in both copies with a sound later commit after it: (its seq, the
    /// later commit's seq). A start is refused (what it named cannot be told).
    pub broken: Option<(u64, u64)>,
    /// Commit records whose ring copy is damaged, read from their second copy.
    pub records_repaired: u64,
    /// Blocks of the log's mirror area (second copies of commit records; 0 before format 8).
    pub mirror_bytes: u64,
}

impl LogCheck {
    /// True if the log lost committed data.
    pub fn damaged(&self) -> bool {
        self.short || self.broken.is_some() || self.volumes.iter().any(|v| v.2 > 0)
    }
}

/// Replays the write-back log of `sb` (if it has one) as a start would, never writing.
pub fn check_log(
    dev: &dyn sce_io::BlockDevice,
    sb: &Superblock,
) -> Result<Option<LogCheck>, StoreError> {
    let Some(log) = &sb.log else {
        return Ok(None);
    };
    let region = log.region(&sb.layout);
    let r = crate::wblog::replay_lent(dev, region, &log.key, log.anchor(), log.lent)?;
    let mut per = std::collections::BTreeMap::<u32, (u64, u64)>::new();
    for ((volume, _), _) in r.index.iter() {
        per.entry(volume).or_default().0 += 1;
    }
    for &(volume, _) in &r.lost {
        per.entry(volume).or_default().1 += 1;
    }
    let name = |id: u32| {
        sb.volumes.iter().find(|v| v.id as u32 == id).map_or_else(
            || format!("volume id {id} (not in the table)"),
            |v| v.name.clone(),
        )
    };
    Ok(Some(LogCheck {
        bytes: (region.blocks + region.mirror_blocks) * crate::wblog::LOG_BLOCK,
        commits: r.commits,
        last_seq: r.last_seq,
        durable_seq: log.durable_seq,
        short: r.anchor_missing() || r.last_seq < log.durable_seq,
        torn_skipped: r.skipped,
        broken: r.broken.map(|b| (b.missing, b.evidence)),
        records_repaired: r.repaired,
        mirror_bytes: region.mirror_blocks * crate::wblog::LOG_BLOCK,
        volumes: per
            .into_iter()
            .map(|(id, (d, l))| (name(id), d, l))
            .collect(),
    }))
}

/// Refuses a start that would give a new volume (of `wanted`) the place of a volume in a
/// table that is full (or that the newcomers fill) while the write-back log still holds pages of a volume `wanted` leaves out:
/// the newcomer takes that volume's id, and the log's pages name volumes by id. (With room
/// in the table a newcomer gets a fresh id; `--discard-dirty` then drops the log's pages of
/// the volumes left out before anything is served.)
pub fn refuse_reusing_logged_volume(
    dev: &dyn sce_io::BlockDevice,
    sb: &Superblock,
    wanted: &[(String, u64)],
) -> Result<(), StoreError> {
    let newcomers = (wanted.iter())
        .filter(|w| sb.volumes.iter().all(|v| v.name != w.0))
        .count();
    // A newcomer takes a place given up only once the table is full: the ones before it
    // take fresh ids.
    if sb.log.is_none() || newcomers == 0 || sb.volumes.len() + newcomers <= superblock::MAX_VOLUMES
    {
        return Ok(());
    }
    let logged = check_log(dev, sb)?.unwrap_or_default();
    let left_out = |name: &str| wanted.iter().all(|w| w.0 != name);
    match logged.volumes.iter().find(|v| left_out(&v.0)) {
        Some(v) => Err(StoreError::DirtyData(format!(
            "the volume table is full ({} volumes) and a new volume would take the place of \
             one this start leaves out, while the write-back log still holds {} dirty pages of \
             {:?}: serve it and run `sce ctl flush --to-source` first",
            superblock::MAX_VOLUMES,
            v.1 + v.2,
            v.0
        ))),
        None => Ok(()),
    }
}
