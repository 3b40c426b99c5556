//! How write-back cleans (issue 45), as an operator steers it (in the spirit of
//! dm-writecache's `low_watermark`/`high_watermark` and bcache's `writeback_rate`): the share
//! of the write-back log that dirty data may fill before the cleaner starts, the share above
//! which cleaning is urgent, and the rate of background cleaning. The server's log applies
//! them; `sce ctl set` changes them at run time.

use crate::config::ConfigError;

/// The cleaner's watermarks and rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WritebackTuning {
    /// The share of the log in use from which the cleaner cleans in the background (gently:
    /// 16 source writes in flight, a lower CPU priority, `rate`).
    pub low_watermark: f64,
    /// The share of the log in use above which cleaning is urgent: 64 source writes in
    /// flight, the clients' CPU priority, no rate limit. Writers waiting for room, and
    /// `flush --to-source`, make it urgent too.
    pub high_watermark: f64,
    /// Bytes per second that background cleaning writes to the source at most (0: no
    /// limit). Urgent cleaning is never limited: a write never waits for room because of it.
    pub rate: u64,
}

impl Default for WritebackTuning {
    fn default() -> Self {
        WritebackTuning {
            low_watermark: 0.25,
            high_watermark: 0.75,
            rate: 0,
        }
    }
}

impl WritebackTuning {
    /// Checks the watermarks: `0 <= low < high <= 1`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let (lo, hi) = (self.low_watermark, self.high_watermark);
        if !(0.0..=1.0).contains(&lo) || !(0.0..=1.0).contains(&hi) {
            return Err(ConfigError::new(
                "writeback_watermark",
                format!("{lo} and {hi} must be shares of the log, within 0 ..= 1 (0% to 100%)"),
            ));
        }
        if lo >= hi {
            return Err(ConfigError::new(
                "writeback_low_watermark",
                format!(
                    "{}% must be below the high watermark, {}%",
                    lo * 100.0,
                    hi * 100.0
                ),
            ));
        }
        Ok(())
    }

    /// Positions of a ring of `blocks` in use from which background cleaning starts.
    pub fn low_blocks(&self, blocks: u64) -> u64 {
        share_of(blocks, millionths(self.low_watermark))
    }

    /// True if a ring of `blocks` with `room` positions left is past the high watermark
    /// (less room than the high watermark leaves): cleaning is urgent.
    pub fn past_high(&self, blocks: u64, room: u64) -> bool {
        past_high(blocks, room, millionths(self.high_watermark))
    }
}

/// A share in millionths (how the server keeps a watermark for lock-free reads).
pub fn millionths(share: f64) -> u64 {
    (share * 1e6).round() as u64
}

/// `millionths` of `blocks`, rounded down.
pub fn share_of(blocks: u64, millionths: u64) -> u64 {
    (u128::from(blocks) * u128::from(millionths) / 1_000_000) as u64
}

/// True if a ring of `blocks` with `room` left is past a high watermark of `high`
/// millionths: the rule both the server's cleaner and the simulator's follow.
pub fn past_high(blocks: u64, room: u64, high: u64) -> bool {
    room < blocks - share_of(blocks, high)
}

/// A share given as "40%" or "0.4".
pub fn parse_share(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let v = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|x| x / 100.0),
        None => t.parse::<f64>(),
    };
    match v {
        Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
        _ => Err(format!("{s:?} is not a share (like \"40%\" or 0.4)")),
    }
}

/// A background cleaning rate: SIZE per second ("64MiB", "64MiB/s"), or 0 / "unlimited".
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let v = s.trim();
    let v = v.strip_suffix("/s").unwrap_or(v);
    if v == "unlimited" {
        return Ok(0);
    }
    crate::units::parse_size(v).map_err(|e| format!("{s:?}: {e} (SIZE per second, or unlimited)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermarks_are_ordered_shares() {
        assert!(WritebackTuning::default().validate().is_ok());
        let t = |lo, hi| WritebackTuning {
            low_watermark: lo,
            high_watermark: hi,
            rate: 0,
        };
        assert!(t(0.0, 1.0).validate().is_ok());
        assert!(t(0.5, 0.5).validate().is_err());
        assert!(t(0.6, 0.5).validate().is_err());
        assert!(t(0.1, 1.5).validate().is_err());
        assert_eq!(parse_share("40%"), Ok(0.4));
        assert_eq!(parse_share("0.25"), Ok(0.25));
        assert!(parse_share("140%").is_err());
        assert!(parse_share("half").is_err());
        assert_eq!(parse_rate("64MiB/s"), Ok(64 << 20));
        assert_eq!(parse_rate("unlimited"), Ok(0));
        assert!(parse_rate("fast").is_err());
    }
}
