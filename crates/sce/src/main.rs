//! The `sce` command: a host-side flash cache for block volumes.

mod alloc;
mod ctl;
mod demo;
mod footprint;
mod footprint_dirty;
mod format;
mod gen;
mod load;
mod logging;
mod notify;
mod packaging;
mod policy_args;
mod serve;
mod sim;
mod sparse;
mod trace_cmd;
mod units;

use anyhow::Result;
use clap::{Parser, Subcommand};
use policy_args::parse_on_off;
use sce_core::{CoreConfig, EvictionKind};
use units::parse_size;

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

/// sce puts a fast local device (an SSD) in front of a slow volume (a SAN LUN, an NBD
/// export, a disk array) as a write-through cache, using the SCE design: 1 MiB fragments,
/// selective background population of the hottest fragments, asynchronous write-through and
/// generalized CLOCK eviction.
#[derive(Parser, Debug)]
#[command(
    name = "sce",
    version,
    about,
    long_about = None,
    arg_required_else_help = true,
    after_help = "Sizes, in every option and the TOML file: K, M, G, T, P and KiB, MiB, GiB, TiB, PiB \
are powers of 1024 (1G = 1GiB); kB, MB, GB, TB, PB powers of 1000 (1GB = 10^9 bytes); a bare \
number is bytes. Durations: ns, us, ms, s (the default), m."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: logging::LogArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show the cache at work: an OLTP-like load on a slow emulated source, with and without
    /// the cache, side by side. Runs with no arguments.
    #[command(after_help = "Examples:
  sce demo
  sce demo --seconds 30 --cache-size 512MiB --mode writearound
  sce demo --flashcache-like
  sce demo --json")]
    Demo(demo::DemoArgs),
    /// Export a volume over NBD, cached on a fast device (or as it is, without --cache).
    #[command(after_help = "Examples:
  sce serve --source /srv/lun0.img --cache /nvme/lun0.cache --cache-size 64GiB \\
            --listen unix:/run/sce/lun0.sock --metrics 127.0.0.1:9100
  sce serve --source nbd://filer:10809/lun0 --cache /nvme/lun0.cache --cache-size 64GiB \\
            --listen unix:/run/sce/lun0.sock --source-generation 2026-11-24
  sce serve --config /etc/sce/lun0.toml --log-format json
  sce serve --source /srv/lun0.img --listen unix:/run/sce/plain.sock   # no cache: the baseline")]
    Serve(Box<serve::ServeArgs>),
    /// Inspect and change a running `sce serve` through its admin socket: status, stats,
    /// flush, exists, evict, prefetch, forget, set, detach, attach, handoff.
    Ctl(ctl::CtlArgs),
    /// Show the counters of a running `sce serve` (from its --metrics endpoint).
    #[command(after_help = "Examples:
  sce stats --metrics 127.0.0.1:9100
  sce stats --metrics http://127.0.0.1:9100/metrics --json
  sce ctl -s /run/sce/lun0.sock stats --watch 2     # the same through the admin socket")]
    Stats(serve::StatsArgs),
    /// Simulate caches on a block trace: the engine's policies (sce, sce-paper, always,
    /// nhit:K, flashcache-like, flashcache-4k) in virtual time, and the reference lru, fifo,
    /// lfu, s3fifo and larc.
    #[command(after_help = "Examples:
  sce sim --trace ../shared/traces/msr-cambridge1-sample.csv --format msr --cache-size 64MiB \\
          --policy sce,flashcache-like,lru
  sce gen oltp --seed 7 --out /tmp/oltp.sce && \\
    sce sim --trace /tmp/oltp.sce --format sce --cache-size 256MiB --json")]
    Sim(sim::SimArgs),
    /// Generate a synthetic block trace (oltp, zipf, scan, phase, shared, hotscan, scanmid)
    /// from a seed.
    #[command(after_help = "Examples:
  sce gen oltp --seed 7 --out /tmp/oltp.sce
  sce gen zipf --size 4GiB --skew 1.1 --out /tmp/zipf.csv --out-format csv")]
    Gen(gen::GenArgs),
    /// Tools for trace files: convert between formats.
    #[command(
        subcommand,
        after_help = "Examples:\n  sce trace convert --in msr.csv.gz --format msr --out msr.sce"
    )]
    Trace(trace_cmd::TraceCommand),
    /// Create a persistent cache device for a source (`sce serve` also formats a blank one).
    #[command(after_help = "Examples:
  sce format --source /srv/lun0.img --cache-size 64GiB /nvme/lun0.cache
  sce format --source nbd://filer/lun0 --line-size 256KiB /dev/nvme0n1p3")]
    Format(format::FormatArgs),
    /// Check a cache device like fsck: superblock, metadata units, intents, and optionally
    /// every cached page against its checksum. Exits 1 if it finds damage.
    #[command(after_help = "Examples:
  sce check /nvme/lun0.cache
  sce check /nvme/lun0.cache --verify-data --json")]
    Check(format::CheckArgs),
    /// Measure the memory `sce serve` takes for a cached volume of a geometry: opens one over
    /// devices that store nothing and counts what the allocator hands out, per part (the
    /// allocator counts in this command only).
    #[command(after_help = "Examples:
  sce footprint --cache-size 2TiB --source-size 100TiB
  sce footprint --cache-size 64GiB --source-size 4TiB --fragment-size 256KiB --json
  sce footprint --cache-size 2TiB --source-size 100TiB --line-size 256KiB
  sce footprint --cache-size 2TiB --source-size 100TiB --writeback")]
    Footprint(FootprintArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    #[command(after_help = "Examples:
  sce completions bash > /etc/bash_completion.d/sce
  sce completions zsh > /usr/local/share/zsh/site-functions/_sce")]
    Completions(packaging::CompletionsArgs),
    /// Write man pages generated from this command's definition.
    #[command(after_help = "Examples:
  sce man --out /usr/local/share/man/man1
  sce man | man -l -")]
    Man(packaging::ManArgs),
}

#[derive(clap::Args, Debug)]
struct FootprintArgs {
    /// Size of the cache device.
    #[arg(long, default_value = "2TiB", value_parser = parse_size)]
    cache_size: u64,
    /// Size of the source volume.
    #[arg(long, default_value = "100TiB", value_parser = parse_size)]
    source_size: u64,
    /// Fragment size: a power of two from 4KiB to 64MiB. [default: 1MiB in lines of
    /// 512KiB, as `serve`]
    #[arg(long, value_parser = parse_size)]
    fragment_size: Option<u64>,
    /// Lines inside fragments, as `serve --line-size` runs them: heat is counted per
    /// fragment, cache slots are lines of this size (a power of two, the fragment size down
    /// to a 64th of it) [default: 512KiB with the default fragment size, else the fragment
    /// size].
    #[arg(long, value_parser = parse_size)]
    line_size: Option<u64>,
    /// Eviction policy (its per-slot state counts too): clock, lru or fifo.
    #[arg(long, default_value = "clock")]
    eviction: EvictionKind,
    /// Page checksums and verified reads: on (as `serve` runs) or off. Persistence keeps the
    /// checksums whatever this says.
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    verify: bool,
    /// Measure `serve --no-persist`: no persistence state.
    #[arg(long)]
    no_persist: bool,
    /// Also measure write-back's index of dirty data: 256 MiB of scattered dirty pages
    /// written to a volume in write-back, its growth per dirty MiB, and what half the cache
    /// dirty would take at that rate (a few seconds more).
    #[arg(long)]
    writeback: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Gives SIGPIPE back its default action, so that output to a closed pipe (`sce check | head`)
/// ends the process quietly, as it does for any Unix tool, instead of a panic in `println!`.
/// Not for `serve`: it writes to sockets, and a client that hangs up must not kill it (Rust
/// ignores SIGPIPE for that reason; the write then fails with EPIPE).
fn default_sigpipe() {
    // SAFETY: signal(2) with SIG_DFL installs no handler of ours; it only changes how the
    // kernel treats SIGPIPE for this process, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() {
    let cli = Cli::parse();
    let serving = matches!(cli.command, Command::Serve(_));
    if !serving {
        default_sigpipe();
    }
    if let Err(e) = cli.log.init(if serving { "info" } else { "warn" }) {
        eprintln!("sce: error: {e}");
        std::process::exit(2);
    }
    let r: Result<()> = match cli.command {
        Command::Demo(a) => demo::demo(a),
        Command::Serve(a) => serve::serve(*a),
        Command::Ctl(a) => ctl::ctl(a),
        Command::Completions(a) => packaging::completions(a),
        Command::Man(a) => packaging::man(a),
        Command::Stats(a) => serve::stats(a),
        Command::Sim(a) => sim::sim(a),
        Command::Gen(a) => gen::gen(a),
        Command::Trace(c) => trace_cmd::trace(c),
        Command::Format(a) => format::format(a),
        Command::Check(a) => format::check(a),
        Command::Footprint(a) => (|| {
            let mut core = CoreConfig {
                eviction: a.eviction,
                ..CoreConfig::default()
            };
            sce_server::admission::geometry(&mut core, a.fragment_size, a.line_size);
            let opts = footprint::Options {
                core,
                cache_size: a.cache_size,
                source_size: a.source_size,
                verify: a.verify,
                persist: !a.no_persist,
                writeback: a.writeback,
            };
            let f = footprint::measure(&opts)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&f)?);
            } else {
                footprint::print(&f);
            }
            Ok(())
        })(),
    };
    if let Err(e) = r {
        eprintln!("sce: error: {}", sce_server::error_text(&e));
        std::process::exit(1);
    }
}
