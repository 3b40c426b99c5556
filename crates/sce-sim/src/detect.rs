//! `--format auto`: which supported format a trace file is in, from its first bytes (after
//! decompression) and its first lines.

use crate::binary;
use crate::csv::CsvSpec;
use crate::trace::{open_input, TraceError, TraceFormat, FORMAT_NAMES};
use std::io::Read;
use std::path::Path;

/// Bytes of the (decompressed) file looked at.
const HEAD: u64 = 64 << 10;
/// Data lines that must agree on one format.
const LINES: usize = 20;

/// A `--format` argument: `auto` (detect it) or a format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FormatChoice {
    /// Detect the format from the file.
    Auto,
    /// This format.
    Given(TraceFormat),
}

impl std::str::FromStr for FormatChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(FormatChoice::Auto);
        }
        s.parse()
            .map(FormatChoice::Given)
            .map_err(|e: String| e.replace("(expected ", "(expected auto, "))
    }
}

impl FormatChoice {
    /// The format of the trace at `path`, and whether it was detected.
    pub fn resolve(&self, path: &Path) -> Result<(TraceFormat, bool), TraceError> {
        match self {
            FormatChoice::Auto => Ok((detect_format(path)?, true)),
            FormatChoice::Given(f) => Ok((f.clone(), false)),
        }
    }
}

/// The format of the trace at `path`: sce's binary format by its magic, vscsi for any other
/// binary content, and the text formats by the shape of their first lines (which must all
/// agree). A file that fits none is an error naming the formats to choose from.
pub fn detect_format(path: &Path) -> Result<TraceFormat, TraceError> {
    let mut head = Vec::new();
    open_input(path)?
        .take(HEAD)
        .read_to_end(&mut head)
        .map_err(|source| TraceError::Io {
            path: path.display().to_string(),
            source,
        })?;
    detect_in(&head).map_err(|why| TraceError::Bad {
        path: path.display().to_string(),
        unit: "format",
        at: 0,
        reason: format!("{why}; give --format ({FORMAT_NAMES})"),
    })
}

/// The format of a file starting with `head`, or why none was recognised.
pub fn detect_in(head: &[u8]) -> Result<TraceFormat, String> {
    if head.starts_with(binary::MAGIC) {
        return Ok(TraceFormat::Sce);
    }
    if head.is_empty() {
        return Err("the file is empty".into());
    }
    if head
        .iter()
        .any(|&b| b == 0 || (b < 0x20 && !b"\t\r\n".contains(&b)))
    {
        // The one binary format besides sce's: vscsi's 32-byte records.
        return Ok(TraceFormat::Vscsi);
    }
    let text = String::from_utf8_lossy(head);
    let mut lines = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'));
    if let Some(first) = lines.clone().next() {
        if first
            .to_ascii_lowercase()
            .starts_with("timestamp,response,iotype")
        {
            return Ok(TraceFormat::Systor);
        }
    }
    // A last line without its newline may be cut off where the head ends: not looked at,
    // unless it is the only one.
    let mut data: Vec<&str> = lines.by_ref().take(LINES + 1).collect();
    if !head.ends_with(b"\n") && data.len() > 1 {
        data.pop();
    }
    let mut found: Option<TraceFormat> = None;
    for l in data.into_iter().take(LINES) {
        let f = line_format(l).ok_or_else(|| format!("line {l:?} fits no known format"))?;
        match &found {
            Some(g) if *g != f => {
                return Err(format!("its first lines mix the {g} and {f} formats"));
            }
            _ => found = Some(f),
        }
    }
    found.ok_or_else(|| "it holds no request line".into())
}

/// The text format one data line has.
fn line_format(l: &str) -> Option<TraceFormat> {
    let num = |s: &str| !s.is_empty() && s.trim().parse::<f64>().is_ok();
    let int = |s: &str| !s.is_empty() && s.trim().bytes().all(|b| b.is_ascii_digit());
    let c: Vec<&str> = l.split(',').map(str::trim).collect();
    let op = |s: &str| ["r", "w", "read", "write"].contains(&s.to_ascii_lowercase().as_str());
    match c.len() {
        // MSR: ticks,host,disk,Read|Write,offset,size,response
        7 if int(c[0]) && op(c[3]) && int(c[4]) && int(c[5]) => Some(TraceFormat::Msr),
        // SYSTOR without its header: time,response,R|W,lun,offset,size
        6 if num(c[0]) && op(c[2]) && int(c[4]) && int(c[5]) => Some(TraceFormat::Systor),
        // sce's CSV: time,op,volume,offset,len
        5 if int(c[0]) && op(c[1]) && int(c[3]) && int(c[4]) => {
            Some(TraceFormat::Csv(CsvSpec::default()))
        }
        // Tencent CBS: time_s,offset_sectors,size_sectors,0|1,volume
        5 if num(c[0]) && int(c[1]) && int(c[2]) && matches!(c[3], "0" | "1") => {
            Some(TraceFormat::Tencent)
        }
        1 => {
            // DiskSim: time_ns device lba_sectors size_sectors 1|0
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() == 5
                && num(w[0])
                && w[1..4].iter().all(|x| int(x))
                && matches!(w[4], "0" | "1"))
            .then_some(TraceFormat::DiskSim)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_is_recognised_and_junk_is_not() {
        let cases: &[(&[u8], &str)] = &[
            (b"SCETRACE\x01\x00", "sce"),
            (b"\x08\x00\x00\x00\x01\x00\x00\x00", "vscsi"),
            (
                b"128166385295514663,hm,0,Write,9056014336,2048,2833\n",
                "msr",
            ),
            (
                b"Timestamp,Response,IOType,LUN,Offset,Size\n1.5,0.1,R,0,512,4096\n",
                "systor",
            ),
            (b"1456095145.1,0.0008,W,0,899056122368,131072\n", "systor"),
            (b"1000,r,0,4096,4096\n2000,w,1,0,512\n", "csv"),
            (
                b"1538323200,2048,8,0,1283\n1538323201,16,8,1,1283\n",
                "tencent",
            ),
            (
                b"9385130000 4 26471903 16 0\n9388280000 3 19757057 16 1\n",
                "disksim",
            ),
            (b"# a comment\n\n1000,read,0,4096,4096\n", "csv"),
        ];
        for (head, want) in cases {
            let got = detect_in(head).unwrap_or_else(|e| panic!("{head:?}: {e}"));
            assert_eq!(
                got.to_string().split(':').next().unwrap(),
                *want,
                "{head:?}"
            );
        }
        for junk in [
            &b""[..],
            b"hello world\n",
            b"1,2,3\n",
            b"1000,r,0,4096,4096\n1 2 3 4 1\n",
        ] {
            assert!(detect_in(junk).is_err(), "{junk:?}");
        }
        // A head cut mid-line still detects from its whole lines.
        assert_eq!(
            detect_in(b"1000,r,0,4096,4096\n2000,w,0,8192,40").unwrap(),
            TraceFormat::Csv(CsvSpec::default())
        );
    }
}
