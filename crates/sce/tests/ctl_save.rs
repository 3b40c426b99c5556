//! `sce ctl set ... --save`: a setting changed at run time is written back into the TOML file
//! the server was started with (comments kept), and a restart from that file runs with it; a
//! server started from flags alone refuses `--save` and changes nothing. (And a status with
//! no reads in its window says so.)

mod common;

use common::{ctl, Server};

#[test]
fn set_save_writes_the_toml_and_a_restart_keeps_it() {
    let (d, src) = common::temp_source(64 << 20);
    let dir = d.path();
    let (sock, file) = (dir.join("s.sock"), dir.join("sce.toml"));
    std::fs::write(
        &file,
        format!(
            "# an operator's file\n[[export]]\nname = \"lun0\"\nsource = \"{}\"\n\
             cache = \"{}\"   # on the SSD\ncache_size = \"16MiB\"\nawt = false\n",
            src.display(),
            dir.join("cache").display()
        ),
    )
    .unwrap();
    let state = dir.join("state");
    let args = [
        "--config",
        file.to_str().unwrap(),
        "--allow-buffered",
        "--state-dir",
        state.to_str().unwrap(),
    ];
    let s = Server::start(&args, &sock);
    for (k, v) in [("population-rate", "32MiB"), ("mode", "writearound")] {
        let (ok, out) = ctl(&sock, &["set", k, v, "--save"]);
        assert!(
            ok && out.contains(&format!("saved to {}", file.display())),
            "{out}"
        );
    }
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.contains("# an operator's file") && text.contains("# on the SSD"),
        "{text}"
    );
    let t: toml::Value = toml::from_str(&text).unwrap();
    let e = &t["export"][0];
    assert_eq!(e["population_rate"].as_str(), Some("32MiB"), "{text}");
    assert_eq!(e["mode"].as_str(), Some("writearound"), "{text}");
    assert!(
        e.get("awt").is_none(),
        "awt would turn the saved mode back: {text}"
    );
    assert!(s.term().success());
    // The restart from the file runs with what was saved.
    let s = Server::start(&args, &sock);
    let (ok, out) = ctl(&sock, &["--json", "status"]);
    assert!(ok, "{out}");
    let st: serde_json::Value = serde_json::from_str(&out).unwrap();
    let x = &st["exports"][0];
    assert_eq!(x["mode"], "writearound", "{out}");
    assert_eq!(
        x["population_rate_limit_bytes_per_second"],
        32 << 20,
        "{out}"
    );
    // Nothing read since: status says so, not "0.0% over the last ..." (once rates exist).
    let status = |json: bool| {
        ctl(
            &sock,
            if json {
                &["--json", "status"]
            } else {
                &["status"]
            },
        )
        .1
    };
    sce_testkit::wait_until("rates over a window", 60, || {
        status(true).contains("\"rates_window_seconds\": ")
    });
    let st: serde_json::Value = serde_json::from_str(&status(true)).unwrap();
    assert!(st["exports"][0]["recent_read_hit_ratio"].is_null(), "{st}");
    let text = status(false);
    assert!(
        text.contains("no reads since start, no reads over the last"),
        "{text}"
    );
    assert!(s.term().success());
    // From flags alone there is no file: refused, and the mode stays.
    let cache2 = dir.join("cache2");
    let flags = Server::start(
        &[
            "--source",
            src.to_str().unwrap(),
            "--cache",
            cache2.to_str().unwrap(),
            "--cache-size",
            "16MiB",
            "--allow-buffered",
            "--state-dir",
            state.to_str().unwrap(),
        ],
        &sock,
    );
    let (ok, out) = ctl(&sock, &["set", "mode", "passthrough", "--save"]);
    assert!(!ok && out.contains("without --config"), "{out}");
    let (_, out) = ctl(&sock, &["--json", "status"]);
    assert!(out.contains("\"mode\": \"writethrough\""), "{out}");
    assert!(flags.term().success());
}
