//! Tests of merging and checking a server's configuration.

use super::*;

fn cli(exports: &[&str], listen: &[&str], metrics: Option<&str>) -> ServeConfig {
    ServeConfig {
        exports: exports
            .iter()
            .map(|n| ExportConfig {
                name: n.to_string(),
                source: format!("/srv/{n}.img"),
                ..ExportConfig::default()
            })
            .collect(),
        listen: listen.iter().map(|l| l.parse().unwrap()).collect(),
        metrics: metrics.map(str::to_string),
        ..ServeConfig::default()
    }
}

fn file(text: &str) -> ConfigFile {
    toml::from_str(text).unwrap()
}

#[test]
fn the_file_comes_first_for_exports_and_second_for_listeners() {
    let mut c = cli(&["cli"], &["unix:/run/a.sock"], Some("127.0.0.1:1"));
    let f = file(
        "listen = [\"tcp:127.0.0.1:10809\"]\nmetrics = \"127.0.0.1:2\"\n\
         [[export]]\nname = \"lun0\"\nsource = \"/srv/lun0.img\"\ncache_size = \"1GiB\"\n",
    );
    c.merge_file(f).unwrap();
    let names: Vec<_> = c.exports.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["lun0", "cli"]);
    assert_eq!(c.exports[0].cache_size.as_deref(), Some("1GiB"));
    assert_eq!(c.listen.len(), 2);
    assert_eq!(c.metrics.as_deref(), Some("127.0.0.1:1"));
    c.check().unwrap();

    let mut c = cli(&["cli"], &[], None);
    c.merge_file(file("metrics = \"127.0.0.1:2\"")).unwrap();
    assert_eq!(c.metrics.as_deref(), Some("127.0.0.1:2"));
    let e = c.check().unwrap_err().to_string();
    assert!(e.contains("nowhere to listen"), "{e}");
}

#[test]
fn a_network_listener_needs_tls_required_or_insecure() {
    let mut c = cli(&["x"], &["tcp:0.0.0.0:10809"], None);
    let e = c.check().unwrap_err().to_string();
    assert!(
        e.contains("refusing to listen") && e.contains("--tls-cert"),
        "{e}"
    );
    // TLS offered but not required still lets plain clients in.
    c.merge_file(file(
        "tls = \"on\"\ntls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"",
    ))
    .unwrap();
    assert_eq!(c.tls.mode(), TlsMode::On);
    assert!(c.check().is_err());
    // A certificate alone means TLS required: allowed.
    let mut c = cli(&["x"], &["tcp:0.0.0.0:10809"], None);
    c.merge_file(file("tls_cert = \"/c.pem\"\ntls_key = \"/k.pem\""))
        .unwrap();
    assert_eq!(c.tls.mode(), TlsMode::Require);
    c.check().unwrap();
    let mut c = cli(&["x"], &[], None);
    let e = c
        .merge_file(file("tls = \"maybe\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown TLS mode"), "{e}");
}

#[test]
fn a_public_metrics_address_needs_metrics_public() {
    cli(&["x"], &["unix:/run/a.sock"], Some("127.0.0.1:0"))
        .check()
        .unwrap();
    let mut c = cli(&["x"], &["unix:/run/a.sock"], Some("0.0.0.0:9100"));
    let e = c.check().unwrap_err().to_string();
    assert!(
        e.contains("refusing to serve metrics on 0.0.0.0:9100") && e.contains("--metrics-public"),
        "{e}"
    );
    c.merge_file(file("metrics_public = true")).unwrap();
    c.check().unwrap();
}

#[test]
fn empty_duplicate_and_unknown_declarations_are_refused() {
    let mut c = cli(&[], &["unix:/run/a.sock"], None);
    let e = c.merge_file(ConfigFile::default()).unwrap_err();
    assert!(e.to_string().contains("nothing to serve"), "{e}");
    let mut c = cli(&["x"], &[], None);
    let e = c
        .merge_file(file("[[export]]\nname = \"x\"\nsource = \"/srv/y\"\n"))
        .unwrap_err();
    assert!(e.to_string().contains("same name"), "{e}");
    let mut c = cli(&["x"], &[], None);
    let e = c.merge_file(file("listen = [\"udp:1\"]")).unwrap_err();
    assert!(e.to_string().starts_with("listen: "), "{e}");
    let bad = toml::from_str::<ConfigFile>("[[export]]\nsource = \"/a\"\ncolour = 1\n");
    assert!(bad.is_err());
}
