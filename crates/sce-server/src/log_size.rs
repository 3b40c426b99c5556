//! `--writeback-log`: how much of a cache device sce gives a write-back log when it
//! formats it (issue 29).

/// The size of the write-back log sce gives a cache device it formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogSize {
    /// [`LogSize::auto_bytes`] of the device, whatever the mode: an export served in
    /// write-through can be switched live into write-back (`sce ctl set mode writeback`),
    /// and write-back needs a log.
    Auto,
    /// This many bytes (0: none, whatever the mode).
    Bytes(u64),
}

impl LogSize {
    /// The log `auto` gives a device of `device` bytes: a sixteenth of it (6% of the read
    /// capacity), at least 16 MiB (but at most a quarter of a small device), at most 4 GiB,
    /// in whole MiB; none if that is under the log's 1 MiB minimum. The log only has to
    /// absorb the dirty data written between cleanings (the cleaner drains it as fast as
    /// the source takes writes), so a larger one mostly takes room from the read slots.
    pub fn auto_bytes(device: u64) -> u64 {
        sce_store::wblog::auto_log_bytes(device)
    }

    /// The size given, `None` for auto (the caller's own default applies).
    pub fn explicit(self) -> Option<u64> {
        match self {
            LogSize::Bytes(b) => Some(b),
            LogSize::Auto => None,
        }
    }

    /// The bytes of log to format a device of `device` bytes with.
    pub fn bytes(self, device: u64) -> u64 {
        match self {
            LogSize::Bytes(b) => b,
            LogSize::Auto => Self::auto_bytes(device),
        }
    }
}

impl std::str::FromStr for LogSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(LogSize::Auto);
        }
        sce_core::units::parse_size(s)
            .map(LogSize::Bytes)
            .map_err(|e| format!("{e} (or auto)"))
    }
}
