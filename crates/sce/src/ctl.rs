//! `sce ctl`: inspect and change a running `sce serve` through its admin socket.

use crate::units::{format_size, parse_size};
use anyhow::{bail, Result};
use sce_server::admin::{call, Request};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod status;
use status::{print_exists, print_status};

/// Options of `sce ctl`.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  sce ctl -s /run/sce/lun0.sock status
  sce ctl -s /run/sce/lun0.sock stats --watch 2
  sce ctl -s /run/sce/lun0.sock set lun0 mode passthrough
  sce ctl -s /run/sce/lun0.sock exists 0 64MiB --json
  sce ctl -s /run/sce/lun0.sock evict 1GiB 256MiB
  sce ctl -s /run/sce/lun0.sock prefetch 0 1GiB
  sce ctl -s /run/sce/lun0.sock detach lun0      # serve from the source; the SSD is free
  sce ctl -s /run/sce/lun0.sock attach lun0      # warm again if nothing changed
  SCE_CTL=/run/sce/lun0.sock.ctl sce ctl flush")]
pub struct CtlArgs {
    /// The server's admin socket, or its data socket (PATH.ctl is then used if it exists).
    /// [default: $SCE_CTL]
    #[arg(short = 's', long, env = "SCE_CTL", value_name = "PATH", global = true)]
    pub socket: Option<PathBuf>,
    /// Print the server's reply as JSON.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub verb: Verb,
}

/// A control verb.
#[derive(clap::Subcommand, Debug)]
pub enum Verb {
    /// Exports, state, mode, occupancy, hit ratio, population and eviction rates, errors.
    Status(ExportArg),
    /// Every counter of the server and its exports.
    Stats {
        #[command(flatten)]
        export: ExportArg,
        /// Print again every this many seconds, with the rates since the last print.
        #[arg(long, value_name = "SECONDS")]
        watch: Option<f64>,
        /// With --watch: stop after this many prints (0: until interrupted).
        #[arg(long, default_value_t = 0)]
        count: u64,
    },
    /// Make every acknowledged write durable (NBD FLUSH of the export: on the source, and
    /// in writeback on the cache device).
    ///
    /// With --to-source, write-back data is also written to the source, which is then
    /// flushed: afterwards the source alone holds every acknowledged write.
    Flush {
        #[command(flatten)]
        export: ExportArg,
        /// Write every dirty (write-back) byte to the source and flush it.
        #[arg(long)]
        to_source: bool,
    },
    /// FlashTier's clean: write the dirty (write-back) data of a range to the source.
    Clean(RangeArgs),
    /// FlashTier's exists: what the cache holds of a range of the source.
    Exists(RangeArgs),
    /// FlashTier's evict: drop what the cache holds of a range (the source is untouched).
    Evict(RangeArgs),
    /// Read a range into the cache now (as NBD CACHE does).
    Prefetch(RangeArgs),
    /// Drop everything clean cached for an export (its source changed behind sce's back),
    /// and write the records so that no crash brings it back. Write-back's dirty pages, the
    /// only copy of acknowledged writes, are kept (the reply says how many).
    Forget(ExportArg),
    /// Detach an export's cache: the export goes on serving from its source alone, and the
    /// cache device is flushed, left clean and released (sce check can read it).
    Detach(ExportArg),
    /// Attach a cache device to an export again (the last one, or CACHE): warm if it still
    /// matches the source, less the ranges written while detached if it is the device that
    /// was detached (else cold after writes, and past 4096 ranges). The start's --force,
    /// --reformat and --forget-volume do not apply, and another export's device is refused.
    Attach {
        #[command(flatten)]
        export: ExportArg,
        /// The cache device (default: the one detached).
        cache: Option<PathBuf>,
    },
    /// Shared mode's warm migration: move the regions this host owns for writing to host
    /// HOST, and publish what it caches of an export, hottest first, for HOST, which reads
    /// it into its own cache in the background (a VM moved there starts warm; this host's
    /// later writes there are published to HOST). Example: sce ctl -s /run/sce.sock
    /// handoff vm1 --to host-b
    Handoff {
        #[command(flatten)]
        export: ExportArg,
        /// The receiving server's --host-name.
        #[arg(long, value_name = "HOST")]
        to: String,
    },
    /// Change a setting of a running export: mode (writethrough, writethrough-sync,
    /// writearound, passthrough, writeback), admission (sce, sce-paper, always, nhit:K),
    /// seq-cutoff (SIZE, 0 for none), population-rate (auto, auto:SIZE, SIZE, unlimited),
    /// writeback-low-watermark and writeback-high-watermark (a share of the write-back log,
    /// like 40%) or writeback-rate (SIZE per second, unlimited). Settings stay across a detach and attach. Entering or leaving writeback
    /// reopens the cache (requests wait a moment, it stays warm; a device without a log is
    /// formatted afresh with one, cold); leaving it writes the
    /// dirty data to the source first, with progress in the server's log. Example: sce ctl
    /// set mode writethrough --no-wait (or, naming the export, set lun0 mode writethrough)
    Set {
        /// [EXPORT] KEY VALUE: the export (default: the only or the default one); the key
        /// (mode, admission, seq-cutoff, population-rate, writeback-low-watermark,
        /// writeback-high-watermark or writeback-rate); the new value.
        #[arg(num_args = 2..=3, required = true, value_name = "[EXPORT] KEY VALUE")]
        args: Vec<String>,
        /// The export (the same as naming it first).
        #[arg(long = "export", value_name = "EXPORT")]
        export_flag: Option<String>,
        /// Leaving writeback: refuse if the cache holds dirty data (not write it back first).
        #[arg(long)]
        no_wait: bool,
        /// Also write the new value into the server's TOML file (its --config; the export's
        /// table, and those sharing its cache device), so that a restart keeps it.
        #[arg(long)]
        save: bool,
    },
}

/// The admin socket for `given`: itself, or `given.ctl` if that exists (a data socket).
pub fn admin_socket(given: Option<&Path>) -> Result<PathBuf> {
    let Some(p) = given else {
        bail!("give the server's socket: sce ctl -s PATH (or set SCE_CTL)");
    };
    let ctl = sce_server::admin::default_path(p);
    Ok(if ctl.exists() { ctl } else { p.to_path_buf() })
}

/// A range of an export, as the range verbs (clean, exists, evict, prefetch) take it.
#[derive(clap::Args, Debug)]
pub struct RangeArgs {
    /// First byte (sizes take units: 1GiB).
    #[arg(value_parser = parse_size)]
    offset: u64,
    /// Length in bytes.
    #[arg(value_parser = parse_size)]
    len: u64,
    /// The export (default: the only or the default one).
    #[arg(long)]
    export: Option<String>,
}

/// An export named by a verb: positionally (as before) or with --export; default: the
/// only export, or the default one ("").
#[derive(clap::Args, Debug)]
pub struct ExportArg {
    /// The export (default: the only or the default one; "" names the default one).
    #[arg(value_name = "EXPORT")]
    export: Option<String>,
    /// The export (the same as naming it first).
    #[arg(long = "export", value_name = "EXPORT")]
    export_flag: Option<String>,
}

impl ExportArg {
    fn name(self) -> Option<String> {
        self.export_flag.or(self.export)
    }

    /// Refuses an export named twice, differently.
    fn check(&self) -> Result<()> {
        match (&self.export_flag, &self.export) {
            (Some(f), Some(p)) if f != p => {
                bail!("the export is named twice: {p:?} and --export {f:?}")
            }
            _ => Ok(()),
        }
    }
}

/// Refuses what a verb's arguments say twice or not at all.
fn check(verb: &mut Verb) -> Result<()> {
    match verb {
        Verb::Status(e) | Verb::Forget(e) | Verb::Detach(e) => e.check(),
        Verb::Stats { export, .. } | Verb::Flush { export, .. } | Verb::Handoff { export, .. } => {
            export.check()
        }
        // `attach --export NAME CACHE`: the one positional is the cache.
        Verb::Attach { export, cache } => {
            if export.export_flag.is_some() && cache.is_none() {
                if let Some(p) = export.export.take() {
                    *cache = Some(PathBuf::from(p));
                }
            }
            export.check()
        }
        Verb::Set {
            args, export_flag, ..
        } => match (export_flag, args.len()) {
            (Some(f), 3) if *f != args[0] => {
                bail!(
                    "the export is named twice: {:?} and --export {f:?}",
                    args[0]
                )
            }
            _ => Ok(()),
        },
        _ => Ok(()),
    }
}

/// The request of range verb `verb` over `r`.
fn range_req(verb: &str, r: RangeArgs) -> Request {
    Request {
        verb: verb.into(),
        export: r.export,
        offset: Some(r.offset),
        len: Some(r.len),
        ..Request::default()
    }
}

/// How a reply is shown to a person.
type Render = fn(&Value);

fn simple(verb: &str, export: Option<String>) -> Request {
    Request {
        verb: verb.into(),
        export,
        ..Request::default()
    }
}

/// The request of a verb (other than `stats`) and how its reply is shown.
fn request(verb: Verb) -> (Request, Render) {
    match verb {
        Verb::Status(e) => (simple("status", e.name()), print_status),
        Verb::Stats { export, .. } => (simple("stats", export.name()), |v| print_stats(v, None)),
        Verb::Flush { export, to_source } => {
            let mut r = simple("flush", export.name());
            r.to_source = to_source;
            (r, |v| {
                println!("flushed: {}", list(&v["flushed"]));
                for d in v["to_source"].as_array().into_iter().flatten() {
                    println!(
                        "  export {:?}: {} written back to the source in {}",
                        d["export"].as_str().unwrap_or("?"),
                        size(&d["bytes_written_back"]),
                        seconds(&d["seconds"])
                    );
                }
            })
        }
        Verb::Clean(r) => (range_req("clean", r), |v| {
            println!("written back: {}", size(&v["bytes_written_back"]));
        }),
        Verb::Exists(r) => (range_req("exists", r), print_exists),
        Verb::Evict(r) => (range_req("evict", r), |v| {
            println!("evicted {}", size(&v["evicted_bytes"]));
        }),
        Verb::Prefetch(r) => (range_req("prefetch", r), |v| {
            println!(
                "fetched {}; {} of {} now cached",
                size(&v["fetched_bytes"]),
                size(&v["cached_bytes"]),
                size(&v["len"])
            );
            if let Some(why) = v["short_because"].as_str() {
                println!("not all of it: {why}");
            }
        }),
        Verb::Forget(e) => (simple("forget", e.name()), print_forget),
        Verb::Detach(e) => (simple("detach", e.name()), print_detach),
        Verb::Handoff { export, to } => {
            let mut r = simple("handoff", export.name());
            r.value = Some(to);
            (r, |v| {
                println!(
                    "handed off {} fragment(s), {} cached, hottest first; {} owned region(s) moved",
                    v["fragments"],
                    size(&v["bytes"]),
                    v["regions_moved"]
                );
            })
        }
        Verb::Attach { export, cache } => (
            Request {
                verb: "attach".into(),
                export: export.name(),
                value: cache.map(|p| p.display().to_string()),
                ..Request::default()
            },
            print_attach,
        ),
        Verb::Set {
            args,
            export_flag,
            no_wait,
            save,
        } => (set_req(args, export_flag, (no_wait, save)), print_set),
    }
}

/// The request of `set [EXPORT] KEY VALUE`.
fn set_req(
    mut args: Vec<String>,
    export_flag: Option<String>,
    (no_wait, save): (bool, bool),
) -> Request {
    let value = args.pop();
    let key = args.pop();
    Request {
        verb: "set".into(),
        export: export_flag.or(args.pop()),
        key,
        value,
        no_wait,
        save,
        ..Request::default()
    }
}

/// Runs `sce ctl`.
pub fn ctl(a: CtlArgs) -> Result<()> {
    let path = admin_socket(a.socket.as_deref())?;
    let mut a = a;
    check(&mut a.verb)?;
    if let Verb::Stats {
        watch: Some(secs),
        count,
        ..
    } = &a.verb
    {
        let (secs, count) = (*secs, *count);
        let (req, _) = request(a.verb);
        return watch_stats(&path, &req, secs, count, a.json);
    }
    let (req, render) = request(a.verb);
    let v = call(&path, &req)?;
    if req.save && v["saved_to"].is_null() {
        bail!("the setting was applied but not saved: this server predates `set --save`");
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        render(&v);
    }
    Ok(())
}

fn print_forget(v: &Value) {
    println!(
        "forgot {} fragment(s) of export {}",
        v["fragments_dropped"], v["export"]
    );
    let (dirty, lost) = (
        v["dirty_pages_kept"].as_u64(),
        v["lost_pages_kept"].as_u64(),
    );
    if dirty.unwrap_or(0) + lost.unwrap_or(0) > 0 {
        println!(
            "kept {} dirty page(s) (write-back data the source does not have yet) and {} lost \
             page(s): forget drops clean data only; `sce ctl flush --to-source` writes them back",
            dirty.unwrap_or(0),
            lost.unwrap_or(0)
        );
    }
}

fn print_detach(v: &Value) {
    println!(
        "detached {} from export {} in {}{}",
        v["cache"].as_str().unwrap_or("?"),
        v["export"],
        seconds(&v["seconds"]),
        if v["left_clean"] == Value::Bool(true) {
            "; left clean"
        } else {
            "; NOT left clean: the next attach recovers it as after a crash"
        }
    );
}

/// A duration in seconds, as a reply gives it.
fn seconds(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "?".into(), |s| format!("{s:.1} s"))
}

fn print_attach(v: &Value) {
    let how = match v["cold_because"].as_str() {
        Some(why) => format!("cold: {why}"),
        None => format!("warm: {} fragment(s) restored", v["fragments_restored"]),
    };
    println!(
        "attached {} to export {}, {how}",
        v["cache"].as_str().unwrap_or("?"),
        v["export"]
    );
    let whose = if v["settings_kept"] == Value::Bool(true) {
        "as before the detach, or as set since"
    } else {
        "the configuration's"
    };
    println!("settings ({whose}): {}", settings(v));
}

/// The settings in a `set` or `attach` reply, in a line.
fn settings(v: &Value) -> String {
    let rate = match v["population_rate_bytes_per_second"].as_u64() {
        Some(0) => "unlimited".to_string(),
        Some(n) => format!("{}/s", format_size(n)),
        None => "?".into(),
    };
    let adaptive = if v["population_rate_adaptive"] == Value::Bool(true) {
        " (adaptive)"
    } else {
        ""
    };
    let pct = |k: &str| {
        v[k].as_f64()
            .map_or("?".into(), |x| format!("{:.0}%", x * 100.0))
    };
    let wb_rate = match v["writeback_rate_bytes_per_second"].as_u64() {
        Some(0) => "unlimited".to_string(),
        Some(n) => format!("{}/s", format_size(n)),
        None => "?".into(),
    };
    format!(
        "mode {}, admission {}, seq-cutoff {}, population rate {rate}{adaptive}, write-back \
         cleaning from {} (urgent above {}) at {wb_rate}",
        v["mode"].as_str().unwrap_or("?"),
        v["admission"].as_str().unwrap_or("?"),
        size(&v["sequential_cutoff_bytes"]),
        pct("writeback_low_watermark"),
        pct("writeback_high_watermark"),
    )
}

fn print_set(v: &Value) {
    println!("export {}: {}", v["export"], settings(v));
    if v["reopened"] == Value::Bool(true) {
        println!(
            "the cache was reopened in the new mode ({} of dirty data written to the source \
             first, in {})",
            size(&v["drained_bytes"]),
            seconds(&v["drain_seconds"])
        );
    }
    if v["detached"] == Value::Bool(true) {
        println!("the export is detached: its cache serves it with these settings once attached");
    }
    if let Some(f) = v["saved_to"].as_str() {
        println!("saved to {f}");
    }
}

fn size(v: &Value) -> String {
    v.as_u64().map_or_else(|| "?".into(), format_size)
}

fn list(v: &Value) -> String {
    let names: Vec<String> = v
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| format!("{n}"))
        .collect();
    if names.is_empty() {
        "nothing".into()
    } else {
        names.join(", ")
    }
}

/// The counters `stats` shows per export, with how to render each.
const SHOWN: [(&str, &str, Kind); 14] = [
    ("read_requests", "read requests", Kind::Count),
    ("write_requests", "write requests", Kind::Count),
    ("read_hit_ratio", "read hit ratio", Kind::Ratio),
    ("read_pages_hit", "pages hit", Kind::Count),
    ("read_pages_missed", "pages missed", Kind::Count),
    ("cache_bytes_read", "cache read", Kind::Bytes),
    ("cache_bytes_written", "cache written", Kind::Bytes),
    ("source_bytes_read", "source read", Kind::Bytes),
    ("source_bytes_written", "source written", Kind::Bytes),
    ("fragments_populated", "populated", Kind::Count),
    ("fragments_evicted", "evicted", Kind::Count),
    ("free_slots", "free slots", Kind::Count),
    ("cache_checksum_errors", "checksum errors", Kind::Count),
    ("cache_write_errors", "write errors", Kind::Count),
];

#[derive(Clone, Copy)]
enum Kind {
    Count,
    Bytes,
    Ratio,
}

/// Prints a stats document in aligned columns; with `prev` (and the seconds between),
/// also each counter's rate.
pub fn print_stats(v: &Value, prev: Option<(&Value, f64)>) {
    println!(
        "{:<18} {:>14}",
        "connections",
        format!("{} ({} open)", v["connections"], v["open_connections"])
    );
    println!(
        "{:<18} {:>14}",
        "requests",
        format!("{} ({} errors)", v["requests"], v["request_errors"])
    );
    for (name, e) in v["exports"].as_object().into_iter().flatten() {
        println!("export {name:?}");
        if e["cached"] != Value::Bool(true) {
            println!("  not cached");
            continue;
        }
        for (key, label, kind) in SHOWN {
            let x = &e[key];
            let shown = match kind {
                Kind::Count => x.as_u64().map_or("-".into(), |n| n.to_string()),
                Kind::Bytes => size(x),
                Kind::Ratio => x
                    .as_f64()
                    .map_or("-".into(), |r| format!("{:.1}%", r * 100.0)),
            };
            let rate = prev.and_then(|(p, dt)| {
                let before = p["exports"][name][key].as_u64()?;
                let now = x.as_u64()?;
                let r = now.saturating_sub(before) as f64 / dt.max(1e-9);
                Some(match kind {
                    Kind::Bytes => format!("{}/s", format_size(r as u64)),
                    Kind::Count => format!("{r:.1}/s"),
                    Kind::Ratio => return None,
                })
            });
            match rate {
                Some(r) => println!("  {label:<16} {shown:>14} {r:>14}"),
                None => println!("  {label:<16} {shown:>14}"),
            }
        }
    }
}

fn watch_stats(path: &Path, req: &Request, secs: f64, count: u64, json: bool) -> Result<()> {
    if !(secs.is_finite() && secs > 0.0) {
        bail!("--watch takes a positive number of seconds");
    }
    let mut prev: Option<(Value, std::time::Instant)> = None;
    let mut n = 0;
    loop {
        let v = call(path, req)?;
        let now = std::time::Instant::now();
        if json {
            println!("{}", serde_json::to_string(&v)?);
        } else {
            if n > 0 {
                println!();
            }
            print_stats(
                &v,
                prev.as_ref()
                    .map(|(p, t)| (p, now.duration_since(*t).as_secs_f64())),
            );
        }
        prev = Some((v, now));
        n += 1;
        if count > 0 && n >= count {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs_f64(secs));
    }
}
