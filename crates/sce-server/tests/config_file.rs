//! The configuration of `sce serve`: the TOML file of `--config` loaded (unknown keys and bad
//! TOML refused, naming the file and the key), merged into the command line's settings (the
//! file's exports first, its listeners after, the command line winning where both give a
//! value), and checked (something to serve, distinct names, somewhere to listen, no network
//! listener or metrics endpoint beyond loopback unless asked for). Every refusal is tested
//! for what it names.

use sce_nbd::TlsMode;
use sce_server::config::{SharedConfig, TlsConfig};
use sce_server::{ConfigFile, ExportConfig, ServeConfig};
use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// `text` written to a file in `dir`, loaded.
fn load(dir: &Path, text: &str) -> anyhow::Result<ConfigFile> {
    let p = dir.join("sce.toml");
    std::fs::write(&p, text).unwrap();
    ConfigFile::load(&p)
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
    assert_eq!(
        format!("{:?}", c.listen[0]),
        format!("{:?}", cli(&[], &["unix:/run/a.sock"], None).listen[0])
    );
    assert_eq!(c.metrics.as_deref(), Some("127.0.0.1:1"));
    c.check().unwrap();

    let mut c = cli(&["cli"], &[], None);
    c.merge_file(file("metrics = \"127.0.0.1:2\"")).unwrap();
    assert_eq!(c.metrics.as_deref(), Some("127.0.0.1:2"));
    let e = c.check().unwrap_err().to_string();
    assert!(e.contains("nowhere to listen"), "{e}");
}

#[test]
fn the_command_line_wins_over_the_file_for_the_admin_socket_and_its_group() {
    let mut c = cli(&["x"], &["unix:/run/a.sock"], None);
    c.admin = Some("/run/cli.ctl".into());
    c.merge_file(file(
        "admin = \"/run/file.ctl\"\nadmin_group = \"wheel\"\ndiscard_dirty = [\"v1\"]\n\
         insecure = true\nmetrics_public = true\n",
    ))
    .unwrap();
    assert_eq!(c.admin, Some(PathBuf::from("/run/cli.ctl")));
    assert_eq!(c.admin_group.as_deref(), Some("wheel"));
    assert!(c.insecure && c.metrics_public);
    // The file's dirty volumes add to the command line's.
    let mut c = cli(&["x"], &[], None);
    c.admin_group = Some("disk".into());
    c.discard_dirty = vec!["v0".into()];
    c.merge_file(file(
        "admin = \"/run/file.ctl\"\nadmin_group = \"wheel\"\ndiscard_dirty = [\"v1\"]",
    ))
    .unwrap();
    assert_eq!(c.admin, Some(PathBuf::from("/run/file.ctl")));
    assert_eq!(c.admin_group.as_deref(), Some("disk"));
    assert_eq!(c.discard_dirty, ["v0", "v1"]);
    // A file's false never turns a command line's true off.
    let mut c = cli(&["x"], &[], None);
    c.insecure = true;
    c.merge_file(file("insecure = false")).unwrap();
    assert!(c.insecure);
}

#[test]
fn tls_settings_merge_per_field_with_the_command_line_first() {
    let mut c = cli(&["x"], &[], None);
    c.tls.cert = Some("/cli/cert.pem".into());
    c.tls.key = Some("/cli/key.pem".into());
    c.tls.mode = Some(TlsMode::On);
    c.merge_file(file(
        "tls = \"require\"\ntls_cert = \"/f/c.pem\"\ntls_key = \"/f/k.pem\"\n\
         tls_client_ca = \"/f/ca.pem\"\ntls_psk = \"/f/psk\"",
    ))
    .unwrap();
    assert_eq!(c.tls.mode, Some(TlsMode::On));
    assert_eq!(c.tls.cert, Some(PathBuf::from("/cli/cert.pem")));
    assert_eq!(c.tls.key, Some(PathBuf::from("/cli/key.pem")));
    assert_eq!(c.tls.client_ca, Some(PathBuf::from("/f/ca.pem")));
    assert_eq!(c.tls.psk, Some(PathBuf::from("/f/psk")));
}

#[test]
fn a_network_listener_needs_tls_required_or_insecure() {
    let mut c = cli(&["x"], &["tcp:0.0.0.0:10809"], None);
    let e = c.check().unwrap_err().to_string();
    assert!(
        e.contains("refusing to listen on tcp:0.0.0.0:10809") && e.contains("--tls-cert"),
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
    // --insecure lets it in; loopback needs neither.
    let mut c = cli(&["x"], &["tcp:0.0.0.0:10809"], None);
    c.insecure = true;
    c.check().unwrap();
    cli(&["x"], &["tcp:127.0.0.1:10809"], None).check().unwrap();
    let mut c = cli(&["x"], &[], None);
    let e = c
        .merge_file(file("tls = \"maybe\""))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("tls: ") && e.contains("unknown TLS mode"),
        "{e}"
    );
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
    // An address that is none is said so, with the flag it came from.
    let c = cli(&["x"], &["unix:/run/a.sock"], Some("no port here"));
    let e = sce_server::error_text(&c.check().unwrap_err());
    assert!(e.starts_with("--metrics no port here: "), "{e}");
    assert!(e.contains("not an address to listen on"), "{e}");
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
    // Distinct names pass, even when one is the default export "".
    let mut c = cli(&["", "a", "b"], &["unix:/run/a.sock"], None);
    c.merge_file(file("[[export]]\nname = \"c\"\nsource = \"/srv/c\"\n"))
        .unwrap();
    c.check().unwrap();
    // The check alone (no file) refuses the same.
    let e = cli(&["a", "b", "a"], &["unix:/run/a.sock"], None)
        .check()
        .unwrap_err();
    assert!(
        e.to_string().contains("two exports have the same name"),
        "{e}"
    );
}

#[test]
fn loading_a_file_names_the_file_and_the_key_it_refuses() {
    let d = tempfile::tempdir().unwrap();
    let e = ConfigFile::load(&d.path().join("missing.toml")).unwrap_err();
    let t = sce_server::error_text(&e);
    assert!(
        t.starts_with("reading ") && t.contains("missing.toml"),
        "{t}"
    );
    let e = load(d.path(), "[[export]]\nsource = \"/a\"\ncolour = \"red\"\n").unwrap_err();
    let t = e.to_string();
    assert!(t.contains("sce.toml") && t.contains("colour"), "{t}");
    let e = load(d.path(), "listen = \"unix:/a\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("sce.toml") && e.contains("listen"), "{e}");
    let e = load(d.path(), "[[export]]\nname = \"a\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("source"), "an export without a source: {e}");
    let e = load(d.path(), "bogus = 1\n").unwrap_err().to_string();
    assert!(e.contains("bogus"), "{e}");
    let e = load(d.path(), "[[export\n").unwrap_err().to_string();
    assert!(e.contains("sce.toml"), "{e}");
}

#[test]
fn every_export_field_of_the_file_is_read() {
    let d = tempfile::tempdir().unwrap();
    let f = load(
        d.path(),
        "[[export]]\nname = \"lun0\"\nsource = \"/dev/sdb\"\ncache = \"/dev/nvme0n1\"\n\
         cache_size = \"10GiB\"\ncache_share = \"40%\"\nmode = \"writearound\"\nawt = false\n\
         hot_window = 8\nawt_budget = \"64MiB\"\nperiod = \"2s\"\nmin_free_pcnt = 5.0\n\
         evict_for_population = false\nadmission = \"always\"\nchunk_size = \"2MiB\"\n\
         line_size = \"1MiB\"\neviction = \"lru\"\ntarget_missrate = 0.2\nread_only = true\n\
         persist = false\ncrash_journal = false\nsource_name = \"lun0\"\n\
         source_generation = \"g7\"\npopulation_rate = \"auto\"\nsequential_cutoff = \"4MiB\"\n\
         admission_margin = 3\npartial_fill = true\nmiss_fills = \"auto\"\n\
         recency_window = \"1%\"\ndense_line = \"6%\"\nmax_cache_writes = \"1dwpd\"\n",
    )
    .unwrap();
    let e = &f.export[0];
    assert_eq!(e.cache, Some(PathBuf::from("/dev/nvme0n1")));
    assert_eq!(
        e.fragment_size.as_deref(),
        Some("2MiB"),
        "chunk_size is its alias"
    );
    assert_eq!(e.line_size.as_deref(), Some("1MiB"));
    assert_eq!((e.hot_window, e.admission_margin), (Some(8), Some(3)));
    assert_eq!((e.min_free_pcnt, e.target_missrate), (Some(5.0), Some(0.2)));
    assert!(e.read_only && e.partial_fill == Some(true));
    assert_eq!(
        (e.persist, e.crash_journal, e.awt),
        (Some(false), Some(false), Some(false))
    );
    assert_eq!(e.evict_for_population, Some(false));
    assert_eq!(
        e.miss_fills,
        Some(sce_server::admission::OnOffAuto::Word("auto".into()))
    );
    assert_eq!(e.max_cache_writes.as_deref(), Some("1dwpd"));
    assert_eq!(e.source_generation.as_deref(), Some("g7"));
    let core = sce_server::export::core_of(e).unwrap();
    assert_eq!((core.fragment_size, core.heat_bytes()), (1 << 20, 2 << 20));
    assert_eq!(core.write_mode.to_string(), "writearound");
    assert_eq!(core.hot_window, 8);
    assert!(!core.throttle.allow_eviction);
}

#[test]
fn tls_without_credentials_or_with_both_kinds_is_refused_naming_the_flags() {
    let t = TlsConfig::default();
    assert_eq!(t.mode(), TlsMode::Off);
    assert!(t.load().unwrap().is_none());
    let t = TlsConfig {
        mode: Some(TlsMode::Require),
        ..TlsConfig::default()
    };
    let e = t.load().err().unwrap().to_string();
    assert!(e.contains("--tls-cert FILE and --tls-key FILE"), "{e}");
    let t = TlsConfig {
        psk: Some("/k.psk".into()),
        ..TlsConfig::default()
    };
    assert_eq!(t.mode(), TlsMode::Require, "a key file alone requires TLS");
    let t = TlsConfig {
        cert: Some("/c.pem".into()),
        ..t
    };
    let e = t.load().err().unwrap().to_string();
    assert!(e.contains("exclude each other"), "{e}");
    // A certificate that is not there: the error is the loader's, not a panic.
    let t = TlsConfig {
        cert: Some("/nonexistent/c.pem".into()),
        key: Some("/nonexistent/k.pem".into()),
        ..TlsConfig::default()
    };
    let e = t.load().err().unwrap().to_string();
    assert!(e.contains("/nonexistent/"), "{e}");
}

#[test]
fn shared_mode_urls_and_limits_are_checked() {
    let ttl = Duration::from_secs(10);
    let s = SharedConfig::parse("etcd://a:2379,b:2379/vols/", "h1", ttl).unwrap();
    assert_eq!(s.endpoints, ["a:2379", "b:2379"]);
    assert_eq!(
        (s.prefix.as_str(), s.host.as_str(), s.lease_ttl),
        ("/vols", "h1", 10)
    );
    let s = SharedConfig::parse("etcd://a:2379", "h1", ttl).unwrap();
    assert_eq!(s.prefix, "/sce");
    for (url, host, ttl, says) in [
        ("http://a:1/p", "h", 10, "give etcd://"),
        ("etcd:///p", "h", 10, "HOST:PORT"),
        ("etcd://a/p", "h", 10, "HOST:PORT"),
        ("etcd://a:1/p", "", 10, "host name"),
        ("etcd://a:1/p", "a/b", 10, "without '/'"),
        ("etcd://a:1/p", "h", 0, "--lease-ttl"),
        ("etcd://a:1/p", "h", 3601, "--lease-ttl"),
    ] {
        let e = SharedConfig::parse(url, host, Duration::from_secs(ttl)).unwrap_err();
        assert!(e.to_string().contains(says), "{url} {host} {ttl}: {e}");
    }
    SharedConfig::parse("etcd://a:1/p", "h", Duration::from_secs(3600)).unwrap();
    let s = SharedConfig::parse("etcd://a:1/p", "h", ttl).unwrap();
    let idle = Duration::from_secs(5);
    assert_eq!(s.clone().with_ownership(0, idle).unwrap().region_size, 0);
    assert_eq!(
        s.clone().with_ownership(1 << 20, idle).unwrap().region_size,
        1 << 20
    );
    for size in [3 << 20, 1 << 19] {
        let e = s.clone().with_ownership(size, idle).unwrap_err();
        assert!(e.to_string().contains("--region-size"), "{size}: {e}");
    }
    for idle in [Duration::ZERO, Duration::from_secs(3601)] {
        let e = s.clone().with_ownership(1 << 20, idle).unwrap_err();
        assert!(e.to_string().contains("--ownership-idle"), "{idle:?}: {e}");
    }
}
