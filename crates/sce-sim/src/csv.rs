//! The generic CSV trace format: which column holds what, in which unit, described by a
//! column spec, so that a trace from any tool can be read without writing a parser.
//!
//! Spec syntax (the part after `csv:`; every key is optional, defaults in brackets):
//! ```text
//! time=COL [0]  op=COL [1]  volume=COL|none [2]  offset=COL [3]  len=COL [4]
//! unit=byte|sector|4k [byte]          offset and len unit (sector = 512 B, 4k = 4096 B)
//! time_unit=s|ms|us|ns|100ns [ns]     time unit; fractions are read (`1.25` s)
//! header=N [0]                         lines to skip at the top
//! sep=comma|tab|space|semicolon|pipe [comma]   space splits on any run of blanks
//! read=TOKEN  write=TOKEN              op values; by default r, read, w, write (any case)
//! ```
//! Columns count from 0. Lines that are empty or start with `#` are skipped. `csv` alone is
//! the layout `sce trace convert --out-format csv` writes:
//! `# time_ns,op,volume,offset,len` then `12000,R,0,4096,8192`.

use crate::request::{IoKind, TraceRequest};

/// The field separator.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Separator {
    /// One byte, e.g. `,` or `\t`.
    Byte(u8),
    /// Any run of spaces or tabs.
    Blanks,
}

/// Where the fields of a request are in a CSV line, and their units.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CsvSpec {
    /// Column of the time.
    pub time: usize,
    /// Column of the operation.
    pub op: usize,
    /// Column of the volume, if any (else volume 0).
    pub volume: Option<usize>,
    /// Column of the offset.
    pub offset: usize,
    /// Column of the length.
    pub len: usize,
    /// Bytes per unit of offset and length.
    pub unit: u64,
    /// Nanoseconds per unit of time.
    pub time_unit_ns: u64,
    /// Lines to skip at the top of the file.
    pub header: u64,
    /// Field separator.
    pub sep: Separator,
    /// The op value that means read, if not the defaults.
    pub read: Option<String>,
    /// The op value that means write, if not the defaults.
    pub write: Option<String>,
}

impl Default for CsvSpec {
    fn default() -> Self {
        CsvSpec {
            time: 0,
            op: 1,
            volume: Some(2),
            offset: 3,
            len: 4,
            unit: 1,
            time_unit_ns: 1,
            header: 0,
            sep: Separator::Byte(b','),
            read: None,
            write: None,
        }
    }
}

impl std::str::FromStr for CsvSpec {
    type Err = String;
    /// Parses the part after `csv:` (see the module documentation).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut spec = CsvSpec::default();
        for kv in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("csv spec: {kv:?} is not key=value"))?;
            let col = |v: &str| {
                v.parse::<usize>()
                    .ok()
                    .filter(|&c| c < 1024)
                    .ok_or_else(|| format!("csv spec: {k}={v:?} is not a column number (0..1023)"))
            };
            match k {
                "time" => spec.time = col(v)?,
                "op" => spec.op = col(v)?,
                "offset" => spec.offset = col(v)?,
                "len" => spec.len = col(v)?,
                "volume" if v == "none" => spec.volume = None,
                "volume" => spec.volume = Some(col(v)?),
                "unit" => {
                    spec.unit = match v {
                        "byte" | "bytes" | "b" => 1,
                        "sector" | "sectors" | "512" => 512,
                        "4k" | "block" | "4096" => 4096,
                        _ => return Err(format!("csv spec: unit={v:?} (byte, sector or 4k)")),
                    }
                }
                "time_unit" => {
                    spec.time_unit_ns = match v {
                        "s" => 1_000_000_000,
                        "ms" => 1_000_000,
                        "us" => 1_000,
                        "100ns" => 100,
                        "ns" => 1,
                        _ => {
                            return Err(format!(
                                "csv spec: time_unit={v:?} (s, ms, us, 100ns or ns)"
                            ))
                        }
                    }
                }
                "header" => {
                    spec.header = v
                        .parse()
                        .map_err(|_| format!("csv spec: header={v:?} is not a line count"))?
                }
                "sep" => {
                    spec.sep = match v {
                        "comma" => Separator::Byte(b','),
                        "tab" => Separator::Byte(b'\t'),
                        "semicolon" | ";" => Separator::Byte(b';'),
                        "pipe" | "|" => Separator::Byte(b'|'),
                        "space" => Separator::Blanks,
                        _ => {
                            return Err(format!(
                                "csv spec: sep={v:?} (comma, tab, space, semicolon or pipe)"
                            ))
                        }
                    }
                }
                "read" if !v.is_empty() => spec.read = Some(v.to_string()),
                "write" if !v.is_empty() => spec.write = Some(v.to_string()),
                _ => return Err(format!("csv spec: unknown key or empty value in {kv:?}")),
            }
        }
        let mut cols = vec![spec.time, spec.op, spec.offset, spec.len];
        cols.extend(spec.volume);
        let n = cols.len();
        cols.sort_unstable();
        cols.dedup();
        if cols.len() != n {
            return Err("csv spec: two fields share a column".into());
        }
        if spec.read.is_some() && spec.read == spec.write {
            return Err("csv spec: read and write are the same token".into());
        }
        Ok(spec)
    }
}

impl std::fmt::Display for CsvSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let vol = self.volume.map_or("none".to_string(), |v| v.to_string());
        let unit = match self.unit {
            512 => "sector",
            4096 => "4k",
            _ => "byte",
        };
        let tu = match self.time_unit_ns {
            1_000_000_000 => "s",
            1_000_000 => "ms",
            1_000 => "us",
            100 => "100ns",
            _ => "ns",
        };
        let sep = match self.sep {
            Separator::Blanks => "space",
            Separator::Byte(b'\t') => "tab",
            Separator::Byte(b';') => "semicolon",
            Separator::Byte(b'|') => "pipe",
            Separator::Byte(_) => "comma",
        };
        write!(
            f,
            "csv:time={},op={},volume={vol},offset={},len={},unit={unit},time_unit={tu},header={},sep={sep}",
            self.time, self.op, self.offset, self.len, self.header
        )?;
        if let Some(r) = &self.read {
            write!(f, ",read={r}")?;
        }
        if let Some(w) = &self.write {
            write!(f, ",write={w}")?;
        }
        Ok(())
    }
}

impl CsvSpec {
    fn fields<'a>(&self, line: &'a str, out: &mut Vec<&'a str>) {
        out.clear();
        match self.sep {
            Separator::Byte(b) => out.extend(line.split(b as char).map(str::trim)),
            Separator::Blanks => out.extend(line.split_whitespace()),
        }
    }

    fn kind(&self, s: &str) -> Result<IoKind, String> {
        match (&self.read, &self.write) {
            (None, None) => match s.to_ascii_lowercase().as_str() {
                "r" | "read" => Ok(IoKind::Read),
                "w" | "write" => Ok(IoKind::Write),
                _ => Err(format!("field op: {s:?} is neither read nor write")),
            },
            (r, w) => {
                let is_read = r.as_deref() == Some(s) || (r.is_none() && w.as_deref() != Some(s));
                let is_write = w.as_deref() == Some(s) || (w.is_none() && r.as_deref() != Some(s));
                if is_read {
                    Ok(IoKind::Read)
                } else if is_write {
                    Ok(IoKind::Write)
                } else {
                    Err(format!(
                        "field op: {s:?} is neither {:?} nor {:?}",
                        r.as_deref().unwrap_or(""),
                        w.as_deref().unwrap_or("")
                    ))
                }
            }
        }
    }

    /// Parses one line (not a comment or a header line). `scratch` is reused between calls.
    pub fn parse<'a>(
        &self,
        line: &'a str,
        scratch: &mut Vec<&'a str>,
    ) -> Result<TraceRequest, String> {
        self.fields(line, scratch);
        let get = |c: usize, what: &str| {
            scratch
                .get(c)
                .copied()
                .ok_or_else(|| format!("missing field {what} (column {c})"))
        };
        let int = |c: usize, what: &str| -> Result<u64, String> {
            let s = get(c, what)?;
            s.parse::<u64>()
                .map_err(|_| format!("field {what}: {s:?} is not a number"))
        };
        let t = get(self.time, "time")?;
        let time_ns = decimal_to_ns(t, self.time_unit_ns)
            .ok_or_else(|| format!("field time: {t:?} is not a number"))?;
        let kind = self.kind(get(self.op, "op")?)?;
        let volume = match self.volume {
            None => 0,
            Some(c) => {
                let s = get(c, "volume")?;
                s.parse::<u32>()
                    .map_err(|_| format!("field volume: {s:?} is not a number"))?
            }
        };
        let offset = int(self.offset, "offset")?
            .checked_mul(self.unit)
            .ok_or("field offset: overflows")?;
        let len = int(self.len, "len")?
            .checked_mul(self.unit)
            .ok_or("field len: overflows")?;
        Ok(TraceRequest {
            time_ns,
            kind,
            volume,
            offset,
            len,
        })
    }

    /// The comment line written at the top of a file in this layout.
    pub fn header_line(&self) -> String {
        let mut names = vec![""; self.columns()];
        names[self.time] = "time";
        names[self.op] = "op";
        names[self.offset] = "offset";
        names[self.len] = "len";
        if let Some(v) = self.volume {
            names[v] = "volume";
        }
        format!("# {}", names.join(self.sep_str()))
    }

    fn columns(&self) -> usize {
        1 + [
            self.time,
            self.op,
            self.offset,
            self.len,
            self.volume.unwrap_or(0),
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
    }

    fn sep_str(&self) -> &'static str {
        match self.sep {
            Separator::Blanks => " ",
            Separator::Byte(b'\t') => "\t",
            Separator::Byte(b';') => ";",
            Separator::Byte(b'|') => "|",
            Separator::Byte(_) => ",",
        }
    }

    /// Formats one request as a line (without the newline). Errors if an offset or length
    /// is not a whole number of units.
    pub fn format(&self, r: &TraceRequest) -> Result<String, String> {
        if !r.offset.is_multiple_of(self.unit) || !r.len.is_multiple_of(self.unit) {
            return Err(format!(
                "offset {} or length {} is not a multiple of the {}-byte unit",
                r.offset, r.len, self.unit
            ));
        }
        let mut cols = vec![String::new(); self.columns()];
        cols[self.time] = if self.time_unit_ns == 1 {
            r.time_ns.to_string()
        } else {
            let whole = r.time_ns / self.time_unit_ns;
            let frac = r.time_ns % self.time_unit_ns;
            if frac == 0 {
                whole.to_string()
            } else {
                let digits = (self.time_unit_ns as f64).log10().round() as usize;
                format!("{whole}.{frac:0digits$}")
            }
        };
        cols[self.op] = match r.kind {
            IoKind::Read => self.read.clone().unwrap_or_else(|| "R".into()),
            IoKind::Write => self.write.clone().unwrap_or_else(|| "W".into()),
        };
        if self.read.is_some() != self.write.is_some() {
            return Err("csv spec: to write, give both read= and write= (or neither)".into());
        }
        if let Some(v) = self.volume {
            cols[v] = r.volume.to_string();
        } else if r.volume != 0 {
            return Err(format!(
                "volume {} cannot be written: the spec has volume=none",
                r.volume
            ));
        }
        cols[self.offset] = (r.offset / self.unit).to_string();
        cols[self.len] = (r.len / self.unit).to_string();
        Ok(cols.join(self.sep_str()))
    }
}

/// A non-negative decimal number of `unit_ns` units, in nanoseconds: exact for plain
/// decimals (`12.000000001`), through floating point for other notations (`1e3`).
pub(crate) fn decimal_to_ns(s: &str, unit_ns: u64) -> Option<u64> {
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let digits = |x: &str| x.bytes().all(|b| b.is_ascii_digit());
    if !int.is_empty() && digits(int) && digits(frac) && frac.len() <= 18 {
        let i: u128 = int.parse().ok()?;
        let f: u128 = if frac.is_empty() {
            0
        } else {
            frac.parse().ok()?
        };
        let ns = i * unit_ns as u128 + f * unit_ns as u128 / 10u128.pow(frac.len() as u32);
        return u64::try_from(ns).ok();
    }
    let v: f64 = s.parse().ok()?;
    (v.is_finite() && v >= 0.0 && v * (unit_ns as f64) < u64::MAX as f64)
        .then_some((v * unit_ns as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_round_trips_and_rejects_nonsense() {
        let s: CsvSpec = "time=1,op=0,offset=2,len=3,volume=none,unit=sector,time_unit=us,sep=tab,read=0,write=1"
            .parse()
            .unwrap();
        let shown = s.to_string();
        assert_eq!(
            shown
                .strip_prefix("csv:")
                .unwrap()
                .parse::<CsvSpec>()
                .unwrap(),
            s
        );
        let r = TraceRequest {
            time_ns: 1_500,
            kind: IoKind::Write,
            volume: 0,
            offset: 1024,
            len: 4096,
        };
        let line = s.format(&r).unwrap();
        assert_eq!(line, "1\t1.500\t2\t8");
        let mut scratch = Vec::new();
        assert_eq!(s.parse(&line, &mut scratch).unwrap(), r);
        assert!("time=0,op=0".parse::<CsvSpec>().is_err());
        assert!("unit=furlong".parse::<CsvSpec>().is_err());
        assert!("time".parse::<CsvSpec>().is_err());
        assert!("colour=red".parse::<CsvSpec>().is_err());
        let d = CsvSpec::default();
        assert_eq!(d.header_line(), "# time,op,volume,offset,len");
        let e = d.parse("1,R,0,x,8", &mut scratch).unwrap_err();
        assert!(e.contains("offset") && e.contains("not a number"), "{e}");
        let e = d.parse("1,R,0", &mut scratch).unwrap_err();
        assert!(e.contains("missing field offset"), "{e}");
    }
}
