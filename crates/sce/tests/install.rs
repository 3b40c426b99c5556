//! `scripts/install.sh` as a packager and an administrator use it: staged under a DESTDIR
//! (every file where a distribution puts it, the unit running the binary at the prefix),
//! installed for real under a prefix (the unit passes `systemd-analyze verify`, `man
//! sce-serve` reads the installed page), then removed again.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `scripts/install.sh ARGS` with the binary this test was built with.
fn install(args: &[&str]) -> std::process::Output {
    let out = Command::new("bash")
        .arg(repo().join("scripts/install.sh"))
        .args(["--bin", env!("CARGO_BIN_EXE_sce")])
        .args(args)
        .env_remove("DESTDIR")
        .env_remove("PREFIX")
        .env_remove("UNITDIR")
        .output()
        .expect("run install.sh");
    assert!(
        out.status.success(),
        "install.sh {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

const FILES: &[&str] = &[
    "usr/bin/sce",
    "usr/share/man/man1/sce.1",
    "usr/share/man/man1/sce-serve.1",
    "usr/share/man/man1/sce-ctl.1",
    "usr/share/bash-completion/completions/sce",
    "usr/share/zsh/vendor-completions/_sce",
    "usr/share/fish/vendor_completions.d/sce.fish",
    "usr/lib/systemd/system/sce@.service",
    "usr/share/doc/sce/examples/sce.toml",
];

#[test]
fn a_staged_install_puts_every_file_where_a_distribution_would() {
    let stage = tempfile::tempdir().unwrap();
    let root = stage.path();
    install(&["--prefix", "/usr", "--destdir", root.to_str().unwrap()]);
    for f in FILES {
        let meta = std::fs::metadata(root.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(meta.len() > 0, "{f} is empty");
    }
    assert!(root.join("etc/sce").is_dir(), "/etc/sce is created");
    let unit = std::fs::read_to_string(root.join("usr/lib/systemd/system/sce@.service")).unwrap();
    assert!(
        unit.contains("ExecStart=/usr/bin/sce serve"),
        "the unit runs the installed binary, not the staging path: {unit}"
    );
    assert!(!unit.contains(root.to_str().unwrap()));
    let bash =
        std::fs::read_to_string(root.join("usr/share/bash-completion/completions/sce")).unwrap();
    assert!(
        bash.contains("complete") && bash.contains("serve"),
        "{bash}"
    );
    // Removal takes back what was installed, and leaves /etc/sce (the administrator's).
    install(&[
        "--prefix",
        "/usr",
        "--destdir",
        root.to_str().unwrap(),
        "--uninstall",
    ]);
    for f in FILES {
        assert!(!root.join(f).exists(), "{f} left behind by --uninstall");
    }
    assert!(root.join("etc/sce").is_dir());
}

#[test]
fn the_installed_unit_verifies_and_its_man_page_reads() {
    if !sce_testkit::require_known_tool("systemd-analyze")
        || !sce_testkit::require_known_tool("man")
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("usr");
    install(&["--prefix", prefix.to_str().unwrap()]);
    let unit = prefix.join("lib/systemd/system/sce@lun0.service");
    let manpath = prefix.join("share/man");
    // The unit names man:sce-serve(1) and runs PREFIX/bin/sce: verify checks both.
    let verify_unit = || {
        Command::new("systemd-analyze")
            .arg("verify")
            .arg(&unit)
            .env("MANPATH", &manpath)
            .current_dir(dir.path())
            .output()
            .expect("run systemd-analyze")
    };
    let verify = verify_unit();
    assert!(
        verify.status.success() && verify.stderr.is_empty(),
        "systemd-analyze verify: {}",
        String::from_utf8_lossy(&verify.stderr)
    );
    let man = Command::new("man")
        .args(["-P", "cat", "sce-serve"])
        .env("MANPATH", &manpath)
        .env("MANWIDTH", "100")
        .output()
        .expect("run man");
    let page = String::from_utf8_lossy(&man.stdout);
    assert!(
        man.status.success(),
        "{}",
        String::from_utf8_lossy(&man.stderr)
    );
    assert!(
        page.contains("sce-serve") && page.contains("--cache"),
        "{page}"
    );
    // Without the man pages, the unit does not verify: what the check above stands on.
    for p in std::fs::read_dir(manpath.join("man1")).unwrap() {
        std::fs::remove_file(p.unwrap().path()).unwrap();
    }
    let bare = verify_unit();
    assert!(
        String::from_utf8_lossy(&bare.stderr).contains("sce-serve"),
        "verify did not look for the man page: {}",
        String::from_utf8_lossy(&bare.stderr)
    );
}
