//! This host's identity in shared mode: the host name, and a random id generated once and
//! kept beside it in the state directory (`STATE_DIR/shared-host.NAME.id`). The id goes into
//! the registration under the name, so the same host restarting (same state directory)
//! is recognised as itself while its old lease lives on, and a clone that shares the name
//! (another machine, or another state directory) is refused. The file stays locked while
//! a server uses it: two servers of one state directory cannot share a name either.

use anyhow::{bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// This host's id, with its file locked for as long as this lives.
#[derive(Debug)]
pub struct HostIdentity {
    id: String,
    path: PathBuf,
    _lock: File,
}

/// An id as the file holds it: 32 hexadecimal digits.
fn well_formed(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

fn generate() -> Result<String> {
    let mut raw = [0u8; 16];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .context("reading /dev/urandom for a host id")?;
    Ok(raw.iter().map(|b| format!("{b:02x}")).collect())
}

impl HostIdentity {
    /// The id of host `host` kept in `state_dir`, generated and saved if there is none.
    /// Fails if another running server holds it.
    pub fn load(state_dir: &Path, host: &str) -> Result<HostIdentity> {
        let path = state_dir.join(format!("shared-host.{host}.id"));
        let why = || format!("shared mode keeps this host's id in {}", path.display());
        std::fs::create_dir_all(state_dir).with_context(why)?;
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(why)?;
        if f.try_lock().is_err() {
            bail!(
                "host name {host:?} is in use by another sce serve with --state-dir {}: \
                 give each server in shared mode its own --host-name",
                state_dir.display()
            );
        }
        let mut text = String::new();
        f.read_to_string(&mut text).with_context(why)?;
        let id = match text.trim() {
            id if well_formed(id) => id.to_string(),
            _ => {
                let id = generate()?;
                f.set_len(0).with_context(why)?;
                f.rewind().with_context(why)?;
                writeln!(f, "{id}").with_context(why)?;
                f.sync_all().with_context(why)?;
                id
            }
        };
        Ok(HostIdentity { id, path, _lock: f })
    }

    /// The id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where it is kept.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id is generated once and read back; a second holder of the same name and state
    /// directory is refused while the first lives; another name gets another id.
    #[test]
    fn one_id_per_name_and_state_dir() {
        let d = tempfile::tempdir().unwrap();
        let a = HostIdentity::load(d.path(), "h").unwrap();
        assert!(well_formed(a.id()));
        let e = HostIdentity::load(d.path(), "h").unwrap_err().to_string();
        assert!(e.contains("--host-name"), "{e}");
        let other = HostIdentity::load(d.path(), "g").unwrap();
        assert_ne!(other.id(), a.id());
        let id = a.id().to_string();
        drop(a);
        assert_eq!(HostIdentity::load(d.path(), "h").unwrap().id(), id);
    }
}
