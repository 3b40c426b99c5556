//! An etcd v3 client over the JSON gateway: each call is one HTTP/1.1 POST of a JSON body
//! to a member's client URL (`/v3/kv/put`, `/v3/kv/range`, `/v3/lease/grant`,
//! `/v3/lease/keepalive`, `/v3/watch`); keys and values travel base64-encoded. Every call
//! asks for a member with a leader (etcd's `hasleader` metadata): a member cut off from the
//! cluster refuses it instead of keeping a watch open that never hears anything. A call that
//! cannot reach a member (refused, reset, timed out) is tried on the next one, so a
//! cluster that keeps its quorum keeps serving when one member dies.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

pub use crate::coord::{prefix_end, Coord, EtcdError, Event, Events, Kv, Watch};

/// A client of an etcd cluster.
#[derive(Debug)]
pub struct Etcd {
    members: Vec<(String, SocketAddr)>,
    /// The member tried first (the last one that answered).
    current: AtomicUsize,
    timeout: Duration,
}

fn b64(b: &[u8]) -> String {
    B64.encode(b)
}

fn unb64(v: &Value) -> Result<Vec<u8>, EtcdError> {
    match v.as_str() {
        None => Ok(Vec::new()),
        Some(s) => B64
            .decode(s)
            .map_err(|e| EtcdError::Protocol(format!("base64: {e}"))),
    }
}

/// The gateway writes 64-bit integers as strings.
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn kv(v: &Value) -> Result<Kv, EtcdError> {
    Ok(Kv {
        key: unb64(&v["key"])?,
        value: unb64(&v["value"])?,
        mod_revision: int(&v["mod_revision"]),
        lease: int(&v["lease"]),
    })
}

impl Etcd {
    /// A client of the members at `endpoints` (`HOST:PORT` or `http://HOST:PORT`), each
    /// call bounded by `timeout`.
    pub fn new(endpoints: &[&str], timeout: Duration) -> Result<Etcd, EtcdError> {
        let mut members = Vec::new();
        for e in endpoints {
            let hostport = e.trim_start_matches("http://").trim_end_matches('/');
            let addr = hostport
                .to_socket_addrs()
                .map_err(|err| EtcdError::Endpoint(e.to_string(), err.to_string()))?
                .next()
                .ok_or_else(|| EtcdError::Endpoint(e.to_string(), "no address".into()))?;
            members.push((hostport.to_string(), addr));
        }
        if members.is_empty() {
            return Err(EtcdError::Endpoint(String::new(), "no endpoint".into()));
        }
        Ok(Etcd {
            members,
            current: AtomicUsize::new(0),
            timeout,
        })
    }

    /// Opens a request to a member that accepts it: the response's headers are read. While
    /// no member answers (a leader election, a restart), it goes round them again, 50 ms
    /// apart, for up to three times the client's timeout (one member that does not answer
    /// takes a whole timeout; an election takes about a second). A put retried after an answer was lost may
    /// apply twice; every key sce puts tolerates that (the same value, or one more
    /// invalidation).
    fn open(&self, path: &str, body: &Value) -> Result<BufReader<TcpStream>, EtcdError> {
        let body = body.to_string();
        let deadline = std::time::Instant::now() + 3 * self.timeout;
        loop {
            match self.open_once(path, &body) {
                Err(EtcdError::Unreachable(why)) if std::time::Instant::now() < deadline => {
                    tracing::debug!("etcd: {why}; trying again");
                    std::thread::sleep(Duration::from_millis(50));
                }
                r => return r,
            }
        }
    }

    /// One round over the members, from the one that answered last.
    fn open_once(&self, path: &str, body: &str) -> Result<BufReader<TcpStream>, EtcdError> {
        let n = self.members.len();
        let first = self.current.load(Relaxed);
        let mut why = Vec::new();
        for k in 0..n {
            let i = (first + k) % n;
            let (host, addr) = &self.members[i];
            match self.try_open(host, addr, path, body) {
                Ok(r) => {
                    self.current.store(i, Relaxed);
                    return Ok(r);
                }
                Err(EtcdError::Unreachable(e)) => why.push(format!("{host}: {e}")),
                Err(e) => return Err(e),
            }
        }
        Err(EtcdError::Unreachable(why.join("; ")))
    }

    fn try_open(
        &self,
        host: &str,
        addr: &SocketAddr,
        path: &str,
        body: &str,
    ) -> Result<BufReader<TcpStream>, EtcdError> {
        let io = |e: std::io::Error| EtcdError::Unreachable(e.to_string());
        let s = TcpStream::connect_timeout(addr, self.timeout).map_err(io)?;
        s.set_read_timeout(Some(self.timeout)).map_err(io)?;
        s.set_write_timeout(Some(self.timeout)).map_err(io)?;
        let mut w = &s;
        write!(
            w,
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nGrpc-Metadata-hasleader: true\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .map_err(io)?;
        let mut r = BufReader::new(s);
        let mut status = String::new();
        r.read_line(&mut status).map_err(io)?;
        let code: u16 = status
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| EtcdError::Unreachable(format!("bad status line {status:?}")))?;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).map_err(io)? == 0 || h == "\r\n" {
                break;
            }
        }
        match code {
            200 => Ok(r),
            // A member without a leader, or shutting down: another may serve.
            503 => Err(EtcdError::Unreachable(format!("HTTP {code}"))),
            _ => {
                let mut rest = String::new();
                let _ = r.read_to_string(&mut rest);
                Err(EtcdError::Server(format!("HTTP {code}: {}", rest.trim())))
            }
        }
    }

    /// One call: the whole answer (chunked or not), as one JSON document.
    fn call(&self, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let mut r = self.open(path, body)?;
        let mut text = String::new();
        r.read_to_string(&mut text)
            .map_err(|e| EtcdError::Unreachable(e.to_string()))?;
        // A chunked answer: its JSON starts at the first '{'.
        let start = text.find('{').unwrap_or(0);
        let end = text.rfind('}').map_or(text.len(), |e| e + 1);
        let v: Value = serde_json::from_str(&text[start..end])
            .map_err(|e| EtcdError::Protocol(format!("{e}: {text}")))?;
        if let Some(err) = v.get("error") {
            return Err(EtcdError::Server(err.to_string()));
        }
        Ok(v)
    }

    fn range(&self, body: Value) -> Result<(Vec<Kv>, i64), EtcdError> {
        let v = self.call("/v3/kv/range", &body)?;
        let kvs = v["kvs"]
            .as_array()
            .map(|a| a.iter().map(kv).collect::<Result<Vec<_>, _>>())
            .transpose()?
            .unwrap_or_default();
        Ok((kvs, int(&v["header"]["revision"])))
    }
}

impl Coord for Etcd {
    /// Puts `value` at `key` (attached to `lease` unless 0); the revision it made.
    fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<i64, EtcdError> {
        let mut body = json!({"key": b64(key), "value": b64(value)});
        if lease != 0 {
            body["lease"] = json!(lease.to_string());
        }
        let v = self.call("/v3/kv/put", &body)?;
        Ok(int(&v["header"]["revision"]))
    }

    /// `put_if`, putting `also` (a key and a value, with no lease) in the same transaction
    /// when it succeeds: both get the same revision.
    fn put_if_and(
        &self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        expect: i64,
        also: Option<(&[u8], &[u8])>,
    ) -> Result<Result<i64, Option<Kv>>, EtcdError> {
        let compare = match expect {
            0 => {
                json!({"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
            }
            r => {
                json!({"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": r.to_string()})
            }
        };
        let mut put = json!({"key": b64(key), "value": b64(value)});
        if lease != 0 {
            put["lease"] = json!(lease.to_string());
        }
        let mut success = vec![json!({"request_put": put})];
        if let Some((k, v)) = also {
            success.push(json!({"request_put": {"key": b64(k), "value": b64(v)}}));
        }
        let v = self.call(
            "/v3/kv/txn",
            &json!({
                "compare": [compare],
                "success": success,
                "failure": [{"request_range": {"key": b64(key)}}],
            }),
        )?;
        if v["succeeded"] == json!(true) {
            return Ok(Ok(int(&v["header"]["revision"])));
        }
        let held = &v["responses"][0]["response_range"]["kvs"][0];
        Ok(Err(if held.is_object() {
            Some(kv(held)?)
        } else {
            None
        }))
    }

    /// The keys starting with `prefix`, and the cluster's revision.
    fn range_prefix(&self, prefix: &[u8]) -> Result<(Vec<Kv>, i64), EtcdError> {
        self.range(json!({"key": b64(prefix), "range_end": b64(&prefix_end(prefix))}))
    }

    /// The keys starting with `prefix` as they were at `revision` (a read of history).
    /// [`EtcdError::Compacted`] if the cluster no longer keeps it.
    fn range_prefix_at(&self, prefix: &[u8], revision: i64) -> Result<Vec<Kv>, EtcdError> {
        let body = json!({
            "key": b64(prefix),
            "range_end": b64(&prefix_end(prefix)),
            "revision": revision.to_string(),
        });
        match self.range(body) {
            Err(EtcdError::Server(e)) if e.contains("compacted") => {
                Err(EtcdError::Compacted(revision))
            }
            Ok((kvs, _)) => Ok(kvs),
            Err(e) => Err(e),
        }
    }

    /// The key `key` exactly with its revision and lease, if there is one.
    fn get_kv(&self, key: &[u8]) -> Result<Option<Kv>, EtcdError> {
        let (kvs, _) = self.range(json!({"key": b64(key)}))?;
        Ok(kvs.into_iter().next())
    }

    /// Deletes `key` in one transaction only if it was last changed at revision `expect`;
    /// false if it was not (changed since, or absent).
    fn delete_if(&self, key: &[u8], expect: i64) -> Result<bool, EtcdError> {
        let v = self.call(
            "/v3/kv/txn",
            &json!({
                "compare": [{"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": expect.to_string()}],
                "success": [{"request_delete_range": {"key": b64(key)}}],
            }),
        )?;
        Ok(v["succeeded"] == json!(true))
    }

    /// Deletes `key`.
    fn delete(&self, key: &[u8]) -> Result<(), EtcdError> {
        self.call("/v3/kv/deleterange", &json!({"key": b64(key)}))
            .map(|_| ())
    }

    /// Deletes every key starting with `prefix`.
    fn delete_prefix(&self, prefix: &[u8]) -> Result<(), EtcdError> {
        let body = json!({"key": b64(prefix), "range_end": b64(&prefix_end(prefix))});
        self.call("/v3/kv/deleterange", &body).map(|_| ())
    }

    /// Compacts the key history up to `revision`: watches can no longer start before it.
    fn compact(&self, revision: i64) -> Result<(), EtcdError> {
        self.call(
            "/v3/kv/compaction",
            &json!({"revision": revision.to_string(), "physical": true}),
        )
        .map(|_| ())
    }

    /// A lease of `ttl` seconds; its id.
    fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        let v = self.call("/v3/lease/grant", &json!({"TTL": ttl.to_string()}))?;
        match int(&v["ID"]) {
            0 => Err(EtcdError::Protocol(format!("no lease id in {v}"))),
            id => Ok(id),
        }
    }

    /// Renews lease `id`; the seconds it has left (0 or less: it has expired).
    fn keep_alive(&self, id: i64) -> Result<i64, EtcdError> {
        let mut r = self.open("/v3/lease/keepalive", &json!({"ID": id.to_string()}))?;
        let v = next_json(&mut r)?.ok_or_else(|| EtcdError::Protocol("no answer".into()))?;
        Ok(int(&v["result"]["TTL"]))
    }

    /// Revokes lease `id`: its keys are deleted.
    fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", &json!({"ID": id.to_string()}))
            .map(|_| ())
    }

    /// Watches the keys starting with `prefix` from revision `from` (0: from now on).
    fn watch_prefix(&self, prefix: &[u8], from: i64) -> Result<Watch, EtcdError> {
        let mut req = json!({"key": b64(prefix), "range_end": b64(&prefix_end(prefix))});
        if from > 0 {
            req["start_revision"] = json!(from.to_string());
        }
        let mut r = self.open("/v3/watch", &json!({"create_request": req}))?;
        // The first message confirms the watch.
        let first = next_json(&mut r)?.ok_or_else(|| EtcdError::Protocol("no answer".into()))?;
        let compacted = int(&first["result"]["compact_revision"]);
        if compacted > 0 {
            return Err(EtcdError::Compacted(compacted));
        }
        if first["result"]["created"] != json!(true) {
            return Err(EtcdError::Protocol(format!("watch not created: {first}")));
        }
        Ok(Watch::new(HttpWatch { r }))
    }
}

/// What a read of a stream that timed out says.
const QUIET: &str = "nothing came in time";

/// The next JSON document of a streamed (chunked) answer; None at its end.
fn next_json(r: &mut BufReader<TcpStream>) -> Result<Option<Value>, EtcdError> {
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            EtcdError::Unreachable(QUIET.into())
        }
        _ => EtcdError::Unreachable(e.to_string()),
    };
    loop {
        // A chunk: its size in hex, then the data (one JSON document and a newline, as the
        // gateway writes them), then CRLF.
        let mut size = String::new();
        if r.read_line(&mut size).map_err(io)? == 0 {
            return Ok(None);
        }
        let n = usize::from_str_radix(size.trim(), 16)
            .map_err(|_| EtcdError::Protocol(format!("bad chunk size {size:?}")))?;
        if n == 0 {
            return Ok(None);
        }
        let mut data = vec![0u8; n + 2];
        r.read_exact(&mut data).map_err(io)?;
        let text = String::from_utf8_lossy(&data[..n]);
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let v: Value =
            serde_json::from_str(text).map_err(|e| EtcdError::Protocol(format!("{e}: {text}")))?;
        if let Some(err) = v.get("error") {
            return Err(EtcdError::Server(err.to_string()));
        }
        return Ok(Some(v));
    }
}

/// A watch's HTTP stream.
struct HttpWatch {
    r: BufReader<TcpStream>,
}

impl Events for HttpWatch {
    fn next_events(&mut self, timeout: Duration) -> Result<Vec<Event>, EtcdError> {
        let _ = self.r.get_ref().set_read_timeout(Some(timeout));
        let v = match next_json(&mut self.r) {
            Ok(Some(v)) => v,
            Ok(None) => return Err(EtcdError::Unreachable("the watch ended".into())),
            Err(EtcdError::Unreachable(e)) if e == QUIET => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let compacted = int(&v["result"]["compact_revision"]);
        if compacted > 0 {
            return Err(EtcdError::Compacted(compacted));
        }
        if v["result"]["canceled"] == json!(true) {
            return Err(EtcdError::Server(format!("the watch was cancelled: {v}")));
        }
        let mut out = Vec::new();
        for e in v["result"]["events"].as_array().into_iter().flatten() {
            let k = kv(&e["kv"])?;
            out.push(match e["type"].as_str() {
                Some("DELETE") => Event::Delete {
                    key: k.key,
                    mod_revision: k.mod_revision,
                },
                _ => Event::Put(k),
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends_and_integers() {
        assert_eq!(prefix_end(b"abc"), b"abd");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), vec![0]);
        assert_eq!(int(&json!("42")), 42);
        assert_eq!(int(&json!(7)), 7);
        assert!(Etcd::new(&["not an endpoint"], Duration::from_secs(1)).is_err());
    }
}
