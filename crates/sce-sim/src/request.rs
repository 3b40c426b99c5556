//! One request of a trace: what every reader ([`crate::trace`], [`crate::csv`],
//! [`crate::binary`]) and the generator ([`crate::gen`]) yield, and every simulation
//! consumes.

/// Read or write.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum IoKind {
    /// A read.
    Read,
    /// A write.
    Write,
}

/// One request of a trace.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Time since an arbitrary origin, in nanoseconds.
    pub time_ns: u64,
    /// Read or write.
    pub kind: IoKind,
    /// Volume (disk, LUN) number.
    pub volume: u32,
    /// Byte offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}
