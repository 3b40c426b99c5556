//! A three-member etcd cluster on loopback (Debian's etcd-server), for the tests of shared
//! mode: members can be killed one at a time, the whole cluster stopped, and started again
//! on their data directories (they rejoin).

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// The cluster; every member is killed on drop.
pub struct Cluster {
    args: Vec<Vec<String>>,
    members: Vec<Option<Child>>,
    /// The members' client endpoints (HOST:PORT).
    pub endpoints: Vec<String>,
}

/// `n` distinct free ports: every listener stays bound until all are chosen, so the kernel
/// cannot hand out one twice (two members on one port: one never starts).
fn free_ports(n: usize) -> Vec<u16> {
    let ls: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

/// The command line of member `i` of the cluster `initial`.
fn member_args(dir: &Path, i: usize, (client, peer): (u16, u16), initial: &str) -> Vec<String> {
    let client = format!("http://127.0.0.1:{client}");
    let peer = format!("http://127.0.0.1:{peer}");
    let data = dir.join(format!("m{i}")).display().to_string();
    let name = format!("m{i}");
    [
        "--name",
        &name,
        "--data-dir",
        &data,
        "--listen-client-urls",
        &client,
        "--advertise-client-urls",
        &client,
        "--listen-peer-urls",
        &peer,
        "--initial-advertise-peer-urls",
        &peer,
        "--initial-cluster",
        initial,
        "--initial-cluster-state",
        "new",
        "--initial-cluster-token",
        "sce-test",
    ]
    .iter()
    .map(|x| x.to_string())
    .collect()
}

impl Cluster {
    /// Starts three members with their data under `dir`.
    pub fn start(dir: &Path) -> Cluster {
        let p = free_ports(6);
        let ports: Vec<(u16, u16)> = (0..3).map(|i| (p[2 * i], p[2 * i + 1])).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, p)| format!("m{i}=http://127.0.0.1:{}", p.1))
            .collect();
        let initial = initial.join(",");
        let args = (0..3)
            .map(|i| member_args(dir, i, ports[i], &initial))
            .collect();
        let mut c = Cluster {
            args,
            members: vec![None, None, None],
            endpoints: ports.iter().map(|p| format!("127.0.0.1:{}", p.0)).collect(),
        };
        c.start_all();
        c
    }

    /// Starts every member that is not running (on its data directory: it rejoins).
    pub fn start_all(&mut self) {
        for (m, a) in self.members.iter_mut().zip(&self.args) {
            if m.is_none() {
                *m = Some(
                    Command::new("etcd")
                        .args(a)
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .expect("starting etcd"),
                );
            }
        }
    }

    /// Kills member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills every member.
    pub fn stop_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    /// `etcd://` URL of the cluster with `prefix`, as `sce serve --shared` takes it.
    pub fn url(&self, prefix: &str) -> String {
        format!("etcd://{}/{prefix}", self.endpoints.join(","))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// A TCP proxy in front of an etcd member, which a test can cut: while cut, it closes the
/// connections it carries and every new one at once, as a network partition between one
/// host and etcd would look to that host.
pub struct Proxy {
    /// Where to connect instead of the member (HOST:PORT).
    pub endpoint: String,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    /// A proxy to `target` (HOST:PORT), from a thread of its own for the test's life.
    pub fn start(target: &str) -> Proxy {
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = l.local_addr().unwrap().to_string();
        let cut = std::sync::Arc::new(AtomicBool::new(false));
        let (c, target) = (cut.clone(), target.to_string());
        std::thread::spawn(move || {
            for conn in l.incoming().map_while(Result::ok) {
                if c.load(SeqCst) {
                    continue;
                }
                let Ok(up) = std::net::TcpStream::connect(&target) else {
                    continue;
                };
                for (from, to) in [
                    (conn.try_clone().unwrap(), up.try_clone().unwrap()),
                    (up, conn),
                ] {
                    let c = c.clone();
                    std::thread::spawn(move || pipe(from, to, &c));
                }
            }
        });
        Proxy { endpoint, cut }
    }

    /// Cuts (true) or restores (false) the connection.
    pub fn cut(&self, on: bool) {
        self.cut.store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Copies `from` to `to` until either closes or the proxy is cut.
fn pipe(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    cut: &std::sync::atomic::AtomicBool,
) {
    use std::io::{Read, Write};
    let _ = from.set_read_timeout(Some(std::time::Duration::from_millis(50)));
    let mut buf = vec![0u8; 64 << 10];
    while !cut.load(std::sync::atomic::Ordering::SeqCst) {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}
