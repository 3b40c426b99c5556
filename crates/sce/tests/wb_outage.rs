//! A source outage under load through `sce serve` (issue 27, item 9): nbdkit's error filter
//! fails every source write for 15 s while fio writes at random (queue depth 8). The
//! cleaner's backoff must hold and its logs be rate-limited: the failed cleanings and the
//! log lines per second are printed and bounded (the old cleaner, woken by every write
//! waiting for room, failed thousands per second with one WARN each). When the source
//! returns, `flush --to-source` drains everything.

mod common;

use common::num;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A child (fio), killed on drop.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// CPU time (user + system) of process `pid` so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name (which is in parentheses).
    let rest = stat.rsplit_once(')').unwrap().1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// fio's random writes (4 KiB, queue depth 8) to the export on `sock` for `secs` seconds,
/// going on past errors (writes that waited too long for room fail during the outage).
fn fio(dir: &Path, sock: &Path, secs: u64) -> Killed {
    Killed(
        Command::new("fio")
            .current_dir(dir)
            .args([
                "--name=w",
                "--ioengine=nbd",
                &format!("--uri=nbd+unix:///?socket={}", sock.display()),
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=8",
                "--size=32M",
                "--time_based",
                &format!("--runtime={secs}"),
                "--continue_on_error=all",
                "--output-format=terse",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn a_15_s_source_outage_under_fio_costs_few_cleanings_and_few_log_lines() {
    if !sce_testkit::require_known_tool("nbdkit") || !sce_testkit::require_known_tool("fio") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (ksock, flag, cache, sock) = (
        d.path().join("src.sock"),
        d.path().join("outage"),
        d.path().join("cache"),
        d.path().join("s"),
    );
    std::fs::write(&flag, b"").unwrap();
    let kit = common::nbdkit_with_outage(&ksock, &flag, "64M");
    let src_uri = kit.uri.clone();
    let s = common::Server::start(
        &[
            "--source",
            &src_uri,
            "--cache",
            cache.to_str().unwrap(),
            "--cache-size",
            "8MiB",
            "--fragment-size",
            "256KiB",
            "--mode",
            "writeback",
            "--allow-buffered",
        ],
        &sock,
    );
    let fio = fio(d.path(), &sock, 40);
    sce_testkit::poll("a first failed cleaning", 120, || {
        let st = s.export_stats();
        (num(&st, "writeback_clean_errors") > 0)
            .then_some(())
            .ok_or(st.to_string())
    });
    // 15 s of outage under load, from the first failure.
    let count = || {
        let st = s.export_stats();
        let lines = s.log().lines().count() as u64;
        (num(&st, "writeback_clean_errors"), lines, cpu_time(s.pid()))
    };
    let (t0, (e0, l0, c0)) = (Instant::now(), count());
    std::thread::sleep(Duration::from_secs(15));
    let (secs, (e1, l1, c1)) = (t0.elapsed().as_secs_f64(), count());
    let st = s.export_stats();
    let (cleanings, lines) = ((e1 - e0) as f64 / secs, (l1 - l0) as f64 / secs);
    let cores = (c1 - c0).as_secs_f64() / secs;
    println!(
        "15 s source outage under fio randwrite QD8: {} failed cleanings in {secs:.1} s = \
         {cleanings:.1}/s; {} log lines = {lines:.2}/s; the server used {cores:.2} of a core; \
         {} writes waited for room",
        e1 - e0,
        l1 - l0,
        num(&st, "writeback_waits")
    );
    assert!(
        num(&st, "writeback_waits") > 0,
        "no write waited for room: {st}"
    );
    assert!(
        cleanings < 50.0,
        "{cleanings:.1} failed cleanings per second"
    );
    assert!(lines < 5.0, "{lines:.2} log lines per second:\n{}", s.log());
    // The source returns: an operator's flush drains it all.
    drop(fio);
    std::fs::remove_file(&flag).unwrap();
    // Writes fio had in flight when it was killed may still land after a flush: flush
    // again until nothing is dirty.
    let st = sce_testkit::poll("nothing dirty after flush --to-source", 120, || {
        let (ok, out) = common::ctl(&sock, &["flush", "--to-source"]);
        assert!(ok, "{out}\n{}\n{}", s.export_stats(), s.log());
        let st = s.export_stats();
        (num(&st, "writeback_dirty_bytes") == 0)
            .then_some(st.clone())
            .ok_or(st.to_string())
    });
    assert_eq!(num(&st, "writeback_lost_bytes"), 0, "{st}");
    let log = s.log();
    assert!(
        log.contains("cleaning succeeds again after"),
        "the end of the outage was not logged:\n{log}"
    );
    assert!(s.term().success());
}
