//! The state directory: the newest superblock sequence this host wrote to each device (a
//! start handed an older copy of the device recognises it) and the failure marker.

use super::PersistConfig;

/// The state file that remembers the newest superblock sequence this host wrote to device
/// `uuid`.
fn state_file(cfg: &PersistConfig, uuid: &[u8; 16]) -> Option<std::path::PathBuf> {
    cfg.state_dir
        .as_ref()
        .map(|d| d.join(format!("seq-{}", sce_store::uuid_string(uuid))))
}

/// The newest superblock sequence this host recorded for device `uuid`, if any.
pub(super) fn state_seq(cfg: &PersistConfig, uuid: &[u8; 16]) -> Option<u64> {
    let text = std::fs::read_to_string(state_file(cfg, uuid)?).ok()?;
    // A file of an older sce ("N\n") is padded with NULs to the fixed width before its
    // first rewrite in place (`StateSeq`): a crash between the two leaves them.
    text.trim_matches(|c: char| c.is_whitespace() || c == '\0')
        .parse()
        .ok()
}

/// The state file of a served device, opened once and rewritten in place: every superblock
/// write records its sequence with one positioned write of a fixed-width line, where
/// creating, writing and renaming a file cost about a millisecond on every intent and
/// journal write, under the locks that every write over cached data waits for (issue 46).
/// The callers hold the superblock lock, so the writes do not interleave.
#[derive(Default)]
pub(super) struct StateSeq {
    file: std::sync::OnceLock<Option<std::fs::File>>,
}

impl StateSeq {
    /// Records `seq` for device `uuid` (see [`record_state_seq`]), synced if `sync`.
    pub(super) fn record(&self, cfg: &PersistConfig, uuid: &[u8; 16], seq: u64, sync: bool) {
        use std::os::unix::fs::FileExt;
        let Some(path) = state_file(cfg, uuid) else {
            return;
        };
        let file = self.file.get_or_init(|| {
            let open = || {
                if let Some(d) = path.parent() {
                    std::fs::create_dir_all(d)?;
                }
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&path)?;
                f.set_len(STATE_LINE as u64)?;
                Ok::<_, std::io::Error>(f)
            };
            open()
                .inspect_err(|e| {
                    tracing::warn!(
                        "cannot keep the superblock sequence in {}: {e}",
                        path.display()
                    )
                })
                .ok()
        });
        let Some(f) = file else { return };
        let r = f
            .write_all_at(state_line(seq).as_bytes(), 0)
            .and_then(|()| if sync { f.sync_all() } else { Ok(()) });
        if let Err(e) = r {
            tracing::warn!(
                "cannot record the superblock sequence in {}: {e}",
                path.display()
            );
        }
    }
}

/// Bytes of the state file's line: a u64 in decimal (at most 20 digits) and a newline.
const STATE_LINE: usize = 21;

/// The state file's line for `seq`: left-aligned in a fixed width, so that a shorter number
/// rewritten in place leaves no digit of a longer one.
fn state_line(seq: u64) -> String {
    format!("{seq:<w$}\n", w = STATE_LINE - 1)
}

/// Records `seq` as the newest superblock sequence of device `uuid` (write, fsync, rename).
/// Best effort: a failure only weakens the detection of a rolled-back device, and is logged.
pub(super) fn record_state_seq(cfg: &PersistConfig, uuid: &[u8; 16], seq: u64, sync: bool) {
    let Some(path) = state_file(cfg, uuid) else {
        return;
    };
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(state_line(seq).as_bytes())?;
        if sync {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)
    };
    if let Err(e) = write() {
        tracing::warn!(
            "cannot record the superblock sequence in {}: {e}",
            path.display()
        );
    }
}

/// The failure marker file of device `uuid`, if a state directory is configured.
pub(super) fn marker(cfg: &PersistConfig, uuid: &[u8; 16]) -> Option<std::path::PathBuf> {
    cfg.state_dir
        .as_ref()
        .map(|d| d.join(format!("failed-{}", sce_store::uuid_string(uuid))))
}
