//! `sce-sim`: trace-driven simulation. This first part holds the streaming trace readers
//! ([`trace`]) and the classic reference policies over 4 KiB blocks ([`reference`]), which
//! are checked against an independent simulator's results. The engine policies driven
//! through `sce-core` in virtual time come next.

pub mod engine;
pub mod reference;
pub mod trace;

pub use engine::{DeviceModel, EngineResult, EngineSim};
pub use reference::{BlockCache, ReferencePolicy};
pub use trace::{IoKind, TraceError, TraceFormat, TraceReader, TraceRequest};
