//! Human units: sizes like `1GiB`, `4G`, `512k`, durations like `2ms`, and their display;
//! the command line and the server's configuration parse with them, and the simulations
//! print and plot with them.

/// Parses a size: a number with an optional unit. `k`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB`,
/// `P`/`PiB` are powers of 1024; `KB`, `MB`, `GB`, `TB`, `PB` are powers of 1000; `B` or no
/// unit is bytes. Fractions are allowed when the result is a whole number of bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "invalid size {s:?}: expected a number with an optional unit, like 4GiB"
        ));
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "p" | "pib" => 1 << 50,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        u => {
            return Err(format!(
                "invalid size {s:?}: unknown unit {u:?} (use B, KiB, MiB, GiB, TiB, PiB)"
            ))
        }
    };
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| format!("size {s:?} is too large"));
    }
    let f: f64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: {num:?} is not a number"))?;
    let bytes = f * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 || bytes.fract() != 0.0 {
        return Err(format!("invalid size {s:?}: not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

/// Parses a duration: a number with a unit `ns`, `us`, `ms`, `s`, `m` (default seconds).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let f: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected a number and a unit, like 2ms"))?;
    let secs = match unit.trim() {
        "ns" => f / 1e9,
        "us" | "µs" => f / 1e6,
        "ms" => f / 1e3,
        "" | "s" => f,
        "m" | "min" => f * 60.0,
        u => {
            return Err(format!(
                "invalid duration {s:?}: unknown unit {u:?} (use ns, us, ms, s, m)"
            ))
        }
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("invalid duration {s:?}"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// Formats a byte count with a binary unit, e.g. `1.50 GiB`.
pub fn format_size(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("100TiB"), Ok(100 << 40));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("1XB").is_err());
        assert!(parse_size("99999999999PiB").is_err());
        assert!(parse_size("0.1B").is_err());
        assert_eq!(format_size(1536 << 20), "1.50 GiB");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("2ms").unwrap().as_micros(), 2000);
        assert_eq!(parse_duration("1.5s").unwrap().as_millis(), 1500);
        assert!(parse_duration("fast").is_err());
    }
}
