//! The helper as a test sees it, in a real process with a real environment: this test binary
//! runs itself as a child, once with `CI=true` and once without, on a requirement that is
//! missing everywhere, and checks that the child fails (naming the package) or skips.

use std::process::{Command, Output};

const MISSING: &str = "sce-testkit-no-such-program";
const PACKAGE: &str = "sce-testkit-no-such-package";

/// What the children run: a test that needs a program nobody has. Ignored, so that it only
/// runs when a parent asks for it by name.
#[test]
#[ignore = "run by missing_tool_fails_in_ci_and_skips_elsewhere as a child process"]
fn child_needs_a_missing_tool() {
    if !sce_testkit::require_tool(MISSING, PACKAGE) {
        eprintln!("child: skipped");
        return;
    }
    unreachable!("{MISSING} cannot be installed");
}

fn child(ci: Option<&str>) -> Output {
    let mut c = Command::new(std::env::current_exe().expect("test binary"));
    c.args([
        "--exact",
        "child_needs_a_missing_tool",
        "--ignored",
        "--nocapture",
    ]);
    c.env_remove("CI");
    if let Some(v) = ci {
        c.env("CI", v);
    }
    c.output().expect("run the test binary")
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

#[test]
fn missing_tool_fails_in_ci_and_skips_elsewhere() {
    let ci = child(Some("true"));
    let out = text(&ci);
    assert!(
        !ci.status.success(),
        "under CI=true the child must fail:\n{out}"
    );
    assert!(out.contains(PACKAGE) && out.contains(MISSING), "{out}");
    assert!(!out.contains("child: skipped"), "{out}");

    for ci in [None, Some("false")] {
        let local = child(ci);
        let out = text(&local);
        assert!(
            local.status.success(),
            "outside CI the child must pass:\n{out}"
        );
        assert!(out.contains("SKIP:") && out.contains(PACKAGE), "{out}");
        assert!(out.contains("child: skipped"), "{out}");
        assert!(out.contains("1 passed"), "the child test ran: {out}");
    }
}

#[test]
fn present_tool_is_simply_there() {
    // `sh` is everywhere; nothing to skip, nothing to fail.
    assert!(sce_testkit::require_tool("sh", "dash"));
}

/// `scripts/test.sh` installs every program and Python module the tests may require.
#[test]
fn test_script_installs_every_requirement() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/test.sh");
    let text = std::fs::read_to_string(&script).expect("scripts/test.sh");
    for (cmd, package) in sce_testkit::TOOLS {
        assert!(
            text.contains(&format!("{cmd}:{package}")),
            "scripts/test.sh does not install {cmd} ({package})"
        );
    }
    for (_, _, pip) in sce_testkit::PYTHON_MODULES {
        assert!(text.contains(pip), "scripts/test.sh does not install {pip}");
    }
}
