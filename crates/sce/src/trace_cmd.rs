//! `sce trace`: tools for trace files. `convert` rewrites a trace in another format
//! (streaming, bounded memory), e.g. a CSV from any tool into sce's compact binary format.

use anyhow::Result;
use sce_sim::{FormatChoice, TraceFormat, TraceReader, TraceWriter};
use std::path::PathBuf;

/// `sce trace` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum TraceCommand {
    /// Convert a trace to another format (gzip, bzip2, xz input are read directly).
    Convert(ConvertArgs),
}

/// Options of `sce trace convert`.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// The input trace.
    #[arg(long = "in")]
    pub input: PathBuf,
    /// Its format: auto (recognised from the file), vscsi, msr, systor, tencent, disksim,
    /// sce, csv or csv:SPEC (`sce sim --help` describes the spec).
    #[arg(long, default_value = "auto")]
    pub format: FormatChoice,
    /// The output file.
    #[arg(long)]
    pub out: PathBuf,
    /// Its format (same names as --format).
    #[arg(long, default_value = "sce")]
    pub out_format: TraceFormat,
    /// Count and skip malformed records instead of failing.
    #[arg(long)]
    pub skip_bad: bool,
}

/// Runs an `sce trace` subcommand.
pub fn trace(c: TraceCommand) -> Result<()> {
    match c {
        TraceCommand::Convert(a) => {
            let (format, _) = a.format.resolve(&a.input)?;
            let mut r = TraceReader::open(&a.input, format.clone(), a.skip_bad)?;
            let mut w = TraceWriter::create(&a.out, a.out_format.clone())?;
            while let Some(req) = r.next_request()? {
                w.write(&req)?;
            }
            let n = w.finish()?;
            eprintln!(
                "converted {n} requests{} from {} ({}) to {} ({})",
                if r.skipped() > 0 {
                    format!(" ({} malformed skipped)", r.skipped())
                } else {
                    String::new()
                },
                a.input.display(),
                format,
                a.out.display(),
                a.out_format
            );
            Ok(())
        }
    }
}
