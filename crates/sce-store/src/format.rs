//! Formatting a cache device: a new UUID, a fresh superblock, an empty intent bitmap, and
//! (format 6) a write-back log region taken from the end of the device.

use crate::layout::{Layout, BLOCK};
use crate::superblock::{self, DeviceState, Superblock, Volume, FORMAT_VERSION};
use crate::{unix_now, write_superblock, StoreError};
use sce_io::{AlignedBuf, BlockDevice};

/// How to format a device.
#[derive(Clone, Debug)]
pub struct FormatOptions {
    /// Fragment size.
    pub fragment_size: u64,
    /// The source volume the device will cache.
    pub volume: Volume,
    /// Use only this many bytes of the device (default: all of it).
    pub size: Option<u64>,
    /// Bytes of them to give a write-back log (format 6; 0: none, format 5), taken from
    /// the end: the slots and their metadata get the rest.
    pub log_bytes: u64,
    /// Bytes of the read slots the log may lend when dirty data outgrows its own region
    /// (format 9, `wblog::Lend`; 0: none). Ignored without a log.
    pub lend_bytes: u64,
}

/// Formats `dev` over the superblock `old` found on it. Both copies of `old` are first
/// written again with every volume's generation bumped, so that a crash inside the format
/// (which clears the intent bitmap before it writes the new superblock) never leaves a
/// superblock whose clean records a load would trust without their intents: what survives
/// is the new superblock or one under which every clean record is stale. (Dirty claims are
/// loaded whatever their generation: a start finds them again and drains them again.)
pub fn reformat(
    dev: &dyn BlockDevice,
    old: &Superblock,
    opts: &FormatOptions,
) -> Result<Superblock, StoreError> {
    let mut sb = old.clone();
    for v in &mut sb.volumes {
        v.generation = v.generation.wrapping_add(1);
    }
    for _ in 0..2 {
        sb.seq += 1;
        write_superblock(dev, &sb)?;
    }
    format(dev, opts)
}

/// A new log's superblock fields: `blocks` of region (none if 0), a random key, an empty
/// log from position 0, lending `lend`'s chunks (none lent yet).
fn new_log(blocks: u64, lend: crate::wblog::Lend) -> Option<superblock::LogInfo> {
    (blocks > 0).then(|| {
        let mut key = [0u8; 16];
        rand::Rng::fill(&mut rand::thread_rng(), &mut key[..]);
        superblock::LogInfo {
            blocks,
            key,
            anchor_lpos: 0,
            anchor_seq: 1,
            durable_seq: 0,
            anchor_commit: false,
            mirror_blocks: crate::wblog::LogRegion::mirror_for(blocks),
            lend_chunks: lend.chunks,
            lend_chunk_blocks: lend.chunk_blocks,
            lent: 0,
        }
    })
}

/// Formats `dev`: a new UUID, a fresh superblock (both copies), an empty intent bitmap.
/// Old metadata units and journal blocks are not erased: they carry the old UUID and are
/// rejected as foreign.
pub fn format(dev: &dyn BlockDevice, opts: &FormatOptions) -> Result<Superblock, StoreError> {
    let size = opts.size.unwrap_or(dev.size()).min(dev.size());
    let size = size - size % BLOCK;
    let log_blocks = opts.log_bytes / BLOCK;
    if log_blocks > 0 && log_blocks < superblock::MIN_LOG_BLOCKS {
        return Err(StoreError::Geometry(format!(
            "a write-back log of {} bytes is smaller than the least, {} bytes",
            opts.log_bytes,
            superblock::MIN_LOG_BLOCKS * BLOCK
        )));
    }
    let rest = size.checked_sub(log_blocks * BLOCK).ok_or_else(|| {
        StoreError::Geometry(format!(
            "a write-back log of {} bytes does not fit a device of {size}",
            opts.log_bytes
        ))
    })?;
    let layout = Layout::compute(rest, opts.fragment_size)?;
    if opts.volume.name.len() > superblock::MAX_NAME {
        return Err(StoreError::Geometry(format!(
            "the source name is longer than {} bytes",
            superblock::MAX_NAME
        )));
    }
    let lend = crate::wblog::Lend::laid_out(
        opts.lend_bytes,
        layout.data_offset,
        layout.slots as u64,
        layout.fragment_size,
    );
    let mut uuid = [0u8; 16];
    rand::Rng::fill(&mut rand::thread_rng(), &mut uuid[..]);
    let zero = AlignedBuf::new(BLOCK as usize * 64);
    let end = layout.intent_offset + layout.intent_blocks as u64 * BLOCK;
    let mut at = layout.intent_offset;
    while at < end {
        let n = (end - at).min(zero.len() as u64);
        dev.write_at(at, &zero[..n as usize])?;
        at += n;
    }
    let now = unix_now();
    let sb = Superblock {
        version: if log_blocks > 0 {
            superblock::LOG_FORMAT_VERSION
        } else {
            FORMAT_VERSION
        },
        seq: 1,
        uuid,
        layout,
        state: DeviceState::Clean,
        created: now,
        last_clean_shutdown: 0,
        last_open: 0,
        clean_shutdowns: 0,
        unclean_starts: 0,
        journal_tail: 0,
        journal_landed: 0,
        other_copy_damaged: false,
        volumes: vec![opts.volume.clone()],
        log: new_log(log_blocks, lend),
    };
    // Write copy B (seq 1) and then A (seq 2), so both are valid and A wins.
    write_superblock(dev, &sb)?;
    let mut sb2 = sb.clone();
    sb2.seq = 2;
    write_superblock(dev, &sb2)?;
    Ok(sb2)
}
