//! `sce-coord`: what several hosts caching one volume need to agree (issue 16), on etcd.
//!
//! * [`coord`]: what sce asks of the store, as a trait ([`Coord`]), with etcd's semantics.
//! * [`etcd`]: a small etcd v3 client over etcd's JSON gateway (`/v3/...` on the client
//!   port, etcd 3.4 and later): keys with revisions, leases and their keep-alive, and
//!   watches from a revision. It fails over between the cluster's members.
//! * [`mem`]: an in-memory store with the same semantics, whose clients can be paused,
//!   partitioned, compacted under and have their leases expired on command (tests).
//! * [`member`]: a host's registration under a lease, kept alive, with the local deadline
//!   until which the host can count on it.
//! * [`inval`]: invalidations: listen, drop, acknowledge.
//! * [`own`]: ownership of a volume's regions: the owner writes without asking the others.
//! * [`track`]: the other hosts and their acknowledgements, kept current by one watch:
//!   publish a write's range and wait for every other host's acknowledgement (or departure).

pub mod coord;
pub mod etcd;
pub mod inval;
pub mod mem;
pub mod member;
pub mod own;
pub mod track;

pub use coord::{Coord, EtcdError, Event, Events, Kv, Watch};
pub use etcd::Etcd;
pub use mem::{Faults, MemClient, MemEtcd};
pub use member::Membership;
pub use track::Tracker;
