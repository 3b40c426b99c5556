//! Fuzzes a whole server connection: the input is everything a client sends (handshake,
//! options, requests, payloads); the server must never panic or hang, whatever it is.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sce_io::{BlockDevice, MemDevice};
use sce_nbd::server::Conn;
use sce_nbd::{Export, Server};
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};

#[derive(Clone)]
struct Fake(Arc<Mutex<(Vec<u8>, usize)>>);

impl Read for Fake {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        let mut g = self.0.lock().unwrap();
        let (data, pos) = &mut *g;
        let n = b.len().min(data.len() - *pos);
        b[..n].copy_from_slice(&data[*pos..*pos + n]);
        *pos += n;
        Ok(n)
    }
}

impl Write for Fake {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Conn for Fake {
    fn try_clone_conn(&self) -> std::io::Result<Self> {
        Ok(self.clone())
    }
    fn shutdown_conn(&self) {}
    fn shutdown_read(&self) {}
}

fuzz_target!(|data: &[u8]| {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(1 << 20));
    let server = Server::new(vec![
        Export {
            name: "a".into(),
            description: "d".into(),
            device: dev.clone(),
            read_only: false,
            prefetch: None,
        },
        Export {
            name: "ro".into(),
            description: String::new(),
            device: dev,
            read_only: true,
            prefetch: None,
        },
    ]);
    let _ = server.serve(Fake(Arc::new(Mutex::new((data.to_vec(), 0)))));
});
