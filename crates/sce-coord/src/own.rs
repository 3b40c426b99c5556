//! Ownership of a volume's regions (issue 31, docs/SHARED.md "Ownership"), the etcd half.
//!
//! A host that writes a region first puts `PREFIX/owner/REGION` under its lease, only if
//! the key is absent (one transaction), then waits until every other host has acknowledged
//! that revision ([`crate::Tracker::wait_acked`]): each one's listener has then dropped the
//! region from its cache and counts it as another's (its reads of it go to the source).
//! From then on, until the owner deletes the key (idle, a hand-off, a clean stop) or its
//! lease expires, its writes there need no etcd call at all.
//!
//! The value is `HOST ID` (the host name and the id of the server that holds it), followed
//! by `handoff FROM` when a hand-off moved the region to HOST from host FROM.
//!
//! Every put of an owner key also puts `PREFIX/owned` (no lease) in the same transaction:
//! a trace that outlives the key, so that a host that catches up (whose target is the
//! newest such revision) processes every acquisition, even of a region released since.
//! The volume's region size is agreed in `PREFIX/region-size`, put by the first host.

use crate::coord::{Coord, EtcdError, Kv};

/// The key every acquisition and move also puts (see the module's doc).
pub fn trace_key(prefix: &str) -> Vec<u8> {
    format!("{prefix}/owned").into_bytes()
}

/// The key of the volume's region size.
pub fn size_key(prefix: &str) -> Vec<u8> {
    format!("{prefix}/region-size").into_bytes()
}

/// Records `size` as the volume's region size if no host did; the size agreed.
pub fn agree_size(etcd: &dyn Coord, prefix: &str, size: u64) -> Result<u64, EtcdError> {
    let text = size.to_string();
    match etcd.put_if(&size_key(prefix), text.as_bytes(), 0, 0)? {
        Ok(_) => Ok(size),
        Err(Some(kv)) => String::from_utf8_lossy(&kv.value)
            .parse()
            .ok()
            .filter(|s: &u64| s.is_power_of_two())
            .ok_or_else(|| EtcdError::Protocol(format!("a region size that is not one: {kv:?}"))),
        Err(None) => agree_size(etcd, prefix, size),
    }
}

/// The owner key of `region`.
pub fn key(prefix: &str, region: u64) -> Vec<u8> {
    format!("{prefix}/owner/{region}").into_bytes()
}

/// The region an owner key names, if `k` is one.
pub fn region_of(prefix: &str, k: &[u8]) -> Option<u64> {
    let k = std::str::from_utf8(k).ok()?;
    let n = k.strip_prefix(prefix)?.strip_prefix("/owner/")?;
    // Only the canonical decimal form: "01" or "+1" is nobody's region.
    n.parse::<u64>().ok().filter(|r| r.to_string() == n)
}

/// An owner key's value: `HOST ID`, and `handoff FROM` when a hand-off put it.
pub fn value(host: &str, id: &str, from: Option<&str>) -> String {
    match from {
        Some(f) => format!("{host} {id} handoff {f}"),
        None => format!("{host} {id}"),
    }
}

/// Whether an owner key's value says a hand-off put it.
pub fn is_handoff(value: &[u8]) -> bool {
    String::from_utf8_lossy(value).split(' ').nth(2) == Some("handoff")
}

/// Takes `region` for the holder of `lease` if nobody owns it: Ok(revision), or Err(the key
/// as another holds it; None if it vanished meanwhile).
pub fn acquire(
    etcd: &dyn Coord,
    prefix: &str,
    region: u64,
    value: &str,
    lease: i64,
) -> Result<Result<i64, Option<Kv>>, EtcdError> {
    put_owner(etcd, prefix, region, 0, value, lease)
}

/// Gives `region` up if the key is still the one put at `revision`; false if it was not.
pub fn release(
    etcd: &dyn Coord,
    prefix: &str,
    region: u64,
    revision: i64,
) -> Result<bool, EtcdError> {
    etcd.delete_if(&key(prefix, region), revision)
}

/// Moves `region`, held by the key put at `revision`, to the holder of `lease`: Ok(the new
/// revision) or Err(what the key holds instead).
pub fn transfer(
    etcd: &dyn Coord,
    prefix: &str,
    region: u64,
    revision: i64,
    value: &str,
    lease: i64,
) -> Result<Result<i64, Option<Kv>>, EtcdError> {
    put_owner(etcd, prefix, region, revision, value, lease)
}

/// Puts the owner key of `region` under `lease` if it was last changed at `expect` (0:
/// absent), with the trace in the same transaction.
fn put_owner(
    etcd: &dyn Coord,
    prefix: &str,
    region: u64,
    expect: i64,
    value: &str,
    lease: i64,
) -> Result<Result<i64, Option<Kv>>, EtcdError> {
    let trace = (trace_key(prefix), region.to_string());
    let also = Some((&trace.0[..], trace.1.as_bytes()));
    etcd.put_if_and(&key(prefix, region), value.as_bytes(), lease, expect, also)
}

/// The regions owned at `revision`, with their keys.
pub fn owners_at(
    etcd: &dyn Coord,
    prefix: &str,
    revision: i64,
) -> Result<Vec<(u64, Kv)>, EtcdError> {
    let p = format!("{prefix}/owner/");
    let kvs = if revision > 0 {
        etcd.range_prefix_at(p.as_bytes(), revision)?
    } else {
        etcd.range_prefix(p.as_bytes())?.0
    };
    Ok(kvs
        .into_iter()
        .filter_map(|kv| Some((region_of(prefix, &kv.key)?, kv)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_keys_and_values() {
        assert_eq!(key("/p/v", 7), b"/p/v/owner/7");
        assert_eq!(region_of("/p/v", b"/p/v/owner/7"), Some(7));
        assert_eq!(region_of("/p/v", b"/p/v/owner/07"), None);
        assert_eq!(region_of("/p/v", b"/p/v/owner/x"), None);
        assert_eq!(region_of("/p/v", b"/p/v/inval/7"), None);
        assert_eq!(region_of("/p/w", b"/p/v/owner/7"), None);
        assert!(!is_handoff(value("a", "id", None).as_bytes()));
        assert!(is_handoff(value("a", "id", Some("b")).as_bytes()));
    }
}
