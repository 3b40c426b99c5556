//! The `sce` command: a host-side flash cache for block volumes.

mod alloc;
mod demo;
mod footprint;
mod format;
mod gen;
mod policy_args;
mod serve;
mod sim;
mod sparse;
mod trace_cmd;
mod units;

use anyhow::Result;
use clap::{Parser, Subcommand};
use sce_core::{CoreConfig, EvictionKind};
use units::parse_size;

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

/// sce puts a fast local device (an SSD) in front of a slow volume (a SAN LUN, an NBD
/// export, a disk array) as a write-through cache, using the SCE design: 1 MiB fragments,
/// selective background population of the hottest fragments, asynchronous write-through and
/// generalized CLOCK eviction.
#[derive(Parser, Debug)]
#[command(name = "sce", version, about, long_about = None, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show the cache at work: an OLTP-like load on a slow emulated source, with and without
    /// the cache, side by side. Runs with no arguments.
    Demo(demo::DemoArgs),
    /// Export a volume over NBD, cached on a fast device (or as it is, without --cache).
    Serve(serve::ServeArgs),
    /// Show the counters of a running `sce serve` (from its --metrics endpoint).
    Stats(serve::StatsArgs),
    /// Simulate caches on a block trace: the engine's own policies in virtual time, and the
    /// reference lru, fifo and lfu.
    Sim(sim::SimArgs),
    /// Generate a synthetic block trace (oltp, zipf, scan, phase, shared) from a seed.
    Gen(gen::GenArgs),
    /// Tools for trace files: convert between formats.
    #[command(subcommand)]
    Trace(trace_cmd::TraceCommand),
    /// Create a persistent cache device for a source (`sce serve` also formats a blank one).
    Format(format::FormatArgs),
    /// Check a cache device like fsck: superblock, metadata units, intents, and optionally
    /// every cached page against its checksum. Exits 1 if it finds damage.
    Check(format::CheckArgs),
    /// Measure the memory `sce serve` takes for a cached volume of a geometry: opens one over
    /// devices that store nothing and counts what the allocator hands out, per part.
    Footprint(FootprintArgs),
}

#[derive(clap::Args, Debug)]
struct FootprintArgs {
    /// Size of the cache device.
    #[arg(long, default_value = "2TiB", value_parser = parse_size)]
    cache_size: u64,
    /// Size of the source volume.
    #[arg(long, default_value = "100TiB", value_parser = parse_size)]
    source_size: u64,
    /// Fragment size: a power of two from 4KiB to 64MiB.
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    fragment_size: u64,
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
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
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
    if !matches!(cli.command, Command::Serve(_)) {
        default_sigpipe();
    }
    let r: Result<()> = match cli.command {
        Command::Demo(a) => demo::demo(a),
        Command::Serve(a) => {
            let filter = tracing_subscriber::EnvFilter::try_from_env("SCE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_ansi(ansi)
                .with_writer(std::io::stderr)
                .init();
            serve::serve(a)
        }
        Command::Stats(a) => serve::stats(a),
        Command::Sim(a) => sim::sim(a),
        Command::Gen(a) => gen::gen(a),
        Command::Trace(c) => trace_cmd::trace(c),
        Command::Format(a) => format::format(a),
        Command::Check(a) => format::check(a),
        Command::Footprint(a) => (|| {
            let opts = footprint::Options {
                core: CoreConfig {
                    fragment_size: a.fragment_size,
                    eviction: a.eviction,
                    ..CoreConfig::default()
                },
                cache_size: a.cache_size,
                source_size: a.source_size,
                verify: a.verify,
                persist: !a.no_persist,
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
        eprintln!("sce: error: {e:#}");
        std::process::exit(1);
    }
}
