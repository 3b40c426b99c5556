//! `sce sim`, `sce gen` and `sce trace convert` as a user runs them: the reference policies
//! against libCacheSim (the PyPI package, computed here, not copied), bad input, generator
//! reproducibility, format round trips, separate volumes, and shared volumes over hosts.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn sce(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(args)
        .output()
        .expect("run sce")
}

fn ok(args: &[&str]) -> String {
    let o = sce(args);
    assert!(
        o.status.success(),
        "sce {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).expect("utf-8")
}

/// Runs sce expecting a clean failure; returns stderr.
fn fails(args: &[&str]) -> String {
    let o = sce(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "sce {args:?} should fail");
    assert!(
        !err.contains("panicked") && o.status.code().is_some(),
        "sce {args:?} must not panic: {err}"
    );
    err
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ok(args)).expect("json")
}

fn policy<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["policies"]
        .as_array()
        .expect("policies")
        .iter()
        .find(|x| x["policy"] == name)
        .expect("policy in output")
}

/// libCacheSim's Python package, installed with pip if missing. If it cannot be installed,
/// the cross-check skips (saying so), or fails under `CI=true` (see `sce_testkit`).
fn libcachesim() -> Option<&'static str> {
    let (module, version, pip) = sce_testkit::PYTHON_MODULES
        .iter()
        .find(|m| m.0 == "libcachesim")
        .expect("libcachesim in sce_testkit::PYTHON_MODULES");
    if !sce_testkit::python_has(module, *version) {
        let _ = Command::new("python3")
            .args(["-m", "pip", "install", "-q", pip])
            .status();
    }
    sce_testkit::require_python_module(module, *version, pip).then_some("python3")
}

/// The start of every libCacheSim script: the 4 KiB blocks of the CSV trace `argv[1]`, in
/// order, and the cache sizes in blocks (the other arguments) as `blocks_per_size`.
const LIBCACHESIM_BLOCKS: &str = r#"
import sys, libcachesim as lcs
path, blocks_per_size = sys.argv[1], [int(x) for x in sys.argv[2:]]
blocks = []
for line in open(path):
    if line.startswith('#'):
        continue
    t, op, vol, off, ln = line.strip().split(',')
    off, ln = int(off), int(ln)
    if ln > 0:
        blocks.extend(range(off // 4096, (off + ln - 1) // 4096 + 1))
"#;

/// libCacheSim's LRU, FIFO and LFU.
const LIBCACHESIM: &str = r#"for n in blocks_per_size:
    for name, cls in (('lru', lcs.LRU), ('fifo', lcs.FIFO), ('lfu', lcs.LFU)):
        c = cls(cache_size=n)
        miss = sum(0 if c.get(lcs.Request(obj_size=1, obj_id=b)) else 1 for b in blocks)
        print(name, n, len(blocks), miss)
"#;

/// libCacheSim's S3-FIFO, its parameters spelled out (they are its defaults, and ours).
const LIBCACHESIM_S3FIFO: &str = r#"for n in blocks_per_size:
    c = lcs.S3FIFO(cache_size=n, small_size_ratio=0.1, ghost_size_ratio=0.9,
                   move_to_main_threshold=2)
    miss = sum(0 if c.get(lcs.Request(obj_size=1, obj_id=b)) else 1 for b in blocks)
    print('s3fifo', n, len(blocks), miss)
"#;

/// Runs libCacheSim's `policies` (a script after [`LIBCACHESIM_BLOCKS`]) with `py` over
/// `trace` at `sizes` blocks; returns its lines `policy blocks accesses misses`.
fn libcachesim_lines(py: &str, policies: &str, trace: &Path, sizes: &[u64]) -> String {
    let script = format!("{LIBCACHESIM_BLOCKS}{policies}");
    let mut args: Vec<String> = vec!["-c".into(), script, p(trace).into()];
    args.extend(sizes.iter().map(|s| s.to_string()));
    let out = Command::new(py).args(&args).output().expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `sce sim` of `policies` over the CSV `trace` with a cache of `blocks` 4 KiB blocks.
fn sim_blocks(trace: &Path, blocks: u64, policies: &str) -> serde_json::Value {
    let size = format!("{}", blocks * 4096);
    json(&sim_args(
        trace,
        "csv",
        &size,
        &["--policy", policies, "--json"],
    ))
}

/// Asserts that policy `name` in `sce sim`'s output `v` counted exactly the accesses and
/// misses of libCacheSim's line for `name` at `blocks`; returns its accesses and miss ratio.
fn assert_as_libcachesim(
    lines: &str,
    v: &serde_json::Value,
    name: &str,
    blocks: u64,
) -> (u64, f64) {
    let line = lines
        .lines()
        .find(|l| l.starts_with(&format!("{name} {blocks} ")))
        .expect("a libCacheSim line");
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(2)
        .map(|x| x.parse().unwrap())
        .collect();
    let r = policy(v, name);
    let acc = r["accesses"].as_u64().unwrap();
    let mr = r["miss_ratio"].as_f64().unwrap();
    assert_eq!(acc, f[0], "{name} {blocks}: block accesses");
    assert_eq!(
        (mr * acc as f64).round() as u64,
        f[1],
        "{name} at {blocks} blocks: sce {mr}, libCacheSim {}",
        f[1] as f64 / f[0] as f64
    );
    (acc, mr)
}

/// A generated Zipf trace (20,000 requests of 16 KiB over 256 MiB, 70% reads) in CSV.
fn zipf_csv(dir: &Path) -> PathBuf {
    let trace = dir.join("z.csv");
    ok(&[
        "gen",
        "zipf",
        "--requests",
        "20000",
        "--size",
        "256MiB",
        "--skew",
        "0.8",
        "--read-fraction",
        "0.7",
        "--request-size",
        "16KiB",
        "--seed",
        "3",
        "--out",
        p(&trace),
        "--out-format",
        "csv",
    ]);
    trace
}

/// The reference policies agree with libCacheSim on a generated trace: accesses and misses
/// counted exactly equal, at three sizes, for LRU, FIFO and LFU.
#[test]
fn reference_policies_match_libcachesim() {
    let Some(py) = libcachesim() else { return };
    let d = tempfile::tempdir().unwrap();
    let trace = zipf_csv(d.path());
    let sizes = [512u64, 2048, 8192];
    let lines = libcachesim_lines(py, LIBCACHESIM, &trace, &sizes);
    let mut checked = 0;
    for blocks in sizes {
        let v = sim_blocks(&trace, blocks, "lru,fifo,lfu");
        for name in ["lru", "fifo", "lfu"] {
            assert_as_libcachesim(&lines, &v, name, blocks);
            checked += 1;
        }
    }
    assert_eq!(checked, 9);
}

/// `sce sim --policy s3fifo` misses exactly as libCacheSim's S3FIFO on a generated trace, at
/// four sizes (777 blocks: the small FIFO and the ghost round down, to 77 and 699). LARC
/// runs beside it over the same accesses, and S3-FIFO is not worse than LRU here.
#[test]
fn s3fifo_matches_libcachesim() {
    let Some(py) = libcachesim() else { return };
    let d = tempfile::tempdir().unwrap();
    let trace = zipf_csv(d.path());
    let sizes = [512u64, 777, 2048, 8192];
    let lines = libcachesim_lines(py, LIBCACHESIM_S3FIFO, &trace, &sizes);
    for blocks in sizes {
        let v = sim_blocks(&trace, blocks, "s3fifo,lru,larc");
        let (acc, mr) = assert_as_libcachesim(&lines, &v, "s3fifo", blocks);
        let lru = policy(&v, "lru")["miss_ratio"].as_f64().unwrap();
        assert!(mr <= lru, "{blocks} blocks: s3fifo {mr}, lru {lru}");
        assert_eq!(policy(&v, "larc")["accesses"].as_u64(), Some(acc));
    }
    let e = fails(&sim_args(&trace, "csv", "1MiB", &["--policy", "s4fifo"]));
    assert!(e.contains("s3fifo, larc"), "{e}");
}

/// The arguments of `sce sim` over `trace` read as `format`, with a cache of `cache_size`,
/// then `more`.
fn sim_args<'a>(
    trace: &'a Path,
    format: &'a str,
    cache_size: &'a str,
    more: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "sim",
        "--trace",
        p(trace),
        "--format",
        format,
        "--cache-size",
        cache_size,
    ];
    args.extend_from_slice(more);
    args
}

/// The arguments of `sce gen WORKLOAD OPTS --out OUT`.
fn gen_args<'a>(workload: &'a str, out: &'a Path, opts: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["gen", workload];
    args.extend_from_slice(opts);
    args.extend(["--out", p(out)]);
    args
}

/// `sce gen WORKLOAD OPTS --out DIR/NAME`: the trace's path.
fn gen_trace(dir: &Path, name: &str, workload: &str, opts: &[&str]) -> PathBuf {
    let out = dir.join(name);
    ok(&gen_args(workload, &out, opts));
    out
}

fn write(dir: &Path, name: &str, body: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

/// Bad input gives a one-line error naming the position, and never a panic.
#[test]
fn bad_input_is_a_one_line_error_with_its_position() {
    let d = tempfile::tempdir().unwrap();
    let csv = write(
        d.path(),
        "t.csv",
        b"0,R,0,0,4096\n1,R,0,4096,4096\n2,R,0,x,4096\n",
    );
    let sim = |trace: &Path, format: &str| {
        fails(&sim_args(trace, format, "1MiB", &["--policy", "lru,sce"]))
    };
    let one_line = |e: &str| {
        assert_eq!(e.trim_end().lines().count(), 1, "one line: {e}");
    };
    // A non-numeric field.
    let e = sim(&csv, "csv");
    one_line(&e);
    assert!(
        e.contains("line 3") && e.contains("offset") && e.contains("not a number"),
        "{e}"
    );
    // A wrong format flag: clap names the value and lists the formats.
    let e = sim(&csv, "parquet");
    assert!(
        e.lines()
            .next()
            .unwrap()
            .contains("unknown trace format \"parquet\""),
        "{e}"
    );
    let e = sim(&csv, "csv:time=0,op=0");
    assert!(e.contains("two fields share a column"), "{e}");
    // A text trace read as binary, and a binary one read as text.
    let e = sim(&csv, "sce");
    one_line(&e);
    assert!(e.contains("header 1") && e.contains("magic"), "{e}");
    // An empty file.
    let empty = write(d.path(), "empty", b"");
    for f in ["csv", "sce", "vscsi", "msr"] {
        let e = sim(&empty, f);
        one_line(&e);
        assert!(e.contains("empty"), "{f}: {e}");
    }
    // A truncated binary record.
    let good = d.path().join("g.sce");
    ok(&[
        "gen",
        "oltp",
        "--requests",
        "10",
        "--out",
        p(&good),
        "--size",
        "64MiB",
    ]);
    let mut bytes = std::fs::read(&good).unwrap();
    assert_eq!(bytes.len(), 32 + 10 * 32);
    bytes.truncate(bytes.len() - 5);
    let cut = write(d.path(), "cut.sce", &bytes);
    let e = sim(&cut, "sce");
    one_line(&e);
    assert!(e.contains("record 10") && e.contains("truncated"), "{e}");
    // A whole record missing: the header's count catches it.
    bytes.truncate(32 + 8 * 32);
    let short = write(d.path(), "short.sce", &bytes);
    let e = sim(&short, "sce");
    assert!(e.contains("record 9") && e.contains("announces 10"), "{e}");
    let e = sim(&good, "vscsi");
    one_line(&e);
    assert!(e.contains("record 1"), "{e}");
    // --skip-bad counts and goes on.
    let out = ok(&sim_args(
        &csv,
        "csv",
        "1MiB",
        &["--policy", "lru", "--skip-bad"],
    ));
    assert!(out.contains("2 requests (1 malformed skipped)"), "{out}");
    // Bad options.
    let e = fails(&sim_args(
        &good,
        "sce",
        "1MiB",
        &["--device-model", "ssd=fast"],
    ));
    assert!(e.contains("--device-model"), "{e}");
    let e = fails(&gen_args(
        "zipf",
        &d.path().join("x"),
        &["--read-fraction", "2"],
    ));
    one_line(&e);
    assert!(e.contains("read fraction"), "{e}");
}

/// The same seed gives the same trace, byte for byte; another seed another trace; and a
/// trace converted to another format and back is the same trace.
#[test]
fn gen_is_reproducible_and_formats_round_trip() {
    let d = tempfile::tempdir().unwrap();
    let gen = |seed: &str, name: &str, workload: &str| {
        let out = gen_trace(
            d.path(),
            name,
            workload,
            &["--requests", "3000", "--size", "1GiB", "--seed", seed],
        );
        std::fs::read(out).unwrap()
    };
    for w in ["oltp", "zipf", "scan", "phase", "shared"] {
        let a = gen("5", "a.sce", w);
        assert_eq!(a, gen("5", "b.sce", w), "{w}: same seed, same bytes");
        assert_ne!(a, gen("6", "c.sce", w), "{w}: another seed");
    }
    let src = d.path().join("a.sce");
    gen("9", "a.sce", "shared");
    for fmt in [
        "csv",
        "msr",
        "systor",
        "tencent",
        "disksim",
        "csv:time=2,op=0,offset=1,len=3,volume=4,unit=sector,time_unit=us,sep=tab",
    ] {
        let mid = d.path().join("mid");
        let back = d.path().join("back.sce");
        ok(&[
            "trace",
            "convert",
            "--in",
            p(&src),
            "--format",
            "sce",
            "--out",
            p(&mid),
            "--out-format",
            fmt,
        ]);
        ok(&[
            "trace",
            "convert",
            "--in",
            p(&mid),
            "--format",
            fmt,
            "--out",
            p(&back),
        ]);
        let (a, b) = (std::fs::read(&src).unwrap(), std::fs::read(&back).unwrap());
        if ["csv", "systor"].contains(&fmt) {
            assert_eq!(a, b, "{fmt}: lossless");
        } else {
            // The other formats keep coarser clocks: offsets, lengths, ops and volumes agree.
            assert_eq!(a.len(), b.len(), "{fmt}");
            for (x, y) in a[32..].chunks(32).zip(b[32..].chunks(32)) {
                assert_eq!(x[8..], y[8..], "{fmt}");
            }
        }
    }
    // vscsi has no volume: converting a shared trace is refused, naming the request.
    let e = fails(&[
        "trace",
        "convert",
        "--in",
        p(&src),
        "--format",
        "sce",
        "--out",
        p(&d.path().join("v")),
        "--out-format",
        "vscsi",
    ]);
    assert!(e.contains("request") && e.contains("volume"), "{e}");
}

/// Two volumes with the same offsets are two address spaces, not one.
#[test]
fn volumes_are_separate() {
    let d = tempfile::tempdir().unwrap();
    let mut body = String::new();
    for vol in 0..2 {
        for i in 0..16u64 {
            body += &format!("{},R,{vol},{},4096\n", (vol * 16 + i) * 1000, i * 4096);
        }
    }
    let t = write(d.path(), "v.csv", body.as_bytes());
    let v = json(&sim_args(
        &t,
        "csv",
        "4MiB",
        &["--policy", "lru,always", "--json"],
    ));
    assert_eq!(v["volumes"], 2);
    assert_eq!(policy(&v, "lru")["miss_ratio"], 1.0, "{v}");
    assert_eq!(policy(&v, "always")["read_hit_ratio"], 0.0, "{v}");
}

/// `--eviction` sets the engine policies' eviction: two slots, fragments A B A C A a second
/// apart. LRU and CLOCK keep A (used again) and evict B for C, so the last A hits; FIFO
/// evicts A, the first in, so it misses. A value it does not know is refused.
#[test]
fn eviction_is_chosen_for_the_engine_policies() {
    let d = tempfile::tempdir().unwrap();
    let mut body = String::new();
    for (i, f) in [0u64, 1, 0, 2, 0].iter().enumerate() {
        body += &format!("{},R,0,{},4096\n", i as u64 * 1_000_000_000, f << 20);
    }
    let t = write(d.path(), "e.csv", body.as_bytes());
    let hit = |eviction: &str| {
        let v = json(&sim_args(
            &t,
            "csv",
            "2MiB",
            &[
                "--policy",
                "always",
                "--core-shards",
                "1",
                "--eviction",
                eviction,
                "--json",
            ],
        ));
        assert_eq!(v["eviction"], eviction, "{v}");
        policy(&v, "always")["read_hit_ratio"].as_f64().unwrap()
    };
    let (lru, clock, fifo) = (hit("lru"), hit("clock"), hit("fifo"));
    assert_eq!(
        (lru, clock),
        (0.4, 0.4),
        "A kept: hits at the 3rd and 5th reads"
    );
    assert_eq!(fifo, 0.2, "A evicted for C: only the 3rd read hits");
    let e = fails(&sim_args(&t, "csv", "2MiB", &["--eviction", "arc"]));
    assert!(e.contains("clock, lru or fifo"), "{e}");
}

/// Hosts over a shared volume invalidate each other's copies; one host has nobody to
/// invalidate. With a RAM layer, h2 is reported and consistent with h and h1.
#[test]
fn shared_hosts_and_ram_layer() {
    let d = tempfile::tempdir().unwrap();
    let t = gen_trace(
        d.path(),
        "s.sce",
        "shared",
        &["--requests", "20000", "--size", "64MiB", "--hosts", "2"],
    );
    let plot = d.path().join("p.svg");
    let v = json(&sim_args(
        &t,
        "sce",
        "128MiB",
        &[
            "--policy",
            "lru,sce",
            "--hosts",
            "2",
            "--interval",
            "2",
            "--plot",
            p(&plot),
            "--json",
        ],
    ));
    for name in ["lru", "sce"] {
        let r = policy(&v, name);
        let ipw = r["invalidations_per_write"].as_f64().unwrap();
        assert!(ipw > 0.2 && ipw <= 1.0, "{name}: {ipw}");
        let writes = r["writes"].as_u64().unwrap();
        assert!(writes > 5000);
        // Ownership (the default): both hosts write the volume's one region at once, so
        // the first owner releases it on the other's first write and from then on nobody
        // owns it: every write published (2 ops each), as without ownership.
        let n = |k: &str| r[k].as_u64().unwrap();
        let (owned, contended) = (n("owned_writes"), n("contended_writes"));
        assert_eq!(owned + contended, writes, "{name}");
        assert!((1..10).contains(&owned), "{name}: {owned}");
        assert!(n("region_acquisitions") >= 1 && n("contention_releases") >= 1);
        assert_eq!(n("region_releases"), n("contention_releases"), "{name}");
        assert!(n("read_pages_bypassed") < 100, "{name}");
        let ops = r["coherence_ops_per_write"].as_f64().unwrap();
        assert!((1.99..2.01).contains(&ops), "{name}: {ops}");
    }
    assert_eq!(v["ownership"]["idle_seconds"].as_f64(), Some(10.0));
    assert_eq!(v["ownership"]["region_size_bytes"].as_u64(), Some(1 << 30));
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() >= 2);
    // Without ownership, the server's per-write protocol: a publication and the other
    // host's acknowledgement.
    let off = [
        "--policy",
        "lru",
        "--hosts",
        "2",
        "--ownership",
        "off",
        "--json",
    ];
    let v = json(&sim_args(&t, "sce", "128MiB", &off));
    let r = policy(&v, "lru");
    assert_eq!(r["coherence_puts_per_write"].as_f64(), Some(2.0));
    assert_eq!(r["coherence_ops_per_write"].as_f64(), Some(2.0));
    assert_eq!(r["owned_writes"].as_u64(), Some(0));
    assert!(v["ownership"].is_null());
    let v = json(&sim_args(
        &t,
        "sce",
        "128MiB",
        &[
            "--policy",
            "lru",
            "--hosts",
            "1",
            "--ram-size",
            "8MiB",
            "--ram-policy",
            "periodic:5",
            "--json",
        ],
    ));
    let r = policy(&v, "lru");
    assert!(r["invalidations_per_write"].is_null());
    assert!(r["coherence_puts_per_write"].is_null());
    assert!(r["coherence_ops_per_write"].is_null() && v["ownership"].is_null());
    let (h, h1, h2) = (
        r["read_hit_ratio"].as_f64().unwrap(),
        r["ram_hit_ratio"].as_f64().unwrap(),
        r["flash_hit_ratio"].as_f64().unwrap(),
    );
    assert!(h1 > 0.0 && h1 < h, "{h1} {h}");
    assert!(
        ((h - h1) / (1.0 - h1) - h2).abs() < 1e-9,
        "h2 = (h-h1)/(1-h1)"
    );
}

/// A trace faster than the device models is replayed open loop by default and says that the
/// models are overloaded; `--replay closed:4` paces it to the models instead, without the
/// warning, and changes no reference hit or miss. Traces whose timestamps are all equal are
/// replayed closed:32 by default. Every policy gets modelled read and write latencies, and
/// the cache bytes written per interval add up to the total.
#[test]
fn replay_modes_and_the_overload_warning() {
    let d = tempfile::tempdir().unwrap();
    // 5000 requests/s of 8 KiB, mostly misses: the disk model serves about 800 a second.
    let t = gen_trace(
        d.path(),
        "fast.sce",
        "oltp",
        &[
            "--requests",
            "3000",
            "--size",
            "256MiB",
            "--iops",
            "5000",
            "--seed",
            "2",
        ],
    );
    let sim = |extra: &[&str]| {
        let mut args = sim_args(
            &t,
            "sce",
            "16MiB",
            &["--policy", "sce,lru", "--interval", "0.1"],
        );
        args.extend_from_slice(extra);
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run_json = |extra: &[&str]| {
        let mut a = sim(extra);
        a.push("--json".into());
        json(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let run_text = |extra: &[&str]| ok(&sim(extra).iter().map(String::as_str).collect::<Vec<_>>());

    let text = run_text(&[]);
    assert!(
        text.contains("replay: open (default: the trace's timestamps)"),
        "{text}"
    );
    for name in ["sce", "lru"] {
        assert!(
            text.contains(&format!(
                "warning: {name}: the source model is overloaded by the trace's timestamps"
            )),
            "{text}"
        );
    }
    assert!(text.contains("latencies are queueing; consider --replay closed:QD"));
    let open = run_json(&[]);
    assert_eq!(open["replay"], "open");
    assert_eq!(open["warnings"].as_array().unwrap().len(), 2, "{open}");

    let text = run_text(&["--replay", "closed:4"]);
    assert!(text.contains("replay: closed:4 (--replay)"), "{text}");
    assert!(!text.contains("overloaded"), "{text}");
    let closed = run_json(&["--replay", "closed:4"]);
    assert_eq!(closed["replay"], "closed:4");
    assert!(closed["warnings"].as_array().unwrap().is_empty());

    for name in ["sce", "lru"] {
        let (o, c) = (policy(&open, name), policy(&closed, name));
        let f = |v: &serde_json::Value, k: &str| {
            v[k].as_f64()
                .unwrap_or_else(|| panic!("{name}: {k} in {v}"))
        };
        assert_eq!(o["overloaded"], true);
        assert_eq!(c["overloaded"], false);
        assert!(f(o, "source_utilization") > 2.0, "{name}: {o}");
        let cu = f(c, "source_utilization");
        assert!(cu > 0.5 && cu <= 1.0, "{name}: {cu}");
        // Open loop, the reads wait behind each other; closed, four in flight never queue
        // on a four-channel disk for more than a few services.
        let (om, cm) = (
            f(o, "mean_read_latency_seconds"),
            f(c, "mean_read_latency_seconds"),
        );
        assert!(om > 10.0 * cm, "{name}: open {om}, closed {cm}");
        assert!(cm < 0.05, "{name}: {cm}");
        for v in [o, c] {
            let w = f(v, "mean_write_latency_seconds");
            assert!(
                w > 0.0 && f(v, "p99_write_latency_seconds") >= w,
                "{name}: {v}"
            );
            assert!(f(v, "p99_read_latency_seconds") >= f(v, "mean_read_latency_seconds"));
            let (iv, bytes) = (
                v["intervals"].as_array().unwrap(),
                v["interval_cache_bytes_written"].as_array().unwrap(),
            );
            assert_eq!(iv.len(), bytes.len(), "{name}");
            // The warm-up curve keeps its shape: [seconds, ratio or null].
            assert!(iv
                .iter()
                .all(|x| x[0].is_f64() && x.as_array().unwrap().len() == 2));
            let sum: u64 = bytes.iter().map(|b| b.as_u64().unwrap()).sum();
            if name == "sce" {
                assert_eq!(sum, v["cache_bytes_written"].as_u64().unwrap(), "{name}");
            } else {
                let miss = (f(v, "miss_ratio") * v["accesses"].as_u64().unwrap() as f64).round();
                let rewritten = v["cache_blocks_rewritten"].as_u64().unwrap();
                assert!(rewritten > 0, "{name}: the trace has write hits");
                assert_eq!(
                    sum,
                    (miss as u64 + rewritten) * 4096,
                    "lru: a block per insertion and per write hit"
                );
                assert_eq!(sum, v["cache_bytes_written"].as_u64().unwrap(), "{name}");
            }
        }
    }
    // Time does not change what a reference policy hits.
    assert_eq!(
        policy(&open, "lru")["miss_ratio"],
        policy(&closed, "lru")["miss_ratio"]
    );

    // The plot has a second panel: cache bytes written over time.
    let plot = d.path().join("p.svg");
    run_json(&["--replay", "closed:4", "--plot", p(&plot)]);
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.contains("cache bytes written, cumulative") && svg.contains("closed:4"));
    assert!(
        svg.matches("<polyline").count() >= 4,
        "two lines per policy"
    );

    // Timestamps all zero: nothing to replay open, so closed:32.
    let mut body = String::new();
    for i in 0..64u64 {
        body += &format!("0,R,0,{},4096\n", i % 16 * 4096);
    }
    let flat = write(d.path(), "flat.csv", body.as_bytes());
    let args = sim_args(&flat, "csv", "1MiB", &["--policy", "lru"]);
    let text = ok(&args);
    assert!(
        text.contains("replay: closed:32 (default: the trace's timestamps are all equal)"),
        "{text}"
    );
    let mut a = args.to_vec();
    a.push("--json");
    let v = json(&a);
    assert_eq!(v["replay"], "closed:32");
    let lru = policy(&v, "lru");
    assert_eq!(lru["overloaded"], false);
    assert!(lru["source_utilization"].as_f64().unwrap() <= 1.0);
    // Two streams laid end to end: the second goes back to time zero, far more than a tenth
    // of the span. Jitter (neighbours a little out of order, as in traces logged in
    // completion order) is fine.
    let replay_of = |name: &str, times: &[u64]| {
        let body: String = times
            .iter()
            .enumerate()
            .map(|(i, t)| format!("{t},R,0,{},4096\n", i as u64 % 16 * 4096))
            .collect();
        let f = write(d.path(), name, body.as_bytes());
        let v = json(&sim_args(&f, "csv", "1MiB", &["--policy", "lru", "--json"]));
        (
            v["replay"].as_str().unwrap().to_string(),
            v["replay_reason"].as_str().unwrap().to_string(),
        )
    };
    let ms = 1_000_000u64;
    let spliced: Vec<u64> = (0..2).flat_map(|_| (0..50).map(|i| i * 10 * ms)).collect();
    let (r, why) = replay_of("spliced.csv", &spliced);
    assert_eq!(r, "closed:32", "{why}");
    assert!(
        why.contains("1 of the trace's 100 requests are earlier"),
        "{why}"
    );
    // Neighbours swapped: half the requests are earlier than the one before, by 1% of the span.
    let jitter: Vec<u64> = (0..100u64).map(|i| (i ^ 1) * 10 * ms).collect();
    assert_eq!(replay_of("jitter.csv", &jitter).0, "open");
    let e = fails(&sim_args(&flat, "csv", "1MiB", &["--replay", "closed:0"]));
    assert!(e.contains("--replay") && e.contains("queue depth"), "{e}");
}

/// The admission knobs reach the engine policies of `sce sim`: the default admission writes
/// far less to the cache than the paper's algorithm on an OLTP trace with a small cache, and
/// an endurance budget caps what every engine policy writes (the trace lasts less than a
/// day, so the allowance is one day's budget).
#[test]
fn admission_options_reach_the_simulated_policies() {
    let dir = tempfile::tempdir().unwrap();
    let t = gen_trace(
        dir.path(),
        "oltp.sce",
        "oltp",
        &["--size", "512MiB", "--requests", "30000", "--seed", "5"],
    );
    let base = sim_args(
        &t,
        "sce",
        "32MiB",
        &["--json", "--policy", "sce,sce-paper,flashcache-like"],
    );
    let v = json(&base);
    let written = |v: &serde_json::Value, n: &str| {
        policy(v, n)["cache_bytes_written"]
            .as_u64()
            .expect("bytes written")
    };
    let (sce, paper) = (written(&v, "sce"), written(&v, "sce-paper"));
    assert!(sce * 4 < paper, "sce {sce} against sce-paper {paper}");
    let mut capped = base.to_vec();
    capped.extend(["--max-cache-writes", "4MiB"]);
    let v = json(&capped);
    for n in ["sce", "sce-paper", "flashcache-like"] {
        let w = written(&v, n);
        assert!(
            w <= (4 << 20) + (1 << 20),
            "{n}: {w} bytes over a 4 MiB budget"
        );
        assert!(w >= 2 << 20, "{n}: the budget is used ({w})");
    }
    let e = fails(&sim_args(
        &t,
        "sce",
        "32MiB",
        &["--population-rate", "fast"],
    ));
    assert!(e.contains("population rate"), "{e}");
}

/// `--format auto` (the default) recognises each shared trace's format, and each format
/// `sce trace convert` writes; the JSON names it, with units in its keys and no Rust debug
/// strings; a file of no known format fails with a message naming --format.
#[test]
fn format_auto_recognises_every_format_and_json_has_units() {
    let shared =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces");
    let d = tempfile::tempdir().unwrap();
    let mut cases: Vec<(std::path::PathBuf, &str)> = vec![
        (shared.join("cloudPhysicsIO.vscsi"), "vscsi"),
        (shared.join("msr-cambridge1-sample.csv"), "msr"),
        (shared.join("systor17-traces-sample.csv.gz"), "systor"),
        (shared.join("tpcc-small.trace"), "disksim"),
    ];
    let src = shared.join("msr-cambridge1-sample.csv");
    for out in ["sce", "csv", "tencent", "disksim", "systor", "vscsi"] {
        let path = d.path().join(format!("t.{out}"));
        ok(&[
            "trace",
            "convert",
            "--in",
            p(&src),
            "--out",
            p(&path),
            "--out-format",
            out,
        ]);
        cases.push((path, out));
    }
    for (trace, want) in &cases {
        let v = json(&[
            "sim",
            "--trace",
            p(trace),
            "--cache-size",
            "16MiB",
            "--json",
        ]);
        let got = v["format"].as_str().unwrap();
        assert_eq!(got.split(':').next().unwrap(), *want, "{}", trace.display());
        assert_eq!(v["format_detected"], true);
        let text = v.to_string();
        for debug in ["DeviceModel", "Some(", "Periodic(", "{ "] {
            assert!(!text.contains(debug), "{debug} in {text}");
        }
        assert!(v["ssd_model"]["read_latency_seconds"].as_f64().unwrap() > 0.0);
        assert!(v["cache_size_bytes"].as_u64() == Some(16 << 20));
        let pol = &v["policies"][0];
        for k in [
            "mean_read_latency_seconds",
            "wall_seconds",
            "cache_bytes_written",
        ] {
            assert!(pol.get(k).is_some(), "{k} missing: {pol}");
        }
    }
    // The table says what was detected.
    let table = ok(&["sim", "--trace", p(&cases[1].0), "--cache-size", "16MiB"]);
    assert!(table.contains("(msr, detected)"), "{table}");
    let junk = d.path().join("junk.txt");
    std::fs::write(&junk, "hello,world\nthis is not a trace\n").unwrap();
    let err = fails(&["sim", "--trace", p(&junk), "--cache-size", "16MiB"]);
    assert!(
        err.contains("fits no known format") && err.contains("--format"),
        "{err}"
    );
}

/// `--mode writeback` through the write-back log, as `sce serve` runs it (issue 45):
/// writes are acknowledged at the cache device's speed, the cleaner writes the dirty data
/// back to the source in coalesced runs, the log's share in use is reported per interval,
/// and reads of pages the log holds are hits.
#[test]
fn writeback_in_the_simulator_reports_cleaning_and_dirty_occupancy() {
    let d = tempfile::tempdir().unwrap();
    let trace = d.path().join("oltp.sce");
    ok(&["gen", "oltp", "--seed", "3", "--out", p(&trace)]);
    let run = |mode: &str| {
        json(&[
            "sim",
            "--trace",
            p(&trace),
            "--cache-size",
            "32MiB",
            "--policy",
            "sce",
            "--mode",
            mode,
            "--interval",
            "10",
            "--json",
        ])
    };
    let (wb, wt) = (run("writeback"), run("writethrough"));
    let (b, t) = (policy(&wb, "sce"), policy(&wt, "sce"));
    let lat = |x: &serde_json::Value| x["mean_write_latency_seconds"].as_f64().unwrap();
    println!(
        "write latency: writeback {:.3} ms, writethrough {:.3} ms; written back {} of {} bytes \
         written to the source by writethrough; {} dirty at the end; {} waits",
        lat(b) * 1e3,
        lat(t) * 1e3,
        b["bytes_written_back"],
        t["source_bytes_written"],
        b["dirty_bytes_at_end"],
        b["writeback_waits"]
    );
    assert!(lat(b) < lat(t), "write-back writes are acknowledged sooner");
    let back = b["bytes_written_back"].as_u64().unwrap();
    let left = b["dirty_bytes_at_end"].as_u64().unwrap();
    assert!(back > 0, "the cleaner wrote nothing back");
    assert_eq!(b["source_bytes_written"].as_u64().unwrap(), back);
    assert!(
        t["bytes_written_back"].is_null(),
        "only write-back reports it"
    );
    let runs = b["writeback_source_writes"].as_u64().unwrap();
    assert!(
        runs > 0 && runs <= back / 4096,
        "{runs} source writes for {back} bytes"
    );
    assert_eq!(
        b["writeback_log_bytes"].as_u64().unwrap(),
        8 << 20,
        "auto: a quarter of 32 MiB"
    );
    assert!(
        b["writeback_log_read_pages"].as_u64().unwrap() > 0,
        "no read found the log"
    );
    let shares = b["interval_dirty_share"].as_array().unwrap();
    assert!(!shares.is_empty());
    assert!(shares.len() <= b["intervals"].as_array().unwrap().len());
    assert!(shares
        .iter()
        .all(|s| (0.0..=1.0).contains(&s.as_f64().unwrap())));
    assert!(left as f64 <= 32.0 * 1048576.0);
    // Several hosts over one volume in write-back need issue 16's coherence: refused.
    let err = fails(&[
        "sim",
        "--trace",
        p(&trace),
        "--cache-size",
        "32MiB",
        "--mode",
        "writeback",
        "--hosts",
        "2",
    ]);
    assert!(err.contains("issue 16"), "{err}");
    // sce serve runs write-back only on a persistent cache (dirty data must survive a
    // crash), and says so instead of starting.
    let src = d.path().join("src");
    std::fs::File::create(&src)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let cache = d.path().join("cache");
    let sock = d.path().join("s.sock");
    let err = fails(&[
        "serve",
        "--source",
        p(&src),
        "--cache",
        p(&cache),
        "--cache-size",
        "1MiB",
        "--mode",
        "writeback",
        "--no-persist",
        "--listen",
        &format!("unix:{}", sock.display()),
    ]);
    assert!(err.contains("writeback needs a persistent cache"), "{err}");
    assert!(!cache.exists(), "the refused start left a cache file");
}

/// Issue 30: a source saturated by an open replay (an OLTP mix with periodic 1 GiB read
/// scans, arriving faster than the modelled disk serves) starves background population,
/// which re-reads the source. The default (512 KiB lines, miss fills while the source is
/// busy, the page area) fills from the misses' own data instead: with 256 MiB it hits at
/// least as often as flashcache-like (which fills from its misses) while writing well under
/// as much to the cache (0.6x); population alone (`--miss-fills off --dense-line off`: no
/// fill from a miss's own data, in lines or in the page area) starves. With 1 GiB, 256 KiB
/// lines with miss fills must reach flashcache-like (lines only, the default once fell short:
/// 0.094 against 0.103, 2,048 lines of 512 KiB holding fewer of the hot set's scattered
/// pages than 262,144 blocks; with the page area the default reaches it too, 0.1097 both).
/// Ratios of modelled figures only.
#[test]
fn a_saturated_source_still_fills_the_cache_from_misses() {
    let dir = tempfile::tempdir().unwrap();
    let t = gen_trace(
        dir.path(),
        "hotscan.sce",
        "hotscan",
        &[
            "--requests",
            "200000",
            "--iops",
            "3000",
            "--seed",
            "3",
            "--size",
            "4GiB",
            "--scan-every",
            "30",
            "--scan-duration",
            "10",
            "--scan-size",
            "1GiB",
        ],
    );
    let hits = |v: &serde_json::Value| v["read_hit_ratio"].as_f64().unwrap();
    for cache in ["256MiB", "1GiB"] {
        let run = |more: &[&str]| {
            let mut a = sim_args(&t, "sce", cache, &["--json", "--replay", "open"]);
            a.extend_from_slice(more);
            json(&a)
        };
        let base = run(&["--policy", "sce,flashcache-like"]);
        let fc = policy(&base, "flashcache-like");
        assert!(
            fc["overloaded"].as_bool() == Some(true),
            "{cache}: the source must be saturated for this test to mean anything"
        );
        let default = policy(&base, "sce");
        // Starved: no fill from a miss's own data at all (the page area fills from misses
        // too, whatever `--miss-fills` says).
        let off = run(&[
            "--policy",
            "sce",
            "--miss-fills",
            "off",
            "--dense-line",
            "off",
        ]);
        let starved = policy(&off, "sce");
        let lines = run(&[
            "--policy",
            "sce",
            "--line-size",
            "256KiB",
            "--miss-fills",
            "on",
        ]);
        let fine = policy(&lines, "sce");
        let best = if cache == "256MiB" { default } else { fine };
        assert!(
            hits(best) >= hits(fc),
            "{cache}: sce {} < flashcache-like {}",
            hits(best),
            hits(fc)
        );
        assert!(hits(default) > 2.0 * hits(starved), "{cache}: fills help");
        for fed in [default, fine] {
            assert!(fed["miss_fills"].as_u64().unwrap() > 1000, "{cache}: {fed}");
            assert!(fed["population_source_busy"].as_u64().unwrap() > 0);
            let (w, wfc) = (
                fed["cache_bytes_written"].as_u64().unwrap(),
                fc["cache_bytes_written"].as_u64().unwrap(),
            );
            // Under 0.6x: the page area refills the pages writes cover and takes pages
            // into whichever of two sets has room (issue 47's second round): 1 GiB 0.57x
            // for both (0.47x and 0.52x before; 256 MiB 0.15x).
            assert!(w * 10 < wfc * 6, "{cache}: {w} bytes written against {wfc}");
        }
    }
}

/// Issue 30: `flashcache-4k` is flashcache-like that caches misaligned I/O (requests widened
/// to whole pages), the baseline a misaligned trace needs: on reads that start 512 bytes
/// before each page (a 63-sector partition offset), flashcache-like never fills a whole
/// page and so never hits, while flashcache-4k hits every re-read.
#[test]
fn flashcache_4k_caches_misaligned_reads() {
    let dir = tempfile::tempdir().unwrap();
    let mut body = String::new();
    for round in 0..4u64 {
        for b in 0..64u64 {
            let t = (round * 64 + b) * 1_000_000;
            body.push_str(&format!("{t},r,0,{},4096\n", b * 65536 + 3584));
        }
    }
    let t = write(dir.path(), "misaligned.csv", body.as_bytes());
    let v = json(&sim_args(
        &t,
        "csv",
        "16MiB",
        &["--json", "--policy", "flashcache-like,flashcache-4k"],
    ));
    let hits = |n| policy(&v, n)["read_hit_ratio"].as_f64().unwrap();
    assert!(hits("flashcache-like") < 0.01, "{v}");
    assert!(hits("flashcache-4k") > 0.7, "{v}");
}

/// With a RAM cache the JSON gives the application's latencies: an asynchronous RAM cache
/// acknowledges writes at once, a synchronous one when the flash layer has them; reads that
/// hit RAM cost nothing, so the application's mean read latency is below the flash layer's.
#[test]
fn application_latencies_follow_the_ram_policy() {
    let dir = tempfile::tempdir().unwrap();
    let t = gen_trace(
        dir.path(),
        "oltp.sce",
        "oltp",
        &[
            "--size",
            "256MiB",
            "--requests",
            "20000",
            "--read-fraction",
            "0.7",
        ],
    );
    let run = |ram_policy: &str| {
        let v = json(&sim_args(
            &t,
            "sce",
            "64MiB",
            &["--json", "--ram-size", "16MiB", "--ram-policy", ram_policy],
        ));
        policy(&v, "sce").clone()
    };
    let f = |p: &serde_json::Value, k: &str| p[k].as_f64().unwrap();
    let (sync, asy) = (run("sync"), run("async"));
    assert_eq!(f(&asy, "app_mean_write_latency_seconds"), 0.0, "{asy}");
    let w = f(&sync, "app_mean_write_latency_seconds");
    assert!(
        w > 0.0 && w >= 0.9 * f(&sync, "mean_write_latency_seconds"),
        "{sync}"
    );
    assert!(f(&asy, "app_mean_read_latency_seconds") < f(&asy, "mean_read_latency_seconds"));
}
