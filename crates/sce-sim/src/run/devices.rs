//! The device models of a simulation, from their description on the command line.

use crate::engine::DeviceModel;
use sce_core::units::{parse_duration, parse_size};

/// Parses `ssd=MODEL,source=MODEL` (either may be left out).
pub fn parse_device_models(s: &str) -> Result<(DeviceModel, DeviceModel), String> {
    let (mut ssd, mut source) = (DeviceModel::mercury_ssd(), DeviceModel::disk());
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("device model {part:?}: expected ssd=MODEL or source=MODEL"))?;
        let m = match v {
            "mercury-ssd" => DeviceModel::mercury_ssd(),
            "disk" => DeviceModel::disk(),
            _ => {
                let f: Vec<&str> = v.split('/').collect();
                if f.len() != 5 {
                    return Err(format!(
                        "device model {v:?}: expected mercury-ssd, disk or \
                         READ_LAT/WRITE_LAT/READ_BW/WRITE_BW/CHANNELS (240us/225us/110MB/39MB/8)"
                    ));
                }
                let lat = |x: &str| parse_duration(x).map(|d| d.as_nanos() as u64);
                let bw = |x: &str| {
                    parse_size(x).and_then(|b| {
                        if b == 0 {
                            Err(format!("bandwidth {x:?} must be > 0"))
                        } else {
                            Ok(b)
                        }
                    })
                };
                let channels: usize = f[4]
                    .parse()
                    .ok()
                    .filter(|&c| c > 0 && c <= 4096)
                    .ok_or_else(|| format!("channels {:?}: expected 1..=4096", f[4]))?;
                DeviceModel {
                    read_ns: lat(f[0])?,
                    write_ns: lat(f[1])?,
                    read_bw: bw(f[2])?,
                    write_bw: bw(f[3])?,
                    channels,
                }
            }
        };
        match k {
            "ssd" | "cache" => ssd = m,
            "source" => source = m,
            _ => {
                return Err(format!(
                    "device model {part:?}: unknown device {k:?} (ssd, source)"
                ))
            }
        }
    }
    Ok((ssd, source))
}
