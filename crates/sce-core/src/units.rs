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

/// A time in Unix seconds as a UTC date and time, `2026-11-27 15:02:01 UTC` (for people:
/// `sce check` prints when a device was last shut down cleanly).
pub fn format_unix_time(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (the proleptic Gregorian calendar, in eras of
    // 400 years that start on March 1st).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as i64;
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_times() {
        assert_eq!(format_unix_time(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_unix_time(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(format_unix_time(1_700_000_000), "2023-11-14 22:13:20 UTC");
        assert_eq!(format_unix_time(4_107_542_399), "2100-02-28 23:59:59 UTC");
    }

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
