//! Block trace readers. Every format streams into one request type with bounded memory;
//! a malformed record is an error naming its line (or record) number, or, with `skip_bad`,
//! is counted and skipped. Gzip, bzip2 and xz input is recognised by its magic bytes and
//! read directly.

use crate::binary;
use crate::csv::{decimal_to_ns, CsvSpec};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

pub use crate::request::{IoKind, TraceRequest};

/// The supported formats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceFormat {
    /// VMware vscsi v1 binary: 32-byte little-endian records.
    Vscsi,
    /// MSR Cambridge CSV: `ticks,host,disk,Read|Write,offset,size,response`.
    Msr,
    /// SYSTOR '17 CSV with header: `Timestamp,Response,IOType,LUN,Offset,Size`.
    Systor,
    /// Tencent CBS CSV: `timestamp_s,offset_sectors,size_sectors,type(0=read,1=write),volume`.
    Tencent,
    /// DiskSim ASCII: `time_ns device lba_sectors size_sectors type(1=read,0=write)`.
    DiskSim,
    /// Generic CSV described by a column spec (see [`crate::csv`]).
    Csv(CsvSpec),
    /// sce's own compact binary format (see [`crate::binary`]).
    Sce,
}

/// The format names, for help and error messages.
pub const FORMAT_NAMES: &str = "vscsi, msr, systor, tencent, disksim, sce, csv or csv:SPEC";

impl std::str::FromStr for TraceFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "vscsi" => TraceFormat::Vscsi,
            "msr" => TraceFormat::Msr,
            "systor" => TraceFormat::Systor,
            "tencent" => TraceFormat::Tencent,
            "disksim" => TraceFormat::DiskSim,
            "sce" => TraceFormat::Sce,
            "csv" => TraceFormat::Csv(CsvSpec::default()),
            _ => match s.strip_prefix("csv:") {
                Some(spec) => TraceFormat::Csv(spec.parse()?),
                None => {
                    return Err(format!(
                        "unknown trace format {s:?} (expected {FORMAT_NAMES})"
                    ))
                }
            },
        })
    }
}

impl std::fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TraceFormat::Vscsi => f.write_str("vscsi"),
            TraceFormat::Msr => f.write_str("msr"),
            TraceFormat::Systor => f.write_str("systor"),
            TraceFormat::Tencent => f.write_str("tencent"),
            TraceFormat::DiskSim => f.write_str("disksim"),
            TraceFormat::Sce => f.write_str("sce"),
            TraceFormat::Csv(s) => s.fmt(f),
        }
    }
}

/// How a trace file is compressed, from its first bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Compression {
    /// Not compressed (or not in a way we recognise).
    None,
    /// gzip (`1f 8b`).
    Gzip,
    /// bzip2 (`BZh`).
    Bzip2,
    /// xz (`fd 37 7a 58 5a 00`).
    Xz,
}

impl Compression {
    /// Recognises a compressed stream by its magic bytes.
    pub fn detect(head: &[u8]) -> Compression {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(b"BZh") && head.get(3).is_some_and(|d| (b'1'..=b'9').contains(d))
        {
            Compression::Bzip2
        } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
            Compression::Xz
        } else {
            Compression::None
        }
    }
}

/// The decompressed bytes of a trace file.
pub(crate) fn open_input(path: &Path) -> Result<Box<dyn BufRead + Send>, TraceError> {
    let io = |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut f = BufReader::with_capacity(1 << 20, File::open(path).map_err(io)?);
    let buffered = |r: Box<dyn Read + Send>| -> Box<dyn BufRead + Send> {
        Box::new(BufReader::with_capacity(1 << 20, r))
    };
    Ok(match Compression::detect(f.fill_buf().map_err(io)?) {
        Compression::None => Box::new(f),
        Compression::Gzip => buffered(Box::new(flate2::read::MultiGzDecoder::new(f))),
        Compression::Bzip2 => buffered(Box::new(bzip2::bufread::MultiBzDecoder::new(f))),
        Compression::Xz => buffered(Box::new(xz2::bufread::XzDecoder::new_multi_decoder(f))),
    })
}

/// A trace that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A malformed record.
    #[error("{path}: {unit} {at}: {reason}")]
    Bad {
        /// The file.
        path: String,
        /// "line" or "record".
        unit: &'static str,
        /// 1-based position.
        at: u64,
        /// What is wrong.
        reason: String,
    },
    /// The file holds no request.
    #[error("{0}: the trace is empty")]
    Empty(String),
}

/// A streaming reader of one trace file.
pub struct TraceReader {
    path: String,
    format: TraceFormat,
    input: Box<dyn BufRead + Send>,
    position: u64,
    skip_bad: bool,
    skipped: u64,
    seen: u64,
    line: Vec<u8>,
    /// Records the sce header announces (`binary::UNKNOWN_COUNT` if it does not).
    announced: u64,
    /// True once the sce header has been read.
    header_read: bool,
}

fn cmd_kind(cmd: u16) -> Option<IoKind> {
    match cmd {
        0x08 | 0x28 | 0x88 | 0xa8 => Some(IoKind::Read),
        0x0a | 0x2a | 0x8a | 0xaa => Some(IoKind::Write),
        _ => None,
    }
}

fn num<T: std::str::FromStr>(s: Option<&str>, what: &str) -> Result<T, String> {
    let s = s.ok_or_else(|| format!("missing field {what}"))?.trim();
    s.parse::<T>()
        .map_err(|_| format!("field {what}: {s:?} is not a number"))
}

fn seconds_to_ns(s: Option<&str>, what: &str) -> Result<u64, String> {
    let s = s.ok_or_else(|| format!("missing field {what}"))?.trim();
    decimal_to_ns(s, 1_000_000_000)
        .ok_or_else(|| format!("field {what}: {s:?} is not a valid time"))
}

impl TraceReader {
    /// Opens a trace. Gzip, bzip2 and xz are detected by their magic bytes.
    pub fn open(
        path: &Path,
        format: TraceFormat,
        skip_bad: bool,
    ) -> Result<TraceReader, TraceError> {
        let p = path.display().to_string();
        let input = open_input(path)?;
        Ok(TraceReader {
            announced: binary::UNKNOWN_COUNT,
            header_read: false,
            path: p,
            format,
            input,
            position: 0,
            skip_bad,
            skipped: 0,
            seen: 0,
            line: Vec::new(),
        })
    }

    /// Records skipped as malformed (with `skip_bad`).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    fn bad(&self, unit: &'static str, reason: String) -> TraceError {
        TraceError::Bad {
            path: self.path.clone(),
            unit,
            at: self.position,
            reason,
        }
    }

    /// The next request, `Ok(None)` at the end.
    pub fn next_request(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        loop {
            let r = match self.format {
                TraceFormat::Vscsi => self.next_vscsi(),
                TraceFormat::Sce => self.next_sce(),
                _ => self.next_text(),
            };
            match r {
                Ok(Some(req)) => {
                    self.seen += 1;
                    return Ok(Some(req));
                }
                Ok(None) if self.seen == 0 && self.skipped == 0 => {
                    return Err(TraceError::Empty(self.path.clone()))
                }
                Ok(None) => return Ok(None),
                Err(TraceError::Bad { .. }) if self.skip_bad => self.skipped += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// Reads up to `buf.len()` bytes; fewer only at the end of the input.
    fn read_full(&mut self, buf: &mut [u8]) -> Result<usize, TraceError> {
        let mut got = 0;
        while got < buf.len() {
            let n = match self.input.read(&mut buf[got..]) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(TraceError::Io {
                        path: self.path.clone(),
                        source,
                    })
                }
            };
            if n == 0 {
                break;
            }
            got += n;
        }
        Ok(got)
    }

    fn next_sce(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        if !self.header_read {
            let mut h = [0u8; binary::HEADER_SIZE];
            let got = self.read_full(&mut h)?;
            if got == 0 {
                return Ok(None);
            }
            let bad = |reason: String| TraceError::Bad {
                path: self.path.clone(),
                unit: "header",
                at: 1,
                reason,
            };
            if got < h.len() {
                return Err(bad(format!(
                    "truncated: {got} of {} bytes",
                    binary::HEADER_SIZE
                )));
            }
            self.announced = binary::decode_header(&h).map_err(bad)?;
            self.header_read = true;
        }
        let mut rec = [0u8; binary::RECORD_SIZE];
        let got = self.read_full(&mut rec)?;
        if got == 0 {
            if self.announced != binary::UNKNOWN_COUNT && self.position != self.announced {
                self.position += 1;
                let e = self.bad(
                    "record",
                    format!(
                        "missing: the header announces {} records, the file ends after {}",
                        self.announced,
                        self.position - 1
                    ),
                );
                return if self.skip_bad { Ok(None) } else { Err(e) };
            }
            return Ok(None);
        }
        self.position += 1;
        if got < rec.len() {
            let e = self.bad(
                "record",
                format!("truncated: {got} of {} bytes", binary::RECORD_SIZE),
            );
            return if self.skip_bad { Ok(None) } else { Err(e) };
        }
        if self.position > self.announced {
            let e = self.bad(
                "record",
                format!(
                    "unexpected: the header announces {} records",
                    self.announced
                ),
            );
            return if self.skip_bad { Ok(None) } else { Err(e) };
        }
        binary::decode_record(&rec)
            .map(Some)
            .map_err(|reason| self.bad("record", reason))
    }

    fn next_vscsi(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        let mut rec = [0u8; 32];
        let got = self.read_full(&mut rec)?;
        if got == 0 {
            return Ok(None);
        }
        self.position += 1;
        if got < 32 {
            // A truncated last record cannot be skipped into a valid stream: always an error.
            let e = self.bad("record", format!("truncated: {got} of 32 bytes"));
            return if self.skip_bad { Ok(None) } else { Err(e) };
        }
        let le32 = |i: usize| u32::from_le_bytes(rec[i..i + 4].try_into().expect("4"));
        let le64 = |i: usize| u64::from_le_bytes(rec[i..i + 8].try_into().expect("8"));
        let len = le32(4) as u64;
        let cmd = u16::from_le_bytes([rec[12], rec[13]]);
        let lbn = le64(16);
        let ts = le64(24);
        let kind = cmd_kind(cmd)
            .ok_or_else(|| self.bad("record", format!("unknown SCSI command {cmd:#x}")))?;
        let offset = lbn
            .checked_mul(512)
            .ok_or_else(|| self.bad("record", "offset overflows".into()))?;
        Ok(Some(TraceRequest {
            time_ns: ts.saturating_mul(1000),
            kind,
            volume: 0,
            offset,
            len,
        }))
    }

    fn next_text(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        loop {
            self.line.clear();
            let n = self
                .input
                .read_until(b'\n', &mut self.line)
                .map_err(|source| TraceError::Io {
                    path: self.path.clone(),
                    source,
                })?;
            if n == 0 {
                return Ok(None);
            }
            self.position += 1;
            let Ok(t) = std::str::from_utf8(&self.line) else {
                return Err(self.bad("line", "not text (is --format right?)".into()));
            };
            let t = t.trim();
            if t.is_empty() || t.starts_with('#') {
                continue;
            }
            if self.format == TraceFormat::Systor
                && self.position == 1
                && t.starts_with("Timestamp")
            {
                continue;
            }
            let parsed = match &self.format {
                TraceFormat::Msr => parse_msr(t),
                TraceFormat::Systor => parse_systor(t),
                TraceFormat::Tencent => parse_tencent(t),
                TraceFormat::DiskSim => parse_disksim(t),
                TraceFormat::Csv(spec) => {
                    if self.position <= spec.header {
                        continue;
                    }
                    let mut scratch = Vec::new();
                    spec.parse(t, &mut scratch)
                }
                TraceFormat::Vscsi | TraceFormat::Sce => {
                    return Err(self.bad("line", "binary format read as text".into()))
                }
            };
            return parsed.map(Some).map_err(|reason| self.bad("line", reason));
        }
    }
}

impl Iterator for TraceReader {
    type Item = Result<TraceRequest, TraceError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_request().transpose()
    }
}

fn kind_rw(s: Option<&str>, what: &str) -> Result<IoKind, String> {
    match s.map(str::trim) {
        Some("Read" | "R" | "r" | "read") => Ok(IoKind::Read),
        Some("Write" | "W" | "w" | "write") => Ok(IoKind::Write),
        Some(x) => Err(format!("field {what}: {x:?} is neither read nor write")),
        None => Err(format!("missing field {what}")),
    }
}

fn parse_msr(t: &str) -> Result<TraceRequest, String> {
    let mut f = t.split(',');
    let ticks: u64 = num(f.next(), "timestamp")?;
    let _host = f.next().ok_or("missing field hostname")?;
    let volume: u32 = num(f.next(), "disk number")?;
    let kind = kind_rw(f.next(), "type")?;
    let offset: u64 = num(f.next(), "offset")?;
    let len: u64 = num(f.next(), "size")?;
    Ok(TraceRequest {
        time_ns: ticks.saturating_mul(100),
        kind,
        volume,
        offset,
        len,
    })
}

fn parse_systor(t: &str) -> Result<TraceRequest, String> {
    let mut f = t.split(',');
    let time_ns = seconds_to_ns(f.next(), "timestamp")?;
    let _resp = f.next().ok_or("missing field response")?;
    let kind = kind_rw(f.next(), "IOType")?;
    let volume: u32 = num(f.next(), "LUN")?;
    let offset: u64 = num(f.next(), "offset")?;
    let len: u64 = num(f.next(), "size")?;
    Ok(TraceRequest {
        time_ns,
        kind,
        volume,
        offset,
        len,
    })
}

fn parse_tencent(t: &str) -> Result<TraceRequest, String> {
    let mut f = t.split(',');
    let time_ns = seconds_to_ns(f.next(), "timestamp")?;
    let off: u64 = num(f.next(), "offset")?;
    let size: u64 = num(f.next(), "size")?;
    let kind = match num::<u8>(f.next(), "type")? {
        0 => IoKind::Read,
        1 => IoKind::Write,
        x => return Err(format!("field type: {x} is neither 0 (read) nor 1 (write)")),
    };
    let volume: u32 = num(f.next(), "volume")?;
    let offset = off.checked_mul(512).ok_or("field offset: overflows")?;
    Ok(TraceRequest {
        time_ns,
        kind,
        volume,
        offset,
        len: size.saturating_mul(512),
    })
}

fn parse_disksim(t: &str) -> Result<TraceRequest, String> {
    let mut f = t.split_whitespace();
    let time_ns: u64 = num(f.next(), "time")?;
    let volume: u32 = num(f.next(), "device")?;
    let lba: u64 = num(f.next(), "lba")?;
    let size: u64 = num(f.next(), "size")?;
    let kind = match num::<u8>(f.next(), "type")? {
        1 => IoKind::Read,
        0 => IoKind::Write,
        x => return Err(format!("field type: {x} is neither 1 (read) nor 0 (write)")),
    };
    let offset = lba.checked_mul(512).ok_or("field lba: overflows")?;
    Ok(TraceRequest {
        time_ns,
        kind,
        volume,
        offset,
        len: size.saturating_mul(512),
    })
}
