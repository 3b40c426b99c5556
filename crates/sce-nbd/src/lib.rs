//! `sce-nbd`: the NBD protocol for sce. [`Server`] exports any `BlockDevice` (the cached
//! volume is one) over Unix sockets or TCP; [`NbdClient`] is a remote export as a
//! `BlockDevice`, so the source of a cache can be a SAN-like NBD export. [`proto`] holds the
//! pure parsers and encoders (fuzzed).

pub mod client;
mod conn;
pub mod proto;
pub mod server;
mod status;
pub mod uri;

pub use client::{ClientOptions, NbdClient};
pub use server::{
    listen, listen_with, ConnError, Export, ExportIo, ListenAddr, ListenOptions, Listener, Server,
    ServerConfig, ServerStats, ServerTls, TlsMode,
};
pub use uri::NbdUri;
