//! `sce ctl set ... --save`: a setting changed at run time written back to the TOML file the
//! server was started with, so that a restart keeps it. The edit is prepared and checked
//! before the setting is applied (a file that would not start, or an export it does not
//! declare, refuses the `set` with nothing changed); it is written after, in place, its
//! comments and layout kept (`toml_edit`), atomically (a new file beside it with its owner and
//! permissions, synced, renamed over it; a symbolic link's target is what is replaced), one
//! save at a time.

use crate::config::ConfigFile;
use anyhow::{anyhow, bail, Context, Result};
use sce_engine::order::{levels, OrderedMutex, OrderedMutexGuard};
/// One save at a time (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::AdminSave, T>;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use toml_edit::{DocumentMut, Item, TableLike};

/// Held from the reading of the file to its replacement: saves do not interleave.
static SAVING: Mutex<()> = Mutex::new(());

/// Takes the save lock; hold it across `prepare`, the `set` and `Pending::write`.
pub(super) fn lock() -> OrderedMutexGuard<'static, levels::AdminSave, ()> {
    SAVING.lock()
}

/// The TOML key of `set`'s `key` (its aliases included).
fn toml_key(key: &str) -> Result<&'static str> {
    Ok(match key {
        "mode" => "mode",
        "admission" => "admission",
        "seq-cutoff" | "sequential-cutoff" => "sequential_cutoff",
        "population-rate" => "population_rate",
        "writeback-low-watermark" => "writeback_low_watermark",
        "writeback-high-watermark" => "writeback_high_watermark",
        "writeback-rate" => "writeback_rate",
        other => bail!("{other} cannot be saved"),
    })
}

/// An edited configuration file, checked, not yet written.
pub(super) struct Pending {
    file: PathBuf,
    text: String,
}

/// Prepares setting `key` to `value` in the export tables of `file` named in `exports` (the
/// export `set` changes and those sharing its cache device, whose settings are one), and
/// checks that the result loads and that each edited export's settings are valid. Saving a
/// mode drops the table's `awt` (it would turn the saved mode into the other write-through);
/// saving an admission into a table that names no sizes writes the sizes it ran with, since
/// the default geometry depends on the admission and a restart with another would not
/// place the device's records.
pub(super) fn prepare(file: &Path, exports: &[String], key: &str, value: &str) -> Result<Pending> {
    let k = toml_key(key)?;
    let file = std::fs::canonicalize(file).with_context(|| format!("{}", file.display()))?;
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let old: ConfigFile =
        toml::from_str(&text).map_err(|e| anyhow!("{} does not load: {e}", file.display()))?;
    let mut doc: DocumentMut = text
        .parse()
        .map_err(|e| anyhow!("{}: {e}", file.display()))?;
    let mut tables = export_tables(&mut doc);
    for name in exports {
        let Some(t) = tables
            .iter_mut()
            .find(|t| t.get("name").and_then(|v| v.as_str()).unwrap_or("") == name)
        else {
            bail!(
                "export {name:?} is not declared in {} (it comes from the command line): \
                 nothing saved, nothing changed",
                file.display()
            );
        };
        t.insert(k, toml_edit::value(value));
        if k == "mode" {
            t.remove("awt");
        }
        let sized = t.contains_key("fragment_size") || t.contains_key("line_size");
        if k == "admission" && !sized {
            let spec = old
                .export
                .iter()
                .find(|e| e.name == *name)
                .expect("declared");
            let ran = crate::export::core_config(spec)?;
            t.insert(
                "fragment_size",
                toml_edit::value(size_text(ran.heat_bytes())),
            );
            t.insert("line_size", toml_edit::value(size_text(ran.fragment_size)));
        }
    }
    let text = doc.to_string();
    let new: ConfigFile = toml::from_str(&text).map_err(|e| {
        anyhow!(
            "{key} {value} would leave {} unloadable: {e}; nothing changed",
            file.display()
        )
    })?;
    for spec in new.export.iter().filter(|e| exports.contains(&e.name)) {
        let check =
            crate::export::core_config(spec).and_then(|c| c.validate().map_err(|e| anyhow!("{e}")));
        if let Err(e) = check {
            bail!(
                "with {key} {value}, {} would not start export {:?}: {}; save the settings it \
                 names first (nothing changed)",
                file.display(),
                spec.name,
                crate::error_text(&e)
            );
        }
    }
    Ok(Pending { file, text })
}

/// The export tables of `doc`: `[[export]]` tables, or the inline tables of `export = [...]`.
fn export_tables(doc: &mut DocumentMut) -> Vec<&mut dyn TableLike> {
    match doc.get_mut("export") {
        Some(Item::ArrayOfTables(a)) => a.iter_mut().map(|t| t as &mut dyn TableLike).collect(),
        Some(Item::Value(toml_edit::Value::Array(a))) => a
            .iter_mut()
            .filter_map(|v| v.as_inline_table_mut().map(|t| t as &mut dyn TableLike))
            .collect(),
        _ => Vec::new(),
    }
}

/// A size as the TOML file writes sizes: "1MiB", "512KiB", or bytes.
fn size_text(n: u64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}KiB", n >> 10),
        n => n.to_string(),
    }
}

impl Pending {
    /// The file the edit replaces.
    pub(super) fn file(&self) -> &Path {
        &self.file
    }

    /// Replaces the file with the edit: a new file beside it (never one that exists or a
    /// link), with its permissions and owner, synced, renamed over it, the directory synced.
    pub(super) fn write(&self) -> Result<()> {
        let file = &self.file;
        let dir = file
            .parent()
            .ok_or_else(|| anyhow!("{} has no directory", file.display()))?;
        let name = file
            .file_name()
            .ok_or_else(|| anyhow!("{} names no file", file.display()))?;
        let tmp = dir.join(format!(
            ".{}.sce-save.{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let meta = std::fs::metadata(file)?;
        let write = || -> Result<()> {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(meta.mode() & 0o7777)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)?;
            // The owner too (root editing a root:sce 0640 file keeps it the group's); a
            // server that may not give it away keeps its own.
            let _ = std::os::unix::fs::fchown(&f, Some(meta.uid()), Some(meta.gid()));
            f.set_permissions(meta.permissions())?;
            f.write_all(self.text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, file)?;
            std::fs::File::open(dir)?.sync_all()?;
            Ok(())
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            e.context(format!("writing {}", file.display()))
        })
    }
}
