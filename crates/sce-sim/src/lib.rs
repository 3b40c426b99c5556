//! `sce-sim`: trace-driven simulation of sce's cache policies.
//!
//! - [`request`]: one request of a trace, what every reader and the generator yield;
//! - [`trace`]: streaming trace readers (vscsi, MSR, SYSTOR, Tencent, DiskSim, generic
//!   [`csv`], sce's own [`binary`] format; gzip, bzip2 and xz read directly), and
//!   [`writer`] to write any of them;
//! - [`gen`]: a seeded statistical workload generator;
//! - [`reference`](mod@reference): the classic reference policies (LRU, FIFO, LFU) over 4 KiB blocks,
//!   checked against an independent simulator;
//! - [`engine`]: the very `sce-core` state machine the server runs, in virtual time over
//!   modelled devices.
//! - [`layers`]: what sits around a cache: separate volumes, a RAM cache above it, and
//!   several hosts sharing a volume.
//! - [`run`]: a whole simulation as `sce sim` runs it, every policy in its own thread, and
//!   [`plot`] to draw what they come to.
//!
//! Sizes and durations as people write them are `sce_core::units`.

pub mod binary;
pub mod csv;
pub mod detect;
pub mod engine;
pub mod gen;
pub mod layers;
pub mod plot;
pub mod reference;
pub mod request;
pub mod run;
pub mod trace;
pub mod writer;

pub use csv::CsvSpec;
pub use detect::{detect_format, FormatChoice};
pub use engine::{DeviceModel, EngineResult, EngineSim, LogSizes};
pub use gen::{GenConfig, Generator, Workload, ZipfParams};
pub use reference::{BlockCache, ReferencePolicy};
pub use request::{IoKind, TraceRequest};
pub use trace::{Compression, TraceError, TraceFormat, TraceReader};
pub use writer::{TraceWriter, WriteError};
