//! `sce ctl set ... --save`: a setting changed at run time written back to the TOML file the
//! server was started with, so that a restart keeps it. The file is edited in place, its
//! comments and layout kept (`toml_edit`), and replaced atomically (written beside it, synced,
//! renamed over it, with its permissions).

use anyhow::{anyhow, bail, Context, Result};
use std::io::Write;
use std::path::Path;

/// The TOML key of `set`'s `key`.
fn toml_key(key: &str) -> Result<&'static str> {
    Ok(match key {
        "mode" => "mode",
        "admission" => "admission",
        "seq-cutoff" => "sequential_cutoff",
        "population-rate" => "population_rate",
        "writeback-low-watermark" => "writeback_low_watermark",
        "writeback-high-watermark" => "writeback_high_watermark",
        "writeback-rate" => "writeback_rate",
        other => bail!("{other} cannot be saved"),
    })
}

/// Sets `key` to `value` in the `[[export]]` tables of `file` named in `exports` (the export
/// `set` changed and those sharing its cache device, whose settings are one). Saving a mode
/// drops the table's `awt`, which would otherwise turn the saved mode into the other
/// write-through at the next start. Refused, with nothing written, if an export is not
/// declared in the file (it came from the command line) or the file does not parse.
pub(super) fn save(file: &Path, exports: &[String], key: &str, value: &str) -> Result<()> {
    let k = toml_key(key)?;
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let mut doc: toml_edit::DocumentMut = text
        .parse()
        .map_err(|e| anyhow!("{} no longer parses: {e}", file.display()))?;
    let tables = doc
        .get_mut("export")
        .and_then(|t| t.as_array_of_tables_mut())
        .ok_or_else(|| anyhow!("{} declares no [[export]]", file.display()))?;
    for name in exports {
        let t = tables
            .iter_mut()
            .find(|t| t.get("name").and_then(|v| v.as_str()).unwrap_or("") == name)
            .ok_or_else(|| {
                anyhow!(
                    "export {name:?} is not declared in {} (it comes from the command line): \
                     nothing saved",
                    file.display()
                )
            })?;
        t[k] = toml_edit::value(value);
        if k == "mode" {
            t.remove("awt");
        }
    }
    replace(file, doc.to_string().as_bytes())
}

/// Replaces `file` with `bytes`: written to a temporary file beside it with its permissions,
/// synced, renamed over it, and the directory synced.
fn replace(file: &Path, bytes: &[u8]) -> Result<()> {
    let dir = file
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = file
        .file_name()
        .ok_or_else(|| anyhow!("{} names no file", file.display()))?;
    let tmp = dir.join(format!(".{}.sce-save", name.to_string_lossy()));
    let perm = std::fs::metadata(file)?.permissions();
    let write = || -> Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.set_permissions(perm)?;
        f.write_all(bytes)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saves_into_the_named_exports_keeping_comments() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("sce.toml");
        let text = "# the server\nlisten = [\"unix:/run/s.sock\"]\n\n[[export]]\nname = \"a\"\n\
                    source = \"/a\"   # the LUN\nawt = false\n\n[[export]]\nname = \"b\"\n\
                    source = \"/b\"\n";
        std::fs::write(&f, text).unwrap();
        save(&f, &["a".into()], "population-rate", "64MiB").unwrap();
        save(&f, &["a".into()], "mode", "writearound").unwrap();
        let got = std::fs::read_to_string(&f).unwrap();
        assert!(
            got.contains("# the server") && got.contains("# the LUN"),
            "{got}"
        );
        let v: toml::Value = toml::from_str(&got).unwrap();
        let a = &v["export"][0];
        assert_eq!(a["population_rate"].as_str(), Some("64MiB"));
        assert_eq!(a["mode"].as_str(), Some("writearound"));
        assert!(a.get("awt").is_none(), "{got}");
        assert!(v["export"][1].get("mode").is_none(), "{got}");
        // An export the file does not declare: refused, the file untouched.
        let e = save(&f, &["c".into()], "mode", "passthrough").unwrap_err();
        assert!(e.to_string().contains("not declared"), "{e}");
        assert_eq!(std::fs::read_to_string(&f).unwrap(), got);
        assert!(save(&f, &["a".into()], "hot-window", "3").is_err());
    }
}
