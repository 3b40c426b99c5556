//! Helpers shared by the CLI integration tests: a `sce serve` child whose log is captured,
//! and a tiny HTTP client for its /stats endpoint.

#![allow(dead_code)]

use parking_lot::Mutex;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Waits up to 20 s for `path` to exist.
pub fn wait_for(path: &Path) {
    let t0 = Instant::now();
    while !path.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A running `sce serve`, killed on drop, with its stderr collected.
pub struct Server {
    child: Option<Child>,
    log: Arc<Mutex<Vec<String>>>,
    /// HOST:PORT of its metrics endpoint.
    pub metrics: String,
}

impl Server {
    /// Starts `sce serve ARGS --listen unix:SOCK --metrics 127.0.0.1:0` and waits until it
    /// listens.
    pub fn start(args: &[&str], sock: &Path) -> Server {
        let _ = std::fs::remove_file(sock);
        let mut child = Command::new(env!("CARGO_BIN_EXE_sce"))
            .arg("serve")
            .args(args)
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .args(["--metrics", "127.0.0.1:0"])
            .env("SCE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let err = child.stderr.take().unwrap();
        let l = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                l.lock().push(line);
            }
        });
        let t0 = Instant::now();
        let metrics = loop {
            let found = log.lock().iter().find_map(|l| {
                l.split_once("metrics on http://")
                    .map(|x| x.1.trim_end_matches("/metrics").to_string())
            });
            if let Some(m) = found {
                break m;
            }
            if let Ok(Some(st)) = child.try_wait() {
                panic!("sce serve exited with {st}: {}", log.lock().join("\n"));
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "sce serve did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        wait_for(sock);
        Server {
            child: Some(child),
            log,
            metrics,
        }
    }

    /// The /stats document of the default export.
    pub fn export_stats(&self) -> serde_json::Value {
        let mut c = std::net::TcpStream::connect(&self.metrics).unwrap_or_else(|e| {
            panic!(
                "metrics endpoint {}: {e}; the server logged:\n{}",
                self.metrics,
                self.log()
            )
        });
        write!(c, "GET /stats HTTP/1.0\r\n\r\n").unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).unwrap();
        let body = resp.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        v["exports"][""].clone()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Everything it logged so far.
    pub fn log(&self) -> String {
        self.log.lock().join("\n")
    }

    fn signal(&mut self, sig: i32) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        unsafe { libc::kill(child.id() as i32, sig) };
        child.wait().unwrap()
    }

    /// SIGTERM, and the exit status.
    pub fn term(mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGTERM)
    }

    /// SIGKILL.
    pub fn kill(mut self) {
        self.signal(libc::SIGKILL);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A number field of a stats document.
pub fn num(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("no number {k} in {v}"))
}
