//! `sce format` creates a persistent cache device; `sce check` verifies one, like fsck.

use crate::units::{format_size, parse_size};
use anyhow::{bail, Context, Result};
use sce_io::{BlockDevice, DirectMode, FileDevice, FileOptions};
use sce_store::{CheckReport, DeviceState, FormatOptions, Superblock, Volume};
use std::path::PathBuf;

/// Options of `sce format`.
#[derive(clap::Args, Debug)]
pub struct FormatArgs {
    /// The cache device (file or block device) to format.
    pub cache: PathBuf,
    /// The source it will cache: a file, a block device, or an NBD URI. Its name and size go
    /// into the volume table; `sce serve` refuses the device for any other source.
    #[arg(long)]
    pub source: String,
    /// The source's size, if it cannot be read here (an NBD URI not reachable now).
    #[arg(long, value_parser = parse_size)]
    pub source_size: Option<u64>,
    /// The source's name in the volume table (default: its canonical path, or its URI).
    #[arg(long)]
    pub source_name: Option<String>,
    /// Line size: the unit of cache space, one slot of the device (`serve` counts heat per
    /// 1MiB fragment over lines smaller than that): a power of two from 4KiB to 64MiB.
    /// [default: 512KiB, the line of `serve`'s default geometry]
    #[arg(long, value_parser = parse_size)]
    pub line_size: Option<u64>,
    /// The old name of --line-size (it named the slot, which `serve` calls a line); accepted
    /// with a warning.
    #[arg(long, value_parser = parse_size, hide = true, conflicts_with = "line_size")]
    pub fragment_size: Option<u64>,
    /// Create the cache file with this size if it does not exist.
    #[arg(long, value_parser = parse_size)]
    pub cache_size: Option<u64>,
    /// Format even if the device already holds an sce cache, or data that is not an sce
    /// cache (its contents are lost).
    #[arg(long)]
    pub force: bool,
    /// With --force: give up the dirty write-back data of this volume (its name in the
    /// device's table, as `sce check` prints it; or `all`). Without it, formatting a device
    /// that holds dirty data is refused. Repeatable.
    #[arg(long, value_name = "VOLUME")]
    pub discard_dirty: Vec<String>,
    /// Give the device a write-back log of this size, for `--mode writeback` and live
    /// switches into it (auto: a sixteenth of the device, 16MiB to 4GiB, as `sce serve`
    /// gives a cache it formats; 0: none: write-back on it then formats it afresh with an
    /// auto log, its read cache cold).
    #[arg(long, default_value = "auto", value_name = "auto|SIZE")]
    pub writeback_log: sce_server::config::LogSize,
    /// How much of the read slots the log may borrow as dirty data outgrows it (format 9:
    /// auto, up to half the device in all; a size; 0: none), as `sce serve` gives a cache
    /// it formats.
    #[arg(long, default_value = "auto", value_name = "auto|SIZE")]
    pub writeback_grow: sce_server::config::LogSize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn source_size(a: &FormatArgs) -> Result<u64> {
    if let Some(s) = a.source_size {
        return Ok(s);
    }
    if a.source.contains("://") {
        let uri: sce_nbd::NbdUri = a.source.parse().map_err(|e: String| anyhow::anyhow!(e))?;
        return Ok(sce_nbd::NbdClient::connect(&uri, 1)
            .with_context(|| format!("source {} (give --source-size if it is down)", a.source))?
            .size());
    }
    let d = FileDevice::open(
        std::path::Path::new(&a.source),
        &FileOptions {
            direct: DirectMode::Off,
            create_size: None,
            read_only: true,
            ..Default::default()
        },
    )
    .with_context(|| format!("source {}", a.source))?;
    Ok(d.size())
}

/// The line size asked for: --line-size, or the old --fragment-size (with a warning), or
/// the default.
fn line_size(a: &FormatArgs) -> u64 {
    if let Some(l) = a.fragment_size {
        tracing::warn!(
            "sce format --fragment-size is now --line-size (the slot size; `serve`'s \
             --fragment-size is the unit of heat): taken as --line-size {}",
            format_size(l)
        );
    }
    a.line_size
        .or(a.fragment_size)
        .unwrap_or(sce_server::admission::DEFAULT_LINE_SIZE)
}

/// Runs `sce format`.
pub fn format(a: FormatArgs) -> Result<()> {
    let size = source_size(&a)?;
    let name = source_name(&a);
    let dev = open_blank_cache(&a)?;
    let sb = sce_store::format(
        &dev,
        &FormatOptions {
            fragment_size: line_size(&a),
            volume: Volume {
                id: 1,
                generation: 1,
                source_size: size,
                name,
                identity: [0; sce_store::superblock::IDENTITY_BYTES],
                detached: false,
                writeback: false,
            },
            size: None,
            log_bytes: a.writeback_log.bytes(dev.size()),
            lend_bytes: a.writeback_grow.explicit().unwrap_or_else(|| {
                sce_store::wblog::auto_lend_bytes(dev.size(), a.writeback_log.bytes(dev.size()))
            }),
        },
    )?;
    print_formatted(&a, &sb)
}

/// The name the superblock records for the source: `--source-name`, else the URI or the
/// canonical path.
fn source_name(a: &FormatArgs) -> String {
    a.source_name.clone().unwrap_or_else(|| {
        if a.source.contains("://") {
            a.source.clone()
        } else {
            std::fs::canonicalize(&a.source)
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| a.source.clone())
        }
    })
}

/// Opens the cache device, refusing one that overlaps the source or that holds data
/// (another cache or anything else) unless `--force`.
fn open_blank_cache(a: &FormatArgs) -> Result<FileDevice> {
    sce_server::ownership::refuse_overlaps(&[
        sce_server::ownership::Claim {
            export: String::new(),
            role: "source",
            path: a.source.clone(),
        },
        sce_server::ownership::Claim {
            export: String::new(),
            role: "cache",
            path: a.cache.display().to_string(),
        },
    ])?;
    let dev = FileDevice::open(
        &a.cache,
        &FileOptions {
            direct: DirectMode::Preferred,
            create_size: a.cache_size,
            read_only: false,
            lock: sce_io::LockMode::Exclusive,
        },
    )
    .with_context(|| format!("cache device {}", a.cache.display()))?;
    if let sce_server::ownership::Contents::Foreign(what) =
        sce_server::ownership::contents_at(&dev, Some(&a.cache))?
    {
        if !a.force {
            bail!(
                "{} holds data that is not an sce cache ({what}); pass --force to format it \
                 anyway (its contents are lost)",
                a.cache.display()
            );
        }
    }
    match sce_store::read_superblock(&dev) {
        Ok(sb) if !a.force => bail!(
            "{} already holds an sce cache (UUID {}, for {}); pass --force to format it anyway",
            a.cache.display(),
            sce_store::uuid_string(&sb.uuid),
            sb.volumes
                .iter()
                .map(|v| v.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Ok(sb) => {
            // --force: never drops the only copy of write-back data unless that is said too.
            let all = a.discard_dirty.iter().any(|d| d == "all");
            let dirt = match sce_store::dirty_by_volume(&dev, &sb, |_| true) {
                Ok(d) => d,
                Err(e) if all => {
                    tracing::error!("--discard-dirty all: the dirty data could not be counted ({e}); formatting over whatever the device holds");
                    Vec::new()
                }
                Err(e) => bail!(
                    "counting the dirty (write-back) data the device holds, before formatting \
                     over it: {e} (pass --discard-dirty all to format it anyway)"
                ),
            };
            sce_store::refuse_dirty_drop(&dirt, &a.discard_dirty, "sce format --force")?;
            for d in &dirt {
                tracing::error!(
                    volume = %d.name,
                    "--discard-dirty: sce format --force drops {} dirty and {} lost pages \
                     (write-back data the source never received)",
                    d.dirty,
                    d.lost
                );
            }
        }
        _ => {}
    }
    Ok(dev)
}

/// Prints what was formatted: the superblock as JSON, or a summary.
fn print_formatted(a: &FormatArgs, sb: &Superblock) -> Result<()> {
    if a.json {
        println!("{}", serde_json::to_string_pretty(sb)?);
    } else {
        let l = &sb.layout;
        println!(
            "formatted {}: UUID {}, format version {}",
            a.cache.display(),
            sce_store::uuid_string(&sb.uuid),
            sb.version
        );
        println!(
            "  {} lines of {} ({} of data), {} of metadata",
            l.slots,
            format_size(l.fragment_size),
            format_size(l.data_bytes()),
            format_size(l.metadata_bytes())
        );
        if let Some(log) = &sb.log {
            let lend = log.lend(l);
            println!(
                "  write-back log of {}, which may grow into {} of the slots as dirty data does \
                 ({} chunks of {})",
                format_size(log.blocks * sce_store::wblog::LOG_BLOCK),
                format_size(lend.blocks() * sce_store::wblog::LOG_BLOCK),
                lend.chunks,
                format_size(lend.chunk_blocks * sce_store::wblog::LOG_BLOCK)
            );
        }
        println!(
            "  caches {} ({})",
            sb.volumes[0].name,
            format_size(sb.volumes[0].source_size)
        );
    }
    Ok(())
}

/// Options of `sce check`.
#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The cache device to check. It is only read.
    pub cache: PathBuf,
    /// Also read every valid cached page and verify it against its checksum.
    #[arg(long)]
    pub verify_data: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `sce check`. Exits 1 if it found damage.
pub fn check(a: CheckArgs) -> Result<()> {
    let dev = FileDevice::open(
        &a.cache,
        &FileOptions {
            direct: DirectMode::Preferred,
            create_size: None,
            read_only: true,
            ..Default::default()
        },
    )
    .with_context(|| format!("cache device {}", a.cache.display()))?;
    let r = sce_store::check(&dev, a.verify_data)
        .with_context(|| format!("checking {}", a.cache.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_check(&r, a.verify_data);
    }
    if r.damaged() {
        std::process::exit(1);
    }
    Ok(())
}

fn print_check(r: &CheckReport, verified: bool) {
    let sb = &r.superblock;
    let l = &sb.layout;
    let when = |t: u64| {
        if t == 0 {
            "never".to_string()
        } else {
            crate::units::format_unix_time(t)
        }
    };
    println!(
        "sce cache device, format version {}, UUID {}",
        sb.version,
        sce_store::uuid_string(&sb.uuid)
    );
    println!(
        "  state {}, last clean shutdown {}, {} clean shutdowns, {} unclean starts",
        match sb.state {
            DeviceState::Clean => "clean",
            DeviceState::Open => "open (in use, or not shut down cleanly)",
            DeviceState::Failed => "FAILED (disabled after device errors)",
        },
        when(sb.last_clean_shutdown),
        sb.clean_shutdowns,
        sb.unclean_starts
    );
    println!(
        "  {} lines of {}, {} units of {} lines, {} of metadata",
        l.slots,
        format_size(l.fragment_size),
        l.units,
        l.slots_per_unit,
        format_size(r.metadata_bytes)
    );
    print_log(r);
    for (name, s) in &r.volumes {
        println!("  volume {name}:");
        println!(
            "    units: {} ok, {} never written, {} repaired from their mirror copy, damaged in both copies: {} corrupt, {} misplaced; never this device's: {} (another device, format or former content)",
            s.units_ok, s.units_blank, s.units_repaired, s.units_corrupt, s.units_misplaced, s.units_foreign
        );
        println!(
            "    fragments: {} loadable ({} pages), {} under a write intent, {} stale, {} out of range, up to {} in rejected units",
            s.slots_valid,
            s.pages_valid,
            s.slots_dropped_intent,
            s.slots_stale,
            s.slots_out_of_range,
            s.slots_in_bad_units
        );
        println!("    write intents set: {}", s.intents_set);
        print_dirty(r, name, s);
        println!(
            "    write journal (every block's checksum verified): {} live blocks of {} ({} \
             copies damaged, {} repaired from the mirror, {} missing), {} pages they drop in \
             {} fragments",
            s.journal_blocks_live,
            l.journal_blocks / 2,
            s.journal_blocks_bad,
            s.journal_blocks_repaired,
            s.journal_blocks_missing,
            s.journal_pages_dropped,
            s.journal_fragments_hit
        );
    }
    if verified {
        println!(
            "  data: {} pages checked (dirty ones included), {} bad, of them {} dirty (lost: reads of them fail)",
            r.data_pages_checked, r.data_pages_bad, r.data_dirty_pages_bad
        );
    }
    for line in damage_summary(r) {
        println!("{line}");
    }
}

/// A volume's write-back line of `sce check`: its dirty pages, in the slots and the log.
fn print_dirty(r: &CheckReport, name: &str, s: &sce_store::ScanReport) {
    let (log_dirty, log_lost) = log_pages(r, name);
    let in_log = match r.log {
        Some(_) => format!("; in the log: {log_dirty} dirty, {log_lost} lost"),
        None => String::new(),
    };
    println!(
        "    write-back: {} dirty pages ({}), {} lost pages (reads of them fail){in_log}",
        s.pages_dirty + log_dirty,
        format_size((s.pages_dirty + log_dirty) * 4096),
        s.dirty_pages_lost + log_lost,
    );
}

/// The write-back log's line of `sce check`, if the device has one.
fn print_log(r: &CheckReport) {
    let Some(g) = &r.log else {
        return;
    };
    let mirror = if g.mirror_bytes > 0 {
        format!(
            " (records' second copies in a mirror area of {})",
            format_size(g.mirror_bytes)
        )
    } else {
        " (records' two copies side by side: format 7)".to_string()
    };
    println!(
        "  write-back log: {}{mirror}, {} commits replayed (last {}, {} recorded durable{}), \
         {} record(s) read from their second copy, {} torn pages of the last commits skipped \
         (they keep their older version)",
        format_size(g.bytes),
        g.commits,
        g.last_seq,
        g.durable_seq,
        if g.short {
            ": SHORT, committed data lost"
        } else {
            ""
        },
        g.records_repaired,
        g.torn_skipped
    );
}

/// What `check` found damaged in the write-back log, in an operator's words.
fn log_damage(r: &CheckReport) -> Vec<String> {
    let mut out = Vec::new();
    let Some(g) = r.log.as_ref() else {
        return out;
    };
    if g.records_repaired > 0 {
        out.push(format!(
            "damage found in the write-back log: {} commit record(s) have a damaged copy; the \
             other copy is read (nothing lost)",
            g.records_repaired
        ));
    }
    if let Some((missing, later)) = g.broken {
        out.push(format!(
            "damage found in the write-back log: commit {missing} is damaged in both copies \
             and commit {later} was written after it (so it had been durable): the pages it \
             named cannot be told, and a start is refused rather than serve older bytes for \
             them; `sce format --force` (or a start with --reformat --discard-dirty all) gives \
             up the log's dirty data"
        ));
    }
    let lost: u64 = g.volumes.iter().map(|v| v.2).sum();
    if !g.short && lost == 0 {
        return out;
    }
    let short = if g.short {
        "its replay ends before the last commit recorded durable (committed dirty data is \
         missing, and a start is refused); "
    } else {
        ""
    };
    out.push(format!(
        "damage found in the write-back log: {short}{lost} dirty page(s) whose newest committed \
         version fails its checksum (reads of them fail, never an older version)"
    ));
    out
}

/// The dirty and lost pages the write-back log holds for volume `name`.
fn log_pages(r: &CheckReport, name: &str) -> (u64, u64) {
    (r.log.iter().flat_map(|g| &g.volumes))
        .find(|v| v.0 == name)
        .map_or((0, 0), |v| (v.1, v.2))
}

/// What `check` found, in the words an operator acts on: one line per kind of damage, or
/// "no damage found".
fn damage_summary(r: &sce_store::CheckReport) -> Vec<String> {
    let mut out = Vec::new();
    if r.superblock_copy_damaged {
        out.push(
            "damage found: one superblock copy is damaged; the other is used (clean data is \
             dropped at the next start, dirty data kept)"
                .to_string(),
        );
    }
    for (name, s) in &r.volumes {
        let both = s.units_corrupt + s.units_misplaced + s.units_foreign;
        if s.units_repaired > 0 || s.journal_blocks_repaired > 0 {
            out.push(format!(
                "damage found in volume {name}: {} metadata unit(s) and {} write-journal \
                 block(s) have one damaged copy; the next start reads the other and rewrites \
                 them (nothing lost)",
                s.units_repaired, s.journal_blocks_repaired
            ));
        }
        if both > 0 || s.journal_blocks_missing > 0 {
            // Only write-back in the slots keeps dirty data where units and the journal name
            // it (the volume's flag); through the log, the units hold clean data alone.
            let flagged = (r.superblock.volumes.iter()).any(|v| v.name == *name && v.writeback);
            let slots_wb =
                s.pages_dirty + s.dirty_pages_lost > 0 || (flagged && r.superblock.log.is_none());
            let start = if slots_wb {
                "the volume was served in write-back in the slots, so what they named may be \
                 the only copy of its data: a start is refused"
            } else {
                "the clean data they vouched for is dropped at the next start (never served), \
                 which goes ahead (dirty data, if any, lives in the write-back log)"
            };
            out.push(format!(
                "damage found in volume {name}: {both} metadata unit(s) and {} write-journal \
                 block(s) are damaged in both copies: {start}",
                s.journal_blocks_missing
            ));
        }
    }
    if r.data_pages_bad > 0 {
        out.push(format!(
            "damage found: {} cached page(s) fail their checksum: clean ones are read from the \
             source instead, the {} dirty one(s) are lost (reads fail)",
            r.data_pages_bad, r.data_dirty_pages_bad
        ));
    }
    out.extend(log_damage(r));
    if out.is_empty() {
        out.push("no damage found".to_string());
    }
    let (ld, ll) = r.log.as_ref().map_or((0, 0), |g| {
        (
            g.volumes.iter().map(|v| v.1).sum(),
            g.volumes.iter().map(|v| v.2).sum(),
        )
    });
    let dirty: u64 = r.volumes.iter().map(|(_, s)| s.pages_dirty).sum::<u64>() + ld;
    let lost: u64 = r
        .volumes
        .iter()
        .map(|(_, s)| s.dirty_pages_lost)
        .sum::<u64>()
        + ll;
    if dirty + lost > 0 {
        out.push(format!(
            "WARNING: this device holds the only copy of {dirty} dirty pages ({}) of write-back \
             data the source does not have{}: serve it in writeback and run `sce ctl flush \
             --to-source` before replacing, reformatting or discarding it",
            format_size(dirty * 4096),
            if lost > 0 {
                format!(", and {lost} lost pages")
            } else {
                String::new()
            }
        ));
    }
    out
}
