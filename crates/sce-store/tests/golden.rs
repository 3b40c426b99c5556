//! Pins the on-device format: the version, a golden superblock, the layout arithmetic; and
//! checks that damaged superblocks give clear errors, never a panic.

use sce_io::{AlignedBuf, BlockDevice, MemDevice};
use sce_store::superblock::MAGIC;
use sce_store::{
    read_superblock, DeviceState, Layout, StoreError, Superblock, Volume, FORMAT_VERSION,
};

fn golden() -> Superblock {
    Superblock {
        version: FORMAT_VERSION,
        seq: 7,
        uuid: *b"0123456789abcdef",
        layout: Layout::compute(1 << 30, 1 << 20).unwrap(),
        state: DeviceState::Clean,
        created: 1_700_000_000,
        last_clean_shutdown: 1_700_000_100,
        last_open: 1_700_000_050,
        clean_shutdowns: 3,
        unclean_starts: 1,
        journal_tail: 77,
        journal_landed: 75,
        other_copy_damaged: false,
        volumes: vec![Volume {
            id: 1,
            generation: 2,
            source_size: 100 << 30,
            name: "/dev/mapper/san-lun7".into(),
            identity: *b"fedcba9876543210",
            detached: false,
            writeback: false,
        }],
        log: None,
    }
}

/// CRC-32C of the whole format 8 superblock image of `a_device_with_a_write_back_log_is_format_8`.
const GOLDEN_LOG_CRC: u32 = 0x12b2_111e;

#[test]
fn format_version_and_golden_superblock() {
    assert_eq!(
        FORMAT_VERSION, 5,
        "a format change must bump the version and the golden image"
    );
    let img = golden().encode();
    assert_eq!(img.len(), 4096);
    assert_eq!(&img[0..8], &MAGIC);
    assert_eq!(&img[8..12], &5u32.to_le_bytes());
    // The whole image, pinned by its CRC-32C: any change to the encoding shows here.
    assert_eq!(
        crc32c::crc32c(&img),
        0xb8d9_6c57,
        "the superblock encoding changed: bump FORMAT_VERSION and update docs/FORMAT.md"
    );
    assert_eq!(Superblock::decode(&img).unwrap(), golden());
}

#[test]
fn layout_arithmetic_is_pinned() {
    let l = Layout::compute(1 << 30, 1 << 20).unwrap();
    assert_eq!(
        (l.entry_size, l.unit_size, l.slots_per_unit),
        (1104, 4096, 3)
    );
    assert_eq!((l.slots, l.units, l.intent_blocks), (1017, 339, 1));
    // The write journal: 1/256 of the device, at most 4 MiB, after the intent bitmap.
    assert_eq!((l.journal_offset, l.journal_blocks), (12288, 1024));
    assert_eq!((l.meta_offset, l.data_offset), (12288 + (4 << 20), 7 << 20));
    let small = Layout::compute(64 << 20, 1 << 20).unwrap();
    assert_eq!(small.journal_blocks, 64);
    let tiny = Layout::compute(2 << 20, 64 << 10).unwrap();
    assert_eq!(tiny.journal_blocks, 16);
    assert!(l.data_offset + l.data_bytes() <= 1 << 30);
    let s = Layout::compute(1 << 30, 4096).unwrap();
    assert_eq!((s.entry_size, s.slots_per_unit), (36, 112));
    assert!(s.data_offset + s.data_bytes() <= 1 << 30);
    assert!(Layout::compute(1 << 20, 1 << 20).is_err());
    assert!(Layout::compute(1 << 30, 3000).is_err());
}

fn device_with(sb: &Superblock) -> MemDevice {
    let d = MemDevice::new(1 << 30);
    let mut b = AlignedBuf::new(4096);
    for seq in [sb.seq, sb.seq + 1] {
        let mut s = sb.clone();
        s.seq = seq;
        b.copy_from_slice(&s.encode());
        d.write_at(Superblock::copy_offset(seq), &b).unwrap();
    }
    d
}

#[test]
fn every_damaged_byte_gives_an_error_or_the_other_copy_never_a_panic() {
    let sb = golden();
    let d = device_with(&sb);
    assert_eq!(read_superblock(&d).unwrap().seq, 8);
    let mut b = AlignedBuf::new(8192);
    d.read_at(0, &mut b).unwrap();
    let clean = b.to_vec();
    for i in 0..8192 {
        for flip in [0x01u8, 0x80, 0xff] {
            b.copy_from_slice(&clean);
            b[i] ^= flip;
            // One copy damaged: the other one serves.
            d.write_at(0, &b).unwrap();
            let got = read_superblock(&d).unwrap();
            assert!(got.seq == 7 || got.seq == 8);
            // Both damaged at the same byte: a clear error.
            let j = (i + 4096) % 8192;
            b[j] ^= flip;
            d.write_at(0, &b).unwrap();
            if let Err(e) = read_superblock(&d) {
                let m = e.to_string();
                assert!(
                    m.contains("corrupt") || m.contains("not an sce") || m.contains("version"),
                    "{m}"
                );
            }
        }
    }
}

#[test]
fn newer_version_foreign_and_blank_devices_are_named() {
    let mut sb = golden();
    sb.version = 10;
    let d = device_with(&sb);
    let e = read_superblock(&d).unwrap_err();
    assert!(matches!(e, StoreError::Version(10)), "{e}");
    assert!(e.to_string().contains("newer than this sce's 9"), "{e}");
    // Older devices (version 1: checksums not bound to their address; version 2: no write
    // journal; version 3: no dirty bitmaps, so it could not tell write-back data) are named
    // as older, and the message says how to go on. Version 4 has no mirror copies of its
    // units and journal blocks (its data starts where version 5 keeps the mirrors).
    for v in [1, 2, 3, 4] {
        let mut old = golden();
        old.version = v;
        let e = read_superblock(&device_with(&old)).unwrap_err();
        assert!(matches!(e, StoreError::OldVersion(x) if x == v), "{e}");
        let m = e.to_string();
        assert!(m.contains("older than this sce's 5"), "{m}");
        assert!(m.contains("--reformat"), "{m}");
    }
    let blank = MemDevice::new(1 << 20);
    assert!(matches!(
        read_superblock(&blank),
        Err(StoreError::NotFormatted)
    ));
    let tiny = MemDevice::new(4096);
    assert!(matches!(
        read_superblock(&tiny),
        Err(StoreError::NotFormatted)
    ));
    let sb = golden();
    let e = sce_store::find_volume(&sb, "/dev/other", 100 << 30).unwrap_err();
    assert!(e.to_string().contains("another source"), "{e}");
    let e = sce_store::find_volume(&sb, "/dev/mapper/san-lun7", 1 << 30).unwrap_err();
    assert!(e.to_string().contains("another source"), "{e}");
}

#[test]
fn page_checksums_are_bound_to_their_address() {
    let page = [0x5au8; 4096];
    let here = sce_store::page_checksum(&page, sce_store::page_seed(1, 10));
    assert_ne!(
        here,
        sce_store::page_checksum(&page, sce_store::page_seed(1, 11)),
        "the same bytes at the next page"
    );
    assert_ne!(
        here,
        sce_store::page_checksum(&page, sce_store::page_seed(2, 10)),
        "the same page of another volume"
    );
    assert_eq!(
        here,
        sce_store::page_checksum(&page, sce_store::page_seed(1, 10))
    );
}

#[test]
fn a_stray_bit_in_the_intent_padding_is_refused_by_load_and_check() {
    use sce_store::{format, FormatOptions};
    let d = MemDevice::new(64 << 20);
    let sb = format(
        &d,
        &FormatOptions {
            fragment_size: 1 << 20,
            volume: golden().volumes[0].clone(),
            size: None,
            log_bytes: 0,
            lend_bytes: 0,
        },
    )
    .unwrap();
    let l = sb.layout;
    assert!(
        !l.slots.is_multiple_of(64),
        "the test needs padding in the last word"
    );
    sce_store::check(&d, true).unwrap();
    // Set the first bit past the last slot.
    let mut block = AlignedBuf::new(4096);
    d.read_at(l.intent_offset, &mut block).unwrap();
    let s = l.slots as usize;
    block[s / 8] |= 1 << (s % 8);
    d.write_at(l.intent_offset, &block).unwrap();
    let e = sce_store::check(&d, true).unwrap_err();
    assert!(e.to_string().contains("past its last slot"), "{e}");
    let frags = golden().volumes[0].source_size.div_ceil(1 << 20);
    let e = sce_store::load(&d, sb.clone(), 0, frags).unwrap_err();
    assert!(matches!(e, StoreError::Corrupt(_)), "{e}");
    // Past the last word too.
    block[s / 8] &= !(1 << (s % 8));
    block[4000] = 0x80;
    d.write_at(l.intent_offset, &block).unwrap();
    assert!(sce_store::check(&d, false).is_err());
}

/// Format 8 (7 before the mirror area and cleaned entries, 6 before tombstones): a device
/// with a write-back log. Its superblock carries the log's region and state; a device
/// without one stays format 5, byte for byte (older builds still read it). Formats 6 and 7
/// are read (no mirror area), and written back as 8 (a build that reads only an older
/// format then refuses the device rather than misread the log).
#[test]
fn a_device_with_a_write_back_log_is_format_9() {
    use sce_store::{format, FormatOptions};
    let mut sb = golden();
    sb.version = sce_store::LOG_FORMAT_VERSION;
    let l = &sb.layout;
    let lend = sce_store::wblog::Lend::laid_out(
        l.data_bytes() / 2,
        l.data_offset,
        l.slots as u64,
        l.fragment_size,
    );
    assert!(lend.chunks > 0, "{lend:?}");
    sb.log = Some(sce_store::LogInfo {
        blocks: 8192,
        key: *b"secret-log-key!!",
        anchor_lpos: 1234,
        anchor_seq: 56,
        durable_seq: 60,
        anchor_commit: true,
        mirror_blocks: 512,
        lend_chunks: lend.chunks,
        lend_chunk_blocks: lend.chunk_blocks,
        lent: 3,
    });
    let img = sb.encode();
    assert_eq!(&img[8..12], &9u32.to_le_bytes());
    assert_eq!(
        crc32c::crc32c(&img),
        GOLDEN_LOG_CRC,
        "the format 9 superblock encoding changed: update docs/FORMAT.md"
    );
    assert_eq!(Superblock::decode(&img).unwrap(), sb);
    // More chunks lent than there are, or chunks that do not fit the slots: corrupt.
    for (chunks, blocks, lent) in [(16, lend.chunk_blocks, 17), (16, u32::MAX as u64, 1)] {
        let mut bad = sb.clone();
        let b = bad.log.as_mut().unwrap();
        (b.lend_chunks, b.lend_chunk_blocks, b.lent) = (chunks, blocks, lent);
        assert!(
            Superblock::decode(&bad.encode()).is_err(),
            "{chunks} {blocks} {lent}"
        );
    }
    // The same log as formats 6 to 8 wrote it (no chunks lent; no mirror area before 8; the
    // version field and its checksum apart).
    let mut with_mirror = sb.clone();
    let w = with_mirror.log.as_mut().unwrap();
    (w.lend_chunks, w.lend_chunk_blocks, w.lent) = (0, 0, 0);
    let mut older = with_mirror.clone();
    older.log.as_mut().unwrap().mirror_blocks = 0;
    for (v, was) in [(6u32, &older), (7, &older), (8, &with_mirror)] {
        let img9 = was.encode();
        let mut b = img9.clone();
        b[8..12].copy_from_slice(&v.to_le_bytes());
        b[12..16].fill(0);
        let crc = crc32c::crc32c(&b);
        b[12..16].copy_from_slice(&crc.to_le_bytes());
        let read = Superblock::decode(&b).unwrap();
        assert_eq!((read.version, read.log), (v, was.log));
        assert_eq!(read.encode(), img9, "written back as format 9");
    }
    // A mirror area that leaves too small a ring is corrupt.
    let mut bad = sb.clone();
    bad.log.as_mut().unwrap().mirror_blocks = 8192;
    assert!(Superblock::decode(&bad.encode()).is_err());
    // A format 6 superblock without a region is corrupt, not a log-less device.
    let mut bad = sb.clone();
    bad.log.as_mut().unwrap().blocks = 0;
    let e = Superblock::decode(&bad.encode()).unwrap_err();
    assert!(e.to_string().contains("without a write-back log"), "{e}");

    // Formatting with a log takes it from the end of the device; the superblock names it.
    let d = MemDevice::new(256 << 20);
    let sb = format(
        &d,
        &FormatOptions {
            fragment_size: 1 << 20,
            volume: golden().volumes[0].clone(),
            size: None,
            log_bytes: 32 << 20,
            lend_bytes: 0,
        },
    )
    .unwrap();
    let log = sb.log.expect("a log");
    assert_eq!(sb.version, 9);
    assert_eq!((log.blocks, log.mirror_blocks), (8192, 512));
    let region = log.region(&sb.layout);
    assert_eq!((region.blocks, region.mirror_blocks), (7680, 512));
    assert_eq!(region.mirror_offset, region.offset + 7680 * 4096);
    let off = sce_store::LogInfo::offset(&sb.layout);
    assert_eq!(off, 224 << 20);
    assert!(sb.layout.data_offset + sb.layout.slots as u64 * (1 << 20) <= off);
    assert_eq!(read_superblock(&d).unwrap().log, sb.log);
    // The same device cut short of its log is refused, naming the sizes.
    let short = MemDevice::new(240 << 20);
    let mut b = AlignedBuf::new(8192);
    d.read_at(0, &mut b).unwrap();
    short.write_at(0, &b).unwrap();
    let e = read_superblock(&short).unwrap_err();
    assert!(e.to_string().contains("describes 268435456 bytes"), "{e}");
    // Too small a log is refused.
    let e = format(
        &MemDevice::new(64 << 20),
        &FormatOptions {
            fragment_size: 1 << 20,
            volume: golden().volumes[0].clone(),
            size: None,
            log_bytes: 512 << 10,
            lend_bytes: 0,
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("smaller than the least"), "{e}");
}
