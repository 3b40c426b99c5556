//! The small grammars of the server's options: admission's (population rate, endurance
//! budget, miss fills, recency window, page area, on/off), `--writeback-log`, the keys of
//! `sce ctl set`, and how an error and its causes are said (`error_text`).

use anyhow::Context;
use sce_core::CoreConfig;
use sce_server::admin::retune;
use sce_server::admission::{
    parse_on_off, AdmissionOptions, DenseLine, MissFills, OnOffAuto, PopulationRate, RecencyWindow,
    WriteBudget,
};
use sce_server::error_text;
use sce_server::log_size::LogSize;

const MIB: u64 = 1 << 20;

#[test]
fn rates_and_budgets_parse() {
    assert_eq!("auto".parse(), Ok(PopulationRate::Auto));
    assert_eq!("unlimited".parse(), Ok(PopulationRate::Unlimited));
    assert_eq!("64MiB/s".parse(), Ok(PopulationRate::Fixed(64 << 20)));
    assert_eq!("64MiB".parse(), Ok(PopulationRate::Fixed(64 << 20)));
    assert_eq!("auto:32MiB".parse(), Ok(PopulationRate::AutoUpTo(32 << 20)));
    let e = "0".parse::<PopulationRate>().unwrap_err();
    assert!(
        e.contains("must be positive") && e.contains("unlimited"),
        "{e}"
    );
    let e = "auto:0".parse::<PopulationRate>().unwrap_err();
    assert!(e.contains("must be positive"), "{e}");
    let e = "fast".parse::<PopulationRate>().unwrap_err();
    assert!(
        e.contains("\"fast\"") && e.contains("auto, auto:SIZE, SIZE or unlimited"),
        "{e}"
    );
    assert_eq!(
        "200GiB".parse::<WriteBudget>().map(|b| b.per_day(0)),
        Ok(200 << 30)
    );
    assert_eq!(
        "200GiB/day".parse::<WriteBudget>().map(|b| b.per_day(0)),
        Ok(200 << 30)
    );
    assert_eq!(
        "0.5dwpd"
            .parse::<WriteBudget>()
            .map(|b| b.per_day(100 << 30)),
        Ok(50 << 30)
    );
    assert_eq!("2 DWPD".parse::<WriteBudget>(), Ok(WriteBudget::Dwpd(2.0)));
    // A tiny budget of a tiny device is still a budget, not none.
    assert_eq!(WriteBudget::Dwpd(0.001).per_day(10), 1);
    for bad in ["0dwpd", "-1dwpd", "infdwpd", "xdwpd", "0", "lots"] {
        let e = bad.parse::<WriteBudget>().unwrap_err();
        assert!(
            e.starts_with(&format!("write budget {bad:?}")),
            "{bad}: {e}"
        );
    }
}

#[test]
fn options_apply_to_the_core_as_given_and_keep_its_defaults_otherwise() {
    let mut cfg = CoreConfig::default();
    AdmissionOptions {
        population_rate: Some(PopulationRate::Unlimited),
        sequential_cutoff: Some(0),
        max_cache_writes: Some(WriteBudget::Dwpd(2.0)),
        ..Default::default()
    }
    .apply(&mut cfg, 1 << 30);
    assert_eq!(
        (
            cfg.population_rate,
            cfg.sequential_cutoff,
            cfg.max_cache_writes
        ),
        (0, 0, Some(2 << 30))
    );
    assert!(!cfg.population_adaptive);
    let d = CoreConfig::default();
    let mut cfg = CoreConfig::default();
    AdmissionOptions::default().apply(&mut cfg, 1 << 30);
    assert_eq!(cfg.population_rate, d.population_rate);
    assert_eq!(cfg.sequential_cutoff, d.sequential_cutoff);
    assert_eq!(cfg.max_cache_writes, None);
    assert_eq!(
        MissFills::of(&cfg),
        MissFills::Auto,
        "the default miss fills"
    );
    // auto:SIZE keeps adapting, with that ceiling, and a floor no higher.
    let mut cfg = CoreConfig::default();
    AdmissionOptions {
        population_rate: Some(PopulationRate::AutoUpTo(1 << 10)),
        ..Default::default()
    }
    .apply(&mut cfg, 1 << 30);
    assert_eq!(
        (cfg.population_rate, cfg.population_adaptive),
        (1 << 10, true)
    );
    assert!(cfg.population_min_rate <= 1 << 10);
    let mut cfg = CoreConfig::default();
    AdmissionOptions {
        population_rate: Some(PopulationRate::Fixed(5 * MIB)),
        admission_margin: Some(7),
        partial_fill: true,
        miss_fills: Some(MissFills::Off),
        recency_window: Some(RecencyWindow(5)),
        dense_line: Some(DenseLine(12)),
        max_cache_writes: Some(WriteBudget::Bytes(3 * MIB)),
        ..Default::default()
    }
    .apply(&mut cfg, 1 << 30);
    assert_eq!(
        (cfg.population_rate, cfg.population_adaptive),
        (5 * MIB, false)
    );
    assert_eq!((cfg.admission_margin, cfg.partial_fill), (7, true));
    assert_eq!((cfg.miss_fills, cfg.miss_fills_when_busy), (false, false));
    assert_eq!((cfg.recency_window, cfg.dense_line_percent), (5, 12));
    assert_eq!(cfg.max_cache_writes, Some(3 * MIB));
}

#[test]
fn describe_says_what_the_settings_are() {
    let mut cfg = CoreConfig::default();
    AdmissionOptions {
        population_rate: Some(PopulationRate::Fixed(64 * MIB)),
        sequential_cutoff: Some(4 * MIB),
        partial_fill: true,
        miss_fills: Some(MissFills::On),
        recency_window: Some(RecencyWindow(15)),
        dense_line: Some(DenseLine(6)),
        max_cache_writes: Some(WriteBudget::Bytes(10 << 30)),
        ..Default::default()
    }
    .apply(&mut cfg, 1 << 30);
    let d = AdmissionOptions::describe(&cfg);
    for part in [
        "population rate 64.00 MiB/s",
        "sequential cutoff 4.00 MiB",
        "partial fill on",
        "miss fills on",
        "recency window 1.5%",
        "page area lines dense at 6%",
        "cache write budget 10.00 GiB/day",
    ] {
        assert!(d.contains(part), "{part:?} in {d}");
    }
    cfg.population_rate = 0;
    cfg.recency_window = 0;
    cfg.dense_line_percent = 0;
    cfg.max_cache_writes = None;
    cfg.partial_fill = false;
    let d = AdmissionOptions::describe(&cfg);
    for part in [
        "population rate unlimited",
        "recency window off",
        "page area off",
        "budget none",
        "partial fill off",
    ] {
        assert!(d.contains(part), "{part:?} in {d}");
    }
    cfg.population_rate = 8 * MIB;
    cfg.population_adaptive = true;
    let d = AdmissionOptions::describe(&cfg);
    assert!(d.contains("auto up to 8.00 MiB/s"), "{d}");
}

#[test]
fn on_off_and_miss_fills_words() {
    for w in ["on", "true", "yes"] {
        assert_eq!(parse_on_off(w), Ok(true), "{w}");
    }
    for w in ["off", "false", "no"] {
        assert_eq!(parse_on_off(w), Ok(false), "{w}");
    }
    assert_eq!(
        parse_on_off("maybe").unwrap_err(),
        "maybe: expected on or off"
    );
    assert_eq!("auto".parse(), Ok(MissFills::Auto));
    assert_eq!("yes".parse(), Ok(MissFills::On));
    assert_eq!("off".parse(), Ok(MissFills::Off));
    assert_eq!(
        "often".parse::<MissFills>().unwrap_err(),
        "often: expected on, off or auto"
    );
    for m in [MissFills::Off, MissFills::On, MissFills::Auto] {
        let mut cfg = CoreConfig::default();
        m.apply(&mut cfg);
        assert_eq!(MissFills::of(&cfg), m);
        assert_eq!(m.to_string().parse::<MissFills>(), Ok(m));
    }
    assert_eq!(OnOffAuto::Bool(true).text(), "on");
    assert_eq!(OnOffAuto::Bool(false).text(), "off");
    assert_eq!(OnOffAuto::Word("auto".into()).text(), "auto");
}

#[test]
fn recency_windows_and_page_areas_are_percentages_in_range() {
    assert_eq!("off".parse(), Ok(RecencyWindow(0)));
    assert_eq!("0%".parse(), Ok(RecencyWindow(0)));
    assert_eq!("1%".parse(), Ok(RecencyWindow(10)));
    assert_eq!("0.5%".parse(), Ok(RecencyWindow(5)));
    assert_eq!("0.1%".parse(), Ok(RecencyWindow(1)));
    assert_eq!("50%".parse(), Ok(RecencyWindow(500)));
    let e = "0.01%".parse::<RecencyWindow>().unwrap_err();
    assert!(e.contains("smallest window is 0.1%"), "{e}");
    for bad in ["51%", "1", "-1%", "NaN%", "inf%", "x%"] {
        let e = bad.parse::<RecencyWindow>().unwrap_err();
        assert!(e.contains("from 0.1% to 50%"), "{bad}: {e}");
    }
    assert_eq!("off".parse(), Ok(DenseLine(0)));
    assert_eq!("0".parse(), Ok(DenseLine(0)));
    assert_eq!("1%".parse(), Ok(DenseLine(1)));
    assert_eq!("100%".parse(), Ok(DenseLine(100)));
    for bad in ["101%", "6", "1.5%", "x%"] {
        let e = bad.parse::<DenseLine>().unwrap_err();
        assert!(e.contains("from 1% to 100%"), "{bad}: {e}");
    }
}

#[test]
fn geometry_gives_admission_sce_default_lines_only_when_nothing_is_asked() {
    use sce_server::admission::{geometry, DEFAULT_LINE_SIZE};
    let mut c = CoreConfig {
        admission: sce_core::Admission::Sce,
        fragment_size: MIB,
        ..CoreConfig::default()
    };
    geometry(&mut c, None, None);
    assert_eq!((c.fragment_size, c.heat_bytes()), (DEFAULT_LINE_SIZE, MIB));
    let mut c = CoreConfig {
        admission: sce_core::Admission::Sce,
        ..CoreConfig::default()
    };
    geometry(&mut c, Some(4 * MIB), None);
    assert_eq!((c.fragment_size, c.heat_bytes()), (4 * MIB, 4 * MIB));
    geometry(&mut c, Some(4 * MIB), Some(MIB));
    assert_eq!((c.fragment_size, c.heat_bytes()), (MIB, 4 * MIB));
    // A fragment no larger than a default line stays whole.
    let mut c = CoreConfig {
        admission: sce_core::Admission::Sce,
        fragment_size: 256 << 10,
        ..CoreConfig::default()
    };
    geometry(&mut c, None, None);
    assert_eq!(c.fragment_size, 256 << 10);
}

#[test]
fn auto_gives_every_mode_a_sixteenth_within_bounds() {
    assert_eq!(LogSize::auto_bytes(64 << 30), 4 << 30);
    assert_eq!(LogSize::auto_bytes(100 << 30), 4 << 30);
    assert_eq!(LogSize::auto_bytes(16 << 30), 1 << 30);
    assert_eq!(LogSize::auto_bytes(1 << 30), 64 * MIB);
    assert_eq!(LogSize::auto_bytes(200 * MIB), 16 * MIB);
    assert_eq!(LogSize::auto_bytes(32 * MIB), 8 * MIB);
    assert_eq!(LogSize::auto_bytes(2 * MIB), 0);
    let auto = LogSize::Auto;
    assert_eq!(auto.bytes(16 << 30), 1 << 30);
    assert_eq!(auto.explicit(), None);
    assert_eq!(LogSize::Bytes(0).bytes(16 << 30), 0);
    assert_eq!(LogSize::Bytes(5 * MIB).explicit(), Some(5 * MIB));
    assert_eq!("auto".parse::<LogSize>(), Ok(LogSize::Auto));
    assert_eq!("8MiB".parse::<LogSize>(), Ok(LogSize::Bytes(8 * MIB)));
    assert_eq!("0".parse::<LogSize>(), Ok(LogSize::Bytes(0)));
    let e = "lots".parse::<LogSize>().unwrap_err();
    assert!(e.ends_with("(or auto)"), "{e}");
}

#[test]
fn set_keys_parse_into_retunes_and_unknown_keys_list_the_known() {
    let t = retune("mode", "writearound").unwrap();
    assert_eq!(
        t.write_mode.map(|m| m.to_string()).as_deref(),
        Some("writearound")
    );
    let t = retune("admission", "always").unwrap();
    assert_eq!(
        t.admission.map(|m| m.to_string()).as_deref(),
        Some("always")
    );
    assert_eq!(
        retune("seq-cutoff", "8MiB").unwrap().sequential_cutoff,
        Some(8 * MIB)
    );
    assert_eq!(
        retune("sequential-cutoff", "0").unwrap().sequential_cutoff,
        Some(0)
    );
    let d = CoreConfig::default();
    for (v, want) in [
        ("auto", (d.population_rate, true)),
        ("auto:4MiB", (4 * MIB, true)),
        ("16MiB", (16 * MIB, false)),
        ("unlimited", (0, false)),
    ] {
        assert_eq!(
            retune("population-rate", v).unwrap().population_rate,
            Some(want),
            "{v}"
        );
    }
    let t = retune("writeback-low-watermark", "30%").unwrap();
    assert_eq!(t.writeback_low_watermark, Some(0.3));
    let t = retune("writeback-high-watermark", "0.8").unwrap();
    assert_eq!(t.writeback_high_watermark, Some(0.8));
    assert_eq!(
        retune("writeback-rate", "2MiB").unwrap().writeback_rate,
        Some(2 * MIB)
    );
    for (k, v, says) in [
        ("mode", "sometimes", "sometimes"),
        ("seq-cutoff", "far", "seq-cutoff: "),
        ("population-rate", "0", "must be positive"),
        (
            "writeback-low-watermark",
            "lots",
            "writeback-low-watermark: ",
        ),
        ("writeback-rate", "quick", "writeback-rate: "),
    ] {
        let e = retune(k, v).unwrap_err().to_string();
        assert!(e.contains(says), "{k} {v}: {e}");
    }
    let e = retune("hot-window", "3").unwrap_err().to_string();
    assert!(
        e.starts_with("cannot set \"hot-window\" at run time"),
        "{e}"
    );
    assert!(e.contains("writeback-rate"), "{e}");
}

#[test]
fn a_cause_already_in_the_message_is_said_once() {
    let os = std::io::Error::from_raw_os_error(libc::ECONNREFUSED);
    let open = sce_io::IoError::Open {
        path: "/tmp/s.sock".into(),
        source: os,
    };
    let e = Err::<(), _>(open).context("export \"\"").unwrap_err();
    let text = error_text(&e);
    assert_eq!(text.matches("os error 111").count(), 1, "{text}");
    assert!(
        text.starts_with("export \"\": cannot open /tmp/s.sock: "),
        "{text}"
    );
    // A cause not yet said is still said.
    let e = Err::<(), _>(std::io::Error::other("disk on fire"))
        .context("loading the cache")
        .unwrap_err();
    assert_eq!(error_text(&e), "loading the cache: disk on fire");
    // Every level, in order.
    let e = Err::<(), _>(std::io::Error::other("c"))
        .context("b")
        .context("a")
        .unwrap_err();
    assert_eq!(error_text(&e), "a: b: c");
}
