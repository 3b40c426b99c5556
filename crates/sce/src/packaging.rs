//! What a distribution package installs beside the binary, generated from the command-line
//! definition itself so that it never drifts: shell completions (`sce completions SHELL`)
//! and man pages (`sce man --out DIR`: `sce.1` and one `sce-SUBCOMMAND.1` per subcommand).

use anyhow::{Context, Result};
use clap::CommandFactory;
use std::path::PathBuf;

/// Options of `sce completions`.
#[derive(clap::Args, Debug)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    pub shell: clap_complete::Shell,
}

/// Options of `sce man`.
#[derive(clap::Args, Debug)]
pub struct ManArgs {
    /// Write sce.1 and sce-SUBCOMMAND.1 pages into this directory (created if missing);
    /// without it, print sce.1 to standard output.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// Prints the completion script for a shell.
pub fn completions(a: CompletionsArgs) -> Result<()> {
    let mut cmd = crate::Cli::command();
    clap_complete::generate(a.shell, &mut cmd, "sce", &mut std::io::stdout());
    Ok(())
}

/// Writes the man pages.
pub fn man(a: ManArgs) -> Result<()> {
    let cmd = crate::Cli::command();
    let Some(dir) = a.out else {
        clap_mangen::Man::new(cmd).render(&mut std::io::stdout())?;
        return Ok(());
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    let mut page = |c: clap::Command, name: String| -> Result<()> {
        let path = dir.join(format!("{name}.1"));
        let mut f =
            std::fs::File::create(&path).with_context(|| format!("writing {}", path.display()))?;
        clap_mangen::Man::new(c.name(name.clone())).render(&mut f)?;
        written.push(path);
        Ok(())
    };
    page(cmd.clone(), "sce".into())?;
    for sub in cmd.get_subcommands() {
        let name = format!("sce-{}", sub.get_name());
        page(sub.clone(), name)?;
    }
    for p in &written {
        println!("{}", p.display());
    }
    Ok(())
}
