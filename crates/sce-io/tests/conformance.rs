//! The conformance suite against every implementation in this crate.

use sce_io::*;
use std::time::Duration;

const SIZE: u64 = 8 << 20;

#[test]
fn memory() {
    conformance::run_all(&MemDevice::new(SIZE));
    conformance::run_all(&MemDevice::with_block_size(SIZE, 4096).unwrap());
    // Not a whole number of 1 MiB chunks: the short last chunk too.
    conformance::run_all(&MemDevice::with_block_size(SIZE + 4096, 4096).unwrap());
}

#[test]
fn file_direct() {
    let dir = tempfile::tempdir().unwrap();
    let opts = FileOptions {
        direct: DirectMode::Required,
        create_size: Some(SIZE),
        read_only: false,
        ..Default::default()
    };
    let d = FileDevice::open(&dir.path().join("f"), &opts).unwrap();
    assert!(
        d.is_direct(),
        "the temp dir is expected to support O_DIRECT"
    );
    conformance::run_all(&d);
}

#[test]
fn file_buffered() {
    let dir = tempfile::tempdir().unwrap();
    let opts = FileOptions {
        direct: DirectMode::Off,
        create_size: Some(SIZE),
        read_only: false,
        ..Default::default()
    };
    let d = FileDevice::open(&dir.path().join("f"), &opts).unwrap();
    assert!(!d.is_direct());
    conformance::run_all(&d);
}

#[test]
fn latency_wrapper() {
    let cfg = LatencyConfig {
        read: Delay::Uniform {
            min: Duration::from_micros(10),
            max: Duration::from_micros(50),
        },
        write: Delay::Exponential {
            mean: Duration::from_micros(20),
        },
        flush: Delay::Fixed(Duration::from_micros(10)),
        max_in_flight: 4,
        bandwidth: Some(4 << 30),
        seed: 3,
    };
    conformance::run_all(&LatencyDevice::new(MemDevice::new(SIZE), cfg));
}

#[test]
fn fault_wrapper_without_faults() {
    let d = FaultDevice::new(MemDevice::new(SIZE));
    conformance::run_all(&d);
    assert_eq!(d.control().faults_fired(), 0);
    assert!(d.control().ops(Op::Write) > 0);
}

#[test]
fn through_arc_and_box() {
    let a: std::sync::Arc<dyn BlockDevice> = std::sync::Arc::new(MemDevice::new(SIZE));
    conformance::run_all(&a);
    let b: Box<dyn BlockDevice> = Box::new(MemDevice::new(SIZE));
    conformance::run_all(&b);
}
