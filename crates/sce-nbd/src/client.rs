//! `NbdClient`: a remote NBD export as a `BlockDevice`, so a source can be a SAN-like export
//! (`nbd://host:port/name`, `nbd+unix:///name?socket=PATH`). It keeps a small pool of
//! connections when the server allows several (CAN_MULTI_CONN), one otherwise; each request
//! takes a free connection, so concurrent callers run in parallel.

use crate::proto::{self, errno, ProtoError, Request};
use parking_lot::{Condvar, Mutex};
use sce_io::{check_range, BlockDevice, IoError, Op};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Where an export is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdUri {
    /// `nbd://host[:port]/name`.
    Tcp {
        /// `host:port`.
        addr: String,
        /// Export name.
        name: String,
    },
    /// `nbd+unix:///name?socket=PATH`.
    Unix {
        /// Socket path.
        socket: PathBuf,
        /// Export name.
        name: String,
    },
}

impl std::str::FromStr for NbdUri {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("nbd+unix://") {
            let (path, query) = rest
                .split_once('?')
                .ok_or_else(|| format!("{s}: nbd+unix URIs need ?socket=PATH"))?;
            let name = path.strip_prefix('/').unwrap_or(path).to_string();
            let socket = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .filter(|p| !p.is_empty())
                .ok_or_else(|| format!("{s}: nbd+unix URIs need ?socket=PATH"))?;
            Ok(NbdUri::Unix {
                socket: PathBuf::from(socket),
                name,
            })
        } else if let Some(rest) = s.strip_prefix("nbd://") {
            let (hostport, name) = rest.split_once('/').unwrap_or((rest, ""));
            if hostport.is_empty() {
                return Err(format!("{s}: nbd URIs need a host"));
            }
            let addr = if hostport.contains(':') {
                hostport.to_string()
            } else {
                format!("{hostport}:10809")
            };
            Ok(NbdUri::Tcp {
                addr,
                name: name.to_string(),
            })
        } else {
            Err(format!(
                "{s:?} is not an NBD URI (nbd://host:port/name or nbd+unix:///name?socket=PATH)"
            ))
        }
    }
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Read for Stream {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(b),
            Stream::Unix(s) => s.read(b),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(b),
            Stream::Unix(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Connects and negotiates with NBD_OPT_GO. Returns the stream, size and flags.
fn connect(uri: &NbdUri) -> io::Result<(Stream, u64, u16)> {
    let (mut s, name) = match uri {
        NbdUri::Tcp { addr, name } => {
            let t = TcpStream::connect(addr)?;
            t.set_nodelay(true)?;
            (Stream::Tcp(t), name)
        }
        NbdUri::Unix { socket, name } => (Stream::Unix(UnixStream::connect(socket)?), name),
    };
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello)?;
    if hello[..8] != proto::NBDMAGIC.to_be_bytes() || hello[8..16] != proto::IHAVEOPT.to_be_bytes()
    {
        return Err(bad("not an NBD newstyle server"));
    }
    let hflags = u16::from_be_bytes([hello[16], hello[17]]);
    if hflags & proto::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(bad("server does not speak fixed newstyle"));
    }
    let mut cflags = proto::FLAG_C_FIXED_NEWSTYLE;
    if hflags & proto::FLAG_NO_ZEROES != 0 {
        cflags |= proto::FLAG_C_NO_ZEROES;
    }
    s.write_all(&cflags.to_be_bytes())?;
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
    let mut opt = proto::IHAVEOPT.to_be_bytes().to_vec();
    opt.extend_from_slice(&proto::OPT_GO.to_be_bytes());
    opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
    opt.extend_from_slice(&data);
    s.write_all(&opt)?;
    let (mut size, mut flags) = (None, 0u16);
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h)?;
        if h[..8] != proto::OPT_REPLY_MAGIC.to_be_bytes() {
            return Err(bad("bad option reply magic"));
        }
        let reply = u32::from_be_bytes(h[12..16].try_into().expect("4"));
        let len = u32::from_be_bytes(h[16..20].try_into().expect("4"));
        if len > proto::MAX_OPTION_LEN {
            return Err(bad("option reply too long"));
        }
        let mut d = vec![0u8; len as usize];
        s.read_exact(&mut d)?;
        match reply {
            proto::REP_ACK => break,
            proto::REP_INFO
                if d.len() >= 12 && u16::from_be_bytes([d[0], d[1]]) == proto::INFO_EXPORT =>
            {
                size = Some(u64::from_be_bytes(d[2..10].try_into().expect("8")));
                flags = u16::from_be_bytes([d[10], d[11]]);
            }
            proto::REP_INFO => {}
            r if r & proto::REP_FLAG_ERROR != 0 => {
                return Err(bad(format!(
                    "server refused export {name:?}: {}",
                    String::from_utf8_lossy(&d)
                )));
            }
            _ => return Err(bad("unexpected option reply")),
        }
    }
    let size = size.ok_or_else(|| bad("server sent no export size"))?;
    Ok((s, size, flags))
}

/// A remote export.
pub struct NbdClient {
    uri: NbdUri,
    size: u64,
    flags: u16,
    idle: Mutex<Vec<Stream>>,
    free: Condvar,
    cookie: AtomicU64,
}

impl std::fmt::Debug for NbdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdClient")
            .field("uri", &self.uri)
            .field("size", &self.size)
            .finish()
    }
}

fn open_err(uri: &NbdUri, e: io::Error) -> IoError {
    let path = match uri {
        NbdUri::Tcp { addr, name } => PathBuf::from(format!("nbd://{addr}/{name}")),
        NbdUri::Unix { socket, name } => {
            PathBuf::from(format!("nbd+unix:///{name}?socket={}", socket.display()))
        }
    };
    IoError::Open { path, source: e }
}

impl NbdClient {
    /// Connects with up to `connections` connections (1 unless the server allows several).
    pub fn connect(uri: &NbdUri, connections: usize) -> Result<NbdClient, IoError> {
        let (first, size, flags) = connect(uri).map_err(|e| open_err(uri, e))?;
        let mut pool = vec![first];
        if flags & proto::TFLAG_CAN_MULTI_CONN != 0 {
            for _ in 1..connections.max(1) {
                pool.push(connect(uri).map_err(|e| open_err(uri, e))?.0);
            }
        }
        Ok(NbdClient {
            uri: uri.clone(),
            size,
            flags,
            idle: Mutex::new(pool),
            free: Condvar::new(),
            cookie: AtomicU64::new(1),
        })
    }

    /// The transmission flags the server sent.
    pub fn flags(&self) -> u16 {
        self.flags
    }

    fn request(
        &self,
        op: Op,
        command: u16,
        offset: u64,
        len: u32,
        out: Option<&[u8]>,
        into: Option<&mut [u8]>,
    ) -> Result<(), IoError> {
        let mut s = {
            let mut idle = self.idle.lock();
            loop {
                if let Some(s) = idle.pop() {
                    break s;
                }
                self.free.wait(&mut idle);
            }
        };
        let cookie = self.cookie.fetch_add(1, Relaxed);
        let io_err = |e: io::Error| IoError::Io {
            op,
            offset,
            len: len as u64,
            source: e,
        };
        let r = (|| -> Result<u32, IoError> {
            let h = proto::encode_request(&Request {
                flags: 0,
                command,
                cookie,
                offset,
                len,
            });
            s.write_all(&h).map_err(io_err)?;
            if let Some(d) = out {
                s.write_all(d).map_err(io_err)?;
            }
            let mut rh = [0u8; proto::REPLY_LEN];
            s.read_exact(&mut rh).map_err(io_err)?;
            let (error, c) = proto::parse_simple_reply(&rh)
                .map_err(|e: ProtoError| io_err(io::Error::new(io::ErrorKind::InvalidData, e)))?;
            if c != cookie {
                return Err(io_err(bad("reply cookie does not match")));
            }
            if error == 0 {
                if let Some(b) = into {
                    s.read_exact(b).map_err(io_err)?;
                }
            }
            Ok(error)
        })();
        match r {
            Ok(error) => {
                self.idle.lock().push(s);
                self.free.notify_one();
                match error {
                    0 => Ok(()),
                    errno::EINVAL => Err(IoError::Invalid(format!(
                        "server refused {op} at {offset} (+{len}): EINVAL"
                    ))),
                    e => Err(IoError::Io {
                        op,
                        offset,
                        len: len as u64,
                        source: io::Error::from_raw_os_error(e as i32),
                    }),
                }
            }
            Err(e) => {
                // The stream is in an unknown state: replace it.
                if let Ok((fresh, _, _)) = connect(&self.uri) {
                    self.idle.lock().push(fresh);
                    self.free.notify_one();
                }
                Err(e)
            }
        }
    }
}

impl BlockDevice for NbdClient {
    fn size(&self) -> u64 {
        self.size
    }
    fn logical_block_size(&self) -> u32 {
        512
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        check_range(Op::Read, offset, buf.len() as u64, self.size, 512)?;
        for (i, chunk) in buf.chunks_mut(proto::MAX_PAYLOAD as usize).enumerate() {
            let at = offset + (i as u64) * proto::MAX_PAYLOAD as u64;
            let n = chunk.len() as u32;
            if n > 0 {
                self.request(Op::Read, proto::CMD_READ, at, n, None, Some(chunk))?;
            }
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        check_range(Op::Write, offset, buf.len() as u64, self.size, 512)?;
        for (i, chunk) in buf.chunks(proto::MAX_PAYLOAD as usize).enumerate() {
            let at = offset + (i as u64) * proto::MAX_PAYLOAD as u64;
            self.request(
                Op::Write,
                proto::CMD_WRITE,
                at,
                chunk.len() as u32,
                Some(chunk),
                None,
            )?;
        }
        Ok(())
    }
    fn flush(&self) -> Result<(), IoError> {
        if self.flags & proto::TFLAG_SEND_FLUSH == 0 {
            return Ok(());
        }
        self.request(Op::Flush, proto::CMD_FLUSH, 0, 0, None, None)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(Op::Discard, offset, len, self.size, 512)?;
        // WRITE_ZEROES keeps the BlockDevice contract (reads back as zeroes); TRIM would not.
        if self.flags & proto::TFLAG_SEND_WRITE_ZEROES == 0 {
            return Err(IoError::Unsupported { op: Op::Discard });
        }
        let step = proto::MAX_PAYLOAD as u64;
        let mut at = offset;
        while at < offset + len {
            let n = step.min(offset + len - at);
            self.request(
                Op::Discard,
                proto::CMD_WRITE_ZEROES,
                at,
                n as u32,
                None,
                None,
            )?;
            at += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        assert_eq!(
            "nbd://127.0.0.1:10810/lun0".parse(),
            Ok(NbdUri::Tcp {
                addr: "127.0.0.1:10810".into(),
                name: "lun0".into()
            })
        );
        assert_eq!(
            "nbd://filer".parse(),
            Ok(NbdUri::Tcp {
                addr: "filer:10809".into(),
                name: String::new()
            })
        );
        assert_eq!(
            "nbd+unix:///vol?socket=/run/x.sock".parse(),
            Ok(NbdUri::Unix {
                socket: "/run/x.sock".into(),
                name: "vol".into()
            })
        );
        assert!("nbd+unix:///vol".parse::<NbdUri>().is_err());
        assert!("http://x".parse::<NbdUri>().is_err());
        assert!("nbd:///x".parse::<NbdUri>().is_err());
    }
}
