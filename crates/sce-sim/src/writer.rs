//! Writing traces in any supported format, for `sce trace convert` and `sce gen`. What is
//! written reads back, with [`crate::TraceReader`], as the same requests, except where a
//! format cannot hold a field (vscsi and DiskSim count in 512-byte sectors and have coarser
//! clocks; vscsi has no volume): those limits are checked and reported, never rounded away
//! silently.

use crate::binary;
use crate::request::{IoKind, TraceRequest};
use crate::trace::TraceFormat;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

/// A trace that could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The file could not be created or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A request the format cannot hold.
    #[error("{path}: request {at}: {reason}")]
    Unrepresentable {
        /// The file.
        path: String,
        /// 1-based request number.
        at: u64,
        /// Why.
        reason: String,
    },
}

/// A streaming writer of one trace file.
pub struct TraceWriter {
    path: String,
    format: TraceFormat,
    out: BufWriter<File>,
    written: u64,
    line: String,
}

fn sectors(what: &str, v: u64) -> Result<u64, String> {
    if !v.is_multiple_of(512) {
        return Err(format!(
            "{what} {v} is not a multiple of 512 bytes (use --out-format sce or csv)"
        ));
    }
    Ok(v / 512)
}

fn secs(ns: u64) -> String {
    format!("{}.{:09}", ns / 1_000_000_000, ns % 1_000_000_000)
}

impl TraceWriter {
    /// Creates (truncates) `path` for writing in `format`.
    pub fn create(path: &Path, format: TraceFormat) -> Result<TraceWriter, WriteError> {
        let p = path.display().to_string();
        let io = |source| WriteError::Io {
            path: p.clone(),
            source,
        };
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
        match &format {
            TraceFormat::Sce => out
                .write_all(&binary::encode_header(binary::UNKNOWN_COUNT))
                .map_err(io)?,
            TraceFormat::Systor => out
                .write_all(b"Timestamp,Response,IOType,LUN,Offset,Size\n")
                .map_err(io)?,
            TraceFormat::Csv(spec) => {
                out.write_all(spec.header_line().as_bytes()).map_err(io)?;
                out.write_all(b"\n").map_err(io)?;
            }
            _ => {}
        }
        Ok(TraceWriter {
            path: p,
            format,
            out,
            written: 0,
            line: String::new(),
        })
    }

    /// Requests written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    fn io(&self, source: std::io::Error) -> WriteError {
        WriteError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Appends one request.
    pub fn write(&mut self, r: &TraceRequest) -> Result<(), WriteError> {
        let at = self.written + 1;
        let unrep = |reason: String| WriteError::Unrepresentable {
            path: self.path.clone(),
            at,
            reason,
        };
        self.line.clear();
        match &self.format {
            TraceFormat::Sce => {
                let b = binary::encode_record(r).map_err(unrep)?;
                self.out.write_all(&b).map_err(|e| self.io(e))?;
            }
            TraceFormat::Vscsi => {
                let b = vscsi_record(r, self.written as u32).map_err(unrep)?;
                self.out.write_all(&b).map_err(|e| self.io(e))?;
            }
            text => text_line(text, r, &mut self.line).map_err(unrep)?,
        }
        if !self.line.is_empty() {
            self.out
                .write_all(self.line.as_bytes())
                .map_err(|e| WriteError::Io {
                    path: self.path.clone(),
                    source: e,
                })?;
        }
        self.written += 1;
        Ok(())
    }

    /// Flushes the file and, for the sce format, writes the record count into the header.
    pub fn finish(mut self) -> Result<u64, WriteError> {
        self.out.flush().map_err(|e| self.io(e))?;
        if self.format == TraceFormat::Sce {
            let n = self.written;
            let f = self.out.get_mut();
            f.seek(SeekFrom::Start(0))
                .and_then(|_| f.write_all(&binary::encode_header(n)))
                .and_then(|_| f.flush())
                .map_err(|e| WriteError::Io {
                    path: self.path.clone(),
                    source: e,
                })?;
        }
        Ok(self.written)
    }
}

/// The 32-byte vscsi record of `r`, the `index`-th of the file; or why it has none.
fn vscsi_record(r: &TraceRequest, index: u32) -> Result<[u8; 32], String> {
    if r.volume != 0 {
        return Err(format!("vscsi has no volume field (volume {})", r.volume));
    }
    let lbn = sectors("offset", r.offset)?;
    let len =
        u32::try_from(r.len).map_err(|_| format!("length {} does not fit in 32 bits", r.len))?;
    let mut b = [0u8; 32];
    b[0..4].copy_from_slice(&index.to_le_bytes());
    b[4..8].copy_from_slice(&len.to_le_bytes());
    let cmd: u16 = if r.kind == IoKind::Read { 0x28 } else { 0x2a };
    b[12..14].copy_from_slice(&cmd.to_le_bytes());
    b[16..24].copy_from_slice(&lbn.to_le_bytes());
    b[24..32].copy_from_slice(&(r.time_ns / 1000).to_le_bytes());
    Ok(b)
}

/// Appends the line of `r` in the text format `format` to `line`; or says why it has none.
fn text_line(format: &TraceFormat, r: &TraceRequest, line: &mut String) -> Result<(), String> {
    use std::fmt::Write as _;
    match format {
        TraceFormat::Msr => {
            let _ = writeln!(
                line,
                "{},sce,{},{},{},{},0",
                r.time_ns / 100,
                r.volume,
                if r.kind == IoKind::Read {
                    "Read"
                } else {
                    "Write"
                },
                r.offset,
                r.len
            );
        }
        TraceFormat::Systor => {
            let _ = writeln!(
                line,
                "{},0,{},{},{},{}",
                secs(r.time_ns),
                if r.kind == IoKind::Read { "R" } else { "W" },
                r.volume,
                r.offset,
                r.len
            );
        }
        TraceFormat::Tencent => {
            let off = sectors("offset", r.offset)?;
            let len = sectors("length", r.len)?;
            let _ = writeln!(
                line,
                "{},{off},{len},{},{}",
                secs(r.time_ns),
                if r.kind == IoKind::Read { 0 } else { 1 },
                r.volume
            );
        }
        TraceFormat::DiskSim => {
            let off = sectors("offset", r.offset)?;
            let len = sectors("length", r.len)?;
            let _ = writeln!(
                line,
                "{} {} {off} {len} {}",
                r.time_ns,
                r.volume,
                if r.kind == IoKind::Read { 1 } else { 0 }
            );
        }
        TraceFormat::Csv(spec) => {
            let l = spec.format(r)?;
            line.push_str(&l);
            line.push('\n');
        }
        TraceFormat::Sce | TraceFormat::Vscsi => unreachable!("binary formats have no line"),
    }
    Ok(())
}
