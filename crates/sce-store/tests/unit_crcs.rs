//! `read_unit_crcs`: the checksums of a unit read back from its records, by the rule loading
//! uses to choose between its two copies, reading the primary alone when it is the image the
//! caller knows the device holds (issue 30: checksums out of memory).

use sce_io::{AlignedBuf, BlockDevice, FaultDevice, MemDevice, Op};
use sce_store::superblock::Volume;
use sce_store::unit::{EntryIn, UnitBuilder};
use sce_store::{format, read_unit_crcs, FormatOptions, Layout, UnitCrcs};
use std::sync::Arc;

fn device() -> (Arc<MemDevice>, Layout, [u8; 16]) {
    let d = MemDevice::new(16 << 20);
    let volume = Volume {
        id: 1,
        generation: 1,
        source_size: 64 << 20,
        name: "unit-crcs".into(),
        identity: [0; 16],
        detached: false,
        writeback: false,
    };
    let opts = FormatOptions {
        fragment_size: 1 << 20,
        volume,
        size: None,
        log_bytes: 0,
        lend_bytes: 0,
    };
    let sb = format(&d, &opts).unwrap();
    (Arc::new(d), sb.layout, sb.uuid)
}

/// An image of unit 0 of round `seq`: slot 0 holds fragment 7 with pages 0..4 valid, whose
/// checksums are `base + p` (every page's is written, valid or not).
fn image(l: &Layout, uuid: &[u8; 16], seq: u64, base: u32) -> Vec<u8> {
    let mut b = UnitBuilder::new(l, uuid, 0, seq);
    let mut bitmap = vec![0u64; l.bitmap_words()];
    bitmap[0] = 0b1111;
    let e = EntryIn {
        frag: 7,
        volume: 1,
        generation: 1,
        bitmap: &bitmap,
        dirty: &[],
    };
    b.set(0, &e, |p| base + p);
    b.set_crcs(0, |p| base + p);
    b.finish()
}

fn put(d: &dyn BlockDevice, at: u64, img: &[u8]) {
    let mut buf = AlignedBuf::new(img.len());
    buf.copy_from_slice(img);
    d.write_at(at, &buf).unwrap();
}

fn first_crcs(r: UnitCrcs) -> Vec<u32> {
    match r {
        UnitCrcs::Found(c) => c[..8].to_vec(),
        other => panic!("no checksums: {other:?}"),
    }
}

#[test]
fn the_copy_loading_would_choose_and_the_primary_alone_when_it_is_known() {
    let (d, l, uuid) = device();
    // Never written: blank, whatever the sequence asked for.
    assert_eq!(
        read_unit_crcs(&*d, &l, &uuid, 0, 0).unwrap(),
        UnitCrcs::Blank
    );
    assert_eq!(
        read_unit_crcs(&*d, &l, &uuid, 0, 9).unwrap(),
        UnitCrcs::Blank
    );
    // The primary of round 5, the mirror of round 7 (a primary write lost, say).
    put(&*d, l.unit_offset(0), &image(&l, &uuid, 5, 100));
    put(&*d, l.unit_mirror_offset(0), &image(&l, &uuid, 7, 200));
    let later: Vec<u32> = (200..208).collect();
    // Unknown sequence, or the mirror's: both copies read, the later round's chosen.
    assert_eq!(
        first_crcs(read_unit_crcs(&*d, &l, &uuid, 0, 0).unwrap()),
        later
    );
    assert_eq!(
        first_crcs(read_unit_crcs(&*d, &l, &uuid, 0, 7).unwrap()),
        later
    );
    // Every page's checksum comes back, the invalid pages' (4..) too.
    assert_eq!(later[4..], [204, 205, 206, 207]);

    // The primary holds the round the caller knows: read alone (the mirror's reads fail
    // here, and are not made).
    let f = FaultDevice::new(d.clone());
    let m = l.unit_mirror_offset(0);
    f.control()
        .fail_range(&[Op::Read], m..m + l.unit_size as u64);
    put(&*d, l.unit_offset(0), &image(&l, &uuid, 8, 300));
    let primary: Vec<u32> = (300..308).collect();
    assert_eq!(
        first_crcs(read_unit_crcs(&f, &l, &uuid, 0, 8).unwrap()),
        primary
    );
    // Any other sequence needs the mirror too: here, its read fails and so does the call
    // (an I/O error is not taken for damage).
    assert!(read_unit_crcs(&f, &l, &uuid, 0, 7).is_err());
    // The primary unreadable: the mirror, if it is the image known.
    let p = l.unit_offset(0);
    let g = FaultDevice::new(d.clone());
    g.control()
        .fail_range(&[Op::Read], p..p + l.unit_size as u64);
    assert_eq!(
        first_crcs(read_unit_crcs(&g, &l, &uuid, 0, 7).unwrap()),
        later
    );
    assert!(
        read_unit_crcs(&g, &l, &uuid, 0, 8).is_err(),
        "not the image known"
    );

    // A damaged primary: the mirror, whatever was known.
    let mut torn = image(&l, &uuid, 8, 300);
    torn[200] ^= 1;
    put(&*d, l.unit_offset(0), &torn);
    assert_eq!(
        first_crcs(read_unit_crcs(&*d, &l, &uuid, 0, 8).unwrap()),
        later
    );
    // Both damaged: unknown, said so (not blank).
    put(&*d, m, &torn);
    assert_eq!(
        read_unit_crcs(&*d, &l, &uuid, 0, 8).unwrap(),
        UnitCrcs::Damaged
    );
}
