//! The superblock and its volume table. Two copies (A at 0, B at 4 KiB) are written in turn,
//! each with a sequence number and a checksum, so a torn superblock write leaves the other
//! copy intact; loading takes the valid copy with the higher sequence number.

use crate::layout::{Layout, BLOCK};
use crate::StoreError;

/// First bytes of a superblock.
pub const MAGIC: [u8; 8] = *b"SCECACHE";
/// The on-device format version this build writes for a device without a write-back log
/// (one an older build can still read).
pub const FORMAT_VERSION: u32 = 5;
/// The format version of a device with a write-back log (`Superblock::log`): format 5 plus
/// the log's region and state (docs/FORMAT.md); 7 since the log's records may hold
/// tombstones, which a build that reads only 6 would skip; 8 since they may hold cleaned
/// entries and keep their second copies in the log's mirror area; 9 since its ring may lend
/// chunks of the read slots (`wblog::Lend`), which an older build would take for read data.
/// This build reads 5 to 9, and writes 9 for a device with a log (so an older build refuses
/// it rather than misread it).
pub const LOG_FORMAT_VERSION: u32 = 9;
/// The first format version with a write-back log (6: before tombstones).
pub const LOG_FORMAT_VERSION_FIRST: u32 = 6;
/// The least write-back log region (1 MiB).
pub const MIN_LOG_BLOCKS: u64 = 256;
/// Where the log's fields start (format 6; zero on format 5).
const LOG_AT: usize = 184;
/// Volume table entries a superblock holds.
pub const MAX_VOLUMES: usize = 16;
/// Longest volume name, in bytes.
pub const MAX_NAME: usize = 110;

const VOLUMES_AT: usize = 256;
const VOLUME_ENTRY: usize = 128;
/// Where the per-volume source identities start (16 bytes each, after the volume table).
const IDENTITIES_AT: usize = VOLUMES_AT + 8 + MAX_VOLUMES * VOLUME_ENTRY;
/// Bytes of a source identity.
pub const IDENTITY_BYTES: usize = 16;

/// What the superblock says about how the device was left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceState {
    /// Shut down cleanly: every record is current and no intent is set.
    Clean,
    /// In use, or crashed while in use.
    Open,
    /// Disabled after device errors; its contents must not be trusted.
    Failed,
}

/// A volume table entry: a source volume whose fragments this device caches.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Volume {
    /// Small id stored in slot entries.
    pub id: u16,
    /// Generation: slot entries of an older generation are invalid. Forgetting a volume bumps
    /// it, which invalidates all its fragments at once.
    pub generation: u32,
    /// Size of the source in bytes.
    pub source_size: u64,
    /// The source's name (path or URI, as given to `sce serve`).
    pub name: String,
    /// A 128-bit hash of what identified the source's content version when the device last
    /// recorded it (file: device, inode, size, modification and change times; block device:
    /// major:minor and serial; NBD: export and size, plus an operator's generation string).
    /// All zero: unknown. A start that finds another identity invalidates the volume.
    #[serde(serialize_with = "ser_hex")]
    pub identity: [u8; IDENTITY_BYTES],
    /// The cache was detached from this volume's source while the server went on serving
    /// it (`sce ctl detach`): writes may have reached the source that the cache never saw,
    /// so a start drops what the device holds for it (an attach that knows nothing was
    /// written clears the flag first). Bit 1 of the entry's flags.
    pub detached: bool,
    /// The volume was served in write-back: the device may hold the only copy of some of
    /// its data. Metadata damage that cannot be located (both copies of a unit, a journal
    /// block of an earlier commit) then refuses a start instead of dropping what the damaged
    /// structure held. Set by a write-back start, cleared only by a format. Bit 2.
    pub writeback: bool,
}

/// Flags of a volume entry: bit 0 is always set (an entry in use).
const FLAG_IN_USE: u16 = 1;
/// Flags of a volume entry: the cache was detached from the volume.
const FLAG_DETACHED: u16 = 2;
/// Flags of a volume entry: the volume was served in write-back (its records and journal
/// may hold the only copy of data), so metadata damage that cannot be located refuses a
/// start rather than dropping what it held.
const FLAG_WRITEBACK: u16 = 4;

fn ser_hex<S: serde::Serializer>(u: &[u8; IDENTITY_BYTES], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&u.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// The write-back log's region and state (format 6): the region is `blocks` 4 KiB blocks
/// right after the rest of the layout, at `layout.cache_size` (`LogInfo::offset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LogInfo {
    /// 4 KiB blocks of the log region.
    pub blocks: u64,
    /// The secret the log's commit records are checksummed with, so that client data
    /// written into the log can never pass for one (never shown).
    #[serde(skip)]
    pub key: [u8; 16],
    /// Where replay starts: the position of a commit record known durable (or, for an
    /// empty log, where it begins)...
    pub anchor_lpos: u64,
    /// ...and that record's sequence number (for an empty log, the next one).
    pub anchor_seq: u64,
    /// The anchor is a commit record (else: an empty log from there).
    pub anchor_commit: bool,
    /// The newest commit sequence number known durable when this superblock was written: a
    /// replay that ends before it met damage, not the end of the log.
    pub durable_seq: u64,
    /// Blocks at the end of the region that are its mirror area (second copies of commit
    /// records; format 8). 0: none (format 6 and 7, whose records keep both copies side by
    /// side in the ring).
    pub mirror_blocks: u64,
    /// Chunks of read slots the ring may lend (format 9; 0: none), and their size in 4 KiB
    /// blocks (`wblog::Lend`).
    pub lend_chunks: u64,
    /// Blocks per lendable chunk.
    pub lend_chunk_blocks: u64,
    /// Chunks lent now (the last ones of each lap): replay reads them, a start keeps their
    /// slots out of the read cache. Raised before a lap uses one more, lowered once no lap
    /// a replay may read uses it.
    pub lent: u64,
}

impl LogInfo {
    /// The device offset of the log region on a device of layout `l`.
    pub fn offset(l: &Layout) -> u64 {
        l.cache_size.div_ceil(BLOCK) * BLOCK
    }

    /// The log's region on a device of layout `l`: its ring, and its mirror area (the last
    /// `mirror_blocks` blocks) if it has one.
    pub fn region(&self, l: &Layout) -> crate::wblog::LogRegion {
        let offset = Self::offset(l);
        let ring = self.blocks - self.mirror_blocks;
        crate::wblog::LogRegion {
            offset,
            blocks: ring,
            mirror_offset: if self.mirror_blocks > 0 {
                offset + ring * BLOCK
            } else {
                0
            },
            mirror_blocks: self.mirror_blocks,
            lend: self.lend(l),
        }
    }

    /// The lendable chunks on a device of layout `l` (in its slot area).
    pub fn lend(&self, l: &Layout) -> crate::wblog::Lend {
        if self.lend_chunks == 0 {
            return crate::wblog::Lend::default();
        }
        crate::wblog::Lend {
            chunks: self.lend_chunks,
            chunk_blocks: self.lend_chunk_blocks,
            area_offset: l.data_offset,
            area_slots: l.slots as u64,
            slot_bytes: l.fragment_size,
        }
    }

    /// Where replay starts.
    pub fn anchor(&self) -> crate::wblog::Anchor {
        if self.anchor_commit {
            crate::wblog::Anchor::Commit {
                lpos: self.anchor_lpos,
                seq: self.anchor_seq,
            }
        } else {
            crate::wblog::Anchor::Empty {
                lpos: self.anchor_lpos,
                next_seq: self.anchor_seq.max(1),
            }
        }
    }

    /// Records `a` as where replay starts.
    pub fn set_anchor(&mut self, a: crate::wblog::Anchor) {
        self.anchor_lpos = a.lpos();
        self.anchor_seq = a.seq();
        self.anchor_commit = matches!(a, crate::wblog::Anchor::Commit { .. });
    }
}

/// The decoded superblock.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Superblock {
    /// Format version.
    pub version: u32,
    /// Write counter; the copy with the higher one wins.
    pub seq: u64,
    /// The device's identity; units carry it, so units of another device are rejected.
    #[serde(serialize_with = "ser_uuid")]
    pub uuid: [u8; 16],
    /// Geometry.
    pub layout: Layout,
    /// How the device was left.
    pub state: DeviceState,
    /// Unix seconds when formatted.
    pub created: u64,
    /// Unix seconds of the last clean shutdown (0: never).
    pub last_clean_shutdown: u64,
    /// Unix seconds of the last start.
    pub last_open: u64,
    /// Clean shutdowns so far.
    pub clean_shutdowns: u64,
    /// Starts that found the device not cleanly shut down.
    pub unclean_starts: u64,
    /// The write journal's tail: journal blocks with a lower sequence number are no longer
    /// needed (the records they vouch for were durable when it was written) and are ignored
    /// at load.
    pub journal_tail: u64,
    /// Write-back: every dirty journal entry in a block below this sequence number belongs
    /// to a write whose data was made durable by a completed flush (an NBD FLUSH or FUA
    /// moves it up). At load, a page such an entry names that holds neither its new bytes
    /// nor a record's is damaged, not torn: it is lost, never the source's older bytes.
    pub journal_landed: u64,
    /// Not stored: the other copy was found damaged when this one was read, so this one may
    /// be one write older than the device's newest state (`read_superblock` sets it).
    #[serde(skip)]
    pub other_copy_damaged: bool,
    /// The volume table.
    pub volumes: Vec<Volume>,
    /// The write-back log (format 6), if the device was formatted with one.
    pub log: Option<LogInfo>,
}

fn ser_uuid<S: serde::Serializer>(u: &[u8; 16], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&uuid_string(u))
}

/// A UUID in the usual 8-4-4-4-12 hex form.
pub fn uuid_string(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

struct W<'a>(&'a mut [u8]);
impl W<'_> {
    fn u16(&mut self, at: usize, v: u16) {
        self.0[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, at: usize, v: u32) {
        self.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, at: usize, v: u64) {
        self.0[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
}

pub(crate) fn rd16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
pub(crate) fn rd32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub(crate) fn rd64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Offset of the checksum field; the checksum is computed with it zeroed.
const CRC_AT: usize = 12;

impl Superblock {
    /// Encodes into one 4 KiB block.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK as usize];
        b[0..8].copy_from_slice(&MAGIC);
        let mut w = W(&mut b);
        // A device with a log is written as the newest log format, whatever it was read as.
        let version = if self.log.is_some() {
            LOG_FORMAT_VERSION
        } else {
            self.version
        };
        w.u32(8, version);
        w.u64(16, self.seq);
        w.0[24..40].copy_from_slice(&self.uuid);
        let l = &self.layout;
        w.u64(40, l.cache_size);
        w.u64(48, l.fragment_size);
        w.u32(56, l.slots);
        w.u32(60, l.slots_per_unit);
        w.u32(64, l.unit_size);
        w.u32(68, l.entry_size);
        w.u64(72, l.intent_offset);
        w.u64(80, l.meta_offset);
        w.u64(88, l.data_offset);
        w.u32(
            96,
            match self.state {
                DeviceState::Clean => 0,
                DeviceState::Open => 1,
                DeviceState::Failed => 2,
            },
        );
        w.u32(100, l.units);
        w.u64(104, self.created);
        w.u64(112, self.last_clean_shutdown);
        w.u64(120, self.last_open);
        w.u64(128, self.clean_shutdowns);
        w.u64(136, self.unclean_starts);
        w.u32(144, l.intent_blocks);
        w.u32(148, l.pages_per_fragment);
        w.u64(152, l.journal_offset);
        w.u32(160, l.journal_blocks);
        w.u64(168, self.journal_tail);
        w.u64(176, self.journal_landed);
        if let Some(log) = &self.log {
            w.u64(LOG_AT, log.blocks);
            w.0[LOG_AT + 8..LOG_AT + 24].copy_from_slice(&log.key);
            w.u64(LOG_AT + 24, log.anchor_lpos);
            w.u64(LOG_AT + 32, log.anchor_seq);
            w.u64(LOG_AT + 40, log.durable_seq);
            w.u64(LOG_AT + 48, log.anchor_commit as u64);
            w.u64(LOG_AT + 56, log.mirror_blocks);
            w.u32(LOG_AT + 64, log.lend_chunk_blocks as u32);
            w.u16(LOG_AT + 68, log.lend_chunks as u16);
            w.u16(LOG_AT + 70, log.lent as u16);
        }
        w.u32(VOLUMES_AT, self.volumes.len() as u32);
        for (i, v) in self.volumes.iter().enumerate().take(MAX_VOLUMES) {
            let at = VOLUMES_AT + 8 + i * VOLUME_ENTRY;
            w.u16(at, v.id);
            w.u16(
                at + 2,
                FLAG_IN_USE
                    | if v.detached { FLAG_DETACHED } else { 0 }
                    | if v.writeback { FLAG_WRITEBACK } else { 0 },
            );
            w.u32(at + 4, v.generation);
            w.u64(at + 8, v.source_size);
            let name = &v.name.as_bytes()[..v.name.len().min(MAX_NAME)];
            w.u16(at + 16, name.len() as u16);
            w.0[at + 18..at + 18 + name.len()].copy_from_slice(name);
            let id_at = IDENTITIES_AT + i * IDENTITY_BYTES;
            w.0[id_at..id_at + IDENTITY_BYTES].copy_from_slice(&v.identity);
        }
        let crc = crc32c::crc32c(&b);
        b[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes one copy. Every failure says what is wrong.
    pub fn decode(b: &[u8]) -> Result<Superblock, StoreError> {
        if b.len() < BLOCK as usize {
            return Err(StoreError::Corrupt("superblock shorter than 4 KiB".into()));
        }
        let b = &b[..BLOCK as usize];
        if b[0..8] != MAGIC {
            return Err(StoreError::NotFormatted);
        }
        let version = rd32(b, 8);
        let stored = rd32(b, CRC_AT);
        let mut copy = b.to_vec();
        copy[CRC_AT..CRC_AT + 4].fill(0);
        let crc_ok = crc32c::crc32c(&copy) == stored;
        if version > LOG_FORMAT_VERSION && version < 1 << 16 {
            // A newer format may checksum differently: report the version, not corruption.
            return Err(StoreError::Version(version));
        }
        if !crc_ok {
            return Err(StoreError::Corrupt("superblock checksum mismatch".into()));
        }
        let log_format = (LOG_FORMAT_VERSION_FIRST..=LOG_FORMAT_VERSION).contains(&version);
        if version != FORMAT_VERSION && !log_format {
            if (1..FORMAT_VERSION).contains(&version) {
                return Err(StoreError::OldVersion(version));
            }
            return Err(StoreError::Corrupt(format!("format version {version}")));
        }
        let state = match rd32(b, 96) {
            0 => DeviceState::Clean,
            1 => DeviceState::Open,
            2 => DeviceState::Failed,
            n => return Err(StoreError::Corrupt(format!("unknown device state {n}"))),
        };
        let layout = decode_layout(b)?;
        let volumes = decode_volumes(b)?;
        let log = decode_log(b, version)?;
        if let Some(l) = &log {
            l.lend(&layout).check().map_err(StoreError::Corrupt)?;
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[24..40]);
        Ok(Superblock {
            version,
            seq: rd64(b, 16),
            uuid,
            layout,
            state,
            created: rd64(b, 104),
            last_clean_shutdown: rd64(b, 112),
            last_open: rd64(b, 120),
            clean_shutdowns: rd64(b, 128),
            unclean_starts: rd64(b, 136),
            journal_tail: rd64(b, 168),
            journal_landed: rd64(b, 176),
            other_copy_damaged: false,
            volumes,
            log,
        })
    }

    /// The device offset the copy with sequence number `seq` goes to.
    pub fn copy_offset(seq: u64) -> u64 {
        (seq % 2) * BLOCK
    }
}

/// The stored geometry, checked against the one computed from the sizes.
fn decode_layout(b: &[u8]) -> Result<Layout, StoreError> {
    let cache_size = rd64(b, 40);
    let fragment_size = rd64(b, 48);
    let expect = Layout::compute(cache_size, fragment_size)
        .map_err(|e| StoreError::Corrupt(format!("superblock geometry: {e}")))?;
    let layout = Layout {
        cache_size,
        fragment_size,
        pages_per_fragment: rd32(b, 148),
        slots: rd32(b, 56),
        entry_size: rd32(b, 68),
        unit_size: rd32(b, 64),
        slots_per_unit: rd32(b, 60),
        units: rd32(b, 100),
        intent_offset: rd64(b, 72),
        intent_blocks: rd32(b, 144),
        journal_offset: rd64(b, 152),
        journal_blocks: rd32(b, 160),
        meta_offset: rd64(b, 80),
        data_offset: rd64(b, 88),
    };
    if layout != expect {
        return Err(StoreError::Corrupt(format!(
            "superblock geometry is inconsistent: stored {layout:?}, computed {expect:?}"
        )));
    }
    Ok(layout)
}

/// The write-back log's fields: present on formats 6 to 8 (with a region), absent on 5.
fn decode_log(b: &[u8], version: u32) -> Result<Option<LogInfo>, StoreError> {
    if version < LOG_FORMAT_VERSION_FIRST {
        return Ok(None);
    }
    let blocks = rd64(b, LOG_AT);
    if blocks == 0 {
        return Err(StoreError::Corrupt(format!(
            "format {version} superblock without a write-back log region"
        )));
    }
    let mirror_blocks = if version >= 8 {
        rd64(b, LOG_AT + 56)
    } else {
        0
    };
    if mirror_blocks >= blocks || blocks - mirror_blocks < crate::wblog::MIN_LOG_BLOCKS {
        return Err(StoreError::Corrupt(format!(
            "a write-back log of {blocks} blocks with a mirror area of {mirror_blocks}"
        )));
    }
    // Zero before format 9 (the field was unused).
    let (lend_chunk_blocks, lend_chunks, lent) = if version >= 9 {
        (
            rd32(b, LOG_AT + 64) as u64,
            rd16(b, LOG_AT + 68) as u64,
            rd16(b, LOG_AT + 70) as u64,
        )
    } else {
        (0, 0, 0)
    };
    if lent > lend_chunks || (lend_chunks > 0 && lend_chunk_blocks == 0) {
        return Err(StoreError::Corrupt(format!(
            "a write-back log lending {lent} of {lend_chunks} chunks of {lend_chunk_blocks} blocks"
        )));
    }
    let mut key = [0u8; 16];
    key.copy_from_slice(&b[LOG_AT + 8..LOG_AT + 24]);
    Ok(Some(LogInfo {
        blocks,
        key,
        anchor_lpos: rd64(b, LOG_AT + 24),
        anchor_seq: rd64(b, LOG_AT + 32),
        durable_seq: rd64(b, LOG_AT + 40),
        anchor_commit: rd64(b, LOG_AT + 48) & 1 != 0,
        // Zero before format 8 (the field was unused).
        mirror_blocks,
        lend_chunks,
        lend_chunk_blocks,
        lent,
    }))
}

/// The volume table.
fn decode_volumes(b: &[u8]) -> Result<Vec<Volume>, StoreError> {
    let n = rd32(b, VOLUMES_AT) as usize;
    if n > MAX_VOLUMES {
        return Err(StoreError::Corrupt(format!(
            "{n} volumes in the volume table"
        )));
    }
    let mut volumes = Vec::with_capacity(n);
    for i in 0..n {
        let at = VOLUMES_AT + 8 + i * VOLUME_ENTRY;
        let len = rd16(b, at + 16) as usize;
        if len > MAX_NAME {
            return Err(StoreError::Corrupt(format!(
                "volume {i}: name of {len} bytes"
            )));
        }
        let name = String::from_utf8(b[at + 18..at + 18 + len].to_vec())
            .map_err(|_| StoreError::Corrupt(format!("volume {i}: name is not UTF-8")))?;
        let id_at = IDENTITIES_AT + i * IDENTITY_BYTES;
        let mut identity = [0u8; IDENTITY_BYTES];
        identity.copy_from_slice(&b[id_at..id_at + IDENTITY_BYTES]);
        volumes.push(Volume {
            id: rd16(b, at),
            generation: rd32(b, at + 4),
            source_size: rd64(b, at + 8),
            name,
            identity,
            detached: rd16(b, at + 2) & FLAG_DETACHED != 0,
            writeback: rd16(b, at + 2) & FLAG_WRITEBACK != 0,
        });
    }
    Ok(volumes)
}
